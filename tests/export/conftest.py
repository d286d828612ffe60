"""What several export tests build their small bundles from and query them with."""

import pytest

from xmc.data import load_jsonl_split


@pytest.fixture(scope="session")
def sample_train(sample_dir):
    return load_jsonl_split(sample_dir, "trn")


@pytest.fixture(scope="session")
def queries(sample_dir):
    return load_jsonl_split(sample_dir, "dev").texts[:40]
