"""Everything outside the engine uses it through a public surface, and each importer only the
surface meant for it: the front ends (service/http, api, rollout, observability) and training/
``engine`` alone (about thirty names: load, predict, the live memory, the batcher, the
encoder's layout, one error base and its subclasses, RAE's aggregation); the Ray Serve front end
also ``engine.distributed`` (the encoder, shard and coordinator parts of a sharded bundle); export/
and the lab (bench/, studies/, tools/) also ``engine.offline`` (building, fusing, compacting,
measuring). Each
import names the surface module itself and only names in its ``__all__``, so the engine's
modules can move and change behind them."""

import ast
from pathlib import Path

import engine
import engine.distributed
import engine.offline

ROOT = Path(__file__).resolve().parents[2]
SURFACES = {
    "engine": engine,
    "engine.distributed": engine.distributed,
    "engine.offline": engine.offline,
}
FRONT = ("engine",)
# importer (a folder of the repository) → the surfaces it may import
ALLOWED = {
    "service/http": FRONT,
    "service/api": FRONT,
    "service/rollout": FRONT,
    "service/observability": FRONT,
    "training": FRONT,
    "xmcserve": FRONT,
    "service/ray_serve": (*FRONT, "engine.distributed"),
    "export": (*FRONT, "engine.offline"),
    "bench": (*FRONT, "engine.offline", "engine.distributed"),
    "studies": (*FRONT, "engine.offline"),
    "tools": (*FRONT, "engine.offline"),
    "loadtest": FRONT,
    "deploy": FRONT,
    "data": FRONT,
    "xmc": (),
    "bundle": (),
}


def is_engine(module: str) -> bool:
    return module == "engine" or module.startswith("engine.")


def engine_imports(path: Path) -> list[tuple[int, str, list[str]]]:
    """(line, module, names) of each import of the engine in the file, functions included;
    ``import engine`` (or ``import engine.offline as offline``) counts as that surface and each
    ``<bound name>.<attr>`` the file reads as a name it imports."""
    tree = ast.parse(path.read_text(), str(path))

    def read(bound: str) -> list[str]:
        return sorted(
            {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and ast.unparse(n.value) == bound}
        )

    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and is_engine(node.module or ""):
            found.append((node.lineno, node.module, [alias.name for alias in node.names]))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if is_engine(alias.name):
                    found.append((node.lineno, alias.name, read(alias.asname or alias.name)))
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
        and path.relative_to(ROOT).parts[0] not in ("tests", ".venv", "engine")
        and not any(part.startswith(".") for part in path.relative_to(ROOT).parts)
        and path.relative_to(ROOT) != Path("service/__init__.py")
    ]
    assert unchecked == []


def test_the_check_sees_a_submodule_a_private_name_and_a_surface_not_meant_for_the_importer(tmp_path):
    module = tmp_path / "reach.py"
    module.write_text(
        "from engine.rae import aggregate\n"
        "from engine import keep_keys\n"
        "from engine.offline import rank_batch\n"
        "import engine\n"
        "engine.load_bundle('x')\n"
    )
    assert len(wrong_imports(module, FRONT)) == 4
    assert len(wrong_imports(module, ALLOWED["export"])) == 3


def test_every_public_name_exists_and_the_front_ends_surface_is_narrow():
    for module in SURFACES.values():
        assert [name for name in module.__all__ if not hasattr(module, name)] == []
    assert len(engine.__all__) <= 32


# The runtime is at the bottom: the engine, the bundle contract, the XMC core and every stage
# that builds a bundle reach the engine, never the HTTP front end. bench/ and loadtest/ measure
# the front ends themselves, so they alone may start one in process.
BELOW_THE_FRONT_ENDS = ("engine", "bundle", "xmc", "export", "training", "data", "studies", "deploy")


def service_imports(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else []
        names += [a.name for a in node.names] if isinstance(node, ast.Import) else []
        found += [
            f"{path}:{node.lineno} imports {name}" for name in names if name == "service" or name.startswith("service.")
        ]
    return found


def test_nothing_below_the_front_ends_imports_the_service_package():
    wrong = [
        w
        for folder in BELOW_THE_FRONT_ENDS
        for path in sorted((ROOT / folder).rglob("*.py"))
        for w in service_imports(path)
    ]
    assert not wrong, "\n".join(wrong)


def test_the_import_check_sees_both_forms(tmp_path):
    module = tmp_path / "up.py"
    module.write_text("import service.http.app\nfrom service.api import schemas\nimport engine\n")
    assert len(service_imports(module)) == 2
