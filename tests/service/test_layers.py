"""The layers of the serving side: bundle ← engine ← api, rollout ← http; engine ← api ←
ray_serve; no import cycles, no HTTP in the engine. The bundle format (``bundle/``) lies under
every layer and imports none of them; the runtime (``engine/``, top level) imports only it."""

import ast
import subprocess
import sys
from pathlib import Path

SERVICE = Path(__file__).resolve().parents[2] / "service"
BUNDLE = SERVICE.parent / "bundle"
ENGINE = SERVICE.parent / "engine"
HTTP_PACKAGES = ("fastapi", "starlette", "uvicorn", "httpx")
# What each layer may import from service/ (itself included).
ALLOWED = {
    # the bundle format: below every layer, importing none
    "bundle": ("bundle",),
    "engine": ("bundle", "engine"),
    "service.rollout": ("bundle", "engine", "service.rollout"),
    # the API both front ends serve (schemas, limits, guards, the front door), owned by neither;
    # the front door gives each request its id and access line from observability
    "service.api": ("bundle", "engine", "service.api", "service.observability"),
    # logs, request ids and tracing: shared by both front ends, importing nothing of service/
    "service.observability": ("service.observability",),
    "service.http": (
        "bundle",
        "engine",
        "service.api",
        "service.rollout",
        "service.http",
        "service.observability",
    ),
    # the Ray Serve front end imports nothing of the single server's
    "service.ray_serve": ("bundle", "engine", "service.api", "service.observability", "service.ray_serve"),
}


def module_name(path: Path) -> str:
    parts = path.relative_to(SERVICE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    """Every module named by an import statement anywhere in the file (functions included)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def graph() -> dict[str, set[str]]:
    modules = {module_name(p): p for p in [*SERVICE.rglob("*.py"), *ENGINE.rglob("*.py"), *BUNDLE.rglob("*.py")]}
    return {name: {m for m in imports_of(path) if m in modules and m != name} for name, path in modules.items()}


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """A cycle of module-to-module imports, or None (depth-first search with colours)."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycles_in_service():
    assert find_cycle(graph()) is None


def test_each_layer_imports_only_the_layers_below_it():
    for module, targets in graph().items():
        layer = next((name for name in ALLOWED if module == name or module.startswith(name + ".")), None)
        if layer is None:
            continue
        for target in targets:
            assert target == "service" or target.startswith(ALLOWED[layer]), f"{module} imports {target}"


def test_the_bundle_format_is_in_the_layer_graph():
    edges = graph()
    assert "bundle.labels" in edges and "bundle.manifest" in edges["bundle.labels"]
    assert "bundle" in edges["engine.bundle"]


def test_the_engine_imports_no_http_framework():
    paths = [*ENGINE.rglob("*.py"), *BUNDLE.rglob("*.py")]
    assert len(paths) > 20  # the folders are where this test looks
    for path in paths:
        bad = {m for m in imports_of(path) if m.split(".")[0] in HTTP_PACKAGES}
        assert not bad, (path, bad)
    probe = "import sys, engine; print(sorted(m for m in sys.modules if m.split('.')[0] in %r))"
    out = subprocess.run([sys.executable, "-c", probe % (HTTP_PACKAGES,)], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_the_shadow_worker_child_starts_without_the_engine():
    """The child is spawned fresh: importing ONNX Runtime and the engine there would delay the
    first copies past their deadline."""
    probe = "import sys, service.rollout.shadow_child; print(sorted(m for m in sys.modules if m.startswith(%r)))"
    heavy = ("onnxruntime", "hnswlib", "tokenizers", "engine", "service.rollout.shadow_worker")
    out = subprocess.run([sys.executable, "-c", probe % (heavy,)], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
