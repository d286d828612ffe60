"""Fold a bundle's append log into a fresh bundle: ``python -m export.compact``.

A live memory (`engine/memory.py`) grows its HNSW graph by insertion and keeps the
appended value rows apart; compaction writes what it serves as an ordinary bundle, with the graph
rebuilt over every key, the memory laid out [instances ; labels] again and the labels file
extended. Label ids do not change, so clients' stored ids stay valid. The encoder, tokenizer and
head files are the source's (hard-linked); the manifest records the source id and the number of
appends folded in (``params.compacted_from``, ``params.appends``).

The compacted bundle stays in its source's lineage (docs/operations.md, "Lineage model"): it has
no log of its own but goes on in the lineage's log, from the byte offset the compaction read it
to (``manifest.lineage``: the log's path relative to the compacted bundle's log directory, that
offset and the sha256 of what was folded; part of the bundle id). The source may be serving
meanwhile: its log is only read (no lock, no repair), up to the last complete record, and what it
logs later is replayed by the compacted bundle at load, or applied before its first append. Serve
it with the same log directory setting the compaction was given (``--appends-dir`` =
``XMCSERVE_APPEND_LOG_DIR``, or neither: each bundle's ``<bundle>.appends/``, and the compacted
bundle then goes beside its source, as a bundle only finds its lineage's log in its own log
directory or one beside it). A source with nothing logged past what it was built or compacted
with is refused: there is nothing to fold.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
from pathlib import Path

import numpy as np
import scipy.sparse as sp

from bundle import MANIFEST_FILE, Counts, Lineage, Manifest, label_files, shard_list, utc_now
from engine import AppendLogError, MemoryView, appends_dir_beside
from engine.offline import SOURCE_LOGS, ScoreFusion, lineage_log_path, load_for_reading
from export.build import write_index, write_label_files
from export.derive import fusion_files, link_or_copy, write_key_terms
from export.export_params import ExportParams
from export.writer import refuse_existing, write_bundle
from xmc.command import program
from xmc.data import LabelSpace


class NothingToFold(RuntimeError):
    """The source's log holds nothing past what the source was built or compacted with."""


def compact_bundle(source: Path, out: Path, appends_dir: Path | None = None, force: bool = False) -> Manifest:
    """The bundle ``source`` with the appends of its log (in ``appends_dir``, default beside it)
    folded in, written to ``out``. Raises :class:`NothingToFold` (nothing written) when there are
    none, ``FileExistsError`` when ``out`` exists (also when another compaction wrote it first)
    unless ``force``."""
    refuse_existing(out, force)
    source, out = Path(source).resolve(), Path(out).resolve()
    predictor, reads = load_for_reading(source, Path(appends_dir or appends_dir_beside(source)).resolve())
    if not reads:
        raise NothingToFold(f"{source}: no append log (is --appends-dir the server's XMCSERVE_APPEND_LOG_DIR?)")
    if predictor.view.version == 0:
        raise NothingToFold(
            f"{source}: nothing to fold: {reads[-1].path} holds no append past what the bundle already has; "
            "nothing written"
        )
    # where the compacted bundle's log directory will be: the lineage log is named relative to it
    target_dir = Path(appends_dir).resolve() if appends_dir is not None else appends_dir_beside(out)
    lineage_read = reads[-1]  # the log the source writes to: its lineage's
    lineage = Lineage(
        bundle_id=lineage_read.bundle_id,
        log=os.path.relpath(lineage_read.path, target_dir),
        offset=lineage_read.size,
        sha256=lineage_read.sha256,
    )
    # refused before anything is written: the compacted bundle would not find the log at load
    lineage_log_path(target_dir, lineage.log, lineage.bundle_id)
    bundle, view = predictor.bundle, predictor.view
    src = bundle.manifest
    keys = bundle.index.vectors(np.arange(view.num_keys))
    order, instance_rows = canonical_order(view)
    rebuilt = {MANIFEST_FILE, *label_files(src.labels_format)}
    rebuilt |= {name for shard in shard_list(src) for name in (shard.index, shard.values, shard.rerank)}
    rebuilt |= fusion_files(src)
    params = ExportParams(
        index=src.ann,
        # the same cells, codes and scan: a compaction changes the keys, not how they are searched
        **(
            {"ivf_nlist": src.ivfpq.nlist, "pq_m": src.ivfpq.pq_m, "ivf_nprobe": src.ivfpq.nprobe, "dim": src.dim}
            if src.ivfpq
            else {}
        ),
        hnsw_m=src.hnsw.M,
        ef_construction=src.hnsw.ef_construction,
        ef_search=src.search_breadth,
        rae_lambda=src.rae.lam if src.rae else 0.0,
        shards=len(shard_list(src)),
    )

    def populate(stage: Path) -> dict:
        for name in src.files:
            if name not in rebuilt:
                link_or_copy(source / name, stage / name)
        labels = LabelSpace(uids=view.label_uids[: view.num_labels], texts=view.label_texts[: view.num_labels])
        write_label_files(stage, labels, src.labels_format)
        memory_Y = instance_labels(view, instance_rows) if view.values is not None else None
        counts = Counts(labels=view.num_labels, memory_rows=view.num_keys, train_instances=len(instance_rows))
        shards, _ = write_index(stage, keys[order], memory_Y, params)
        if bundle.fusion is not None:
            carried_fusion(bundle.fusion, view.num_labels).save(stage, src.fusion)
        if bundle.key_terms is not None:  # a lexical fusion: the keys' term vectors in the new key order
            terms = bundle.key_terms.rows
            if view.appended_key_terms is not None:
                terms = sp.vstack([terms, view.appended_key_terms], format="csr")
            new_shards = shards or shard_list(src.model_copy(update={"counts": counts}))
            write_key_terms(stage, terms[order], src.fusion.lexical, new_shards)
        return src.model_dump(exclude={"bundle_id", "files"}) | {
            "created_at": utc_now(),
            "counts": counts,
            "shards": shards,
            "lineage": lineage,
            "append_ids": view.append_ids,  # a retry of a folded append is still recognised
            "params": {
                **{name: value for name, value in src.params.items() if name != SOURCE_LOGS},  # folded too
                "compacted_from": src.bundle_id,
                "appends": view.version,
            },
        }

    return write_bundle(out, populate, force)


def carried_fusion(fusion: ScoreFusion, num_labels: int) -> ScoreFusion:
    """The same model (and lexicon, features, rerank depth, sparse ranker) with frequency 0 for the
    labels appended since export: what the live memory used for them, so the compacted bundle answers
    as the grown one did (the sparse ranker's file still covers the labels it was fitted on, and only
    those: a load gives the later ones their columns from their texts, as their appends did)."""
    appended = np.zeros(num_labels - len(fusion.log_frequency), dtype=np.float32)
    log_frequency = np.concatenate([fusion.log_frequency, appended])
    return dataclasses.replace(fusion, log_frequency=log_frequency)


def canonical_order(view: MemoryView) -> tuple[np.ndarray, np.ndarray]:
    """Key ids in the order of a built memory: instance keys (oldest first), then one key per
    label in label-id order; and the instance keys alone."""
    key_labels = view.labels_of_keys(np.arange(view.num_keys))
    instance_keys = np.flatnonzero(key_labels < 0)
    label_keys = np.empty(view.num_labels, dtype=np.int64)
    label_keys[key_labels[key_labels >= 0]] = np.flatnonzero(key_labels >= 0)
    return np.concatenate([instance_keys, label_keys]), instance_keys


def instance_labels(view: MemoryView, instance_keys: np.ndarray) -> sp.csr_matrix:
    """Y of the instance keys, read off the value rows' sparsity pattern (λ·y keeps y's pattern,
    even for λ = 0)."""
    labels, counts = view.values.row_labels(instance_keys)
    indptr = np.concatenate([[0], np.cumsum(counts)])
    return sp.csr_matrix(
        (np.ones(len(labels), dtype=np.float32), labels, indptr), shape=(len(instance_keys), view.num_labels)
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=program("export.compact"), description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--bundle", type=Path, required=True, help="the served bundle whose appends to fold in")
    parser.add_argument("--out", type=Path, required=True, help="bundle dir to create")
    parser.add_argument(
        "--appends-dir",
        type=Path,
        default=None,
        help="directory of the append logs (the server's XMCSERVE_APPEND_LOG_DIR; default: <bundle>.appends)",
    )
    parser.add_argument(
        "--force", action="store_true", help="replace an existing bundle at --out (without it, an existing one is kept)"
    )
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        manifest = compact_bundle(args.bundle, args.out, args.appends_dir, args.force)
    except (NothingToFold, FileExistsError, AppendLogError) as exc:
        raise SystemExit(f"export.compact: {exc}") from None
    print(json.dumps({"bundle_id": manifest.bundle_id, "out": str(args.out), **manifest.counts.model_dump()}))


if __name__ == "__main__":
    main()
