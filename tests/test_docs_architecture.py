"""docs/architecture.md says what the code is: its tables of which package imports which (the
top-level packages, and the layers of ``service/``) equal the imports the code makes, its module
map names every module of the tree and nothing that is not there, and every ``python -m`` entry
point it lists is one that runs.

Words that drift from the tree are worse than none: a newcomer reads the map first. The tables
and the map are read from the page's own text, so the page stays the one place they are written.
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "architecture.md"
# The project's top-level packages (folders of Python code), in the order the tables list them.
PACKAGES = (
    "xmc", "bundle", "engine", "training", "export", "service", "xmcserve",
    "bench", "studies", "tools", "loadtest", "data", "deploy",
)  # fmt: skip
NONE = "—"


def page_section(title: str) -> str:
    text = PAGE.read_text(encoding="utf-8")
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end >= 0 else len(text)]


def table_rows(section: str, header: str) -> dict[str, set[str]]:
    """``| `name/` | `a`, `b` |`` rows of the table whose header row starts with ``header``:
    name → the set of names in its second column (``—``: none)."""
    lines = section.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith(f"| {header} |"))
    rows = {}
    for line in lines[first + 2 :]:
        if not line.startswith("|"):
            break
        name, imports = (cell.strip() for cell in line.strip("|").split("|")[:2])
        rows[name.strip("`/")] = set() if imports == NONE else {n.strip().strip("`/") for n in imports.split(",")}
    return rows


def project_modules() -> dict[str, Path]:
    """Every Python file of the project packages, by dotted name (``__init__`` as its package)."""
    modules = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def imported_modules(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)  # and each name, which may be a module (from service import engine)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def import_edges(level: int, within: str | None = None) -> dict[str, set[str]]:
    """Which unit imports which: units are the top-level packages (``level`` 1) or, inside
    ``within``, its sub-packages (``level`` 2); a unit importing itself is not an edge."""
    edges: dict[str, set[str]] = defaultdict(set)
    for name, path in project_modules().items():
        parts = name.split(".")
        if within is not None and (parts[0] != within or len(parts) < 3):
            continue  # a sub-package's modules only (service/__init__.py is no layer)
        unit = parts[level - 1]
        edges[unit]  # every unit has a row, importing nothing included
        for module in imported_modules(path):
            target = module.split(".")
            if within is None and target[0] in PACKAGES and target[0] != unit:
                edges[unit].add(target[0])
            elif within is not None and target[0] == within and len(target) > 1 and target[1] != unit:
                edges[unit].add(target[1])
    return dict(edges)


def test_the_package_table_is_the_imports_between_packages():
    documented = table_rows(page_section("Data flow"), "package")
    actual = {package: targets for package, targets in import_edges(1).items()}
    assert documented == actual


def test_the_layer_table_is_the_imports_between_the_layers_of_service():
    documented = table_rows(page_section("Layers of the service"), "layer")
    assert documented == import_edges(2, within="service")


def module_map() -> dict[str, str]:
    """The module map's block split by top-level folder: ``xmc`` → its text (continuation lines
    included); ``service`` also by sub-package (``engine`` → its text)."""
    block = page_section("Module map").split("```")[1]
    parts: dict[str, list[str]] = defaultdict(list)
    top = sub = None
    for line in block.splitlines():
        if match := re.match(r"^([a-z_]+)/\s", line):
            top, sub = match.group(1), None
            line = line[match.end() :]
        match = re.match(r"^\s*([a-z_]+)/\s", line)
        if top == "service" and match and (ROOT / "service" / match.group(1) / "__init__.py").is_file():
            sub = f"service/{match.group(1)}"  # a sub-package's entry (not a folder named in the text)
            line = line[match.end() :]
        if top is not None:
            parts[sub or top].append(line)
    return {name: " ".join(lines) for name, lines in parts.items()}


def documented_in(text: str, relative: Path) -> bool:
    """A module is in its folder's text by file name (``build.py``), or for ``bench/`` by
    module name (benchmarks are listed as ``python -m bench.<name>``), or through a folder
    listed whole (``losses/ (one per file)``)."""
    words = set(re.findall(r"[\w.]+/?", text))
    return (
        relative.name in words
        or (relative.stem in words and relative.suffix == ".py")
        or any(f"{parent.name}/" in words for parent in relative.parents if parent.name)
    )


def test_the_module_map_names_every_module_and_no_other():
    sections = module_map()
    missing, unknown = [], []
    for path in project_modules().values():
        relative = path.relative_to(ROOT)
        if relative.name == "__init__.py":
            continue
        key = "/".join(relative.parts[:2]) if relative.parts[0] == "service" else relative.parts[0]
        if key not in sections:
            missing.append(f"{relative} (no {key}/ entry)")
        elif not documented_in(sections[key], relative.relative_to(key)):
            missing.append(str(relative))
    for key, text in sections.items():
        for file_name in re.findall(r"[\w]+\.py\b", text):
            if not list((ROOT / key).rglob(file_name)):
                unknown.append(f"{key}/…/{file_name}")
    assert not missing, "modules the map does not name:\n" + "\n".join(missing)
    assert not unknown, "the map names files that are not in the tree:\n" + "\n".join(unknown)


def runs_as_module(dotted: str) -> bool:
    """``python -m dotted`` runs something: a package's ``__main__.py``, or a module whose
    ``if __name__ == "__main__":`` calls its main."""
    path = ROOT.joinpath(*dotted.split("."))
    if (path / "__main__.py").is_file():
        return True
    source = path.with_suffix(".py")
    return source.is_file() and re.search(r'^if __name__ == "__main__":', source.read_text(), re.MULTILINE) is not None


def test_every_python_m_entry_point_in_the_data_flow_table_runs():
    table = page_section("Data flow")
    rows = [line for line in table.splitlines() if line.startswith("| ") and "python -m" in line]
    assert rows
    named = [name for row in rows for name in re.findall(r"`(?:python -m )?([a-z_]+\.[a-z_.]+)`", row)]
    named = [name for name in named if not name.endswith(".py") and ":" not in name]
    assert "export.build" in named
    assert [name for name in named if not runs_as_module(name)] == []
