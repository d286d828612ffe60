"""The classical XMC peers on the same split, filter file and metrics as xmcserve.

    .venv-peers/bin/python -m studies.peers --data ../shared/data/debian-related --out peers.json

Runs in its own environment (``make peers-venv``): libpecos pins numpy < 2 and scipy < 1.14,
which the serving/training environment does not. Systems:

* ``pecos-xr-linear``: PECOS XR-Linear (PIFA label embeddings, hierarchical k-means with 16
  splits, beam 50) on PECOS's own TF-IDF vectorizer of 1–2-grams (the issue's reference setup);
* ``pecos-xr-linear-sklearn-tfidf``: the same model on the scikit-learn features below, which
  suit these short package titles much better (about +9 P@1);
* ``omikuji-bonsai``: Omikuji with unbalanced clustering, cluster_k 100, depth 3 (Bonsai);
* ``omikuji-parabel``: Omikuji's defaults (balanced 2-means trees, Parabel);
* ``tfidf-ovr-logreg``: scikit-learn TF-IDF of word 1–2-grams and character 3–5-grams (within word
  boundaries), one-vs-rest L2 logistic regression, C 10 (liblinear, dual coordinate descent): the
  simplest classic baseline, :mod:`export.baseline` (the code ``make fit`` measures a user's bundle
  against), in ``--threads`` forked processes, memory flat at any label count;
* ``fasttext-supervised``: fastText's supervised classifier on the raw texts (lower-cased, punctuation
  split off as the fastText tutorial does), the setup its docs give for multi-label tags: one-vs-all
  loss (``ova``, independent sigmoids instead of a softmax), word bigrams, dim 100. epoch and lr are
  chosen on the dev split only (:data:`FASTTEXT_GRID`, by the mean of P@1, P@3 and P@5), also when
  another split is evaluated; the grid's dev scores (a point whose fit diverges, fastText's
  "Encountered NaN", is recorded as failed) and the choice are in the row. With ``--threads 1`` and
  its fixed seed a fit is deterministic.

The others use scikit-learn TF-IDF of word 1–2-grams (min_df 2, sublinear tf) fitted on the
training texts. Each model ranks ``k`` + (the largest filter list) labels, the split's filter pairs are
removed, the top ``k`` kept, and the metrics come from :mod:`xmc.metrics`, as for xmcserve.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import scipy.sparse as sp
from sklearn.feature_extraction.text import TfidfVectorizer

from export.baseline import DoesNotFit, ovr_logreg, word_and_char_tfidf
from xmc.data import XMCDataset, load_jsonl_split
from xmc.metrics import drop_excluded, score_ranking
from xmc.results import write_result


def sklearn_tfidf(train: XMCDataset, dev: XMCDataset) -> tuple[sp.csr_matrix, sp.csr_matrix]:
    vectorizer = TfidfVectorizer(ngram_range=(1, 2), min_df=2, sublinear_tf=True, dtype=np.float32)
    return vectorizer.fit_transform(train.texts).tocsr(), vectorizer.transform(dev.texts).tocsr()


def pecos_tfidf(train: XMCDataset, dev: XMCDataset) -> tuple[sp.csr_matrix, sp.csr_matrix]:
    from pecos.utils.featurization.text.vectorizers import Vectorizer

    vectorizer = Vectorizer.train(train.texts, {"type": "tfidf", "kwargs": {"ngram_range": [1, 2]}})
    return (
        vectorizer.predict(train.texts).tocsr().astype(np.float32),
        vectorizer.predict(dev.texts).tocsr().astype(np.float32),
    )


def pecos_xr_linear(X, Y, Xt, depth: int, threads: int) -> list[list[int]]:
    from pecos.xmc import Indexer, LabelEmbeddingFactory
    from pecos.xmc.xlinear.model import XLinearModel

    label_features = LabelEmbeddingFactory.create(Y, X, method="pifa")
    chain = Indexer.gen(label_features, indexer_type="hierarchicalkmeans", nr_splits=16, threads=threads)
    model = XLinearModel.train(X, Y, C=chain, threads=threads)
    scores = model.predict(Xt, beam_size=50, only_topk=depth, threads=threads).tocsr()
    return [_row_ranking(scores, i) for i in range(scores.shape[0])]


def _row_ranking(scores: sp.csr_matrix, i: int) -> list[int]:
    start, end = scores.indptr[i], scores.indptr[i + 1]
    order = np.argsort(-scores.data[start:end], kind="stable")
    return scores.indices[start:end][order].tolist()


def write_omikuji_data(X: sp.csr_matrix, Y: sp.csr_matrix, path: Path) -> None:
    """Omikuji's text format; rows with no feature left after ``min_df`` are skipped (its reader
    refuses them, and a linear model learns nothing from them)."""
    rows = np.flatnonzero(np.diff(X.indptr) > 0)
    with open(path, "w") as fh:
        fh.write(f"{len(rows)} {X.shape[1]} {Y.shape[1]}\n")
        for i in rows:
            labels = ",".join(str(j) for j in Y.indices[Y.indptr[i] : Y.indptr[i + 1]])
            cols, vals = X.indices[X.indptr[i] : X.indptr[i + 1]], X.data[X.indptr[i] : X.indptr[i + 1]]
            fh.write(labels + " " + " ".join(f"{c}:{v:.6f}" for c, v in zip(cols, vals, strict=True)) + "\n")


def omikuji_model(X, Y, Xt, depth: int, threads: int, bonsai: bool) -> list[list[int]]:
    import omikuji

    hyper = omikuji.Model.default_hyper_param()
    if bonsai:
        hyper.cluster_balanced = False
        hyper.cluster_k = 100
        hyper.max_depth = 3
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "train.txt"
        write_omikuji_data(X, Y, path)
        model = omikuji.Model.train_on_data(str(path), hyper, threads)
    out = []
    for i in range(Xt.shape[0]):
        start, end = Xt.indptr[i], Xt.indptr[i + 1]
        pairs = list(zip(Xt.indices[start:end].tolist(), Xt.data[start:end].tolist(), strict=True))
        out.append([label for label, _ in model.predict(pairs, beam_size=10, top_k=depth)])
    return out


# fastText's grid, searched on the dev split; the other settings are fixed (FASTTEXT_FIXED). lr 1.0, the
# tutorial's softmax rate, diverges under ova on Cooking-StackExchange; 0.25 is there to see that 0.5 is not too high
FASTTEXT_GRID = {"epoch": [25, 50], "lr": [0.25, 0.5, 1.0]}
FASTTEXT_FIXED = {"wordNgrams": 2, "dim": 100, "loss": "ova", "seed": 1}
# the fastText tutorial's normalization: these characters become tokens of their own, then lower case
_FASTTEXT_PUNCT = re.compile(r"([.!?,'/()])")


def fasttext_text(text: str) -> str:
    return " ".join(_FASTTEXT_PUNCT.sub(r" \1 ", text).lower().split())


def fasttext_texts(train: XMCDataset, dev: XMCDataset) -> tuple[list[str], list[str]]:
    return [fasttext_text(t) for t in train.texts], [fasttext_text(t) for t in dev.texts]


def fasttext_fit(texts: list[str], Y: sp.csr_matrix, threads: int, **params):
    """A fastText supervised model of ``texts`` with labels ``__label__<id>``; texts without a label
    are left out (fastText reads a line without one as a text of no class)."""
    import fasttext

    Y = Y.tocsr()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "train.txt"
        with open(path, "w", encoding="utf-8") as fh:
            for i, text in enumerate(texts):
                labels = Y.indices[Y.indptr[i] : Y.indptr[i + 1]]
                if len(labels) and text:
                    fh.write(" ".join(f"__label__{j}" for j in labels) + " " + text + "\n")
        return fasttext.train_supervised(input=str(path), thread=threads, verbose=0, **params)


def fasttext_rank(model, texts: list[str], depth: int) -> list[list[int]]:
    labels, _ = model.predict(texts, k=depth, threshold=0.0)
    return [[int(label[len("__label__") :]) for label in row] for row in labels]


def fasttext_supervised(
    X, Y, Xt, depth: int, threads: int, tuning: tuple | None = None, info: dict | None = None
) -> list[list[int]]:
    """Fit every point of :data:`FASTTEXT_GRID` on trn, score each on ``tuning`` (trn and the dev
    split, as :func:`measure` hands them) and rank ``Xt`` with the best. ``info`` gets the grid, its
    dev scores, the choice and the fastText version."""
    import itertools
    from importlib.metadata import PackageNotFoundError, version

    if tuning is None:
        raise ValueError("fasttext-supervised chooses epoch and lr on the dev split: pass tuning=(trn, dev)")
    train, dev = tuning
    dev_texts = [fasttext_text(t) for t in dev.texts]
    exclude = dev.filter_sets()
    grid, best, best_model = [], None, None
    for epoch, lr in itertools.product(FASTTEXT_GRID["epoch"], FASTTEXT_GRID["lr"]):
        started = time.perf_counter()
        try:
            model = fasttext_fit(X, Y, threads, epoch=epoch, lr=lr, **FASTTEXT_FIXED)
        except RuntimeError as exc:  # "Encountered NaN": this lr diverges; the point is recorded, not chosen
            point = {"epoch": epoch, "lr": lr, "fit_seconds": round(time.perf_counter() - started, 1)}
            grid.append({**point, "failed": str(exc)})
            print(f"fasttext-supervised: {json.dumps(grid[-1])}", file=sys.stderr, flush=True)
            continue
        fit_seconds = time.perf_counter() - started
        ranked = drop_excluded(fasttext_rank(model, dev_texts, depth), exclude, depth)
        scores = score_ranking(ranked, dev, train)
        point = {
            "epoch": epoch,
            "lr": lr,
            "fit_seconds": round(fit_seconds, 1),
            **{f"dev_{m}": scores[m] for m in ("P@1", "P@3", "P@5")},
        }
        point["dev_mean_P@1,3,5"] = round((scores["P@1"] + scores["P@3"] + scores["P@5"]) / 3, 4)
        grid.append(point)
        print(f"fasttext-supervised: {json.dumps(point)}", file=sys.stderr, flush=True)
        if best is None or point["dev_mean_P@1,3,5"] > best["dev_mean_P@1,3,5"]:  # ties: the earlier point
            best, best_model = point, model
        del model
    if best_model is None:
        raise RuntimeError(f"fasttext-supervised: no point of the grid trained: {grid}")
    for package in ("fasttext-wheel", "fasttext"):
        with contextlib.suppress(PackageNotFoundError):
            fasttext_version = f"{package} {version(package)}"
            break
    else:
        fasttext_version = "unknown"
    if info is not None:
        info.update(
            fasttext=fasttext_version,
            fixed=FASTTEXT_FIXED,
            grid_searched=FASTTEXT_GRID,
            grid_on_dev=grid,
            chosen={"epoch": best["epoch"], "lr": best["lr"], "by": "dev mean of P@1, P@3, P@5"},
        )
    return fasttext_rank(best_model, Xt, depth)


# name -> (featurizer, model, featurization note)
SYSTEMS = {
    "pecos-xr-linear": (pecos_tfidf, pecos_xr_linear, "PECOS Tfidf vectorizer, 1-2-grams"),
    "pecos-xr-linear-sklearn-tfidf": (sklearn_tfidf, pecos_xr_linear, "sklearn TF-IDF 1-2-grams, min_df 2, sublinear"),
    "omikuji-bonsai": (
        sklearn_tfidf,
        lambda X, Y, Xt, depth, threads: omikuji_model(X, Y, Xt, depth, threads, bonsai=True),
        "sklearn TF-IDF 1-2-grams, min_df 2, sublinear",
    ),
    "omikuji-parabel": (
        sklearn_tfidf,
        lambda X, Y, Xt, depth, threads: omikuji_model(X, Y, Xt, depth, threads, bonsai=False),
        "sklearn TF-IDF 1-2-grams, min_df 2, sublinear",
    ),
    "tfidf-ovr-logreg": (
        word_and_char_tfidf,
        ovr_logreg,
        "sklearn TF-IDF word 1-2 + char_wb 3-5-grams, min_df 2, sublinear; liblinear L2 LR C 10 (dual)",
    ),
    "fasttext-supervised": (
        fasttext_texts,
        fasttext_supervised,
        "fastText supervised on lower-cased texts with punctuation split off; loss ova, wordNgrams 2, dim 100, "
        "epoch and lr chosen on dev",
    ),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--data",
        type=Path,
        default=Path("../shared/data/debian-related"),
        help="dataset directory: the trn split, the evaluated split and its filter file",
    )
    parser.add_argument("--split", default="dev", help="split to evaluate on (the models train on trn)")
    parser.add_argument(
        "--systems", default=",".join(SYSTEMS), help="comma list of the systems above to run (default: all)"
    )
    parser.add_argument(
        "--k",
        type=int,
        default=100,
        help="labels kept per text after the filter pairs are removed (the metrics' depth)",
    )
    parser.add_argument(
        "--threads", type=int, default=os.cpu_count() or 1, help="training and prediction threads (default: all cores)"
    )
    parser.add_argument("--out", type=Path, required=True, help="result JSON file")
    parser.add_argument(
        "--ovr-max-gb",
        type=float,
        default=2.0,
        help="tfidf-ovr-logreg's scores held at once (a chunk of labels, at most 1,024)",
    )
    parser.add_argument(
        "--keep",
        action="store_true",
        help="keep the rows --out already has and run only the systems it lacks (the one-vs-rest fit alone is "
        "an hour or more on 2 cores); each row is written as soon as it is measured, and the one-vs-rest fit "
        "saves its progress after every chunk beside --out, so a stopped run goes on where it stopped",
    )
    args = parser.parse_args(argv)
    wanted = args.systems.split(",")
    unknown = [name for name in wanted if name not in SYSTEMS]
    if unknown:  # before --out is touched: a typo must not cost the rows it holds
        parser.error(f"unknown --systems {unknown}; known: {', '.join(SYSTEMS)}")
    results = json.loads(args.out.read_text()) if args.keep and args.out.is_file() else {}
    # a skipped row is tried again: it is refused before any fit, and the budget may have grown
    lacking = [name for name in wanted if name not in results or "skipped" in results[name]]
    measure(args, lacking, results)
    return 0


def measure(args: argparse.Namespace, systems: list[str], results: dict) -> None:
    """Run ``systems`` on ``args.data``'s split into ``results``, writing ``args.out`` (every row
    in :data:`SYSTEMS`' order) after each, so a stopped run keeps what it measured."""
    if not systems:
        return
    train = load_jsonl_split(args.data, "trn")
    dev = load_jsonl_split(args.data, args.split, labels=train.labels)
    exclude = dev.filter_sets()
    depth = args.k + max((len(e) for e in exclude), default=0)
    Y = (train.Y > 0).astype(np.float32).tocsr()

    def write() -> None:
        ordered = {name: results[name] for name in SYSTEMS if name in results}
        write_result(args.out, {**ordered, **results})

    for name in systems:
        started = time.perf_counter()
        featurize, train_and_predict, features = SYSTEMS[name]
        X, Xt = featurize(train, dev)
        featurized = time.perf_counter() - started
        ovr = train_and_predict is ovr_logreg
        state = ovr_state(args.out, args.split) if ovr and args.keep else None
        timing: dict = {}
        info: dict = {}
        try:
            extra = {"max_gb": args.ovr_max_gb, "state": state, "timing": timing} if ovr else {}
            if train_and_predict is fasttext_supervised:  # chooses its settings on dev, whatever split is scored
                tuning = dev if args.split == "dev" else load_jsonl_split(args.data, "dev", labels=train.labels)
                extra = {"tuning": (train, tuning), "info": info}
            candidates = train_and_predict(X, Y, Xt, depth, args.threads, **extra)
        except DoesNotFit as exc:
            results[name] = {"skipped": str(exc), "notes": features}
            print(name, json.dumps(results[name]), file=sys.stderr, flush=True)
            write()
            continue
        # a resumed fit counts the seconds of the runs before it
        seconds = featurized + timing["fit_seconds"] if ovr else time.perf_counter() - started
        ranked = drop_excluded(candidates, exclude, args.k)
        results[name] = {
            **score_ranking(ranked, dev, train),
            "train_seconds": round(seconds, 1),
            "notes": f"{features}; seconds = featurize + fit + predict {len(dev)} texts on {args.threads} "
            f"threads; {len(dev.filter_pairs)} filter pairs applied",
            **info,
        }
        print(name, json.dumps(results[name]), file=sys.stderr, flush=True)
        write()
        if state is not None:
            state.unlink(missing_ok=True)  # the row holds what it was kept for


def ovr_state(out: Path, split: str) -> Path:
    """Where ``--keep`` saves the one-vs-rest fit's progress: beside the result file."""
    return out.with_name(f"{out.stem}.tfidf-ovr-logreg-{split}.npz")


if __name__ == "__main__":
    sys.exit(main())
