"""Every module of service/ and of the bundle format it reads (bundle/) must import with torch and
transformers unavailable, and all but the Ray Serve front end without ray."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

PROBE = r"""
import importlib, importlib.abc, pkgutil, sys

BLOCKED = ("torch", "transformers", "sentence_transformers")
SKIPPED = ()

class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"blocked import of {name}")
        return None

sys.meta_path.insert(0, Block())
import service
import bundle
names = [m.name for m in pkgutil.walk_packages(service.__path__, "service.") if not m.name.startswith(SKIPPED)]
names += [m.name for m in pkgutil.walk_packages(bundle.__path__, "bundle.")]
for name in names:
    importlib.import_module(name)
leaked = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
assert not leaked, leaked
print("imported", len(names), "modules:", ", ".join(names))
"""


def test_service_imports_without_torch_or_transformers():
    result = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "service.http.app" in result.stdout and "service.engine.search" in result.stdout
    assert "bundle.labels" in result.stdout and "bundle.ivfpq_file" in result.stdout


def test_the_blocker_really_blocks():
    probe = PROBE.replace("import service\n", "import torch\n")
    result = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and "blocked import of torch" in result.stderr


def test_everything_but_the_ray_front_end_imports_without_ray():
    probe = PROBE.replace('BLOCKED = ("torch"', 'BLOCKED = ("ray", "torch"').replace(
        "SKIPPED = ()", 'SKIPPED = ("service.ray_serve",)'
    )
    result = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "service.http.app" in result.stdout and "service.ray_serve" not in result.stdout
