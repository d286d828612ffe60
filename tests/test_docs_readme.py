"""The README's command-line and Python blocks run as a user would copy them: its ``xmcserve
predict`` and ``xmcserve info`` lines and its Python snippet, against the default bundle (the
session's build of it stands in for ``bundles/default``)."""

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README.read_text(), flags=re.DOTALL)


def as_run_here(line: str, bundle: Path) -> list[str]:
    command = line.split("  #")[0].strip().replace("bundles/default", str(bundle))
    words = __import__("shlex").split(command)
    assert words[0] == ".venv/bin/xmcserve"
    return [shutil.which("xmcserve", path=str(Path(sys.executable).parent)), *words[1:]]


def test_the_readmes_predict_and_info_lines_run(sample_bundle):
    lines = [line for block in blocks("bash") for line in block.splitlines() if line.startswith(".venv/bin/xmcserve ")]
    predict = next(line for line in lines if " predict " in line)
    info = next(line for line in lines if " info " in line)
    done = subprocess.run(as_run_here(predict, sample_bundle), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    answer = json.loads(done.stdout)
    assert answer["text"].startswith("python3-numpy") and len(answer["labels"]) == 3
    done = subprocess.run(as_run_here(info, sample_bundle), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["card"]["data"]["labels"] == 12078


def test_the_readmes_python_snippet_runs(sample_bundle, tmp_path):
    (snippet,) = [block for block in blocks("python") if "xmcserve.load" in block]
    script = tmp_path / "snippet.py"
    script.write_text(snippet.replace('"bundles/default"', repr(str(sample_bundle))))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    printed = done.stdout.splitlines()
    assert len(printed) == 3 and all(len(line.split(" ", 2)) == 3 for line in printed)
