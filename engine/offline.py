"""What building, fusing, compacting and measuring a bundle use of the engine beyond serving
(``export/``, ``bench/``, ``studies/``, ``tools/``): the runtime bundle and its encoder (and the
null encoder benchmarks serve with, and its vector file), the key index and its builders, the one
ranking of fetched keys and the score fusion's candidates and features, the lexical terms and the
sparse ranker over them, the references a served answer is measured against (exact search, the
text ranked alone), and the append logs a compaction or a bundle-to-bundle tool carries on. Front
ends use :mod:`engine` only."""

from engine.append_log import AppendLog, lineage_log_path, sync_directory
from engine.bundle import Bundle, load_bundle, load_encoder, load_labels, load_shard, load_shard_index
from engine.encoder import MAX_CHUNK, OnnxEncoder
from engine.fusion import (
    FEATURE_GROUPS,
    OPTIONAL_GROUPS,
    SOURCE_GROUPS,
    LabelKeySource,
    OnnxTreeEnsemble,
    ScoreFusion,
    features_of_groups,
    memory_log_frequency,
)
from engine.index import (
    HnswIndex,
    IvfPqIndex,
    KeyIndex,
    ShardedIndex,
    auto_nlist,
    empty_index,
    exact_rerank,
    faiss_threads,
)
from engine.lexical import KeyTerms, Lexicon, save_key_terms
from engine.loading import SOURCE_LOGS, carried_lineage, load_for_reading
from engine.memory import fetch_and_ef
from engine.null_encoder import NullEncoder, write_null_vectors
from engine.reference import (
    BATCH_TOLERANCE,
    Invariance,
    ann_recall,
    batch_invariance,
    exact_rankings,
    key_recall_at_10,
    recall_at_k,
    recall_with_label_ties,
    recall_with_ties,
)
from engine.search import FusionRows, Neighbours, fusion_candidates, neighbours_needed, rank_batch
from engine.shards import merge_answers
from engine.sparse import LABEL_WEIGHT, PRUNE, SparseRanker, centroid_columns, pruned

__all__ = [
    # the runtime bundle and its encoder
    "Bundle",
    "load_bundle",
    "load_encoder",
    "load_labels",
    "load_shard",
    "load_shard_index",
    "OnnxEncoder",
    "MAX_CHUNK",
    "NullEncoder",
    "write_null_vectors",
    # the key index
    "KeyIndex",
    "HnswIndex",
    "IvfPqIndex",
    "ShardedIndex",
    "auto_nlist",
    "empty_index",
    "exact_rerank",
    "faiss_threads",
    "fetch_and_ef",
    "merge_answers",
    # ranking and the score fusion
    "Neighbours",
    "neighbours_needed",
    "rank_batch",
    "fusion_candidates",
    "FusionRows",
    "ScoreFusion",
    "OnnxTreeEnsemble",
    "FEATURE_GROUPS",
    "OPTIONAL_GROUPS",
    "SOURCE_GROUPS",
    "features_of_groups",
    "memory_log_frequency",
    "Lexicon",
    "KeyTerms",
    "save_key_terms",
    "SparseRanker",
    "centroid_columns",
    "pruned",
    "LABEL_WEIGHT",
    "PRUNE",
    "LabelKeySource",
    # the references a served answer is measured against
    "exact_rankings",
    "recall_at_k",
    "recall_with_label_ties",
    "recall_with_ties",
    "ann_recall",
    "key_recall_at_10",
    "batch_invariance",
    "Invariance",
    "BATCH_TOLERANCE",
    # append logs and lineages
    "AppendLog",
    "lineage_log_path",
    "sync_directory",
    "carried_lineage",
    "load_for_reading",
    "SOURCE_LOGS",
]
