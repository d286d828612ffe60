"""Every CLI option has a help string (project rule): ``--help`` is the scripts' documentation;
and every module with a ``main`` runs it when started with ``python -m``.

Walks every tracked ``*.py`` file and flags each ``*.add_argument(...)`` call without ``help=``.
Calls whose only keywords come from a ``**mapping`` are skipped: export/export_params.py builds its
options from a dataclass, and its own test checks their help.
"""

from __future__ import annotations

import ast
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def missing_help(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        if node.func.attr != "add_argument":
            continue
        names = [keyword.arg for keyword in node.keywords]
        if "help" in names or (names and all(name is None for name in names)):
            continue
        found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


def tracked_python_files() -> list[str]:
    files = subprocess.run(
        ["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    assert files, "git ls-files found no Python files"
    return files


def test_every_add_argument_has_help():
    missing = [where for name in tracked_python_files() for where in missing_help(ROOT / name)]
    assert not missing, "add_argument without help=:\n" + "\n".join(missing)


def runs_main_as_script(tree: ast.Module) -> bool:
    """Whether the module has ``if __name__ == "__main__":`` with a call of ``main`` in it."""
    for node in tree.body:
        if not isinstance(node, ast.If):
            continue
        test = ast.unparse(node.test).replace("'", '"')
        if test == '__name__ == "__main__"':
            calls = [n for n in ast.walk(node) if isinstance(n, ast.Call) and ast.unparse(n.func) == "main"]
            return bool(calls)
    return False


def test_every_module_with_a_main_runs_it_as_a_script():
    """A ``main`` that ``python -m`` never calls is a command that silently does nothing (export.fuse
    lost its guard when it was split, and ``make trained-bundle`` then wrote no bundle and said
    nothing). A module run through its package's ``__main__.py`` counts when that file calls it."""
    silent = []
    for name in tracked_python_files():
        path = ROOT / name
        if name.startswith("tests/") or path.name == "__main__.py":
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=name)
        if not any(isinstance(node, ast.FunctionDef) and node.name == "main" for node in tree.body):
            continue
        package_main = path.parent / "__main__.py"
        module = name.removesuffix(".py").replace("/", ".")
        through_package = package_main.is_file() and f"from {module} import main" in package_main.read_text()
        if not (
            runs_main_as_script(tree) or (through_package and runs_main_as_script(ast.parse(package_main.read_text())))
        ):
            silent.append(name)
    assert not silent, "modules whose main() python -m never calls:\n" + "\n".join(silent)
