"""Server memory held by clients that ask for a large answer and never read it.

    python -m bench.unread_answers [--out bench/results/unread-answers.json]

A uvicorn server with ``python -m service.http``'s protocol answers each of 16 clients (receive
buffer 4 KiB, reading nothing) 8 MiB, with the write timeout at 1 s and at 10^6 s (in effect none,
uvicorn's own behaviour); the bytes the server's transports hold for them (answers not yet handed
to the kernel) and the open connections are sampled 1 s and 4 s after the requests. Run from a
checkout's root.
"""

import argparse
import asyncio
import json
import socket
import threading
import time
from pathlib import Path

import uvicorn

from service.http.server import uvicorn_options
from service.http.settings import ServerSettings
from xmc.results import write_result

CLIENTS, ANSWER_BYTES = 16, 8 << 20


async def answer(scope, receive, send):
    if scope["type"] != "http":
        return
    await receive()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"%d" % ANSWER_BYTES)]})
    await send({"type": "http.response.body", "body": b"x" * ANSWER_BYTES})


def buffered_mib(server: uvicorn.Server) -> float:
    connections = list(server.server_state.connections)
    return round(sum(c.transport.get_write_buffer_size() for c in connections if c.transport) / 2**20, 1)


def run(write_timeout_s: float) -> dict:
    settings = ServerSettings(write_timeout_s=write_timeout_s, header_timeout_s=60)
    config = uvicorn.Config(answer, host="127.0.0.1", port=0, **uvicorn_options(settings) | {"factory": False})
    server = uvicorn.Server(config)
    thread = threading.Thread(target=asyncio.run, args=(server.serve(),), daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    clients = []
    for _ in range(CLIENTS):
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", port))
        sock.sendall(b"GET / HTTP/1.1\r\nhost: bench\r\n\r\n")
        clients.append(sock)
    samples = {}
    for at in (1, 4):
        time.sleep(at - sum(samples) if samples else at)
        samples[at] = {"buffered_mib": buffered_mib(server), "connections": len(server.server_state.connections)}
    for sock in clients:
        sock.close()
    server.should_exit = True
    thread.join(30)
    return {"write_timeout_s": write_timeout_s, "after_s": samples}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None, help="JSON result file (default: print only)")
    args = parser.parse_args(argv)
    results = {"clients": CLIENTS, "answer_bytes": ANSWER_BYTES, "runs": [run(1e6), run(1.0), run(1e6), run(1.0)]}
    print(json.dumps(results, indent=1))
    if args.out:
        write_result(args.out, results)


if __name__ == "__main__":
    main()
