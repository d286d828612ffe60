"""The serving benchmark's OTLP/HTTP trace receiver, in a process of its own (so that the load
generator does not share its interpreter): it answers every export with an empty OTLP success and
counts them, without decoding (a collector's work is not the server's cost).

    python -m bench.lib.otlp_receiver --port N
"""

from __future__ import annotations

import argparse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, required=True, help="port to listen on, on 127.0.0.1")
    args = parser.parse_args(argv)
    received = {"exports": 0, "bytes": 0}

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            received["bytes"] += len(self.rfile.read(int(self.headers.get("content-length", 0))))
            received["exports"] += 1
            self.send_response(200)
            self.send_header("content-type", "application/x-protobuf")
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", args.port), Handler)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        print(received, flush=True)


if __name__ == "__main__":
    main()
