"""bench/ is a suite: every benchmark is a ``python -m bench.<name>`` that answers ``--help``
without running, is named by a Makefile target or a line of bench/results/README.md, edits no
``sys.path``, and imports no other benchmark (what they share lives in bench/lib)."""

import subprocess
import sys
from pathlib import Path

import pytest

from tests.service.test_layers import imports_of

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = sorted(path.stem for path in (ROOT / "bench").glob("*.py") if path.stem != "__init__")


@pytest.mark.parametrize("name", BENCHMARKS)
def test_each_benchmark_answers_help_without_running(name):
    done = subprocess.run(
        [sys.executable, "-m", f"bench.{name}", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("usage:"), done.stdout[:500]


def test_each_benchmark_is_named_where_it_is_run_from():
    named = (ROOT / "Makefile").read_text() + (ROOT / "bench" / "results" / "README.md").read_text()
    assert not [name for name in BENCHMARKS if f"bench.{name}" not in named]


def test_no_benchmark_edits_sys_path_or_imports_another():
    for path in (ROOT / "bench").rglob("*.py"):
        assert "sys.path" not in path.read_text(), path
        others = {m for m in imports_of(path) if m.startswith("bench.") and not m.startswith("bench.lib")}
        others = {m for m in others if m.removeprefix("bench.") in BENCHMARKS}
        assert not others, f"{path.relative_to(ROOT)} imports {sorted(others)}"
