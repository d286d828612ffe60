"""Variants: a primary bundle (A), an optional candidate (B), sticky A/B routing, atomic swaps,
and the bundle A served before its last change, kept loaded so that a rollback is one more swap.

Each variant slot owns a micro-batcher that reads the slot's predictor once per batch, so
swapping a slot's predictor is atomic: a batch already computing finishes on the old bundle, the
next batch runs on the new one. The slots' names are the front end's (``A`` and ``B`` over HTTP):
the first is the primary, the second the candidate.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.batcher import BatcherConfig, MicroBatcher
from engine.search import Predictor, StageTimes

__all__ = ["Variants", "VariantSlot", "route", "key_fraction"]


def key_fraction(key: str) -> float:
    """A request key's fixed position in [0, 1): the same key always lands in the same place,
    so routing is sticky, and raising the split only ever moves keys from A to B."""
    digest = hashlib.blake2b(key.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


def route(key: str | None, split_b: float, candidate_ready: bool, rng: random.Random | None = None) -> bool:
    """True when one request goes to the candidate (B): with probability ``split_b``, sticky per
    key when one is given."""
    if not candidate_ready or split_b <= 0.0:
        return False
    position = key_fraction(key) if key else (rng or random).random()
    return position < split_b


@dataclass
class VariantSlot:
    name: str
    config: BatcherConfig
    on_batch_done: Callable[[int, StageTimes], None]
    on_drop: Callable[[str], None] | None = None
    predictor: Predictor | None = None
    source: str | None = None
    fallback: VariantSlot | None = None
    batcher: MicroBatcher = field(init=False)

    def __post_init__(self) -> None:
        self.batcher = MicroBatcher(self.current_predictor, self.config, self.on_batch_done, self.on_drop)

    def current_predictor(self) -> Predictor | None:
        """This slot's bundle; when it was emptied (B after a promote) with requests still queued,
        the fallback slot's bundle serves them instead of failing them."""
        if self.predictor is None and self.fallback is not None:
            return self.fallback.predictor
        return self.predictor

    @property
    def ready(self) -> bool:
        return self.predictor is not None

    @property
    def bundle_id(self) -> str | None:
        return self.predictor.bundle.bundle_id if self.predictor else None


@dataclass(frozen=True)
class Retired:
    """The bundle A served before a promote or a reload of A, and where it was loaded from."""

    predictor: Predictor
    source: str


@dataclass
class Variants:
    """The live serving state: slots A and B, the split, the counters of swaps, and A's previous
    bundle (kept loaded until A changes again: it costs its memory, and makes a rollback instant)."""

    slots: dict[str, VariantSlot] = field(default_factory=dict)
    primary: str = "A"
    candidate: str = "B"
    split_b: float = 0.0
    swaps: int = 0
    previous: Retired | None = None

    @classmethod
    def create(
        cls,
        config: BatcherConfig,
        on_batch_done: Callable[[str], Callable[[int, StageTimes], None]],
        on_drop: Callable[[str], Callable[[str], None]] = lambda name: None,
        names: tuple[str, str] = ("A", "B"),
    ) -> Variants:
        """``on_batch_done(name)`` / ``on_drop(name)``: each slot's batcher callbacks; ``names``:
        the primary's and the candidate's."""
        primary, candidate = names
        slots = {name: VariantSlot(name, config, on_batch_done(name), on_drop(name)) for name in names}
        slots[candidate].fallback = slots[primary]
        return cls(slots=slots, primary=primary, candidate=candidate)

    def __getitem__(self, name: str) -> VariantSlot:
        return self.slots[name]

    def start(self) -> None:
        for slot in self.slots.values():
            slot.batcher.start()

    async def stop(self) -> None:
        for slot in self.slots.values():
            await slot.batcher.stop()

    def install(self, name: str, predictor: Predictor, source: str) -> Predictor | None:
        """Swap ``predictor`` into slot ``name``; returns the one it replaced."""
        slot = self.slots[name]
        if name == self.primary and slot.predictor is not None:
            self.previous = Retired(slot.predictor, slot.source or "")
        previous, slot.predictor, slot.source = slot.predictor, predictor, source
        self.swaps += 1
        return previous

    def promote(self) -> Predictor:
        """B becomes A; B is emptied and the split reset (all traffic on the new A)."""
        candidate = self.slots[self.candidate]
        if candidate.predictor is None:
            raise LookupError(f"no candidate ({self.candidate}) bundle loaded")
        previous = self.install(self.primary, candidate.predictor, candidate.source or "")
        candidate.predictor, candidate.source = None, None
        self.split_b = 0.0
        return previous

    def rollback(self) -> Predictor:
        """A's previous bundle becomes A again; the one it replaces becomes the previous (a second
        rollback undoes the first). B and the split are left as they are. Returns the one replaced."""
        if self.previous is None:
            raise LookupError(
                f"no previous {self.primary} bundle to roll back to ({self.primary} has not changed since start-up)"
            )
        back = self.previous
        return self.install(self.primary, back.predictor, back.source)

    def choose(self, key: str | None, forced: str | None = None) -> VariantSlot:
        if forced is not None:
            slot = self.slots[forced]
            if not slot.ready:
                raise LookupError(f"variant {forced} has no bundle loaded")
            return slot
        to_candidate = route(key, self.split_b, self.slots[self.candidate].ready)
        return self.slots[self.candidate if to_candidate else self.primary]

    def describe(self) -> dict:
        return {
            "split_b": self.split_b,
            "swaps": self.swaps,
            "variants": {
                name: {
                    "bundle_id": slot.bundle_id,
                    "source": slot.source,
                    "queue_depth": slot.batcher.depth,
                    "memory": slot.predictor.view.describe() if slot.predictor else None,
                }
                for name, slot in self.slots.items()
            },
            "previous": {
                "bundle_id": self.previous.predictor.bundle.bundle_id if self.previous else None,
                "source": self.previous.source if self.previous else None,
            },
        }
