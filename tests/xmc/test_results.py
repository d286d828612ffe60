"""xmc.results: a result file names paths relative to the repository (in values, keys, commands
and tracebacks), beside it with ``..``, in the home folder with ``~`` and in the temporary folder
with ``<tmp>``; it is written whole, indented by two, with one newline at the end."""

from __future__ import annotations

import json
from pathlib import Path

from xmc.results import default_prefixes, dumps, relative_paths, relative_text, write_result

MACHINE = [("/work/main", "."), ("/work", ".."), ("/root", "~"), ("/tmp", "<tmp>")]


def test_paths_in_the_repository_become_relative_to_it():
    assert relative_text("/work/main/bundles/default", MACHINE) == "bundles/default"
    assert relative_text("/work/main/.venv/bin/python", MACHINE) == ".venv/bin/python"
    assert relative_text("/work/main", MACHINE) == "."
    assert relative_text("/work/main/", MACHINE) == "."


def test_paths_outside_it_keep_where_they_are_without_the_machine_folder():
    assert relative_text("/work/shared/data/debian-related", MACHINE) == "../shared/data/debian-related"
    assert relative_text("/work/main-old/x", MACHINE) == "../main-old/x"  # a sibling, not the repository
    assert relative_text("/root/out/gpu.json", MACHINE) == "~/out/gpu.json"
    assert relative_text("/tmp/xmcserve-baseline-081918c", MACHINE) == "<tmp>/xmcserve-baseline-081918c"
    assert relative_text("/tmp", MACHINE) == "<tmp>"


def test_paths_inside_longer_strings_are_renamed_and_the_rest_is_kept():
    command = "/work/main/.venv/bin/python /work/main/bench/lib/null_encoder.py --host 127.0.0.1 --port 35109"
    assert relative_text(command, MACHINE) == ".venv/bin/python bench/lib/null_encoder.py --host 127.0.0.1 --port 35109"
    assert relative_text("--set=data_dir=/tmp/m/data --x", MACHINE) == "--set=data_dir=<tmp>/m/data --x"
    traceback = 'File "/work/main/bundle/directory.py", line 3'
    assert relative_text(traceback, MACHINE) == 'File "bundle/directory.py", line 3'
    assert relative_text("(/work/main/a.py)", MACHINE) == "(a.py)"
    # URL paths, a container's bare /tmp and paths that only contain a root are not the machine's
    for kept in ("/predict", "http://127.0.0.1:8000/work/main", "ctr_run -e HOME=/tmp --tmpfs /tmp", "a/tmp/b"):
        assert relative_text(kept, MACHINE) == kept


def test_every_string_of_a_payload_is_renamed_keys_and_paths_included():
    payload = {
        "bundle": Path("/work/main/bundles/default"),
        "trees": {"this": "/work/main", "baseline": "/tmp/xmcserve-baseline-58e5ef8"},
        'process 1:"/work/main/.venv/bin/python"': 1.0,
        "command": ("/work/main/.venv/bin/python", "-m", "bench.serving"),
        "numbers": [1, 2.5, None, True],
    }
    assert relative_paths(payload, MACHINE) == {
        "bundle": "bundles/default",
        "trees": {"this": ".", "baseline": "<tmp>/xmcserve-baseline-58e5ef8"},
        'process 1:".venv/bin/python"': 1.0,
        "command": [".venv/bin/python", "-m", "bench.serving"],
        "numbers": [1, 2.5, None, True],
    }


def test_this_machine_names_the_repository_first_then_the_folders_around_it(tmp_path):
    root = tmp_path / "checkout"
    root.mkdir()
    pairs = default_prefixes(root)
    assert pairs[0] == (str(root), ".") and (str(tmp_path), "..") in pairs
    assert relative_paths({"bundle": str(root / "bundles" / "default")}, pairs) == {"bundle": "bundles/default"}
    assert relative_paths(str(tmp_path / "other"), pairs) == "../other"  # beside the checkout


def test_the_writer_writes_the_whole_file_indented_with_a_final_newline(tmp_path, monkeypatch):
    monkeypatch.setattr("xmc.results.default_prefixes", lambda root=None: [(str(tmp_path), "<tmp>")])
    out = write_result(tmp_path / "results" / "x.json", {"work": tmp_path / "w", "qps": 258.7})
    assert out == tmp_path / "results" / "x.json"
    assert out.read_text() == '{\n  "work": "<tmp>/w",\n  "qps": 258.7\n}\n'
    assert json.loads(out.read_text()) == {"work": "<tmp>/w", "qps": 258.7}
    assert [p.name for p in out.parent.iterdir()] == ["x.json"]  # no staged sibling left behind
    assert dumps({"a": 1}, []) == '{\n  "a": 1\n}\n'
