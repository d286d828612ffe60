"""Annif as a peer: its fastText and Omikuji backends and their ensemble, on an xmcserve data set.

    .venv-annif/bin/python -m studies.annif_peer --data data/cooking-stackexchange \\
        --out-prefix bench/results/peers-cooking-stackexchange

Runs in its own environment (``make annif-venv``): Annif pins its own numpy, scikit-learn and
fastText build. What it does, in ``--workdir``:

1. the label space as an Annif TSV vocabulary (``<uri>\\tlabel``, the label's title; the uri names the
   label's id), each split as a TSV corpus (``text\\t<uri> <uri>``), a ``projects.cfg`` of the
   projects below, and a minimal NLTK ``punkt_tab`` (see :func:`write_punkt_tab`);
2. ``annif load-vocab``, ``annif train`` of each source project (``--jobs`` processes) on trn;
3. ``annif hyperopt`` of the ensemble's source weights on the dev split only (``--trials``,
   ``--metric``), the weights it finds written into ``projects.cfg``;
4. every project's suggestions for each of ``--splits`` through Annif's Python API, ``limit`` =
   ``--k`` + the largest filter list; the split's filter pairs removed, the top ``--k`` kept and
   scored with :mod:`xmc.metrics`, as ``studies.peers`` does;
5. the rows (``annif-fasttext``, ``annif-omikuji-parabel``, ``annif-omikuji-bonsai``,
   ``annif-ensemble``) added to ``<out-prefix>-<split>.json``, the rows already there kept.

Projects (analyzer ``snowball(english)``, Annif's usual English one, for all):

* ``annif-fasttext``: Annif's fastText backend with studies.peers' fastText settings as chosen on dev
  (loss ova, lr 0.5, epoch 50, wordNgrams 2, dim 100), on Annif's analyzed tokens;
* ``annif-omikuji-parabel``: Omikuji's defaults in Annif (balanced 2-means, depth 20), Annif's TF-IDF
  of 1-2-grams, min_df 2 (studies.peers' features' n-grams and cut-off);
* ``annif-omikuji-bonsai``: the same with cluster_balanced false, cluster_k 100, max_depth 3
  (Annif's documented Bonsai configuration);
* ``annif-ensemble``: Annif's ``ensemble`` backend (a weighted mean of the sources' scores), its
  weights from ``annif hyperopt`` on dev (Optuna's TPE sampler, which Annif does not seed: another
  run may find slightly different weights; the JSON keeps the ones used).

Seconds: a source's row is its ``annif train`` wall time (the process start included) plus its
suggestions for the split; the ensemble's, its sources' training, the hyperopt and its own
suggestions.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import numpy as np

from xmc.data import XMCDataset, load_jsonl_split
from xmc.metrics import drop_excluded, score_ranking
from xmc.results import write_result

URI_BASE = "http://xmcserve.invalid/label/"
VOCAB_ID = "labels"
ANALYZER = "snowball(english)"
SOURCES = {
    "annif-fasttext": {
        "backend": "fasttext",
        "params": {"dim": 100, "lr": 0.5, "epoch": 50, "wordNgrams": 2, "loss": "ova"},
        "notes": (
            "Annif fasttext backend, loss ova, lr 0.5, epoch 50, wordNgrams 2, dim 100 (studies.peers' dev choice)"
        ),
    },
    "annif-omikuji-parabel": {
        "backend": "omikuji",
        "params": {"ngram": 2, "min_df": 2},
        "notes": "Annif omikuji backend, Parabel (Annif's defaults: balanced 2-means, max_depth 20); TF-IDF 1-2-grams, "
        "min_df 2",
    },
    "annif-omikuji-bonsai": {
        "backend": "omikuji",
        "params": {"ngram": 2, "min_df": 2, "cluster_balanced": "False", "cluster_k": 100, "max_depth": 3},
        "notes": "Annif omikuji backend, Bonsai (cluster_balanced False, cluster_k 100, max_depth 3); TF-IDF "
        "1-2-grams, min_df 2",
    },
}
ENSEMBLE = "annif-ensemble"
# Annif reads suggestions in batches of this many documents
BATCH = 32


def write_punkt_tab(nltk_data: Path) -> Path:
    """A minimal NLTK ``punkt_tab`` for English under ``nltk_data``: every Annif analyzer splits a
    text into sentences first (``nltk.sent_tokenize``), whose ``PunktTokenizer`` reads these four
    files; Annif downloads them when missing, which cannot be done here. Empty files are a Punkt
    model that knows no abbreviations, collocations or sentence starters: it still splits at
    ``.?!`` followed by a space and a word, and our texts are one-line titles."""
    lang = nltk_data / "tokenizers" / "punkt_tab" / "english"
    lang.mkdir(parents=True, exist_ok=True)
    for name in ("collocations.tab", "sent_starters.txt", "abbrev_types.txt", "ortho_context.tab"):
        (lang / name).write_text("")
    return nltk_data


def label_uri(label: int) -> str:
    return f"<{URI_BASE}{label}>"


def clean(text: str) -> str:
    """A text as one TSV field: no tab, no line break."""
    return " ".join(text.split())


def write_vocab(path: Path, train: XMCDataset) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        for i, title in enumerate(train.labels.texts):
            fh.write(f"{label_uri(i)}\t{clean(title) or train.labels.uids[i]}\n")


def write_corpus(path: Path, split: XMCDataset) -> None:
    Y = split.Y.tocsr()
    with open(path, "w", encoding="utf-8") as fh:
        for i, text in enumerate(split.texts):
            uris = " ".join(label_uri(j) for j in Y.indices[Y.indptr[i] : Y.indptr[i + 1]])
            fh.write(f"{clean(text)}\t{uris}\n")


def projects_cfg(limit: int, weights: dict[str, float]) -> str:
    blocks = []
    for name, spec in SOURCES.items():
        lines = [f"[{name}]", f"name={name}", "language=en", f"backend={spec['backend']}"]
        lines += [f"analyzer={ANALYZER}", f"vocab={VOCAB_ID}", f"limit={limit}"]
        lines += [f"{key}={value}" for key, value in spec["params"].items()]
        blocks.append("\n".join(lines))
    sources = ",".join(f"{name}:{weights[name]:.4f}" for name in SOURCES)
    blocks.append(
        "\n".join(
            [f"[{ENSEMBLE}]", f"name={ENSEMBLE}", "language=en", "backend=ensemble", f"vocab={VOCAB_ID}"]
            + [f"limit={limit}", f"sources={sources}"]
        )
    )
    return "\n\n".join(blocks) + "\n"


def annif_cli(env: dict, *args: str) -> tuple[str, float]:
    """Run ``annif ARGS``; its stdout and wall seconds. A failure stops the run with Annif's output."""
    started = time.perf_counter()
    done = subprocess.run(
        [str(Path(sys.executable).with_name("annif")), *args], env=env, capture_output=True, text=True
    )
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        sys.exit(f"annif {' '.join(args)} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    return done.stdout, seconds


def parse_weights(output: str) -> dict[str, float]:
    """The ``sources=a:0.3,b:0.7`` line ``annif hyperopt`` recommends, as weights."""
    (line,) = [line for line in output.splitlines() if line.startswith("sources=")]
    pairs = (item.rsplit(":", 1) for item in line[len("sources=") :].split(","))
    return {name: float(weight) for name, weight in pairs}


def rankings(project, texts: list[str], depth: int, label_of: np.ndarray) -> list[list[int]]:
    """Each text's suggestions from an Annif project, best first, as our label ids (ties by id)."""
    from annif.corpus import Document

    out: list[list[int]] = []
    for start in range(0, len(texts), BATCH):
        batch = project.suggest([Document(text=t) for t in texts[start : start + BATCH]])
        array = batch.array.tocsr()
        for i in range(array.shape[0]):
            cols = array.indices[array.indptr[i] : array.indptr[i + 1]]
            vals = array.data[array.indptr[i] : array.indptr[i + 1]]
            labels = label_of[cols]
            order = np.lexsort((labels, -vals))
            out.append([int(j) for j in labels[order][:depth] if j >= 0])
    return out


def versions() -> dict[str, str]:
    out = {}
    for package in ("annif", "fasttext-numpy2", "fasttext-wheel", "omikuji", "nltk", "optuna", "scikit-learn"):
        try:
            out[package] = version(package)
        except PackageNotFoundError:
            continue
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, required=True, help="dataset directory (trn, dev and the scored splits)")
    parser.add_argument("--splits", default="dev,tst", help="comma list of the splits scored (the models train on trn)")
    parser.add_argument(
        "--out-prefix",
        type=Path,
        required=True,
        help="rows go to <prefix>-<split>.json, beside the rows studies.peers wrote there",
    )
    parser.add_argument("--k", type=int, default=100, help="labels kept per text (the metrics' depth)")
    parser.add_argument("--jobs", type=int, default=1, help="Annif's --jobs for training and hyperopt")
    parser.add_argument("--trials", type=int, default=100, help="annif hyperopt trials of the ensemble's weights")
    parser.add_argument("--metric", default="NDCG@5", help="annif hyperopt's metric, on dev")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/xmcserve-annif"), help="Annif's files")
    args = parser.parse_args(argv)
    splits = args.splits.split(",")

    work = args.workdir.resolve()
    work.mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        "NLTK_DATA": str(write_punkt_tab(work / "nltk_data")),
        "ANNIF_PROJECTS": str(work / "projects.cfg"),
        "ANNIF_DATADIR": str(work / "annif-data"),
    }
    os.environ.update({key: env[key] for key in ("NLTK_DATA", "ANNIF_PROJECTS", "ANNIF_DATADIR")})

    train = load_jsonl_split(args.data, "trn")
    evaluated = {name: load_jsonl_split(args.data, name, labels=train.labels) for name in {"dev", *splits}}
    depth = args.k + max((len(e) for s in evaluated.values() for e in s.filter_sets()), default=0)
    write_vocab(work / "vocab.tsv", train)
    for name, split in {"trn": train, **evaluated}.items():
        write_corpus(work / f"{name}.tsv", split)
    equal = {name: 1.0 for name in SOURCES}
    (work / "projects.cfg").write_text(projects_cfg(depth, equal))

    annif_cli(env, "load-vocab", "--force", "--language", "en", VOCAB_ID, str(work / "vocab.tsv"))
    train_seconds = {}
    for name in SOURCES:
        _, train_seconds[name] = annif_cli(env, "train", "--jobs", str(args.jobs), name, str(work / "trn.tsv"))
        print(f"annif: trained {name} in {train_seconds[name]:.1f} s", file=sys.stderr, flush=True)
    hyperopt_out, hyperopt_seconds = annif_cli(
        env,
        "hyperopt",
        "--trials",
        str(args.trials),
        "--jobs",
        str(args.jobs),
        "--metric",
        args.metric,
        "--results-file",
        str(work / "hyperopt-trials.tsv"),
        ENSEMBLE,
        str(work / "dev.tsv"),
    )
    weights = parse_weights(hyperopt_out)
    (work / "projects.cfg").write_text(projects_cfg(depth, weights))
    best = next((line for line in hyperopt_out.splitlines() if line.startswith("Got best")), "")
    print(f"annif: hyperopt {best} in {hyperopt_seconds:.1f} s: {weights}", file=sys.stderr, flush=True)

    import annif
    import annif.registry

    app = annif.create_flask_app()
    meta = {"annif_versions": versions(), "analyzer": ANALYZER}
    with app.app_context():
        projects = {name: annif.registry.get_project(name) for name in [*SOURCES, ENSEMBLE]}
        subjects = projects[ENSEMBLE].subjects
        label_of = np.full(len(subjects), -1, dtype=np.int64)
        for i in range(train.num_labels):
            label_of[subjects.by_uri(label_uri(i)[1:-1])] = i
        for project in projects.values():
            project.initialize()
        for split_name in splits:
            split = evaluated[split_name]
            exclude = split.filter_sets()
            out = Path(f"{args.out_prefix}-{split_name}.json")
            results = json.loads(out.read_text()) if out.is_file() else {}
            for name, project in projects.items():
                started = time.perf_counter()
                ranked = drop_excluded(rankings(project, split.texts, depth, label_of), exclude, args.k)
                suggest_seconds = time.perf_counter() - started
                if name == ENSEMBLE:
                    seconds = sum(train_seconds.values()) + hyperopt_seconds + suggest_seconds
                    notes = (
                        f"Annif ensemble backend over {', '.join(SOURCES)}, weights from annif hyperopt on dev "
                        f"({args.trials} trials, {args.metric}); seconds = the sources' annif train + hyperopt + "
                        f"suggest {len(split)} texts"
                    )
                    extra = {"weights": weights, "hyperopt": best, "hyperopt_seconds": round(hyperopt_seconds, 1)}
                else:
                    seconds = train_seconds[name] + suggest_seconds
                    notes = (
                        f"{SOURCES[name]['notes']}; analyzer {ANALYZER}; seconds = annif train (--jobs {args.jobs}) + "
                        f"suggest {len(split)} texts"
                    )
                    extra = {"params": SOURCES[name]["params"]}
                results[name] = {
                    **score_ranking(ranked, split, train),
                    "train_seconds": round(seconds, 1),
                    "suggest_seconds": round(suggest_seconds, 1),
                    "notes": f"{notes}; {len(split.filter_pairs)} filter pairs applied",
                    **extra,
                    **meta,
                }
                print(name, split_name, json.dumps(results[name]), file=sys.stderr, flush=True)
                write_result(out, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
