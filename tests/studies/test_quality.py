"""studies.quality: each fused row's bundle is named by its fusion (a changed fusion is rebuilt, not
reused), the single-tree comparison row keeps NGAME's tree, and the fusion candidates are tabled;
the peers a workdir lacks are run, and a data set's user-route rows are the bundles they name."""

import argparse
import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from engine.offline import load_bundle
from export.derive import derive_rae_bundle
from export.fuse import FuseParams, fuse_bundle
from export.fusion_fit import DEFAULT_PARAMS
from studies.quality import run as quality
from studies.quality.run import (
    USER_ROUTE_ROWS,
    fused_bundle_name,
    fusion_model_markdown,
    fusion_model_table,
    fusion_of_row,
    markdown_table,
    run_peers,
    user_route_rows,
    with_peer_rows,
)
from xmc.data import load_jsonl_split


def given(**overrides) -> argparse.Namespace:
    fields = {
        "fusion_model": "lambdarank",
        "fusion_trees": 40,
        "fusion_leaves": 15,
        "fusion_rerank_depth": 150,
        "fusion_extra_features": ["ranks"],
    } | overrides
    return argparse.Namespace(**fields)


def test_each_fused_row_has_its_fusion_and_a_bundle_named_by_it():
    args = given()
    assert fusion_of_row("-fused", args) == (
        "lambdarank",
        {"trees": 40, "leaves": 15},
        ("rae", "lexical", "ranks"),
        150,
    )
    assert fusion_of_row("-fused-rae-features", args)[2] == ("rae", "ranks")
    assert fusion_of_row("-fused-tree", args) == ("tree", {}, ("rae", "lexical"), None)
    source = Path("bundles/quality/memory-lambda0.3")
    names = {
        fused_bundle_name(source, "-fused", *fusion_of_row("-fused", a)[:2], fusion_of_row("-fused", a)[3]).name
        for a in (args, given(fusion_trees=100), given(fusion_rerank_depth=None), given(fusion_model="gbdt"))
    }
    assert len(names) == 4 and all(name.startswith("memory-lambda0.3-fused-") for name in names)
    fused = fusion_of_row("-fused", args)
    assert fused_bundle_name(source, "-fused", *fused[:2], fused[3], "leave_one_out", fused[2]).name not in names
    named = fused_bundle_name(source, "-fused", *fused[:2], fused[3], groups=fused[2]).name
    assert named.endswith("-ranks-without-holdout") and named not in names  # its extra group, ranks
    assert fusion_of_row("-fused", given(fusion_model="tree"))[1] == {}  # a tree takes no ensemble size
    # no size given: export.fuse chooses among its default sizes, and the name says which (a changed
    # default is rebuilt too); another model's default size is named in full
    unsized = fusion_of_row("-fused", given(fusion_trees=None, fusion_leaves=None))
    assert unsized[1] == {}
    assert fused_bundle_name(source, "-fused", *unsized[:2], unsized[3]).name.endswith(
        "-lambdarank-sizes60x31-60x15-depth150-without-holdout"
    )
    default = DEFAULT_PARAMS["gbdt"]
    size = fusion_of_row("-fused", given(fusion_model="gbdt", fusion_trees=None, fusion_leaves=None))[1]
    assert size == {"trees": default["trees"], "leaves": default["leaves"]}


def test_the_fusion_candidates_are_tabled_with_the_choice_and_its_dev_figures():
    figures = {"P@1": 70.0, "P@5": 35.0, "PSP@5": 25.0, "R@100": 77.0}
    candidate = {"validation": {"filter_after": figures, "exclude_before": figures}, "onnx_ms_per_query": 0.2}
    result = {
        "held_out_instances": 2000,
        "folds": 5,
        "max_model_ms": 0.3,
        "candidates": {
            "tree@all[rae+lexical]": candidate | {"rerank_depth": None, "ineligible_because": []},
            "gbdt-100x31@all[rae+lexical]": candidate | {"rerank_depth": None, "ineligible_because": ["model over"]},
        },
        "chosen": "tree@all[rae+lexical]",
        "dev": {"filter_after": figures, "exclude_before": figures},
    }
    markdown = fusion_model_markdown(fusion_model_table(result))
    assert "| tree@all[rae+lexical] | 70.00 / 35.00 / 25.00 / 77.00 |" in markdown
    assert "**chosen**" in markdown and "| model over |" in markdown and "Dev, once, for the choice" in markdown


def test_the_unfused_memory_and_each_candidate_s_dev_figures_are_tabled_when_measured():
    figures = {"P@1": 70.0, "P@5": 35.0, "PSP@5": 25.0, "R@100": 77.0}
    dev = {"P@1": 71.0, "P@5": 36.0, "PSP@5": 26.0, "R@100": 78.0}
    both = {"filter_after": figures, "exclude_before": figures}
    result = {
        "held_out_instances": 2000,
        "held_out_memory": "without_holdout",
        "folds": 5,
        "max_model_ms": None,
        "unfused": {"validation": both, "dev": {"filter_after": dev, "exclude_before": dev}},
        "candidates": {
            "tree@all[rae+lexical]": {
                "validation": both,
                "onnx_ms_per_query": 0.02,
                "rerank_depth": None,
                "ineligible_because": [],
                "dev": {"filter_after": dev, "exclude_before": dev},
            },
            "tree@200[rae+lexical]": {
                "validation": both,
                "onnx_ms_per_query": 0.01,
                "rerank_depth": 200,
                "ineligible_because": ["PSP@5 below"],
            },
        },
        "chosen": "tree@all[rae+lexical]",
    }
    markdown = fusion_model_markdown(fusion_model_table(result))
    assert "searched without holdout" in markdown
    same = "70.00 / 35.00 / 25.00 / 77.00 | 70.00 / 35.00 / 25.00 / 77.00"
    assert f"| no fusion (p̂ alone) | {same} | 71.00 / 36.00 / 26.00 / 78.00 | 0 |" in markdown
    assert f"| tree@all[rae+lexical] | {same} | 71.00 / 36.00 / 26.00 / 78.00 | 0.020 | **chosen** |" in markdown
    assert f"| tree@200[rae+lexical] | {same} |  | 0.010 | PSP@5 below |" in markdown


def test_the_peers_run_in_their_environment_keeping_the_rows_the_workdir_has(tmp_path):
    """studies.peers --keep runs only what peers.json lacks (the one-vs-rest fit takes an hour or more)."""
    calls = []

    def run(argv, check):
        calls.append(argv)
        Path(argv[argv.index("--out") + 1]).write_text(json.dumps({"omikuji-bonsai": {"P@1": 47.6}}))

    rows = run_peers(Path(".venv-peers/bin/python"), Path("data/x"), tmp_path, run=run)
    out = str(tmp_path / "peers.json")
    assert calls == [[".venv-peers/bin/python", "-m", "studies.peers", "--data", "data/x", "--out", out, "--keep"]]
    assert rows == {"omikuji-bonsai": {"P@1": 47.6}}
    # --peer-systems: only those are run and tabled, the file's other rows stay in it
    assert run_peers(Path("python"), Path("data/x"), tmp_path, "pecos-xr-linear", run=run) == {}
    assert calls[-1][-2:] == ["--systems", "pecos-xr-linear"]


def test_the_user_route_writes_its_rows_under_the_data_folder_s_name_and_keeps_the_lambda_plot(tmp_path, monkeypatch):
    figures = {"P@1": 50.0, "P@5": 20.0, "PSP@5": 40.0, "R@100": 70.0}
    row = {**figures, "exclude_before": figures, "train_seconds": 1.0, "notes": "n"}
    monkeypatch.setattr(quality, "user_route_rows", lambda *args: ({"xmcserve-fit": row}, {"seconds": {"train": 1}}))
    monkeypatch.setattr(
        quality, "load_jsonl_split", lambda data, split, labels=None: SimpleNamespace(labels=[], filter_pairs=[])
    )
    monkeypatch.chdir(tmp_path)
    assert quality.main(["--user-route", "--skip-peers", "--data", "data/my-set", "--workdir", "w"]) == 0
    written = json.loads((tmp_path / "bench/results/quality-my-set-dev.json").read_text())
    assert written["systems"] == {"xmcserve-fit": row} and written["make_fit"] == {"seconds": {"train": 1}}
    assert (tmp_path / "bench/results/quality-my-set-dev.md").is_file()
    assert not (tmp_path / "bench/results/quality-rae-lambda.png").exists()  # the tuned set's plot is left alone


def test_a_peer_row_measured_later_joins_the_peers_and_replaces_its_own_in_place():
    bundle = {"bundle_id": "b", "P@1": 80.0}
    systems = {"omikuji-bonsai": {"P@1": 75.0}, "tfidf-ovr-logreg": {"skipped": "s"}, "xmcserve": bundle}
    assert list(with_peer_rows(systems, {"pecos-xr-linear": {"P@1": 65.0}})) == [
        "omikuji-bonsai",
        "tfidf-ovr-logreg",
        "pecos-xr-linear",
        "xmcserve",
    ]
    replaced = with_peer_rows(systems, {"tfidf-ovr-logreg": {"P@1": 70.0}})
    assert list(replaced) == list(systems) and replaced["tfidf-ovr-logreg"] == {"P@1": 70.0}
    assert list(with_peer_rows({"xmcserve": bundle}, {"omikuji-bonsai": {}})) == ["omikuji-bonsai", "xmcserve"]


def never(*args, **kwargs):
    raise AssertionError("--only-peers reads the peers' rows; it runs and loads nothing")


def test_only_peers_adds_their_rows_to_the_results_and_keeps_every_other_part(tmp_path, monkeypatch):
    figures = {"P@1": 80.0, "P@5": 40.0, "PSP@5": 40.0, "R@100": 86.0}
    xmcserve = {**figures, "exclude_before": figures, "bundle_id": "b", "train_seconds": 9.0, "notes": "n"}
    earlier = {
        "data": "data/x",
        "filter_pairs_applied": 2,
        "systems": {"omikuji-bonsai": {**figures, "train_seconds": 49.0, "notes": "o"}, "xmcserve-x": xmcserve},
        "rae_lambda_sweep": {},
        "training_ablations": {"protocol": "p", "rows": []},
        "fusion_models": None,
        "make_fit": {"seconds": {"train": 1}},
    }
    out = tmp_path / "quality.json"
    out.write_text(json.dumps(earlier))
    ovr = {**figures, "P@1": 70.0, "train_seconds": 14000.0, "notes": "liblinear"}
    (tmp_path / "peers.json").write_text(json.dumps({"pecos-xr-linear": {"P@1": 1.0}, "tfidf-ovr-logreg": ovr}))
    monkeypatch.setattr(quality, "run_peers", never)
    monkeypatch.setattr(quality, "load_jsonl_split", never)
    argv = ["--only-peers", "--peer-systems", "tfidf-ovr-logreg", "--out", str(out), "--workdir", str(tmp_path)]
    assert quality.main([*argv, "--data", "data/x"]) == 0
    written = json.loads(out.read_text())
    assert list(written["systems"]) == ["omikuji-bonsai", "tfidf-ovr-logreg", "xmcserve-x"]
    assert written["systems"]["xmcserve-x"] == xmcserve and written["systems"]["tfidf-ovr-logreg"] == ovr
    kept = ("data", "filter_pairs_applied", "training_ablations", "make_fit")
    assert {key: written[key] for key in kept} == {key: earlier[key] for key in kept}
    assert "| tfidf-ovr-logreg | 70.00 |" in out.with_suffix(".md").read_text()


def test_only_peers_refuses_what_it_cannot_do_before_writing_anything(tmp_path, monkeypatch, capsys):
    out = tmp_path / "quality.json"
    earlier = {"data": "data/x", "filter_pairs_applied": 0, "systems": {}, "rae_lambda_sweep": {}}
    out.write_text(json.dumps(earlier))
    (tmp_path / "peers.json").write_text(json.dumps({"omikuji-bonsai": {"P@1": 1.0}}))
    monkeypatch.setattr(quality, "run_peers", never)
    monkeypatch.setattr(quality, "load_jsonl_split", never)
    base = ["--only-peers", "--out", str(out), "--workdir", str(tmp_path), "--data", "data/x"]
    refusals = {
        "still being measured": [*base, "--peer-systems", "tfidf-ovr-logreg"],  # not in peers.json yet
        "exclude each other": [*base, "--skip-peers"],
        "not data/y's": ["--only-peers", "--out", str(out), "--workdir", str(tmp_path), "--data", "data/y"],
        "does not exist": ["--only-peers", "--out", str(tmp_path / "none.json"), "--data", "data/x"],
        "peers.json does not exist": [*base[:4], str(tmp_path / "empty"), "--data", "data/x"],
    }
    for says, argv in refusals.items():
        with pytest.raises(SystemExit) as refused:
            quality.main(argv)
        assert refused.value.code == 2 and says in capsys.readouterr().err, says
    assert json.loads(out.read_text()) == earlier


def test_only_peers_with_the_user_route_goes_into_that_data_set_s_results(tmp_path, monkeypatch):
    figures = {"P@1": 50.0, "P@5": 20.0, "PSP@5": 40.0, "R@100": 70.0}
    fit = {**figures, "exclude_before": figures, "bundle_id": "b", "train_seconds": 1.0, "notes": "n"}
    out = tmp_path / "bench/results/quality-my-set-dev.json"
    out.parent.mkdir(parents=True)
    earlier = {"data": "data/my-set", "filter_pairs_applied": 0, "systems": {"xmcserve-fit": fit}}
    out.write_text(json.dumps({**earlier, "rae_lambda_sweep": {}, "make_fit": {"s": 1}}))
    (tmp_path / "w").mkdir()
    ovr = {**figures, "train_seconds": 9.0, "notes": "liblinear"}
    (tmp_path / "w/peers.json").write_text(json.dumps({"tfidf-ovr-logreg": ovr}))
    monkeypatch.setattr(quality, "run_peers", never)
    monkeypatch.setattr(quality, "load_jsonl_split", never)
    monkeypatch.chdir(tmp_path)
    assert quality.main(["--user-route", "--only-peers", "--data", "data/my-set", "--workdir", "w"]) == 0
    written = json.loads(out.read_text())
    assert list(written["systems"]) == ["tfidf-ovr-logreg", "xmcserve-fit"] and written["make_fit"] == {"s": 1}
    assert not (tmp_path / "bench/results/quality-rae-lambda.png").exists()


def test_a_skipped_peer_is_a_row_that_says_why():
    figures = {"P@1": 70.0, "P@5": 35.0, "PSP@5": 25.0, "R@100": 77.0}
    table = markdown_table(
        {
            "omikuji-bonsai": {**figures, "train_seconds": 30.0, "notes": "n"},
            "tfidf-ovr-logreg": {"skipped": "12 GiB > 8 GiB", "notes": "liblinear"},
        }
    )
    assert "| omikuji-bonsai | 70.00 | 35.00 | 25.00 | 77.00 | — | 30 | n |" in table
    assert "| tfidf-ovr-logreg | — | — | — | — | — | — | skipped: 12 GiB > 8 GiB |" in table


def test_the_user_route_rows_are_make_fit_s_bundles_and_the_pretrained_memory_with_and_without_fusion(
    memory_and_run, sample_dir, tmp_path, monkeypatch
):
    """make fit (injected: the tiny memory, its run and the default fusion) is run once; each row is
    the bundle it names, evaluated on dev, with the stages' seconds it cost."""
    memory, held_out = memory_and_run
    train = load_jsonl_split(sample_dir, "trn")
    dev = load_jsonl_split(sample_dir, "dev", labels=train.labels)
    shutil.copytree(memory, tmp_path / "minilm-rae-64d")  # as if export.build's defaults had built it
    fits = []

    def fit(data, bundle, run, force):
        fits.append((data, bundle, run, force))
        # a memory of its own (another λ), so no two rows evaluate one bundle
        derive_rae_bundle(tmp_path / "minilm-rae-64d", bundle.with_name(bundle.name + "-memory"), train.Y, lam=0.3)
        shutil.copytree(held_out, run)
        fuse_bundle(bundle.with_name(bundle.name + "-memory"), run, train, bundle, FuseParams(sparse_depth=20))
        return {"bundle": str(bundle), "seconds": {"train": 100.0, "memory": 20.0, "fusion": 5.0}}

    rows, summary = user_route_rows(sample_dir, tmp_path, train, dev, fit=fit)
    assert fits == [(sample_dir, tmp_path / "fit", tmp_path / "fit-run", True)]
    assert list(rows) == list(USER_ROUTE_ROWS)
    fusing = summary["seconds"].pop("pretrained_fusion")  # timed here: the fusion of the pretrained memory
    assert summary["seconds"] == {"train": 100.0, "memory": 20.0, "fusion": 5.0, "pretrained": 0.0} and fusing > 0
    seconds = {name: row["train_seconds"] for name, row in rows.items()}
    assert seconds == {
        "xmcserve-pretrained-memory": 0.0,
        "xmcserve-pretrained-fused": round(fusing, 1),
        "xmcserve-fit-memory": 120.0,
        "xmcserve-fit": 125.0,
    }
    built = {
        "xmcserve-pretrained-memory": tmp_path / "minilm-rae-64d",
        "xmcserve-pretrained-fused": tmp_path / "minilm-rae-64d-fused",
        "xmcserve-fit-memory": tmp_path / "fit-memory",
        "xmcserve-fit": tmp_path / "fit",
    }
    for name, path in built.items():
        assert rows[name]["bundle_id"] == load_bundle(path).manifest.bundle_id, name
        assert 0 < rows[name]["P@1"] <= 100 and rows[name]["notes"] == USER_ROUTE_ROWS[name]
    fused = load_bundle(tmp_path / "minilm-rae-64d-fused").manifest.fusion
    assert fused is not None and fused.queries == 150  # fitted on make fit's held-out instances
    assert fused.sparse is not None  # export.fuse's default: with the sparse ranker
    assert len({row["bundle_id"] for row in rows.values()}) == 4
    again, _ = user_route_rows(sample_dir, tmp_path, train, dev, fit=fit)
    assert len(fits) == 1 and {n: r["bundle_id"] for n, r in again.items()} == {
        n: r["bundle_id"] for n, r in rows.items()
    }
    # the pretrained memory gone, the fit kept: the memory alone is built again, and timed
    shutil.rmtree(tmp_path / "minilm-rae-64d")
    built_again = []

    def build(out, *args):
        built_again.append(out)
        shutil.copytree(memory, out)
        return 7.0

    monkeypatch.setattr(quality, "ensure_bundle", build)
    _, summary = user_route_rows(sample_dir, tmp_path, train, dev, fit=fit)
    assert len(fits) == 1 and built_again == [tmp_path / "minilm-rae-64d"]
    assert summary["seconds"]["pretrained"] == 7.0
    assert json.loads((tmp_path / "fit.json").read_text())["seconds"]["pretrained"] == 7.0
