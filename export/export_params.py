"""Export parameters: one dataclass with documented defaults, and the CLI options derived from it.

Each attribute of :class:`ExportParams` is a ``--kebab-case`` option of ``python -m export.build``:
its help is the attribute's entry in the docstring, its ``choices`` come from the attribute's
``Literal`` type, so neither is written twice.
"""

from __future__ import annotations

import argparse
import functools
import inspect
import re
from dataclasses import asdict, dataclass, fields
from typing import Literal, get_args, get_origin, get_type_hints

from bundle import AnnKind, HnswParams, IndexKind, IvfPqParams, LabelsFormat, RaeMode, RaeParams
from xmc.options import parse_bool

Quantize = Literal["none", "int8", "int8-static"]
EncodeDevice = Literal["auto", "cpu", "cuda"]
ALL_HEAD_BLOCKS = "all"
# The ExportParams attribute of each field of the manifest's RaeParams.
RAE_ATTRIBUTES = {"lam": "rae_lambda", "tau": "rae_tau", "top_b": "rae_top_b", "mode": "rae_mode"}

__all__ = [
    "ALL_HEAD_BLOCKS",
    "RAE_ATTRIBUTES",
    "AnnKind",
    "ExportParams",
    "IndexKind",
    "Quantize",
    "RaeMode",
    "add_arguments",
    "from_arguments",
]


@dataclass
class ExportParams:
    """Export parameters; the defaults build the default serving bundle.

    Attributes:
        index_kind: ``rae_memory``: training instances and labels as keys, RAE aggregation;
            ``labels``: label vectors only, pure dual-encoder retrieval (default: rae_memory)
        dim: serving dimension of the PCA head, ignored when the checkpoint has a trained head (default: 64)
        max_length: tokenizer truncation, in tokens; Debian titles average ~21 (default: 128)
        labels_format: ``jsonl``: labels.jsonl, parsed at every load; ``arrays``: the uids and
            texts as memory-mapped arrays with a sorted uid hash array, which a server opens
            without parsing or a Python object per label (10^6 labels and more) (default: jsonl)
        index: how the keys are searched: ``hnswlib``, a graph over float32 vectors, best for small
            label sets; ``ivfpq``, compressed: faiss IVF with 4-bit PQ fast-scan codes whose
            candidates are re-ranked exactly from float16 vectors, about a third of hnswlib's
            bytes a key and minutes to build at 10^7 keys (bench/results/ann-compressed.json)
            (default: hnswlib)
        ivf_nlist: ivfpq cells; 0 = the power of two at or below min(4·sqrt(keys), keys / 39) (default: 0)
        ivf_nprobe: ivfpq cells scanned per query; 0 = 256 for an RAE memory (a query's b keys
            reach into more cells than a top 10: on the trained Debian-Related memory 128 cost 0.46
            P@1 against hnswlib, 256 0.05), 128 for a label index (default: 0)
        pq_m: ivfpq PQ sub-quantizers of 4 bits, an even divisor of dim: pq_m / 2 bytes of code a key;
            0 = dim, one a dimension: at 10^7 clustered keys its candidates reach recall@10 0.99
            after the re-rank where dim / 2 stops near 0.976 (bench/results/ten-million.json) (default: 0)
        hnsw_m: HNSW graph degree M (default: 32)
        ef_construction: HNSW build breadth (default: 200)
        ef_search: default search breadth stored in the manifest: hnswlib's ``hnsw.ef_search``,
            for ivfpq ``ivfpq.rerank_depth`` (the candidates re-ranked); RAE-XMC uses 300 (default: 300)
        rae_lambda: λ in V = [λY ; (1−λ)I], RAE-XMC §3.3; 0.5 in the paper (default: 0.5)
        rae_tau: softmax temperature τ; 0.04 in the paper for unit vectors (default: 0.04)
        rae_top_b: keys retrieved per query, b; 200 in the paper (default: 200)
        rae_mode: ``joint``: one softmax over all top-b keys, the paper; ``split``: instance and
            label keys normalised separately, see engine/rae.py (default: joint)
        batch_size: least texts per encoding block; each block is length-sorted and chunked (default: 128)
        encode_device: where the memory and label texts are encoded: ``auto`` = torch on CUDA when
            a GPU is present (fp16 autocast), else the fused ONNX graph on every CPU core; ``cpu``;
            ``cuda`` (fails without a GPU) (default: auto)
        gpu_batch_size: texts per length-sorted torch batch on a GPU (default: 512)
        encode_parity_tolerance: largest allowed max |GPU − ONNX on CPU| of the pooled vectors on a
            sample; fp16 differs in the third decimal (default: 0.05)
        optimize: fuse the served graph with onnxruntime's transformer optimizer (BERT-class
            encoders); the parity check runs on the fused graph (default: true)
        quantize: ``none``; ``int8``: dynamic int8 MatMuls (activation scales computed per call, so
            the service runs such a graph one text per session call, which keeps a text's vector
            independent of its batch); or ``int8-static``: int8 MatMuls with activation scales
            fitted on calibration_texts of the memory and label texts, constants of the graph, so
            texts batch freely. Lossy either way: the parity check then runs on the float graph,
            and the int8 graph's smallest cosine to it on the parity texts is recorded and must
            reach int8_min_cosine (default: none)
        int8_min_cosine: refuse an int8 graph whose outputs drift further than this (default: 0.85)
        calibration_texts: memory and label texts the ``int8-static`` scales are fitted on (default: 512)
        parity_texts: random texts in the ONNX-vs-torch parity check (default: 64)
        parity_tolerance: largest allowed max |onnx − torch| (default: 0.0001)
        max_train: use only the first N training instances as memory; 0 = all (default: 0)
        head_blocks: ``all``, or a comma list of the trained head's block names to serve:
            ``g1_de`` = the DE half only, ``g2_clf`` = the classifier half only (default: all)
        shards: split the index keys into this many contiguous ranges, each with its own HNSW
            file (and value rows for an RAE memory); the service searches each and merges exactly
            (default: 1)
        build_threads: HNSW insertion threads; 1 makes the index, and so the bundle id,
            reproducible from the same inputs; 0 uses every core: faster, order-dependent graph (default: 1)
        seed: seed for the random parity texts and HNSW construction (default: 0)
    """

    index_kind: IndexKind = "rae_memory"
    dim: int = 64
    max_length: int = 128
    labels_format: LabelsFormat = "jsonl"
    index: AnnKind = "hnswlib"
    ivf_nlist: int = 0
    ivf_nprobe: int = 0
    pq_m: int = 0
    hnsw_m: int = 32
    ef_construction: int = 200
    ef_search: int = 300
    rae_lambda: float = 0.5
    rae_tau: float = 0.04
    rae_top_b: int = 200
    rae_mode: RaeMode = "joint"
    batch_size: int = 128
    encode_device: EncodeDevice = "auto"
    gpu_batch_size: int = 512
    encode_parity_tolerance: float = 0.05
    optimize: bool = True
    quantize: Quantize = "none"
    int8_min_cosine: float = 0.85
    calibration_texts: int = 512
    parity_texts: int = 64
    parity_tolerance: float = 1e-4
    max_train: int = 0
    head_blocks: str = ALL_HEAD_BLOCKS
    shards: int = 1
    build_threads: int = 1
    seed: int = 0

    def __post_init__(self) -> None:
        # Checked here, not deep inside the build, so a typo fails before minutes of encoding.
        for name, allowed in choices().items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"unknown {name} {getattr(self, name)!r} ({', '.join(allowed)})")
        if self.shards < 1:
            raise ValueError(f"shards must be at least 1, not {self.shards}")
        if self.index == "ivfpq":
            pq_m = self.ivfpq(1).pq_m  # its parameters checked now: pq_m even and a divisor of dim, nprobe ≥ 1
            if self.dim % pq_m:
                raise ValueError(f"pq_m {pq_m} does not divide dim {self.dim}")

    def hnsw(self) -> HnswParams:
        """The HNSW graph's parameters as the manifest records them (and the graph is built with)."""
        return HnswParams(space="ip", M=self.hnsw_m, ef_construction=self.ef_construction, ef_search=self.ef_search)

    def ivfpq(self, keys: int) -> IvfPqParams:
        """The compressed index's parameters as the manifest records them, for an index of ``keys`` keys."""
        from engine.offline import auto_nlist

        pq_m = self.pq_m or self.dim
        nprobe = self.ivf_nprobe or (256 if self.index_kind == "rae_memory" else 128)
        return IvfPqParams(
            nlist=self.ivf_nlist or auto_nlist(keys), pq_m=pq_m, nprobe=nprobe, rerank_depth=self.ef_search
        )

    def rae(self) -> RaeParams:
        """The RAE parameters as the manifest records them."""
        return RaeParams(**{field: getattr(self, attribute) for field, attribute in RAE_ATTRIBUTES.items()})

    def head_block_names(self) -> list[str] | None:
        """The trained head's blocks to serve; ``None`` serves all of them."""
        if self.head_blocks == ALL_HEAD_BLOCKS:
            return None
        return [name.strip() for name in self.head_blocks.split(",")]


@functools.cache
def choices() -> dict[str, tuple[str, ...]]:
    """The allowed values of every ``Literal``-typed parameter, by name."""
    hints = get_type_hints(ExportParams)
    return {f.name: get_args(hints[f.name]) for f in fields(ExportParams) if get_origin(hints[f.name]) is Literal}


def attribute_docs(cls: type) -> dict[str, str]:
    """``{attribute: description}`` from the ``Attributes:`` section of ``cls``'s docstring: one
    ``name: text`` entry per attribute, its continuation lines indented deeper."""
    lines = inspect.cleandoc(cls.__doc__ or "").splitlines()
    docs: dict[str, str] = {}
    name = None
    for line in lines[lines.index("Attributes:") + 1 :] if "Attributes:" in lines else []:
        entry = re.fullmatch(r" {4}(\w+): (.+)", line)
        if entry:
            name = entry[1]
            docs[name] = entry[2]
        elif name and line.startswith(" " * 8):
            docs[name] += " " + line.strip()
        else:
            break
    return docs


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One ``--kebab-case`` option per :class:`ExportParams` attribute."""
    defaults = asdict(ExportParams())
    docs = attribute_docs(ExportParams)
    allowed = choices()
    for name, default in defaults.items():
        option = {"default": default, "help": docs[name].replace("``", "")}  # no reST markup in a terminal
        if name in allowed:
            option["choices"] = allowed[name]
        elif isinstance(default, bool):
            # argparse's type=bool would take "false" as true
            option.update(type=parse_bool, metavar="{true,false}")
        else:
            option["type"] = type(default)
        parser.add_argument(f"--{name.replace('_', '-')}", **option)


def from_arguments(args: argparse.Namespace) -> ExportParams:
    """The :class:`ExportParams` of parsed options (see :func:`add_arguments`)."""
    return ExportParams(**{f.name: getattr(args, f.name) for f in fields(ExportParams)})
