"""The serving image installs the core dependencies and one ONNX Runtime extra (``.[cpu]`` or
``.[gpu]``) and nothing else, so every third-party module service/ imports — at the top of a
module or inside a function, as the shadow worker child does — must come from one of them. The
Ray Serve front end runs in Ray's own image and is checked against the ``ray`` extra."""

import ast
import contextlib
import re
import sys
from importlib.metadata import PackageNotFoundError, packages_distributions, requires
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")

ROOT = Path(__file__).resolve().parents[2]
OWN = {"xmc", "bundle", "engine", "service", "training", "export", "xmcserve"}


def imported_top_level(paths) -> set[str]:
    names = set()
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return names - set(sys.stdlib_module_names) - OWN - {"__future__"}


def normalised(requirement: str) -> str:
    """The distribution name of a requirement, PEP 503-normalised (``ray[serve]==2.60`` → ``ray``)."""
    return re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9_.-]+", requirement)[0]).lower()


def declared(*extras: str) -> set[str]:
    """The distributions ``pip install .[extras]`` installs: the declared ones and, recursively,
    what they require (fastapi brings starlette and anyio)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = list(project["dependencies"])
    for extra in extras:
        requirements += project["optional-dependencies"][extra]
    todo, found = [normalised(r) for r in requirements], set()
    while todo:
        name = todo.pop()
        if name in found:
            continue
        found.add(name)
        with contextlib.suppress(PackageNotFoundError):  # a declared distribution this environment lacks
            todo += [normalised(r) for r in requires(name) or [] if "extra ==" not in r]
    return found


def undeclared(paths, extras) -> dict[str, list[str]]:
    """Third-party modules imported by ``paths`` that no declared distribution provides."""
    providers = packages_distributions()
    allowed = declared(*extras)
    missing = {}
    for module in sorted(imported_top_level(paths)):
        dists = {normalised(d) for d in providers.get(module, [])}
        if not dists & allowed:
            missing[module] = sorted(dists) or ["<not installed>"]
    return missing


def test_the_serving_process_imports_only_core_and_onnxruntime_dependencies():
    # the serving process runs service/ (but the Ray front end), the engine under it and the
    # bundle format they read
    paths = [p for p in (ROOT / "service").rglob("*.py") if "ray_serve" not in p.parts]
    paths += [*(ROOT / "engine").rglob("*.py"), *(ROOT / "bundle").rglob("*.py")]
    assert undeclared(paths, ["cpu"]) == {}


def test_the_ray_front_end_imports_only_what_its_image_installs():
    assert undeclared((ROOT / "service" / "ray_serve").rglob("*.py"), ["cpu", "ray"]) == {}


def test_an_undeclared_import_is_found(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("def f():\n    import sklearn\n")  # scikit-learn is a training dependency only
    assert undeclared([module], ["cpu"]) == {"sklearn": ["scikit-learn"]}
