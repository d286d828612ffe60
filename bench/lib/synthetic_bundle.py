"""A labels bundle of synthetic keys with the compressed index and label arrays, for the benches
at 10^6-10^7 labels (bench.shard_replica, bench.ten_million): keys drawn from bench.ann_scale's
mixture, written by export's own writer with the encoder of a real bundle."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import numpy as np

from bench.lib.synthetic import DIM, draw
from bundle import ENCODER_FILE, TOKENIZER_FILE, Counts, HnswParams

SPREAD = 0.55  # bench.ann_scale's: a label's nearest neighbours at cosines of about 0.7–0.9


def build_synthetic_bundle(
    labels: int, out: Path, encoder_bundle: Path, seed: int, threads: int, centres: np.ndarray | None = None
) -> tuple[dict, np.ndarray, tuple]:
    """The shard's bundle at ``out``; returns its build report, the keys and the query model. The
    keys are bench.ann_scale's mixture, around ``centres`` (unit vectors) when given, random
    centres (40 labels a cluster, as its 10^6 set) otherwise."""
    from bundle import read_manifest, write_label_arrays
    from engine.offline import IvfPqIndex
    from export.export_params import ExportParams
    from export.writer import write_bundle

    rng = np.random.default_rng(seed)
    if centres is None:  # bench.ann_scale's random centres, 40 labels a cluster
        centres = rng.standard_normal((max(1, labels // 40), DIM)).astype(np.float32)
        centres /= np.linalg.norm(centres, axis=1, keepdims=True)
    weights = rng.lognormal(0.0, 1.0, len(centres))
    model = (centres, weights / weights.sum(), SPREAD)
    vectors = np.empty((labels, centres.shape[1]), dtype=np.float32)
    step = 1 << 20  # drawn a million at a time: at once, draw's float64 noise alone is 5 GB at 10^7
    for start in range(0, labels, step):
        vectors[start : start + step] = draw(*model[:2], min(step, labels - start), rng, SPREAD)
    source = read_manifest(encoder_bundle)
    params = ExportParams(index_kind="labels", index="ivfpq", labels_format="arrays", build_threads=threads)
    ivfpq = params.ivfpq(labels)
    report: dict = {}

    def populate(stage: Path) -> dict:
        for name in (ENCODER_FILE, TOKENIZER_FILE):
            shutil.copy(encoder_bundle / name, stage / name)
        started = time.perf_counter()
        uids = [f"synthetic-{i}" for i in range(labels)]
        write_label_arrays(stage, uids, [f"synthetic label {i}" for i in range(labels)])
        report["label_arrays_s"] = round(time.perf_counter() - started, 1)
        started = time.perf_counter()
        index = IvfPqIndex.build(vectors, ivfpq, 0, seed, threads)
        index.save(stage / "index.faiss", stage / "rerank.npy")
        report.update(index.build_seconds)
        report["index_s"] = round(time.perf_counter() - started, 1)
        return {
            "created_at": source.created_at,
            "source": source.source.model_copy(update={"data": f"synthetic clustered, seed {seed}"}),
            "tokenizer": source.tokenizer,
            "dim": vectors.shape[1],
            "index_kind": "labels",
            "labels_format": "arrays",
            "ann": "ivfpq",
            "ivfpq": ivfpq,
            "hnsw": HnswParams(
                space="ip", M=params.hnsw_m, ef_construction=params.ef_construction, ef_search=params.ef_search
            ),
            "counts": Counts(labels=labels, memory_rows=labels),
            "params": {"seed": seed, "build_threads": threads},
        }

    started = time.perf_counter()
    write_bundle(out, populate, force=True)
    report["seconds"] = round(time.perf_counter() - started, 1)
    return report, vectors, model
