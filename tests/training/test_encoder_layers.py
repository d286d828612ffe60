"""The transformers API that training/encoder_layers.py builds its attention masks with, and the
pyproject floor that promises it.

``transformers.masking_utils.create_bidirectional_mask`` first shipped in transformers 5.0.0
(4.57.6, the last 4.x, has only the causal masks) with the argument ``input_embeds``; 5.2.0
renamed it to ``inputs_embeds``, the keyword encoder_layers.run_layers passes, so 5.0 and 5.1 fail
with a TypeError. The first release that works is 5.2.0.
"""

import inspect
import re
from pathlib import Path

import torch
from packaging.requirements import Requirement
from packaging.version import Version

from training.encoder_layers import create_bidirectional_mask

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"
FIRST_WORKING = Version("5.2.0")
RELEASES_WITHOUT_IT = ("4.40.0", "4.57.6", "5.0.0", "5.1.0")  # no function (4.x) or input_embeds (5.0, 5.1)


def transformers_requirement() -> Requirement:
    # a regex, not tomllib: the project supports Python 3.10
    found = re.findall(r'"(transformers[<>=!~][^"]*)"', PYPROJECT.read_text())
    assert len(found) == 1, found
    return Requirement(found[0])


def test_create_bidirectional_mask_imports_and_takes_inputs_embeds():
    assert "inputs_embeds" in inspect.signature(create_bidirectional_mask).parameters


def test_create_bidirectional_mask_masks_the_padding(distilbert_dir):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(distilbert_dir, attn_implementation="eager")
    hidden = torch.zeros(2, 3, config.dim)
    attention_mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    mask = create_bidirectional_mask(config=config, inputs_embeds=hidden, attention_mask=attention_mask)
    # eager: an additive float mask, 0 where a token may attend, a large negative at padding
    assert mask.shape == (2, 1, 3, 3)
    assert (mask[0] == 0).all() and (mask[1, :, :, :2] == 0).all() and (mask[1, :, :, 2] < -1e4).all()


def test_pyproject_floor_admits_no_transformers_without_it():
    specifier = transformers_requirement().specifier
    assert FIRST_WORKING in specifier
    for release in RELEASES_WITHOUT_IT:
        assert release not in specifier, release
