"""The ASGI guards on their own: refusals that never reach the app or read the body."""

import asyncio
import json

from service.http.guards import ShedBeforeParsingMiddleware, method_label


async def call(middleware, path="/predict", method="POST"):
    sent, received = [], []

    async def receive():
        received.append(1)
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(message):
        sent.append(message)

    await middleware({"type": "http", "path": path, "method": method, "headers": []}, receive, send)
    return sent, received


def test_an_overloaded_server_refuses_predict_before_reading_the_body():
    reached, shed = [], []

    async def app(scope, receive, send):
        reached.append(scope["path"])

    waits = {"now": 2.0}
    guard = ShedBeforeParsingMiddleware(app, lambda: waits["now"], deadline_s=1.0, on_shed=lambda: shed.append(1))
    sent, received = asyncio.run(call(guard))
    assert sent[0]["status"] == 503 and (b"retry-after", b"1") in sent[0]["headers"]
    assert "deadline" in json.loads(sent[1]["body"])["detail"] and not received and not reached and shed == [1]
    asyncio.run(call(guard, path="/healthz", method="GET"))  # other routes are never shed
    waits["now"] = 0.5
    asyncio.run(call(guard))
    assert reached == ["/healthz", "/predict"]


def test_methods_map_to_a_fixed_set():
    assert method_label("POST") == "POST" and method_label("BREW") == "OTHER" and method_label("post") == "OTHER"
