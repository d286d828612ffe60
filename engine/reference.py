"""The references a served answer is measured against: exact (brute-force) search over a bundle's
own key vectors through the same aggregation (recall@k of the index), and the same text ranked
alone (batch invariance: the answer does not depend on the requests it was batched with). The
tests check small bundles with these; the benchmarks and studies the bundles users serve."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.bundle import Bundle
from engine.search import Neighbours, Predictor, Ranking, rank_batch


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


# Two rankings of the same text agree when they hold the same labels in the same order and no
# score moved by more than this.
BATCH_TOLERANCE = 1e-6


@dataclass
class Invariance:
    """What :func:`batch_invariance` compared and found."""

    compared: int = 0
    other_labels: int = 0
    max_abs_score_diff: float = 0.0
    first_difference: str | None = None

    @property
    def holds(self) -> bool:
        return self.other_labels == 0 and self.max_abs_score_diff <= BATCH_TOLERANCE


def batch_invariance(predictor: Predictor, texts: list[str], batches: int, seed: int = 0, k: int = 10) -> Invariance:
    """Every text of ``texts`` ranked alone, then inside ``batches`` random batches of 1 to 64
    texts of mixed lengths (some made longer, so that padding varies), compared label by label."""
    rng = np.random.default_rng(seed)
    pool = texts + [f"{text} {text} {text}" for text in texts[: len(texts) // 4]]  # longer neighbours
    alone = {}
    for text in pool:
        ranking = predictor.predict([text], k).rankings[0]
        alone[text] = (ranking.ids.tolist(), ranking.scores)
    found = Invariance()
    for _ in range(batches):
        size = int(rng.integers(1, min(64, len(pool)) + 1))
        batch = [pool[i] for i in rng.choice(len(pool), size, replace=False)]
        for text, ranking in zip(batch, predictor.predict(batch, k).rankings, strict=True):
            ids, scores = alone[text]
            found.compared += 1
            if ranking.ids.tolist() != ids:
                found.other_labels += 1
                found.first_difference = (
                    found.first_difference or f"{text!r}: other labels inside a batch of {len(batch)}"
                )
                continue
            worst = float(np.abs(ranking.scores - scores).max(initial=0.0))
            if worst > BATCH_TOLERANCE and found.first_difference is None:
                found.first_difference = f"{text!r}: scores moved by {worst:.2e} inside a batch of {len(batch)}"
            found.max_abs_score_diff = max(found.max_abs_score_diff, worst)
    return found
