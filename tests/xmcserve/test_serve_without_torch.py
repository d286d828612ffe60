"""Serving installs what serving needs: ``pip install ".[cpu]"`` into a clean virtual environment
(no torch, no transformers, no training stack), then ``xmcserve serve --bundle DIR`` answers
``/predict`` as the development install does. The package is installed from a copy of its
sources, as a user's ``pip install`` builds it."""

import shutil
import subprocess
import sys
from pathlib import Path

import httpx

from engine import load_predictor
from loadtest.localserver import start_server, stop_server

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("xmcserve", "xmc", "bundle", "engine", "service", "training", "export")
TRAINING_STACK = ("torch", "transformers", "lightgbm", "sklearn")


def test_a_clean_cpu_install_serves_a_bundle_without_torch(tiny_rae_bundle, tmp_path):
    source = tmp_path / "src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    for package in PACKAGES:
        shutil.copytree(ROOT / package, source / package, ignore=shutil.ignore_patterns("__pycache__"))
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    installed = subprocess.run(
        [str(venv / "bin" / "pip"), "install", "--quiet", "--disable-pip-version-check", f"{source}[cpu]"],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert installed.returncode == 0, installed.stderr[-4000:]
    absent = subprocess.run(
        [
            str(venv / "bin" / "python"),
            "-c",
            f"import importlib.util as u; print([m for m in {TRAINING_STACK!r} if u.find_spec(m)])",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert absent.stdout.strip() == "[]", absent.stdout + absent.stderr

    command = [str(venv / "bin" / "xmcserve"), "serve", "--bundle", str(tiny_rae_bundle)]
    server = start_server(
        tiny_rae_bundle, tmp_path / "server.log", {"PYTHONPATH": ""}, timeout_s=180, command=command, cwd=tmp_path
    )
    try:
        answer = httpx.post(f"{server.url}/predict", json={"text": "a terminal emulator", "k": 5}, timeout=30)
        info = httpx.get(f"{server.url}/info", timeout=30).json()
    finally:
        stop_server(server)
    assert answer.status_code == 200, answer.text
    predictor = load_predictor(tiny_rae_bundle)
    expected = predictor.predict(["a terminal emulator"], 5).rankings[0]
    assert [label["id"] for label in answer.json()["results"][0]["labels"]] == expected.ids.tolist()
    assert (
        info["bundle_path"] == str(tiny_rae_bundle.resolve())
        and info["card"]["bundle_id"] == predictor.bundle.bundle_id
    )
