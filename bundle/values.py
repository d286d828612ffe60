"""An RAE memory's value rows V = [λ·Y_trn ; (1−λ)·I_L] (RAE-XMC eq. 4): built offline from the
training labels, written as one CSR file per shard (``values.npz``, ``values-<i>.npz``), and read
back checked (:func:`~bundle.csr_file.load_csr`) and stacked in key order."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import scipy.sparse as sp

from bundle.csr_file import load_csr
from bundle.errors import BundleError
from bundle.manifest import Manifest, Shard, shard_list

# V's entries are λ or 1 − λ, λ in 0..1 (RAE-XMC eq. 4)
VALUE_RANGE = (0.0, 1.0)


def build_values(Y_train: sp.csr_matrix, lam: float) -> sp.csr_matrix:
    """V = [λ·Y_trn ; (1−λ)·I_L] as float32 CSR, shape (N + L) x L (RAE-XMC eq. 4)."""
    num_labels = Y_train.shape[1]
    Y = (Y_train > 0).astype(np.float32)
    V = sp.vstack([lam * Y, (1.0 - lam) * sp.identity(num_labels, dtype=np.float32, format="csr")])
    return V.tocsr().astype(np.float32)


def load_shard_values(path: Path, manifest: Manifest, shard: Shard) -> sp.csr_matrix:
    """One shard's rows of V, (its keys x labels): λ or 1 − λ where a key votes for a label, so
    every value in 0..1 (a larger one would outweigh the softmax's weights, and enough of them
    overflow a score to ``inf``)."""
    return load_csr(path / shard.values, (shard.keys, manifest.counts.labels), "value matrix", VALUE_RANGE)


def check_rae_counts(path: Path, manifest: Manifest) -> None:
    if manifest.rae is None:
        raise BundleError(f"{path}: rae_memory bundle without RAE parameters")
    if manifest.counts.train_instances + manifest.counts.labels != manifest.counts.memory_rows:
        raise BundleError(f"{path}: memory rows != train instances + labels")


def load_values(path: Path, manifest: Manifest) -> sp.csr_matrix | None:
    """V, the shards' value rows stacked in key order."""
    if manifest.index_kind != "rae_memory":
        return None
    check_rae_counts(path, manifest)
    parts = [load_shard_values(path, manifest, shard) for shard in shard_list(manifest)]
    return parts[0] if len(parts) == 1 else sp.vstack(parts, format="csr")
