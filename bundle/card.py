"""The bundle's card: what a reader asks of a bundle before serving it — what data and recipe made
it, how long that took, and how good it is — as ``card.json`` (this schema) with a short
``README.md`` rendered from it, both written into every bundle by the export writer.

Both are listed with their sha256 in the manifest like every file, so a changed card is refused
at load like a changed index; but they are left out of the bundle id (:func:`~bundle.manifest.
content_id`), since they describe what the bundle serves without changing it: measuring a bundle
and recording the figures in its card keeps its id. A bundle from before cards has none, and
loads as before."""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from bundle.errors import BundleError

CARD_FILE = "card.json"
CARD_README_FILE = "README.md"
CARD_FILES = (CARD_FILE, CARD_README_FILE)
# A card is a page of figures; a larger one is not a card, and is not read into a server.
MAX_CARD_BYTES = 256 << 10


class _Card(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Figures(_Card):
    """One system's figures on one split, under one protocol."""

    system: str = Field(description="what was measured: this bundle, or a baseline such as tfidf-ovr-logreg")
    split: str = Field(description="the split scored (dev, tst) or held-out (the fusion's cross-fitted validation)")
    protocol: str = Field(description="peers (filter after ranking) or exclude-before (filtered labels excluded)")
    metrics: dict[str, float] = Field(description="P@k, PSP@k, R@k, ... in percent")


class Card(_Card):
    """What made the bundle and how good it is. ``made`` and ``data`` come from the manifest and
    are always there; the rest is filled by the command that knows it (``xmcserve fit`` trains,
    fuses and measures; ``xmcserve evaluate --record`` adds a split's figures)."""

    bundle_id: str
    made: dict = Field(description="the command, version, git commit and time that wrote the bundle")
    data: dict = Field(description="the data: its name, labels and memory instances")
    model: dict = Field(description="encoder, serving head, index, RAE parameters and fusion")
    recipe: str | None = Field(None, description="the training recipe (a shipped name or a file)")
    seconds: dict[str, float] = Field(default_factory=dict, description="wall seconds of each stage that made it")
    figures: list[Figures] = Field(default_factory=list, description="the measured quality, baselines included")
    notes: list[str] = Field(default_factory=list, description="what a reader should know (e.g. which rival shipped)")


def read_card(path: Path, files: dict[str, str]) -> Card | None:
    """The card of the bundle at ``path`` whose manifest lists ``files`` (None for a bundle
    without one), checked for size and schema; :class:`BundleError` on a bad card. Its checksum
    is the loader's to check, with the other files."""
    if CARD_FILE not in files:
        return None
    file = path / CARD_FILE
    try:
        size = file.stat().st_size
        if size > MAX_CARD_BYTES:
            raise BundleError(f"{file}: {size} bytes, over the {MAX_CARD_BYTES} a card may have")
        return Card.model_validate(json.loads(file.read_bytes()))
    except OSError as exc:
        raise BundleError(f"{file}: unreadable ({exc.strerror or exc})") from None
    except (ValueError, ValidationError) as exc:  # JSONDecodeError is a ValueError
        raise BundleError(f"{file}: not a bundle card: {str(exc).splitlines()[0]}") from None


def render_readme(card: Card) -> str:
    """The card as a short Markdown page (``README.md`` in the bundle)."""
    data, model, made = card.data, card.model, card.made
    lines = [
        f"# Bundle {card.bundle_id}",
        "",
        f"Made by `{made.get('command', '?')}` (xmcserve {made.get('version', '?')}"
        + (f", commit {made['git_sha'][:12]}" if made.get("git_sha") else "")
        + f") on {made.get('created_at', '?')}.",
        "",
        f"- **data**: {data.get('name') or 'unnamed'}: {data.get('labels', '?')} labels, "
        f"{data.get('train_instances', 0)} memory instances",
        f"- **model**: {model.get('index_kind', '?')} over {model.get('encoder', '?')} "
        f"({model.get('head', '?')} head, {model.get('dim', '?')}-d), {model.get('fusion') or 'no'} fusion",
    ]
    if card.recipe:
        lines.append(f"- **recipe**: {card.recipe}")
    if card.seconds:
        stages = ", ".join(f"{name} {seconds:,.0f} s" for name, seconds in card.seconds.items())
        lines.append(f"- **time**: {stages}")
    if card.figures:
        names = sorted({name for row in card.figures for name in row.metrics}, key=_metric_order)
        lines += ["", "| system | split | protocol | " + " | ".join(names) + " |"]
        lines.append("| --- | --- | --- | " + " | ".join("---:" for _ in names) + " |")
        for row in card.figures:
            cells = " | ".join(f"{row.metrics[n]:.2f}" if n in row.metrics else "" for n in names)
            lines.append(f"| {row.system} | {row.split} | {row.protocol} | {cells} |")
    else:
        lines += ["", "Not measured yet: `xmcserve evaluate --bundle DIR --data DATA --record` adds figures."]
    lines += [""] + [f"> {note}" for note in card.notes] + ([""] if card.notes else [])
    return "\n".join(lines).rstrip() + "\n"


def _metric_order(name: str) -> tuple[str, int]:
    kind, _, k = name.partition("@")
    return (kind, int(k) if k.isdigit() else 0)
