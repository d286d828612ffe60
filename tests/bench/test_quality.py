"""bench.quality: each fused row's bundle is named by its fusion (a changed fusion is rebuilt, not
reused), the single-tree comparison row keeps NGAME's tree, and the fusion candidates are tabled."""

import argparse
from pathlib import Path

from bench.quality import fused_bundle_name, fusion_model_markdown, fusion_model_table, fusion_of_row
from export.fusion_fit import DEFAULT_PARAMS


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
    # export.fuse's default size, named in full: a changed default is rebuilt too
    default = DEFAULT_PARAMS["lambdarank"]
    size = fusion_of_row("-fused", given(fusion_trees=None, fusion_leaves=None))[1]
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
