"""The floors of the serving stack: what a ``POST /predict`` costs with nothing of ours in it, served
by uvicorn with the settings ``python -m service.http`` gives it (uvloop, the httptools parser, the
connection cap, keep-alive, no access log: :func:`service.http.server.uvicorn_options`), so that
the server's CPU per request minus a floor's, measured in the same rounds, is our own machinery.

    python -m bench.lib.floors {asgi,fastapi} [--host 127.0.0.1] [--port 8000]

* ``asgi``: a bare ASGI callable that reads the request's body and answers a fixed JSON;
* ``fastapi``: one ``@app.post("/predict")`` route (FastAPI's own telemetry off, as in our app)
  that awaits the body and returns the same bytes, serialised once by orjson.

Both answer ``GET /readyz`` (what :func:`loadtest.localserver.start_server` waits for). Their
answer has the shape and size of a real ``/predict`` answer for one text at k 10, so the socket
writes are alike. The protocol is uvicorn's plain ``httptools`` one, not our
:class:`~service.http.server.GuardedProtocol`: the guards are ours, so they are counted as our
machinery.
"""

import argparse

import orjson

# One text at k 10, in the shape of service.api.schemas.PredictResponse.
ANSWER = orjson.dumps(
    {
        "bundle_id": "floor",
        "variant": "A",
        "index_kind": "hnsw",
        "k": 10,
        "ef": 300,
        "results": [
            {
                "labels": [
                    {
                        "id": 1000 + i,
                        "uid": f"label-{1000 + i}",
                        "text": f"a label text of some words {i}",
                        "score": 0.9 - i / 50,
                    }
                    for i in range(10)
                ]
            }
        ],
    }
)
READY = b'{"ready":true}'
JSON_HEADERS = [(b"content-type", b"application/json")]


def _headers(body: bytes) -> list[tuple[bytes, bytes]]:
    return [*JSON_HEADERS, (b"content-length", str(len(body)).encode())]


async def asgi_app(scope, receive, send) -> None:
    """The bare ASGI floor: the body read to its end, then the fixed answer (``/readyz``: ready;
    anything else: 404)."""
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return
    if scope["type"] != "http":
        return
    more = True
    while more:  # the whole body, as a real endpoint reads it
        message = await receive()
        if message["type"] == "http.disconnect":
            return
        more = message.get("more_body", False)
    path, method = scope["path"], scope["method"]
    if path == "/predict" and method == "POST":
        status, body = 200, ANSWER
    elif path == "/readyz":
        status, body = 200, READY
    else:
        status, body = 404, b'{"detail":"Not Found"}'
    await send({"type": "http.response.start", "status": status, "headers": _headers(body)})
    await send({"type": "http.response.body", "body": body})


def create_asgi():
    """Uvicorn factory of the bare ASGI floor."""
    return asgi_app


def create_fastapi():
    """Uvicorn factory of the FastAPI floor: one ``/predict`` route (and ``/readyz``)."""
    from fastapi import FastAPI, Request, Response

    app = FastAPI(docs_url=None, redoc_url=None, telemetry={"tracing": False, "metrics": False, "logs": False})

    @app.post("/predict")
    async def predict(request: Request) -> Response:
        await request.body()
        return Response(ANSWER, media_type="application/json")

    @app.get("/readyz")
    async def readyz() -> Response:
        return Response(READY, media_type="application/json")

    return app


FLOORS = {"asgi": "bench.lib.floors:create_asgi", "fastapi": "bench.lib.floors:create_fastapi"}


def uvicorn_settings() -> dict:
    """Our server's uvicorn options (:func:`service.http.server.uvicorn_options`, from the same
    environment), with uvicorn's plain httptools protocol in place of ours."""
    from service.http.server import uvicorn_options
    from service.http.settings import ServerSettings

    return {**uvicorn_options(ServerSettings()), "http": "httptools"}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("floor", choices=sorted(FLOORS), help="which floor app to serve")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on")
    args = parser.parse_args(argv)
    import uvicorn

    uvicorn.run(FLOORS[args.floor], host=args.host, port=args.port, **uvicorn_settings())


if __name__ == "__main__":
    main()
