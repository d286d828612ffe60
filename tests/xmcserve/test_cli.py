"""The ``xmcserve`` command: every command's ``--help`` names it, the module's options and exit
codes are kept, ``predict`` and ``info`` answer from a bundle in process, and what the command
and ``import xmcserve`` give equals the engine's own answers."""

import io
import json
import shutil
import subprocess
import sys
from importlib.metadata import entry_points

import pytest

import xmcserve
from engine import load_predictor
from xmcserve.cli import COMMANDS, main

TEXTS = ["a terminal emulator for the desktop", "python bindings for a C library"]


def run(argv, capsys, stdin: str | None = None, monkeypatch=None) -> tuple[int | str | None, str, str]:
    """main(argv)'s exit code (or SystemExit's message) and what it printed."""
    if stdin is not None:
        monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def test_the_top_help_lists_every_command(capsys):
    code, out, _ = run(["--help"], capsys)
    assert code == 0
    for name, command in COMMANDS.items():
        assert f"  {name}" in out and command.summary in out


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_each_commands_help_names_the_command(name, capsys):
    code, out, _ = run([name, "--help"], capsys)
    assert code == 0 and out.startswith(f"usage: xmcserve {name}")
    assert sys.argv[0] != f"xmcserve {name}"  # restored


def test_no_command_or_an_unknown_one_is_a_usage_error(capsys):
    assert run([], capsys)[0] == 2
    code, _, err = run(["trian"], capsys)
    assert code == 2 and "unknown command 'trian'" in err and "train" in err


def test_a_commands_own_error_keeps_its_exit_code(capsys, tmp_path):
    code, _, _ = run(["build", "--data", str(tmp_path / "missing"), "--out", str(tmp_path / "b")], capsys)
    assert "export.build" in str(code) and "lbl.json.gz" in str(code)  # a message, not a traceback


def test_predict_gives_the_engines_labels_as_json_lines(tiny_rae_bundle, capsys, monkeypatch):
    code, out, _ = run(["predict", "--bundle", str(tiny_rae_bundle), "-k", "5", *TEXTS], capsys)
    assert code == 0
    lines = [json.loads(line) for line in out.splitlines()]
    predictor = load_predictor(tiny_rae_bundle)
    expected = predictor.predict(TEXTS, 5)
    uids = predictor.view.label_uids
    assert [line["text"] for line in lines] == TEXTS
    for line, ranking in zip(lines, expected.rankings, strict=True):
        assert [label["uid"] for label in line["labels"]] == [uids[i] for i in ranking.ids.tolist()]
        assert [label["score"] for label in line["labels"]] == pytest.approx(ranking.scores.tolist(), rel=1e-6)
        assert all(label["text"] for label in line["labels"])
    # texts on standard input, one a line (blank lines skipped), and an exclusion kept out
    first = lines[0]["labels"][0]["uid"]
    code, out, _ = run(
        ["predict", "--bundle", str(tiny_rae_bundle), "--exclude", first], capsys, f"{TEXTS[0]}\n\n", monkeypatch
    )
    assert code == 0 and len(out.splitlines()) == 1
    assert first not in {label["uid"] for label in json.loads(out)["labels"]}


def test_predict_refuses_what_it_cannot_answer(tiny_rae_bundle, capsys, monkeypatch, tmp_path):
    code, _, _ = run(["predict", "--bundle", str(tiny_rae_bundle), "-k", "0", "x"], capsys)
    assert "at least 1" in str(code)
    code, _, _ = run(["predict", "--bundle", str(tiny_rae_bundle)], capsys, "\n", monkeypatch)
    assert "no texts" in str(code)
    code, _, _ = run(["predict", "--bundle", str(tmp_path), "x"], capsys)
    assert "not a bundle directory" in str(code)


def test_info_shows_the_manifest_and_checks_the_files(bundle_copy, capsys):
    code, out, _ = run(["info", str(bundle_copy)], capsys)
    assert code == 0
    shown = json.loads(out)
    assert shown["manifest"]["bundle_id"] == shown["card"]["bundle_id"] == load_predictor(bundle_copy).bundle.bundle_id
    assert shown["card"]["data"]["labels"] == shown["manifest"]["counts"]["labels"]
    labels = next(name for name in shown["manifest"]["files"] if name.startswith("labels"))
    (bundle_copy / labels).write_bytes(b"changed")
    code, _, _ = run(["info", str(bundle_copy)], capsys)
    assert "xmcserve info" in str(code) and labels in str(code)
    assert run(["info", "--no-verify", str(bundle_copy)], capsys)[0] == 0


def test_the_python_api_answers_as_the_engine(tiny_rae_bundle):
    model = xmcserve.load(tiny_rae_bundle)
    predictor = load_predictor(tiny_rae_bundle)
    answers = model.predict(TEXTS, k=3)
    expected = predictor.predict(TEXTS, 3)
    assert len(answers) == 2 and all(len(labels) == 3 for labels in answers)
    for labels, ranking in zip(answers, expected.rankings, strict=True):
        assert [label.uid for label in labels] == [predictor.view.label_uids[i] for i in ranking.ids.tolist()]
        assert [label.text for label in labels] == [predictor.view.label_texts[i] for i in ranking.ids.tolist()]
    assert model.predict(TEXTS[0], k=3) == answers[:1]  # one text is a batch of one
    assert model.predict([]) == []
    excluded = answers[0][0].uid
    assert excluded not in {label.uid for label in model.predict(TEXTS[0], k=3, exclude={excluded})[0]}
    with pytest.raises(ValueError, match="at least 1"):
        model.predict(TEXTS, k=0)
    assert model.bundle_id == predictor.bundle.bundle_id


def test_the_console_script_is_installed_and_runs():
    scripts = {entry.name: entry.value for entry in entry_points(group="console_scripts")}
    assert scripts.get("xmcserve") == "xmcserve.cli:main"
    command = shutil.which("xmcserve", path=str(__import__("pathlib").Path(sys.executable).parent))
    assert command is not None
    done = subprocess.run([command, "--version"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.startswith("xmcserve ")


def test_python_dash_m_xmcserve_runs_the_same_command():
    done = subprocess.run(
        [sys.executable, "-m", "xmcserve", "info", "--help"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0 and done.stdout.startswith("usage: xmcserve info")
