"""The Dockerfiles, the build context and the image names: what `make images` builds from a
clean clone (deploy/checks/build_images.py), checked without a container engine."""

import fnmatch
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.deploy.conftest import assert_hadolint_clean

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
sys.path.insert(0, str(DEPLOY / "checks"))
from build_images import IMAGES  # noqa: E402
from runtime import project_version  # noqa: E402

VERSION = project_version()

MULTI_STAGE = ["Dockerfile", "Dockerfile.train", "Dockerfile.gpu", "Dockerfile.ray"]


def stages(dockerfile: str) -> list[str]:
    """The Dockerfile's stages as text, continuation lines joined."""
    text = (DEPLOY / dockerfile).read_text().replace("\\\n", " ")
    parts = re.split(r"^(?=FROM )", text, flags=re.M)
    return [p for p in parts if p.startswith("FROM ")]


def ignored(path: str, patterns: list[str]) -> bool:
    """.dockerignore semantics for the patterns used here: a match of the path or of a parent."""
    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    return any(
        fnmatch.fnmatch(p, pat.removeprefix("**/")) or fnmatch.fnmatch(p, pat) for p in prefixes for pat in patterns
    )


def dockerignore() -> list[str]:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def test_the_build_context_leaves_out_environments_bundles_and_runs():
    patterns = dockerignore()
    for heavy in (".venv", ".venv-peers", "bundles/default/index.bin", "runs/x", ".git", "loadtest/results/a.csv"):
        assert ignored(heavy, patterns), heavy
    assert ignored("service/http/__pycache__/app.cpython-311.pyc", patterns)


@pytest.mark.parametrize("dockerfile", sorted({*IMAGES.values()}))
def test_every_copied_path_is_in_the_build_context(dockerfile):
    patterns = dockerignore()
    text = (ROOT / dockerfile).read_text()
    sources = [
        src
        for line in text.splitlines()
        if line.startswith("COPY ") and "--from=" not in line
        for src in line.split()[1:-1]
        if not src.startswith("--")
    ]
    assert sources
    for source in sources:
        assert (ROOT / source).exists(), source
        assert not ignored(source, patterns), f"{dockerfile} copies {source}, which .dockerignore leaves out"


@pytest.mark.parametrize("dockerfile", MULTI_STAGE)
def test_wheels_compile_in_a_builder_stage_and_the_runtime_stage_has_no_compiler(dockerfile):
    builder, *_, runtime = stages(dockerfile)
    assert re.match(r"FROM \S+ AS builder", builder), builder.splitlines()[0]
    assert re.search(r"apt-get install [^&]*\bg\+\+", builder)
    assert not re.search(r"\b(g\+\+|gcc|build-essential|clang|-dev)\b", runtime)
    assert "COPY --from=builder" in runtime
    extras = re.search(r"pip install[^\n]*\.\[[A-Za-z,${}_]+\]", builder)
    assert extras, "install from pyproject's extras"
    # dependencies are installed before the sources are copied, so that a code change reuses them
    assert extras.start() < re.search(r"^COPY (--\S+ )*service", builder, re.M).start()
    if dockerfile != "Dockerfile.ray":  # Ray's base image runs as its own user `ray`
        assert re.search(r"^USER (?!root|0\b)\S+", runtime, re.M)


@pytest.mark.parametrize("dockerfile", ["Dockerfile", "Dockerfile.gpu"])
def test_serving_images_keep_their_healthcheck_in_the_runtime_stage(dockerfile):
    runtime = stages(dockerfile)[-1]
    assert "HEALTHCHECK" in runtime and "/readyz" in runtime


def test_the_load_generator_installs_the_loadtest_extra_only():
    text = (DEPLOY / "Dockerfile.loadtest").read_text()
    assert "['optional-dependencies']['loadtest']" in text
    assert 'pip install "' not in text and "pip install ." not in text


def image_references() -> dict[str, list[str]]:
    files = [ROOT / "docker-compose.yml", ROOT / "Makefile", *DEPLOY.rglob("*.yaml"), *DEPLOY.rglob("Dockerfile*")]
    files.append(DEPLOY / "README.md")
    # an image name, not a Service's address (http://xmcserve-shadow:8000)
    pattern = re.compile(r"(?<![/\w-])xmcserve-([a-z][a-z-]*?):([A-Za-z0-9<>._-]+)")
    return {str(f.relative_to(ROOT)): pattern.findall(f.read_text()) for f in files}


def test_image_names_follow_one_scheme_from_the_project_version():
    references = image_references()
    assert sum(len(v) for v in references.values()) > 10
    for path, found in references.items():
        for flavour, tag in found:
            assert flavour in IMAGES, (path, flavour)
            assert tag in (VERSION, "<version>"), f"{path}: xmcserve-{flavour}:{tag}, expected :{VERSION}"
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    for service in compose["services"].values():
        if "build" in service:
            flavour = next(f for f, d in IMAGES.items() if d == service["build"]["dockerfile"])
            assert service["image"] == f"xmcserve-{flavour}:{VERSION}"


@pytest.mark.parametrize(
    "dockerfile",
    ["Dockerfile.loadtest", "checks/standins/ray.Containerfile", "checks/standins/prometheus.Containerfile"],
)
def test_new_dockerfiles_pass_hadolint(dockerfile):
    assert_hadolint_clean(DEPLOY / dockerfile)


# --- the host install (Makefile) ---

MAKE = shutil.which("make")


def make_dry_run(*args: str, env: dict | None = None) -> str:
    done = subprocess.run([MAKE, "-n", *args], cwd=ROOT, capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.skipif(MAKE is None, reason="no make")
def test_make_serve_installs_the_serving_extras_and_make_test_the_dev_extra(tmp_path):
    venv = f"VENV={tmp_path / 'venv'}"
    serve = make_dry_run("serve", venv)
    installs = [line for line in serve.splitlines() if "pip install" in line]
    assert installs and all('".[cpu,train]"' in line for line in installs), installs
    test = make_dry_run("test", venv)
    assert any('".[cpu,train,dev]"' in line for line in test.splitlines() if "pip install" in line)


@pytest.mark.skipif(MAKE is None, reason="no make")
def test_a_machine_without_a_compiler_is_pointed_at_the_readme_prerequisites(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").symlink_to(sys.executable)
    env = {"PATH": str(bin_dir), "HOME": str(tmp_path)}
    done = subprocess.run([MAKE, "prereqs", "CXX=no-such-compiler"], cwd=ROOT, capture_output=True, text=True, env=env)
    assert done.returncode != 0
    assert "README.md, Prerequisites" in done.stderr, done.stderr
    assert "no C++ compiler" in done.stderr or "no Python headers" in done.stderr, done.stderr


def test_ray_image_and_its_stand_in_use_the_ray_extras_pin():
    """Dockerfile.ray installs `.[cpu]` only, relying on the base's Ray: base tag, stand-in and the
    `ray` extra must name one release."""
    pin = re.search(r'"ray\[serve\]==([^"]+)"', (ROOT / "pyproject.toml").read_text()).group(1)
    base = re.search(r"^ARG RAY_IMAGE=rayproject/ray:([^-\s]+)-py311", (DEPLOY / "Dockerfile.ray").read_text(), re.M)
    standin = re.search(r"^ARG RAY_VERSION=(\S+)", (DEPLOY / "checks/standins/ray.Containerfile").read_text(), re.M)
    assert base and standin
    assert base.group(1) == pin == standin.group(1)


def test_train_image_runtime_stage_has_the_openmp_runtime_lightgbm_links():
    """LightGBM's Linux wheel loads the system libgomp.so.1, which slim bases lack: without it the
    train image built, but `import lightgbm` (export.fuse) failed inside it."""
    import tomllib

    train = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["train"]
    if not any(re.match(r"lightgbm\b", r) for r in train):
        pytest.skip("the train extra has no LightGBM")
    runtime_stage = stages("Dockerfile.train")[-1]
    assert re.search(r"^RUN .*apt-get install [^\n]*\blibgomp1\b", runtime_stage, re.M), runtime_stage
