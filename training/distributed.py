"""Data-parallel training over the processes torchrun starts (PyTorch DDP): NCCL between GPUs,
gloo between CPU processes.

    python -m torch.distributed.run --nproc_per_node 2 -m training.train --config CONFIG

How a UniDEC step is split, given that a contrastive loss needs every query of the batch against
the whole batch label pool:

* Every rank draws the same global batch: the same seed, the same clusters (each rank clusters
  with the same generator, which keeps the generators in step, and takes rank 0's clusters) and
  the same mined negatives (rank 0 mines, a multi-threaded HNSW build not being deterministic,
  and broadcasts them). ``batch_size`` is the global batch, so a run on W processes samples
  exactly what one process samples.
* Each rank encodes its contiguous share of the batch's queries and of its label pool; the
  shares are all-gathered *with their gradients* and every rank computes the loss ℒ of the
  whole batch. A gathered share's gradient comes back summed over the W ranks' identical
  losses (W·∂ℒ/∂x) and DDP averages the parameter gradients (÷W), so each parameter steps on
  ∂ℒ/∂θ as in one process; Ψ rows, indexed on every rank, get W identical gradients, averaged.
* The full passes (refresh, dev check) encode the texts in shares too, gathered on every rank.
* Rank 0 alone writes checkpoints, the log and the trainer state; ``--resume`` reads that state
  on every rank, so the run directory must be on storage every rank sees.

A single process is the degenerate world (``size`` 1): shares are everything, gathers return
their input, and the run is bit for bit what it was before this module existed.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import all_gather_single_autograd

# How long a rank waits in a collective. Rank 0 alone mines negatives, scores the dev split and
# writes checkpoints while the others wait in their next collective; at 10^6 labels that takes
# minutes, past NCCL's 10-minute default.
COLLECTIVE_TIMEOUT = timedelta(hours=2)


@dataclass(frozen=True)
class World:
    """This process's place among the run's processes, and the collectives the trainer uses.

    Attributes:
        rank / size: the process's rank and the number of processes (torchrun's RANK, WORLD_SIZE).
        local_rank: the rank on this machine (LOCAL_RANK): the GPU a process trains on.
        device: where this process trains.
    """

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.size > 1

    # ----------------------------------------------------------------- shares
    def counts(self, total: int) -> list[int]:
        """Rows per rank when ``total`` rows are cut into contiguous shares (``np.array_split``)."""
        return [len(part) for part in np.array_split(np.arange(total), self.size)]

    def share(self, rows: np.ndarray) -> np.ndarray:
        """This rank's contiguous share of ``rows``."""
        return np.array_split(np.asarray(rows), self.size)[self.rank]

    def share_to_compute(self, rows: np.ndarray) -> np.ndarray:
        """:meth:`share`, but never empty while ``rows`` is not: an empty share computes the
        first row, which the gather drops. Every rank then runs the whole model, which DDP needs
        (a rank whose parameters get no gradient would stall the others' all-reduce)."""
        mine = self.share(rows)
        return mine if len(mine) or not len(rows) else np.asarray(rows)[:1]

    # ----------------------------------------------------------------- collectives
    def gather_rows(self, local: torch.Tensor, total: int) -> torch.Tensor:
        """The ranks' shares of ``total`` rows, concatenated in rank order, with gradient.
        ``local`` may hold one filler row more than this rank's share (see
        :meth:`share_to_compute`); it is dropped."""
        if not self.distributed:
            return local
        counts = self.counts(total)
        width = max(max(counts), 1)
        mine = local[: counts[self.rank]]
        padded = torch.cat([mine, mine.new_zeros((width - len(mine), *local.shape[1:]))])
        gathered = all_gather_single_autograd(padded, 0, dist.group.WORLD).view(self.size, width, *local.shape[1:])
        return torch.cat([gathered[r, :n] for r, n in enumerate(counts)])

    def gather_array(self, local: np.ndarray, total: int) -> np.ndarray:
        """:meth:`gather_rows` for numpy arrays, without gradient."""
        if not self.distributed:
            return local
        with torch.no_grad():
            gathered = self.gather_rows(torch.from_numpy(np.ascontiguousarray(local)).to(self.device), total)
        return gathered.cpu().numpy()

    def broadcast_ragged(self, rows: list[np.ndarray] | None, count: int) -> list[np.ndarray]:
        """Rank 0's ``count`` int64 arrays of any lengths, on every rank (two broadcasts: the
        lengths, then the values, instead of pickling ``count`` arrays)."""
        if not self.distributed:
            assert rows is not None
            return rows
        lengths = torch.zeros(count, dtype=torch.int64, device=self.device)
        if self.is_main:
            assert rows is not None and len(rows) == count
            lengths.copy_(torch.tensor([len(r) for r in rows], dtype=torch.int64))
        dist.broadcast(lengths, src=0)
        values = torch.zeros(int(lengths.sum()), dtype=torch.int64, device=self.device)
        if self.is_main and len(values):
            values.copy_(torch.from_numpy(np.concatenate(rows).astype(np.int64)))
        dist.broadcast(values, src=0)
        ends = np.cumsum(lengths.cpu().numpy())
        return np.split(values.cpu().numpy(), ends[:-1]) if count else []

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    @contextlib.contextmanager
    def main_first(self) -> Iterator[None]:
        """Rank 0 runs the block before the others (e.g. it builds a cache they then load)."""
        if not self.is_main:
            self.barrier()
        yield
        if self.is_main:
            self.barrier()


def init_world(device: torch.device) -> World:
    """The world torchrun describes in the environment (one process without it). On CUDA each
    process takes the GPU of its local rank and the ranks talk over NCCL, on the CPU over gloo."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size == 1:
        return World(device=device)
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if device.type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=COLLECTIVE_TIMEOUT)
    return World(rank=rank, size=size, local_rank=local_rank, device=device)


def close_world(world: World) -> None:
    if world.distributed and dist.is_initialized():
        dist.destroy_process_group()
