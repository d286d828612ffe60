"""The UniDEC training run (Kharbanda et al., WWW 2025): optimiser, schedule, epochs, per-epoch
dev check, checkpoints and ``--resume``. What is embedded lives in :mod:`training.embedder`, what
is minimised in :mod:`training.objective`.

One epoch: (every τ epochs) embed all training queries and labels with the current model,
cluster the queries into balanced clusters (curriculum size) and mine each query's hard
negatives from an HNSW index over the label embeddings; then, batch by batch, sample β
positives + η hard negatives per query, pool them, score the pool with both heads and step on
the objective. After the epoch: exact-search dev metrics (DE⊕CLF, DE, CLF, RAE), a JSONL log
line, the export-layout checkpoint (``checkpoint/``, and ``best/`` by ``select_metric``) and the
trainer state for ``--resume``.

Under torchrun the run is data-parallel (:mod:`training.distributed`): every rank draws the same
global batch, encodes its share of it, and computes the loss over the gathered shares.
"""

from __future__ import annotations

import json
import logging
import math
import random
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import scipy.sparse as sp
import torch
from tokenizers import Tokenizer
from tqdm import tqdm

from bundle import build_values
from training.batching import (
    Batch,
    PslBatcher,
    balanced_clusters,
    cluster_batches,
    curriculum_cluster_size,
    mine_hard_negatives,
)
from training.distributed import World
from training.embedder import Embedder, TextSide, pick_device
from training.embedding_eval import score_dev_systems
from training.encoder_layers import freeze_prefix, num_layers
from training.gandalf import LabelPoints, label_points
from training.objective import BatchMasks, HeadOutputs, Objective
from training.train_params import TrainParams
from training.unidec import UniDEC, load_encoder, load_fast_tokenizer
from xmc.checkpoint import HOLDOUT_FILE, LOG_FILE, PARAMS_FILE, default_encoder_dir, uses_sentence_normalize
from xmc.data import XMCDataset, load_train_and_dev, split_holdout

log = logging.getLogger("xmcserve.train")

STATE_FILE = "state.pt"


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def warmup_cosine(total_steps: int, warmup_ratio: float):
    """LR multiplier: linear warm-up over ``warmup_ratio`` of the steps, then cosine to 0."""
    warmup = max(1, int(total_steps * warmup_ratio))

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total_steps - warmup)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return factor


@dataclass
class RunState:
    epoch: int = 0
    step: int = 0
    best: float = float("-inf")
    clusters: list[np.ndarray] = field(default_factory=list)
    hard_negatives: list[np.ndarray] | None = None
    train_seconds: float = 0.0  # wall seconds of the run so far, every process of it (resumes add up)


class BatchForward(torch.nn.Module):
    """This rank's share of a batch through Φ and both heads (the module DDP wraps): the DE
    and CLF vectors of its query rows, the DE vectors of its pool-label rows, and the Ψ rows of
    the whole pool (an index into a parameter: cheap, so every rank takes all of it).

    Query rows past the training instances are Gandalf's label points (``point_labels``): their
    text is a label's, so their Φ comes from the labels' side."""

    def __init__(self, embedder: Embedder, num_instances: int, point_labels: np.ndarray | None = None):
        super().__init__()
        self.model = embedder.model
        self.embedder = embedder
        self.num_instances = num_instances
        self.point_labels = point_labels

    def pooled_queries(self, queries: TextSide, labels: TextSide, rows: np.ndarray) -> torch.Tensor:
        points = rows >= self.num_instances
        if self.point_labels is None or not points.any():
            return self.embedder.pooled_batch(queries, rows)
        parts = [
            self.embedder.pooled_batch(queries, rows[~points]),
            self.embedder.pooled_batch(labels, self.point_labels[rows[points] - self.num_instances]),
        ]
        order = np.argsort(np.concatenate([np.flatnonzero(~points), np.flatnonzero(points)]), kind="stable")
        pooled = torch.cat(parts)
        return pooled[torch.from_numpy(order).to(pooled.device)]

    def forward(
        self, queries: TextSide, query_rows: np.ndarray, labels: TextSide, label_rows: np.ndarray, pool: np.ndarray
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        pooled_q = self.pooled_queries(queries, labels, query_rows)
        pooled_l = self.embedder.pooled_batch(labels, label_rows)
        label_table = self.model.psi[torch.from_numpy(pool).to(self.model.psi.device)]
        return self.model.de(pooled_q), self.model.de(pooled_l), self.model.clf(pooled_q), label_table


class Trainer:
    """One training run: its data, model, embedder, objective, optimiser and run directory.

    Args:
        params: the run's :class:`TrainParams`.
        world: the processes of a torchrun launch (:func:`training.distributed.init_world`);
            ``None``: this process alone, on ``params.device``.
    """

    def __init__(self, params: TrainParams, world: World | None = None):
        self.started = time.perf_counter()  # wall time counts from here: data, cache, init, epochs, evals
        self.params = params
        self.out = Path(params.out_dir)
        self.world = world or World(device=pick_device(params.device))
        self.device = self.world.device
        if params.threads:
            torch.set_num_threads(params.threads)
        seed_everything(params.seed)
        self.rng = np.random.default_rng(params.seed)
        self.encoder_dir = Path(params.encoder_dir) if params.encoder_dir else default_encoder_dir()
        self.train, self.dev = self._load_data()
        self.own_labels = self.train.filter_sets()
        self.points = self._label_points()
        self.state = RunState()
        self.embedder = self._pretrained_embedder()
        self._build_sides()
        self._init_heads()
        self.batcher = self._batcher()
        self.objective = Objective(params)
        self.steps_per_epoch = math.ceil(self.batcher.Y.shape[0] / params.batch_size)
        self.optimizer = self._optimizer()
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, warmup_cosine(self.steps_per_epoch * params.epochs, params.warmup_ratio)
        )
        self.values = build_values(self.train.Y, params.rae_lambda)
        self.forward = self._batch_forward()

    @property
    def model(self) -> UniDEC:
        return self.embedder.model

    @property
    def tokenizer(self) -> Tokenizer:
        return self.embedder.tokenizer

    # ----------------------------------------------------------------- set-up
    def _load_data(self) -> tuple[XMCDataset, XMCDataset | None]:
        p = self.params
        train, dev = load_train_and_dev(p.data_dir, p.train_split, p.dev_split, p.max_train, p.max_dev)
        if p.holdout:
            train, held = split_holdout(train, p.holdout, p.seed)
            if self.world.is_main:
                self.out.mkdir(parents=True, exist_ok=True)
                (self.out / HOLDOUT_FILE).write_text("".join(f"{uid}\n" for uid in held.uids))
            log.info("holdout: %d training instances kept out (%s)", len(held), self.out / HOLDOUT_FILE)
        log.info("data: %d train, %d dev instances, %d labels", len(train), len(dev) if dev else 0, train.num_labels)
        return train, dev

    def _label_points(self) -> LabelPoints | None:
        """Gandalf's label points (``params.gandalf``), trained on after the instances."""
        if not self.params.gandalf:
            return None
        points = label_points(self.train.Y, self.params.gandalf_threshold)
        per_point = points.targets.nnz / max(len(points), 1)
        log.info("gandalf: %d label texts as queries, %.1f soft targets each", len(points), per_point)
        return points

    def _batcher(self) -> PslBatcher:
        """Batches over the training rows: the instances, then the label points if any."""
        p = self.params
        Y, own, soft = self.train.Y, self.own_labels, self.points is not None
        if soft:
            Y = sp.vstack([(Y > 0).astype(np.float32), self.points.targets]).tocsr()
            own = own + [{int(label)} for label in self.points.labels]  # a point's own label: its own item
        return PslBatcher(Y, own, p.positives_per_query, p.negatives_per_query, self.rng, soft_targets=soft)

    def _pretrained_embedder(self) -> Embedder:
        """The pretrained encoder with its lower ``frozen_layers`` frozen, heads still to come."""
        p = self.params
        tokenizer = load_fast_tokenizer(self.encoder_dir, p.max_length)
        encoder = load_encoder(self.encoder_dir, p.attention)
        depth = num_layers(encoder)
        if not 0 <= p.frozen_layers <= depth:
            raise ValueError(f"frozen_layers must be in [0, {depth}] for this encoder")
        self.encoder_params = freeze_prefix(encoder, p.frozen_layers)
        pre_normalize = uses_sentence_normalize(self.encoder_dir)
        model = UniDEC.with_placeholder_heads(encoder.to(self.device), p.frozen_layers, pre_normalize)
        cache_dir = Path(p.cache_dir) if p.cache_dir else None
        return Embedder(model, tokenizer, self.device, cache_dir, self.encoder_dir, self.world)

    def _build_sides(self) -> None:
        """The run's three sides with their frozen-prefix states (computed once, or loaded; with
        a cache directory, rank 0 computes and stores them and the other ranks load them)."""
        started = time.perf_counter()
        with self.world.main_first() if self.embedder.cache_dir else nullcontext():
            self.queries = self.embedder.side(self.train.texts, "train")
            self.labels = self.embedder.side(self.train.labels.texts, "labels")
            self.dev_queries = self.embedder.side(self.dev.texts, "dev") if self.dev is not None else None
        self.cache_seconds = time.perf_counter() - started
        log.info("frozen-prefix states ready in %.1fs", self.cache_seconds)

    def _init_heads(self) -> None:
        """g1, g2 by PCA of Φ of the queries and labels, Ψ from the labels' texts (see
        :meth:`UniDEC.init_heads_by_pca`); this first pass of Φ stays memoised for epoch 0."""
        p = self.params
        pooled_queries = self.embedder.pooled(self.queries)
        pooled_labels = self.embedder.pooled(self.labels)
        self.model.init_heads_by_pca(pooled_queries, pooled_labels, p.de_dim, p.clf_dim)
        self.model.label_uids = list(self.train.labels.uids)  # Ψ rows are matched to labels by uid at export
        self.model.to(self.device)

    def _optimizer(self) -> torch.optim.Optimizer:
        p = self.params
        groups = [
            {"params": list(self.model.g1.parameters()) + list(self.model.g2.parameters()), "lr": p.lr_heads},
            {"params": [self.model.psi], "lr": p.lr_label_table, "weight_decay": 0.0},
        ]
        if self.encoder_params:
            groups.insert(0, {"params": self.encoder_params, "lr": p.lr_encoder})
        # fused: one kernel over each tensor instead of a chain of element-wise ops; the same
        # update, and the one that matters at 10^6 labels, where Ψ is most of the parameters
        # (a 10^6 × 32 table: 367 → 28 ms per step on 2 cores)
        return torch.optim.AdamW(groups, weight_decay=p.weight_decay, fused=True)

    def _batch_forward(self) -> torch.nn.Module:
        """The step's forward: :class:`BatchForward`, under DDP when the run has several
        processes (built after the heads exist; DDP starts every rank from rank 0's weights)."""
        point_labels = self.points.labels if self.points is not None else None
        forward = BatchForward(self.embedder, len(self.train), point_labels)
        if not self.world.distributed:
            return forward
        device_ids = [self.device] if self.device.type == "cuda" else None
        return torch.nn.parallel.DistributedDataParallel(forward, device_ids=device_ids, forward_sync_buffers=False)

    # ----------------------------------------------------------------- training
    def refresh(self, epoch: int) -> None:
        """Re-cluster the queries and re-mine hard negatives with the current embeddings: the DE
        half (UniDEC) or the whole serving vector (DE ⊕ N(Ψ), the space the service searches)."""
        started = time.perf_counter()
        p = self.params
        blocks = None if p.mine_with == "serving" else ["g1_de"]
        queries = self.embedder.serving_vectors(self.queries, blocks=blocks)
        if self.points is not None:  # a label point's query vector: its label's text as a query
            as_queries = self.embedder.serving_vectors(self.labels, blocks=blocks)[self.points.labels]
            queries = np.concatenate([queries, as_queries])
        labels = self.embedder.serving_vectors(self.labels, labels=True, blocks=blocks)
        size = curriculum_cluster_size(epoch, p.cluster_size_start, p.cluster_size_max, p.cluster_grow_every)
        # every rank clusters (their generators stay in step) and keeps rank 0's clusters: the
        # vectors are equal to the last bit only when every rank read the same prefix cache
        clusters = balanced_clusters(queries, size, self.rng)
        self.state.clusters = self.world.broadcast_ragged(clusters, len(clusters))
        if p.negatives_per_query > 0:
            mined = None
            if self.world.is_main:
                Y, own = self.batcher.Y, self.batcher.own_labels
                mined = mine_hard_negatives(queries, labels, Y, own, p.hard_negative_depth)
            self.state.hard_negatives = self.world.broadcast_ragged(mined, len(queries))
        log.info(
            "epoch %d: %d clusters of ≤%d, negatives mined in %.1fs",
            epoch,
            len(self.state.clusters),
            size,
            time.perf_counter() - started,
        )

    def head_outputs(self, batch: Batch) -> HeadOutputs:
        """The batch's queries and pool labels through Φ and both heads (bf16 on CUDA, returned
        as float32: the objective's logits and softmaxes run in full precision). Each rank
        encodes its share; the shares are gathered, with their gradients, into the whole batch."""
        world = self.world
        query_rows, label_rows = world.share_to_compute(batch.queries), world.share_to_compute(batch.pool)
        with self.embedder.autocast():
            de_query, de_label, clf_query, label_table = self.forward(
                self.queries, query_rows, self.labels, label_rows, batch.pool
            )
        return HeadOutputs(
            de_query=world.gather_rows(de_query.float(), len(batch.queries)),
            de_label=world.gather_rows(de_label.float(), len(batch.pool)),
            clf_query=world.gather_rows(clf_query.float(), len(batch.queries)),
            label_table=label_table,
        )

    def batch_loss(self, batch: Batch) -> tuple[torch.Tensor, dict[str, float]]:
        masks = BatchMasks.from_batch(batch, self.device)
        return self.objective(self.head_outputs(batch), masks)

    def train_step(self, batch: Batch) -> tuple[float, dict[str, float]]:
        """One optimiser step on ``batch``; the memoised vectors are stale after it."""
        p = self.params
        loss, parts = self.batch_loss(batch)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if p.grad_clip:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), p.grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        self.state.step += 1
        self.embedder.forget()
        return float(loss.detach()), parts

    def train_epoch(self, epoch: int) -> dict:
        p = self.params
        if epoch % max(1, p.refresh_every) == 0 or not self.state.clusters:
            self.refresh(epoch)
        self.batcher.hard_negatives = self.state.hard_negatives
        self.model.train()
        totals: dict[str, float] = {}
        batches = cluster_batches(self.state.clusters, p.batch_size, self.rng)
        pool_sizes = []
        started = time.perf_counter()
        desc = f"epoch {epoch + 1}/{p.epochs}"
        for rows in tqdm(batches, desc=desc, unit="batch", leave=False, disable=not self.world.is_main):
            batch = self.batcher.make(rows)
            pool_sizes.append(len(batch.pool))
            loss, parts = self.train_step(batch)
            for name, value in {"loss": loss, **parts}.items():
                totals[name] = totals.get(name, 0.0) + value
        seconds = time.perf_counter() - started
        return {
            **{name: round(value / len(batches), 5) for name, value in totals.items()},
            "batches": len(batches),
            "mean_pool_size": round(float(np.mean(pool_sizes)), 1),
            "epoch_seconds": round(seconds, 1),
            "samples_per_second": round(self.batcher.Y.shape[0] / seconds, 1),
            "processes": self.world.size,
        }

    # ----------------------------------------------------------------- evaluation
    def evaluate_dev(self) -> dict[str, dict[str, float]]:
        """Exact-search dev metrics of DE⊕CLF, DE, CLF and RAE over the current serving vectors
        (every rank encodes its share; rank 0 scores, the others return nothing)."""
        if self.dev is None or self.dev_queries is None:
            return {}
        p = self.params
        vectors = self.embedder.dev_vectors(self.dev_queries, self.labels, self.queries)
        if not self.world.is_main:
            return {}
        return score_dev_systems(vectors, self.dev, self.train, self.values, p.eval_k, p.rae_tau, p.rae_top_b)

    # ----------------------------------------------------------------- run
    def save(self, metrics: dict) -> None:
        extra = {"train_seconds": round(self.state.train_seconds, 1), "epoch": self.state.epoch, "dev": metrics}
        self.model.save_checkpoint(self.out / "checkpoint", self.encoder_dir, extra)
        system, _, metric = self.params.select_metric.partition("/")
        value = metrics.get(system, {}).get(metric)
        if value is None:  # no dev split, or eval_k below the metric's k: the last epoch is best known
            log.warning("select_metric %s not measured; best/ is the last epoch", self.params.select_metric)
            self.model.save_checkpoint(self.out / "best", self.encoder_dir, extra)
        elif value is not None and value > self.state.best:
            self.state.best = value
            self.model.save_checkpoint(self.out / "best", self.encoder_dir, extra)
        torch.save(
            {
                "model": self.model.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(),
                "run": self.state,
                "rng": self.rng.bit_generator.state,
                "torch_rng": torch.get_rng_state(),
            },
            self.out / STATE_FILE,
        )

    def resume(self) -> None:
        path = self.out / STATE_FILE
        if not path.is_file():
            raise FileNotFoundError(f"--resume: no {path}")
        saved = torch.load(path, weights_only=False, map_location="cpu")  # every rank reads rank 0's state
        self.model.load_state_dict(saved["model"])
        self.optimizer.load_state_dict(saved["optimizer"])
        self.scheduler.load_state_dict(saved["scheduler"])
        self.state = saved["run"]
        self.embedder.forget()
        self.rng.bit_generator.state = saved["rng"]
        self.batcher.rng = self.rng
        torch.set_rng_state(saved["torch_rng"])
        log.info("resumed %s after epoch %d", self.out, self.state.epoch)

    def fit(self, resume: bool = False) -> dict:
        """Train to ``params.epochs`` (from the saved state with ``resume``); rank 0 writes the
        run directory, every rank returns the last epoch's log line (dev metrics on rank 0 only)."""
        main = self.world.is_main
        if main:
            self.out.mkdir(parents=True, exist_ok=True)
            self.params.save(self.out / PARAMS_FILE)
        if resume:
            self.resume()
        earlier = self.state.train_seconds  # wall seconds of the processes before a resume
        if not resume and self.state.epoch == 0:
            # epoch 0: the starting point (pretrained encoder, PCA heads, Ψ from label texts)
            start = {"epoch": 0, "cache_seconds": round(self.cache_seconds, 1), "dev": self.evaluate_dev()}
            if main:
                (self.out / LOG_FILE).write_text(json.dumps(start) + "\n")
        last: dict = {}
        for epoch in range(self.state.epoch, self.params.epochs):
            stats = self.train_epoch(epoch)
            eval_started = time.perf_counter()
            metrics = self.evaluate_dev()
            self.state.epoch = epoch + 1
            self.state.train_seconds = earlier + time.perf_counter() - self.started
            last = {
                "epoch": epoch + 1,
                **stats,
                "train_seconds": round(self.state.train_seconds, 1),
                "eval_seconds": round(time.perf_counter() - eval_started, 1),
                "lr": [round(g["lr"], 8) for g in self.optimizer.param_groups],
                "dev": metrics,
            }
            if not main:
                continue
            self.save(metrics)
            with open(self.out / LOG_FILE, "a") as fh:
                fh.write(json.dumps(last) + "\n")
            log.info("epoch %d: %s", epoch + 1, json.dumps({k: last[k] for k in ("loss", "epoch_seconds", "dev")}))
        return last
