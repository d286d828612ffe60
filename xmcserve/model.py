"""A bundle loaded for use in process: ``xmcserve.load(bundle_dir).predict(texts, k)`` gives, for
each text, its k labels by uid, text and score, best first: the answers ``POST /predict`` gives
for the same bundle, without a server. Torch-free, like the server."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path

from engine import EncoderOptions, Predictor, load_predictor


@dataclass(frozen=True)
class Label:
    """One label of an answer: its uid, its text and its score (higher is better)."""

    uid: str
    text: str
    score: float


class Model:
    """One bundle, loaded, checked (every file's checksum) and warmed; thread-safe."""

    def __init__(self, predictor: Predictor):
        self.predictor = predictor

    @property
    def bundle_id(self) -> str:
        return self.predictor.bundle.bundle_id

    @property
    def manifest(self):
        """The bundle's manifest (:class:`bundle.Manifest`): what it holds and how it was made."""
        return self.predictor.bundle.manifest

    def predict(
        self, texts: str | Sequence[str], k: int = 10, exclude: Collection[str] | None = None
    ) -> list[list[Label]]:
        """Each text's ``k`` best labels, best first. ``exclude``: label uids none of the answers
        may hold (unknown uids are ignored). One text (a ``str``) still gives a list of answers."""
        batch = [texts] if isinstance(texts, str) else list(texts)
        if not batch:
            return []
        if k < 1:
            raise ValueError(f"k must be at least 1, not {k}")
        view = self.predictor.view
        excluded = [view.label_ids(exclude)] * len(batch) if exclude else None
        prediction = self.predictor.predict(batch, k, exclude=excluded)
        view = prediction.view or view
        uids, label_texts = view.label_uids, view.label_texts
        return [
            [
                Label(uids[i], label_texts[i], float(score))
                for i, score in zip(ranking.ids.tolist(), ranking.scores.tolist(), strict=True)
            ]
            for ranking in prediction.rankings
        ]


def load(bundle_dir: Path | str, threads: int | None = None, verify: bool = True) -> Model:
    """The bundle at ``bundle_dir``, ready to predict. ``threads``: the encoder's intra-op threads
    (default: ONNX Runtime's choice); ``verify``: check every file's sha256 first (a corrupt or
    truncated bundle is refused with :class:`bundle.BundleError`)."""
    options = EncoderOptions(intra_op_threads=threads) if threads else None
    return Model(load_predictor(bundle_dir, options, verify))
