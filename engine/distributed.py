"""The engine's parts that a deployment sharding one bundle across processes loads apart (the Ray
Serve front end, :mod:`service.ray_serve`): the encoder alone, one shard's index and value rows
alone, the labels and fusion alone, and the steps that turn the shards' answers into rankings
(merge, exclusion, the one ranking). A single process loads them all at once instead
(:func:`engine.load_predictor`)."""

from engine.bundle import load_encoder, load_fusion, load_labels, load_shard
from engine.memory import base_view, fetch_and_ef
from engine.search import excluded_label_ids, merged_neighbours, neighbours_needed, rank_batch
from engine.shards import ShardAnswer, ShardQuery, ShardSearcher, merge_answers

__all__ = [
    "load_encoder",
    "load_fusion",
    "load_labels",
    "load_shard",
    "base_view",
    "fetch_and_ef",
    "ShardQuery",
    "ShardAnswer",
    "ShardSearcher",
    "merge_answers",
    "merged_neighbours",
    "neighbours_needed",
    "excluded_label_ids",
    "rank_batch",
]
