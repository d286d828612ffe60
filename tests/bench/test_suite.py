"""bench/ is a suite: every benchmark is a ``python -m bench.<name>`` that answers ``--help``
without running, is named by a Makefile target or a line of bench/results/README.md, edits no
``sys.path``, and imports no other benchmark (what they share lives in bench/lib)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.service.test_layers import imports_of

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = sorted(path.stem for path in (ROOT / "bench").glob("*.py") if path.stem != "__init__")


# Runs each benchmark as ``python -m bench.<name> --help`` runs it (runpy, as __main__), all in one
# child process: a process each paid the imports (torch, transformers, faiss) 30 times over, about
# three minutes of the suite.
HELP_ALL = """
import contextlib, io, json, runpy, sys
answers = {}
for name in sys.argv[1:]:
    out, err = io.StringIO(), io.StringIO()
    sys.argv = [f"bench/{name}.py", "--help"]
    code = None
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            runpy.run_module(f"bench.{name}", run_name="__main__", alter_sys=True)
        except SystemExit as exit:
            code = exit.code
        except BaseException as exc:
            code = repr(exc)
    answers[name] = {"code": code, "stdout": out.getvalue()[:500], "stderr": err.getvalue()[-2000:]}
print(json.dumps(answers))
"""


@pytest.fixture(scope="module")
def help_answers() -> dict:
    done = subprocess.run(
        [sys.executable, "-c", HELP_ALL, *BENCHMARKS], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.parametrize("name", BENCHMARKS)
def test_each_benchmark_answers_help_without_running(name, help_answers):
    answer = help_answers[name]
    assert answer["code"] == 0 and answer["stdout"].startswith("usage:"), answer


def test_each_benchmark_is_named_where_it_is_run_from():
    named = (ROOT / "Makefile").read_text() + (ROOT / "bench" / "results" / "README.md").read_text()
    assert not [name for name in BENCHMARKS if f"bench.{name}" not in named]


def test_no_benchmark_edits_sys_path_or_imports_another():
    for path in (ROOT / "bench").rglob("*.py"):
        assert "sys.path" not in path.read_text(), path
        others = {m for m in imports_of(path) if m.startswith("bench.") and not m.startswith("bench.lib")}
        others = {m for m in others if m.removeprefix("bench.") in BENCHMARKS}
        assert not others, f"{path.relative_to(ROOT)} imports {sorted(others)}"
