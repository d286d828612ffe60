"""Peak RSS of a server under the worst requests: a 300 MB body, then a large /predict.

    python -m bench.worst_request --bundle BUNDLE --uids N --shape {per-text|texts-only|flat}

``per-text``: the largest request the limits admit (64 texts of ~2 KB, 64 x 156 uids of 250 B);
``texts-only``: the 64 texts alone; ``flat``: 64 texts and one flat exclude list of N uids (the
500k). Run from a checkout's root: the server is that checkout's code (``python -m`` puts the
working directory first on the path), so the same command measures an older commit in a worktree.
"""

import json
import time
from pathlib import Path

import httpx

from bench.lib.args import REQUIRED, bench_parser
from bench.lib.profiling import memory
from loadtest.localserver import start_server, stop_server

SHAPES = ("per-text", "texts-only", "flat")


def main(argv: list[str] | None = None) -> None:
    parser = bench_parser(__doc__, bundle=REQUIRED, data=None)
    parser.add_argument("--uids", type=int, default=500_000, help="exclude uids of the flat request (default 500000)")
    parser.add_argument("--shape", choices=SHAPES, default="per-text", help="the large /predict request's shape")
    args = parser.parse_args(argv)
    srv = start_server(args.bundle.resolve(), Path("/tmp/worst.log"))
    pid = srv.process.pid
    try:
        httpx.post(srv.url + "/predict", json={"text": "libc6", "k": 10}, timeout=60)
        print("baseline HWM MiB", memory(pid)["peak_rss_mib"])
        # 1) a 300 MB JSON body
        host, port = srv.url.removeprefix("http://").split(":")
        body = b'{"text": "' + b"a" * (300 * 1024 * 1024) + b'"}'
        t = time.time()
        try:
            r = httpx.post(
                srv.url + "/predict", content=body, headers={"content-type": "application/json"}, timeout=120
            )
            print("300MB body ->", r.status_code, r.text[:100], round(time.time() - t, 2), "s")
        except Exception as e:
            print("300MB body ->", type(e).__name__, round(time.time() - t, 2), "s")
        print("after 300MB HWM MiB", memory(pid)["peak_rss_mib"])
        # 2) 64 texts of 2 KB and as many exclude uids as the body cap allows (500k on the old code)
        n = args.uids
        if args.shape == "per-text":  # the largest the new limits admit: 64 x 156 uids of 250 bytes
            uids = [[f"{t}-{i}".ljust(250, "x") for i in range(156)] for t in range(64)]
            big = {"texts": ["libc6 " * 340] * 64, "k": 1000, "exclude": uids}
            n = 64 * 156
        elif args.shape == "texts-only":
            big = {"texts": ["libc6 " * 340] * 64, "k": 1000}
        else:  # the issue's: one flat list
            big = {"texts": ["libc6 " * 340] * 64, "k": 1000, "exclude": [f"u{i}" for i in range(n)]}
        t = time.time()
        r = httpx.post(srv.url + "/predict", json=big, timeout=300)
        print(
            f"64 texts + {n} uids ->",
            r.status_code,
            round(time.time() - t, 2),
            "s",
            len(json.dumps(big)) // 1024,
            "KiB",
        )
        print("after big request HWM MiB", memory(pid)["peak_rss_mib"])
    finally:
        stop_server(srv)


if __name__ == "__main__":
    main()
