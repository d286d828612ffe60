"""docs/own-data.md's worked example, run as written: the 20-line CSV converted by ``xmc.convert``,
built into a bundle by ``export.build`` and served by ``service.http``, in a scratch directory
laid out as the page assumes (``.venv``, ``docs``); each command must succeed, print the line the
page shows, and the served answer must rank first the label the page shows first. The page's
conversion of a team's TSV (columns named, no label table, a dev split drawn) is run the same way.

What differs from a user's machine: the port is a free one instead of 8000, and the server the
page starts in the background is started (and stopped) by the test."""

import json
import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from engine import load_predictor
from loadtest.localserver import free_port
from tests.conftest import wait_for
from xmc.data import load_jsonl_split

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "own-data.md"


TEAM_TABLE = "## Columns as your team named them"


def blocks() -> list[str]:
    text = DOC.read_text()
    return re.findall(r"```bash\n(.*?)```", text[text.index("## Worked example") :], flags=re.DOTALL)


def team_table_blocks() -> list[str]:
    text = DOC.read_text()
    section = text[text.index(TEAM_TABLE) : text.index("## Worked example")]
    return re.findall(r"```bash\n(.*?)```", section, flags=re.DOTALL)


def commands(block: str) -> list[tuple[str, list[str]]]:
    """Each command (continuation lines joined) with the ``# …`` lines the page shows after it."""
    out, lines, i = [], block.splitlines(), 0
    while i < len(lines):
        command = lines[i]
        i += 1
        while command.endswith("\\"):
            command = command[:-1] + " " + lines[i].strip()
            i += 1
        shown = []
        while i < len(lines) and lines[i].startswith("# "):
            shown.append(lines[i][2:])
            i += 1
        out.append((command, shown))
    return out


def run(command: str, workdir: Path, env: dict) -> str:
    done = subprocess.run(["bash", "-c", command], cwd=workdir, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{command} exited {done.returncode}:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def test_the_worked_example_from_a_csv_to_a_served_bundle_runs_as_written(tmp_path):
    workdir = tmp_path / "repo"
    workdir.mkdir()
    (workdir / ".venv").symlink_to(Path(sys.prefix))
    (workdir / "docs").symlink_to(ROOT / "docs")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    prepare, serve, _ = blocks()
    assert len((ROOT / "docs" / "examples" / "own-data" / "packages.csv").read_text().splitlines()) == 20
    for command, shown in commands(prepare):
        printed = run(command, workdir, env)
        for line in shown:
            assert line in printed, f"{command}\n  page shows {line!r}, printed {printed!r}"
    (start, _), (query, shown) = commands(serve)
    port = free_port()
    assert start.endswith("&"), "the page no longer starts the server in the background"
    server = subprocess.Popen(
        ["bash", "-c", start.removesuffix("&").strip().replace("8000", str(port))],
        cwd=workdir,
        env=env,
        start_new_session=True,  # the shell and its server: one process group, stopped together
        stdout=open(tmp_path / "server.log", "w"),  # noqa: SIM115 (the child keeps it)
        stderr=subprocess.STDOUT,
    )
    try:
        wait_for(lambda: ready(port, server, tmp_path / "server.log"), limit_s=120, step_s=0.25)
        answer = json.loads(run(query.replace("8000", str(port)), workdir, env))
        uids = [label["uid"] for label in answer["results"][0]["labels"]]
        page_uids = re.findall(r'"uid":"([^"]+)"', "\n".join(shown))
        assert page_uids and uids[: len(page_uids)] == page_uids, (uids, page_uids)
        assert answer["k"] == json.loads(shlex.split(query)[-1])["k"] == len(uids)
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(20)


def test_the_team_table_with_named_columns_no_label_table_and_a_drawn_dev_converts_as_shown(tmp_path):
    workdir = tmp_path / "repo"
    workdir.mkdir()
    (workdir / ".venv").symlink_to(Path(sys.prefix))
    (workdir / "docs").symlink_to(ROOT / "docs")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    ((command, shown),) = commands(*team_table_blocks())
    printed = run(command, workdir, env)
    assert shown and all(line in printed.splitlines() for line in shown), (shown, printed)
    out = re.search(r"--out (\S+)", command).group(1)
    trn, dev = (load_jsonl_split(workdir / out, split) for split in ("trn", "dev"))
    assert trn.labels.uids == trn.labels.texts and not set(trn.uids) & set(dev.uids)
    assert (
        len(trn.uids) + len(dev.uids)
        == len((ROOT / "docs/examples/own-data/packages.tsv").read_text().splitlines()) - 1
    )


def ready(port: int, server: subprocess.Popen, log: Path) -> bool:
    assert server.poll() is None, log.read_text()[-3000:]
    try:
        return httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def test_make_fit_plans_and_builds_a_trained_fused_bundle_of_the_worked_example(tmp_path):
    """The page's ``export.fit --plan`` line, then the command itself (what ``make fit`` runs): a
    trained memory fused with a sparse ranker, served answers from it."""
    workdir = tmp_path / "repo"
    workdir.mkdir()
    (workdir / ".venv").symlink_to(Path(sys.prefix))
    (workdir / "docs").symlink_to(ROOT / "docs")
    (workdir / "training").symlink_to(ROOT / "training")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    prepare, _, plan = blocks()
    run(commands(prepare)[0][0], workdir, env)  # the conversion
    ((command, shown),) = commands(plan)
    printed = run(command, workdir, env)
    assert shown and all(line in printed for line in shown), (shown, printed)
    summary = json.loads(run(command.replace(" --plan", ""), workdir, env).splitlines()[-1])
    bundle = workdir / summary["bundle"]
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert manifest["source"]["head"] != "pca" and manifest["fusion"]["sparse"]["labels"] == 12
    predictor = load_predictor(bundle)
    ranking = predictor.predict(["python3-requests: elegant and simple HTTP library for Python3"], 3).rankings[0]
    assert len(ranking.ids) == 3
