"""The stages' layers: xmc, bundle ← engine ← service, training ← export ← the lab (bench ←
studies, tools), each importing only what lies below it (the runtime, engine/, at the bottom: no
stage reaches the front ends in service/ but bench, tools and loadtest, which measure them), and
the core xmc and the bundle format importable without torch, transformers or any stage (the
bundle format without any serving runtime either). Training imports the bundle's RAE
values; export imports of training only the torch model code it exports
(export/serving_graph.py); the lab imports nothing of training (what it reads of a run is in xmc).
Nothing of the product imports the lab, and of the tests only those of the lab do
(tests/bench/, tests/studies/, tests/tools/)."""

import ast
from pathlib import Path

from tests.import_probe import import_all

ROOT = Path(__file__).resolve().parents[2]
STAGES = (
    *("xmc", "bundle", "engine", "service", "training", "export", "xmcserve"),
    *("bench", "studies", "tools", "loadtest"),
)
# The lab (benchmarks, studies, tools) and the product, which never imports it (data/ and deploy/
# hold the data generators and the deployment checks).
LAB = ("bench", "studies", "tools")
PRODUCT = ("xmc", "bundle", "engine", "service", "training", "export", "xmcserve", "loadtest", "data", "deploy")
# What each top-level package may import of the others (itself included).
ALLOWED = {
    "xmc": {"xmc"},
    # the bundle contract: what export writes and service reads, owned by neither
    "bundle": {"bundle"},
    # the runtime: a bundle loaded, encoded, searched, ranked; no HTTP, nothing of a stage
    "engine": {"bundle", "engine"},
    "service": {"xmc", "bundle", "engine", "service"},
    "training": {"xmc", "bundle", "engine", "training"},
    "export": {"xmc", "bundle", "engine", "training", "export"},
    # the package a user imports and its command: the stages' entry points behind one name
    "xmcserve": {"xmc", "bundle", "engine", "service", "training", "export", "xmcserve"},
    "bench": {"xmc", "bundle", "engine", "service", "export", "loadtest", "bench"},
    # a study runs the bundles export builds, on bench's harness; nothing of service in process
    "studies": {"xmc", "bundle", "engine", "export", "loadtest", "bench", "studies"},
    "tools": {"xmc", "bundle", "engine", "service", "export", "loadtest", "bench", "tools"},
    # the load test runs from its own image: it starts a server, never reaches into bench/
    "loadtest": {"xmc", "bundle", "engine", "service", "loadtest"},
}


def top_level_imported(path: Path) -> set[str]:
    """The top-level packages an import statement anywhere in the file (functions included) names."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
    return found


def stages_imported(path: Path) -> set[str]:
    return top_level_imported(path) & set(STAGES)


def test_each_stage_imports_only_the_stages_below_it():
    wrong = [
        f"{path.relative_to(ROOT)} imports {sorted(stages_imported(path) - ALLOWED[stage])}"
        for stage in STAGES
        for path in (ROOT / stage).rglob("*.py")
        if stages_imported(path) - ALLOWED[stage]
    ]
    assert not wrong, "\n".join(wrong)


def lab_imported(path: Path) -> set[str]:
    return top_level_imported(path) & set(LAB)


def test_no_product_package_imports_the_lab():
    wrong = [
        f"{path.relative_to(ROOT)} imports {sorted(lab_imported(path))}"
        for package in PRODUCT
        for path in sorted((ROOT / package).rglob("*.py"))
        if lab_imported(path)
    ]
    assert not wrong, "\n".join(wrong)


def test_only_the_labs_tests_import_the_lab():
    """A product test that needs a helper of the lab's finds it in the product (exact search in
    engine.offline) or in tests/support/, never in bench/, studies/ or tools/."""
    lab_tests = tuple(ROOT / "tests" / folder for folder in LAB)
    wrong = [
        f"{path.relative_to(ROOT)} imports {sorted(lab_imported(path))}"
        for path in sorted((ROOT / "tests").rglob("*.py"))
        if not any(path.is_relative_to(folder) for folder in lab_tests) and lab_imported(path)
    ]
    assert not wrong, "\n".join(wrong)


def test_the_lab_check_sees_both_forms(tmp_path):
    module = tmp_path / "reach.py"
    module.write_text("import bench.lib.latency\ndef f():\n    from studies.quality.run import main\n")
    assert lab_imported(module) == {"bench", "studies"}


def test_export_imports_of_training_only_the_model_code_it_exports():
    importers = sorted(
        str(path.relative_to(ROOT)) for path in (ROOT / "export").rglob("*.py") if "training" in stages_imported(path)
    )
    assert importers == ["export/serving_graph.py"]


def test_the_layer_check_sees_an_import_inside_a_function(tmp_path):
    module = tmp_path / "late.py"
    module.write_text("def f():\n    from training.trainer import Trainer\n")
    assert stages_imported(module) == {"training"}


def test_xmc_imports_without_torch_or_any_stage():
    result = import_all(("xmc",), blocked=("torch", "transformers", "engine", "service", "training", "export", *LAB))
    assert result.returncode == 0, result.stderr
    assert "xmc.metrics" in result.stdout and "xmc.evaluate" in result.stdout


# what the bundle format must not need: torch, any serving runtime, any stage
BUNDLE_BLOCKED = (
    "torch", "transformers", "onnxruntime", "tokenizers", "hnswlib", "faiss", "fastapi", "starlette", "uvicorn",
    "ray", "xmc", "engine", "service", "training", "export", *LAB, "loadtest",
)  # fmt: skip


def test_the_bundle_format_imports_without_torch_any_stage_or_serving_runtime():
    """No HTTP, no ONNX Runtime, no index library: the format is numpy, scipy and pydantic."""
    result = import_all(("bundle",), blocked=BUNDLE_BLOCKED)
    assert result.returncode == 0, result.stderr
    assert "bundle.manifest" in result.stdout and "bundle.ivfpq_file" in result.stdout
