"""Exact (brute-force) search over a bundle's own key vectors, through the same aggregation:
the reference the HNSW answers are measured against."""

from __future__ import annotations

import numpy as np

from engine import Predictor, Ranking
from engine.offline import Bundle, Neighbours, rank_batch


def bundle_keys(bundle: Bundle) -> np.ndarray:
    return bundle.index.vectors(np.arange(bundle.index.count))


def exact_rankings(bundle: Bundle, vectors: np.ndarray, k: int, keys: np.ndarray | None = None) -> list[Ranking]:
    """The exact top-k labels per query with their scores, best first: every key's similarity,
    the top keys (RAE: the top-b, then the same aggregation as served). Keys of equal
    similarity are taken in id order, as the served merge takes them: a quicksort's order would
    swap duplicate keys (an instance whose text is a label's) across the top-b cut."""
    keys = bundle_keys(bundle) if keys is None else keys
    sims = vectors @ keys.T
    rae = bundle.manifest.rae
    width = min(rae.top_b if rae else k, sims.shape[1])
    key_ids = np.broadcast_to(np.arange(sims.shape[1]), sims.shape)
    top = np.lexsort((key_ids, -sims), axis=-1)[:, :width]
    top_sims = np.take_along_axis(sims, top, axis=1)
    if rae is None:
        return [Ranking(ids, scores) for ids, scores in zip(top, top_sims, strict=True)]
    view = Predictor(bundle).view  # the bundle as built: its keys' labels and value rows
    found = Neighbours(top, top_sims, view.labels_of_keys(top), view.values, None, ef=0)
    return rank_batch(bundle.manifest, found, [k] * len(vectors), [()] * len(vectors))


def exact_top_k(bundle: Bundle, vectors: np.ndarray, k: int, keys: np.ndarray | None = None) -> list[set[int]]:
    """Label ids of the exact top-k per query (RAE: exact top-b keys, then the same aggregation)."""
    return [set(ranking.ids.tolist()) for ranking in exact_rankings(bundle, vectors, k, keys)]


def recall_at_k(truth: list[set[int]], served: list[list[int]]) -> float:
    return float(np.mean([len(t & set(s)) / max(len(t), 1) for t, s in zip(truth, served, strict=True)]))


# A label score computed by two paths over the same keys differs by float summation order
# (~1e-7 here); two labels whose scores come from the same keys tie exactly.
LABEL_SCORE_ROUNDING = 1e-6


def recall_with_label_ties(exact: list[Ranking], served: list, k: int) -> float:
    """Recall@k of ``served`` (label ids per query, best first) against ``exact`` (rankings
    of more than ``k`` labels, from :func:`exact_rankings`) that counts a served label as found
    when its exact score reaches the exact k-th score: labels tied at the cut (the same keys
    behind them, or the same aggregated weight) are each a correct k-th answer, and which one a
    path returns is an accident of its summation order and tie-break, which moves with the
    CPU's kernels."""
    recalls = []
    for truth, answer in zip(exact, served, strict=True):
        scores = dict(zip(truth.ids.tolist(), truth.scores.tolist(), strict=True))
        cut = truth.scores[: min(k, len(truth.scores))]
        if not len(cut):
            recalls.append(1.0)
            continue
        kth = float(cut[-1]) - LABEL_SCORE_ROUNDING - 1e-5 * abs(float(cut[-1]))
        found = sum(scores.get(label, -np.inf) >= kth for label in list(answer)[:k])
        recalls.append(min(found, len(cut)) / len(cut))
    return float(np.mean(recalls))


def ann_recall(bundle: Bundle, texts: list[str], k: int = 10, ef: int | None = None) -> float:
    """Recall@k of the served search path (HNSW at ``ef``) against exact search, same vectors."""
    vectors, _ = bundle.encoder.encode(texts)
    served = Predictor(bundle).search(vectors, k, ef).rankings
    return recall_at_k(exact_top_k(bundle, vectors, k), [r.ids.tolist() for r in served])


def key_recall_at_10(predictor: Predictor, vectors: np.ndarray, ef: int | None = None) -> float:
    """Share of the exact 10 nearest keys (over every key of the predictor's current memory,
    appended ones included) that its index search at breadth ``ef`` returns."""
    keys = predictor.bundle.index.vectors(np.arange(predictor.view.num_keys))
    found, _, _ = predictor.knn(vectors, 10, ef)
    hits = 0
    for start in range(0, len(vectors), 512):  # a block of exact similarities at a time
        exact = np.argpartition(-(vectors[start : start + 512] @ keys.T), 10, axis=1)[:, :10]
        hits += sum(len(set(e) & set(f)) for e, f in zip(exact, found[start : start + 512], strict=True))
    return round(hits / (10 * len(vectors)), 4)


# |exact similarity computed twice| of the same key differs by summation order (BLAS against einsum)
SIMILARITY_ROUNDING = 1e-5


def recall_with_ties(found: np.ndarray, queries: np.ndarray, keys, kth_sims: np.ndarray) -> float:
    """Recall@k that counts a returned key as correct when its exact similarity reaches the
    k-th exact similarity of its query (``kth_sims``): keys with identical vectors (an instance
    whose text is a label's) tie, and exact search itself returns either. ``found``: nq x k key
    ids (−1: none, a miss); ``keys``: the vectors exact search ran over (indexable by id)."""
    valid = found >= 0
    vectors = np.asarray(keys[np.where(valid, found, 0).ravel()], dtype=np.float32).reshape(*found.shape, -1)
    sims = np.einsum("qkd,qd->qk", vectors, queries)
    return float(np.mean(valid & (sims >= kth_sims[:, None] - SIMILARITY_ROUNDING)))


def breadth_settings(text: str) -> list[tuple[int, int]]:
    """``--settings`` of a compressed-index sweep: comma-separated ``nprobe:ef`` pairs (cells
    scanned, candidates re-ranked), cheap to costly."""
    return [(int(nprobe), int(ef)) for nprobe, ef in (pair.split(":") for pair in text.split(","))]


def first_reaching(recalls: dict, target: float):
    """The first key of ``recalls`` (setting → recall@10, in sweep order) whose recall reaches
    ``target``; the best one when none does."""
    return next((key for key, recall in recalls.items() if recall >= target), max(recalls, key=recalls.get))
