"""Dev-split quality of xmcserve's bundles beside the classical XMC peers, in one table.

    python -m studies.quality [--data ../shared/data/debian-related] [--run runs/debian-unidec]
        [--peers-python .venv-peers/bin/python] [--out bench/results/quality-debian-dev.json]

Every xmcserve row is a real bundle evaluated through the service's search path (ONNX encoder,
HNSW, RAE aggregation; :func:`export.evaluate.evaluate_bundle`) with the dev filter file
applied under the peers' protocol (filter after ranking: the headline columns, what every
comparison uses) and, beside it, as a caller's ``exclude`` before aggregation
(``exclude_before``); the peers run in their own environment (:mod:`studies.peers`). Rows:

* ``pecos-xr-linear`` (+ ``-sklearn-tfidf``), ``omikuji-bonsai``, ``omikuji-parabel``;
* ``minilm-zero-shot-de``: pretrained all-MiniLM-L6-v2 + 64-d PCA head, label index;
* ``minilm-rae``: the same encoder, RAE memory (training instances + labels), λ 0.5;
* ``xmcserve-unidec-64d``: the trained UniDEC checkpoint, DE⊕CLF label index;
* ``xmcserve-unidec-de-32d`` / ``xmcserve-unidec-clf-32d``: its halves served alone;
* ``xmcserve-unidec-rae-64d``: the trained encoder as an RAE memory at the best dev λ of a sweep
  (each λ is a derived bundle: same encoder and index, new value matrix);
* ``xmcserve-unidec-rae-64d-fused``: that memory with a score fusion (:mod:`export.fuse`, lexical
  features included) fitted on the run's held-out training instances, when the run kept some out
  (``holdout``); ``…-fused-rae-features``: the same model over the memory's candidates and the RAE
  features alone (no lexical features, and so no sparse ranker, which searches their term space).

The trained checkpoint comes from ``--run`` (trained first with ``--config`` when it has none);
its ``train_seconds`` is the run's own measurement (cache building + epochs). Writes the JSON,
a markdown table and a PNG of P@1 / P@5 / PSP@5 against λ next to it.

A data set no default was tuned on is measured as a user meets it (``make bench-quality-fit``)::

    python -m studies.quality --user-route --data data/gutenberg-subjects \
        --workdir bundles/quality-gutenberg-subjects   # -> bench/results/quality-gutenberg-subjects-dev.*

Rows: every peer, and :data:`USER_ROUTE_ROWS`: ``export.build``'s defaults and ``make fit``'s
bundle with no setting changed, each with and without the default fusion (:func:`user_route_rows`).
Hours on 2 cores: ``make fit`` trains, and the one-vs-rest peer fits each label alone; the
workdir keeps every bundle, the fit's summary and the peers' rows, so a rerun only evaluates.

A peer measured after the rest (the one-vs-rest fit of Debian-Related's 35,736 labels takes hours)
joins the table already written, every other row kept as it is::

    python -m studies.quality --only-peers --peer-systems tfidf-ovr-logreg   # --workdir's peers.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import yaml

from engine.offline import load_bundle
from export.build import ExportParams, build_bundle
from export.derive import derive_rae_bundle
from export.evaluate import evaluate_bundle
from export.fit import fit as fit_bundle
from export.fuse import FuseParams, fuse_bundle
from export.fusion_fit import DEFAULT_FUSION, DEFAULT_PARAMS, size_name
from export.held_out import DEFAULT_HELD_OUT_MEMORY, add_held_out_memory_option
from xmc.checkpoint import HOLDOUT_FILE, LOG_FILE, PARAMS_FILE, ServingHead
from xmc.data import load_jsonl_split
from xmc.metrics import HEADLINE
from xmc.results import relative_paths, write_result

DEBIAN_OUT = "quality-debian-dev.json"
LAMBDAS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)


def bundle_row(path: Path, dev, train, train_seconds: float, notes: str) -> dict:
    bundle = load_bundle(path)
    result = evaluate_bundle(bundle, dev, train, k=100)
    row = {name: result["metrics"][name] for name in HEADLINE}
    return {
        **row,
        "exclude_before": {name: result["metrics_exclude_before"][name] for name in HEADLINE},
        "train_seconds": round(train_seconds, 1),
        "notes": notes,
        "bundle_id": result["bundle_id"],
        "all_metrics": result["metrics"],
        "all_metrics_exclude_before": result["metrics_exclude_before"],
        "queries_per_second": result["queries_per_second"],
        **fusion_record(bundle.manifest.fusion),
    }


def fusion_record(fusion) -> dict:
    """What a row keeps of its bundle's fusion: the model and its size, and how the size was chosen."""
    if fusion is None:
        return {}
    chosen = fusion.size_choice
    return {
        "fusion": {
            "kind": fusion.kind,
            "model_params": fusion.model_params,
            "size_choice": None
            if chosen is None
            else {"chosen": chosen.chosen, "validation": {k: v["filter_after"] for k, v in chosen.validation.items()}},
        }
    }


def ensure_bundle(out: Path, train, params: ExportParams, checkpoint: Path | None, data: Path) -> float:
    """Build ``out`` unless it exists; returns the export seconds (0 when it already existed)."""
    if (out / "manifest.json").is_file():
        return 0.0
    started = time.perf_counter()
    build_bundle(out, train.labels, train, checkpoint, params, data_name=str(data))
    return time.perf_counter() - started


def run_peers(python: Path, data: Path, workdir: Path, systems: str | None = None, run=subprocess.run) -> dict:
    """The peers' rows (``systems``, a comma list of studies.peers' names; None: all), by ``python -m
    studies.peers`` in the peers' environment; ``peers.json`` in ``workdir`` keeps the rows measured,
    and only the systems it lacks are run (``--keep``: the one-vs-rest fit alone takes an hour or
    more on 2 cores)."""
    out = workdir / "peers.json"
    chosen = ["--systems", systems] if systems else []
    run([str(python), "-m", "studies.peers", "--data", str(data), "--out", str(out), "--keep", *chosen], check=True)
    rows = json.loads(out.read_text())
    return {name: row for name, row in rows.items() if not systems or name in systems.split(",")}


def kept_peers(workdir: Path, systems: str | None) -> dict:
    """The rows ``workdir``'s ``peers.json`` holds (``systems``, a comma list; None: all), read and
    never run: a peer still being measured (the one-vs-rest fit resumes from its saved chunks) is
    not started a second time. Raises FileNotFoundError or KeyError for what it lacks."""
    path = workdir / "peers.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: run studies.peers --keep --out {path} first")
    rows = json.loads(path.read_text())
    wanted = systems.split(",") if systems else list(rows)
    lacking = [name for name in wanted if name not in rows]
    if lacking:
        raise KeyError(f"{path} has no row for {', '.join(lacking)} (still being measured?)")
    return {name: rows[name] for name in wanted}


def with_peer_rows(systems: dict, peers: dict) -> dict:
    """``systems`` with ``peers``' rows in: a row it has is replaced where it stands, a new one goes
    after the peers it has (a peer's row is the one without a bundle), before xmcserve's rows."""
    merged = {name: peers.get(name, row) for name, row in systems.items()}
    new = {name: row for name, row in peers.items() if name not in merged}
    first_bundle = next((i for i, row in enumerate(merged.values()) if "bundle_id" in row), len(merged))
    ordered = list(merged.items())
    return dict(ordered[:first_bundle] + list(new.items()) + ordered[first_bundle:])


# The rows of a data set as a user meets it (--user-route), and what each is.
USER_ROUTE_ROWS = {
    "xmcserve-pretrained-memory": "export.build's defaults: pretrained MiniLM, joint RAE memory, no training",
    "xmcserve-pretrained-fused": "the same memory + export.fuse's default, fitted on make fit's held-out instances",
    "xmcserve-fit-memory": "make fit's trained RAE memory, no fusion",
    "xmcserve-fit": "make fit's bundle, no setting changed: the trained memory + the default fusion and sparse ranker",
}


def user_route_rows(data: Path, workdir: Path, train, dev, fit=fit_bundle) -> tuple[dict, dict]:
    """A data set as a user meets it (docs/own-data.md): ``export.build``'s defaults, and what
    ``make fit`` builds with no setting changed (:func:`export.fit.fit`, its training sized to the
    data), each with and without the default score fusion, so the table says what training and
    what fusion were worth on data no default was tuned on. Returns the rows and ``make fit``'s
    summary (its plan and each stage's seconds). Bundles already in ``workdir`` are reused."""
    pretrained, bundle, run = workdir / "minilm-rae-64d", workdir / "fit", workdir / "fit-run"
    summary_file = workdir / "fit.json"

    def save(summary: dict) -> None:  # after each stage, so a later run keeps what this one timed
        summary_file.write_text(json.dumps(summary, indent=2) + "\n")

    if not summary_file.is_file():  # written last: a fit that stopped half-way is run again
        save(fit(data, bundle, run, force=True))
    summary = json.loads(summary_file.read_text())
    # built apart from the fit (0 s when it was there): either may be gone while the other is kept
    if "pretrained" not in summary["seconds"] or not (pretrained / "manifest.json").is_file():
        summary["seconds"]["pretrained"] = round(ensure_bundle(pretrained, train, ExportParams(), None, data), 1)
        save(summary)
    pretrained_fused = workdir / "minilm-rae-64d-fused"
    if not (pretrained_fused / "manifest.json").is_file():
        started = time.perf_counter()
        fuse_bundle(pretrained, run, train, pretrained_fused, FuseParams(), force=True)
        summary["seconds"]["pretrained_fusion"] = round(time.perf_counter() - started, 1)
        save(summary)
    stages = summary["seconds"]
    bundles = {
        "xmcserve-pretrained-memory": (pretrained, stages["pretrained"]),
        "xmcserve-pretrained-fused": (pretrained_fused, stages["pretrained"] + stages.get("pretrained_fusion", 0.0)),
        "xmcserve-fit-memory": (bundle.with_name(bundle.name + "-memory"), stages["train"] + stages["memory"]),
        "xmcserve-fit": (bundle, stages["train"] + stages["memory"] + stages["fusion"]),
    }
    rows = {}
    for name, (path, seconds) in bundles.items():
        rows[name] = bundle_row(path, dev, train, seconds, USER_ROUTE_ROWS[name])
        print(name, json.dumps({m: rows[name][m] for m in HEADLINE}), flush=True)
    return rows, summary


def ensure_trained(run: Path, config: Path) -> Path:
    checkpoint = run / "best"
    if not (checkpoint / "head.json").is_file():
        subprocess.run(
            [sys.executable, "-m", "training.train", "--config", str(config), "--set", f"out_dir={run}"], check=True
        )
    return checkpoint


def lambda_sweep(source: Path, workdir: Path, dev, train, lambdas) -> list[dict]:
    """Each λ is a derived bundle (same encoder and index, its own value matrix), evaluated
    through the service's search path; the dev texts are encoded once, by the shared encoder."""
    vectors, _ = load_bundle(source).encoder.encode(dev.texts)
    rows = []
    for lam in lambdas:
        out = workdir / f"{source.name}-lambda{lam:.1f}"
        if not (out / "manifest.json").is_file():
            derive_rae_bundle(source, out, train.Y, lam=lam, force=True)
        result = evaluate_bundle(load_bundle(out), dev, train, k=100, vectors=vectors)
        before = {m: result["metrics_exclude_before"][m] for m in HEADLINE}
        rows.append(
            {
                "lambda": lam,
                **{m: result["metrics"][m] for m in HEADLINE},
                "exclude_before": before,
                "bundle_id": result["bundle_id"],
            }
        )
        print(f"  λ={lam:.1f} {json.dumps(rows[-1])}", flush=True)
    return rows


def plot_sweep(sweeps: dict[str, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for ax, metric in zip(axes, ("P@1", "P@5", "PSP@5"), strict=True):
        for name, rows in sweeps.items():
            ax.plot([r["lambda"] for r in rows], [r[metric] for r in rows], marker="o", label=name)
        ax.set_xlabel("λ (weight of the training-instance memory)")
        ax.set_title(f"{metric}, Debian-Related dev (filtered)")
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def markdown_table(systems: dict[str, dict]) -> str:
    """Headline columns under the peers' protocol (filter after ranking); xmcserve rows also show
    the same four with the filter as ``exclude`` before aggregation (peers have no such mode).
    n/m: not measured under that protocol."""
    lines = [
        "| system | P@1 | P@5 | PSP@5 | R@100 | exclude before: P@1 / P@5 / PSP@5 / R@100 | train s | notes |",
        "| --- | ---: | ---: | ---: | ---: | --- | ---: | --- |",
    ]
    for name, row in systems.items():
        if "skipped" in row:  # a peer that did not fit this machine says why
            lines.append(f"| {name} | {' | '.join('—' for _ in HEADLINE)} | — | — | skipped: {row['skipped']} |")
            continue
        values = " | ".join("n/m" if row[m] is None else f"{row[m]:.2f}" for m in HEADLINE)
        before = " / ".join(f"{row['exclude_before'][m]:.2f}" for m in HEADLINE) if "exclude_before" in row else "—"
        lines.append(f"| {name} | {values} | {before} | {row['train_seconds']:.0f} | {row['notes']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--data",
        type=Path,
        default=Path("../shared/data/debian-related"),
        help="dataset directory: trn and dev splits and the dev filter file",
    )
    parser.add_argument(
        "--run",
        type=Path,
        default=Path("runs/debian-unidec"),
        help="training run whose best/ checkpoint is evaluated (trained with --config when it has none)",
    )
    parser.add_argument(
        "--config",
        type=Path,
        default=Path("training/configs/debian-unidec.yaml"),
        help="training config for --run when it has no checkpoint yet",
    )
    parser.add_argument(
        "--workdir",
        type=Path,
        default=Path("bundles/quality"),
        help="directory the evaluated bundles (and peers.json) are built in; existing ones are reused",
    )
    parser.add_argument(
        "--peers-python",
        type=Path,
        default=Path(".venv-peers/bin/python"),
        help="Python of the peers' environment, to run studies.peers with",
    )
    parser.add_argument("--skip-peers", action="store_true", help="leave out the classical peers' rows")
    parser.add_argument(
        "--peer-systems",
        default=None,
        help="comma list of studies.peers' systems to table (default: all; the one-vs-rest fit is hours on a "
        "large label set)",
    )
    parser.add_argument("--rae-tau", type=float, default=ExportParams.rae_tau, help="τ of the trained RAE memory")
    parser.add_argument("--rae-top-b", type=int, default=ExportParams.rae_top_b, help="b of the trained RAE memory")
    parser.add_argument(
        "--rae-mode", default=ExportParams.rae_mode, choices=("joint", "split"), help="RAE mode of the trained memory"
    )
    parser.add_argument("--name", default="xmcserve-unidec", help="row name prefix of the trained checkpoint")
    parser.add_argument(
        "--fusion-model",
        choices=("tree", "gbdt", "lambdarank"),
        default=DEFAULT_FUSION.model,
        help="the fused rows' model (export.fuse --model, whose default it is: studies.fusion_models' choice)",
    )
    parser.add_argument(
        "--fusion-extra-features",
        nargs="*",
        default=list(DEFAULT_FUSION.extra_groups),
        help="optional feature groups of the fused rows (export.fuse --extra-features)",
    )
    parser.add_argument(
        "--fusion-trees", type=int, help="boosting rounds of the fused rows' ensemble (export.fuse --trees)"
    )
    parser.add_argument(
        "--fusion-leaves", type=int, help="max leaves per tree of the fused rows' ensemble (export.fuse --leaves)"
    )
    parser.add_argument(
        "--fusion-rerank-depth",
        type=int,
        default=DEFAULT_FUSION.rerank_depth or 0,
        help="the fused rows' rerank depth (export.fuse --rerank-depth, whose default it is; 0: every candidate)",
    )
    add_held_out_memory_option(parser, "--fusion-held-out-memory")
    parser.add_argument(
        "--fusion-models",
        type=Path,
        help="a studies.fusion_models result whose candidates' validation figures (and the choice's dev figures) "
        "are tabled beside the rows",
    )
    parser.add_argument("--run-notes", default="", help="added to the trained rows' notes (e.g. where it trained)")
    parser.add_argument(
        "--add-run",
        action="store_true",
        help="evaluate only --run (DE⊕CLF label index and RAE rows, named --name) and add its rows and "
        "λ sweep to the results already in --out; the peers and the other rows are kept as they are",
    )
    parser.add_argument(
        "--only-pretrained",
        action="store_true",
        help="evaluate only the pretrained-MiniLM rows and their λ sweep, replacing theirs in --out",
    )
    parser.add_argument(
        "--only-peers",
        action="store_true",
        help="put the rows of --workdir's peers.json (--peer-systems; nothing is run) into the results already in "
        "--out; every other row is kept as it is",
    )
    parser.add_argument(
        "--user-route",
        action="store_true",
        help="a data set no default was tuned on, as a user meets it: the peers, export.build's defaults and "
        "make fit's bundle (export.fit in --workdir, no setting changed), each with and without the default "
        "fusion; --run, --config and the trained rows' options are not used",
    )
    parser.add_argument(
        "--ablation-base", type=Path, default=None, help="a training run the --ablation runs are compared with"
    )
    parser.add_argument(
        "--ablation",
        type=Path,
        nargs="*",
        default=[],
        help="training runs that differ from --ablation-base in one method (their last dev check is tabled)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="result JSON file; the markdown table and the λ plot are written beside it (default: "
        "bench/results/quality-debian-dev.json; with --user-route, quality-<the data folder's name>-dev.json)",
    )
    args = parser.parse_args(argv)
    if args.out is None:
        args.out = Path("bench/results") / (f"quality-{args.data.name}-dev.json" if args.user_route else DEBIAN_OUT)
    earlier: dict = {}  # the results already in --out, for the modes that add rows to them
    if args.only_peers or args.add_run or args.only_pretrained:  # each adds rows to results already written
        modes = [flag for flag in ("only_peers", "add_run", "only_pretrained", "skip_peers") if getattr(args, flag)]
        if len(modes) > 1:
            parser.error(" and ".join("--" + flag.replace("_", "-") for flag in modes) + " exclude each other")
        if not args.out.is_file():
            parser.error(f"{args.out} does not exist: there are no results to add rows to")
        earlier = json.loads(args.out.read_text())
        earlier_data = earlier.get("data")
        # a result file names its data set relative to the repository (xmc.results)
        same = earlier_data is None or earlier_data == relative_paths(str(args.data.resolve()))
        if not same and Path(earlier_data).resolve() != args.data.resolve():
            parser.error(f"{args.out} holds {earlier_data}'s results, not {args.data}'s (--data)")
    if args.only_peers:  # nothing to load or measure: the rows are read from the workdir
        try:
            peers = kept_peers(args.workdir, args.peer_systems)
        except (FileNotFoundError, KeyError) as exc:
            parser.error(str(exc).strip("'\""))
        write_results(
            args.out,
            Path(earlier.get("data", args.data)),
            earlier["filter_pairs_applied"],
            with_peer_rows(earlier["systems"], peers),
            earlier["rae_lambda_sweep"],
            earlier.get("training_ablations"),
            earlier.get("fusion_models"),
            extra={key: earlier[key] for key in ("make_fit",) if key in earlier},
        )
        return 0
    ablations = training_ablations(args.ablation_base, args.ablation) if args.ablation_base else None
    fusion_models = fusion_model_table(json.loads(args.fusion_models.read_text())) if args.fusion_models else None
    args.workdir.mkdir(parents=True, exist_ok=True)
    train = load_jsonl_split(args.data, "trn")
    dev = load_jsonl_split(args.data, "dev", labels=train.labels)
    if args.user_route:
        systems = {} if args.skip_peers else run_peers(args.peers_python, args.data, args.workdir, args.peer_systems)
        rows, summary = user_route_rows(args.data, args.workdir, train, dev)
        write_results(args.out, args.data, len(dev.filter_pairs), {**systems, **rows}, {}, extra={"make_fit": summary})
        return 0
    if args.add_run or args.only_pretrained:
        if args.add_run:
            checkpoint = ensure_trained(args.run, args.config)
            rows, sweeps = trained_rows(args, checkpoint, train, dev, halves=False, int8=False)
            sweeps = {f"{args.name} (trained)": sweeps}
        else:
            rows, sweeps = pretrained_rows(args.workdir, args.data, train, dev)
        # the rows of one checkpoint (or of the pretrained encoder) are replaced as a group
        systems = {name: row for name, row in earlier["systems"].items() if name not in rows_of_group(args)}
        sweeps = {**earlier["rae_lambda_sweep"], **sweeps}
        write_results(
            args.out,
            args.data,
            len(dev.filter_pairs),
            {**systems, **rows},
            sweeps,
            ablations or earlier.get("training_ablations"),
            fusion_models or earlier.get("fusion_models"),
        )
        return 0
    systems: dict[str, dict] = {}
    if not args.skip_peers:
        systems.update(run_peers(args.peers_python, args.data, args.workdir, args.peer_systems))
    pretrained, pretrained_sweep = pretrained_rows(args.workdir, args.data, train, dev)
    systems.update(pretrained)
    checkpoint = ensure_trained(args.run, args.config)
    trained, sweep = trained_rows(args, checkpoint, train, dev, halves=True, int8=True)
    systems.update(trained)
    write_results(
        args.out,
        args.data,
        len(dev.filter_pairs),
        systems,
        {"UniDEC (trained)": sweep, **pretrained_sweep},
        ablations,
        fusion_models,
    )
    return 0


PRETRAINED_ROWS = ("minilm-zero-shot-de", "minilm-rae")
TRAINED_SUFFIXES = (
    "-64d",
    "-de-32d",
    "-clf-32d",
    "-rae-64d",
    "-rae-64d-fused",
    "-rae-64d-fused-tree",
    "-rae-64d-fused-rae-features",
    "-rae-64d-int8",
)
# The fused rows of a run with held-out instances: (row suffix, what the note says). "-fused" is
# the given fusion (--fusion-*), "-fused-tree" NGAME's single tree over the RAE and lexical features
# and every candidate (the default before the ensembles), "-fused-rae-features" the given fusion
# without the lexical features.
FUSIONS = (
    ("-fused", "score fusion (export.fuse, ONNX TreeEnsemble)"),
    ("-fused-tree", "NGAME's single regression tree over the RAE and lexical features, every candidate"),
    (
        "-fused-rae-features",
        "the -fused model over the memory's candidates and the RAE features alone (no lexical features, so no "
        "sparse ranker)",
    ),
)


def fusion_of_row(suffix: str, args) -> tuple[str, dict, tuple[str, ...], int | None]:
    """(model, params, feature groups, rerank depth) of a fused row."""
    if suffix == "-fused-tree":
        return "tree", {}, ("rae", "lexical"), None
    unsized = args.fusion_trees is None and args.fusion_leaves is None
    if args.fusion_model == "tree" or (unsized and FuseParams(args.fusion_model).choosing):
        params = {}  # a tree has no size; export.fuse chooses one where it would (the name says among which)
    else:  # the size in full, export.fuse's default filling what was not given: it names the bundle
        default = DEFAULT_PARAMS[args.fusion_model]
        params = {"trees": args.fusion_trees or default["trees"], "leaves": args.fusion_leaves or default["leaves"]}
    lexical = ("lexical",) if suffix == "-fused" else ()
    groups = ("rae", *lexical, *args.fusion_extra_features)
    return args.fusion_model, params, groups, args.fusion_rerank_depth or None


def fused_bundle_name(
    source: Path,
    suffix: str,
    model: str,
    params: dict,
    depth: int | None,
    memory: str = DEFAULT_HELD_OUT_MEMORY,
    groups: tuple[str, ...] = ("rae", "lexical"),
) -> Path:
    """Where a fused row's bundle is built: its name says its fusion (its optional feature groups
    beyond the row's own, and what its held-out instances were searched against), so a changed one
    is rebuilt."""
    size = "".join(f"-{name}{value}" for name, value in sorted(params.items()))
    choice = FuseParams(model, params) if model != "tree" else None
    if choice is not None and choice.choosing:  # the sizes chosen among: a changed default is rebuilt too
        size += "-sizes" + "-".join(size_name(candidate) for candidate in choice.resolved_sizes)
    extra = "".join(f"-{group}" for group in groups if group not in ("rae", "lexical"))
    memory = memory.replace("_", "-")
    return source.with_name(f"{source.name}{suffix}-{model}{size}-depth{depth or 'all'}{extra}-{memory}")


def rows_of_group(args) -> set[str]:
    """The row names an ``--add-run`` (of ``--name``) or ``--only-pretrained`` evaluation writes."""
    if args.only_pretrained:
        return set(PRETRAINED_ROWS)
    return {f"{args.name}{suffix}" for suffix in TRAINED_SUFFIXES}


def pretrained_rows(workdir: Path, data: Path, train, dev) -> tuple[dict, dict]:
    """The pretrained MiniLM as a label index and as an RAE memory, and the memory's λ sweep."""
    pretrained_de = workdir / "minilm-labels-64d"
    seconds = ensure_bundle(pretrained_de, train, ExportParams(index_kind="labels"), None, data)
    rows = {
        PRETRAINED_ROWS[0]: bundle_row(
            pretrained_de, dev, train, 0.0, f"pretrained MiniLM, 64-d PCA head, label index; export {seconds:.0f} s"
        )
    }
    pretrained_rae = workdir / "minilm-rae-64d"
    seconds = ensure_bundle(pretrained_rae, train, ExportParams(), None, data)
    rows[PRETRAINED_ROWS[1]] = bundle_row(
        pretrained_rae, dev, train, 0.0, f"pretrained MiniLM, 64-d PCA head, RAE λ 0.5; export {seconds:.0f} s"
    )
    print("λ sweep, pretrained encoder", flush=True)
    return rows, {"MiniLM (pretrained)": lambda_sweep(pretrained_rae, workdir, dev, train, LAMBDAS)}


def trained_rows(args, checkpoint: Path, train, dev, halves: bool, int8: bool) -> tuple[dict, list[dict]]:
    """Rows of one trained checkpoint, named ``<args.name>-…``: DE⊕CLF label index, (its halves),
    the RAE memory at the best dev λ of a sweep, (its int8 build); and the sweep."""
    head = ServingHead.load(checkpoint)
    train_seconds = float(head.extra.get("train_seconds", 0.0))
    where = f"{args.run.name} epoch {head.extra.get('epoch')}" + (f", {args.run_notes}" if args.run_notes else "")
    label_rows = {f"{args.name}-64d": ("all", "UniDEC DE⊕CLF label index")}
    if halves:
        label_rows[f"{args.name}-de-32d"] = ("g1_de", "UniDEC DE half only")
        label_rows[f"{args.name}-clf-32d"] = ("g2_clf", "UniDEC CLF half only (N(Ψ) index)")
    systems = {}
    for name, (blocks, note) in label_rows.items():
        out = args.workdir / name
        ensure_bundle(out, train, ExportParams(index_kind="labels", head_blocks=blocks), checkpoint, args.data)
        systems[name] = bundle_row(out, dev, train, train_seconds, f"{note}; {where}")

    trained_rae = args.workdir / f"{args.name}-rae-64d-{args.rae_mode}-tau{args.rae_tau}-b{args.rae_top_b}"
    rae_params = ExportParams(rae_tau=args.rae_tau, rae_top_b=args.rae_top_b, rae_mode=args.rae_mode)
    ensure_bundle(trained_rae, train, rae_params, checkpoint, args.data)
    print(f"λ sweep, {args.name}", flush=True)
    sweep = lambda_sweep(trained_rae, args.workdir, dev, train, LAMBDAS)
    best = max(sweep, key=lambda r: (r["P@5"], r["P@1"]))
    best_bundle = args.workdir / f"{trained_rae.name}-lambda{best['lambda']:.1f}"
    systems[f"{args.name}-rae-64d"] = bundle_row(
        best_bundle,
        dev,
        train,
        train_seconds,
        f"UniDEC encoder as RAE memory ({args.rae_mode}), best dev λ {best['lambda']:.1f}, τ {args.rae_tau}, "
        f"b {args.rae_top_b}; {where}",
    )
    if (args.run / HOLDOUT_FILE).is_file():  # the run kept instances out: fuse the chosen memory
        for suffix, what in FUSIONS:
            model, params, groups, depth = fusion_of_row(suffix, args)
            memory = args.fusion_held_out_memory
            sparse = DEFAULT_FUSION.sparse_depth if suffix == "-fused" else None  # the default's candidates
            named = suffix + (f"-sparse{sparse}" if sparse else "")
            fused = fused_bundle_name(best_bundle, named, model, params, depth, memory, groups)
            if not (fused / "manifest.json").is_file():
                fuse_params = FuseParams(model, params, groups, depth, held_out_memory=memory, sparse_depth=sparse)
                fuse_bundle(best_bundle, args.run, train, fused, fuse_params, force=True)
            fusion = load_bundle(fused).manifest.fusion
            queries = fusion.queries
            what = (
                f"{what}; model {fusion.kind} {fusion.model_params}, rerank depth {fusion.rerank_depth or 'all'}, "
                f"features {fusion.features}"
            )
            systems[f"{args.name}-rae-64d{suffix}"] = bundle_row(
                fused,
                dev,
                train,
                train_seconds,
                f"as {args.name}-rae-64d + {what} fitted on the run's {queries} held-out training instances",
            )
    if int8:  # the serving-speed option: dynamic int8 weights, its quality cost measured on the same split
        out = args.workdir / f"{trained_rae.name}-int8-lambda{best['lambda']:.1f}"
        int8_params = ExportParams(
            quantize="int8",
            rae_lambda=best["lambda"],
            rae_tau=args.rae_tau,
            rae_top_b=args.rae_top_b,
            rae_mode=args.rae_mode,
        )
        ensure_bundle(out, train, int8_params, checkpoint, args.data)
        systems[f"{args.name}-rae-64d-int8"] = bundle_row(
            out, dev, train, train_seconds, f"as {args.name}-rae-64d, int8 dynamic quantization of the encoder"
        )
    return systems, sweep


ABLATION_SYSTEMS = ("de+clf", "rae")


def training_ablations(base: Path, runs: list[Path]) -> dict:
    """Each run's last dev check (the trainer's exact search, filter labels excluded before the
    RAE softmax) beside the base run's, with the parameters it changed."""
    base_params = yaml.safe_load((base / PARAMS_FILE).read_text())
    rows = []
    for run in [base, *runs]:
        params = yaml.safe_load((run / PARAMS_FILE).read_text())
        changed = {k: v for k, v in params.items() if base_params.get(k) != v and k not in ("out_dir", "cache_dir")}
        last = json.loads((run / LOG_FILE).read_text().splitlines()[-1])
        metrics = {system: {m: last["dev"][system][m] for m in HEADLINE} for system in ABLATION_SYSTEMS}
        rows.append({"run": run.name, "changes": changed or "base", "epoch": last["epoch"], **metrics})
    return {
        "protocol": "trainer's exact-search dev check, filter labels excluded before aggregation",
        "base": str(base),
        "rows": rows,
    }


def fusion_ablation(systems: dict) -> list[dict]:
    """Served RAE rows without a score fusion, with one over the RAE features alone, and with the
    lexical features too (peers' protocol)."""
    rows = []
    for name in [n for n in systems if f"{n}-fused" in systems]:
        fused = {f"with{suffix}": f"{name}{suffix}" for suffix, _ in FUSIONS if f"{name}{suffix}" in systems}
        rows.append({"without": name, **fused})
    return rows


def ablation_markdown(systems: dict, ablations: dict | None) -> str:
    lines = []
    pairs = fusion_ablation(systems)
    if pairs:
        lines += [
            "",
            "Score fusion off / the chosen model over the memory's candidates and RAE features alone / NGAME's "
            "single tree over every candidate / the chosen fusion (served bundles, filter after ranking):",
            "",
            "| bundle | P@1 | P@5 | PSP@5 | R@100 |",
            "| --- | ---: | ---: | ---: | ---: |",
        ]
        for pair in pairs:
            order = ("without", "with-fused-rae-features", "with-fused-tree", "with-fused")
            for name in (pair[key] for key in order if key in pair):
                lines.append(f"| {name} | " + " | ".join(f"{systems[name][m]:.2f}" for m in HEADLINE) + " |")
    if ablations:
        lines += [
            "",
            f"Training ablations ({ablations['protocol']}; P@1 / P@5 / PSP@5 / R@100):",
            "",
            "| run | changes | DE⊕CLF | RAE |",
            "| --- | --- | --- | --- |",
        ]
        for row in ablations["rows"]:
            cells = [" / ".join(f"{row[system][m]:.2f}" for m in HEADLINE) for system in ABLATION_SYSTEMS]
            lines.append(f"| {row['run']} | {row['changes']} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines) + ("\n" if lines else "")


# what the quality table keeps of each fusion candidate ("dev": measured after the choice, if at all)
CANDIDATE_KEYS = ("validation", "onnx_ms_per_query", "rerank_depth", "ineligible_because", "dev")


def fusion_model_table(result: dict) -> dict:
    """What the quality table keeps of a ``studies.fusion_models`` result: each candidate's
    cross-fitted validation figures and model cost, the choice, and its dev figures."""
    return {
        "source": "studies.fusion_models (validation: cross-fitted on the run's held-out training instances)",
        "held_out_instances": result["held_out_instances"],
        "held_out_memory": result.get("held_out_memory", "leave_one_out"),  # results before it was a choice
        "folds": result["folds"],
        "unfused": result.get("unfused"),
        "candidates": {name: {key: c.get(key) for key in CANDIDATE_KEYS} for name, c in result["candidates"].items()},
        "max_model_ms": result.get("max_model_ms"),
        "guard_metrics": result.get("guard_metrics"),
        "chosen": result["chosen"],
        "dev_of_choice": result.get("dev"),
    }


PROTOCOLS = ("filter_after", "exclude_before")


def fusion_model_markdown(table: dict | None) -> str:
    if not table:
        return ""
    searched = table.get("held_out_memory", "leave_one_out").replace("_", " ")

    def figures(metrics: dict | None, protocol: str) -> str:
        return " / ".join(f"{metrics[protocol][m]:.2f}" for m in HEADLINE) if metrics else ""

    lines = [
        "",
        f"Score fusion candidates, validation on {table['held_out_instances']} held-out training instances "
        f"searched {searched} ({table['folds']}-fold cross-fit; P@1 / P@5 / PSP@5 / R@100, filter after | exclude "
        f"before; model cost in ONNX Runtime, one thread; budget {table['max_model_ms'] or 'none'} ms; dev, filter "
        "after, measured after the choice and never used for it):",
        "",
        "| candidate | validation, filter after | validation, exclude before | dev, filter after | model ms/query "
        "| chosen, or why not |",
        "| --- | --- | --- | --- | ---: | --- |",
    ]
    unfused = table.get("unfused")
    if unfused:
        cells = [figures(unfused["validation"], p) for p in PROTOCOLS] + [figures(unfused.get("dev"), PROTOCOLS[0])]
        lines.append(f"| no fusion (p̂ alone) | {cells[0]} | {cells[1]} | {cells[2]} | 0 | |")
    for name, c in table["candidates"].items():
        cells = [figures(c["validation"], p) for p in PROTOCOLS] + [figures(c.get("dev"), PROTOCOLS[0])]
        mark = "**chosen**" if name == table["chosen"] else "; ".join(c["ineligible_because"] or [])
        lines.append(f"| {name} | {cells[0]} | {cells[1]} | {cells[2]} | {c['onnx_ms_per_query']:.3f} | {mark} |")
    dev = table.get("dev_of_choice")
    if dev:
        cells = [figures(dev, p) for p in PROTOCOLS]
        lines += ["", f"Dev, once, for the choice: {cells[0]} (filter after), {cells[1]} (exclude before)."]
    return "\n".join(lines) + "\n"


def write_results(
    out: Path,
    data: Path,
    filter_pairs: int,
    systems: dict,
    sweeps: dict,
    ablations: dict | None = None,
    fusion_models: dict | None = None,
    extra: dict | None = None,
) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {
        "data": str(data),
        "split": "dev",
        "k": 100,
        "filter_pairs_applied": int(filter_pairs),
        "systems": systems,
        "rae_lambda_sweep": sweeps,
        "fusion_ablation": fusion_ablation(systems),
        "fusion_models": fusion_models,
        "training_ablations": ablations,
        **(extra or {}),
    }
    write_result(out, result)
    table = markdown_table(systems) + ablation_markdown(systems, ablations) + fusion_model_markdown(fusion_models)
    out.with_suffix(".md").write_text(table)
    if sweeps:  # a user-route run sweeps nothing: the plot of the tuned data set is kept
        plot_sweep(sweeps, out.with_name("quality-rae-lambda.png"))
    print(table)


if __name__ == "__main__":
    sys.exit(main())
