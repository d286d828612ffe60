"""bench.lib.floors: both floor apps read the body and answer /predict with the fixed JSON, in
process through httpx's ASGI transport and under a real uvicorn with our server's settings."""

import asyncio
import json

import httpx
import pytest

from bench.lib.floors import ANSWER, create_asgi, create_fastapi, uvicorn_settings
from bench.lib.non_encoder import start_floor
from loadtest.localserver import stop_server

BODY = json.dumps({"text": "a text to classify", "k": 10}).encode()


async def ask(app) -> list[httpx.Response]:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://floor", timeout=10) as client:
        return [
            await client.post("/predict", content=BODY, headers={"content-type": "application/json"}),
            await client.get("/readyz"),
            await client.get("/nothing"),
        ]


@pytest.mark.parametrize("factory", [create_asgi, create_fastapi])
def test_a_floor_answers_predict_with_the_fixed_answer(factory):
    predict, ready, missing = asyncio.run(asyncio.wait_for(ask(factory()), 30))
    assert predict.status_code == 200 and predict.content == ANSWER
    assert predict.headers["content-type"] == "application/json"
    assert len(json.loads(predict.content)["results"][0]["labels"]) == 10
    assert ready.status_code == 200 and missing.status_code == 404


def test_the_floors_run_on_our_servers_uvicorn_settings_with_the_plain_parser():
    settings = uvicorn_settings()
    assert settings["http"] == "httptools" and settings["loop"] == "uvloop"
    assert settings["access_log"] is False and settings["factory"] is True


@pytest.mark.parametrize("kind", ["asgi", "fastapi"])
def test_a_floor_answers_under_a_real_uvicorn(kind, tmp_path):
    # a floor serves no bundle: any directory stands for the one a server is started with
    server = start_floor(kind, tmp_path, tmp_path / f"{kind}.log", {}, timeout_s=60)
    try:
        answer = httpx.post(f"{server.url}/predict", content=BODY, timeout=10)
        assert answer.status_code == 200 and answer.content == ANSWER
    finally:
        stop_server(server)
