"""docs/operations.md's worked example, run as written: its shell blocks, taken from the page, run
in order against real servers on 127.0.0.1 (a shadow, then A pointing at it), in a scratch copy
of the repository's layout; each command must succeed and print what the page says it prints
(the keys of each answer shown, the text of each refusal). So the page cannot drift from the
service again (issue 43: it failed at "load the candidate into B").

What differs from an operator's machine, each stated here: the ports are free ones instead of
8000/8001; ``make serve`` is the Makefile's serve recipe (``xmcserve serve --bundle
bundles/default``) without its install prerequisites; the shadow log is in the scratch
directory instead of /tmp; the one build command is not run (it takes minutes: the candidate is a
small bundle built by the fixtures, export.build has tests of its own); ``bundles/broken`` is a
copy with one flipped byte; between (b) and (c) clients send traffic for the shadow to compare.
"""

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from bundle.manifest import LABELS_FILE
from loadtest.localserver import free_port
from tests.conftest import wait_for

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "operations.md"
NOT_RUN = {
    ".venv/bin/python -m export.build --data data/debian-sample --out bundles/default-fp32 --quantize none",
}
MAKE_SERVE = """#!/bin/sh
# the Makefile's serve recipe, without its install prerequisites (the test's venv and bundles)
[ "$1" = serve ] || { echo "only 'make serve' is stood in for" >&2; exit 2; }
exec .venv/bin/xmcserve serve --bundle bundles/default --host 127.0.0.1 --port "$DOCS_PORT_A"
"""
BLOCK_TIMEOUT_S = 120


def worked_example() -> list[str]:
    """The shell blocks of the worked example, in page order."""
    text = DOC.read_text()
    section = text[text.index("### Worked example") : text.index("\n## Live memory")]
    return re.findall(r"```bash\n(.*?)```", section, flags=re.DOTALL)


def commands(block: str) -> list[tuple[str, str]]:
    """Each command of ``block`` (continuation lines joined) with the output the page shows for it
    (the ``# …`` lines right after it that show an answer)."""
    out: list[tuple[str, str]] = []
    lines = block.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        i += 1
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        command = line
        while command.rstrip().endswith("\\"):
            command = command.rstrip()[:-1] + " " + lines[i].strip()
            i += 1
        shown = []
        while i < len(lines) and lines[i].startswith("# ") and re.match(r"# (\d{3} )?[{ ]", lines[i]):
            shown.append(lines[i][2:])
            i += 1
        out.append((command, "\n".join(shown)))
    return out


def check_output(command: str, shown: str, printed: str) -> None:
    """``printed`` has every key the page shows for ``command`` and, for a refusal, its text."""
    missing = [key for key in re.findall(r'"([A-Za-z_]+)":', shown) if f'"{key}":' not in printed]
    assert not missing, f"{command}\n  shows keys {missing} the service does not print:\n  {printed[:800]}"
    detail = re.search(r'"detail":"([^"…<]*)', shown)
    if detail:
        assert detail.group(1) in printed, f"{command}\n  page: {detail.group(1)!r}\n  printed: {printed[:800]}"


def run_block(block: str, workdir: Path, env: dict, prelude: str) -> None:
    """Run the block's commands in one shell (after ``prelude``), each one's output checked."""
    listed = commands(block)
    script = [prelude]
    for n, (command, _) in enumerate(listed):
        script += [f"echo '@@@ start {n}'", command, f'echo "@@@ end {n} $?"']
    done = subprocess.run(
        ["bash", "-c", "\n".join(script)],
        cwd=workdir,
        env=env,
        capture_output=True,
        text=True,
        timeout=BLOCK_TIMEOUT_S,
    )
    for n, (command, shown) in enumerate(listed):
        match = re.search(rf"@@@ start {n}\n(.*?)@@@ end {n} (\d+)", done.stdout, flags=re.DOTALL)
        assert match, f"{command} did not finish:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
        assert match.group(2) == "0", f"{command} exited {match.group(2)}:\n{match.group(1)}\n{done.stderr[-2000:]}"
        check_output(command, shown, match.group(1))


@pytest.fixture
def workdir(tmp_path, tiny_rae_bundle, bundle_root) -> Path:
    """The repository's layout as the page assumes it: ``.venv``, ``data``, ``bundles/default``
    and its candidate ``bundles/default-fp32`` (another lineage), ``bundles/broken``."""
    work = tmp_path / "repo"
    (work / "bundles").mkdir(parents=True)
    (work / ".venv").symlink_to(Path(sys.prefix))
    (work / "data").symlink_to(ROOT / "data")
    shutil.copytree(tiny_rae_bundle, work / "bundles" / "default")
    shutil.copytree(bundle_root / "tiny-labels", work / "bundles" / "default-fp32")
    shutil.copytree(tiny_rae_bundle, work / "bundles" / "broken")
    labels = bytearray((work / "bundles" / "broken" / LABELS_FILE).read_bytes())
    labels[5] ^= 0x01
    (work / "bundles" / "broken" / LABELS_FILE).write_bytes(bytes(labels))
    (work / "bin").mkdir()
    (work / "bin" / "make").write_text(MAKE_SERVE)
    (work / "bin" / "make").chmod(0o755)
    return work


def test_the_worked_example_of_the_operations_guide_runs_as_written(workdir, monkeypatch):
    monkeypatch.delenv("XMCSERVE_APPEND_LOG_DIR")  # the page sets none: logs go beside the bundles
    port_a, port_shadow = free_port(), free_port()
    blocks = []
    for block in worked_example():
        block = block.replace("localhost:8000", f"localhost:{port_a}").replace("8001", str(port_shadow))
        blocks.append(block.replace("/tmp/xmcserve-shadow.jsonl", str(workdir / "xmcserve-shadow.jsonl")))
    build, start, mirror, report, *rest = blocks
    saved_env = workdir / "shell-one.env"
    assert [command for command, _ in commands(build)] == sorted(NOT_RUN), "the page's build step changed"
    lines = start.splitlines()
    second = next(i for i, line in enumerate(lines) if line.startswith("# in another shell"))
    shell_two = "\n".join(lines[second + 1 :])
    lines = lines[:second]
    serve_a = next(i for i, line in enumerate(lines) if "make serve" in line)
    assert not any(line.strip() for line in lines[serve_a + 1 :]), "A is no longer started last in the first shell"
    lines.insert(serve_a, f"export -p > {saved_env}")  # shell two has the same variables exported
    env = {
        **os.environ,
        "PATH": f"{workdir / 'bin'}:{os.environ['PATH']}",
        "PYTHONPATH": str(ROOT),  # this checkout's code, from the scratch directory
        "DOCS_PORT_A": str(port_a),
    }
    first_shell = subprocess.Popen(
        ["bash", "-c", "\n".join(lines)],
        cwd=workdir,
        env=env,
        stdout=open(workdir / "shell-one.log", "w"),  # noqa: SIM115 (the child keeps it)
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its servers form one process group, stopped together below
    )
    try:
        for port in (port_shadow, port_a):
            wait_for(lambda port=port: ready(port, first_shell, workdir), limit_s=90, step_s=0.25)
        prelude = f"source {saved_env}"
        run_block(shell_two, workdir, env, prelude)
        prelude += "\n" + next(line for line in shell_two.splitlines() if line.startswith("ADMIN=("))
        run_block(mirror, workdir, env, prelude)
        with httpx.Client(base_url=f"http://127.0.0.1:{port_a}", timeout=30) as client:  # live traffic
            for i in range(80):  # 10 % of them mirrored: some reach the shadow log
                assert client.post("/predict", json={"text": f"libc6 request {i}", "k": 5}).status_code == 200
        shadow_log = workdir / "xmcserve-shadow.jsonl"
        wait_for(lambda: shadow_log.exists() and shadow_log.stat().st_size > 0, limit_s=30)
        run_block(report, workdir, env, prelude)
        for block in rest:
            run_block(block, workdir, env, prelude)
        # serving and rolling out took no log directory: only appends make one
        assert sorted(p.name for p in (workdir / "bundles").iterdir()) == ["broken", "default", "default-fp32"]
    finally:
        os.killpg(first_shell.pid, signal.SIGTERM)
        try:
            first_shell.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(first_shell.pid, signal.SIGKILL)
            first_shell.wait(10)
        deadline = time.monotonic() + 20  # the servers, children of the shell, go with their group
        while time.monotonic() < deadline and group_alive(first_shell.pid):
            time.sleep(0.2)
        if group_alive(first_shell.pid):
            os.killpg(first_shell.pid, signal.SIGKILL)


def ready(port: int, shell: subprocess.Popen, workdir: Path) -> bool:
    assert shell.poll() is None, (workdir / "shell-one.log").read_text()[-3000:]
    try:
        return httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True
