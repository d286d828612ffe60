"""Outside bundle/ the format is used through its public package only: every import of it names
``bundle`` itself and only names in its ``__all__``, so the package's modules can move and change
behind that surface."""

import ast
from pathlib import Path

import bundle

ROOT = Path(__file__).resolve().parents[2]
OUTSIDE = ("xmc", "service", "training", "export", "bench", "loadtest", "data", "deploy")


def bundle_imports(path: Path) -> list[tuple[int, str, list[str]]]:
    """(line, module, names) of each import of the bundle package in the file, functions included."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "bundle":
            found.append((node.lineno, node.module, [alias.name for alias in node.names]))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name, []) for a in node.names if a.name.split(".")[0] == "bundle"]
    return found


def wrong_imports(path: Path) -> list[str]:
    public = set(bundle.__all__)
    wrong = []
    for line, module, names in bundle_imports(path):
        if module != "bundle":
            wrong.append(f"{path}:{line} imports {module}")
            continue
        wrong += [f"{path}:{line} imports {name}, not public" for name in names if name not in public]
    return wrong


def test_the_stages_import_only_the_bundle_packages_public_names():
    wrong = [w for top in OUTSIDE for path in sorted((ROOT / top).rglob("*.py")) for w in wrong_imports(path)]
    assert not wrong, "\n".join(wrong)


def test_the_check_sees_a_submodule_and_a_private_name(tmp_path):
    module = tmp_path / "reach.py"
    module.write_text("from bundle.labels import uid_hash\nfrom bundle import uid_hash\nimport bundle.values\n")
    assert len(wrong_imports(module)) == 3


def test_every_public_name_exists():
    missing = [name for name in bundle.__all__ if not hasattr(bundle, name)]
    assert not missing


def test_the_engine_no_longer_offers_the_format():
    """The format's names are taken from ``bundle``, not through the engine (one owner each)."""
    import engine

    assert not {"Manifest", "read_manifest", "build_values", "sha256_file", "write_label_arrays"} & set(engine.__all__)
