"""A training run's held-out instances of a bundle's memory split, and their fusion features as
export.held_out computes them.
"""

from __future__ import annotations

from pathlib import Path

from engine import load_predictor
from engine.offline import FEATURE_GROUPS, KeyTerms, LabelKeySource, ScoreFusion
from export.fuse import check_memory
from export.held_out import (
    DEFAULT_HELD_OUT_MEMORY,
    HeldOutMemory,
    HeldOutPairs,
    HeldOutSearch,
    SparseSpec,
    unfitted_fusion,
)
from xmc.checkpoint import HOLDOUT_FILE
from xmc.data import load_jsonl_split, rows_of_uids


def held_out_instances(bundle: Path, run: Path, data: Path):
    """(train, predictor, rows): the training split, the bundle's predictor (its memory checked
    against that split) and the rows of the run's held-out instances."""
    train = load_jsonl_split(data, "trn")
    predictor = load_predictor(bundle)
    check_memory(predictor, train)
    return train, predictor, rows_of_uids(train, (run / HOLDOUT_FILE).read_text().split())


def held_out_features(
    predictor,
    train,
    rows,
    rerank_depth: int | None = None,
    memory: HeldOutMemory = DEFAULT_HELD_OUT_MEMORY,
    sparse: SparseSpec | None = None,
    label_keys: LabelKeySource | None = None,
) -> tuple[ScoreFusion, KeyTerms, HeldOutPairs]:
    """(served, key_terms, pairs): the fusion with every feature group as it would be served (the
    whole memory's counts and lexicon), not fitted yet, its key terms, and the held-out instances'
    candidate pairs from both searches against ``memory`` (each search's top ``rerank_depth`` by
    p̂; None: all; ``sparse``: joined by a sparse ranker's top labels; ``label_keys``: by the
    nearest label keys of a deeper search; each source's features after the others)."""
    sources = {"sparse": sparse, "label_keys": label_keys}
    groups = tuple(g for g in FEATURE_GROUPS if g not in sources or sources[g] is not None)
    served, key_rows = unfitted_fusion(predictor, train, groups, rerank_depth, sparse=sparse, label_keys=label_keys)
    fit = sparse.fit if sparse is not None else None
    search = HeldOutSearch.of(predictor, train, rows, (served, key_rows), memory, fit)
    return served, KeyTerms(key_rows), search.pairs(predictor, train, "both")
