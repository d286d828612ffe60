"""A bundle's keys under another index kind, without re-encoding: ``python -m export.reindex``.

    python -m export.reindex --bundle bundles/debian-unidec --out bundles/debian-unidec-ivfpq --index ivfpq

The keys are read back from the source's index (hnswlib keeps them as float32; an ivfpq bundle's
are its float16 re-rank vectors) and indexed again in the same shards; the encoder, labels, value
rows and fusion files are hard-linked (bundles are immutable), so the two bundles differ only in
how their keys are searched: what a comparison of index kinds on a trained bundle needs.

The new bundle stays in its source's lineage (docs/operations.md, "Lineage model"): it replays
the appends the source's lineage logged, with the same label ids and ``append_id`` values, and appends
to that log, so promoting it over a live source loses no acknowledged append. Give it the log
directory setting the server has (``--appends-dir`` = ``XMCSERVE_APPEND_LOG_DIR``, or neither:
each bundle's ``<bundle>.appends/``, and the new bundle then goes beside its source).
"""

from __future__ import annotations

import argparse
import json
import logging
from dataclasses import replace
from pathlib import Path

import numpy as np

from bundle import Manifest, read_manifest, shard_file_names, shard_list, utc_now
from engine import AppendLogError
from engine.offline import carried_lineage, load_shard_index
from export.build import write_shard_index
from export.derive import link_or_copy
from export.export_params import ExportParams
from export.writer import refuse_existing, write_bundle
from xmc.command import program


def reindex_bundle(
    source: Path, out: Path, params: ExportParams, force: bool = False, appends_dir: Path | None = None
) -> Manifest:
    """``source`` with its keys indexed as ``params.index`` says (ivfpq: ``ivf_nlist``, ``pq_m``,
    ``ivf_nprobe``; hnswlib: ``hnsw_m``, ``ef_construction``), ``ef_search`` from ``params``; in
    the source's lineage, its log found through ``appends_dir`` (None: each bundle's default log
    directory) as :func:`~engine.carried_lineage` says."""
    refuse_existing(out, force)
    source = Path(source).resolve()
    src = read_manifest(source)
    lineage = carried_lineage(source, src, out, appends_dir)
    shards = shard_list(src)
    params = replace(params, dim=src.dim, shards=len(shards), index_kind=src.index_kind)
    keys = [load_shard_index(source, src, s).vectors(np.arange(s.first_key, s.first_key + s.keys)) for s in shards]
    ivfpq = params.ivfpq(max(s.keys for s in shards)) if params.index == "ivfpq" else None
    replaced = {name for s in shards for name in (s.index, s.rerank) if name}

    def populate(stage: Path) -> dict:
        for name in src.files:
            if name not in replaced:
                link_or_copy(source / name, stage / name)
        new_shards = []
        for i, (shard, shard_keys) in enumerate(zip(shards, keys, strict=True)):
            index_name, rerank_name = shard_file_names(params.index, len(shards), i)
            write_shard_index(stage, shard_keys, shard.first_key, params, ivfpq, index_name, rerank_name)
            new_shards.append(shard.model_copy(update={"index": index_name, "rerank": rerank_name}))
        hnsw = params.hnsw()
        return src.model_dump(exclude={"bundle_id", "files"}) | {
            "created_at": utc_now(),
            "ann": params.index,
            "ivfpq": ivfpq,
            "hnsw": hnsw if params.index == "hnswlib" else src.hnsw,  # ivfpq: its breadth is ivfpq.rerank_depth
            "shards": new_shards if src.shards else None,
            "lineage": lineage,
            "params": {**src.params, "index": params.index, "reindexed_from": src.bundle_id},
        }

    return write_bundle(out, populate, force)


def retune_bundle(
    source: Path,
    out: Path,
    nprobe: int | None = None,
    ef_search: int | None = None,
    appends_dir: Path | None = None,
) -> Manifest:
    """``source`` (an ivfpq bundle) scanning ``nprobe`` cells and re-ranking ``ef_search``
    candidates by default (``ivfpq.rerank_depth``): every file linked, only the manifest's search parameters new (the
    index does not depend on them); in the source's lineage, as :func:`reindex_bundle`."""
    source = Path(source).resolve()
    src = read_manifest(source)
    if src.ivfpq is None:
        raise ValueError(f"{source}: not an ivfpq bundle")
    lineage = carried_lineage(source, src, out, appends_dir)

    def populate(stage: Path) -> dict:
        for name in src.files:
            link_or_copy(source / name, stage / name)
        return src.model_dump(exclude={"bundle_id", "files"}) | {
            "created_at": utc_now(),
            "ivfpq": src.ivfpq.model_copy(
                update={"nprobe": nprobe or src.ivfpq.nprobe, "rerank_depth": ef_search or src.ivfpq.rerank_depth}
            ),
            "lineage": lineage,
            "params": {**src.params, "retuned_from": src.bundle_id},
        }

    return write_bundle(out, populate)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=program("export.reindex"), description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    defaults = ExportParams()
    parser.add_argument("--bundle", type=Path, required=True, help="the source bundle")
    parser.add_argument("--out", type=Path, required=True, help="bundle dir to create")
    parser.add_argument("--index", choices=["hnswlib", "ivfpq"], default="ivfpq", help="the index kind to build")
    parser.add_argument("--ivf-nlist", type=int, default=defaults.ivf_nlist, help="ivfpq cells (0: auto)")
    parser.add_argument(
        "--ivf-nprobe",
        type=int,
        default=defaults.ivf_nprobe,
        help="ivfpq cells scanned per query (0: 256 for an RAE memory, 128 for a label index)",
    )
    parser.add_argument(
        "--pq-m", type=int, default=defaults.pq_m, help="ivfpq 4-bit PQ sub-quantizers (0: one a dimension)"
    )
    parser.add_argument("--hnsw-m", type=int, default=defaults.hnsw_m, help="hnswlib graph degree M")
    parser.add_argument("--ef-construction", type=int, default=defaults.ef_construction, help="hnswlib build breadth")
    parser.add_argument(
        "--ef-search", type=int, default=None, help="default search breadth / re-rank depth (default: the source's)"
    )
    parser.add_argument("--build-threads", type=int, default=1, help="index build threads (0: every core)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the index construction")
    parser.add_argument(
        "--appends-dir",
        type=Path,
        default=None,
        help="directory of the append logs (the server's XMCSERVE_APPEND_LOG_DIR; default: each bundle's "
        "<bundle>.appends, the new bundle then beside its source): the new bundle goes on in its source's log",
    )
    parser.add_argument("--force", action="store_true", help="replace an existing bundle at --out")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    src = read_manifest(Path(args.bundle).resolve())
    params = ExportParams(
        index=args.index,
        dim=src.dim,
        ivf_nlist=args.ivf_nlist,
        ivf_nprobe=args.ivf_nprobe,
        pq_m=args.pq_m,
        hnsw_m=args.hnsw_m,
        ef_construction=args.ef_construction,
        ef_search=args.ef_search or src.search_breadth,
        build_threads=args.build_threads,
        seed=args.seed,
    )
    try:
        manifest = reindex_bundle(args.bundle, args.out, params, args.force, args.appends_dir)
    except (AppendLogError, FileExistsError) as exc:
        raise SystemExit(f"export.reindex: {exc}") from None
    print(json.dumps({"bundle_id": manifest.bundle_id, "out": str(args.out), "ann": manifest.ann}))


if __name__ == "__main__":
    main()
