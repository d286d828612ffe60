"""The CI entry point (.ci/run) and the tests' tool check: CI installs the browser and Prometheus
the tests need before ``make test``, and under ``CI=true`` a missing tool fails a test instead of
skipping it."""

import os
import subprocess
from pathlib import Path

import pytest

from tests.conftest import need_tool

ROOT = Path(__file__).resolve().parents[1]


def test_a_missing_tool_skips_outside_ci_and_fails_under_ci(monkeypatch):
    need_tool(True, "present")  # nothing happens
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="no chromium"):
        need_tool(False, "no chromium")
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="no chromium .*CI=true"):
        need_tool(False, "no chromium")


def stub(bin_dir: Path, name: str, script: str) -> None:
    path = bin_dir / name
    path.write_text(f"#!/bin/bash\n{script}\n")
    path.chmod(0o755)


def run_ci(tmp_path: Path, installed: set[str]) -> tuple[subprocess.CompletedProcess, list[str]]:
    """.ci/run with dpkg-query, apt-get, id and make replaced by stubs that record their calls."""
    bin_dir, calls = tmp_path / "bin", tmp_path / "calls"
    bin_dir.mkdir()
    known = " ".join(sorted(installed))
    stub(bin_dir, "dpkg-query", f'for p in {known}; do [ "${{@: -1}}" = "$p" ] && echo -n installed; done; exit 0')
    stub(bin_dir, "id", "echo 0")
    stub(bin_dir, "apt-get", f'echo "apt-get $*" >> {calls}')
    stub(bin_dir, "make", f'echo "make $* CI=$CI" >> {calls}')
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path)}
    done = subprocess.run(["bash", ROOT / ".ci" / "run"], env=env, capture_output=True, text=True, timeout=60)
    return done, calls.read_text().splitlines() if calls.exists() else []


def test_ci_installs_the_missing_debian_packages_before_make_test(tmp_path):
    done, calls = run_ci(tmp_path, installed={"prometheus"})
    assert done.returncode == 0, done.stderr
    assert calls[0] == "apt-get update -q"
    assert calls[1] == "apt-get install -y -q --no-install-recommends chromium chromium-driver"
    assert calls[2:] == ["make test CI=true"]


def test_ci_installs_nothing_when_the_packages_are_there(tmp_path):
    done, calls = run_ci(tmp_path, installed={"chromium", "chromium-driver", "prometheus"})
    assert done.returncode == 0, done.stderr
    assert calls == ["make test CI=true"]


def test_the_ci_script_is_executable():
    assert os.access(ROOT / ".ci" / "run", os.X_OK)
