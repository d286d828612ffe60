"""loadtest.loadgen.spread: loads dealt over load-generator processes share one window and come
back merged and one by one; the loops post to the path they are given."""

import asyncio
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from loadtest.loadgen import Job, closed_loop, open_loop, spread

PATHS: list[str] = []


class Answer(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as the load generator expects

    def do_POST(self):
        PATHS.append(self.path)
        self.rfile.read(int(self.headers["Content-Length"]))
        body = b'{"ok": true}'
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


class Server(ThreadingHTTPServer):
    def handle_error(self, request, client_address):
        pass  # a client cut off at its timeout is what one test does


@pytest.fixture
def url():
    server = Server(("127.0.0.1", 0), Answer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_spread_over_two_processes_merges_the_loads_and_keeps_each(url):
    bodies = [b'{"text": "a"}']
    merged, each = spread([Job(url, concurrency=2), Job(url, rps=50)], bodies, 1.0, processes=2, timeout_s=60)
    assert [r.mode for r in each] == ["closed", "open"]
    assert all(r.statuses.get(200, 0) > 0 for r in each)
    assert merged.statuses[200] == sum(r.statuses[200] for r in each)
    assert merged.concurrency == 2 and merged.target_rps == 50
    assert merged.summary()["qps"] > 0


def test_spread_in_this_process_gives_up_at_its_timeout(url):
    with pytest.raises(TimeoutError):
        spread([Job(url, concurrency=1)], [b"{}"], 5.0, processes=1, timeout_s=0.5)


def test_a_failing_generator_process_is_reported_at_once(url):
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="load generator failed"):
        # nothing listens on port 1: the second process cannot connect
        spread([Job(url, concurrency=1), Job("http://127.0.0.1:1", concurrency=1)], [b"{}"], 20.0, 2, timeout_s=60)
    assert time.monotonic() - started < 15


def test_the_loops_post_to_predict_or_to_the_path_given(url):
    PATHS.clear()
    asyncio.run(closed_loop(url, [b"{}"], 1, 5.0, max_requests=2))
    asyncio.run(closed_loop(url, [b"{}"], 1, 5.0, max_requests=2, path="/embeddings"))
    asyncio.run(open_loop(url, [b"{}"], 20.0, 0.1, path="/embeddings"))
    assert PATHS == ["/predict"] * 2 + ["/embeddings"] * 4
