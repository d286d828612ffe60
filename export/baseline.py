"""The simple baseline a user's own data is measured against: TF-IDF of word 1–2-grams and
character 3–5-grams (within word boundaries) and one-vs-rest L2 logistic regression, C 10
(liblinear), the strongest classic peer on this project's many-shot data (studies.peers'
``tfidf-ovr-logreg``, which runs this code). ``make fit`` fits it on the training split and
reports it beside the bundle it built (:mod:`export.fit`).

Each label is fitted alone on one shared copy of the features, in ``threads`` forked processes, its
held-out scores merged into a running top ``depth`` a chunk of labels at a time; no label's
coefficients are kept (all of them, labels x features float64, would be 12 GiB for
Gutenberg-Subjects' 10,207 labels x 161,730 features), so memory stays flat at any label count.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import sys
import time
import zipfile
from pathlib import Path

import numpy as np
import scipy.sparse as sp
from sklearn.feature_extraction.text import TfidfVectorizer

from xmc.data import XMCDataset


def word_and_char_tfidf(train: XMCDataset, dev: XMCDataset) -> tuple[sp.csr_matrix, sp.csr_matrix]:
    from sklearn.pipeline import FeatureUnion

    union = FeatureUnion(
        [
            ("word", TfidfVectorizer(ngram_range=(1, 2), min_df=2, sublinear_tf=True, dtype=np.float32)),
            (
                "char",
                TfidfVectorizer(analyzer="char_wb", ngram_range=(3, 5), min_df=2, sublinear_tf=True, dtype=np.float32),
            ),
        ]
    )
    return union.fit_transform(train.texts).tocsr(), union.transform(dev.texts).tocsr()


class DoesNotFit(RuntimeError):
    """A peer whose model would not fit in this machine's memory budget."""


# L2-regularized logistic regression (bias as a feature, regularized, as scikit-learn's liblinear
# solver has it), C 10, solved in the dual by coordinate descent at liblinear's default tolerance:
# the objective scikit-learn's primal liblinear solves, 2.5x faster per label here; on 60 sampled
# Debian-Related labels its dev decision values are within 0.04 of the primal's (mean 0.004, on
# values of about -10), far below the gaps that order a text's labels
LIBLINEAR_OPTIONS = "-s 7 -c 10 -B 1 -q"
# progress is saved after every chunk: a chunk is at most this many labels, whatever the budget
MAX_CHUNK = 1024
# what every one-vs-rest worker fits its labels on, built once and inherited by fork: liblinear's
# copy of the features (hundreds of MiB for tens of thousands of texts) is never made per label
_OVR: dict = {}


def ovr_logreg(
    X, Y, Xt, depth: int, threads: int, max_gb: float = 2.0, state: Path | None = None, timing: dict | None = None
) -> list[list[int]]:
    """One-vs-rest logistic regression (see the module docstring), each label fitted alone and its
    dev scores merged into a running top ``depth`` a chunk of labels at a time (a chunk's scores fit
    in ``max_gb``). With ``state``, the running top is saved there after every chunk, and a run given
    the same file and the same problem goes on from the chunk after the last one saved (a fit of tens
    of thousands of labels takes hours on a small machine; a stopped one loses one chunk at most).
    ``timing["fit_seconds"]``, when given: the fit's seconds, those of the runs it resumed included."""
    seen = np.flatnonzero(np.asarray(Y.sum(axis=0)).ravel() > 0)  # a label never positive cannot be fitted
    X = X.tocsr().astype(np.float64)
    X.sum_duplicates()
    label_bytes = (X.shape[1] + Xt.shape[0]) * 8  # its coefficients while fitted, its scores until merged
    if label_bytes > max_gb * 2**30:
        raise DoesNotFit(f"one label's coefficients and scores, {label_bytes} B, exceed {max_gb:g} GiB")
    chunk = min(MAX_CHUNK, int(max_gb * 2**30 // label_bytes))
    problem = ovr_problem(X, Y, Xt, seen, chunk, depth)
    first, before, top_scores, top_labels = resume_ovr(state, problem, Xt.shape[0])
    started = time.perf_counter()
    with ovr_context(X, Y, Xt), ovr_workers(threads) as pool:
        for start in range(first, len(seen), chunk):
            labels = seen[start : start + chunk]
            if start > first:  # a fit of many labels takes minutes: say how far it is
                done = (start - first) / (len(seen) - first)
                left = (time.perf_counter() - started) * (1 - done) / done
                print(
                    f"tfidf-ovr-logreg: {start} of {len(seen)} labels, about {left / 60:.0f} min left",
                    file=sys.stderr,
                )
            parts = np.array_split(labels, max(1, min(threads, len(labels))))
            scores = np.hstack(list(pool.map(ovr_scores, parts)) if pool else [ovr_scores(labels)])
            # earlier labels first, and a stable sort: ties keep the order one sort of every label gives
            merged_scores = np.hstack([top_scores, scores])
            merged_labels = np.hstack([top_labels, np.broadcast_to(labels, scores.shape)])
            keep = np.argsort(-merged_scores, axis=1, kind="stable")[:, :depth]
            top_scores = np.take_along_axis(merged_scores, keep, axis=1)
            top_labels = np.take_along_axis(merged_labels, keep, axis=1)
            if state is not None:
                seconds = before + time.perf_counter() - started
                save_ovr(state, problem, start + len(labels), seconds, top_scores, top_labels)
    if timing is not None:
        timing["fit_seconds"] = before + time.perf_counter() - started
    return top_labels.tolist()


@contextlib.contextmanager
def ovr_context(X, Y, Xt):
    """Within it, what :func:`ovr_scores` reads (in this process and the workers forked in it):
    liblinear's problem over ``X`` (its targets rewritten per label), each label's positive rows,
    the dev features."""
    from liblinear.liblinear import problem

    positives = Y.tocsc()
    positives.eliminate_zeros()
    _OVR.update(problem=problem(np.zeros(X.shape[0]), X, bias=1), Y=positives, Xt=Xt.tocsr())
    try:
        yield
    finally:
        _OVR.clear()


def ovr_workers(threads: int):
    """``threads`` forked processes that share the problem (liblinear is single-threaded), or none."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    if threads <= 1:
        return contextlib.nullcontext()
    return ProcessPoolExecutor(threads, mp_context=multiprocessing.get_context("fork"))


def ovr_scores(labels: np.ndarray) -> np.ndarray:
    """The dev texts' decision values of a logistic regression fitted for each of ``labels``."""
    from liblinear.liblinear import parameter

    problem, positives, Xt = _OVR["problem"], _OVR["Y"], _OVR["Xt"]
    options = parameter(LIBLINEAR_OPTIONS)
    out = np.empty((Xt.shape[0], len(labels)))
    for j, label in enumerate(labels):
        w, b = solve_label(problem, positives, label, options)
        out[:, j] = Xt @ w + b
    return out


def solve_label(problem, positives: sp.csc_matrix, label: int, options) -> tuple[np.ndarray, float]:
    """One label's L2 logistic regression on liblinear's ``problem`` (its targets rewritten for
    ``label``, whose positive rows are ``positives``' column): the weights of the problem's
    features (as many as liblinear saw, ``nr_feature``) and the bias, oriented so that a positive
    margin means the label. The baseline here and the served ranker (:mod:`export.sparse_fit`)
    solve their labels alike."""
    import ctypes

    from liblinear.liblinearutil import train

    y = np.ctypeslib.as_array(problem.y, (problem.l,))  # liblinear's own targets, rewritten per label
    y[:] = -1.0
    y[positives.indices[positives.indptr[label] : positives.indptr[label + 1]]] = 1.0
    # liblinear's dual solver visits the texts in rand()'s order: each label from the same seed,
    # so its model never depends on which labels this process fitted before it
    ctypes.CDLL(None).srand(1)
    model = train(problem, options)
    n = model.nr_feature
    coef = np.ctypeslib.as_array(model.w, (n + 1,))  # the features' weights, then the bias feature's
    sign = 1.0 if model.get_labels()[0] == 1 else -1.0  # liblinear's first label is +
    return sign * coef[:n], sign * coef[n] * model.bias


def ovr_problem(X, Y, Xt, seen: np.ndarray, chunk: int, depth: int) -> str:
    """What a saved state must have been fitted on to be resumed: a digest of the chunking and of
    every array of the problem (features, labels and their numbering), so a state is never resumed
    on other data, even one of the same shapes."""
    digest = hashlib.sha256(np.array([*X.shape, Xt.shape[0], len(seen), chunk, depth], dtype=np.int64).tobytes())
    for array in (seen, Y.indptr, Y.indices, X.indptr, X.indices, X.data, Xt.indptr, Xt.indices, Xt.data):
        digest.update(np.ascontiguousarray(array).tobytes())
    return digest.hexdigest()


def resume_ovr(state: Path | None, problem: str, texts: int):
    """(first label index, seconds so far, top scores, top labels) of a saved state of the same
    problem; a fresh start when there is none, one of another problem, or one that cannot be read."""
    empty = (0, 0.0, np.empty((texts, 0)), np.empty((texts, 0), dtype=np.int64))
    if state is None or not state.is_file():
        return empty
    try:
        with np.load(state) as saved:
            if str(saved["problem"]) != problem:
                print(f"tfidf-ovr-logreg: {state} is another problem's: starting afresh", file=sys.stderr)
                return empty
            first = int(saved["next_label"])
            resumed = (first, float(saved["seconds"]), saved["top_scores"], saved["top_labels"])
    except (OSError, ValueError, KeyError, zipfile.BadZipFile) as exc:
        print(f"tfidf-ovr-logreg: {state} cannot be read ({exc}): starting afresh", file=sys.stderr)
        return empty
    print(f"tfidf-ovr-logreg: resuming at label {first} from {state}", file=sys.stderr)
    return resumed


def save_ovr(state: Path, problem: str, next_label: int, seconds: float, top_scores, top_labels) -> None:
    """The running top after a chunk, written whole or not at all (a kill mid-write keeps the last)."""
    state.parent.mkdir(parents=True, exist_ok=True)
    partial = state.with_name(state.name + ".partial.npz")
    np.savez(
        partial, problem=problem, next_label=next_label, seconds=seconds, top_scores=top_scores, top_labels=top_labels
    )
    os.replace(partial, state)


# Above this many labels the baseline is not fitted by make fit (each label is a pass over every
# text: Gutenberg-Subjects' 10,207 labels take about 50 minutes on 2 cores); studies.peers fits any count.
BASELINE_MAX_LABELS = 5000


def baseline_metrics(train: XMCDataset, held: XMCDataset, k: int = 100, threads: int = 1) -> dict:
    """The baseline fitted on ``train`` and scored on ``held`` under the peers' protocol (``k`` +
    the longest filter list ranked, the filter pairs removed, the top ``k`` kept: studies.peers'
    ``tfidf-ovr-logreg`` row), with its seconds."""
    from xmc.metrics import drop_excluded, score_ranking

    started = time.perf_counter()
    exclude = held.filter_sets()
    depth = k + max((len(labels) for labels in exclude), default=0)
    X, Xt = word_and_char_tfidf(train, held)
    candidates = ovr_logreg(X, train.Y, Xt, depth, threads)
    metrics = score_ranking(drop_excluded(candidates, exclude, k), held, train)
    return {**metrics, "seconds": round(time.perf_counter() - started, 1)}
