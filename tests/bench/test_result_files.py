"""The result files in bench/results/ name files relative to the repository: each says where it ran
(CPU, cores, versions), none holds the folders of the machine that wrote it (its checkout, venv,
home, temporary or data folders), and every benchmark, study and tool writes its file through the
one writer that makes them so (xmc.results.write_result)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"
# The roots of a machine's folders, as they begin a path inside a string: a value, a dict key, a
# word of a command or a traceback's quoted file. URL paths ("/predict", "/info") begin with none.
MACHINE_ROOTS = ("work", "tmp", "home", "root", "usr", "opt", "var", "mnt", "srv", "scratch", "Users", "private")
MACHINE_PATH = re.compile(rf"(?:^|(?<=[\s\"'`=(\[,:;]))/(?:{'|'.join(MACHINE_ROOTS)})/")
# (file, key path): strings left as their run wrote them. The H100's first try failed in a traceback
# that names the engine package's files; it is renamed with the rest once that package has moved.
LEFT_AS_WRITTEN = {("gpu-h100-first-try.json", "stages.null_encoder.error")}


def strings(value, path: tuple[str, ...] = ()):
    """(key path, string) for every string in ``value``, its dict keys included."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield ".".join((*path, "<key>")), str(key)
            yield from strings(item, (*path, str(key)))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from strings(item, (*path, str(index)))
    elif isinstance(value, str):
        yield ".".join(path), value


def machine_paths(name: str, payload) -> list[str]:
    return [
        f"{name}: {where}: {text[:120]!r}"
        for where, text in strings(payload)
        if MACHINE_PATH.search(text) and (name, where) not in LEFT_AS_WRITTEN
    ]


@pytest.mark.parametrize("path", sorted(RESULTS.glob("*.json")), ids=lambda p: p.name)
def test_no_result_file_holds_a_folder_of_the_machine_that_wrote_it(path):
    assert machine_paths(path.name, json.loads(path.read_text())) == []


def test_the_check_finds_machine_folders_and_not_url_paths():
    payload = {
        "bundle": "/work/main/bundles/default",
        "command": ["python", "-m", "bench.serving", "--out=/tmp/x/serving.json"],
        'process 1:"/home/me/.venv/bin/python bench/lib/null_encoder.py"': 1.0,
        "error": 'Traceback:\n  File "/usr/lib/python3.11/asyncio/runners.py", line 1',
        "fine": ["/predict", "/info", "bundles/default", "../shared/data/debian-related", "<tmp>/w", "~/out"],
        "container": "ctr_run -e HOME=/tmp --tmpfs /tmp -v <host dir>:/bundles",
    }
    found = machine_paths("x.json", payload)
    assert [line.split(": ")[1] for line in found] == ["bundle", "command.3", "<key>", "error"]


# Writers of files that are not results: a run's training config, the quality run's own progress
# file and the GPU payload's device calls (their paths are used), the peer's stamp in its work folder.
NOT_RESULTS = {
    "studies/ddp_parity/run.py",
    "studies/quality/run.py",
    "tools/gpu/payload.py",
    "bench/lib/infinity_peer.py",
}
WRITERS = ("bench", "studies", "tools")
HAND_WRITTEN = re.compile(r"write_text\(\s*json\.dumps\(")


def test_every_benchmark_study_and_tool_writes_its_result_file_through_the_one_writer():
    writers = [*sorted(path for folder in WRITERS for path in (ROOT / folder).rglob("*.py"))]
    writers.append(ROOT / "export" / "evaluate.py")
    by_hand = [
        f"{path.relative_to(ROOT)}:{text[: match.start()].count(chr(10)) + 1}"
        for path in writers
        for text in [path.read_text()]
        for match in HAND_WRITTEN.finditer(text)
        if str(path.relative_to(ROOT)) not in NOT_RESULTS
    ]
    assert by_hand == []
