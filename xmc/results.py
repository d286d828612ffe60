"""How a stage writes a result file (``bench/results/*.json``, ``python -m export.evaluate --out``):
JSON indented by two, one newline at the end, and every path named relative to the repository, so
that a file says what ran and where (CPU, cores, versions) without the folders of the machine that
wrote it.

:func:`write_result` is the one writer; :func:`relative_paths` is what it does to the payload;
:func:`machine` is the machine a result file names (its cores and processor). In
every string (dict keys too, and inside commands and tracebacks) a path in the repository becomes
relative to it (``/work/main/bundles/default`` → ``bundles/default``, the repository itself
``.``), a path beside the repository starts with ``..`` (``../shared/data/debian-related``), one in
the home folder with ``~`` and one in the temporary folder with ``<tmp>``. A bare ``/tmp`` inside a
longer string is left alone: there it names a container's folder, not this machine's.

Here rather than in ``bench/`` because ``export`` writes result files too and may not import
``bench``; only the standard library, so the peers' venvs (``.venv-peers``, ``.venv-annif``) write
through it as well.
"""

from __future__ import annotations

import json
import os
import platform
import re
import tempfile
from collections.abc import Iterable
from pathlib import Path, PurePath
from typing import Any

Prefixes = Iterable[tuple[str, str]]

# What may stand before a path inside a string (its start, a space, a quote, ``--x=``, ``(``), and
# what a path's names are made of: ``/work/main`` must not match inside ``/work/main-old``.
_BEFORE = r"(?:^|(?<=[\s\"'`=(\[,:;]))"
_NAME = r"[\w.+-]"


def repository_root() -> Path:
    """The checkout this module is in, or the working directory where it is installed as a package."""
    here = Path(__file__).resolve().parents[1]
    return here if (here / "pyproject.toml").is_file() else Path.cwd()


def default_prefixes(root: Path | None = None) -> list[tuple[str, str]]:
    """The (absolute folder, its name in a result file) pairs of this machine, the repository first."""
    root = repository_root() if root is None else Path(root)
    pairs = [(str(root.absolute()), "."), (str(root.resolve()), ".")]
    parent = root.resolve().parent
    if len(parent.parts) > 1:
        pairs.append((str(parent), ".."))
    home = Path.home()
    if len(home.parts) > 1:
        pairs.append((str(home), "~"))
    for tmp in (tempfile.gettempdir(), os.environ.get("TMPDIR", ""), "/tmp"):
        if tmp and len(PurePath(tmp).parts) > 1:
            pairs.append((str(PurePath(tmp)), "<tmp>"))
    return pairs


def _compile(prefixes: Prefixes) -> tuple[re.Pattern[str], dict[str, str]]:
    names: dict[str, str] = {}
    for prefix, name in prefixes:
        folder = prefix.rstrip("/")
        if folder:
            names.setdefault(folder, name)  # the first pair for a folder wins
    # the longest first, so that the repository wins over the folder it sits in
    alternatives = "|".join(re.escape(folder) for folder in sorted(names, key=len, reverse=True))
    return re.compile(rf"{_BEFORE}({alternatives})(?!{_NAME})(/?)"), names


def _renamer(prefixes: Prefixes):
    pattern, names = _compile(prefixes)

    def rename_in(text: str) -> str:
        def rename(match: re.Match[str]) -> str:
            name, slash = names[match.group(1)], match.group(2)
            if name == ".":
                # the repository itself is ``.``; a path in it needs no ``./``
                return "" if slash and re.match(_NAME, text[match.end() : match.end() + 1]) else "."
            if not slash and (match.start(), match.end()) != (0, len(text)):
                return match.group(0)  # a bare ``/tmp`` in a command: a container's folder
            return name + slash

        return pattern.sub(rename, text) if names else text

    return rename_in


def relative_text(text: str, prefixes: Prefixes) -> str:
    """``text`` with every path under one of ``prefixes`` renamed (see the module's docstring)."""
    return _renamer(prefixes)(text)


def relative_paths(value: Any, prefixes: Prefixes | None = None) -> Any:
    """``value`` (dicts, lists, tuples, strings, paths, numbers) with every path renamed in every
    string and dict key, the rest as it is; ``prefixes`` defaults to :func:`default_prefixes`."""
    rename_in = _renamer(default_prefixes() if prefixes is None else prefixes)

    def walk(item: Any) -> Any:
        if isinstance(item, PurePath):
            item = str(item)
        if isinstance(item, str):
            return rename_in(item)
        if isinstance(item, dict):
            return {walk(key) if isinstance(key, str) else key: walk(v) for key, v in item.items()}
        if isinstance(item, (list, tuple)):
            return [walk(v) for v in item]
        return item

    return walk(value)


def dumps(payload: Any, prefixes: Prefixes | None = None) -> str:
    """The text :func:`write_result` writes for ``payload``."""
    return json.dumps(relative_paths(payload, prefixes), indent=2) + "\n"


def write_result(path: str | os.PathLike[str], payload: Any) -> Path:
    """Write ``payload`` to ``path`` as a result file, its folder made if missing; returns the path.
    Written whole to a sibling and renamed, so the file is never half a result (a run cut short
    keeps the last whole one)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    staged = path.with_name(path.name + ".tmp")
    staged.write_text(dumps(payload))
    os.replace(staged, path)
    return path


def machine() -> dict[str, Any]:
    """Where a result ran, as its file names it: the cores this machine has and its processor."""
    return {"cpus": os.cpu_count(), "processor": platform.processor() or platform.machine()}
