"""From a user's data to a trained, fused bundle, in one command:

    make fit DATA=data/mine BUNDLE=bundles/mine [RUN=runs/mine]
    python -m export.fit --data data/mine --bundle bundles/mine [--run runs/mine]

``--data`` is a folder in the layout of docs/own-data.md (``xmc.convert`` writes it); its ``trn``
split is learnt from, its ``dev`` split (if any) only reported on. Four stages, each the project's
own command with its defaults, so what this builds is what they build:

1. **train** (:mod:`training.train`): the CPU recipe ``debian-unidec`` (``--recipe`` for another)
   (the top transformer layer fine-tuned with the heads, the lower ones frozen and their states
   cached once) sized to the data (:func:`sized_training`): the epochs so that a run sees about
   as many instances as the recipe's six epochs over Debian-Related's, and a share of the
   training split held out for the fusion;
2. **memory** (:mod:`export.build`): the trained encoder's RAE memory of the whole split, with the
   RAE settings the recipe's sweep chose (:data:`MEMORY_ARGS`);
3. **fusion** (:mod:`export.fuse`): the default score fusion with its sparse linear ranker, fitted
   on the held-out instances (never the dev split), its ensemble size the one those instances'
   cross-fitted validation prefers (:data:`~export.fusion_fit.DEFAULT_SIZES`);
4. **untrained**: did training pay? The pretrained encoder's memory (:mod:`export.build`'s
   defaults) with the same fusion, fitted on the same held-out instances (``<bundle>-untrained``):
   of the two, the one with the better cross-fitted validation on those instances
   (:func:`shipped_bundle`) is written to ``--bundle``, and the fit says which and why.

When the data has a ``dev`` split, the fit then measures itself there, under the peers' protocol
(:func:`measure_fit`): the bundle it built beside the simple baseline, TF-IDF + one-vs-rest
logistic regression fitted on the same ``trn`` (:mod:`export.baseline`, studies.peers'
``tfidf-ovr-logreg``; skipped above :data:`~export.baseline.BASELINE_MAX_LABELS` labels, with a
word), printed as a table and written to ``<run>/fit-report.json``. Nothing is chosen on it.

Before anything runs it prints the plan and an estimate of each stage's wall time, from the rates
measured on this project's 2-core CPU (:data:`SECONDS_PER`): a bigger machine is faster. Each stage
shows its own progress bars. The run directory (default ``runs/<bundle name>``) keeps the
checkpoint, the held-out list; the memory bundles (``<bundle>-memory``, ``<bundle>-untrained-memory``) and
the untrained fused one (``<bundle>-untrained``) are written beside the bundle.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from bundle import Figures, read_manifest
from export.baseline import BASELINE_MAX_LABELS, baseline_metrics
from export.build import main as build_main
from export.card import CardFacts, record
from export.fuse import main as fuse_main
from export.fusion_fit import FuseError
from export.fusion_validation import best_validation
from export.sparse_fit import SparseFitParams
from xmc.command import program
from xmc.data import load_train_and_dev

log = logging.getLogger("xmcserve.fit")

# The CPU recipe, by its shipped name (training/configs/, package data): training resolves it
# wherever the package is installed; ``--recipe`` gives another (a name or a YAML file).
RECIPE = "debian-unidec"
# The recipe's six epochs over Debian-Related's 37,816 training instances: the instances a run sees.
INSTANCES_SEEN = 6 * 37_816
EPOCHS_RANGE = (2, 10)
# The recipe's dimensions of each head (de_dim, clf_dim: a 64-d serving vector).
HEAD_DIM = 32
# Held-out instances for the fusion: 5 % of the split, at least 2 and at most the recipe's 2,000.
HOLDOUT_SHARE, HOLDOUT_RANGE = 0.05, (2, 2000)
# The RAE memory of the trained encoder (the Makefile's TRAINED_MEMORY_ARGS; training.sweep's choice).
MEMORY_ARGS = ("--rae-mode", "split", "--rae-tau", "0.04", "--rae-top-b", "200", "--rae-lambda", "0.2")
# Wall seconds per text on this project's 2-core CPU (2026-11-27, Debian-Related): caching the
# frozen layers' states (instances + labels), one training epoch (per training instance), encoding
# the memory (instances + labels), and fusing (per instance: held-out search, sparse fit, ONNX).
SECONDS_PER = {"cache": 0.0052, "epoch": 0.0091, "memory": 0.0089, "fusion": 0.004}
# And what each stage costs whatever the data's size (loading the encoder, exporting and
# quantizing the ONNX graph and checking its parity, fitting the fusion's model).
SECONDS_FIXED = {"cache": 30.0, "train": 60.0, "memory": 90.0, "fusion": 15.0}
# A one-vs-rest sparse ranker (label sets up to SparseFitParams.one_vs_rest_max_labels), per (text,
# label) pair of one liblinear fit over terms ⊕ dense vector plus one over terms only (the two the
# fusion chooses between), each fitted twice (the served ranker, and without the held-out
# instances): 50 s + 17 s a fit on Cooking-StackExchange's 8.2 million pairs (2026-12-02).
SECONDS_PER_RANKER_PAIR = 2 * (6.4e-6 + 2.2e-6)


@dataclass
class FitPlan:
    """What :func:`fit` runs: the training overrides and each stage's estimated seconds."""

    instances: int
    labels: int
    epochs: int
    holdout: int
    overrides: list[str]
    estimate: dict[str, float] = field(default_factory=dict)
    head_dim: int = 32  # each trained head's dimensions; the untrained memory is 2x as wide

    def describe(self) -> str:
        total = sum(self.estimate.values())

        def minutes(seconds: float) -> str:
            return f"~{seconds / 60:.0f} min" if seconds >= 60 else f"~{seconds:.0f} s"

        stages = ", ".join(f"{name} {minutes(seconds)}" for name, seconds in self.estimate.items())
        return (
            f"{self.instances} training instances, {self.labels} labels: {self.epochs} epochs, "
            f"{self.holdout} instances held out for the fusion. Estimated wall time on a 2-core CPU: "
            f"{minutes(total)} ({stages})"
        )


def sized_training(instances: int, labels: int) -> tuple[int, int, int]:
    """(epochs, held-out instances, each head's dimensions) for a training split of ``instances``
    texts and ``labels`` labels. The heads start from a PCA of the texts' vectors, which needs more
    vectors than dimensions: a tiny data set gets narrower heads than the recipe's 32 + 32."""
    epochs = min(max(round(INSTANCES_SEEN / max(instances, 1)), EPOCHS_RANGE[0]), EPOCHS_RANGE[1])
    holdout = min(max(math.ceil(HOLDOUT_SHARE * instances), HOLDOUT_RANGE[0]), HOLDOUT_RANGE[1])
    if holdout >= instances:
        raise FuseError(f"{instances} training instances: too few to hold {holdout} out for the fusion")
    vectors = instances - holdout + labels
    head_dim = min(HEAD_DIM, 2 ** max(int(math.log2(max(vectors // 2, 1))), 1))
    return epochs, holdout, head_dim


def plan_fit(data: Path, run: Path, has_dev: bool, extra: list[str]) -> FitPlan:
    """The training run's overrides for ``data`` (its ``trn`` split), and the estimates."""
    train, _ = load_train_and_dev(data, "trn", "")
    n, labels = len(train), train.num_labels
    epochs, holdout, head_dim = sized_training(n, labels)
    overrides = [
        f"data_dir={data}",
        f"dev_split={'dev' if has_dev else ''}",
        f"out_dir={run}",
        f"cache_dir={run / 'cache'}",
        f"epochs={epochs}",
        f"holdout={holdout}",
        f"batch_size={min(512, max(8, (n - holdout) // 4))}",
        *([f"de_dim={head_dim}", f"clf_dim={head_dim}"] if head_dim < HEAD_DIM else []),
        *extra,
    ]
    texts = n + labels
    estimate = {
        "cache": SECONDS_PER["cache"] * texts,
        "train": SECONDS_PER["epoch"] * (n - holdout) * epochs,
        "memory": SECONDS_PER["memory"] * texts,
        "fusion": SECONDS_PER["fusion"] * n,
    }
    if SparseFitParams().kind(labels) == "one_vs_rest":
        estimate["fusion"] += SECONDS_PER_RANKER_PAIR * (n + labels) * labels
    estimate = {stage: seconds + SECONDS_FIXED[stage] for stage, seconds in estimate.items()}
    # the untrained rival: the pretrained encoder's memory and the same fusion
    estimate["untrained"] = estimate["memory"] + estimate["fusion"]
    return FitPlan(n, labels, epochs, holdout, overrides, estimate, head_dim)


def fit(
    data: Path,
    bundle: Path,
    run: Path,
    force: bool = False,
    train_set: list[str] | None = None,
    recipe: str = RECIPE,
) -> dict:
    """Train on ``data`` with ``recipe`` (a shipped recipe's name or a YAML file), build the
    trained memory and fuse it into ``bundle`` (see the module docstring); returns each stage's
    seconds. Raises :class:`FuseError` (or the stage's own error) when a stage is refused."""
    if bundle.exists() and not force:
        raise FileExistsError(f"{bundle} exists (--force replaces it)")
    if ("/" in recipe or recipe.endswith((".yaml", ".yml"))) and not Path(recipe).is_file():
        raise FileNotFoundError(f"recipe {recipe}: no such file")  # before any stage runs
    has_dev = (data / "dev.json.gz").exists()
    plan = plan_fit(data, run, has_dev, list(train_set or []))
    log.info("plan: %s", plan.describe())
    print(plan.describe(), file=sys.stderr, flush=True)
    seconds: dict[str, float] = {}
    memory = bundle.with_name(bundle.name + "-memory")

    def stage(name: str, command, argv: list[str]) -> None:
        started = time.perf_counter()
        log.info("%s: %s", name, " ".join(argv))
        status = command(argv)
        if status not in (None, 0):
            raise RuntimeError(f"stage {name} exited {status}")
        seconds[name] = round(time.perf_counter() - started, 1)

    def train(argv: list[str]) -> int:
        # its own process: export/ does not import training/ (data flows training -> export), and
        # the run's threads, CUDA and logging are its own
        return subprocess.run([sys.executable, "-m", "training.train", *argv], check=False).returncode

    stage("train", train, ["--config", recipe, *sum((["--set", o] for o in plan.overrides), [])])
    build = ["--data", str(data), "--checkpoint", str(run / "best"), "--out", str(memory)]
    stage("memory", build_main, [*build, "--index-kind", "rae_memory", *MEMORY_ARGS, *(["--force"] * force)])
    fuse = ["--bundle", str(memory), "--run", str(run), "--data", str(data), "--out", str(bundle)]
    stage("fusion", fuse_main, [*fuse, *(["--force"] * force)])
    # did training pay? the pretrained encoder's memory with the same fusion, fitted on the same
    # held-out instances: the better cross-fitted validation there is what is shipped (never dev)
    untrained_memory = bundle.with_name(bundle.name + "-untrained-memory")
    untrained = bundle.with_name(bundle.name + "-untrained")
    build_untrained = ["--data", str(data), "--out", str(untrained_memory), "--index-kind", "rae_memory"]
    build_untrained += ["--dim", str(2 * plan.head_dim), *(["--force"] * force)]
    fuse_untrained_memory = ["--bundle", str(untrained_memory), "--run", str(run), "--data", str(data)]
    fuse_untrained = [*fuse_untrained_memory, "--out", str(untrained), *(["--force"] * force)]

    def untrained_stage(argv: list[str]) -> int:
        status = build_main(build_untrained)
        return status if status not in (None, 0) else fuse_main(fuse_untrained)

    stage("untrained", untrained_stage, build_untrained)
    shipped = shipped_bundle(bundle, untrained)
    if shipped.untrained_wins:
        log.info("training did not pay: %s", shipped.reason)
        # the untrained fusion, written where the bundle goes (the trained one it replaces stays
        # reported, and its memory and run are kept)
        stage("ship untrained", fuse_main, [*fuse_untrained_memory, "--out", str(bundle), "--force"])
    print(shipped.reason, file=sys.stderr, flush=True)
    summary = {
        "bundle": str(bundle),
        "run": str(run),
        "plan": plan.describe(),
        "seconds": seconds,
        "shipped": "untrained" if shipped.untrained_wins else "trained",
        "validation": {"trained": shipped.trained, "untrained": shipped.untrained},
    }
    if has_dev:
        started = time.perf_counter()
        report = measure_fit(data, bundle, untrained=untrained)
        report["shipped"] = shipped.reason
        seconds["report"] = round(time.perf_counter() - started, 1)
        (run / REPORT_FILE).write_text(json.dumps(report, indent=2) + "\n")
        print(report_table(report), file=sys.stderr, flush=True)
        summary["report"] = str(run / REPORT_FILE)
    figures = card_figures(report, bundle.name, untrained.name) if has_dev else []
    notes = [
        shipped.reason,
        *(report["notes"] if has_dev else ["no dev split: nothing measured beyond the held-out validation"]),
    ]
    record(bundle, CardFacts(recipe=recipe, seconds=seconds, figures=figures, notes=notes))
    return summary


@dataclass
class Shipped:
    """Which of the trained and the untrained fused bundles is shipped, and why: each one's best
    cross-fitted validation on the held-out instances (mean of P@1 and P@5; None: too few held
    out to validate, and the trained one is kept)."""

    trained: float | None
    untrained: float | None

    @property
    def untrained_wins(self) -> bool:
        return self.trained is not None and self.untrained is not None and self.untrained > self.trained

    @property
    def reason(self) -> str:
        if self.trained is None or self.untrained is None:
            return "too few held-out instances to validate the trained bundle against the untrained one: trained kept"
        verdict = "the untrained one is shipped" if self.untrained_wins else "the trained one is shipped"
        return (
            f"held-out validation (mean of P@1 and P@5): trained {self.trained:.2f}, "
            f"untrained (the pretrained encoder's memory, the same fusion) {self.untrained:.2f}: {verdict}"
        )


def fused_validation(bundle: Path) -> float | None:
    """A fused bundle's best cross-fitted validation on its held-out instances (its manifest's
    size choice; None when none was validated)."""
    fusion = read_manifest(bundle).fusion
    choice = fusion.size_choice if fusion is not None else None
    score = best_validation(choice.validation) if choice is not None else None
    return round(score, 2) if score is not None else None


def shipped_bundle(trained: Path, untrained: Path) -> Shipped:
    return Shipped(fused_validation(trained), fused_validation(untrained))


REPORT_FILE = "fit-report.json"
REPORTED = ("P@1", "P@3", "P@5", "PSP@1", "PSP@5", "R@10", "R@100")


def measure_fit(data: Path, bundle: Path, threads: int | None = None, untrained: Path | None = None) -> dict:
    """The built ``bundle`` (and the ``untrained`` rival, when given) and the simple baseline
    (fitted on ``trn``) on ``data``'s dev split, under the peers' protocol:
    ``{"split", "rows": {name: metrics}, "notes"}``."""
    from engine.offline import load_bundle
    from export.evaluate import evaluate_bundle

    train, dev = load_train_and_dev(data, "trn", "dev")
    rows: dict[str, dict] = {}
    exclude_before: dict[str, dict] = {}  # the built bundles under the other protocol
    notes = []
    if train.num_labels <= BASELINE_MAX_LABELS:
        rows["tfidf-ovr-logreg"] = baseline_metrics(train, dev, threads=threads or os.cpu_count() or 1)
    else:
        labels = train.num_labels
        notes.append(f"the baseline is not fitted above {BASELINE_MAX_LABELS} labels ({labels}): studies.peers fits it")
    for built in (bundle, untrained) if untrained is not None else (bundle,):
        started = time.perf_counter()
        result = evaluate_bundle(load_bundle(built), dev, train)
        rows[built.name] = {**result["metrics"], "seconds": round(time.perf_counter() - started, 1)}
        exclude_before[built.name] = result["metrics_exclude_before"]
    if "tfidf-ovr-logreg" in rows:
        base, built = rows["tfidf-ovr-logreg"], rows[bundle.name]
        gain = {name: round(built[name] - base[name], 2) for name in REPORTED if name in built and name in base}
        rows[f"{bundle.name} - baseline"] = gain
    return {"split": "dev", "instances": len(dev), "rows": rows, "exclude_before": exclude_before, "notes": notes}


def card_figures(report: dict, bundle: str, untrained: str | None = None) -> list[Figures]:
    """The report's rows as the bundle card's figures: this bundle, the untrained rival and the
    baseline under the peers' protocol, and the built ones excluding before too."""
    names = {
        bundle: "this bundle",
        **({untrained: "untrained rival (pretrained encoder, same fusion)"} if untrained else {}),
    }

    def figures(metrics: dict) -> dict[str, float]:
        return {name: float(metrics[name]) for name in REPORTED if name in metrics}

    rows = [
        Figures(system=names.get(name, name), split=report["split"], protocol="peers", metrics=figures(metrics))
        for name, metrics in report["rows"].items()
        if not name.endswith(" - baseline")
    ]
    rows += [
        Figures(
            system=names.get(name, name), split=report["split"], protocol="exclude-before", metrics=figures(metrics)
        )
        for name, metrics in report.get("exclude_before", {}).items()
    ]
    return rows


def report_table(report: dict) -> str:
    """The report as the fit prints it: one row a system, the peers' protocol's columns."""
    rows = report["rows"]
    width = max(len(name) for name in rows)
    lines = [f"{report['split']} split, {report['instances']} instances (peers' protocol: filter after ranking)"]
    lines.append(f"  {'':<{width}}  " + "  ".join(f"{name:>6}" for name in REPORTED))
    for name, metrics in rows.items():
        cells = "  ".join(f"{metrics[m]:6.2f}" if m in metrics else f"{'':>6}" for m in REPORTED)
        lines.append(f"  {name:<{width}}  {cells}")
    lines += [f"  {note}" for note in report["notes"]]
    lines += [f"  {report['shipped']}"] if "shipped" in report else []
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog=program("export.fit"), description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--data", type=Path, required=True, help="dataset folder (docs/own-data.md layout)")
    parser.add_argument("--bundle", type=Path, required=True, help="the fused bundle to write")
    parser.add_argument("--run", type=Path, default=None, help="training run directory (default runs/<bundle name>)")
    parser.add_argument(
        "--set",
        dest="train_set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a training parameter",
    )
    parser.add_argument(
        "--recipe",
        default=RECIPE,
        help=f"the training recipe: a shipped one's name or a YAML file of training parameters (default {RECIPE})",
    )
    parser.add_argument("--force", action="store_true", help="replace an existing bundle")
    parser.add_argument("--plan", action="store_true", help="print the plan and the estimate, run nothing")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    run = args.run or Path("runs") / args.bundle.name
    try:
        if args.plan:
            has_dev = (args.data / "dev.json.gz").exists()
            print(plan_fit(args.data, run, has_dev, args.train_set).describe())
            return
        summary = fit(args.data, args.bundle, run, args.force, args.train_set, args.recipe)
    except (FuseError, FileExistsError, FileNotFoundError, RuntimeError, ValueError) as exc:
        raise SystemExit(f"export.fit: {exc}") from None
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
