"""Shared fixtures: the sample data, one real bundle built from it, a running uvicorn server.

The bundles are built once per run: under pytest-xdist (``make test`` runs the files on two
workers) the first worker to need one builds it under a lock in the run's shared temporary
directory and the others wait for it and read the same files (:func:`built_once`)."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from loadtest.localserver import Server, start_server, stop_server

ROOT = Path(__file__).resolve().parents[1]
SAMPLE_DIR = ROOT / "data" / "debian-sample"


def wait_for(condition, limit_s: float = 60, step_s: float = 0.1):
    """Poll ``condition`` until it returns something truthy, and return that (bounded by ``limit_s``)."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if result := condition():
            return result
        time.sleep(step_s)
    raise AssertionError(f"condition not met within {limit_s}s")


def built_once(tmp_path_factory, name: str, build) -> Path:
    """``build(path)``'s output at ``path``, made once per test run: one session's, or with
    pytest-xdist the one all workers share (the first builds it under a file lock; a build that
    failed leaves no completion mark, so the next worker to need it tries again and fails alike)."""
    from filelock import FileLock

    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # the run's directory, above each worker's own
    path, done = base / "built-once" / name, base / "built-once" / f"{name}.done"
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(path) + ".lock"):
        if not done.exists():
            shutil.rmtree(path, ignore_errors=True)
            build(path)
            done.touch()
    return path


def need_tool(present: bool, reason: str) -> None:
    """Skip the test, saying ``reason``, where a tool it needs (a browser, Prometheus) is missing;
    under ``CI=true`` fail instead: CI installs these tools (.ci/run), and a skip there would let a
    run pass that no longer checks what the test guards."""
    if present:
        return
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"{reason} (CI=true: the tool must be installed, see .ci/run)", pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="session")
def sample_dir() -> Path:
    return SAMPLE_DIR


@pytest.fixture(scope="session")
def sample_bundle(tmp_path_factory) -> Path:
    """The default bundle (pretrained MiniLM, RAE memory, 64-d) built from the shipped sample."""
    from export.build import ExportParams, build_bundle
    from xmc.data import load_jsonl_split

    def build(out: Path) -> None:
        train = load_jsonl_split(SAMPLE_DIR, "trn")
        build_bundle(out, train.labels, train, params=ExportParams(), data_name=str(SAMPLE_DIR))

    return built_once(tmp_path_factory, "sample-rae", build)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt")


@pytest.fixture(scope="session")
def distilbert_dir(tmp_path_factory) -> Path:
    """A randomly initialised small DistilBERT with the MiniLM (bert-base-uncased) vocabulary."""
    import shutil

    import torch
    from transformers import DistilBertConfig, DistilBertModel

    from xmc.checkpoint import default_encoder_dir

    torch.manual_seed(0)
    config = DistilBertConfig(
        vocab_size=30522, dim=32, n_layers=2, n_heads=2, hidden_dim=64, max_position_embeddings=128
    )
    out = tmp_path_factory.mktemp("ckpt") / "distilbert-tiny"
    DistilBertModel(config).save_pretrained(out)
    for name in TOKENIZER_FILES:
        shutil.copy(default_encoder_dir() / name, out / name)
    return out


@pytest.fixture(scope="session")
def tiny_rae_bundle(distilbert_dir, tmp_path_factory) -> Path:
    """A small rae_memory bundle (tiny DistilBERT, 300 sample instances): fast to copy and corrupt."""
    from export.build import ExportParams, build_bundle
    from xmc.data import load_jsonl_split

    train = load_jsonl_split(SAMPLE_DIR, "trn")
    out = tmp_path_factory.mktemp("bundles") / "tiny-rae"
    build_bundle(out, train.labels, train, distilbert_dir, ExportParams(dim=16, max_train=300, rae_top_b=50))
    return out


@pytest.fixture
def bundle_copy(tiny_rae_bundle, tmp_path) -> Path:
    """A test's own copy of ``tiny_rae_bundle``, to corrupt or edit."""
    target = tmp_path / "bundle"
    shutil.copytree(tiny_rae_bundle, target)
    return target


@pytest.fixture(scope="session")
def bundle_root(tmp_path_factory, tiny_rae_bundle, distilbert_dir) -> Path:
    """A bundle root for reloads: ``tiny-rae``, ``tiny-labels`` (a labels-index bundle of the same
    encoder) and ``corrupt`` (one flipped byte in its labels file); a dir outside it for escapes."""
    import shutil

    from bundle.manifest import LABELS_FILE
    from export.build import ExportParams, build_bundle
    from xmc.data import load_jsonl_split

    root = tmp_path_factory.mktemp("bundle-root")
    shutil.copytree(tiny_rae_bundle, root / "tiny-rae")
    labels = load_jsonl_split(SAMPLE_DIR, "trn").labels
    build_bundle(root / "tiny-labels", labels, None, distilbert_dir, ExportParams(index_kind="labels", dim=16))
    shutil.copytree(tiny_rae_bundle, root / "corrupt")
    data = bytearray((root / "corrupt" / LABELS_FILE).read_bytes())
    data[5] ^= 0x01
    (root / "corrupt" / LABELS_FILE).write_bytes(bytes(data))
    (tmp_path_factory.getbasetemp() / "outside-bundle").mkdir(exist_ok=True)
    return root


@pytest.fixture(scope="session")
def live_server(sample_bundle, tmp_path_factory) -> Iterator[Server]:
    server = start_server(sample_bundle, tmp_path_factory.mktemp("logs") / "uvicorn.log")
    yield server
    stop_server(server)


@pytest.fixture(autouse=True)
def _no_xmcserve_environment(monkeypatch):
    """Every test starts from the documented defaults: a developer's or CI's own ``XMCSERVE_*``
    variables (a bundle dir, a token) must not leak into settings or the servers tests start."""
    import os

    for name in [n for n in os.environ if n.startswith("XMCSERVE_")]:
        monkeypatch.delenv(name)


@pytest.fixture(autouse=True)
def _own_append_log_dir(_no_xmcserve_environment, monkeypatch, tmp_path):
    """Each test's servers and apps log appends to a directory of the test's own: a log has one
    writer process, and the session's bundles are shared by tests whose servers may overlap. A
    test of the default (``<bundle dir>.appends/``) removes the variable."""
    monkeypatch.setenv("XMCSERVE_APPEND_LOG_DIR", str(tmp_path / "xmcserve-appends"))
