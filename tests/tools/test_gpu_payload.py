"""tools.gpu.payload without a GPU or a network: the fat binary's pruning on a synthetic ELF library
(two containers, padding between them, sm_80 and sm_90 cubins, sm_90 PTX), the section lookup, the
cutting of the archives into calls, what the image lacks, and the scripts and commands it writes."""

import importlib.metadata
import itertools
import json
import random
import re
import struct
import subprocess
import tarfile
import zipfile

import pytest
from packaging.utils import canonicalize_name

from tools.gpu.payload import (
    FATBIN_MAGIC,
    KIND_CUBIN,
    KIND_PTX,
    SDIST_ONLY,
    Archive,
    PayloadParams,
    call_commands,
    elf_section_range,
    fatbin_entries,
    image_distributions,
    local_distributions,
    main,
    missing_distributions,
    nv_fatbin_range,
    part_names,
    probe_script,
    prune_fatbin,
    repo_folder,
    run_script,
    runs_on,
    setup_script,
    split_calls,
    target_tags,
    write_ort_archive,
    write_parts,
)

ENTRY_HEADER = 64


def fatbin_entry(kind: int, arch: int, payload: bytes) -> bytes:
    """An entry as nvcc lays it out: kind, version, header size, payload size, the arch at +28."""
    header = struct.pack("<HHIQ", kind, 0x0101, ENTRY_HEADER, len(payload))
    header += bytes(28 - len(header)) + struct.pack("<I", arch)
    return header + bytes(ENTRY_HEADER - len(header)) + payload


def container(entries: list[bytes]) -> bytes:
    body = b"".join(entries)
    return struct.pack("<IHHQ", FATBIN_MAGIC, 1, 16, len(body)) + body


def payload(arch: int, size: int) -> bytes:
    return bytes([arch % 250 + 1]) * size


def fatbin(*containers: bytes, gap: int = 16) -> bytes:
    """The containers with zero padding up to the next 8-byte boundary and ``gap`` bytes more between
    them, and zeros after the last."""
    out = b""
    for blob in containers:
        out += blob
        out += bytes(-len(out) % 8 + gap)
    return out


def payload_ranges(section: bytes) -> list[tuple[int, int, int, int]]:
    """(kind, arch, start, stop) of each entry's payload, read with the module's own parser."""
    return [(e.kind, e.arch, e.payload_offset, e.payload_offset + e.payload_size) for e in fatbin_entries(section)]


def elf64(sections: list[tuple[str, bytes]]) -> tuple[bytes, dict[str, tuple[int, int]]]:
    """A little-endian ELF64 file holding ``sections`` (and a name table), and where each lies."""
    names = b"\0"
    name_at = {}
    for name, _ in [*sections, (".shstrtab", b"")]:
        name_at[name] = len(names)
        names += name.encode() + b"\0"
    body = bytearray(64)
    where = {}
    for name, data in [*sections, (".shstrtab", names)]:
        body += bytes(-len(body) % 16)
        where[name] = (len(body), len(data))
        body += data
    body += bytes(-len(body) % 8)
    shoff = len(body)
    headers = bytes(64)  # section 0: null
    for name, _ in [*sections, (".shstrtab", b"")]:
        offset, size = where[name]
        headers += struct.pack(
            "<IIQQQQIIQQ", name_at[name], 1 if name != ".shstrtab" else 3, 0, 0, offset, size, 0, 0, 1, 0
        )
    count = len(sections) + 2
    ident = b"\x7fELF" + bytes([2, 1, 1]) + bytes(9)
    header = ident + struct.pack("<HHIQQQIHHHHHH", 3, 62, 1, 0, 0, shoff, 0, 64, 56, 0, 64, count, count - 1)
    body[:64] = header
    return bytes(body + headers), where


@pytest.fixture
def section() -> bytes:
    """Two containers: sm_80 + sm_90 cubins, then sm_90 PTX + sm_80 + sm_90 cubins (odd sizes)."""
    first = container([fatbin_entry(KIND_CUBIN, 80, payload(80, 37)), fatbin_entry(KIND_CUBIN, 90, payload(90, 45))])
    second = container(
        [
            fatbin_entry(KIND_PTX, 90, payload(7, 19)),
            fatbin_entry(KIND_CUBIN, 80, payload(81, 64)),
            fatbin_entry(KIND_CUBIN, 90, payload(91, 23)),
        ]
    )
    return fatbin(first, second)


def test_prune_zeroes_exactly_the_cubins_of_other_architectures(section):
    ranges = payload_ranges(section)
    assert [(kind, arch) for kind, arch, *_ in ranges] == [(2, 80), (2, 90), (1, 90), (2, 80), (2, 90)]
    data = bytearray(section)
    report = prune_fatbin(data, 90)

    expected = bytearray(section)
    for kind, arch, start, stop in ranges:
        if kind == KIND_CUBIN and arch != 90:
            expected[start:stop] = bytes(stop - start)
    assert data == expected and len(data) == len(section)
    for kind, arch, start, stop in ranges:  # sm_90 cubins and the PTX keep their bytes
        if kind == KIND_PTX or arch == 90:
            assert data[start:stop] == section[start:stop] and any(data[start:stop])
    assert payload_ranges(bytes(data)) == ranges  # every header and offset as it was
    assert report.zeroed == {80: 37 + 64} and report.kept == {90: 45 + 19 + 23}
    assert (report.containers, report.cubins, report.ptx, report.containers_without_kept) == (2, 4, 1, 0)
    # pruning again changes nothing
    again = bytearray(data)
    prune_fatbin(again, 90)
    assert again == data


def test_prune_refuses_when_no_entry_is_of_the_kept_architecture(section):
    data = bytearray(section)
    with pytest.raises(ValueError, match="no entry of sm_100"):
        prune_fatbin(data, 100)
    only_80 = bytearray(fatbin(container([fatbin_entry(KIND_CUBIN, 80, payload(80, 40))])))
    with pytest.raises(ValueError, match="no entry of sm_90"):
        prune_fatbin(only_80, 90)
    assert data == section and only_80 == fatbin(container([fatbin_entry(KIND_CUBIN, 80, payload(80, 40))]))


def test_prune_refuses_ptx_of_other_architectures_and_what_it_cannot_parse(section):
    with_ptx = fatbin(
        container([fatbin_entry(KIND_PTX, 80, payload(3, 16)), fatbin_entry(KIND_CUBIN, 90, payload(90, 8))])
    )
    data = bytearray(with_ptx)
    with pytest.raises(ValueError, match="PTX for \\[80\\]"):
        prune_fatbin(data, 90)
    assert data == with_ptx

    garbage = bytearray(section)
    garbage[-3] = 1  # a non-zero byte where only padding may be
    with pytest.raises(ValueError, match="neither a container nor padding"):
        prune_fatbin(garbage, 90)
    short = bytearray(section)
    struct.pack_into("<Q", short, 8, 10**6)  # the first container's size past the section's end
    with pytest.raises(ValueError, match="runs past"):
        prune_fatbin(short, 90)
    unknown = bytearray(fatbin(container([fatbin_entry(5, 90, payload(90, 8))])))
    with pytest.raises(ValueError, match="kind 5"):
        prune_fatbin(unknown, 90)


def test_cubins_run_on_their_major_architecture_from_their_minor_up():
    assert runs_on(90, 90) and runs_on(80, 86) and runs_on(86, 89)
    assert not runs_on(80, 90) and not runs_on(89, 90) and not runs_on(120, 90) and not runs_on(89, 86)


def test_nv_fatbin_range_finds_the_section_and_pruning_through_it_stays_inside(section):
    blob, where = elf64([(".text", b"\x90" * 100), (".nv_fatbin", section), (".rodata", b"ro" * 33)])
    assert nv_fatbin_range(blob) == where[".nv_fatbin"]
    assert elf_section_range(blob, ".rodata") == where[".rodata"] and elf_section_range(blob, ".bss") is None
    offset, size = nv_fatbin_range(blob)
    data = bytearray(blob)
    with memoryview(data) as view:
        prune_fatbin(view[offset : offset + size], 90)
    assert data[:offset] == blob[:offset] and data[offset + size :] == blob[offset + size :]
    assert data[offset : offset + size] != section and len(data) == len(blob)

    without, _ = elf64([(".text", b"\x90" * 100)])
    with pytest.raises(ValueError, match="no .nv_fatbin"):
        nv_fatbin_range(without)
    with pytest.raises(ValueError, match="not an ELF"):
        nv_fatbin_range(b"MZ" + bytes(100))
    with pytest.raises(ValueError, match="64-bit"):
        nv_fatbin_range(b"\x7fELF\x01\x01" + bytes(100))


def test_the_ort_archive_holds_the_wheel_with_its_library_pruned(section, tmp_path):
    blob, where = elf64([(".nv_fatbin", section)])
    wheel = tmp_path / "onnxruntime_gpu-1.31.1-cp312-cp312-manylinux_2_28_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as out:
        out.writestr("onnxruntime/capi/libonnxruntime_providers_cuda.so", blob)
        out.writestr("onnxruntime/__init__.py", "x = 1\n")
        out.writestr("onnxruntime_gpu-1.31.1.dist-info/METADATA", "Name: onnxruntime-gpu\n")
    reports = write_ort_archive(wheel, tmp_path / "ort.tar.xz", 90, 1)
    assert list(reports) == ["onnxruntime/capi/libonnxruntime_providers_cuda.so"]
    with tarfile.open(tmp_path / "ort.tar.xz") as tar:
        names = tar.getnames()
        library = tar.extractfile("onnxruntime/capi/libonnxruntime_providers_cuda.so").read()
    assert sorted(names) == sorted(zipfile.ZipFile(wheel).namelist())
    offset, size = where[".nv_fatbin"]
    expected = bytearray(section)
    prune_fatbin(expected, 90)
    assert library[offset : offset + size] == expected and len(library) == len(blob)

    plain = tmp_path / "onnxruntime_gpu-1.31.1-cp312-cp312-manylinux_2_28_x86_64.cpu.whl"
    with zipfile.ZipFile(plain, "w") as out:
        out.writestr("onnxruntime/__init__.py", "x = 1\n")
    with pytest.raises(ValueError, match="not a CUDA build"):
        write_ort_archive(plain, tmp_path / "plain.tar.xz", 90, 1)


@pytest.mark.parametrize("call_bytes", [1, 7, 100, 101, 250, 10_000])
def test_split_calls_fills_each_call_in_order_and_covers_every_byte(call_bytes):
    rng = random.Random(call_bytes)
    streams = [("ort.tar.xz", rng.randint(1, 700)), ("deps.tar", rng.randint(1, 300)), ("bundle.tar.xz", 333)]
    calls = split_calls(streams, call_bytes)
    sizes = [sum(piece.size for piece in call) for call in calls]
    assert all(0 < size <= call_bytes for size in sizes)
    assert all(size == call_bytes for size in sizes[:-1])  # as few calls as the bytes allow
    pieces = [piece for call in calls for piece in call]
    assert [piece.stream for piece in pieces] == sorted(
        [piece.stream for piece in pieces], key=[name for name, _ in streams].index
    )
    for name, size in streams:
        mine = [piece for piece in pieces if piece.stream == name]
        assert mine[0].start == 0 and mine[-1].stop == size
        assert all(a.stop == b.start for a, b in itertools.pairwise(mine)) and all(p.size > 0 for p in mine)
    names = part_names(calls)
    assert len(set(names.values())) == len(pieces) and names[pieces[0]] == "ort.tar.xz.1"


def test_split_calls_refuses_what_it_cannot_cut():
    with pytest.raises(ValueError):
        split_calls([("a", 10)], 0)
    with pytest.raises(ValueError, match="empty"):
        split_calls([("a", 10), ("b", 0)], 5)
    with pytest.raises(ValueError, match="repeat"):
        split_calls([("a", 1), ("a", 2)], 5)


def test_parts_joined_give_back_each_archive(tmp_path):
    sources = {}
    for name, size in (("ort.tar.xz", 1000), ("deps.tar", 10), ("bundle.tar.xz", 555)):
        path = tmp_path / name
        path.write_bytes(random.Random(size).randbytes(size))
        sources[name] = Archive(name, path, size, "-")
    calls = split_calls([(name, a.size) for name, a in sources.items()], 300)
    out = tmp_path / "out"
    write_parts(calls, sources, out)
    names = part_names(calls)
    for name, source in sources.items():
        joined = b"".join(
            (out / f"c{number}" / "parts" / names[piece]).read_bytes()
            for number, call in enumerate(calls, 1)
            for piece in call
            if piece.stream == name
        )
        assert joined == source.path.read_bytes()
    assert all(sum(p.stat().st_size for p in (out / f"c{n}" / "parts").iterdir()) <= 300 for n in range(1, 7))


@pytest.mark.parametrize("call_bytes", [58_000_000 - 65536, 40_000_000, 200_000_000])
def test_the_scripts_parse_and_name_the_parts_of_their_calls(call_bytes, tmp_path):
    sizes = {"ort.tar.xz": 70_072_936, "deps.tar": 24_000_000, "bundle.tar.xz": 88_400_000}
    archives = {name: Archive(name, tmp_path / name, size, f"{i:064x}") for i, (name, size) in enumerate(sizes.items())}
    calls = split_calls(list(sizes.items()), call_bytes)
    names = part_names(calls)
    setup = setup_script(calls, archives, "onnxruntime-gpu 1.31.1", 90)
    run = run_script(calls, archives, 400, "rae-memory-64d-x")
    for script_name, text in (("setup.sh", setup), ("run.sh", run)):
        path = tmp_path / script_name
        path.write_text(text)
        done = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        assert re.search("@[A-Z_]+@", text) is None
    compile(probe_script(), "probe.py", "exec")
    assert "sys." + "path" not in probe_script()  # bench/ edits no import path (tests/bench/test_suite.py)
    for piece, part in names.items():
        assert part in (run if piece.stream == "bundle.tar.xz" else setup)
    assert archives["ort.tar.xz"].sha256 in setup and archives["bundle.tar.xz"].sha256 in run
    assert '--budget-s "${BUDGET:-400}"' in run
    assert '--out "$out/gpu.json" ${BENCH_ARGS:-} 2>&1' in run  # another run on the warm machine adds its arguments

    commands = call_commands(calls, ".gpu", 400)
    assert [command["carry"] for command in commands] == [[f".gpu/c{n}"] for n in range(1, len(calls) + 1)]
    assert commands[0]["command"].startswith("rm -rf /tmp/parts") and "run.sh" in commands[-1]["command"]
    assert sum("setup.sh" in command["command"] for command in commands) == 1
    assert all(len(command["command"]) <= 2000 and command["timeout_s"] <= 600 for command in commands)


KINDS = """# kinds

## `nvidia-h200`
| pip list | numpy 2.5.2 |

## Python packages already there

nvidia-h100-x1, nvidia-h200: their image holds these. Packages: Anyio, numpy, typing_extensions, h11.

## another section
Packages: fastapi.
"""


class FakeDistribution:
    def __init__(self, version: str, requires: list[str]):
        self.version, self.requires = version, requires


def test_image_distributions_are_read_from_kinds_md(tmp_path):
    kinds = tmp_path / "KINDS.md"
    kinds.write_text(KINDS)
    assert image_distributions(kinds) == {"anyio", "numpy", "typing-extensions", "h11"}
    with pytest.raises(FileNotFoundError, match="--kinds"):
        image_distributions(tmp_path / "absent.md")
    kinds.write_text("# nothing\n")
    with pytest.raises(ValueError, match="Packages"):
        image_distributions(kinds)


def test_missing_distributions_walk_the_venv_and_stop_at_the_image(tmp_path):
    kinds = tmp_path / "KINDS.md"
    kinds.write_text(KINDS)
    pyproject = tmp_path / "pyproject.toml"
    deps = ["fastapi>=0.1", "uvicorn[standard]", "numpy", "hnswlib", "oldthing; python_version < '3.11'"]
    pyproject.write_text("[project]\nname = 'x'\ndependencies = " + json.dumps(deps) + "\n")
    venv = {
        "fastapi": FakeDistribution("0.165.0", ["starlette>=1", "anyio", "httpx2; extra == 'standard'"]),
        "starlette": FakeDistribution("1.10.0", ["anyio", "typing-extensions; python_version < '3.13'"]),
        "uvicorn": FakeDistribution(
            "0.54.0", ["h11", "httptools; extra == 'standard'", "watch; sys_platform == 'win32'"]
        ),
        "httptools": FakeDistribution("0.9.0", None),
        "hnswlib": FakeDistribution("0.8.0", ["numpy"]),
        # in the image: its own requirements are never looked at
        "numpy": FakeDistribution("2.4.6", ["not-installed-here"]),
    }

    def distribution(name):
        if canonicalize_name(name) not in venv:
            raise importlib.metadata.PackageNotFoundError(name)
        return venv[canonicalize_name(name)]

    missing = missing_distributions(pyproject, kinds, "3.12", distribution)
    assert missing == [
        ("fastapi", "0.165.0"),
        ("hnswlib", "0.8.0"),
        ("httptools", "0.9.0"),
        ("starlette", "1.10.0"),
        ("uvicorn", "0.54.0"),
    ]
    del venv["httptools"]
    with pytest.raises(LookupError, match="httptools"):
        missing_distributions(pyproject, kinds, "3.12", distribution)


def test_local_wheels_are_matched_by_name_version_and_tags(tmp_path):
    folder = tmp_path / "whl"
    folder.mkdir()
    for name in (
        "fastapi-0.165.0-py3-none-any.whl",
        "faiss_cpu-1.15.1-cp310-abi3-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl",
        "orjson-3.13.0-cp312-cp312-manylinux_2_17_x86_64.manylinux2014_x86_64.whl",
        "hnswlib-0.8.0.tar.gz",
        "httpx2-2.16.2-py3-none-any.whl",
    ):
        (folder / name).write_bytes(b"")
    tags = target_tags("3.12", PayloadParams().platforms)
    missing = [("faiss-cpu", "1.15.1"), ("fastapi", "0.165.0"), ("hnswlib", "0.8.0"), ("orjson", "3.13.0")]
    files, unused = local_distributions(missing, [folder], tags)
    assert [path.name.split("-")[0] for path in files] == ["faiss_cpu", "fastapi", "hnswlib", "orjson"]
    assert unused == ["httpx2-2.16.2-py3-none-any.whl"] and "hnswlib" in SDIST_ONLY

    (folder / "orjson-3.13.0-cp312-cp312-manylinux_2_17_x86_64.manylinux2014_x86_64.whl").unlink()
    (folder / "orjson-3.13.0-cp311-cp311-manylinux_2_17_x86_64.whl").write_bytes(b"")
    (folder / "fastapi-0.164.0-py3-none-any.whl").write_bytes(b"")
    with pytest.raises(LookupError) as raised:
        local_distributions([*missing, ("uvicorn", "0.54.0")], [folder], tags)
    text = str(raised.value)
    assert "cp311" in text and "fastapi-0.164.0" in text and "uvicorn 0.54.0: no file" in text


def test_main_says_what_is_missing_before_any_long_step(tmp_path, capsys):
    code = main(["--out", str(tmp_path / "out"), "--kinds", str(tmp_path / "absent.md")])
    assert code == 2 and "absent.md" in capsys.readouterr().err
    assert main(["--out", str(tmp_path / "out"), "--call-mb", "0.1"]) == 2


def test_help_starts_with_usage(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0 and capsys.readouterr().out.startswith("usage:")


def test_payload_params_count_megabytes_as_powers_of_ten():
    assert PayloadParams().call_bytes == 58_000_000 and PayloadParams(call_mb=1).call_bytes == 1_000_000
    assert "manylinux_2_28_x86_64" in PayloadParams().platforms and "manylinux1_x86_64" in PayloadParams().platforms


def test_the_probe_imports_onnxruntime_before_the_compiled_hnswlib():
    # the H200 image segfaulted in onnxruntime's init when the hnswlib compiled there came first
    modules = re.search(r"for module in \((.*?)\):", probe_script()).group(1)
    assert modules.index("'onnxruntime'") < modules.index("'hnswlib'")


def test_the_output_folder_counts_as_ignored_before_it_exists(tmp_path):
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / ".git" / "info").mkdir(exist_ok=True)
    (tmp_path / ".git" / "info" / "exclude").write_text("/.gpu/\n")
    assert not (tmp_path / ".gpu").exists()
    assert repo_folder(tmp_path / ".gpu", root=tmp_path) == ".gpu"
    with pytest.raises(ValueError, match="not ignored by git"):
        repo_folder(tmp_path / "carried", root=tmp_path)
