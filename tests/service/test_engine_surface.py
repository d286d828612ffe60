"""export/ and bench/ use the engine through its public package only: every import of it names
``service.engine`` itself and only names its ``__all__`` lists, so the engine's modules can move
and change behind that surface (the one ranking entry, ``rank_batch``, among them)."""

import ast
from pathlib import Path

import service.engine

ROOT = Path(__file__).resolve().parents[2]
OUTSIDE = ("export", "bench")


def engine_imports(path: Path) -> list[tuple[int, str, list[str]]]:
    """(line, module, names) of each import of the engine in the file, functions included."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("service.engine"):
            found.append((node.lineno, node.module, [alias.name for alias in node.names]))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name, []) for a in node.names if a.name.startswith("service.engine")]
    return found


def wrong_imports(path: Path) -> list[str]:
    public = set(service.engine.__all__)
    wrong = []
    for line, module, names in engine_imports(path):
        if module != "service.engine":
            wrong.append(f"{path}:{line} imports {module}")
            continue
        wrong += [f"{path}:{line} imports {name}, not public" for name in names if name not in public]
    return wrong


def test_export_and_bench_import_only_the_engines_public_names():
    wrong = [w for top in OUTSIDE for path in sorted((ROOT / top).rglob("*.py")) for w in wrong_imports(path)]
    assert not wrong, "\n".join(wrong)


def test_the_check_sees_a_submodule_and_a_private_name(tmp_path):
    module = tmp_path / "reach.py"
    module.write_text("from service.engine.rae import aggregate\nfrom service.engine import keep_keys\n")
    assert len(wrong_imports(module)) == 2


def test_every_public_name_exists():
    missing = [name for name in service.engine.__all__ if not hasattr(service.engine, name)]
    assert not missing
