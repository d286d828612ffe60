"""The lab is a suite: every benchmark (``python -m bench.<name>``), study (``python -m
studies.<name>``, a folder with its README.md) and tool (``python -m tools.<name>``) answers
``--help`` without running and is named where it is run from; none edits ``sys.path``; no benchmark
imports another, no study another study or a benchmark (what they share is bench/lib, the harness,
and studies/lib), and none of them imports the tests, but the screenshot tool, which drives the
rollout page with the page tests' browser."""

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = sorted(path.stem for path in (ROOT / "bench").glob("*.py") if path.stem != "__init__")
STUDIES = sorted(path.parent.name for path in (ROOT / "studies").glob("*/__main__.py"))
TOOLS = ["gpu", "gpu.payload", "rollout_screenshots"]
COMMANDS = [f"bench.{n}" for n in BENCHMARKS] + [f"studies.{n}" for n in STUDIES] + [f"tools.{n}" for n in TOOLS]
LAB = ("bench", "studies", "tools")


# Runs each command as ``python -m <module> --help`` runs it (runpy, as __main__), all in one child
# process: a process each paid the imports (torch, transformers, faiss) 40 times over, minutes of the
# suite.
HELP_ALL = """
import contextlib, io, json, runpy, sys
answers = {}
for name in sys.argv[1:]:
    out, err = io.StringIO(), io.StringIO()
    sys.argv = [name, "--help"]
    code = None
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            runpy.run_module(name, run_name="__main__", alter_sys=True)
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
        [sys.executable, "-c", HELP_ALL, *COMMANDS], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.parametrize("name", COMMANDS)
def test_each_command_answers_help_without_running(name, help_answers):
    answer = help_answers[name]
    assert answer["code"] == 0 and answer["stdout"].startswith("usage:"), answer


def test_each_benchmark_is_named_where_it_is_run_from():
    named = (ROOT / "Makefile").read_text() + (ROOT / "bench" / "results" / "README.md").read_text()
    assert not [name for name in BENCHMARKS if f"bench.{name}" not in named]


def test_each_study_is_a_package_with_its_readme_naming_its_command():
    for name in STUDIES:
        folder = ROOT / "studies" / name
        assert (folder / "__init__.py").is_file() and (folder / "run.py").is_file(), name
        readme = folder / "README.md"
        assert readme.is_file() and f"-m studies.{name}" in readme.read_text(), readme


def test_nothing_in_the_lab_edits_sys_path():
    assert not [path for lab in LAB for path in (ROOT / lab).rglob("*.py") if "sys.path" in path.read_text()]


def lab_imports(path: Path) -> set[str]:
    """The modules of the lab and of the tests an import statement anywhere in the file names."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return {module for module in found if module.split(".")[0] in (*LAB, "tests")}


# (file, the one import of the tests it may make): the docs' screenshots drive the rollout page with
# the browser the page tests use
MAY_IMPORT_TESTS = {("tools", "rollout_screenshots.py"): "tests.support.browser"}


def wrong_lab_imports(root: Path) -> list[str]:
    """Imports in bench/, studies/ and tools/ of another benchmark, study or tool, or of the tests;
    bench.lib and studies.lib are shared, and a module may import its own folder's."""
    wrong = []
    for lab in LAB:
        for path in sorted((root / lab).rglob("*.py")):
            parts = path.relative_to(root).parts
            own = ".".join(parts[:2]).removesuffix(".py")  # bench.serving, studies.quality, tools.gpu
            for module in sorted(lab_imports(path)):
                shared = module.startswith(("bench.lib", "studies.lib")) or "." not in module
                if shared or module == own or module.startswith(own + ".") or MAY_IMPORT_TESTS.get(parts) == module:
                    continue
                wrong.append(f"{path.relative_to(root)} imports {module}")
    return wrong


def test_no_benchmark_imports_another_and_no_study_another_study_a_benchmark_or_the_tests():
    wrong = wrong_lab_imports(ROOT)
    assert not wrong, "\n".join(wrong)


def test_the_check_sees_a_study_importing_another_a_benchmark_and_the_tests(tmp_path):
    for folder in LAB:
        (tmp_path / folder).mkdir()
    (tmp_path / "studies" / "one").mkdir()
    (tmp_path / "studies" / "one" / "run.py").write_text(
        "from studies.two.run import main\nfrom studies.one.run import x\nfrom bench.lib.latency import measure\n"
        "import bench.serving\nfrom tests.support.browser import LAPTOP\n"
    )
    assert wrong_lab_imports(tmp_path) == [
        "studies/one/run.py imports bench.serving",
        "studies/one/run.py imports studies.two.run",
        "studies/one/run.py imports tests.support.browser",
    ]
