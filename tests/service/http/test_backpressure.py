"""A real server with a tiny queue: overload is refused with 429 + Retry-After, never a 5xx."""

import asyncio

import httpx
import pytest

from loadtest.localserver import start_server, stop_server


@pytest.fixture(scope="module")
def small_queue_server(tiny_rae_bundle, tmp_path_factory):
    server = start_server(
        tiny_rae_bundle,
        tmp_path_factory.mktemp("logs") / "small-queue.log",
        extra_env={"XMCSERVE_MAX_QUEUE": "1", "XMCSERVE_MAX_BATCH_SIZE": "1"},
    )
    yield server
    stop_server(server)


def test_overload_gets_429_with_retry_after(small_queue_server):
    async def flood():
        async with httpx.AsyncClient(base_url=small_queue_server.url, timeout=30) as client:
            body = {"texts": ["libc6: GNU C Library: Shared libraries"] * 32, "k": 5}
            return await asyncio.gather(*[client.post("/predict", json=body) for _ in range(40)])

    responses = asyncio.run(flood())
    codes = [r.status_code for r in responses]
    assert set(codes) <= {200, 429}, codes
    assert codes.count(429) > 0 and codes.count(200) > 0
    refused = next(r for r in responses if r.status_code == 429)
    assert int(refused.headers["Retry-After"]) >= 1
    assert "queue full" in refused.json()["detail"]
    metrics = httpx.get(f"{small_queue_server.url}/metrics").text
    rejected = f'xmcserve_rejected_requests_total{{variant="A"}} {float(codes.count(429))}'
    assert rejected in metrics.splitlines(), [line for line in metrics.splitlines() if "rejected" in line]
    assert f'xmcserve_predicted_texts_total{{variant="A"}} {32.0 * codes.count(200)}' in metrics.splitlines()
    assert 'status="429"' in metrics
