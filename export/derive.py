"""Bundles derived from another bundle without re-encoding: an RAE memory with other λ, τ, b or
mode, with a score fusion (``export.fuse``), or a float bundle's encoder quantized to int8.

The encoder and the index do not depend on these parameters, so they are hard-linked (bundles are
immutable, sharing their files is safe) and only the value rows (``values.npz``, or each shard's,
when λ changes) and the manifest are new. This is what a λ sweep serves.

A derived bundle stays in its source's lineage (:func:`~engine.carried_lineage`): it
replays the appends the source's lineage logged and appends to that log, found through the
``appends_dir`` it is given (the server's XMCSERVE_APPEND_LOG_DIR; None: each bundle's
``<bundle>.appends/``, the derived bundle then beside its source).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import scipy.sparse as sp
from tokenizers import Tokenizer

from bundle import (
    ENCODER_FILE,
    MANIFEST_FILE,
    TOKENIZER_FILE,
    FusionParams,
    Manifest,
    RaeParams,
    Shard,
    shard_list,
    utc_now,
)
from engine.offline import ScoreFusion, carried_lineage, save_key_terms
from export.export_params import RAE_ATTRIBUTES, Quantize, RaeMode
from export.onnx_export import quantize_checked, random_texts
from export.writer import write_bundle, write_values


def derive_rae_bundle(
    source: Path,
    out: Path,
    train_Y: sp.csr_matrix,
    lam: float | None = None,
    tau: float | None = None,
    top_b: int | None = None,
    mode: RaeMode | None = None,
    force: bool = False,
    appends_dir: Path | None = None,
) -> Manifest:
    """An ``rae_memory`` bundle at ``out`` that differs from ``source`` only in the RAE parameters
    given (the others are kept); ``train_Y`` is the memory's label matrix, for a new λ's values.
    A score fusion of ``source`` is dropped (with its key term files): it was fitted to the
    scores of the old parameters."""
    src = Manifest.model_validate_json((source / MANIFEST_FILE).read_text())
    if src.index_kind != "rae_memory" or src.rae is None:
        raise ValueError(f"{source}: not an rae_memory bundle")
    if train_Y.shape != (src.counts.train_instances, src.counts.labels):
        raise ValueError(f"label matrix {train_Y.shape} does not match the bundle's memory")
    given = {"lam": lam, "tau": tau, "top_b": top_b, "mode": mode}
    rae = RaeParams(**(src.rae.model_dump() | {name: value for name, value in given.items() if value is not None}))
    lineage = carried_lineage(source, src, out, appends_dir)

    new_values = rae.lam != src.rae.lam
    value_files = {shard.values for shard in shard_list(src)}
    dropped = value_files if new_values else set()
    dropped |= fusion_files(src)

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
            "lineage": lineage,
            "params": {**src.params, **rae_attributes, "derived_from": src.bundle_id},
        }

    return write_bundle(out, populate, force)


def derive_fused_bundle(
    source: Path,
    out: Path,
    fusion: ScoreFusion,
    params: FusionParams,
    key_terms: sp.csr_matrix | None = None,
    force: bool = False,
    appends_dir: Path | None = None,
) -> Manifest:
    """``source`` with the score fusion ``fusion`` (replacing any it had): its files linked, the
    fusion written beside them (and, for a lexical fusion, the keys' term vectors ``key_terms``,
    key id order, cut into ``params.lexical``'s files along the shards), the manifest's
    ``fusion`` set."""
    src = Manifest.model_validate_json((source / MANIFEST_FILE).read_text())
    replaced = fusion_files(src)
    if (key_terms is not None) != (params.lexical is not None):
        raise ValueError("a lexical fusion is written with its key term vectors, and only a lexical one")
    lineage = carried_lineage(source, src, out, appends_dir)

    def populate(stage: Path) -> dict:
        for name in src.files:
            if name not in replaced:
                link_or_copy(source / name, stage / name)
        fusion.save(stage, params)
        if key_terms is not None:
            write_key_terms(stage, key_terms, params.lexical, shard_list(src))
        return src.model_dump(exclude={"bundle_id", "files"}) | {
            "created_at": utc_now(),
            "fusion": params,
            "lineage": lineage,
            "params": {**src.params, "derived_from": src.bundle_id},
        }

    return write_bundle(out, populate, force)


def derive_quantized_bundle(
    source: Path,
    out: Path,
    quantize: Quantize,
    calibration_texts: list[str] | None = None,
    least_cosine: float = 0.85,
    parity_texts: int = 64,
    seed: int = 0,
    force: bool = False,
    appends_dir: Path | None = None,
) -> Manifest:
    """A float32 bundle's twin with an int8 encoder (``quantize``: ``int8`` or ``int8-static``,
    whose scales fit on ``calibration_texts``): the graph quantized and checked against the
    float one as a build checks it (:func:`~export.onnx_export.quantize_checked`), every other
    file linked. The keys are the float encoder's, as in a bundle built with ``quantize``."""
    src = Manifest.model_validate_json((source / MANIFEST_FILE).read_text())
    if src.params.get("quantize", "none") != "none":
        raise ValueError(f"{source}: its encoder is quantized already ({src.params['quantize']})")
    if quantize == "none":
        raise ValueError("nothing to derive: quantize is none")
    tokenizer = Tokenizer.from_file(str(source / TOKENIZER_FILE))  # pads and truncates as exported
    lineage = carried_lineage(source, src, out, appends_dir)

    def populate(stage: Path) -> dict:
        for name in src.files:
            if name != ENCODER_FILE:
                link_or_copy(source / name, stage / name)
        shutil.copy2(source / ENCODER_FILE, stage / ENCODER_FILE)
        texts = random_texts(tokenizer, parity_texts, seed)
        cosine = quantize_checked(stage / ENCODER_FILE, tokenizer, texts, least_cosine, quantize, calibration_texts)
        return src.model_dump(exclude={"bundle_id", "files"}) | {
            "created_at": utc_now(),
            "lineage": lineage,
            "params": {**src.params, "quantize": quantize, "int8_min_cosine": cosine, "derived_from": src.bundle_id},
        }

    return write_bundle(out, populate, force)


def write_key_terms(stage: Path, key_terms: sp.csr_matrix, names: list[str], shards: list[Shard]) -> None:
    """Each shard's rows of the keys' term vectors into its file of ``names``."""
    if key_terms.shape[0] != sum(shard.keys for shard in shards) or len(names) != len(shards):
        raise ValueError(f"{key_terms.shape[0]} key term rows, {len(names)} files for {len(shards)} shards")
    for name, shard in zip(names, shards, strict=True):
        save_key_terms(stage / name, key_terms[shard.first_key : shard.first_key + shard.keys])


def fusion_files(manifest: Manifest) -> set[str]:
    """The files of ``manifest``'s score fusion (none without one)."""
    if manifest.fusion is None:
        return set()
    fusion = manifest.fusion
    return {fusion.file, fusion.model, *(fusion.lexical or []), *([fusion.sparse.file] if fusion.sparse else [])}


def link_or_copy(src: Path, dst: Path) -> None:
    """Hard-link ``src`` to ``dst``; copy it where links are impossible (another file system)."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)
