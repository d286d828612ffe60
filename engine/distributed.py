"""The engine of a bundle sharded across processes, as three parts a distributed front end (the
Ray Serve deployments, :mod:`service.ray_serve`) holds one each and calls, never reaching past
them: :class:`EncoderPart` (texts → unit vectors), :class:`ShardPart` (one shard's nearest keys,
with their value rows) and :class:`Coordinator` (the labels, the fusion and the steps between:
what to ask every shard, then the shards' answers merged and ranked). A single process loads the
same parts at once instead (:class:`engine.Engine`); answers are the same, since the coordinator
asks for the keys :meth:`~engine.memory.Memory.knn` would fetch and ranks with the same function.

The front end owns what is about transport: batching requests, deadlines, hedged and repeated
calls, and checking that every answer comes from a replica on the coordinator's bundle
(``bundle_id``)."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np

from engine.bundle import load_encoder, load_fusion, load_labels, load_shard
from engine.encoder import EncoderOptions
from engine.memory import base_view, fetch_and_ef
from engine.search import Ranking, excluded_label_ids, merged_neighbours, neighbours_needed, rank_batch
from engine.shards import ShardAnswer, ShardQuery

__all__ = ["EncoderPart", "ShardPart", "Coordinator", "ShardQuery", "ShardAnswer"]

# a shard's health check asks for this many keys at this breadth
HEALTH_FETCH, HEALTH_EF = 1, 16


class EncoderPart:
    """The bundle's encoder and tokenizer alone, checked by one real encode when loaded."""

    def __init__(self, bundle_dir: Path | str, options: EncoderOptions | None = None, verify: bool = True):
        manifest, self._encoder = load_encoder(bundle_dir, options, verify)
        self.bundle_id = manifest.bundle_id

    def encode(self, texts: list[str]) -> np.ndarray:
        """The texts' unit query vectors (``len(texts) x dim``, float32)."""
        vectors, _ = self._encoder.encode(texts)
        return vectors

    def check(self) -> None:
        """A real encode: :class:`RuntimeError` unless it gives finite unit vectors."""
        vectors = self.encode(["health check"])
        if not np.all(np.isfinite(vectors)) or not np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-3):
            raise RuntimeError("the encoder no longer gives finite unit vectors")


class ShardPart:
    """Shard ``number`` of a bundle alone (an unsharded bundle is shard 0 of 1): its index, for an
    RAE memory its value rows, for a lexical fusion its keys' term vectors."""

    def __init__(self, bundle_dir: Path | str, number: int, verify: bool = True, search_threads: int = 1):
        manifest, self._searcher = load_shard(bundle_dir, number, verify, search_threads=search_threads)
        self.bundle_id = manifest.bundle_id
        self.number = number
        shard = self._searcher.shard
        self._probe = self._searcher.index.vectors([shard.first_key])

    def search_many(self, queries: list[ShardQuery]) -> list[ShardAnswer]:
        """Each query's nearest keys of this shard, as if it were searched alone."""
        return self._searcher.search_many(queries)

    def check(self) -> None:
        """A real query (this shard's first key's own vector): :class:`RuntimeError` unless it is
        answered with a key of this shard."""
        shard = self._searcher.shard
        answer = self._searcher.search(self._probe, HEALTH_FETCH, HEALTH_EF)
        if not (shard.first_key <= answer.keys[0, 0] < shard.first_key + shard.keys):
            raise RuntimeError(f"the shard answered key {answer.keys[0, 0]}, outside its range")


class Coordinator:
    """The labels and the score fusion of a sharded bundle, and the two steps around the shards:
    :meth:`query` (what every shard is asked for a batch of texts) and :meth:`rank` (their
    answers merged, as one index's, and ranked)."""

    def __init__(self, bundle_dir: Path | str, verify: bool = True):
        self.manifest, uids, texts, lookup = load_labels(bundle_dir, verify)
        self.fusion = load_fusion(Path(bundle_dir), self.manifest, verify)
        self.view = base_view(uids, texts, self.manifest.counts.memory_rows, None, uid_lookup=lookup)
        if self.fusion is not None and self.fusion.sparse is not None:  # the single server's columns
            self.view = replace(self.view, sparse_columns=self.fusion.later_label_columns(texts))
        self.bundle_id = self.manifest.bundle_id

    def excluded(self, exclude: Collection[str] | Sequence[Collection[str]], texts: int) -> list[set[int]]:
        """Per text, the label ids of the uids it excludes (one collection for all, or one each)."""
        return excluded_label_ids(self.view, exclude, texts)

    def query(
        self, texts: list[str], vectors: np.ndarray, k: int, ef: int | None, exclude: Sequence[Collection[int]]
    ) -> ShardQuery:
        """What every shard is asked for these texts: the batch's widest fetch at the breadth the
        single server would use (``ef`` or the bundle's), with the texts' terms for a lexical fusion."""
        neighbours = max(neighbours_needed(self.manifest, [k] * len(texts), exclude))
        fetch, ef = fetch_and_ef(neighbours, ef or self.manifest.search_breadth, self.manifest.counts.memory_rows)
        lexicon = self.fusion.lexicon if self.fusion is not None else None
        terms = lexicon.query_terms(texts) if lexicon is not None else None  # each shard scores its keys
        return ShardQuery(vectors, fetch, ef, terms)

    def rank(
        self, query: ShardQuery, answers: Sequence[ShardAnswer], k: int, exclude: Sequence[Collection[int]]
    ) -> tuple[list[Ranking], int]:
        """The shards' answers to ``query`` merged and ranked: each text's ranking and the ef the
        search ran at."""
        ks = [k] * len(query.vectors)
        neighbours = max(neighbours_needed(self.manifest, ks, exclude))
        found = merged_neighbours(answers, neighbours, self.view, query.terms, query.vectors)
        return rank_batch(self.manifest, found, ks, exclude, self.fusion), found.ef
