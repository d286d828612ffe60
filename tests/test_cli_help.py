"""Every CLI option has a help string (project rule): ``--help`` is the scripts' documentation.

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


def test_every_add_argument_has_help():
    files = subprocess.run(
        ["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    assert files, "git ls-files found no Python files"
    missing = [where for name in files for where in missing_help(ROOT / name)]
    assert not missing, "add_argument without help=:\n" + "\n".join(missing)
