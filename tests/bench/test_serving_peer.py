"""bench.serving --peer infinity without the peer: its arguments, the command and environment
infinity is started with (offline, loopback, pinned threads, our graph as it is), the skip and its
reason when the peer's virtualenv is missing, and the figures and ratios made of the turns. None
of it starts a server; with the peer's virtualenv present only its package metadata is read."""

import json
import os

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from bench.lib import infinity_launch, infinity_peer
from bench.lib.profiling import tree_cpu_s, tree_peak_rss_mib
from bench.serving import PEER_OUT, build_parser, main, peer_cpus, peer_ratios, turn_figures
from loadtest.localserver import ROOT


def test_the_peer_arguments_parse_and_an_unknown_peer_is_refused(tmp_path):
    args = build_parser().parse_args(
        ["--peer", "infinity", "--cpus", "0-1", "--peer-venv", str(tmp_path), "--seconds", "6", "--rounds", "2"]
    )
    assert args.peer == "infinity" and args.cpus == "0-1" and args.peer_venv == tmp_path
    assert args.peer_model == infinity_peer.DEFAULT_MODEL_DIR and (args.seconds, args.rounds) == (6.0, 2)
    assert build_parser().parse_args([]).peer is None
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--peer", "tei"])


def test_both_servers_are_pinned_to_the_cores_given_or_the_first_two_allowed():
    assert peer_cpus("0,1") == {0, 1} and peer_cpus("2-3") == {2, 3}
    allowed = sorted(os.sched_getaffinity(0))
    assert peer_cpus(None) == set(allowed[:2])


def test_infinity_is_started_offline_with_our_graph_as_it_is_and_pinned_threads(tmp_path):
    venv = tmp_path / "venv"
    command = infinity_peer.launch_command(venv, 2)
    launcher = ROOT / "bench" / "lib" / "infinity_launch.py"
    assert command[:4] == [str(venv.resolve() / "bin" / "python"), "-I", str(launcher), "2"] and launcher.exists()
    options = dict(zip(command[5:-1:2], command[6:-1:2], strict=True))
    assert command[4] == "v2" and options["--model-id"] == "."  # run in the model folder
    assert options["--engine"] == "optimum" and options["--device"] == "cpu"
    assert options["--pooling-method"] == "mean" and options["--batch-size"] == str(infinity_peer.BATCH_SIZE)
    assert command[-1] == "--onnx-disable-optimize"  # it serves the graph made here, not its own rewrite
    assert "--host" not in command and "--port" not in command  # the launcher adds 127.0.0.1 and a free port

    env = infinity_peer.launch_env(tmp_path, 2)
    assert env["HF_HUB_OFFLINE"] == "1" and env["TRANSFORMERS_OFFLINE"] == "1"
    assert env["DO_NOT_TRACK"] == "1" and env["INFINITY_ANONYMOUS_USAGE_STATS"] == "0"
    assert env["OMP_NUM_THREADS"] == "2" and env["HF_HOME"].startswith(str(tmp_path))

    bodies = infinity_peer.request_bodies(["a title", "another"])
    assert [json.loads(b) for b in bodies] == [
        {"input": ["a title"], "model": infinity_peer.SERVED_MODEL},
        {"input": ["another"], "model": infinity_peer.SERVED_MODEL},
    ]


def test_the_launcher_gives_sessions_without_a_thread_count_the_one_asked_for(monkeypatch):
    monkeypatch.setattr(ort.InferenceSession, "__init__", ort.InferenceSession.__init__)  # restored afterwards
    graph = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["y"])],
        "identity",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9).SerializeToString()
    infinity_launch.with_threads(3)
    unset = ort.SessionOptions()
    ort.InferenceSession(model, unset, providers=["CPUExecutionProvider"])
    assert unset.intra_op_num_threads == 3
    named = ort.SessionOptions()
    named.intra_op_num_threads = 1
    ort.InferenceSession(model, sess_options=named, providers=["CPUExecutionProvider"])
    assert named.intra_op_num_threads == 1
    session = ort.InferenceSession(model, providers=["CPUExecutionProvider"])  # no options at all
    assert session.run(None, {"x": np.ones(1, np.float32)})[0].tolist() == [1.0]


def test_a_missing_peer_venv_is_a_skip_with_its_reason_and_nothing_written(tmp_path, sample_dir, capsys):
    venv, model = tmp_path / "venv", tmp_path / "model"
    assert "make infinity-venv" in infinity_peer.unavailable(venv, model)
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").touch()
    assert "did not finish" in infinity_peer.unavailable(venv, model)
    (venv / infinity_peer.INSTALLED).touch()
    model.mkdir()
    (model / infinity_peer.STAMP).write_text("{}")
    assert infinity_peer.unavailable(venv, model) is None

    out = tmp_path / "peer.json"
    main(["--peer", "infinity", "--peer-venv", str(tmp_path / "none"), "--data", str(sample_dir), "--out", str(out)])
    said = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert said["peer"] == "infinity" and "make infinity-venv" in said["skipped"]
    assert not out.exists() and PEER_OUT.name == "serving-infinity-peer.json"


def rows(qps_by_level: dict[int, float], idle_p50: float) -> list[dict]:
    return [{"concurrency": c, "qps": q, "p50_ms": idle_p50 if c == 1 else 50.0} for c, q in qps_by_level.items()]


def test_peaks_idle_p50s_and_ratios_are_taken_round_by_round():
    ours = turn_figures([rows({1: 200, 16: 450, 64: 440}, 4.0), rows({1: 180, 16: 380, 64: 400}, 5.0)])
    peer = turn_figures([rows({1: 120, 16: 390, 64: 380}, 8.0), rows({1: 100, 16: 300, 64: 320}, 10.0)])
    assert ours["peak_qps_by_round"] == [450, 400] and ours["peak_concurrency_by_round"] == [16, 64]
    assert ours["idle_p50_ms_by_round"] == [4.0, 5.0] and ours["median_peak_qps"] == 425.0
    ratios = peer_ratios({**ours, "peak_rss_mib": 200.0}, {**peer, "peak_rss_mib": 1600.0})
    assert ratios["peak_over_peer_by_round"] == [round(450 / 390, 3), 1.25]
    assert ratios["median_idle_p50_over_peer"] == 0.5 and ratios["peak_rss_over_peer"] == 0.125


def test_a_servers_cpu_and_peak_memory_are_read_with_its_children():
    assert tree_cpu_s(os.getpid()) > 0 and tree_peak_rss_mib(os.getpid()) > 10


@pytest.mark.skipif(
    not (ROOT / infinity_peer.DEFAULT_VENV / infinity_peer.INSTALLED).exists(), reason="no .venv-infinity"
)
def test_the_peer_venv_holds_the_pinned_packages():
    packages = infinity_peer.version(ROOT / infinity_peer.DEFAULT_VENV)
    assert packages["infinity_emb"] == "0.0.78" and packages["numpy"].startswith("1.")
    assert packages["onnxruntime"] == ort.__version__ and packages["torch"].endswith("+cpu")
