"""bench.lib.latency's in-process stage timings: the three ways it times a bundle's stages."""

from bench.lib.latency import served_predictor, stage_medians
from tests.conftest import SAMPLE_DIR
from xmc.data import load_jsonl_split


def test_stage_medians_time_every_stage_or_the_search_steps_alone(tiny_rae_bundle):
    texts = load_jsonl_split(SAMPLE_DIR, "dev").texts[:30]
    predictor = served_predictor(tiny_rae_bundle)
    whole = stage_medians(predictor, texts)
    assert set(whole) == {"tokenize", "encode", "search", "aggregate"}
    assert all(ms > 0 for ms in whole.values())
    after_gap = stage_medians(predictor, texts[:5], idle_gap_s=0.001)
    assert set(after_gap) == set(whole)
    alone = stage_medians(predictor, texts, search_only=True)
    assert set(alone) == {"search", "aggregate"} and all(ms > 0 for ms in alone.values())
