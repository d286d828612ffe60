"""The bundle's ONNX encoder timed on its own, one text per call, outside any server."""

from __future__ import annotations

import threading
import time


def encoder_alone(encoder, texts: list[str], batch: int, seconds: float, workers: int = 1) -> float:
    """Texts/s of ``encoder.encode`` (tokenize + one ONNX call per length-sorted chunk) on
    consecutive batches of the dev texts, ``workers`` threads each calling it one batch at a time,
    as the server's encode stage runs."""
    for i in range(3):
        encoder.encode(texts[i * batch : (i + 1) * batch])
    done = [0] * workers
    start = time.perf_counter()

    def work(worker: int) -> None:
        offset = worker * batch * 7  # workers on different texts
        while time.perf_counter() - start < seconds:
            chunk = [texts[(offset + j) % len(texts)] for j in range(batch)]
            encoder.encode(chunk)
            done[worker] += batch
            offset += batch * workers

    threads = [threading.Thread(target=work, args=(w,)) for w in range(workers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return sum(done) / (time.perf_counter() - start)
