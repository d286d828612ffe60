"""The container tool the deploy checks drive, whichever is there: docker (with a running engine),
podman, or buildah for builds only. ``CONTAINER_TOOLS=<file>`` names a shell file to source first
that defines ``ctr_build``, ``ctr_run`` and ``ctr_podman`` (how the project's development
machines, which have no Docker engine, build and run images); its functions are used instead.

Standard library only: the checks run with any ``python3``, before any virtualenv exists.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Docker's image format: the OCI format that podman and buildah write by default has no HEALTHCHECK.
DOCKER_FORMAT = ["--format", "docker"]


def project_version() -> str:
    """pyproject.toml's project version (read with a pattern: tomllib needs Python 3.11)."""
    return re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M).group(1)


def image_name(flavour: str) -> str:
    """The one naming scheme: ``xmcserve-<flavour>:<project version>``."""
    return f"xmcserve-{flavour}:{project_version()}"


def _works(command: list[str]) -> bool:
    try:
        return subprocess.run(command, capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@dataclass
class Runtime:
    """``build``/``run``/``cli`` prefixes, each a command line (list) to which arguments are appended."""

    name: str
    build_prefix: list[str]
    run_prefix: list[str] | None
    cli_prefix: list[str] | None

    @classmethod
    def detect(cls) -> Runtime:
        tools = os.environ.get("CONTAINER_TOOLS")
        if tools:

            def function(name: str) -> list[str]:
                script = f'source {shlex.quote(tools)} >/dev/null 2>&1 || exit 125; {name} "$@"'
                return ["bash", "-c", script, name]

            build = [*function("ctr_build"), *DOCKER_FORMAT]
            return cls(f"{tools} (ctr_build/ctr_run)", build, function("ctr_run"), function("ctr_podman"))
        if shutil.which("docker") and _works(["docker", "info"]):
            return cls("docker", ["docker", "build"], ["docker", "run"], ["docker"])
        if shutil.which("podman"):
            return cls("podman", ["podman", "build", "--layers", *DOCKER_FORMAT], ["podman", "run"], ["podman"])
        if shutil.which("buildah"):
            return cls("buildah", ["buildah", "bud", "--layers", *DOCKER_FORMAT], None, None)
        raise SystemExit(
            "no container tool: install docker (with its engine running), podman or buildah, "
            "or set CONTAINER_TOOLS to a file defining ctr_build/ctr_run/ctr_podman"
        )

    def build(
        self,
        dockerfile: str,
        tag: str,
        build_args: dict[str, str] | None = None,
        log: Path | None = None,
        keep_layers: bool = True,
    ) -> dict[str, float]:
        """Build ``tag`` from ``dockerfile`` with the repository as context. Returns the seconds
        until the image was created (its timestamp) and until the tool exited: podman and
        buildah then remove their intermediate containers, which on vfs storage takes minutes.
        ``keep_layers=False`` (podman, buildah): no intermediate layer images, since vfs storage
        keeps a full copy of the root filesystem for each; docker's layers share files anyway."""
        args = [f"--build-arg={k}={v}" for k, v in (build_args or {}).items()]
        if not keep_layers and self.name != "docker":
            args.append("--layers=false")  # after the prefix's --layers: the later flag wins
        command = [*self.build_prefix, "-f", dockerfile, "-t", tag, *args, str(ROOT)]
        started_wall, started = time.time(), time.monotonic()
        with open(log or os.devnull, "w") as out:
            code = subprocess.run(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT).returncode
        if code != 0:
            raise SystemExit(f"building {tag} from {dockerfile} failed (exit {code}); log: {log}")
        total = time.monotonic() - started
        created = self.image_created(tag) if self.cli_prefix else None
        to_image = created - started_wall if created and 0 < created - started_wall <= total + 1 else total
        return {"tagged": round(to_image, 1), "total": round(total, 1)}

    def image_created(self, tag: str) -> float | None:
        """The image's creation time (epoch seconds) from docker's or podman's inspect output."""
        from datetime import datetime, timezone

        text = self.cli("image", "inspect", "--format", "{{.Created}}", tag, check=False)
        match = re.match(r"(\d{4}-\d\d-\d\d)[T ](\d\d:\d\d:\d\d)(\.\d+)?", text)
        if not match:
            return None
        stamp = datetime.strptime(f"{match[1]} {match[2]}", "%Y-%m-%d %H:%M:%S").replace(tzinfo=timezone.utc)
        return stamp.timestamp() + float(match[3] or 0)

    def cli(self, *args: str, check: bool = True, timeout: float = 120) -> str:
        if self.cli_prefix is None:
            raise SystemExit(f"{self.name} builds images but cannot run them: install podman or docker")
        done = subprocess.run([*self.cli_prefix, *args], capture_output=True, text=True, timeout=timeout)
        if check and done.returncode != 0:
            raise RuntimeError(f"{' '.join(args[:2])} failed: {done.stderr.strip()}")
        return done.stdout.strip()

    def run_detached(self, name: str, image: str, *args: str, command: list[str] | None = None) -> None:
        """Start a container on the host's network (the dev VMs have no other working network)."""
        if self.run_prefix is None:
            raise SystemExit(f"{self.name} builds images but cannot run them: install podman or docker")
        self.cli("rm", "-f", name, check=False)
        full = [*self.run_prefix, "-d", "--name", name, "--network=host", *args, image, *(command or [])]
        done = subprocess.run(full, capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"starting {name} failed: {done.stderr.strip()}")

    def run_once(
        self, image: str, *args: str, command: list[str] | None = None, timeout: float = 900
    ) -> subprocess.CompletedProcess:
        if self.run_prefix is None:
            raise SystemExit(f"{self.name} builds images but cannot run them: install podman or docker")
        full = [*self.run_prefix, "--rm", "--network=host", *args, image, *(command or [])]
        return subprocess.run(full, capture_output=True, text=True, timeout=timeout)

    def image_bytes(self, tag: str) -> int:
        return int(self.cli("image", "inspect", "--format", "{{.Size}}", tag))

    def has_image(self, tag: str) -> bool:
        return self.cli_prefix is not None and _works([*self.cli_prefix, "image", "inspect", tag])

    def remove(self, name: str) -> None:
        self.cli("rm", "-f", name, check=False)
