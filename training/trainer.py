"""UniDEC training loop (Kharbanda et al., WWW 2025) with the RAE-XMC loss as an option.

One epoch: (every τ epochs) embed all training queries and labels with the current model,
cluster the queries into balanced clusters (curriculum size) and mine each query's hard
negatives from an HNSW index over the label embeddings; then, batch by batch, sample β
positives + η hard negatives per query, pool them, score the pool with both heads and step on

    ℒ = λ·(ℒ_D,q→l + λ_D·ℒ_D,l→q [+ w_RAE·ℒ_RAE]) + (1−λ)·(ℒ_C,q→l + λ_C·ℒ_C,l→q [+ w_BCE·ℒ_BCE]).

After the epoch: exact-search dev metrics (DE⊕CLF, DE, CLF, RAE), a JSONL log line, the
export-layout checkpoint (``checkpoint/``, and ``best/`` by ``select_metric``) and the trainer
state for ``--resume``.
"""

from __future__ import annotations

import json
import logging
import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from service.engine.rae import build_values
from training.batching import (
    Batch,
    PslBatcher,
    balanced_clusters,
    cluster_batches,
    curriculum_cluster_size,
    mine_hard_negatives,
)
from training.cache import TokenStateCache, cached_states, length_sorted_batches
from training.checkpoint import default_encoder_dir, fit_pca_head, uses_sentence_normalize
from training.data import XMCDataset, load_jsonl_split
from training.embedding_eval import rank_labels, rank_rae, score_ranking
from training.encoder_layers import freeze_prefix, num_layers
from training.losses import LOSSES, BinaryCrossEntropyLoss, RaeContrastiveLoss
from training.model import UniDEC, linear_from_block, load_encoder, load_fast_tokenizer
from training.params import TrainParams

log = logging.getLogger("xmcserve.train")

STATE_FILE = "state.pt"
LOG_FILE = "train_log.jsonl"
PARAMS_FILE = "params.yaml"


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


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
class TextSide:
    """The texts of one side (training queries, labels, dev queries) and their cached prefix."""

    texts: list[str]
    cache: TokenStateCache | None
    name: str = ""  # set for the run's own sides (train, labels, dev): their vectors are memoised


@dataclass
class DevVectors:
    """The served vectors (the model's ``ServingHead``, as export writes it) of the dev queries,
    the labels and the training instances; the RAE memory is training instances + labels."""

    query: np.ndarray
    label: np.ndarray
    train: np.ndarray
    de_dim: int

    @property
    def memory(self) -> np.ndarray:
        return np.concatenate([self.train, self.label])

    def half(self, vectors: np.ndarray, name: str) -> np.ndarray:
        """The DE (``de``) or CLF (``clf``) block on its own: each block of a served vector is
        unit-norm and scaled by 1/√2, so a slice times √2 is that half's own vector."""
        block = vectors[:, : self.de_dim] if name == "de" else vectors[:, self.de_dim :]
        return block * math.sqrt(2.0)


@dataclass
class RunState:
    epoch: int = 0
    step: int = 0
    best: float = float("-inf")
    clusters: list[np.ndarray] = field(default_factory=list)
    hard_negatives: list[np.ndarray] | None = None
    train_seconds: float = 0.0  # wall seconds of the run so far, every process of it (resumes add up)


class Trainer:
    """Owns the data, the model, the optimiser and the run directory of one training run."""

    def __init__(self, params: TrainParams):
        self.started = time.perf_counter()  # wall time counts from here: data, cache, init, epochs, evals
        self.params = params
        self.out = Path(params.out_dir)
        self.device = pick_device(params.device)
        if params.threads:
            torch.set_num_threads(params.threads)
        seed_everything(params.seed)
        self.rng = np.random.default_rng(params.seed)
        self.encoder_dir = Path(params.encoder_dir) if params.encoder_dir else default_encoder_dir()
        self._load_data()
        self.tokenizer = load_fast_tokenizer(self.encoder_dir, params.max_length)
        encoder = load_encoder(self.encoder_dir, params.attention)
        depth = num_layers(encoder)
        if not 0 <= params.frozen_layers <= depth:
            raise ValueError(f"frozen_layers must be in [0, {depth}] for this encoder")
        self.encoder_params = freeze_prefix(encoder, params.frozen_layers)
        self._build_caches(encoder.to(self.device))
        self.state = RunState()
        self._pooled_memo: dict[tuple[str, int], np.ndarray] = {}
        self.model = self._init_model(encoder).to(self.device)
        self.batcher = PslBatcher(
            self.train.Y, self.own_labels, params.positives_per_query, params.negatives_per_query, self.rng
        )
        self.loss = LOSSES[params.loss]()
        self.bce = BinaryCrossEntropyLoss()
        self.rae_loss = RaeContrastiveLoss()
        self.steps_per_epoch = math.ceil(len(self.train) / params.batch_size)
        self.optimizer = self._optimizer()
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, warmup_cosine(self.steps_per_epoch * params.epochs, params.warmup_ratio)
        )
        self.values = build_values(self.train.Y, params.rae_lambda)

    # ----------------------------------------------------------------- set-up
    def _load_data(self) -> None:
        p = self.params
        train = load_jsonl_split(p.data_dir, p.train_split)
        if p.max_train:
            train = train.subset(np.arange(min(p.max_train, len(train))))
        self.train: XMCDataset = train
        self.own_labels = train.filter_sets()
        self.dev: XMCDataset | None = None
        if p.dev_split:
            dev = load_jsonl_split(p.data_dir, p.dev_split, labels=train.labels)
            self.dev = dev.subset(np.arange(min(p.max_dev, len(dev)))) if p.max_dev else dev
        log.info(
            "data: %d train, %d dev instances, %d labels",
            len(train),
            len(self.dev) if self.dev else 0,
            train.num_labels,
        )

    def _build_caches(self, encoder: torch.nn.Module) -> None:
        p = self.params
        use_cache = p.frozen_layers > 0
        cache_dir = Path(p.cache_dir) if p.cache_dir else None

        def side(texts: list[str], name: str) -> TextSide:
            cache = (
                cached_states(encoder, self.encoder_dir, self.tokenizer, texts, p.frozen_layers, cache_dir, name)
                if use_cache
                else None
            )
            return TextSide(texts, cache, name)

        started = time.perf_counter()
        self.queries = side(self.train.texts, "train")
        self.labels = side(self.train.labels.texts, "labels")
        self.dev_queries = side(self.dev.texts, "dev") if self.dev is not None else None
        self.cache_seconds = time.perf_counter() - started
        log.info("frozen-prefix states ready in %.1fs", self.cache_seconds)

    def _init_model(self, encoder: torch.nn.Module) -> UniDEC:
        """g1 and g2 start as the PCA projection export uses for untrained encoders; Ψ starts as
        g2 of the labels' own text, so every label (tail and zero-shot too) starts meaningful."""
        p = self.params
        pre_normalize = uses_sentence_normalize(self.encoder_dir)
        model = UniDEC(
            encoder,
            torch.nn.Linear(1, 1),
            torch.nn.Linear(1, 1),
            torch.zeros(1, 1),
            p.frozen_layers,
            pre_normalize,
        )
        pooled_queries = self.memo_pooled(model, self.queries)
        pooled_labels = self.memo_pooled(model, self.labels)
        pca = fit_pca_head(np.concatenate([pooled_queries, pooled_labels]), max(p.de_dim, p.clf_dim), False)
        block = pca.blocks[0]
        model.g1 = linear_from_block(type(block)("g1", block.weight[: p.de_dim], block.bias[: p.de_dim]))
        model.g2 = linear_from_block(type(block)("g2", block.weight[: p.clf_dim], block.bias[: p.clf_dim]))
        with torch.no_grad():
            psi = model.g2(torch.from_numpy(pooled_labels))
        model.psi = torch.nn.Parameter(psi.float())
        return model

    def _optimizer(self) -> torch.optim.Optimizer:
        p = self.params
        groups = [
            {"params": list(self.model.g1.parameters()) + list(self.model.g2.parameters()), "lr": p.lr_heads},
            {"params": [self.model.psi], "lr": p.lr_label_table, "weight_decay": 0.0},
        ]
        if self.encoder_params:
            groups.insert(0, {"params": self.encoder_params, "lr": p.lr_encoder})
        return torch.optim.AdamW(groups, weight_decay=p.weight_decay)

    # ----------------------------------------------------------------- encoding
    def _autocast(self):
        enabled = self.device.type == "cuda"
        return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16, enabled=enabled)

    def pooled_batch(self, model: UniDEC, side: TextSide, rows: np.ndarray, max_tokens: int = 8192) -> torch.Tensor:
        """Φ of ``rows`` of one side, in ``rows`` order. The rows run in length-sorted chunks so
        that little padding is computed: a label pool mixes 5- and 60-token titles."""
        lengths = np.diff(side.cache.offsets)[rows] if side.cache is not None else self._token_lengths(side, rows)
        chunks = length_sorted_batches(lengths, max_tokens)
        parts = [self._pooled_chunk(model, side, rows[chunk]) for chunk in chunks]
        pooled = torch.cat(parts)
        order = torch.from_numpy(np.argsort(np.concatenate(chunks), kind="stable")).to(pooled.device)
        return pooled[order]

    def _token_lengths(self, side: TextSide, rows: np.ndarray) -> np.ndarray:
        # the attention mask, not len(ids): the tokenizer pads to the longest text of the call
        return np.array([sum(e.attention_mask) for e in self.tokenizer.encode_batch([side.texts[r] for r in rows])])

    def _pooled_chunk(self, model: UniDEC, side: TextSide, rows: np.ndarray) -> torch.Tensor:
        if side.cache is not None:
            states, mask = side.cache.batch(rows, self.device)
            return model.pooled_from_states(states, mask)
        encoded = self.tokenizer.encode_batch([side.texts[r] for r in rows])
        ids = torch.tensor([e.ids for e in encoded], dtype=torch.long, device=self.device)
        mask = torch.tensor([e.attention_mask for e in encoded], dtype=torch.long, device=self.device)
        return model.pooled_from_tokens(ids, mask)

    @torch.no_grad()
    def pooled(self, model: UniDEC, side: TextSide, block: int = 4096) -> np.ndarray:
        """Φ of every text of a side, as float32 numpy (eval mode, no grad)."""
        if side.cache is not None and side.cache.pooled_only:
            vectors = torch.from_numpy(side.cache.states.astype(np.float32))
            return model._finish(vectors).numpy()
        was_training = model.training
        model.eval()
        rows = np.arange(len(side.texts))
        parts = []
        for start in range(0, len(rows), block):
            with self._autocast():
                parts.append(self.pooled_batch(model, side, rows[start : start + block], 16384).float().cpu().numpy())
        model.train(was_training)
        return np.concatenate(parts)

    @torch.no_grad()
    def memo_pooled(self, model: UniDEC, side: TextSide) -> np.ndarray:
        """Φ of a side's texts, memoised per optimiser step (the encoder only changes with a
        step): initialisation, the end-of-epoch evaluation and the next refresh share one pass."""
        key = (side.name, self.state.step)
        if not side.name:
            return self.pooled(model, side)
        if key not in self._pooled_memo:
            self._pooled_memo = {k: v for k, v in self._pooled_memo.items() if k[1] == self.state.step}
            self._pooled_memo[key] = self.pooled(model, side)
        return self._pooled_memo[key]

    def serving_vectors(self, side: TextSide, labels: bool = False, blocks: list[str] | None = None) -> np.ndarray:
        """What the exported bundle would serve for a side's texts: ``[N(g1(Φ)) ⊕ N(g2(Φ))]/√2``,
        or ``[N(g1(Φ)) ⊕ N(Ψ)]/√2`` for ``labels``; ``blocks`` restricts the head (e.g. ``["g1_de"]``)."""
        head = self.model.serving_head()
        if blocks is not None:
            head = head.select(blocks)
        pooled = self.memo_pooled(self.model, side)
        return head.label_vectors(pooled) if labels else head.query_vectors(pooled)

    # ----------------------------------------------------------------- training
    def refresh(self, epoch: int) -> None:
        """Re-cluster the queries and re-mine hard negatives with the current embeddings: the DE
        half (UniDEC) or the whole serving vector (DE ⊕ N(Ψ), the space the service searches)."""
        started = time.perf_counter()
        p = self.params
        blocks = None if p.mine_with == "serving" else ["g1_de"]
        queries = self.serving_vectors(self.queries, blocks=blocks)
        labels = self.serving_vectors(self.labels, labels=True, blocks=blocks)
        size = curriculum_cluster_size(epoch, p.cluster_size_start, p.cluster_size_max, p.cluster_grow_every)
        self.state.clusters = balanced_clusters(queries, size, self.rng)
        if p.negatives_per_query > 0:
            self.state.hard_negatives = mine_hard_negatives(
                queries, labels, self.train.Y, self.own_labels, p.hard_negative_depth
            )
        log.info(
            "epoch %d: %d clusters of ≤%d, negatives mined in %.1fs",
            epoch,
            len(self.state.clusters),
            size,
            time.perf_counter() - started,
        )

    def batch_loss(self, batch: Batch) -> tuple[torch.Tensor, dict[str, float]]:
        p = self.params
        model = self.model
        dev = self.device
        positives = torch.from_numpy(batch.positives).to(dev)
        ignore = torch.from_numpy(batch.ignore).to(dev)
        with self._autocast():
            pooled_q = self.pooled_batch(model, self.queries, batch.queries)
            pooled_l = self.pooled_batch(model, self.labels, batch.pool)
            de_q, de_l = model.de(pooled_q).float(), model.de(pooled_l).float()
            clf_q = model.clf(pooled_q).float()
            psi = model.psi[torch.from_numpy(batch.pool).to(dev)]
        if p.clf_normalize:
            clf_q, psi = F.normalize(clf_q, dim=-1), F.normalize(psi, dim=-1)
        s_de = de_q @ de_l.T / p.de_temperature
        s_clf = clf_q @ psi.T / p.clf_temperature
        parts = {"de_q2l": self.loss(s_de, positives, ignore), "clf_q2l": self.loss(s_clf, positives, ignore)}
        if p.lambda_de_l2q:
            parts["de_l2q"] = self.loss(s_de.T, positives.T, ignore.T)
        if p.lambda_clf_l2q:
            parts["clf_l2q"] = self.loss(s_clf.T, positives.T, ignore.T)
        if p.bce_weight:
            parts["clf_bce"] = self.bce(s_clf, positives, ignore)
        if p.rae_weight:
            related = torch.from_numpy(batch.related).to(dev)
            parts["rae"] = self.rae_loss(s_de, positives, ignore, de_q @ de_q.T / p.de_temperature, related)
        de_loss = parts["de_q2l"] + p.lambda_de_l2q * parts.get("de_l2q", 0.0) + p.rae_weight * parts.get("rae", 0.0)
        clf_loss = (
            parts["clf_q2l"] + p.lambda_clf_l2q * parts.get("clf_l2q", 0.0) + p.bce_weight * parts.get("clf_bce", 0.0)
        )
        total = p.lambda_mix * de_loss + (1.0 - p.lambda_mix) * clf_loss
        return total, {name: float(value.detach()) for name, value in parts.items()}

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
        for rows in tqdm(batches, desc=f"epoch {epoch + 1}/{p.epochs}", unit="batch", leave=False):
            batch = self.batcher.make(rows)
            pool_sizes.append(len(batch.pool))
            loss, parts = self.batch_loss(batch)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if p.grad_clip:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), p.grad_clip)
            self.optimizer.step()
            self.scheduler.step()
            self.state.step += 1
            totals["loss"] = totals.get("loss", 0.0) + float(loss.detach())
            for name, value in parts.items():
                totals[name] = totals.get(name, 0.0) + value
        seconds = time.perf_counter() - started
        return {
            **{name: round(value / len(batches), 5) for name, value in totals.items()},
            "batches": len(batches),
            "mean_pool_size": round(float(np.mean(pool_sizes)), 1),
            "epoch_seconds": round(seconds, 1),
            "samples_per_second": round(len(self.train) / seconds, 1),
        }

    # ----------------------------------------------------------------- evaluation
    def dev_vectors(self) -> DevVectors:
        """Serving vectors of the dev queries, the labels and the RAE memory (train + labels)."""
        return DevVectors(
            query=self.serving_vectors(self.dev_queries),
            label=self.serving_vectors(self.labels, labels=True),
            train=self.serving_vectors(self.queries),
            de_dim=self.params.de_dim,
        )

    def evaluate_dev(self) -> dict[str, dict[str, float]]:
        """Exact-search dev metrics of DE⊕CLF, DE, CLF and RAE over the current vectors."""
        if self.dev is None or self.dev_queries is None:
            return {}
        p = self.params
        exclude = self.dev.filter_sets()
        v = self.dev_vectors()
        rankings = {
            "de+clf": rank_labels(v.query, v.label, p.eval_k, exclude),
            "de": rank_labels(v.half(v.query, "de"), v.half(v.label, "de"), p.eval_k, exclude),
            "clf": rank_labels(v.half(v.query, "clf"), v.half(v.label, "clf"), p.eval_k, exclude),
            "rae": rank_rae(v.query, v.memory, self.values, len(self.train), p.rae_tau, p.rae_top_b, p.eval_k, exclude),
        }
        return {name: score_ranking(ranked, self.dev, self.train) for name, ranked in rankings.items()}

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
        saved = torch.load(path, weights_only=False)
        self.model.load_state_dict(saved["model"])
        self.optimizer.load_state_dict(saved["optimizer"])
        self.scheduler.load_state_dict(saved["scheduler"])
        self.state = saved["run"]
        self._pooled_memo = {}
        self.rng.bit_generator.state = saved["rng"]
        self.batcher.rng = self.rng
        torch.set_rng_state(saved["torch_rng"])
        log.info("resumed %s after epoch %d", self.out, self.state.epoch)

    def fit(self, resume: bool = False) -> dict:
        self.out.mkdir(parents=True, exist_ok=True)
        self.params.save(self.out / PARAMS_FILE)
        if resume:
            self.resume()
        earlier = self.state.train_seconds  # wall seconds of the processes before a resume
        if not resume and self.state.epoch == 0:
            # epoch 0: the starting point (pretrained encoder, PCA heads, Ψ from label texts)
            start = {"epoch": 0, "cache_seconds": round(self.cache_seconds, 1), "dev": self.evaluate_dev()}
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
            self.save(metrics)
            with open(self.out / LOG_FILE, "a") as fh:
                fh.write(json.dumps(last) + "\n")
            log.info("epoch %d: %s", epoch + 1, json.dumps({k: last[k] for k in ("loss", "epoch_seconds", "dev")}))
        return last
