"""A child Python that imports every module of some packages while others are made unimportable:
how the layer tests show that a package needs nothing it must not (torch in the server, a stage
in the core, a serving runtime in the bundle format)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PROBE = r"""
import importlib, importlib.abc, pkgutil, sys

BLOCKED, PACKAGES, SKIPPED = {blocked!r}, {packages!r}, {skipped!r}

class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"blocked import of {{name}}")
        return None

sys.meta_path.insert(0, Block())
names = []
for package in PACKAGES:
    module = importlib.import_module(package)
    names += [m.name for m in pkgutil.walk_packages(module.__path__, package + ".") if not m.name.startswith(SKIPPED)]
for name in names:
    importlib.import_module(name)
leaked = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
assert not leaked, leaked
print("imported", len(names), "modules:", " ".join(names))
"""


def import_all(
    packages: tuple[str, ...], blocked: tuple[str, ...], skipped: tuple[str, ...] = ()
) -> subprocess.CompletedProcess:
    """Import every module of ``packages`` (but those under ``skipped``) in a child process in
    which each top-level package of ``blocked`` raises ImportError."""
    source = PROBE.format(blocked=tuple(blocked), packages=tuple(packages), skipped=tuple(skipped))
    return subprocess.run([sys.executable, "-c", source], cwd=ROOT, capture_output=True, text=True, timeout=120)
