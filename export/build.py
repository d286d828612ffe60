"""Checkpoint dir → serving bundle dir.

    python -m export.build --data data/debian-sample --out bundles/default \\
        [--checkpoint DIR] [--index-kind rae_memory|labels] [--dim 64]

Steps: encode the memory texts (mean-pooled Φ, through a fused ONNX graph checked against
torch), fit a PCA head when the checkpoint has none, export the serving graph to ONNX and
check its parity with torch (the export fails otherwise), build the HNSW index over the keys,
write labels, the RAE value matrix and a manifest with sha256 of every file. The bundle is
written to a temporary sibling directory and renamed into place, so a reader never sees a
half-written bundle.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import subprocess
import tempfile
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import hnswlib
import numpy as np
import scipy.sparse as sp
import torch
from tqdm import tqdm

from export.model import PooledEncoder, ServingEncoder, load_encoder, load_fast_tokenizer
from export.onnx_export import (
    ParityError,
    check_parity,
    export_onnx,
    min_cosine,
    optimize_onnx,
    quantize_int8,
    random_texts,
)
from service.engine.encoder import EncoderOptions, OnnxEncoder
from service.engine.manifest import (
    ENCODER_FILE,
    INDEX_FILE,
    LABELS_FILE,
    MANIFEST_FILE,
    TOKENIZER_FILE,
    VALUES_FILE,
    Counts,
    HnswParams,
    Manifest,
    RaeParams,
    SourceInfo,
    TokenizerInfo,
    bundle_id_from,
    sha256_file,
    utc_now,
)
from service.engine.rae import RAE_MODES, build_values
from training.checkpoint import default_encoder_dir, fit_pca_head, load_checkpoint, uses_sentence_normalize
from training.data import LabelSpace, XMCDataset, load_jsonl_split
from training.params import parse_bool

log = logging.getLogger("xmcserve.export")


@dataclass
class ExportParams:
    """Export parameters; defaults build the default serving bundle.

    Attributes:
        index_kind: ``rae_memory`` (training instances + labels as keys, RAE aggregation) or
            ``labels`` (label vectors only, pure dual-encoder retrieval).
        dim: serving dimension of the PCA head (ignored when the checkpoint has a trained head).
        max_length: tokenizer truncation, in tokens (Debian titles average ~21).
        hnsw_m: HNSW graph degree M.
        ef_construction: HNSW build breadth.
        ef_search: default HNSW search breadth stored in the manifest (RAE-XMC uses 300).
        rae_lambda: λ in V = [λY ; (1−λ)I] (RAE-XMC §3.3; 0.5 in the paper).
        rae_tau: softmax temperature τ (0.04 in the paper for unit vectors).
        rae_top_b: keys retrieved per query, b (200 in the paper).
        rae_mode: ``joint`` (one softmax over all top-b keys, the paper) or ``split`` (instance
            and label keys normalised separately; see :mod:`service.engine.rae`).
        batch_size: least texts per encoding block (each block is length-sorted and chunked).
        parity_texts: random texts in the ONNX-vs-torch parity check.
        parity_tolerance: largest allowed max |onnx − torch|.
        optimize: fuse the graph with onnxruntime's transformer optimizer (BERT-class encoders);
            the parity check runs on the fused graph.
        quantize: ``none`` or ``int8`` (dynamic int8 MatMul weights: ~2x faster on CPU, lossy; the
            parity check then runs on the float graph and the int8 graph's smallest cosine to
            it on the parity texts is recorded and must reach ``int8_min_cosine``).
        int8_min_cosine: refuse an int8 graph whose outputs drift further than this.
        max_train: use only the first N training instances as memory (0 = all).
        head_blocks: ``all``, or a comma list of the trained head's block names to serve
            (``g1_de`` = the DE half only, ``g2_clf`` = the classifier half only).
        build_threads: HNSW insertion threads. 1 (default) makes the index, and so the bundle id,
            reproducible from the same inputs; 0 uses every core (faster, order-dependent graph).
        seed: seed for the random parity texts and HNSW construction.
    """

    index_kind: str = "rae_memory"
    dim: int = 64
    max_length: int = 128
    hnsw_m: int = 32
    ef_construction: int = 200
    ef_search: int = 300
    rae_lambda: float = 0.5
    rae_tau: float = 0.04
    rae_top_b: int = 200
    rae_mode: str = "joint"
    batch_size: int = 128
    optimize: bool = True
    quantize: str = "none"
    int8_min_cosine: float = 0.85
    parity_texts: int = 64
    parity_tolerance: float = 1e-4
    max_train: int = 0
    head_blocks: str = "all"
    build_threads: int = 1
    seed: int = 0


@contextmanager
def staged_bundle_dir(out: Path):
    """A temporary sibling of ``out`` to write a bundle into; on success it replaces ``out`` by a
    rename, so a reader never sees a half-written bundle; on failure it is removed."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; a serving container runs as another user
    try:
        yield tmp
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def git_sha() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5, check=False)
    except OSError:
        return None
    return out.stdout.strip() or None


def build_hnsw(keys: np.ndarray, params: ExportParams, path: Path) -> None:
    index = hnswlib.Index(space="ip", dim=keys.shape[1])
    index.init_index(
        max_elements=len(keys), ef_construction=params.ef_construction, M=params.hnsw_m, random_seed=params.seed
    )
    index.add_items(keys, np.arange(len(keys)), num_threads=params.build_threads or -1)
    index.set_ef(params.ef_search)
    index.save_index(str(path))


def write_labels(labels: LabelSpace, path: Path) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        for uid, text in zip(labels.uids, labels.texts, strict=True):
            fh.write(json.dumps({"uid": uid, "text": text}, ensure_ascii=False) + "\n")


def tokenizer_lowercases(tokenizer_json: str) -> bool:
    normalizer = json.loads(tokenizer_json).get("normalizer") or {}
    stack = [normalizer]
    while stack:
        node = stack.pop()
        if node.get("lowercase") or node.get("type") == "Lowercase":
            return True
        stack.extend(node.get("normalizers", []))
    return False


def encode_pooled(encoder, tokenizer, texts: list[str], workdir: Path, params: ExportParams) -> np.ndarray:
    """Mean-pooled Φ of ``texts`` through a fused ONNX graph (about twice torch's speed on CPU),
    parity-checked against torch first. The memory keys come from these vectors."""
    pooled_model = PooledEncoder(encoder).eval()
    plain, fused = workdir / "pooled.plain.onnx", workdir / "pooled.onnx"
    export_onnx(pooled_model, tokenizer, plain)
    try:
        optimize_onnx(plain, fused, encoder.config.model_type, *attention_shape(encoder.config))
    except ValueError:
        plain.rename(fused)
    check_parity(pooled_model, tokenizer, fused, texts[:32], params.parity_tolerance)
    (workdir / TOKENIZER_FILE).write_text(tokenizer.to_str())
    onnx_encoder = OnnxEncoder(fused, workdir / TOKENIZER_FILE, params.max_length, EncoderOptions(providers="cpu"))
    block = max(params.batch_size, 2048)  # large blocks: the encoder length-sorts within each
    parts = [
        onnx_encoder.encode(texts[start : start + block])[0]
        for start in tqdm(range(0, len(texts), block), desc="encode memory", unit="block", leave=False)
    ]
    return np.concatenate(parts)


def attention_shape(config) -> tuple[int, int]:
    """(attention heads, hidden size) of a BERT-like or DistilBERT config."""
    heads = getattr(config, "num_attention_heads", None) or config.n_heads
    hidden = getattr(config, "hidden_size", None) or config.dim
    return heads, hidden


def export_checked_graph(
    serving: ServingEncoder, tokenizer, config, directory: Path, parity_texts: list[str], params: ExportParams
) -> dict:
    """Write ``directory/encoder.onnx``: export, optionally fuse, parity-check, optionally quantize.

    Returns what was done (parity report, fusions, int8 drift) for the manifest's params.
    """
    if params.quantize not in ("none", "int8"):
        raise ValueError(f"unknown quantization {params.quantize!r} (none, int8)")
    final = directory / ENCODER_FILE
    plain = directory / "encoder.plain.onnx"
    export_onnx(serving, tokenizer, plain)
    report: dict = {"fusions": {}}
    if params.optimize:
        try:
            heads, hidden = attention_shape(config)
            report["fusions"] = optimize_onnx(plain, final, config.model_type, heads, hidden)
            plain.unlink()
        except ValueError as exc:
            log.warning("graph not fused: %s", exc)
    if plain.exists():
        plain.rename(final)
    report["parity"] = check_parity(serving, tokenizer, final, parity_texts, params.parity_tolerance).as_dict()
    log.info("ONNX parity: %s; fusions: %s", report["parity"], report["fusions"])
    if params.quantize == "int8":
        float_graph = directory / "encoder.float.onnx"
        final.rename(float_graph)
        quantize_int8(float_graph, final)
        report["int8_min_cosine"] = min_cosine(float_graph, final, tokenizer, parity_texts)
        float_graph.unlink()
        if report["int8_min_cosine"] < params.int8_min_cosine:
            raise ParityError(
                f"int8 graph drifts too far: min cosine {report['int8_min_cosine']:.3f} < {params.int8_min_cosine}"
            )
    return report


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
    if params.index_kind not in ("rae_memory", "labels"):
        raise ValueError(f"unknown index kind {params.index_kind!r}")
    if params.rae_mode not in RAE_MODES:
        raise ValueError(f"unknown RAE mode {params.rae_mode!r} ({', '.join(RAE_MODES)})")
    if params.index_kind == "rae_memory" and (train is None or len(train) == 0):
        raise ValueError("a rae_memory bundle needs training instances")
    if out.exists() and not force:
        raise FileExistsError(f"{out} exists; bundles are immutable (pass --force to replace)")
    started = time.perf_counter()
    torch.manual_seed(params.seed)
    ckpt = load_checkpoint(checkpoint or default_encoder_dir())
    tokenizer = load_fast_tokenizer(ckpt.encoder_dir, params.max_length)
    encoder = load_encoder(ckpt.encoder_dir)

    if train is not None and params.max_train:
        train = train.subset(np.arange(min(params.max_train, len(train))))
    train_texts = train.texts if params.index_kind == "rae_memory" else []
    with tempfile.TemporaryDirectory() as workdir:
        pooled = encode_pooled(encoder, tokenizer, train_texts + labels.texts, Path(workdir), params)
    pooled_train, pooled_labels = pooled[: len(train_texts)], pooled[len(train_texts) :]

    head = ckpt.head or fit_pca_head(pooled, params.dim, uses_sentence_normalize(ckpt.encoder_dir))
    if params.head_blocks != "all":
        head = head.select([name.strip() for name in params.head_blocks.split(",")])
    label_keys = head.label_vectors(pooled_labels)
    keys = np.concatenate([head.query_vectors(pooled_train), label_keys]) if len(train_texts) else label_keys

    with staged_bundle_dir(out) as tmp:
        serving = ServingEncoder(encoder, head).eval()
        parity_set = random_texts(tokenizer, params.parity_texts, params.seed) + labels.texts[:16]
        graph = export_checked_graph(serving, tokenizer, encoder.config, tmp, parity_set, params)
        (tmp / TOKENIZER_FILE).write_text(tokenizer.to_str())
        # The head inside encoder.onnx, as numpy: lets torch tools (the naive benchmark
        # baseline, a re-export) rebuild the same vectors. The service does not read it.
        head.save(tmp)
        write_labels(labels, tmp / LABELS_FILE)
        build_hnsw(keys.astype(np.float32), params, tmp / INDEX_FILE)
        rae = None
        if params.index_kind == "rae_memory":
            sp.save_npz(tmp / VALUES_FILE, build_values(train.Y, params.rae_lambda), compressed=True)
            rae = RaeParams(lam=params.rae_lambda, tau=params.rae_tau, top_b=params.rae_top_b, mode=params.rae_mode)
        files = {p.name: sha256_file(p) for p in sorted(tmp.iterdir())}
        manifest = Manifest(
            # τ and b live only in the manifest: they are part of what the bundle serves, so of its id
            bundle_id=bundle_id_from(
                files | ({"rae": rae.model_dump_json()} if rae else {}),
                prefix=f"{params.index_kind.replace('_', '-')}-{head.dim}d",
            ),
            created_at=utc_now(),
            source=SourceInfo(
                encoder=ckpt.name,
                architecture=encoder.config.model_type,
                head=head.kind,
                training_run=str(checkpoint) if ckpt.head is not None else None,
                git_sha=git_sha(),
                data=data_name,
            ),
            tokenizer=TokenizerInfo(max_length=params.max_length, lowercase=tokenizer_lowercases(tokenizer.to_str())),
            dim=head.dim,
            index_kind=params.index_kind,
            hnsw=HnswParams(
                space="ip", M=params.hnsw_m, ef_construction=params.ef_construction, ef_search=params.ef_search
            ),
            rae=rae,
            counts=Counts(labels=len(labels), memory_rows=len(keys), train_instances=len(train_texts)),
            params={
                **asdict(params),
                **graph,
                "build_seconds": round(time.perf_counter() - started, 1),
            },
            files=files,
        )
        (tmp / MANIFEST_FILE).write_text(manifest.model_dump_json(indent=2))
    log.info("bundle %s written to %s in %.1fs", manifest.bundle_id, out, time.perf_counter() - started)
    return manifest


def derive_rae_bundle(
    source: Path,
    out: Path,
    train_Y: sp.csr_matrix,
    lam: float | None = None,
    tau: float | None = None,
    top_b: int | None = None,
    mode: str | None = None,
    force: bool = False,
) -> Manifest:
    """An ``rae_memory`` bundle that differs from ``source`` only in its RAE parameters (λ, τ, b, mode).

    The encoder and index are unchanged, so they are hard-linked (bundles are immutable), only
    ``values.npz`` (when λ changes) and the manifest are new. This is what a λ sweep serves.
    """
    src = Manifest.model_validate_json((source / MANIFEST_FILE).read_text())
    if src.index_kind != "rae_memory" or src.rae is None:
        raise ValueError(f"{source}: not an rae_memory bundle")
    if train_Y.shape != (src.counts.train_instances, src.counts.labels):
        raise ValueError(f"label matrix {train_Y.shape} does not match the bundle's memory")
    if out.exists() and not force:
        raise FileExistsError(f"{out} exists; bundles are immutable (pass force=True to replace)")
    rae = RaeParams(
        lam=src.rae.lam if lam is None else lam,
        tau=src.rae.tau if tau is None else tau,
        top_b=src.rae.top_b if top_b is None else top_b,
        mode=src.rae.mode if mode is None else mode,
    )
    with staged_bundle_dir(out) as tmp:
        for name in src.files:
            if name == VALUES_FILE and rae.lam != src.rae.lam:
                sp.save_npz(tmp / VALUES_FILE, build_values(train_Y, rae.lam), compressed=True)
                continue
            try:
                os.link(source / name, tmp / name)
            except OSError:
                shutil.copy2(source / name, tmp / name)
        files = {p.name: sha256_file(p) for p in sorted(tmp.iterdir())}
        manifest = src.model_copy(
            update={
                "bundle_id": bundle_id_from(files | {"rae": rae.model_dump_json()}, prefix=f"rae-memory-{src.dim}d"),
                "created_at": utc_now(),
                "rae": rae,
                "params": {
                    **src.params,
                    "rae_lambda": rae.lam,
                    "rae_tau": rae.tau,
                    "rae_top_b": rae.top_b,
                    "rae_mode": rae.mode,
                    "derived_from": src.bundle_id,
                },
                "files": files,
            }
        )
        (tmp / MANIFEST_FILE).write_text(manifest.model_dump_json(indent=2))
    return manifest


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, required=True, help="dataset dir with lbl.json.gz and trn.json.gz")
    parser.add_argument("--out", type=Path, required=True, help="bundle dir to create")
    parser.add_argument("--checkpoint", type=Path, default=None, help="default: pretrained all-MiniLM-L6-v2")
    parser.add_argument("--split", default="trn", help="split used as RAE memory (default trn)")
    parser.add_argument("--force", action="store_true", help="replace an existing bundle")
    defaults = ExportParams()
    for name, value in asdict(defaults).items():
        kind = parse_bool if isinstance(value, bool) else type(value)
        parser.add_argument(f"--{name.replace('_', '-')}", type=kind, default=value)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    params = ExportParams(**{name: getattr(args, name) for name in asdict(defaults)})
    train = load_jsonl_split(args.data, args.split)
    manifest = build_bundle(
        args.out, train.labels, train, args.checkpoint, params, data_name=str(args.data), force=args.force
    )
    print(
        json.dumps(
            {
                "bundle_id": manifest.bundle_id,
                "out": str(args.out),
                "counts": manifest.counts.model_dump(),
                "parity": manifest.params["parity"],
                "build_seconds": manifest.params["build_seconds"],
            }
        )
    )


if __name__ == "__main__":
    main()
