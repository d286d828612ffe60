import os
import subprocess
import sys

import numpy as np
import pytest

from engine import encoder as enc
from engine.encoder import EncoderOptions, OnnxEncoder, choose_providers, plan_chunks


def test_plan_chunks_covers_every_text_once_in_order():
    lengths = sorted(np.random.default_rng(0).integers(3, 80, 50).tolist())
    chunks = plan_chunks(lengths, 16, 64)
    assert chunks[0][0] == 0 and chunks[-1][1] == 50
    assert all(a[1] == b[0] for a, b in zip(chunks, chunks[1:], strict=False))


def test_plan_chunks_trades_call_overhead_against_padding():
    lengths = [10] * 8 + [100] * 8
    assert plan_chunks(lengths, 16, 64) == [(0, 8), (8, 16)]  # padding 8 short texts to 100 costs more
    assert plan_chunks(lengths, 10_000, 64) == [(0, 16)]  # a huge call overhead: one call
    assert plan_chunks([1, 2, 3], 0.0, 64) == [(0, 1), (1, 2), (2, 3)]  # free calls: never pad
    assert all(end - start <= 4 for start, end in plan_chunks([5] * 10, 1e6, 4))
    assert plan_chunks([], 16, 64) == [] and plan_chunks([7], 16, 64) == [(0, 1)]


def test_provider_choice(monkeypatch):
    monkeypatch.setattr(enc.ort, "get_available_providers", lambda: ["CPUExecutionProvider"])
    assert choose_providers("auto") == ["CPUExecutionProvider"]
    with pytest.raises(RuntimeError, match="CUDA execution provider requested"):
        choose_providers("cuda")
    monkeypatch.setattr(enc.ort, "get_available_providers", lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"])
    assert choose_providers("auto") == ["CUDAExecutionProvider", "CPUExecutionProvider"]
    assert choose_providers("cpu") == ["CPUExecutionProvider"]
    with pytest.raises(ValueError, match="unknown provider"):
        choose_providers("tpu")


def test_cuda_asked_for_but_not_created_fails_instead_of_running_on_cpu(tiny_rae_bundle, monkeypatch):
    """onnxruntime-gpu lists the CUDA provider even where it cannot create it (no device, a
    missing cuDNN) and then silently runs the session on the CPU; asked for CUDA, that must fail."""
    monkeypatch.setattr(enc.ort, "get_available_providers", lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"])
    path = tiny_rae_bundle
    with pytest.raises(RuntimeError, match="could not be created"):
        OnnxEncoder(path / "encoder.onnx", path / "tokenizer.json", 64, EncoderOptions(providers="cuda"))


def test_chunked_encoding_matches_one_text_at_a_time(tiny_rae_bundle, monkeypatch):
    path = tiny_rae_bundle
    texts = ["a", "a much longer text " * 6, "libc6: GNU C Library", "x y", "python3-numpy: fast arrays"] * 3
    monkeypatch.setattr(enc, "CALL_COST_TOKENS", 4.0)  # cheap calls: several chunks per batch
    chunked = OnnxEncoder(path / "encoder.onnx", path / "tokenizer.json", 64, EncoderOptions(), enc.MAX_CHUNK)
    vectors, times = chunked.encode(texts)
    singles = np.concatenate([chunked.encode([t])[0] for t in texts])
    np.testing.assert_allclose(vectors, singles, atol=1e-5)
    assert times.encode_s > 0 and times.tokenize_s > 0
    ids = chunked.tokenize(["a much longer text " * 40])[0]
    assert len(ids) == 64  # truncated to the bundle's max length, not padded


@pytest.mark.skipif(
    not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2, reason="needs 2+ cores to pin to one"
)
def test_onnx_runtime_threads_stay_on_the_cores_a_pinned_process_may_use(tiny_rae_bundle):
    """ONNX Runtime's default pool pins a thread to every physical core of the machine; a server
    under taskset or in a cpuset container must keep all of its threads within its mask."""
    last = max(os.sched_getaffinity(0))
    script = f"""
import os
from pathlib import Path
from engine.bundle import load_bundle
encoder = load_bundle(Path({str(tiny_rae_bundle)!r})).encoder
encoder.encode(["libc6: GNU C Library"] * 8)
print(sorted(set().union(*(os.sched_getaffinity(int(t)) for t in os.listdir("/proc/self/task")))))
"""
    out = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
        preexec_fn=lambda: os.sched_setaffinity(0, {last}),
    )
    assert out.stdout.strip().splitlines()[-1] == f"[{last}]", out.stderr[-2000:]


@pytest.mark.parametrize(
    ("workers", "threads", "layout"),
    [
        (0, 0, (4, 1)),  # the default on CPU: a worker per core, one thread per call
        (1, 0, (1, 4)),  # the latency-first layout: one worker, all cores per call
        (2, 0, (2, 2)),
        (0, 2, (2, 2)),
        (3, 3, (3, 3)),  # given both: as given
        (8, 0, (8, 1)),
    ],
)
def test_the_thread_layout_fills_the_cores_this_process_may_use(monkeypatch, workers, threads, layout):
    monkeypatch.setattr(enc, "confined_cpu_count", lambda: 4)
    monkeypatch.setattr(enc, "choose_providers", lambda preference: [enc.CPU_PROVIDER])
    assert enc.thread_layout(workers, threads, "cpu") == layout


def test_on_cuda_two_workers_share_the_device_by_default(monkeypatch):
    monkeypatch.setattr(enc, "choose_providers", lambda preference: [enc.CUDA_PROVIDER, enc.CPU_PROVIDER])
    assert enc.thread_layout(0, 0, "cuda") == (2, 0)
    assert enc.thread_layout(3, 1, "cuda") == (3, 1)


def test_on_the_cpu_each_text_is_its_own_session_call(tiny_rae_bundle):
    """A text's vector is the same bits whatever it is batched with: ONNX Runtime's sums depend on
    a call's shape, so on the CPU no call carries two texts."""
    path = tiny_rae_bundle
    encoder = OnnxEncoder(path / "encoder.onnx", path / "tokenizer.json", 64, EncoderOptions(providers="cpu"))
    assert encoder.texts_per_call == 1
    calls = []
    run = encoder.run
    encoder.run = lambda token_ids: calls.append(len(token_ids)) or run(token_ids)
    texts = ["libc6: GNU C Library", "a much longer text " * 6, "x"]
    batched, _ = encoder.encode(texts)
    assert calls == [1, 1, 1]
    for text, vector in zip(texts, batched, strict=True):
        assert np.array_equal(encoder.encode([text])[0][0], vector)
