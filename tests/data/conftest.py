"""Helpers shared by the tests of the data set builders (data/make_*.py)."""

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

DATA = Path(__file__).resolve().parents[2] / "data"


def load_script(script: Path) -> ModuleType:
    """The builder ``script`` imported as a module, for its functions. data/ goes first on
    sys.path, as ``python data/make_<name>.py`` has it, so the script's ``import builders``
    finds data/builders.py here as it does when run."""
    if str(DATA) not in sys.path:
        sys.path.insert(0, str(DATA))
    spec = importlib.util.spec_from_file_location(script.stem, script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
