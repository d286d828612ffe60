"""The card every bundle is written with (:mod:`bundle.card`), and the figures recorded into it
after the bundle is measured.

:func:`card_for` makes the card from the manifest (what data, encoder, head, index and fusion)
and the :class:`CardFacts` the writing command knows (its name, the recipe, each stage's seconds,
the figures it measured, notes); the export writer calls it for every bundle it seals.
:func:`record` writes a bundle again with more facts in its card — the same files, hard-linked,
so the same bundle id (the card is outside the id) — atomically, like any bundle write."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from bundle import (
    CARD_FILE,
    CARD_FILES,
    CARD_README_FILE,
    Card,
    Figures,
    Manifest,
    read_card,
    read_manifest,
    render_readme,
)


@dataclass
class CardFacts:
    """What the command writing a bundle knows beyond its manifest.

    Attributes:
        command: the command that wrote it (``xmcserve build``, ``xmcserve fit``, …); None: the
            command this process was started as (:func:`started_as`)
        recipe: the training recipe, where one trained the encoder
        seconds: wall seconds of each stage
        figures: quality measured, baselines included (a row of the same system, split and
            protocol as an earlier one replaces it)
        notes: sentences a reader should see
    """

    command: str | None = None
    recipe: str | None = None
    seconds: dict[str, float] = field(default_factory=dict)
    figures: list[Figures] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def merged_over(self, card: Card | None) -> CardFacts:
        """These facts over an earlier card's: its figures and notes kept unless replaced."""
        if card is None:
            return self
        mine = {(row.system, row.split, row.protocol) for row in self.figures}
        kept = [row for row in card.figures if (row.system, row.split, row.protocol) not in mine]
        return CardFacts(
            command=self.command or card.made.get("command"),
            recipe=self.recipe or card.recipe,
            seconds={**card.seconds, **self.seconds},
            figures=kept + list(self.figures),
            notes=list(dict.fromkeys([*card.notes, *self.notes])),
        )


def started_as() -> str:
    """The command this process runs: ``xmcserve fit`` under the xmcserve command, ``python -m
    export.build`` for a module run with ``-m``, else ``python`` (a library call)."""
    argv0 = sys.argv[0] if sys.argv else ""
    if argv0.startswith("xmcserve "):
        return argv0
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is not None and spec.name:
        return f"python -m {spec.name.removesuffix('.__main__')}"
    return "python"


def xmcserve_version() -> str:
    try:
        return version("xmcserve")
    except PackageNotFoundError:
        return "unknown"


def card_for(manifest: Manifest, facts: CardFacts | None = None) -> Card:
    """The card of the bundle ``manifest`` describes (its id already derived)."""
    facts = facts or CardFacts()
    source, fusion = manifest.source, manifest.fusion
    rae = manifest.rae.model_dump(mode="json") if manifest.rae is not None else None
    return Card(
        bundle_id=manifest.bundle_id,
        made={
            "command": facts.command or started_as(),
            "version": xmcserve_version(),
            "git_sha": source.git_sha,
            "created_at": manifest.created_at,
        },
        data={
            "name": source.data,
            "labels": manifest.counts.labels,
            "train_instances": manifest.counts.train_instances,
        },
        model={
            "encoder": source.encoder,
            "head": source.head,
            "dim": manifest.dim,
            "index_kind": manifest.index_kind,
            "ann": manifest.ann,
            "rae": rae,
            "fusion": fusion.kind if fusion is not None else None,
        },
        recipe=facts.recipe,
        seconds=facts.seconds,
        figures=facts.figures,
        notes=facts.notes,
    )


def write_card(directory: Path, card: Card) -> None:
    """``card.json`` and its ``README.md`` into a bundle being written."""
    (directory / CARD_FILE).write_text(card.model_dump_json(indent=2) + "\n")
    (directory / CARD_README_FILE).write_text(render_readme(card))


def record(bundle: Path, facts: CardFacts) -> Manifest:
    """``bundle`` written again with ``facts`` added to its card (same files, same id); the
    bundle at that path is swapped atomically. Raises :class:`bundle.BundleError` for a bundle
    whose manifest or card is unreadable."""
    from export.writer import write_bundle

    manifest = read_manifest(bundle)
    merged = facts.merged_over(read_card(bundle, manifest.files))
    kept = [name for name in manifest.files if name not in CARD_FILES]

    def populate(stage: Path) -> dict:
        for name in kept:
            target = stage / name
            target.parent.mkdir(parents=True, exist_ok=True)
            os.link(bundle / name, target)  # bundle files are never written in place
        return manifest.model_dump(exclude={"bundle_id", "files"})

    return write_bundle(bundle, populate, force=True, card=merged)
