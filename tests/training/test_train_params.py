from pathlib import Path

import pytest

from training.train_params import TrainParams, load_params


def test_defaults_config_and_overrides(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("epochs: 3\nlr_heads: 1\nclf_normalize: true\n")
    params = load_params(config, ["batch_size=64", "loss=infonce", "de_temperature=0.1", "clf_normalize=false"])
    assert params.epochs == 3 and params.lr_heads == 1.0 and isinstance(params.lr_heads, float)
    assert params.batch_size == 64 and params.loss == "infonce" and params.de_temperature == 0.1
    assert params.clf_normalize is False
    assert load_params().to_dict() == TrainParams().to_dict()
    params.save(tmp_path / "saved.yaml")
    assert load_params(tmp_path / "saved.yaml") == params


def test_bad_parameters_are_refused(tmp_path):
    with pytest.raises(ValueError, match="unknown parameter"):
        load_params(None, ["epoch=3"])
    with pytest.raises(ValueError, match="key=value"):
        load_params(None, ["epochs"])
    with pytest.raises(ValueError, match="expected int"):
        (tmp_path / "c.yaml").write_text("epochs: many\n")
        load_params(tmp_path / "c.yaml")
    with pytest.raises(ValueError, match="boolean"):
        load_params(None, ["clf_normalize=maybe"])


def test_choices_are_checked():
    with pytest.raises(ValueError, match="loss"):
        load_params(None, ["loss=hinge"])
    with pytest.raises(ValueError, match="mine_with"):
        load_params(None, ["mine_with=tfidf"])
    with pytest.raises(ValueError, match="batch_size"):
        load_params(None, ["batch_size=0"])
    # a misspelled system or metric would otherwise never select a best/ checkpoint
    for bad in ("rae/P@10", "de_clf/P@5", "P@5"):
        with pytest.raises(ValueError, match="select_metric"):
            load_params(None, [f"select_metric={bad}"])
    assert load_params(None, ["select_metric=de+clf/PSP@5"]).select_metric == "de+clf/PSP@5"


CONFIGS = sorted((Path(__file__).resolve().parents[2] / "training" / "configs").glob("*.yaml"))


@pytest.mark.parametrize("config", CONFIGS, ids=[c.stem for c in CONFIGS])
def test_every_shipped_config_loads(config):
    params = load_params(config)
    if "gpu" in config.stem:  # the GPU recipe trains the whole encoder: no frozen prefix to cache
        assert params.frozen_layers == 0 and params.device == "cuda"


def test_a_shipped_recipe_is_found_by_name_and_a_file_by_its_path(tmp_path, monkeypatch):
    from training.train_params import RECIPES_DIR, recipe_file, shipped_recipes

    assert {"debian-unidec", "debian-unidec-gpu", "smoke", "synthetic-1m"} <= set(shipped_recipes())
    monkeypatch.chdir(tmp_path)  # found wherever the command runs, not relative to a checkout
    assert recipe_file("debian-unidec") == recipe_file("debian-unidec.yaml") == RECIPES_DIR / "debian-unidec.yaml"
    assert load_params("smoke").max_train == load_params(RECIPES_DIR / "smoke.yaml").max_train
    mine = tmp_path / "debian-unidec.yaml"  # a file of the same name as a shipped one wins: it was named
    mine.write_text("epochs: 1\n")
    assert recipe_file("debian-unidec.yaml").resolve() == mine and load_params("debian-unidec.yaml").epochs == 1
    with pytest.raises(FileNotFoundError, match="debian-unidec, debian-unidec-gpu"):
        recipe_file("debain-unidec")
    with pytest.raises(FileNotFoundError, match="no such file"):  # a path is never taken for a name
        recipe_file("configs/smoke.yaml")


def test_the_wheel_carries_the_recipes_and_the_command(tmp_path):
    """What `pip install .` installs: the recipes as package data, the xmcserve package and its
    console script."""
    import shutil
    import subprocess
    import sys
    import zipfile

    root = Path(__file__).resolve().parents[2]
    source = tmp_path / "src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(root / name, source / name)
    for package in ("xmcserve", "xmc", "bundle", "engine", "service", "training", "export"):
        shutil.copytree(root / package, source / package, ignore=shutil.ignore_patterns("__pycache__"))
    built = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path),
            ".",
        ],
        cwd=source,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert built.returncode == 0, built.stderr
    (wheel,) = tmp_path.glob("xmcserve-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {"training/configs/debian-unidec.yaml", "training/configs/smoke.yaml", "xmcserve/cli.py"} <= names
    assert "service/http/static/rollout.js" in names or any(n.startswith("service/http/static/") for n in names)
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "xmcserve = xmcserve.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()
