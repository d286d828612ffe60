"""Checkpoint dir → serving bundle dir.

    python -m export.build --data data/debian-sample --out bundles/default \\
        [--checkpoint DIR] [--index-kind rae_memory|labels] [--dim 64]

Steps: encode the memory texts (mean-pooled Φ, through a fused ONNX graph checked against
torch), fit a PCA head when the checkpoint has none, export the serving graph to ONNX and
check its parity with torch (the export fails otherwise), build the key index (hnswlib, or IVF-PQ) over the keys,
write labels, the RAE value matrix and a manifest with sha256 of every file. The bundle is
written to a temporary sibling directory and renamed into place, so a reader never sees a
half-written bundle.

Modules: export.export_params (these options), export.onnx_export (graphs, fusion, int8, parity),
export.writer (staging, checksums, bundle id, rename), export.derive (bundles derived from
another without re-encoding, e.g. an RAE memory with another λ).
"""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import scipy.sparse as sp
import torch
from tokenizers import Tokenizer

from bundle import (
    ENCODER_FILE,
    LABELS_FILE,
    TOKENIZER_FILE,
    VALUES_FILE,
    Counts,
    IvfPqParams,
    Manifest,
    Shard,
    SourceInfo,
    TokenizerInfo,
    check_unique_uids,
    shard_file_names,
    utc_now,
    write_label_arrays,
)
from engine.offline import HnswIndex, IvfPqIndex
from export.export_params import ExportParams, add_arguments, from_arguments
from export.onnx_export import export_serving_graph, random_texts
from export.pooled_vectors import EncodeReport, encode_pooled
from export.serving_graph import ServingEncoder, load_encoder, load_fast_tokenizer
from export.writer import refuse_existing, write_bundle, write_values
from xmc.checkpoint import (
    Checkpoint,
    ServingHead,
    default_encoder_dir,
    fit_pca_head,
    load_checkpoint,
    uses_sentence_normalize,
)
from xmc.command import program
from xmc.data import LabelSpace, XMCDataset, load_jsonl_split

log = logging.getLogger("xmcserve.export")

# The parity check of the served graph also runs on this many label texts: real inputs beside the random ones.
PARITY_LABEL_TEXTS = 16


@dataclass
class Prepared:
    """What a bundle is written from: the loaded checkpoint, its serving head and the index keys."""

    checkpoint: Checkpoint
    tokenizer: Tokenizer
    encoder: torch.nn.Module
    head: ServingHead
    keys: np.ndarray  # float32 [memory instances + labels, dim]: instance keys first, then label keys
    memory: XMCDataset | None  # the RAE memory's instances; None for a labels index
    encoding: EncodeReport


def build_bundle(
    out: Path,
    labels: LabelSpace,
    train: XMCDataset | None,
    checkpoint: Path | None = None,
    params: ExportParams | None = None,
    data_name: str | None = None,
    force: bool = False,
) -> Manifest:
    """Build a bundle at ``out`` and return its manifest.

    Args:
        out: bundle directory to create (must not exist unless ``force``).
        labels: the label space (uids + texts).
        train: training split, the RAE memory (required for ``rae_memory``).
        checkpoint: checkpoint dir; default: pretrained all-MiniLM-L6-v2 from its package.
        params: :class:`ExportParams`.
        data_name: recorded in the manifest's source.
        force: replace an existing bundle at ``out``.
    """
    params = params or ExportParams()
    if params.index_kind == "rae_memory" and (train is None or len(train) == 0):
        raise ValueError("a rae_memory bundle needs training instances")
    refuse_existing(out, force)  # now, not after minutes of encoding
    check_unique_uids(labels.uids)  # likewise (a duplicate uid would be refused at load)
    started = time.perf_counter()
    prepared = prepare(labels, train, checkpoint, params)

    def populate(stage: Path) -> dict:
        graph, (shards, ivfpq) = write_payload(stage, prepared, labels, params)
        seconds = time.perf_counter() - started
        fields = manifest_fields(prepared, labels, params, graph, checkpoint, data_name, seconds)
        return fields | {"shards": shards, "ann": params.index, "ivfpq": ivfpq, "labels_format": params.labels_format}

    manifest = write_bundle(out, populate, force)
    log.info("bundle %s written to %s in %.1fs", manifest.bundle_id, out, time.perf_counter() - started)
    return manifest


def prepare(labels: LabelSpace, train: XMCDataset | None, checkpoint: Path | None, params: ExportParams) -> Prepared:
    """Load the checkpoint, encode the memory and labels, and make the serving head and index keys."""
    torch.manual_seed(params.seed)
    ckpt = load_checkpoint(checkpoint or default_encoder_dir())
    tokenizer = load_fast_tokenizer(ckpt.encoder_dir, params.max_length)
    encoder = load_encoder(ckpt.encoder_dir)
    memory = memory_instances(train, params)
    memory_texts = memory.texts if memory is not None else []
    pooled, encoding = encode_pooled(encoder, tokenizer, memory_texts + labels.texts, params)
    head = ckpt.head or fit_pca_head(pooled, params.dim, uses_sentence_normalize(ckpt.encoder_dir))
    if params.head_block_names() is not None:
        head = head.select(params.head_block_names())
    pooled_memory, pooled_labels = pooled[: len(memory_texts)], pooled[len(memory_texts) :]
    keys = head.label_vectors(pooled_labels, labels.uids)
    if unseen := head.unseen_labels(labels.uids):
        log.warning(
            "%d labels the checkpoint never saw get zero-shot vectors from their text, e.g. %s",
            len(unseen),
            ", ".join(unseen[:10]),
        )
    if memory_texts:
        keys = np.concatenate([head.query_vectors(pooled_memory), keys])
    return Prepared(ckpt, tokenizer, encoder, head, keys.astype(np.float32), memory, encoding)


def memory_instances(train: XMCDataset | None, params: ExportParams) -> XMCDataset | None:
    """The training instances that become RAE memory keys (the first ``max_train``, 0 = all)."""
    if params.index_kind != "rae_memory":
        return None
    return train.subset(np.arange(min(params.max_train, len(train)))) if params.max_train else train


def write_payload(
    stage: Path, prepared: Prepared, labels: LabelSpace, params: ExportParams
) -> tuple[dict, tuple[list | None, IvfPqParams | None]]:
    """Every bundle file but the manifest, into ``stage``; returns the serving graph's report,
    the shard list and the compressed index's parameters (:func:`write_index`)."""
    tokenizer = prepared.tokenizer
    parity_texts = random_texts(tokenizer, params.parity_texts, params.seed) + labels.texts[:PARITY_LABEL_TEXTS]
    graph = export_serving_graph(
        ServingEncoder(prepared.encoder, prepared.head).eval(),
        tokenizer,
        prepared.encoder.config,
        stage / ENCODER_FILE,
        parity_texts,
        tolerance=params.parity_tolerance,
        fuse=params.optimize,
        quantize=params.quantize,
        int8_min_cosine=params.int8_min_cosine,
        calibration_texts=calibration_texts(prepared, labels, params),
    )
    (stage / TOKENIZER_FILE).write_text(tokenizer.to_str())
    # The head inside encoder.onnx, as numpy: lets torch tools (the naive benchmark baseline, a
    # re-export) rebuild the same vectors. The service does not read it.
    prepared.head.save(stage)
    write_label_files(stage, labels, params.labels_format)
    memory_Y = prepared.memory.Y if prepared.memory is not None else None
    return graph, write_index(stage, prepared.keys, memory_Y, params)


def calibration_texts(prepared: Prepared, labels: LabelSpace, params: ExportParams) -> list[str] | None:
    """A seeded sample of the memory and label texts for ``int8-static`` scales (None otherwise):
    the texts a query resembles, never an evaluation split."""
    if params.quantize != "int8-static":
        return None
    texts = (prepared.memory.texts if prepared.memory is not None else []) + labels.texts
    rows = np.random.default_rng(params.seed).choice(len(texts), min(params.calibration_texts, len(texts)), False)
    return [texts[i] for i in sorted(rows)]


def write_index(
    stage: Path, keys: np.ndarray, memory_Y: sp.csr_matrix | None, params: ExportParams
) -> tuple[list[Shard] | None, IvfPqParams | None]:
    """``index.hnsw`` (+ ``values.npz`` for an RAE memory, whose label matrix is ``memory_Y``),
    or with ``params.shards`` > 1 one ``index-<i>.hnsw`` (+ ``values-<i>.npz``) per contiguous
    range of key ids; for ``params.index`` ivfpq, ``index.faiss`` and ``rerank.npy`` (or one of
    each per shard) instead of the HNSW file. Returns the manifest's shard list (None:
    unsharded) and the compressed index's parameters (None: hnswlib)."""
    if params.shards > len(keys):
        raise ValueError(f"{params.shards} shards for {len(keys)} keys")
    # one cell count for every shard: the manifest records one (a shard's keys, the largest's)
    ivfpq = params.ivfpq(-(-len(keys) // params.shards)) if params.index == "ivfpq" else None
    shards = []
    for i, ids in enumerate(np.array_split(np.arange(len(keys)), params.shards)):
        first = int(ids[0])
        index_name, rerank_name = shard_file_names(params.index, params.shards, i)
        write_shard_index(stage, keys[first : first + len(ids)], first, params, ivfpq, index_name, rerank_name)
        values = (f"values-{i}.npz" if params.shards > 1 else VALUES_FILE) if memory_Y is not None else None
        shards.append(Shard(index=index_name, values=values, rerank=rerank_name, first_key=first, keys=len(ids)))
    if memory_Y is not None:
        write_values(stage, memory_Y, params.rae_lambda, shards if params.shards > 1 else None)
    return (shards if params.shards > 1 else None), ivfpq


def manifest_fields(
    prepared: Prepared,
    labels: LabelSpace,
    params: ExportParams,
    graph: dict,
    checkpoint: Path | None,
    data_name: str | None,
    seconds: float,
) -> dict:
    """The manifest of a built bundle, less the id and checksums that :mod:`export.writer` adds."""
    ckpt, head, config = prepared.checkpoint, prepared.head, prepared.encoder.config
    memory_size = len(prepared.memory) if prepared.memory is not None else 0
    return {
        "created_at": utc_now(),
        "source": SourceInfo(
            encoder=ckpt.name,
            architecture=config.model_type,
            head=head.kind,
            training_run=str(checkpoint) if ckpt.head is not None else None,
            git_sha=git_sha(),
            data=data_name,
        ),
        "tokenizer": TokenizerInfo(
            max_length=params.max_length, lowercase=tokenizer_lowercases(prepared.tokenizer.to_str())
        ),
        "dim": head.dim,
        "index_kind": params.index_kind,
        "hnsw": params.hnsw(),
        "rae": params.rae() if prepared.memory is not None else None,
        "counts": Counts(labels=len(labels), memory_rows=len(prepared.keys), train_instances=memory_size),
        "params": {
            **asdict(params),
            **graph,
            **prepared.encoding.as_dict(),
            "zero_shot_labels": len(head.unseen_labels(labels.uids)),
            "build_seconds": round(seconds, 1),
        },
    }


def write_shard_index(
    stage: Path,
    keys: np.ndarray,
    first_id: int,
    params: ExportParams,
    ivfpq: IvfPqParams | None,
    index_name: str,
    rerank_name: str | None,
) -> None:
    """One shard's index over ``keys`` (ids from ``first_id``), built and saved by its kind's class
    in the engine: the compressed index and its re-rank vectors when ``ivfpq`` is given, else an
    HNSW file."""
    if ivfpq is not None:
        index = IvfPqIndex.build(keys, ivfpq, first_id, params.seed, params.build_threads)
        index.save(stage / index_name, stage / rerank_name)
    else:
        build_hnsw(keys, params, stage / index_name, first_id=first_id)


def build_hnsw(keys: np.ndarray, params: ExportParams, path: Path, first_id: int = 0) -> None:
    """An HNSW file over ``keys``, whose labels are ``first_id``, ``first_id + 1``, …"""
    HnswIndex.build(keys, params.hnsw(), first_id, params.seed, params.build_threads or -1).save(path)


def write_label_files(stage: Path, labels: LabelSpace, labels_format: str) -> None:
    """The bundle's labels: ``labels.jsonl``, or the memory-mapped label arrays (bundle/labels.py).
    Their uids must be distinct (:class:`DuplicateUids` otherwise): a uid names one label."""
    check_unique_uids(labels.uids)
    if labels_format == "arrays":
        write_label_arrays(stage, labels.uids, labels.texts)
    else:
        write_labels(labels, stage / LABELS_FILE)


def write_labels(labels: LabelSpace, path: Path) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        for uid, text in zip(labels.uids, labels.texts, strict=True):
            fh.write(json.dumps({"uid": uid, "text": text}, ensure_ascii=False) + "\n")


def tokenizer_lowercases(tokenizer_json: str) -> bool:
    """Whether the tokenizer's normalizer (or one nested in a sequence of them) lowercases."""
    stack = [json.loads(tokenizer_json).get("normalizer") or {}]
    while stack:
        node = stack.pop()
        if node.get("lowercase") or node.get("type") == "Lowercase":
            return True
        stack.extend(node.get("normalizers", []))
    return False


def git_sha() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5, check=False)
    except OSError:
        return None
    return out.stdout.strip() or None


def build_parser() -> argparse.ArgumentParser:
    """The CLI: where the data and bundle are, plus one option per :class:`ExportParams` attribute."""
    parser = argparse.ArgumentParser(
        prog=program("export.build"), description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--data", type=Path, required=True, help="dataset dir with lbl.json.gz and trn.json.gz")
    parser.add_argument("--out", type=Path, required=True, help="bundle dir to create")
    parser.add_argument(
        "--checkpoint", type=Path, default=None, help="checkpoint dir (default: pretrained all-MiniLM-L6-v2)"
    )
    parser.add_argument("--split", default="trn", help="split used as RAE memory (default: trn)")
    parser.add_argument("--force", action="store_true", help="replace an existing bundle")
    add_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        train = load_jsonl_split(args.data, args.split)
        manifest = build_bundle(
            args.out,
            train.labels,
            train,
            args.checkpoint,
            from_arguments(args),
            data_name=str(args.data),
            force=args.force,
        )
    except (FileExistsError, FileNotFoundError, ValueError) as exc:  # BundleError is a ValueError
        raise SystemExit(f"export.build: {exc}") from None
    summary = {
        "bundle_id": manifest.bundle_id,
        "out": str(args.out),
        "counts": manifest.counts.model_dump(),
        "parity": manifest.params["parity"],
        "build_seconds": manifest.params["build_seconds"],
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
