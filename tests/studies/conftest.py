import pytest

from tests.support.memory_and_run import memory_and_run as tiny_memory_and_run
from xmc.data import load_jsonl_split


@pytest.fixture(scope="session")
def memory_and_run(sample_dir, distilbert_dir, tmp_path_factory):
    """A tiny-DistilBERT RAE memory of the whole sample and a run holding 150 of its instances out."""
    return tiny_memory_and_run(load_jsonl_split(sample_dir, "trn"), distilbert_dir, tmp_path_factory, "tiny")
