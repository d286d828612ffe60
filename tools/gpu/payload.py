"""The files that carry one run of ``python -m tools.gpu`` to a lent CUDA machine, cut into device calls.

    python -m tools.gpu.payload [--out .gpu] [--bundle DIR] [--ort-wheel WHEEL] [--wheels DIR ...]
                                [--call-mb 58] [--keep-arch 90] [--budget-s 400]

The GPU machines lent to this project (tools.gpu's docstring, ``make bench-gpu``) reach no package
registry, carry at most 64 MiB of files per call of the device tool (the repository's tree, about
4.5 MB, counted in), and their image holds the CPU build of ONNX Runtime. This module prepares here
what ``tools.gpu`` needs there, in an output folder that git ignores (``.gpu/``, named in
``.git/info/exclude``):

1. **ONNX Runtime**: onnxruntime-gpu's wheel for CPython 3.12 on manylinux x86-64 (``pip download``, or
   ``--ort-wheel``; 1.31.1 is built for CUDA 13, 255 MB), with its CUDA provider's fat binary pruned to
   one GPU architecture (``--keep-arch``, default 90: the H100 and H200): every cubin that cannot run
   on it (for sm_90: every other one) is overwritten with zeros of its own length, so every offset in
   the library stays valid, and the unpacked wheel, tar + xz, is 70 MB instead of 202.
2. **the serving wheels the image lacks**: pyproject.toml's ``dependencies`` and what they need, as
   installed in the running venv, less the distributions the image already holds (KINDS.md,
   "Python packages already there"), downloaded as wheels (or found in ``--wheels`` folders), and
   hnswlib's sdist (it has no wheels; it compiles there in about 30 s), in one tar.
3. **the bundle**: ``--bundle``, or one built here as tools.gpu builds it (fp32, RAE memory, 64-d),
   tar + xz.
4. **the calls**: those three archives' bytes, in this order, cut into ``c1/``, ``c2/``, … of at most
   ``--call-mb`` MB (10^6 bytes) each, and the scripts: ``setup.sh`` and ``probe.py`` go with the call
   that completes ONNX Runtime and the wheels (it unpacks them into /tmp/site, uninstalls the image's
   onnxruntime, compiles hnswlib, writes the CUDA libraries' folders to /tmp/ld_path and checks that
   the CUDA provider computes what the CPU does), ``run.sh`` with the last (it unpacks the bundle to
   /tmp/bundle and runs ``python3 -m tools.gpu --bundle /tmp/bundle``; ``BUDGET`` and ``BENCH_ARGS``
   in its environment set the budget and add arguments, e.g. ``BENCH_ARGS="--stages scaling
   --scaling-provider cuda --cores-per-server 3"`` for another run on the warm machine).

It prints the device tool's calls, in order: ``run`` with each call's ``carry`` list, ``command`` and
``timeout_s`` (also in ``<out>/calls.json``). A session makes them back to back, each as soon as the
last one returns: what the calls leave under /tmp there lasts only while the machine stays warm (30 s
idle), and each script checks the parts it joins (their sha256) and says to start again from call 1
when they are gone. The last call's ``$OUT`` brings back gpu.json, run.log and the servers' logs
(logs.tar.gz); then give the machine back (``give_back``). tools.gpu's budget (``--budget-s``, 400 s),
the setup and the machine's start take most of a session's 15 minutes of device time. Downloads are
kept in ``<out>/downloads`` for the next time.

Exit status: 0 when the calls are written; 1 when a download, the bundle's build or the writing
failed; 2 for bad arguments, for what this machine lacks (KINDS.md, a wheel, a distribution the venv
does not hold), and for a fat binary that is not laid out as the pruning expects.
"""

from __future__ import annotations

import argparse
import calendar
import dataclasses
import hashlib
import importlib.metadata
import io
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import tarfile
import time
import zipfile
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.tags import Tag, compatible_tags, cpython_tags
from packaging.utils import canonicalize_name, parse_sdist_filename, parse_wheel_filename
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_KINDS = Path("/work/.library/device/KINDS.md")
IMAGE_SECTION = "## Python packages already there"
# The device tool's limit on one call's files, the working tree included (its README, "Limits").
CALL_LIMIT_BYTES = 64 * 2**20
# Room kept in each call for the scripts, which are written once the parts are planned.
SCRIPT_RESERVE = 64 * 1024
# hnswlib publishes no wheels (0.8.0: an sdist only); it is compiled there with the image's numpy,
# pybind11 and setuptools.
SDIST_ONLY = frozenset({"hnswlib"})
# The libraries onnxruntime-gpu 1.31's CUDA provider loads (CUDA 13, cuDNN 9); the image has them in
# pip packages (nvidia/cu13/lib, nvidia/cudnn/lib) that are not on the loader's default path.
CUDA_LIBS = ("libcudnn.so.9", "libcublas.so.13", "libcudart.so.13", "libcurand.so.10", "libcufft.so.12")
# tools.gpu's --work default, where its servers write their logs (passed explicitly by run.sh)
BENCH_WORK = "/tmp/xmcserve-bench-gpu"
# onnxruntime first, as the service imports it: on the H200 image (2026-11-28) hnswlib compiled
# there and then onnxruntime-gpu 1.31.1's _pybind_state segfaults, while the other order runs.
PROBE_MODULES = (
    "onnxruntime",
    "hnswlib",
    "faiss",
    "fastapi",
    "fastapi_offline",
    "uvicorn",
    "httptools",
    "orjson",
    "pydantic",
    "pydantic_settings",
    "pythonjsonlogger",
    "opentelemetry.sdk",
    "opentelemetry.exporter.otlp.proto.http",
    "opentelemetry.instrumentation.fastapi",
)
STREAMS = ("ort.tar.xz", "deps.tar", "bundle.tar.xz")


def manylinux_platforms(glibc_minor: int) -> tuple[str, ...]:
    """pip's ``--platform`` values for x86-64 wheels that a glibc 2.``glibc_minor`` machine runs:
    pip matches each name exactly, so every older manylinux tag and the legacy aliases are named."""
    modern = tuple(f"manylinux_2_{minor}_x86_64" for minor in range(glibc_minor, 4, -1))
    return (*modern, "manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64")


@dataclass(frozen=True)
class PayloadParams:
    """What goes to the GPU machine and how it is cut; the defaults are the H100/H200 run's.

    Attributes:
        out: folder of the calls (``c1/``, ``c2/``, …), ``calls.json`` and the downloads; git must
            ignore it when it lies in the repository, or it would travel with every call's tree
        ort_version: onnxruntime-gpu's version to download
        ort_wheel: this local onnxruntime-gpu wheel instead of a download
        wheels: local folders holding the serving wheels and sdists instead of downloading them
        keep_arch: the SM architecture whose cubins are kept (90: the H100 and H200)
        python_version: the GPU image's Python (major.minor)
        glibc_minor: the newest manylinux_2_N tag downloaded wheels may carry
        call_mb: most MB (10^6 bytes) of carried files per call
        bundle: carry this bundle instead of building one
        data: dataset the built bundle is made of
        kinds: KINDS.md, whose section "Python packages already there" lists the image's
        pyproject: whose ``dependencies`` are the serving requirements
        budget_s: tools.gpu's ``--budget-s`` in the last call
        ort_preset: xz preset of the ONNX Runtime archive (half of its bytes are zeros or code)
        bundle_preset: xz preset of the bundle's archive (fp32 weights barely compress)
    """

    out: Path = Path(".gpu")
    ort_version: str = "1.31.1"
    ort_wheel: Path | None = None
    wheels: tuple[Path, ...] = ()
    keep_arch: int = 90
    python_version: str = "3.12"
    glibc_minor: int = 28
    call_mb: float = 58.0  # parts a call; the working tree (~6 MB) travels beside them
    bundle: Path | None = None
    data: Path = Path("data/debian-sample")
    kinds: Path = DEFAULT_KINDS
    pyproject: Path = ROOT / "pyproject.toml"
    budget_s: float = 400.0
    ort_preset: int = 6
    bundle_preset: int = 1

    @property
    def call_bytes(self) -> int:
        return int(self.call_mb * 1_000_000)

    @property
    def platforms(self) -> tuple[str, ...]:
        return manylinux_platforms(self.glibc_minor)


# -- the CUDA provider's fat binary ----------------------------------------------------------------

ELF_MAGIC = b"\x7fELF"
SECTION_HEADER = struct.Struct("<IIQQQQIIQQ")  # Elf64_Shdr: name, type, flags, addr, offset, size, …
SHT_NOBITS = 8
SHN_XINDEX = 0xFFFF
FATBIN_MAGIC = 0xBA55ED50
FATBIN_CONTAINER = struct.Struct("<IHHQ")  # magic, version, header size, size of the entries
FATBIN_ENTRY = struct.Struct("<HHIQ")  # kind, version, header size, payload size; the arch at +28
FATBIN_ENTRY_MIN = 32
FATBIN_ALIGN = 8  # containers start on 8-byte boundaries of the section; zeros pad between them
KIND_PTX, KIND_CUBIN = 1, 2


def elf_section_range(data, name: str) -> tuple[int, int] | None:
    """(file offset, size) of the section ``name`` of a little-endian ELF64 file, None when it has
    none. Only the section headers and their name table are read (no readelf or pyelftools there)."""
    view = memoryview(data)
    if len(view) < 64 or bytes(view[:4]) != ELF_MAGIC:
        raise ValueError("not an ELF file")
    if view[4] != 2 or view[5] != 1:
        raise ValueError("not a little-endian 64-bit ELF file")
    (shoff,) = struct.unpack_from("<Q", view, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", view, 0x3A)
    if shoff == 0:
        raise ValueError("the ELF file has no section headers")
    if shentsize < SECTION_HEADER.size:
        raise ValueError(f"ELF section headers of {shentsize} bytes")

    def header(index: int) -> tuple:
        at = shoff + index * shentsize
        if at + SECTION_HEADER.size > len(view):
            raise ValueError(f"ELF section header {index} lies past the file's end")
        return SECTION_HEADER.unpack_from(view, at)

    # with 0xff00 sections or more, the count and the name table's index are kept in section 0
    if shnum == 0:
        shnum = header(0)[5]
    if shstrndx == SHN_XINDEX:
        shstrndx = header(0)[6]
    names_offset, names_size = header(shstrndx)[4:6]
    if names_offset + names_size > len(view):
        raise ValueError("the ELF section name table lies past the file's end")
    names = bytes(view[names_offset : names_offset + names_size])
    wanted = name.encode()
    for index in range(shnum):
        name_at, kind, _flags, _addr, offset, size = header(index)[:6]
        if names[name_at : names.find(b"\0", name_at)] != wanted:
            continue
        if kind == SHT_NOBITS:
            raise ValueError(f"section {name} has no bytes in the file")
        if offset + size > len(view):
            raise ValueError(f"section {name} lies past the file's end")
        return offset, size
    return None


def nv_fatbin_range(so_bytes) -> tuple[int, int]:
    """(file offset, size) of the ``.nv_fatbin`` section, where nvcc puts a library's GPU code."""
    found = elf_section_range(so_bytes, ".nv_fatbin")
    if found is None:
        raise ValueError("no .nv_fatbin section: the library holds no CUDA code")
    return found


@dataclass(frozen=True)
class FatbinEntry:
    """One GPU image of a fat binary: a cubin (machine code of one SM architecture) or PTX."""

    container: int
    offset: int
    kind: int
    arch: int
    payload_offset: int
    payload_size: int


def _require_zeros(view: memoryview, start: int, stop: int) -> None:
    if stop > start and bytes(view[start:stop]).count(0) != stop - start:
        raise ValueError(f"bytes {start}..{stop} of the fat binary are neither a container nor padding")


def fatbin_entries(data) -> list[FatbinEntry]:
    """Every entry of the fat binary containers in ``data`` (a ``.nv_fatbin`` section's bytes).

    Raises ValueError for whatever is not laid out as expected (a container or an entry running
    past its end, an unknown kind of entry, non-zero bytes between containers): a pruning that
    guesses could zero code the GPU runs."""
    view = memoryview(data)
    entries: list[FatbinEntry] = []
    pos = containers = 0
    while pos + FATBIN_CONTAINER.size <= len(view):
        magic, _version, header_size, fat_size = FATBIN_CONTAINER.unpack_from(view, pos)
        if magic != FATBIN_MAGIC:
            _require_zeros(view, pos, min(pos + FATBIN_ALIGN, len(view)))
            pos += FATBIN_ALIGN
            continue
        start, stop = pos + header_size, pos + header_size + fat_size
        if header_size < FATBIN_CONTAINER.size or stop > len(view):
            raise ValueError(f"fat binary container at {pos} runs past the section's end")
        at = start
        while at < stop:
            if at + FATBIN_ENTRY_MIN > stop:
                raise ValueError(f"{stop - at} stray bytes at the end of the container at {pos}")
            kind, _version, entry_header, payload = FATBIN_ENTRY.unpack_from(view, at)
            (arch,) = struct.unpack_from("<I", view, at + 28)
            if entry_header < FATBIN_ENTRY_MIN or at + entry_header + payload > stop:
                raise ValueError(f"fat binary entry at {at} runs past its container's end")
            if kind not in (KIND_PTX, KIND_CUBIN):
                raise ValueError(f"fat binary entry at {at} is of kind {kind} (neither PTX nor a cubin)")
            entries.append(FatbinEntry(containers, at, kind, arch, at + entry_header, payload))
            at += entry_header + payload
        containers += 1
        # the next container starts on the next aligned offset; what lies between is padding
        pos = -(-stop // FATBIN_ALIGN) * FATBIN_ALIGN
        _require_zeros(view, stop, min(pos, len(view)))
    _require_zeros(view, pos, len(view))
    if not entries:
        raise ValueError("no fat binary container in the section")
    return entries


def runs_on(cubin_arch: int, gpu_arch: int) -> bool:
    """Whether a cubin of ``cubin_arch`` runs on a GPU of ``gpu_arch``: cubins run on their own
    major architecture, from their minor one up (sm_80 code on an sm_86 GPU; none on sm_90)."""
    return cubin_arch // 10 == gpu_arch // 10 and cubin_arch <= gpu_arch


@dataclass(frozen=True)
class PruneReport:
    """What :func:`prune_fatbin` kept and zeroed: payload bytes per SM architecture.

    ``containers_without_kept`` counts the containers (one per compiled source file, roughly) that
    hold no code for the kept architecture: their kernels could not run on such a GPU before the
    pruning either."""

    keep_arch: int
    containers: int
    cubins: int
    ptx: int
    containers_without_kept: int
    kept: dict[int, int] = field(default_factory=dict)
    zeroed: dict[int, int] = field(default_factory=dict)

    @property
    def zeroed_bytes(self) -> int:
        return sum(self.zeroed.values())

    def describe(self) -> str:
        def mb(per_arch: dict[int, int]) -> str:
            return ", ".join(f"sm_{arch} {size / 1e6:.1f}" for arch, size in sorted(per_arch.items())) or "none"

        return (
            f"{self.cubins} cubins and {self.ptx} PTX in {self.containers} containers "
            f"({self.containers_without_kept} with no sm_{self.keep_arch} code); "
            f"kept (MB) {mb(self.kept)}; zeroed (MB) {mb(self.zeroed)}"
        )


def prune_fatbin(data: bytearray | memoryview, keep_arch: int) -> PruneReport:
    """Overwrites, in place, every cubin payload that cannot run on a GPU of ``keep_arch``
    (:func:`runs_on`; for 90, every cubin but sm_90's) in the fat binary ``data`` (a ``.nv_fatbin``
    section's bytes) with zeros of the same length: headers, offsets and sizes stay, so the library
    loads as before and such a GPU finds the cubins it used before.

    Raises ValueError, before changing anything, when no entry is of ``keep_arch`` (the GPU would
    find no code: the wrong architecture, or a library built without it), or when PTX of another
    architecture is present (the driver may compile PTX where no cubin fits; a fat binary laid out
    so has not been tried on a GPU after pruning). PTX entries are never changed."""
    entries = fatbin_entries(data)
    if not any(entry.arch == keep_arch for entry in entries):
        archs = sorted({entry.arch for entry in entries})
        raise ValueError(f"no entry of sm_{keep_arch} in the fat binary (it has {archs}); nothing is pruned")
    foreign_ptx = sorted({entry.arch for entry in entries if entry.kind == KIND_PTX and entry.arch != keep_arch})
    if foreign_ptx:
        raise ValueError(f"the fat binary holds PTX for {foreign_ptx}, besides sm_{keep_arch}; nothing is pruned")
    kept: dict[int, int] = {}
    zeroed: dict[int, int] = {}
    with_kept = set()
    with memoryview(data) as view:
        for entry in entries:
            if entry.kind == KIND_CUBIN and not runs_on(entry.arch, keep_arch):
                view[entry.payload_offset : entry.payload_offset + entry.payload_size] = bytes(entry.payload_size)
                zeroed[entry.arch] = zeroed.get(entry.arch, 0) + entry.payload_size
            else:
                kept[entry.arch] = kept.get(entry.arch, 0) + entry.payload_size
                with_kept.add(entry.container)
    containers = entries[-1].container + 1
    return PruneReport(
        keep_arch=keep_arch,
        containers=containers,
        cubins=sum(entry.kind == KIND_CUBIN for entry in entries),
        ptx=sum(entry.kind == KIND_PTX for entry in entries),
        containers_without_kept=containers - len(with_kept),
        kept=kept,
        zeroed=zeroed,
    )


# -- what the image lacks --------------------------------------------------------------------------


def image_distributions(kinds: Path = DEFAULT_KINDS) -> frozenset[str]:
    """The distributions the GPU image holds (canonical names), from KINDS.md's section
    "Python packages already there" (the rest of its line ``… Packages: a, b, ….``)."""
    if not kinds.is_file():
        raise FileNotFoundError(
            f"{kinds} is not there: it lists the Python packages the GPU machines' image holds "
            "(section 'Python packages already there'); pass --kinds"
        )
    section = kinds.read_text().partition(IMAGE_SECTION)[2].split("\n## ", 1)[0]
    match = re.search(r"\bPackages:(.*)$", section, re.M)
    if match is None:
        raise ValueError(f"{kinds} has no line 'Packages: …' under '{IMAGE_SECTION}'")
    names = [name.strip() for name in match.group(1).strip().rstrip(".").split(",")]
    bad = [name for name in names if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name)]
    if bad or not names:
        raise ValueError(f"{kinds}: not a list of package names under '{IMAGE_SECTION}': {bad[:5]}")
    return frozenset(canonicalize_name(name) for name in names)


def target_environment(python_version: str) -> dict[str, str]:
    """Marker values of the GPU image's Python (CPython on x86-64 Linux), not this venv's: a
    requirement such as ``typing-extensions; python_version < '3.11'`` counts as it does there."""
    return {
        "python_version": python_version,
        "python_full_version": f"{python_version}.0",
        "implementation_name": "cpython",
        "platform_python_implementation": "CPython",
        "sys_platform": "linux",
        "platform_system": "Linux",
        "platform_machine": "x86_64",
        "os_name": "posix",
    }


def _applies(marker: Marker | None, environment: dict[str, str], extras: Iterable[str]) -> bool:
    if marker is None:
        return True
    return any(marker.evaluate({**environment, "extra": extra}) for extra in (*extras, ""))


def _read_dependencies(pyproject: Path) -> list[str]:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    return tomllib.loads(pyproject.read_text())["project"]["dependencies"]


def missing_distributions(
    pyproject: Path = ROOT / "pyproject.toml",
    kinds: Path = DEFAULT_KINDS,
    python_version: str = "3.12",
    distribution: Callable[[str], importlib.metadata.Distribution] = importlib.metadata.distribution,
) -> list[tuple[str, str]]:
    """(canonical name, version) of each distribution the serving code needs and the GPU image
    lacks: pyproject.toml's ``dependencies`` and what they require (with the extras asked for and
    the markers of the image's Python), at the versions installed in the running venv, less what
    KINDS.md lists.

    The walk stops at the image's distributions: the image holds what they require already (its
    own versions of them may need other things than this venv's do). Raises LookupError when the
    venv lacks one that the walk reaches."""
    image = image_distributions(kinds)
    environment = target_environment(python_version)
    # a requirement's marker is weighed where it is met: with the extras asked of its requirer
    pending = [Requirement(text) for text in _read_dependencies(pyproject)]
    pending = [requirement for requirement in pending if _applies(requirement.marker, environment, ())]
    found: dict[str, str] = {}
    extras_seen: dict[str, set[str]] = {}
    absent: list[str] = []
    while pending:
        requirement = pending.pop()
        name = canonicalize_name(requirement.name)
        if name in image:
            continue
        new_extras = set(requirement.extras) - extras_seen.get(name, set())
        if name in found and not new_extras:
            continue
        extras_seen.setdefault(name, set()).update(requirement.extras)
        try:
            installed = distribution(name)
        except importlib.metadata.PackageNotFoundError:
            absent.append(str(requirement))
            continue
        found[name] = installed.version
        for text in installed.requires or []:
            needed = Requirement(text)
            if _applies(needed.marker, environment, extras_seen[name]):
                pending.append(needed)
    if absent:
        raise LookupError(
            f"the running venv lacks {sorted(set(absent))}, which the GPU machine needs: install them here "
            "(make install) so their versions and requirements are known"
        )
    return sorted(found.items())


def target_tags(python_version: str, platforms: Sequence[str]) -> frozenset[Tag]:
    """The wheel tags the GPU image's CPython installs (cp312, abi3 of older CPythons, pure Python)."""
    version = tuple(int(part) for part in python_version.split("."))
    interpreter = f"cp{version[0]}{version[1]}"
    tags = set(cpython_tags(version, platforms=list(platforms)))
    tags |= set(compatible_tags(version, interpreter=interpreter, platforms=list(platforms)))
    return frozenset(tags)


def local_distributions(
    missing: Sequence[tuple[str, str]], folders: Sequence[Path], tags: frozenset[Tag]
) -> tuple[list[Path], list[str]]:
    """The files of ``folders`` (wheels, and sdists of :data:`SDIST_ONLY`) that hold ``missing``,
    and the names of the files found there that are not needed. Raises LookupError listing every
    distribution with no file, a file of another version than the venv's, one that the GPU
    image's Python cannot install, or two files for one distribution."""
    wanted = dict(missing)
    chosen: dict[str, Path] = {}
    problems: list[str] = []
    unused: list[str] = []
    for folder in folders:
        if not folder.is_dir():
            raise FileNotFoundError(f"{folder}: no such folder of wheels")
        for path in sorted(folder.iterdir()):
            if path.name.endswith(".whl"):
                name, version, _build, file_tags = parse_wheel_filename(path.name)
            elif path.name.endswith((".tar.gz", ".zip")):
                name, version = parse_sdist_filename(path.name)
                file_tags = None
            else:
                continue
            if name not in wanted:
                unused.append(path.name)
                continue
            if version != Version(wanted[name]):
                problems.append(f"{path.name}: the venv has {name} {wanted[name]}")
            elif file_tags is not None and not file_tags & tags:
                problems.append(f"{path.name}: not installable by the GPU image's Python")
            elif file_tags is None and name not in SDIST_ONLY:
                problems.append(f"{path.name}: an sdist, where a wheel is wanted")
            elif name in chosen:
                problems.append(f"{path.name}: a second file for {name} ({chosen[name].name})")
            else:
                chosen[name] = path
    problems += [f"{name} {version}: no file" for name, version in missing if name not in chosen]
    if problems:
        raise LookupError("the wheels folders do not hold what the GPU machine needs:\n  " + "\n  ".join(problems))
    return [chosen[name] for name, _ in missing], unused


# -- cutting the bytes into calls ------------------------------------------------------------------


@dataclass(frozen=True)
class Piece:
    """Bytes ``start`` to ``stop`` of the archive ``stream``, carried as one part file."""

    stream: str
    start: int
    stop: int

    @property
    def size(self) -> int:
        return self.stop - self.start


def split_calls(streams: Sequence[tuple[str, int]], call_bytes: int) -> list[list[Piece]]:
    """The archives ``streams`` ((name, size), in the order the GPU machine needs them) cut into
    calls of at most ``call_bytes``: each call is filled before the next one starts, so there are
    as few calls as the bytes allow and each archive is complete as early as it can be."""
    if call_bytes <= 0:
        raise ValueError(f"a call must carry some bytes (call_bytes {call_bytes})")
    names = [name for name, _ in streams]
    if len(set(names)) != len(names):
        raise ValueError(f"archive names repeat: {names}")
    calls: list[list[Piece]] = []
    room = 0
    for name, size in streams:
        if size <= 0:
            raise ValueError(f"archive {name} is empty")
        start = 0
        while start < size:
            if room == 0:
                calls.append([])
                room = call_bytes
            stop = start + min(room, size - start)
            calls[-1].append(Piece(name, start, stop))
            room -= stop - start
            start = stop
    return calls


def part_names(calls: Sequence[Sequence[Piece]]) -> dict[Piece, str]:
    """Each piece's file name: ``<archive>.<k>``, k counting the archive's pieces from 1."""
    counts: dict[str, int] = {}
    names = {}
    for call in calls:
        for piece in call:
            counts[piece.stream] = counts.get(piece.stream, 0) + 1
            names[piece] = f"{piece.stream}.{counts[piece.stream]}"
    return names


def completing_call(calls: Sequence[Sequence[Piece]], stream: str) -> int:
    """The 1-based call that carries ``stream``'s last piece."""
    return max(i for i, call in enumerate(calls, 1) for piece in call if piece.stream == stream)


# -- the scripts that run there ---------------------------------------------------------------------

COMMON_SH = r"""set -uo pipefail
again="start again from call 1 (the machine was given back between calls, or a call failed)"
# xz with the image's Python: its lzma module is there, the xz tool is not known to be
unxz() { python3 -c "import lzma,shutil,sys; shutil.copyfileobj(lzma.open(sys.stdin.buffer), sys.stdout.buffer)"; }
# NAME SHA256 PART...: every part is in /tmp/parts, and their bytes joined are those made here
check() {
    local name=$1 sha=$2 part got
    shift 2
    for part in "$@"; do
        [ -f "/tmp/parts/$part" ] || { echo "$name: /tmp/parts/$part is missing: $again" >&2; exit 3; }
    done
    got=$(cd /tmp/parts && cat "$@" | sha256sum | cut -d' ' -f1)
    [ "$got" = "$sha" ] || { echo "$name: sha256 $got, not $sha: $again" >&2; exit 3; }
    echo "$name: $# parts, sha256 ok"
}
joined() { (cd /tmp/parts && cat "$@"); }
"""

SETUP_SH = r"""#!/bin/bash
# Made by python -m tools.gpu.payload: call @CALL@ of @CALLS@ of a run of tools.gpu on this machine.
# @ORT@ (its CUDA provider's cubins for sm_@ARCH@ only) and the serving wheels into /tmp/site,
# hnswlib compiled there, the CUDA libraries' folders into /tmp/ld_path, then probe.py beside this.
@COMMON@
here=$(cd "$(dirname "$0")" && pwd)
check ort.tar.xz @ORT_SHA@ @ORT_PARTS@
check deps.tar @DEPS_SHA@ @DEPS_PARTS@
rm -rf /tmp/site /tmp/deps /tmp/ld_path && mkdir -p /tmp/site /tmp/deps
joined @ORT_PARTS@ | unxz | tar x -C /tmp/site || exit 4
joined @DEPS_PARTS@ | tar x -C /tmp/deps || exit 4
# the image's onnxruntime (the CPU build) ships the same module; tools.gpu refuses the two together
python3 -m pip uninstall -q -y onnxruntime
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    /tmp/deps/whl/*.whl || exit 5
status=0
# sdists (hnswlib): no wheels exist; the image's numpy, pybind11 and setuptools build them
for sdist in /tmp/deps/sdist/*; do
    [ -e "$sdist" ] || continue
    t0=$(date +%s)
    python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --target /tmp/site \
        "$sdist" || { echo "building $(basename "$sdist") FAILED" >&2; status=5; }
    echo "$(basename "$sdist"): $(( $(date +%s) - t0 )) s"
done
# the CUDA libraries come in pip packages whose folders are not on the loader's path
found=$(find / -xdev \( @FIND_NAMES@ \) -not -path '/proc/*' -not -path '/tmp/*' -printf '%h\n' 2>/dev/null \
    | sort -u | paste -sd:)
IFS=: read -ra dirs <<< "$found"
for lib in @CUDA_LIBS@; do
    hit=""
    for dir in "${dirs[@]}"; do compgen -G "$dir/$lib*" > /dev/null && hit=1; done
    [ -n "$hit" ] || { echo "$lib: not found on this machine" >&2; status=6; }
done
echo "$found${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" > /tmp/ld_path
echo "LD_LIBRARY_PATH=$(cat /tmp/ld_path)"
PYTHONPATH=/tmp/site LD_LIBRARY_PATH=$(cat /tmp/ld_path) PYTHONUNBUFFERED=1 timeout 180 python3 "$here/probe.py" \
    || status=7
[ "$status" = 0 ] && echo "setup: done; next: @NEXT@" || echo "setup: FAILED ($status)" >&2
exit "$status"
"""

RUN_SH = r"""#!/bin/bash
# Made by python -m tools.gpu.payload: call @CALL@ of @CALLS@ of a run of tools.gpu on this machine.
# The bundle (@BUNDLE_ID@) into /tmp/bundle, then python -m tools.gpu with the ONNX Runtime and
# wheels that call @SETUP_CALL@ put into /tmp/site; gpu.json, run.log and the servers' logs into $OUT.
@COMMON@
[ -s /tmp/ld_path ] && [ -d /tmp/site/onnxruntime ] || { echo "/tmp/site is not set up: $again" >&2; exit 3; }
check bundle.tar.xz @BUNDLE_SHA@ @BUNDLE_PARTS@
rm -rf /tmp/bundle && { joined @BUNDLE_PARTS@ | unxz | tar x -C /tmp; } || exit 6
out=${OUT:-/tmp/xmcserve-gpu-out}
mkdir -p "$out"
export PYTHONPATH=/tmp/site LD_LIBRARY_PATH=$(cat /tmp/ld_path) PYTHONUNBUFFERED=1
python3 -m tools.gpu --bundle /tmp/bundle --budget-s "${BUDGET:-@BUDGET@}" --work @WORK@ \
    --out "$out/gpu.json" ${BENCH_ARGS:-} 2>&1 | tee "$out/run.log"
rc=${PIPESTATUS[0]}
# at most 8 files come back from $OUT: the servers' logs travel as one archive of their last 2 MB each
if compgen -G "@WORK@/*.log" > /dev/null; then
    rm -rf /tmp/log-tails && mkdir -p /tmp/log-tails
    for f in @WORK@/*.log; do tail -c 2000000 "$f" > "/tmp/log-tails/$(basename "$f")"; done
    tar czf "$out/logs.tar.gz" -C /tmp/log-tails .
fi
exit "$rc"
"""

PROBE_PY = r'''"""Made by python -m tools.gpu.payload: the setup call's check that the serving packages import, that
ONNX Runtime is the carried GPU build alone, and that its CUDA provider runs a transformer layer's
kernels (MatMul, Gelu, SkipLayerNormalization, Softmax) as its CPU provider does."""

import importlib
import importlib.metadata as metadata
import sys
import time

failures = []
for module in @MODULES@:
    try:
        importlib.import_module(module)
        print("import", module, "ok")
    except Exception as exc:
        failures.append(f"import {module}: {exc!r}")
builds = []
for name in ("onnxruntime", "onnxruntime-gpu"):
    try:
        builds.append(f"{name} {metadata.version(name)}")
    except metadata.PackageNotFoundError:
        pass
print("ONNX Runtime distributions:", builds)
if [build.split()[0] for build in builds] != ["onnxruntime-gpu"]:
    failures.append(f"ONNX Runtime distributions {builds}: onnxruntime-gpu alone is wanted")

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

print("onnxruntime", ort.__version__, ort.__file__, ort.get_available_providers(), flush=True)
d, h = 384, 1536
rng = np.random.default_rng(0)
w1 = rng.standard_normal((d, h)).astype(np.float32) * 0.05
w2 = rng.standard_normal((h, d)).astype(np.float32) * 0.05
nodes = [
    helper.make_node("MatMul", ["x", "w1"], ["a"]),
    helper.make_node("Gelu", ["a"], ["g"], domain="com.microsoft"),
    helper.make_node("MatMul", ["g", "w2"], ["b"]),
    helper.make_node("SkipLayerNormalization", ["b", "x", "gamma", "beta"], ["ln"], domain="com.microsoft"),
    helper.make_node("Softmax", ["ln"], ["y"], axis=-1),
]
initializers = [
    helper.make_tensor("w1", TensorProto.FLOAT, w1.shape, w1.ravel()),
    helper.make_tensor("w2", TensorProto.FLOAT, w2.shape, w2.ravel()),
    helper.make_tensor("gamma", TensorProto.FLOAT, [d], np.ones(d, np.float32)),
    helper.make_tensor("beta", TensorProto.FLOAT, [d], np.zeros(d, np.float32)),
]
graph = helper.make_graph(
    nodes,
    "probe",
    [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, None, d])],
    [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, None, d])],
    initializers,
)
opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
model = helper.make_model(graph, opset_imports=opsets, ir_version=9).SerializeToString()
x = rng.standard_normal((32, 24, d)).astype(np.float32)
if "CUDAExecutionProvider" not in ort.get_available_providers():
    failures.append("no CUDAExecutionProvider in this ONNX Runtime")
else:
    cpu = ort.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    session = ort.InferenceSession(model, providers=["CUDAExecutionProvider", "CPUExecutionProvider"])
    print("session providers", session.get_providers(), flush=True)
    gpu = session.run(None, {"x": x})[0]
    started = time.perf_counter()
    for _ in range(50):
        session.run(None, {"x": x})
    gap = float(np.abs(gpu - cpu).max())
    print("max |cuda - cpu|", gap, "50 runs", round(time.perf_counter() - started, 4), "s")
    if session.get_providers()[0] != "CUDAExecutionProvider":
        failures.append(f"the session runs on {session.get_providers()[0]}")
    if not gap < 1e-3:
        failures.append(f"CUDA and CPU differ by {gap}")
for failure in failures:
    print("PROBE FAILED:", failure, flush=True)
print("probe:", "FAILED" if failures else "ok")
sys.exit(1 if failures else 0)
'''


def fill(template: str, **values: object) -> str:
    """``template`` with each ``@NAME@`` replaced (bash and Python use every other bracket)."""
    text = template
    for name, value in values.items():
        text = text.replace(f"@{name}@", str(value))
    left = re.findall(r"@[A-Z_]+@", text)
    if left:
        raise ValueError(f"unfilled placeholders {sorted(set(left))}")
    return text


@dataclass(frozen=True)
class Archive:
    """One archive to carry: its name (a stream of :func:`split_calls`), size and sha256."""

    name: str
    path: Path
    size: int
    sha256: str


def setup_script(calls: Sequence[Sequence[Piece]], archives: dict[str, Archive], ort: str, arch: int) -> str:
    names = part_names(calls)
    call = completing_call(calls, "deps.tar")

    def parts(stream: str) -> str:
        return " ".join(names[piece] for c in calls for piece in c if piece.stream == stream)

    return fill(
        SETUP_SH,
        COMMON=COMMON_SH.rstrip("\n"),
        CALL=call,
        CALLS=len(calls),
        NEXT=f"call {call + 1}" if call < len(calls) else "run.sh",
        ORT=ort,
        ARCH=arch,
        ORT_SHA=archives["ort.tar.xz"].sha256,
        ORT_PARTS=parts("ort.tar.xz"),
        DEPS_SHA=archives["deps.tar"].sha256,
        DEPS_PARTS=parts("deps.tar"),
        FIND_NAMES=" -o ".join(f"-name '{lib}*'" for lib in CUDA_LIBS),
        CUDA_LIBS=" ".join(CUDA_LIBS),
    )


def run_script(calls: Sequence[Sequence[Piece]], archives: dict[str, Archive], budget_s: float, bundle_id: str) -> str:
    names = part_names(calls)
    parts = " ".join(names[piece] for c in calls for piece in c if piece.stream == "bundle.tar.xz")
    return fill(
        RUN_SH,
        COMMON=COMMON_SH.rstrip("\n"),
        CALL=len(calls),
        CALLS=len(calls),
        SETUP_CALL=completing_call(calls, "deps.tar"),
        BUNDLE_ID=bundle_id,
        BUNDLE_SHA=archives["bundle.tar.xz"].sha256,
        BUNDLE_PARTS=parts,
        BUDGET=f"{budget_s:g}",
        WORK=BENCH_WORK,
    )


def probe_script() -> str:
    return fill(PROBE_PY, MODULES=repr(PROBE_MODULES))


def call_commands(calls: Sequence[Sequence[Piece]], folder: str, budget_s: float) -> list[dict]:
    """The device tool's ``run`` arguments of each call, in order: ``folder`` is the output folder
    as the repository's root sees it. Every call copies its parts into /tmp/parts; the first starts
    from an empty /tmp (a warm machine may hold an earlier try), the setup call runs setup.sh, the
    last run.sh."""
    setup = completing_call(calls, "deps.tar")
    commands = []
    for number in range(1, len(calls) + 1):
        here = f"{folder}/c{number}"
        steps = ["rm -rf /tmp/parts /tmp/site /tmp/deps /tmp/bundle /tmp/ld_path"] if number == 1 else []
        steps += ["mkdir -p /tmp/parts", f"cp {here}/parts/* /tmp/parts/", "ls -l /tmp/parts"]
        timeout_s = 120.0
        if number == setup:
            steps.append(f"bash {here}/setup.sh")
            timeout_s += 240
        if number == len(calls):
            steps.append(f"bash {here}/run.sh")
            timeout_s += budget_s + 60
        commands.append(
            {"call": number, "carry": [here], "timeout_s": int(min(600, timeout_s)), "command": " && ".join(steps)}
        )
    return commands


# -- making the archives ---------------------------------------------------------------------------


def _tar_info(name: str, size: int, mode: int, mtime: float) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = size, mode, int(mtime)
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info


def _normalized(info: tarfile.TarInfo) -> tarfile.TarInfo:
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info


def write_ort_archive(wheel: Path, dest: Path, keep_arch: int, preset: int) -> dict[str, PruneReport]:
    """The wheel's files, every ELF library with GPU code pruned to ``keep_arch``, as ``dest``
    (tar + xz, laid out as a ``pip install --target`` folder: the package and its dist-info).
    Raises ValueError when no library of the wheel has GPU code (not a CUDA build)."""
    reports: dict[str, PruneReport] = {}
    with zipfile.ZipFile(wheel) as wheel_zip, tarfile.open(dest, "w:xz", preset=preset) as tar:
        for member in wheel_zip.infolist():
            if member.is_dir():
                continue
            mode = (member.external_attr >> 16) & 0o777 or 0o644
            info = _tar_info(member.filename, member.file_size, mode, calendar.timegm(member.date_time))
            if ".so" in Path(member.filename).name:
                data = bytearray(wheel_zip.read(member))
                found = elf_section_range(data, ".nv_fatbin") if data[:4] == ELF_MAGIC else None
                if found is not None:
                    offset, size = found
                    with memoryview(data) as view:
                        reports[member.filename] = prune_fatbin(view[offset : offset + size], keep_arch)
                tar.addfile(info, io.BytesIO(data))
            else:
                with wheel_zip.open(member) as source:
                    tar.addfile(info, source)
    if not reports:
        raise ValueError(f"{wheel.name}: no library with a .nv_fatbin section (not a CUDA build?)")
    return reports


def write_deps_archive(files: Sequence[Path], dest: Path) -> None:
    """Wheels under ``whl/``, sdists under ``sdist/``, uncompressed (wheels are zips already)."""
    with tarfile.open(dest, "w", format=tarfile.PAX_FORMAT) as tar:
        for path in files:
            folder = "whl" if path.name.endswith(".whl") else "sdist"
            tar.add(path, arcname=f"{folder}/{path.name}", filter=_normalized)


def write_bundle_archive(bundle: Path, dest: Path, preset: int) -> None:
    with tarfile.open(dest, "w:xz", preset=preset) as tar:
        tar.add(bundle, arcname="bundle", filter=_normalized)


def archive(name: str, path: Path) -> Archive:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return Archive(name, path, path.stat().st_size, digest.hexdigest())


def write_parts(calls: Sequence[Sequence[Piece]], archives: dict[str, Archive], out: Path) -> None:
    """Each piece's bytes as ``<out>/c<call>/parts/<part name>``."""
    names = part_names(calls)
    for number, call in enumerate(calls, 1):
        folder = out / f"c{number}" / "parts"
        folder.mkdir(parents=True, exist_ok=True)
        for piece in call:
            with open(archives[piece.stream].path, "rb") as source, open(folder / names[piece], "wb") as dest:
                source.seek(piece.start)
                left = piece.size
                while left:
                    block = source.read(min(left, 1 << 20))
                    if not block:
                        raise OSError(f"{archives[piece.stream].path} ended before byte {piece.stop}")
                    dest.write(block)
                    left -= len(block)


def folder_bytes(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())


def tree_bytes(root: Path = ROOT) -> int | None:
    """Bytes of the files that travel with every call (tracked, and untracked but not ignored),
    None where git cannot tell."""
    try:
        listed = subprocess.run(
            ["git", "-C", str(root), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            capture_output=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    paths = (root / os.fsdecode(name) for name in listed.split(b"\0") if name)
    return sum(path.stat().st_size for path in paths if path.is_file() and not path.is_symlink())


def repo_folder(out: Path, root: Path = ROOT) -> str | None:
    """``out`` relative to the repository's root (how the device machine's commands name it), or
    None when it lies outside. Raises ValueError when git would carry it with the tree."""
    try:
        relative = out.resolve().relative_to(root)
    except ValueError:
        return None
    # The trailing slash asks about a folder: git matches a folder pattern such as the README's
    # "/.gpu/" against a path that does not exist yet only when told it is one.
    ignored = subprocess.run(["git", "-C", str(root), "check-ignore", "-q", f"{relative}/"], capture_output=True)
    if ignored.returncode == 1:
        raise ValueError(
            f"{relative} is not ignored by git: it would travel with every call's tree; "
            f"add /{relative}/ to .git/info/exclude"
        )
    return relative.as_posix()


# -- getting the inputs ----------------------------------------------------------------------------


def pip_download(params: PayloadParams, dest: Path, requirements: Sequence[str], binary: bool = True) -> list[Path]:
    """``pip download --no-deps`` of ``requirements`` into ``dest``, as wheels for the GPU image's
    Python (or sdists); pip keeps what ``dest`` already holds. Returns the files of ``dest``."""
    dest.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-d", str(dest)]
    if binary:
        command += ["--only-binary=:all:", "--python-version", params.python_version, "--implementation", "cp"]
        for platform in params.platforms:
            command += ["--platform", platform]
    else:
        # pip reads an sdist's metadata by building it, its build requirements installed aside: named
        # alone, so that those come as wheels (":all:" would reach them too and compile numpy)
        command += ["--no-binary=" + ",".join(Requirement(text).name for text in requirements)]
    subprocess.run([*command, *requirements], check=True)
    return sorted(dest.iterdir())


def get_ort_wheel(params: PayloadParams, say: Callable[[str], None]) -> Path:
    if params.ort_wheel is not None:
        wheel = params.ort_wheel
        if not wheel.is_file():
            raise FileNotFoundError(f"{wheel}: no such wheel")
    else:
        say(f"downloading onnxruntime-gpu {params.ort_version}")
        dest = params.out / "downloads" / "ort"
        pip_download(params, dest, [f"onnxruntime-gpu=={params.ort_version}"])
        matches = sorted(dest.glob(f"onnxruntime_gpu-{params.ort_version}-*.whl"))
        if not matches:
            raise FileNotFoundError(f"pip left no onnxruntime_gpu-{params.ort_version} wheel in {dest}")
        wheel = matches[-1]
    name, _version, _build, tags = parse_wheel_filename(wheel.name)
    if name != "onnxruntime-gpu":
        raise ValueError(f"{wheel.name} is not onnxruntime-gpu")
    if not tags & target_tags(params.python_version, params.platforms):
        raise ValueError(f"{wheel.name}: not installable by the GPU image's Python {params.python_version}")
    return wheel


def get_deps(params: PayloadParams, say: Callable[[str], None]) -> list[Path]:
    missing = missing_distributions(params.pyproject, params.kinds, params.python_version)
    say(f"the image lacks {len(missing)}: " + ", ".join(f"{name} {version}" for name, version in missing))
    folders = list(params.wheels)
    if not folders:
        wheels_dir, sdist_dir = params.out / "downloads" / "wheels", params.out / "downloads" / "sdist"
        pins = [f"{name}=={version}" for name, version in missing if name not in SDIST_ONLY]
        sdists = [f"{name}=={version}" for name, version in missing if name in SDIST_ONLY]
        if pins:
            pip_download(params, wheels_dir, pins)
        if sdists:
            pip_download(params, sdist_dir, sdists, binary=False)
        folders = [wheels_dir, sdist_dir]
    files, unused = local_distributions(missing, folders, target_tags(params.python_version, params.platforms))
    if unused:
        say(f"left out (the image has them, or nothing needs them): {', '.join(unused)}")
    return files


def get_bundle(params: PayloadParams, say: Callable[[str], None]) -> Path:
    if params.bundle is not None:
        if not (params.bundle / "manifest.json").is_file():
            raise FileNotFoundError(f"{params.bundle}: no manifest.json (not a bundle)")
        return params.bundle
    bundle = params.out.resolve() / "bundle"
    say(f"building the bundle into {bundle} (export.build, fp32, a few minutes)")
    # tools.gpu's bundle stage, encoded on this machine's CPU
    command = [sys.executable, "-m", "export.build", "--data", str(params.data.resolve()), "--out", str(bundle)]
    command += ["--force", "--index-kind", "rae_memory", "--dim", "64", "--quantize", "none"]
    command += ["--encode-device", "cpu", "--build-threads", "0"]
    subprocess.run(command, cwd=ROOT, check=True)
    return bundle


# -- the whole --------------------------------------------------------------------------------------


def make_payload(params: PayloadParams, say: Callable[[str], None] = print) -> list[dict]:
    """Steps 1 to 4 of the module's docstring into ``params.out``; returns the calls (as written to
    ``calls.json``). Raises ValueError, FileNotFoundError or LookupError for what is wrong with the
    inputs, before the long steps where it can."""
    if params.call_bytes <= 2 * SCRIPT_RESERVE:
        raise ValueError(f"--call-mb {params.call_mb}: too small")
    folder = repo_folder(params.out)
    tree = tree_bytes()
    if tree is not None and tree + params.call_bytes > CALL_LIMIT_BYTES:
        raise ValueError(
            f"the working tree ({tree / 1e6:.1f} MB) and {params.call_mb} MB of parts exceed the device tool's "
            f"{CALL_LIMIT_BYTES / 1e6:.1f} MB a call: lower --call-mb"
        )
    started = time.monotonic()
    deps = get_deps(params, say)
    ort_wheel = get_ort_wheel(params, say)
    bundle = get_bundle(params, say)

    for old in params.out.glob("c[0-9]*"):
        if old.is_dir() and re.fullmatch(r"c\d+", old.name):
            shutil.rmtree(old)
    work = params.out / "work"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    say(f"pruning {ort_wheel.name} to sm_{params.keep_arch}, xz -{params.ort_preset}")
    reports = write_ort_archive(ort_wheel, work / "ort.tar.xz", params.keep_arch, params.ort_preset)
    for member, report in reports.items():
        say(f"  {member}: {report.describe()}")
    write_deps_archive(deps, work / "deps.tar")
    say(f"bundle {bundle}: xz -{params.bundle_preset}")
    write_bundle_archive(bundle, work / "bundle.tar.xz", params.bundle_preset)
    archives = {name: archive(name, work / name) for name in STREAMS}

    calls = split_calls([(name, archives[name].size) for name in STREAMS], params.call_bytes - SCRIPT_RESERVE)
    write_parts(calls, archives, params.out)
    setup_dir = params.out / f"c{completing_call(calls, 'deps.tar')}"
    last_dir = params.out / f"c{len(calls)}"
    ort_label = parse_wheel_filename(ort_wheel.name)[1]
    bundle_id = json.loads((bundle / "manifest.json").read_text()).get("bundle_id", bundle.name)
    scripts = {
        setup_dir / "setup.sh": setup_script(calls, archives, f"onnxruntime-gpu {ort_label}", params.keep_arch),
        setup_dir / "probe.py": probe_script(),
        last_dir / "run.sh": run_script(calls, archives, params.budget_s, bundle_id),
    }
    for path, text in scripts.items():
        path.write_text(text)
        path.chmod(0o755)
    shutil.rmtree(work)

    commands = call_commands(calls, folder or str(params.out.resolve()), params.budget_s)
    for command in commands:
        command["bytes"] = folder_bytes(params.out / f"c{command['call']}")
        if command["bytes"] > params.call_bytes:
            raise ValueError(f"call {command['call']} holds {command['bytes']} bytes, over {params.call_bytes}")
    record = {
        "made_by": "python -m tools.gpu.payload",
        "params": {k: str(v) if isinstance(v, Path) else v for k, v in dataclasses.asdict(params).items()},
        "onnxruntime_wheel": ort_wheel.name,
        "pruned": {member: dataclasses.asdict(report) for member, report in reports.items()},
        "archives": {name: {"bytes": a.size, "sha256": a.sha256} for name, a in archives.items()},
        "tree_bytes": tree,
        "wall_s": round(time.monotonic() - started, 1),
        "calls": commands,
    }
    (params.out / "calls.json").write_text(json.dumps(record, indent=2, default=str) + "\n")
    if folder is None:
        say(f"warning: {params.out} lies outside the repository; the device tool carries only what lies inside")
    return commands


def describe_calls(commands: Sequence[dict], tree: int | None) -> str:
    sizes = " / ".join(f"{command['bytes'] / 1e6:.2f}" for command in commands)
    tree_text = f"{tree / 1e6:.1f} MB" if tree is not None else "unknown"
    lines = [
        f"{len(commands)} device calls carrying {sizes} MB (the tree adds {tree_text} to each; 64 MiB a call).",
        "Make them in this order, each as soon as the last returns: a machine idle for 30 s is given back with",
        "what /tmp holds, and then everything starts again from call 1. Each is the device tool's run:",
    ]
    for command in commands:
        arguments = {key: command[key] for key in ("carry", "timeout_s", "command")}
        lines.append(f"  call {command['call']}: {json.dumps(arguments)}")
    lines.append("Then give_back. The last call's $OUT holds gpu.json, run.log and logs.tar.gz.")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m tools.gpu.payload", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    defaults = PayloadParams()
    parser.add_argument("--out", type=Path, help=f"output folder, ignored by git (default {defaults.out})")
    parser.add_argument("--bundle", type=Path, help="carry this bundle (default: build one into OUT/bundle)")
    parser.add_argument("--data", type=Path, help=f"data set of the built bundle (default {defaults.data})")
    parser.add_argument("--ort-wheel", type=Path, help="this onnxruntime-gpu wheel instead of a download")
    parser.add_argument("--ort-version", help=f"onnxruntime-gpu to download (default {defaults.ort_version})")
    parser.add_argument(
        "--wheels", type=Path, action="append", help="a folder of the serving wheels and sdists (repeatable)"
    )
    parser.add_argument("--keep-arch", type=int, help=f"SM architecture kept (default {defaults.keep_arch})")
    parser.add_argument("--python-version", help=f"the GPU image's Python (default {defaults.python_version})")
    parser.add_argument("--call-mb", type=float, help=f"MB (10^6 bytes) a call carries (default {defaults.call_mb})")
    parser.add_argument("--budget-s", type=float, help=f"tools.gpu's --budget-s there (default {defaults.budget_s:g})")
    parser.add_argument("--kinds", type=Path, help=f"the device tool's KINDS.md (default {defaults.kinds})")
    return parser


def params_from(args: argparse.Namespace) -> PayloadParams:
    options = ("out", "bundle", "data", "ort_wheel", "ort_version", "keep_arch", "python_version", "call_mb")
    given = {name: getattr(args, name) for name in (*options, "budget_s", "kinds") if getattr(args, name) is not None}
    if args.wheels:
        given["wheels"] = tuple(args.wheels)
    return PayloadParams(**given)


def main(argv: list[str] | None = None) -> int:
    params = params_from(build_parser().parse_args(argv))

    def say(text: str) -> None:
        print(f"tools.gpu.payload: {text}", flush=True)

    try:
        commands = make_payload(params, say)
    except (ValueError, LookupError, FileNotFoundError) as exc:
        print(f"tools.gpu.payload: {exc}", file=sys.stderr)
        return 2
    except (OSError, subprocess.CalledProcessError, tarfile.TarError, zipfile.BadZipFile) as exc:
        print(f"tools.gpu.payload: failed: {exc}", file=sys.stderr)
        return 1
    print(describe_calls(commands, tree_bytes()))
    print(f"tools.gpu.payload: {params.out / 'calls.json'} holds the same")
    return 0


if __name__ == "__main__":
    sys.exit(main())
