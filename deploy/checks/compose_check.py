"""Bring up the compose stack's services as containers and check them: the bundle one-shot, the
shadow, the API mirroring to it, Prometheus scraping both, and a short headless locust run from
the load generator image that must pass its SLO. Every service's image, command, user, CPU cap,
environment, volumes, read-only root and stop grace period come from docker-compose.yml.

    python3 deploy/checks/compose_check.py [--seconds 30] [--users 8] [--out results.json]

All containers share the host's network (``--network=host``: the development VMs have no
other working container network), so the compose service names become 127.0.0.1 with free
ports: every ``http://<service>:8000`` in the environment and Prometheus' targets is rewritten
to its port. Grafana is not run (its image cannot be made from Debian's archive here); its
provisioning files are checked statically by tests/deploy/test_manifests.py. Needs PyYAML.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
import urllib.parse
from pathlib import Path

from image_check import free_port, http, wait_ready
from runtime import ROOT, Runtime

try:
    import yaml
except ImportError:
    raise SystemExit("the compose check reads docker-compose.yml with PyYAML: run it with .venv/bin/python") from None

PROJECT = "xmcserve-check"
SLO_ARGS = ["--p99-ms", "250", "--max-failure-ratio", "0.01", "--min-rps", "20"]  # the Makefile's LOADTEST_ARGS


def interpolate(value: str) -> str:
    """Compose's ``${VAR:-default}`` and ``${VAR}`` from this environment."""
    return re.sub(r"\$\{(\w+)(?::-([^}]*))?\}", lambda m: os.environ.get(m.group(1)) or (m.group(2) or ""), str(value))


def seconds_of(duration: str) -> int:
    match = re.fullmatch(r"(\d+)s", str(duration))
    assert match, f"stop_grace_period {duration!r}: write it in seconds, e.g. 30s"
    return int(match.group(1))


class Stack:
    def __init__(self, runtime: Runtime, compose: dict, ports: dict[str, int]):
        self.runtime = runtime
        self.services = compose["services"]
        self.ports = ports  # compose service -> its port on the host
        self.started: list[str] = []

    def rewrite(self, value: str) -> str:
        for service, port in self.ports.items():
            value = value.replace(f"{service}:8000", f"127.0.0.1:{port}").replace(
                f"{service}:9090", f"127.0.0.1:{port}"
            )
        return value

    def run_args(self, name: str) -> list[str]:
        """docker/podman run flags for a compose service (host network)."""
        service = self.services[name]
        args: list[str] = []
        if "user" in service:
            args += ["--user", str(service["user"])]
        for key, value in (service.get("environment") or {}).items():
            args += ["-e", f"{key}={self.rewrite(interpolate(value))}"]
        for volume in service.get("volumes") or []:
            source, _, rest = volume.partition(":")
            # a path beside the compose file, or a named volume (named as compose names them)
            source = str((ROOT / source).resolve()) if source.startswith(".") else f"{PROJECT}_{source}"
            args += ["-v", f"{source}:{rest}"]
        if "cpus" in service:
            args += ["--cpus", interpolate(service["cpus"])]
        if service.get("read_only"):
            args.append("--read-only")
        for path in service.get("tmpfs") or []:
            args += ["--tmpfs", path]
        return args

    def container(self, name: str) -> str:
        return f"{PROJECT}-{name}"

    def start_server(self, name: str) -> str:
        """An xmcserve service (api, shadow) on its port; returns its URL once /readyz answers."""
        port = self.ports[name]
        command = ["xmcserve", "serve", "--host", "127.0.0.1", "--port", str(port)]
        self.runtime.run_detached(
            self.container(name), self.services[name]["image"], *self.run_args(name), command=command
        )
        self.started.append(self.container(name))
        url = f"http://127.0.0.1:{port}"
        wait_ready(url, 240)
        return url

    def stop(self, name: str) -> dict:
        grace = seconds_of(self.services[name].get("stop_grace_period", "10s"))
        started = time.monotonic()
        self.runtime.cli("stop", "-t", str(grace), self.container(name), timeout=grace + 30)
        code = int(self.runtime.cli("inspect", "--format", "{{.State.ExitCode}}", self.container(name)))
        return {"stop_seconds": round(time.monotonic() - started, 1), "exit_code": code, "grace_s": grace}

    def remove_all(self) -> None:
        for container in reversed(self.started):
            self.runtime.remove(container)


def prometheus_image(runtime: Runtime, image: str) -> str:
    """The compose file's Prometheus image; where it cannot be pulled, a stand-in under its name."""
    if runtime.has_image(image):
        return image
    try:
        runtime.cli("pull", image, timeout=90)
        return image
    except Exception as exc:  # no registry here: Debian's Prometheus package under the same name
        print(f"cannot pull {image} ({str(exc)[:120]}); building a stand-in from Debian's prometheus", flush=True)
        runtime.build("deploy/checks/standins/prometheus.Containerfile", image)
        return image


def prom_query(url: str, query: str) -> list[dict]:
    status, body = http("GET", f"{url}/api/v1/query?query={urllib.parse.quote(query)}")
    assert status == 200, (status, body[:200])
    return json.loads(body)["data"]["result"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=30, help="length of the locust run")
    parser.add_argument("--users", type=int, default=8, help="locust users")
    parser.add_argument("--out", type=Path, default=None, help="merge the results into this JSON file")
    parser.add_argument(
        "--bundle",
        type=Path,
        default=None,
        help="seed the bundles volume's default bundle from this directory instead of running the bundle service",
    )
    args = parser.parse_args(argv)
    runtime = Runtime.detect()
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    stack = Stack(runtime, compose, {name: free_port() for name in ("api", "shadow", "prometheus")})
    results: dict = {"runtime": runtime.name, "ports": stack.ports}
    try:
        started = time.monotonic()
        bundle = services["bundle"]
        if args.bundle:  # the volume gets a bundle built elsewhere; the bundle service is not run
            volume = f"{PROJECT}_bundles:/bundles"
            copy = ["sh", "-c", "rm -rf /bundles/default && cp -r /seed /bundles/default"]
            done = runtime.run_once(
                services["api"]["image"],
                "--user",
                "0",
                "-v",
                volume,
                "-v",
                f"{args.bundle.resolve()}:/seed:ro",
                command=copy,
            )
            results["bundle"] = f"seeded from {args.bundle} (the bundle service was not run)"
        else:
            done = runtime.run_once(bundle["image"], *stack.run_args("bundle"), command=bundle["command"], timeout=1800)
            results["bundle"] = f"the bundle service exited 0 after {time.monotonic() - started:.0f} s"
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
        print(f"ok  bundle: {results['bundle']}", flush=True)

        shadow_url = stack.start_server("shadow")
        print(f"ok  shadow: ready at {shadow_url}", flush=True)
        api_url = stack.start_server("api")
        print(f"ok  api: ready at {api_url}, mirroring to the shadow", flush=True)

        prometheus = services["prometheus"]
        config = yaml.safe_load((ROOT / "deploy/prometheus.yml").read_text())
        for job in config["scrape_configs"]:
            for static in job["static_configs"]:
                static["targets"] = [stack.rewrite(t) for t in static["targets"]]
        prom_dir = Path(tempfile.mkdtemp(prefix="xmcserve-prometheus-"))
        (prom_dir / "prometheus.yml").write_text(yaml.safe_dump(config))
        prom_dir.chmod(0o755)
        (prom_dir / "prometheus.yml").chmod(0o644)
        prom_port = stack.ports["prometheus"]
        image = prometheus_image(runtime, prometheus["image"])
        command = [
            "--config.file=/etc/prometheus/prometheus.yml",
            "--storage.tsdb.path=/prometheus",
            f"--web.listen-address=127.0.0.1:{prom_port}",
        ]
        runtime.run_detached(
            stack.container("prometheus"),
            image,
            "-v",
            f"{prom_dir}/prometheus.yml:/etc/prometheus/prometheus.yml:ro",
            command=command,
        )
        stack.started.append(stack.container("prometheus"))
        prom_url = f"http://127.0.0.1:{prom_port}"

        loadtest = services["locust-master"]["image"]
        command = ["python", "-m", "loadtest.run", "--host", api_url, "--seconds", str(args.seconds)]
        command += ["--users", str(args.users), "--ab-keys", "--results", "/tmp/loadtest-results", *SLO_ARGS]
        done = runtime.run_once(loadtest, command=command, timeout=args.seconds + 180)
        print(done.stdout[-2500:], flush=True)
        # judged after the rest is checked and the stack stopped, so that a miss still reports them
        locust_code = done.returncode
        results["locust"] = {
            "command": " ".join(command[2:]),
            "exit_code": locust_code,
            "table": [line for line in done.stdout.strip().splitlines() if line and not line.startswith("-")][-8:],
        }
        if locust_code == 2:
            raise AssertionError(f"locust itself failed: {done.stderr[-2000:]}")

        deadline = time.monotonic() + 60
        while True:  # scrapes every 5 s: wait for both targets up and counts after the load
            status, body = http("GET", f"{prom_url}/api/v1/targets")
            targets = json.loads(body)["data"]["activeTargets"] if status == 200 else []
            health = {t["labels"]["job"]: t["health"] for t in targets}
            mirrored = prom_query(prom_url, 'sum(xmcserve_predicted_texts_total{job="xmcserve-shadow"})')
            compared = prom_query(prom_url, 'sum(xmcserve_shadow_compared_texts_total{job="xmcserve-api"})')
            answered = prom_query(prom_url, 'sum(xmcserve_predicted_texts_total{job="xmcserve-api"})')
            values = [float(r[0]["value"][1]) if r else 0.0 for r in (answered, mirrored, compared)]
            if (set(health.values()) == {"up"} and len(health) == 2 and min(values) > 0) or time.monotonic() > deadline:
                break
            time.sleep(5)
        results["prometheus"] = {
            "targets": health,
            "api_texts": values[0],
            "shadow_texts": values[1],
            "compared_texts": values[2],
        }
        assert set(health.values()) == {"up"} and len(health) == 2, health
        assert min(values) > 0, results["prometheus"]
        print(f"ok  prometheus: {json.dumps(results['prometheus'])}", flush=True)

        results["stop"] = {name: stack.stop(name) for name in ("api", "shadow")}
        assert all(s["exit_code"] == 0 and s["stop_seconds"] < s["grace_s"] for s in results["stop"].values()), results[
            "stop"
        ]
        print(f"ok  stop: {json.dumps(results['stop'])}", flush=True)
        results["grafana"] = "not run: no image from Debian's archive; provisioning checked by tests/deploy"
        results["passed"] = locust_code == 0
        if args.out:
            record = json.loads(args.out.read_text()) if args.out.exists() else {}
            record["compose_check"] = results
            args.out.write_text(json.dumps(record, indent=2) + "\n")
        assert locust_code == 0, "the locust run missed its SLO (table above)"
        print("ok  locust: SLO passed through the load generator container", flush=True)
    except Exception:
        for container in stack.started:
            print(f"--- {container}\n{runtime.cli('logs', container, check=False)[-2000:]}", file=sys.stderr)
        raise
    finally:
        stack.remove_all()
    return 0


if __name__ == "__main__":
    sys.exit(main())
