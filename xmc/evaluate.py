"""Evaluate a predictor on a data split: ranking through the service's own search path, and the
metrics of :mod:`xmc.metrics`, under both filter protocols.

The predictor is passed in (:class:`engine.Predictor`, or anything with its ``view``,
``encode``, ``predict`` and ``search``), so this core imports no stage; ``python -m export.evaluate``
opens a bundle directory and calls :func:`evaluate_predictor`. The split's filter file (same-item
pairs) is applied under two protocols, both reported:

* ``filter_after`` — the XMC repository's protocol, the one the classical peers are measured
  under and the one every comparison with them uses (``metrics``): the model ranks without
  knowing the filter, then filter labels are dropped from its ranking;
* ``exclude_before`` — what a caller's ``exclude`` does (``metrics_exclude_before``): the filter
  labels are removed before the RAE softmax and before top-k, so a same-item key cannot take
  the probability mass.

For a label index the two agree; for an RAE memory they differ. The training split supplies
label frequencies for PSP@k and the head/torso/tail segments.
"""

from __future__ import annotations

import time
from typing import Any, Literal, Protocol

import numpy as np

from xmc.data import XMCDataset, label_frequencies
from xmc.metrics import HEADLINE, PROPENSITY_PRESETS, Segments, compute_all

FilterProtocol = Literal["filter_after", "exclude_before"]
PROTOCOLS: tuple[FilterProtocol, ...] = ("filter_after", "exclude_before")


class ServedLabels(Protocol):
    """The label side of a served memory (:class:`engine.MemoryView`)."""

    label_uids: list[str]
    num_labels: int

    def label_id(self, uid: str) -> int | None: ...


class Searcher(Protocol):
    """What an evaluation calls (:class:`engine.Predictor`): typed here, not imported, so
    the core stays below the service."""

    view: ServedLabels
    bundle: Any
    default_ef: int

    def encode(self, texts: list[str]) -> tuple: ...

    def predict(self, texts, k, ef, exclude, view) -> Any: ...

    def search(self, vectors, k, ef, exclude, view, texts, terms) -> Any: ...


def label_id_map(view: ServedLabels, dataset: XMCDataset) -> np.ndarray:
    """Dataset label id → served label id (−1 when the memory lacks it), matched by uid."""
    if view.label_uids[: view.num_labels] == dataset.labels.uids:
        return np.arange(dataset.num_labels)
    return np.array([-1 if (i := view.label_id(uid)) is None else i for uid in dataset.labels.uids])


def rank_split(
    predictor: Searcher,
    dataset: XMCDataset,
    k: int,
    ef: int | None,
    batch_size: int = 64,
    vectors: np.ndarray | None = None,
    protocol: FilterProtocol = "exclude_before",
    terms: list | None = None,
) -> tuple[np.ndarray, float]:
    """Ranked dataset label ids (``n x k``, −1 padded) and the wall seconds spent predicting.

    ``vectors``: the split's query vectors, already encoded by this bundle's encoder (a λ sweep
    over bundles that share one encoder encodes once); the search path is the same. ``terms``:
    their lexical term vectors from the same tokenization (:meth:`Predictor.encode`), for a
    lexical score fusion (None: computed from the texts, as a search given texts does).
    ``protocol``: how the filter file applies (see the module docstring).
    """
    view = predictor.view
    to_bundle = label_id_map(view, dataset)
    to_dataset = np.full(view.num_labels, -1, dtype=np.int64)
    to_dataset[to_bundle[to_bundle >= 0]] = np.flatnonzero(to_bundle >= 0)
    filters = dataset.filter_sets()
    ranked = np.full((len(dataset), k), -1, dtype=np.int64)
    started = time.perf_counter()
    for start in range(0, len(dataset), batch_size):
        rows = range(start, min(start + batch_size, len(dataset)))
        exclude = [{int(to_bundle[lab]) for lab in filters[r] if to_bundle[lab] >= 0} for r in rows]
        if protocol == "filter_after":  # rank blind to the filter, deep enough to drop it afterwards
            depth, exclude = k + max(len(e) for e in exclude), [set() for _ in rows]
        else:
            depth = k
        if vectors is None:
            prediction = predictor.predict([dataset.texts[r] for r in rows], depth, ef, exclude, view)
        else:
            texts = [dataset.texts[r] for r in rows]  # a lexical score fusion reads them
            batch_terms = terms[rows.start : rows.stop] if terms is not None else None
            prediction = predictor.search(vectors[rows.start : rows.stop], depth, ef, exclude, view, texts, batch_terms)
        for r, ranking in zip(rows, prediction.rankings, strict=True):
            ids = to_dataset[ranking.ids]
            if protocol == "filter_after":
                ids = np.array([i for i in ids if i not in filters[r]], dtype=np.int64)[:k]
            ranked[r, : len(ids)] = ids
    return ranked, time.perf_counter() - started


def evaluate_predictor(
    predictor: Searcher,
    dataset: XMCDataset,
    train: XMCDataset,
    k: int = 100,
    ef: int | None = None,
    propensity: str = "default",
    segments: Segments | None = None,
    vectors: np.ndarray | None = None,
) -> dict:
    """Both protocols' metrics (``metrics``: filter after ranking, the peers' protocol;
    ``metrics_exclude_before``: the caller's ``exclude``); the split is encoded once. The
    predictor's memory as it is now (appends included) is what is measured."""
    bundle = predictor.bundle
    encode_started = time.perf_counter()
    terms = None
    if vectors is None:  # as the server encodes: the vectors and the lexical terms of one tokenization
        encoded = [predictor.encode(dataset.texts[i : i + 256]) for i in range(0, len(dataset), 256)]
        vectors = np.concatenate([chunk_vectors for chunk_vectors, _, _ in encoded])
        if all(chunk_terms is not None for _, _, chunk_terms in encoded):
            terms = [t for _, _, chunk_terms in encoded for t in chunk_terms]
    encode_seconds = time.perf_counter() - encode_started
    frequencies = label_frequencies(train.Y)
    results, seconds = {}, 0.0
    for protocol in PROTOCOLS:
        ranked, search_seconds = rank_split(predictor, dataset, k, ef, vectors=vectors, protocol=protocol, terms=terms)
        seconds = search_seconds if protocol == "exclude_before" else seconds
        results[protocol] = compute_all(
            ranked,
            dataset.Y,
            frequencies,
            len(train),
            ks=(1, 3, 5),
            recall_ks=tuple(r for r in (10, 100) if r <= k),
            propensity=PROPENSITY_PRESETS[propensity],
            segments=segments,
        )
    return {
        "bundle_id": bundle.bundle_id,
        "index_kind": bundle.manifest.index_kind,
        "dim": bundle.manifest.dim,
        "ef": ef or predictor.default_ef,
        "k": k,
        "instances": len(dataset),
        "filter_pairs_applied": int(len(dataset.filter_pairs)),
        "propensity": {
            "preset": propensity,
            "A": PROPENSITY_PRESETS[propensity][0],
            "B": PROPENSITY_PRESETS[propensity][1],
        },
        "queries_per_second": round(len(dataset) / (encode_seconds + seconds), 1),
        "metrics": {name: round(value, 2) for name, value in results["filter_after"].items()},
        "metrics_exclude_before": {name: round(value, 2) for name, value in results["exclude_before"].items()},
    }


def format_table(result: dict) -> str:
    after, before = result["metrics"], result["metrics_exclude_before"]
    names = [n for n in HEADLINE if n in after] + [n for n in after if n not in HEADLINE]
    width = max(len(n) for n in names)
    lines = [
        f"bundle {result['bundle_id']} ({result['index_kind']}, {result['dim']}-d, ef {result['ef']}) "
        f"on {result['instances']} instances, {result['filter_pairs_applied']} filter pairs applied",
        f"  {'':<{width}}  filter after ranking (peers' protocol)   exclude before aggregation",
    ]
    lines += [f"  {name:<{width}}  {after[name]:6.2f}{'':33}{before[name]:6.2f}" for name in names]
    lines.append(f"  {'queries/s':<{width}}  {result['queries_per_second']:6.1f}")
    return "\n".join(lines)
