"""Everything outside the engine uses it through a public surface, and each importer only the
surface meant for it: the front ends (service/http, api, rollout, observability) and training/
``service.engine`` alone (about thirty names: load, predict, the live memory, the batcher, the
encoder's layout, one error base and its subclasses, RAE's aggregation); the Ray Serve front end
also ``service.engine.distributed`` (a sharded bundle's parts loaded apart); export/, bench/,
studies/ and the other tools also ``service.engine.offline`` (building, fusing, compacting, measuring). Each
import names the surface module itself and only names in its ``__all__``, so the engine's
modules can move and change behind them."""

import ast
from pathlib import Path

import service.engine
import service.engine.distributed
import service.engine.offline

ROOT = Path(__file__).resolve().parents[2]
SURFACES = {
    "service.engine": service.engine,
    "service.engine.distributed": service.engine.distributed,
    "service.engine.offline": service.engine.offline,
}
FRONT = ("service.engine",)
# importer (a folder of the repository) → the surfaces it may import
ALLOWED = {
    "service/http": FRONT,
    "service/api": FRONT,
    "service/rollout": FRONT,
    "service/observability": FRONT,
    "training": FRONT,
    "service/ray_serve": (*FRONT, "service.engine.distributed"),
    "export": (*FRONT, "service.engine.offline", "service.engine.distributed"),
    "bench": (*FRONT, "service.engine.offline", "service.engine.distributed"),
    "studies": (*FRONT, "service.engine.offline"),
    "loadtest": FRONT,
    "deploy": FRONT,
    "data": FRONT,
    "xmc": (),
    "bundle": (),
}


def engine_imports(path: Path) -> list[tuple[int, str, list[str]]]:
    """(line, module, names) of each import of the engine in the file, functions included;
    ``from service import engine`` counts as ``service.engine`` and each ``engine.<name>`` the
    file reads as a name it imports."""
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("service.engine"):
            found.append((node.lineno, node.module, [alias.name for alias in node.names]))
        elif isinstance(node, ast.ImportFrom) and node.module == "service" and "engine" in [a.name for a in node.names]:
            used = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and ast.unparse(n.value) == "engine"}
            found.append((node.lineno, "service.engine", sorted(used)))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name, []) for a in node.names if a.name.startswith("service.engine")]
    return found


def wrong_imports(path: Path, allowed: tuple[str, ...]) -> list[str]:
    wrong = []
    for line, module, names in engine_imports(path):
        if module not in allowed:
            wrong.append(f"{path}:{line} imports {module}")
            continue
        public = set(SURFACES[module].__all__)
        wrong += [f"{path}:{line} imports {module}.{name}, not public" for name in names if name not in public]
    return wrong


def importers() -> list[tuple[Path, tuple[str, ...]]]:
    files = []
    for folder, allowed in ALLOWED.items():
        files += [(path, allowed) for path in sorted((ROOT / folder).rglob("*.py"))]
    return files


def test_every_importer_uses_only_the_surface_meant_for_it():
    wrong = [w for path, allowed in importers() for w in wrong_imports(path, allowed)]
    assert not wrong, "\n".join(wrong)


def test_every_python_folder_outside_the_engine_and_the_tests_is_checked():
    checked = {path for path, _ in importers()}
    unchecked = [
        path.relative_to(ROOT)
        for path in ROOT.rglob("*.py")
        if path not in checked
        and path.relative_to(ROOT).parts[0] not in ("tests", ".venv")
        and path.relative_to(ROOT).parts[:2] != ("service", "engine")
        and not any(part.startswith(".") for part in path.relative_to(ROOT).parts)
        and path.relative_to(ROOT) != Path("service/__init__.py")
    ]
    assert unchecked == []


def test_the_check_sees_a_submodule_a_private_name_and_a_surface_not_meant_for_the_importer(tmp_path):
    module = tmp_path / "reach.py"
    module.write_text(
        "from service.engine.rae import aggregate\n"
        "from service.engine import keep_keys\n"
        "from service.engine.offline import rank_batch\n"
        "from service import engine\n"
        "engine.load_bundle('x')\n"
    )
    assert len(wrong_imports(module, FRONT)) == 4
    assert len(wrong_imports(module, ALLOWED["export"])) == 3


def test_every_public_name_exists_and_the_front_ends_surface_is_narrow():
    for module in SURFACES.values():
        assert [name for name in module.__all__ if not hasattr(module, name)] == []
    assert len(service.engine.__all__) <= 32
