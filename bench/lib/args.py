"""The options the benchmarks repeat, spelled once: :func:`common` is an argparse parent parser
(``argparse.ArgumentParser(..., parents=[common(...)])``) of ``--bundle`` (what is served),
``--data`` (whose texts are sent), ``--out`` (the result file, written by
:func:`xmc.results.write_result`), ``--seed`` and ``--env`` (extra server settings), each with a
benchmark's own default; :func:`bench_parser` is a benchmark's parser with that parent and its docstring;
and the parsers of the compressed-index sweeps' ``--settings``."""

from __future__ import annotations

import argparse
from pathlib import Path

BUNDLE = Path("bundles/default")
SAMPLE = Path("data/debian-sample")
DEBIAN = Path("../shared/data/debian-related")
REQUIRED = "required"


def common(
    out: str | None = None,
    *,
    bundle: Path | str | None = BUNDLE,
    data: Path | None = SAMPLE,
    seed: int | None = None,
    env: bool = False,
) -> argparse.ArgumentParser:
    """A parent parser of the shared options: ``--out`` defaulting to ``out`` (None: no option),
    ``--bundle`` to ``bundle`` (:data:`REQUIRED`: no default; None: no option), ``--data`` to
    ``data`` (None: no option), ``--seed`` to ``seed`` (None: no option), ``--env`` when asked."""
    parent = argparse.ArgumentParser(add_help=False)
    if bundle is not None:
        required = bundle == REQUIRED
        default = None if required else Path(bundle)
        parent.add_argument(
            "--bundle", type=Path, required=required, default=default, help=f"bundle to serve (default {default})"
        )
    if data is not None:
        parent.add_argument("--data", type=Path, default=data, help=f"data set whose texts are sent (default {data})")
    if seed is not None:
        parent.add_argument("--seed", type=int, default=seed, help=f"random seed (default {seed})")
    if env:
        parent.add_argument(
            "--env", action="append", default=[], metavar="NAME=VALUE", help="extra XMCSERVE_* setting (repeatable)"
        )
    if out is not None:
        parent.add_argument("--out", type=Path, default=Path(out), help=f"result JSON (default {out})")
    return parent


def bench_parser(description: str, out: str | None = None, **options) -> argparse.ArgumentParser:
    """A benchmark's parser: ``description`` (its docstring, shown as written) and the options of
    :func:`common` (``out`` and ``options``)."""
    return argparse.ArgumentParser(
        description=description,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        parents=[common(out, **options)],
    )


def breadth_settings(text: str) -> list[tuple[int, int]]:
    """``--settings`` of a compressed-index sweep: comma-separated ``nprobe:ef`` pairs (cells
    scanned, candidates re-ranked), cheap to costly."""
    return [(int(nprobe), int(ef)) for nprobe, ef in (pair.split(":") for pair in text.split(","))]


def first_reaching(recalls: dict, target: float):
    """The first key of ``recalls`` (setting → recall@10, in sweep order) whose recall reaches
    ``target``; the best one when none does."""
    return next((key for key, recall in recalls.items() if recall >= target), max(recalls, key=recalls.get))
