"""Bundles derived from another bundle without re-encoding: an RAE memory with other λ, τ, b or
mode, or with a score fusion (``export.fuse``).

The encoder and the index do not depend on these parameters, so they are hard-linked (bundles are
immutable, sharing their files is safe) and only the value rows (``values.npz``, or each shard's,
when λ changes) and the manifest are new. This is what a λ sweep serves.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import scipy.sparse as sp

from export.params import RAE_ATTRIBUTES, RaeMode
from export.writer import write_bundle, write_values
from service.engine.fusion import ScoreFusion
from service.engine.manifest import MANIFEST_FILE, FusionParams, Manifest, RaeParams, shard_list, utc_now


def derive_rae_bundle(
    source: Path,
    out: Path,
    train_Y: sp.csr_matrix,
    lam: float | None = None,
    tau: float | None = None,
    top_b: int | None = None,
    mode: RaeMode | None = None,
    force: bool = False,
) -> Manifest:
    """An ``rae_memory`` bundle at ``out`` that differs from ``source`` only in the RAE parameters
    given (the others are kept); ``train_Y`` is the memory's label matrix, for a new λ's values.
    A score fusion of ``source`` is dropped: it was fitted to the scores of the old parameters."""
    src = Manifest.model_validate_json((source / MANIFEST_FILE).read_text())
    if src.index_kind != "rae_memory" or src.rae is None:
        raise ValueError(f"{source}: not an rae_memory bundle")
    if train_Y.shape != (src.counts.train_instances, src.counts.labels):
        raise ValueError(f"label matrix {train_Y.shape} does not match the bundle's memory")
    given = {"lam": lam, "tau": tau, "top_b": top_b, "mode": mode}
    rae = RaeParams(**(src.rae.model_dump() | {name: value for name, value in given.items() if value is not None}))

    new_values = rae.lam != src.rae.lam
    value_files = {shard.values for shard in shard_list(src)}
    dropped = value_files if new_values else set()
    dropped |= {src.fusion.file} if src.fusion is not None else set()

    def populate(stage: Path) -> dict:
        if new_values:
            write_values(stage, train_Y, rae.lam, src.shards)
        for name in src.files:
            if name not in dropped:
                link_or_copy(source / name, stage / name)
        # the params keep describing the bundle: the new RAE values replace the source's
        rae_attributes = {RAE_ATTRIBUTES[field]: value for field, value in rae.model_dump().items()}
        return src.model_dump(exclude={"bundle_id", "files"}) | {
            "created_at": utc_now(),
            "rae": rae,
            "fusion": None,
            "params": {**src.params, **rae_attributes, "derived_from": src.bundle_id},
        }

    return write_bundle(out, populate, force)


def derive_fused_bundle(
    source: Path, out: Path, fusion: ScoreFusion, params: FusionParams, force: bool = False
) -> Manifest:
    """``source`` with the score fusion ``fusion`` (replacing any it had): its files linked, the
    fusion written beside them, the manifest's ``fusion`` set."""
    src = Manifest.model_validate_json((source / MANIFEST_FILE).read_text())
    replaced = {src.fusion.file} if src.fusion is not None else set()

    def populate(stage: Path) -> dict:
        for name in src.files:
            if name not in replaced:
                link_or_copy(source / name, stage / name)
        fusion.save(stage / params.file)
        return src.model_dump(exclude={"bundle_id", "files"}) | {
            "created_at": utc_now(),
            "fusion": params,
            "params": {**src.params, "derived_from": src.bundle_id},
        }

    return write_bundle(out, populate, force)


def link_or_copy(src: Path, dst: Path) -> None:
    """Hard-link ``src`` to ``dst``; copy it where links are impossible (another file system)."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)
