"""export.export_params: option types, documented defaults, the CLI options derived from them."""

import argparse
import re
from dataclasses import asdict, fields
from typing import get_args

import pytest

from bundle.manifest import IndexKind, RaeParams
from engine.rae import RAE_MODES
from export.export_params import (
    RAE_ATTRIBUTES,
    ExportParams,
    RaeMode,
    add_arguments,
    attribute_docs,
    choices,
    from_arguments,
)
from xmc.options import parse_bool


def test_every_attribute_is_documented_with_its_actual_default():
    docs = attribute_docs(ExportParams)
    assert list(docs) == [f.name for f in fields(ExportParams)]
    for name, default in asdict(ExportParams()).items():
        stated = re.search(r"\(default: ([^)]*)\)$", docs[name])
        assert stated, f"{name}: no '(default: …)' at the end of its docstring entry"
        parse = parse_bool if isinstance(default, bool) else type(default)
        assert parse(stated[1]) == default, f"{name}: docstring says {stated[1]}, default is {default!r}"


def test_choices_come_from_the_literal_types():
    assert choices() == {
        "index_kind": get_args(IndexKind),
        "labels_format": ("jsonl", "arrays"),
        "index": ("hnswlib", "ivfpq"),
        "rae_mode": ("joint", "split"),
        "quantize": ("none", "int8", "int8-static"),
        "encode_device": ("auto", "cpu", "cuda"),
    }


def test_rae_modes_agree_with_the_bundle_schema():
    assert get_args(RaeMode) == RAE_MODES == get_args(RaeParams.model_fields["mode"].annotation)


@pytest.mark.parametrize("option", ["index_kind", "rae_mode", "quantize", "index", "labels_format"])
def test_an_unknown_choice_is_refused_when_the_params_are_made(option):
    with pytest.raises(ValueError, match=f"unknown {option} 'bogus'"):
        ExportParams(**{option: "bogus"})


def test_head_block_names():
    assert ExportParams().head_block_names() is None
    assert ExportParams(head_blocks="g1_de, g2_clf").head_block_names() == ["g1_de", "g2_clf"]


def test_options_round_trip_to_params():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert from_arguments(parser.parse_args([])) == ExportParams()
    args = parser.parse_args(["--quantize", "int8", "--optimize", "false", "--rae-tau", "0.1", "--head-blocks", "g1"])
    assert from_arguments(args) == ExportParams(quantize="int8", optimize=False, rae_tau=0.1, head_blocks="g1")


def test_every_rae_parameter_has_an_export_attribute():
    assert set(RAE_ATTRIBUTES) == set(RaeParams.model_fields)
    assert ExportParams(rae_lambda=0.3, rae_mode="split").rae() == RaeParams(lam=0.3, tau=0.04, top_b=200, mode="split")
