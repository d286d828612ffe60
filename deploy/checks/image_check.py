"""Run the serving image as a user would and check it: a bundle mounted read-only, a read-only
root filesystem, /readyz, a /predict, /metrics, the image's HEALTHCHECK command, no torch and no
compiler inside, and a SIGTERM that drains (requests in progress answered, exit status 0, well
within the grace period). Prints one line per check; exits 1 on the first failure.

    python3 deploy/checks/image_check.py [--bundle bundles/default] [--image TAG] [--env KEY=VALUE ...]

Without a built bundle it builds one with the train image first, as the compose `bundle` service
does. Images come from ``make images``; the container tool from deploy/checks/runtime.py.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from runtime import ROOT, Runtime, image_name

GRACE_S = 30  # what compose and k8s give the server: XMCSERVE_GRACEFUL_SHUTDOWN_S (20) + margin


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(method: str, url: str, body: dict | None = None, timeout: float = 10) -> tuple[int, bytes]:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def wait_ready(url: str, seconds: float) -> float:
    started = time.monotonic()
    while time.monotonic() - started < seconds:
        try:
            if http("GET", f"{url}/readyz", timeout=2)[0] == 200:
                return time.monotonic() - started
        except OSError:
            pass
        time.sleep(1)
    raise AssertionError(f"{url}/readyz not 200 within {seconds:.0f} s")


def ensure_bundle(runtime: Runtime, bundle: Path | None) -> Path:
    """The bundle to mount: the one given, the host's default, or one built by the train image."""
    for candidate in (bundle, ROOT / "bundles/default"):
        if candidate and (candidate / "manifest.json").exists():
            return candidate.resolve()
    if bundle:
        raise SystemExit(f"{bundle} holds no manifest.json")
    out = ROOT / "build/check-bundles"
    if not (out / "default/manifest.json").exists():
        out.mkdir(parents=True, exist_ok=True)
        print(f"building the default bundle with {image_name('train')} into {out}/default ...", flush=True)
        done = runtime.run_once(image_name("train"), "--user", "0", "-v", f"{out}:/bundles")
        if done.returncode != 0:
            raise SystemExit(f"bundle build failed:\n{done.stdout[-2000:]}{done.stderr[-4000:]}")
    return out / "default"


class Checks:
    def __init__(self):
        self.results: dict[str, str] = {}

    def __call__(self, name: str, detail: str) -> None:
        self.results[name] = detail
        print(f"ok  {name}: {detail}", flush=True)


def drain_under_load(runtime: Runtime, name: str, url: str, body: dict) -> dict:
    """Keep 4 clients sending /predict, send SIGTERM (``stop -t GRACE_S``), count the answers."""
    counts = {"200": 0, "refused": 0, "other": 0}
    errors: list[str] = []
    stop = threading.Event()
    lock = threading.Lock()

    def client() -> None:
        deadline = time.monotonic() + GRACE_S + 10
        while not stop.is_set() and time.monotonic() < deadline:
            try:
                status, _ = http("POST", f"{url}/predict", body, timeout=GRACE_S)
                key = "200" if status == 200 else "other"
                if key == "other":
                    errors.append(f"HTTP {status}")
            except (ConnectionRefusedError, urllib.error.URLError) as exc:
                reason = getattr(exc, "reason", exc)
                key = "refused" if isinstance(reason, ConnectionRefusedError) else "other"
                if key == "other":
                    errors.append(repr(reason))
                time.sleep(0.05)
            except OSError as exc:  # reset or closed mid-request: an answer lost
                key = "other"
                errors.append(repr(exc))
            with lock:
                counts[key] += 1
            if key == "refused":
                return  # the listener is gone: the server stopped accepting, as it should

    threads = [threading.Thread(target=client) for _ in range(4)]
    for t in threads:
        t.start()
    time.sleep(2)
    started = time.monotonic()
    runtime.cli("stop", "-t", str(GRACE_S), name, timeout=GRACE_S + 30)
    seconds = time.monotonic() - started
    stop.set()
    for t in threads:
        t.join(timeout=GRACE_S + 15)
    exit_code = int(runtime.cli("inspect", "--format", "{{.State.ExitCode}}", name))
    logs = runtime.cli("logs", name, check=False)
    return {
        "stop_seconds": round(seconds, 2),
        "exit_code": exit_code,
        "answers": counts,
        "errors": errors[:5],
        "logs": logs,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--bundle", type=Path, default=None, help="bundle directory to mount (default: bundles/default, else built)"
    )
    parser.add_argument("--image", default=image_name("serve"), help="serving image to check")
    parser.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="environment for the server (repeatable), e.g. XMCSERVE_PROVIDERS=cpu for the CUDA image without a GPU",
    )
    parser.add_argument("--ready-seconds", type=float, default=180, help="how long the server may take to become ready")
    parser.add_argument("--out", type=Path, default=None, help="merge the results into this JSON file")
    args = parser.parse_args(argv)

    runtime = Runtime.detect()
    check = Checks()
    bundle = ensure_bundle(runtime, args.bundle)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    name = "xmcserve-image-check"
    healthcheck = json.loads(
        runtime.cli("image", "inspect", "--format", "{{json .Config.Healthcheck}}", args.image) or "null"
    )
    assert healthcheck and "/readyz" in " ".join(healthcheck["Test"]), (
        f"no /readyz HEALTHCHECK in {args.image}: {healthcheck}"
    )
    check("healthcheck kept", " ".join(healthcheck["Test"][1:])[:80])
    # The compose/k8s settings: bundle read-only, root filesystem read-only with a /tmp of its own.
    runtime.run_detached(
        name,
        args.image,
        "--read-only",
        "--tmpfs",
        "/tmp",
        "-v",
        f"{bundle}:/bundles/default:ro",
        *(flag for pair in args.env for flag in ("-e", pair)),
        command=["xmcserve", "serve", "--host", "127.0.0.1", "--port", str(port)],
    )
    try:
        ready_s = wait_ready(url, args.ready_seconds)
        check(
            "/readyz", f"200 after {ready_s:.1f} s (bundle {bundle.name} mounted read-only, root filesystem read-only)"
        )
        body = {"text": "How do I configure a static IP address on a Debian server?", "k": 5}
        status, answer = http("POST", f"{url}/predict", body)
        assert status == 200, (status, answer[:300])
        check("/predict", answer.decode()[:160])
        status, metrics = http("GET", f"{url}/metrics")
        assert status == 200 and b"xmcserve_" in metrics, status
        families = sorted(
            {line.split()[2] for line in metrics.decode().splitlines() if line.startswith("# TYPE xmcserve_")}
        )
        check("/metrics", f"{len(families)} xmcserve_* families, e.g. {', '.join(families[:3])}")
        # The image's own HEALTHCHECK command, run inside the container against this port.
        probe = " ".join(healthcheck["Test"][1:]).replace("8000", str(port)).split(" ", 2)
        runtime.cli("exec", name, *probe)
        check("HEALTHCHECK command", "exit 0 inside the container")
        torch = runtime.cli("exec", name, "python", "-c", "import importlib.util as u; print(u.find_spec('torch'))")
        compilers = runtime.cli("exec", name, "sh", "-c", "command -v gcc g++ cc c++ clang || true")
        user = runtime.cli("exec", name, "id", "-u")
        assert torch == "None" and not compilers and user != "0", (torch, compilers, user)
        check("contents", f"no torch, no compiler, uid {user}")
        drain = drain_under_load(runtime, name, url, body)
        logs = drain.pop("logs")
        assert drain["exit_code"] == 0, (drain, logs[-1500:])
        assert drain["answers"]["other"] == 0, drain
        assert drain["stop_seconds"] < GRACE_S, drain
        check("SIGTERM drain", json.dumps(drain))
    except Exception:
        print(runtime.cli("logs", name, check=False)[-3000:], file=sys.stderr)
        raise
    finally:
        runtime.remove(name)
    if args.out:
        record = json.loads(args.out.read_text()) if args.out.exists() else {}
        key = "image_check" if args.image == image_name("serve") else f"image_check {args.image}"
        record[key] = {"image": args.image, "env": args.env, "runtime": runtime.name, "checks": check.results}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
