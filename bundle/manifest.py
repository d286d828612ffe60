"""The bundle contract: file names and ``manifest.json`` schema, defined once.

``export/`` writes bundles with these models; ``service/`` reads them. A bundle is an
immutable directory::

    manifest.json    this schema
    encoder.onnx     input_ids, attention_mask [batch, seq] int64 -> embedding [batch, dim] float32
    tokenizer.json   HF tokenizers file (truncation set, padding to the batch's longest)
    labels.jsonl     one {"uid", "text"} per line; line number = label id; or, ``labels_format``
    label-*.npy      arrays, the uids and texts as memory-mapped UTF-8 bytes + offsets and a
                     sorted uid hash array for uid → id (bundle.labels)
    index.hnsw       hnswlib index over the keys (labels, or instances + labels for RAE)
    index.faiss      instead of index.hnsw in a compressed bundle (``ann`` ivfpq): a faiss IVF
    rerank.npy       index of 4-bit PQ fast-scan codes, and the keys as float16 (keys x dim), from
                     which the nearest candidates are re-ranked exactly (engine.index.ivfpq);
                     a sharded one has ``index-<i>.faiss`` and ``rerank-<i>.npy`` per shard
    values.npz       RAE only: CSR value matrix V = [λ·Y_trn ; (1−λ)·I_L], (memory rows x labels)
    index-<i>.hnsw   a sharded bundle (``shards`` in the manifest) instead of the two above: one
    values-<i>.npz   index per contiguous range of key ids (the global ids are the HNSW labels)
                     and, for RAE, the value rows of those keys
    fusion.onnx      optional (``fusion`` in the manifest): the score-fusion model of an RAE
                     memory (engine.fusion), an ai.onnx.ml TreeEnsemble over φ
                     (float [batch, features] -> [batch, 1]) run by ONNX Runtime
    fusion.npz       with it: the label frequencies and, for a lexical fusion, the idf of its term
                     space (engine.lexical); a bundle exported before fusion.onnx holds
                     its single regression tree here as arrays
    lexical.npz      a lexical fusion's unit term vectors of the keys, key id order (CSR, keys x
    lexical-<i>.npz  terms); a sharded bundle has one file per shard, its keys' rows
    sparse.npz       optional (``fusion.sparse``): a sparse linear ranker over the lexical fusion's
                     term space, the weights (CSR, terms x labels) and one bias per label
                     (engine.sparse), a second source of the fusion's candidates
    head.npz/.json   the linear head inside encoder.onnx (xmc.checkpoint format); not read
                     by the service, there for torch tools that rebuild the same vectors
"""

from __future__ import annotations

import hashlib
from datetime import datetime, timezone
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from bundle.card import CARD_FILES

# 2: the search breadth per index kind (hnsw.ef_search; ivfpq.rerank_depth, which version 1 read
# from hnsw.ef_search). A version 1 manifest is read as version 2 (Manifest._upgrade).
SCHEMA_VERSION = 2

MANIFEST_FILE = "manifest.json"
ENCODER_FILE = "encoder.onnx"
TOKENIZER_FILE = "tokenizer.json"
LABELS_FILE = "labels.jsonl"
# labels_format arrays, instead of labels.jsonl: uid bytes, uid offsets, text bytes, text offsets,
# sorted uid hashes, the label id of each sorted hash (bundle.labels)
LABEL_ARRAY_FILES = (
    "label-uids.npy",
    "label-uid-offsets.npy",
    "label-texts.npy",
    "label-text-offsets.npy",
    "label-uid-hashes.npy",
    "label-uid-order.npy",
)
INDEX_FILE = "index.hnsw"
IVF_INDEX_FILE = "index.faiss"
RERANK_FILE = "rerank.npy"
VALUES_FILE = "values.npz"
FUSION_FILE = "fusion.npz"
FUSION_MODEL_FILE = "fusion.onnx"
LEXICAL_FILE = "lexical.npz"
SPARSE_FILE = "sparse.npz"

IndexKind = Literal["labels", "rae_memory"]
# how the labels are stored: labels.jsonl, read into arrays at load; or those arrays themselves,
# memory-mapped (LABEL_ARRAY_FILES): no parsing at start, no Python object per label
LabelsFormat = Literal["jsonl", "arrays"]
# how the keys are searched: an hnswlib graph over float32 vectors, or compressed (faiss IVF-PQ
# fast-scan codes, the candidates re-ranked exactly from float16 vectors)
AnnKind = Literal["hnswlib", "ivfpq"]
RaeMode = Literal["joint", "split"]
# the score fusion's model: one regression tree (NGAME App. C), gradient-boosted regression trees,
# or LambdaMART (gradient-boosted trees with a ranking objective, each query a group)
FusionModelKind = Literal["tree", "gbdt", "lambdarank"]
# how a sparse ranker's weights were fitted: one-vs-rest logistic regression over every
# (text, label) pair, or each label's centroid of its texts (PIFA; export.sparse_fit)
SparseFitKind = Literal["one_vs_rest", "centroid"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SourceInfo(_Strict):
    """Where the bundle came from."""

    encoder: str = Field(description="encoder name or checkpoint path")
    architecture: str = Field(description="HF model_type, e.g. bert or distilbert")
    head: str = Field(description="how the serving head was made: pca | unidec | unidec[<blocks>] | trained")
    training_run: str | None = None
    git_sha: str | None = None
    data: str | None = Field(None, description="dataset the memory / labels came from")


class TokenizerInfo(_Strict):
    max_length: int = Field(gt=0)
    lowercase: bool


class HnswParams(_Strict):
    space: Literal["ip", "cosine", "l2"] = "ip"
    M: int = Field(gt=1)
    ef_construction: int = Field(gt=0)
    ef_search: int = Field(gt=0, description="default ef at query time (an hnswlib index's search breadth)")


class IvfPqParams(_Strict):
    """A compressed index (``ann`` ivfpq): faiss IVF over 4-bit PQ fast-scan codes; a query scans
    ``nprobe`` of ``nlist`` cells and re-ranks its best ``max(ef, fetched)`` candidates by the exact
    inner product with their float16 vectors (``rerank_depth`` is that default depth: the search
    breadth of this kind)."""

    nlist: int = Field(ge=1, description="coarse cells (k-means centroids)")
    pq_m: int = Field(ge=1, description="PQ sub-quantizers of 4 bits each: pq_m / 2 bytes of code per key")
    nprobe: int = Field(ge=1, description="cells scanned per query")
    rerank_depth: int = Field(ge=1, description="default candidates re-ranked per query (its search breadth)")
    rerank: Literal["float16"] = Field("float16", description="the stored vectors the candidates are re-ranked by")

    @model_validator(mode="after")
    def _fast_scan_layout(self) -> IvfPqParams:
        if self.pq_m % 2:
            raise ValueError(f"pq_m {self.pq_m}: 4-bit fast-scan codes pack two sub-quantizers a byte (even pq_m)")
        return self


class RaeParams(_Strict):
    """RAE-XMC inference: score = softmax(top-b similarities / τ) · V, V = [λY ; (1−λ)I]."""

    lam: float = Field(ge=0.0, le=1.0, description="λ: weight of the training-instance memory")
    tau: float = Field(gt=0.0, description="τ: softmax temperature")
    top_b: int = Field(gt=0, description="b: number of keys retrieved per query")
    mode: RaeMode = Field(
        "joint",
        description="joint: one softmax over all top-b keys (RAE-XMC eq. 7); split: one over the instance "
        "keys and one over the label keys, so λ is exactly the instance memory's share",
    )


class SparseRankerParams(_Strict):
    """A sparse linear ranker (engine.sparse): margin_l(q) = Σ_t q_t W[t, l] + v(q)·D[l] + b_l
    over the unit idf-weighted term vector q of the lexical fusion's term space (and, with
    ``dense_dim``, the query's dense vector v(q)); each query's top ``depth``
    labels by margin join the candidates the fusion rescores, and every candidate's margin and
    rank are features of φ."""

    file: str = Field(SPARSE_FILE, description="W (CSR, terms x labels, float32) and b (labels) as one npz")
    depth: int = Field(ge=1, description="labels each query's margins add to the candidates")
    labels: int = Field(ge=1, description="labels the weights cover (label ids 0 .. labels - 1; later ones have none)")
    fit: SparseFitKind = Field(description="how W and b were fitted: one_vs_rest | centroid")
    fit_params: dict = Field(default_factory=dict, description="the fit's parameters, as given")
    fitted_on: str = Field(description="the texts the weights were fitted on (never the dev or test split)")
    dense_dim: int = Field(
        0,
        ge=0,
        le=4096,
        description="the query vector's dimension the dense weights D (labels x dense_dim, the npz's 'dense') read: "
        "margin_l(q) gains v(q)·D[l]; 0: no dense weights",
    )
    dense_choice: dict[str, float] = Field(
        default_factory=dict,
        description="the held-out instances' cross-fitted validation (mean of P@1 and P@5, best size) of each "
        "dense weight tried, the best fitted; empty: none was chosen",
    )


class LabelKeysParams(_Strict):
    """The label index as a candidate source (engine.fusion): the memory is searched
    ``fetch`` keys deeper than its RAE top b, and each query's nearest ``depth`` label keys among
    them join the candidates the fusion rescores, their similarity and rank features of φ."""

    depth: int = Field(ge=1, description="label keys each query adds to the candidates")
    fetch: int = Field(ge=0, description="keys searched beyond the RAE top b for them")


class FusionSizeChoice(_Strict):
    """How the fusion's ensemble size was chosen (export.fusion_validation.choose_size): each size
    cross-validated on the held-out instances it was fitted on, the best fitted on them all."""

    folds: int = Field(ge=2, description="folds of the held-out instances, each ranked by a model fitted on the others")
    selection: str = Field(description="what the choice maximised")
    validation: dict[str, dict[str, dict[str, float]]] = Field(
        description="each size (TREESxLEAVES) -> protocol (filter_after, exclude_before) -> metric"
    )
    chosen: str = Field(description="the size fitted (TREESxLEAVES)")


class FusionParams(_Strict):
    """Score fusion of an RAE memory (engine.fusion): fused = p̂ + T(φ)."""

    file: str = Field(FUSION_FILE, description="the label frequencies (and a lexical fusion's idf)")
    model: str = Field(description="T as an ai.onnx.ml TreeEnsemble ONNX model, its checksum in files")
    kind: FusionModelKind = Field("tree", description="what T is: tree | gbdt | lambdarank")
    model_params: dict = Field(default_factory=dict, description="T's fitting parameters, as given")
    parity_max_abs: float | None = Field(
        None, ge=0.0, description="max |ONNX Runtime − fitting library| of T over the fit's pairs, checked at export"
    )
    features: list[str] = Field(description="φ's columns, in the order T reads them")
    depth: int | None = Field(None, ge=0, description="the single tree's depth (0: a single leaf); None: an ensemble")
    rerank_depth: int | None = Field(
        None,
        ge=1,
        description="T rescores each query's top max(rerank_depth, k) candidates by p̂ and only those are "
        "returned (a two-stage ranking); None: every candidate the keys vote for",
    )
    fitted_on: str = Field(description="the queries the tree was fitted on (never the dev or test split)")
    queries: int = Field(gt=0)
    pairs: int = Field(gt=0, description="(query, candidate label) pairs in the fit")
    lexical: list[str] | None = Field(
        None,
        description="the keys' term vector files of a fusion with lexical features, one per shard in shard "
        "order (one for an unsharded bundle); None: no lexical features",
    )
    sparse: SparseRankerParams | None = Field(
        None, description="a sparse linear ranker over the lexical term space, a second candidate source; None: none"
    )
    label_keys: LabelKeysParams | None = Field(
        None, description="the nearest label keys of a deeper search, a third candidate source; None: none"
    )
    size_choice: FusionSizeChoice | None = Field(
        None, description="how the ensemble's size was chosen on the held-out instances; None: as given"
    )

    @model_validator(mode="before")
    @classmethod
    def _an_onnx_model(cls, data):
        # the first fused bundles (2026-11-24) kept a single tree as arrays in fusion.npz and no model
        if isinstance(data, dict) and not data.get("model"):
            raise ValueError(
                "this fusion has no ONNX model (fusion.model): it was exported before the fusion was served as "
                "ONNX; re-fuse its source bundle: python -m export.fuse --bundle <source> --run <run> "
                "--data <dataset> --out <new bundle>"
            )
        return data


class Shard(_Strict):
    """One contiguous range of key ids, ``first_key`` .. ``first_key + keys − 1``."""

    index: str = Field(
        description="its HNSW file (or faiss IVF-PQ file, ``ann`` ivfpq); the elements' labels are the global key ids"
    )
    rerank: str | None = Field(None, description="ivfpq only: its keys' float16 vectors, (keys x dim)")
    values: str | None = Field(None, description="RAE only: its rows of V, (keys x labels)")
    first_key: int = Field(ge=0)
    keys: int = Field(ge=1)


class Counts(_Strict):
    labels: int = Field(ge=1)
    memory_rows: int = Field(ge=1, description="keys in the index (labels, or instances + labels)")
    train_instances: int = Field(0, ge=0, description="instance keys in an RAE memory")


class Lineage(_Strict):
    """Where the memory of a bundle made from another goes on (compacted, reindexed, derived): the
    append log of its lineage (the log of the bundle first built, ``bundle_id``), of which the
    bundle holds the first ``offset`` bytes (folded in by a compaction; 0: made from the lineage's
    first bundle). Every bundle of a lineage reads and writes that one log, so they all hold its
    appends in one order, with the same label ids (see docs/operations.md, "Lineage model")."""

    bundle_id: str = Field(description="the lineage's first bundle: its log is named from this id")
    log: str = Field(
        description="the log's path relative to this bundle's append log directory (in it, or in a "
        "<name>.appends directory beside it)"
    )
    offset: int = Field(ge=0, description="bytes of the log folded into this bundle (0: none)")
    sha256: str = Field(description="sha256 of those bytes: a log altered since is refused")
    seen: int | None = Field(
        None,
        ge=0,
        description="bytes of complete records the log held when this bundle was made from its source "
        "(reindexed, derived, fused): a log with fewer is not its lineage's (the bundle is refused); "
        "None: not recorded (a compaction's)",
    )


class Manifest(_Strict):
    schema_version: int = SCHEMA_VERSION
    bundle_id: str
    created_at: str
    source: SourceInfo
    tokenizer: TokenizerInfo
    dim: int = Field(gt=0)
    index_kind: IndexKind
    labels_format: LabelsFormat = Field("jsonl", description="labels.jsonl, or memory-mapped label arrays")
    ann: AnnKind = Field("hnswlib", description="how the keys are searched: hnswlib | ivfpq (compressed)")
    hnsw: HnswParams = Field(description="hnswlib's parameters (an ivfpq bundle does not search by them)")
    ivfpq: IvfPqParams | None = Field(None, description="the compressed index's parameters (``ann`` ivfpq)")
    rae: RaeParams | None = None
    counts: Counts
    shards: list[Shard] | None = Field(None, description="a sharded index; None: index.hnsw (+ values.npz)")
    fusion: FusionParams | None = Field(None, description="RAE score fusion; None: rank by p̂")
    params: dict = Field(default_factory=dict, description="export parameters as given")
    lineage: Lineage | None = Field(
        None, description="a compacted, reindexed or derived bundle's lineage log; None: its own"
    )
    append_ids: dict[str, tuple[int, str]] = Field(
        default_factory=dict,
        description="a compacted bundle: the append_ids folded in, id -> (memory version, content "
        "fingerprint), so that a client's retry after the switch is recognised, not applied again",
    )
    files: dict[str, str] = Field(description="file name -> sha256 hex digest")

    @model_validator(mode="before")
    @classmethod
    def _upgrade(cls, data):
        """A version 1 manifest (as written until the search breadth was named per index kind) in
        the current form: an ivfpq bundle's re-rank depth was ``hnsw.ef_search``. Only the
        manifest read changes; the bundle's files, checksums and id are as they were."""
        if isinstance(data, dict) and data.get("schema_version") == 1:
            data = {**data, "schema_version": SCHEMA_VERSION}
            hnsw, ivfpq = data.get("hnsw"), data.get("ivfpq")
            if isinstance(ivfpq, dict) and isinstance(hnsw, dict) and "rerank_depth" not in ivfpq:
                data["ivfpq"] = {**ivfpq, "rerank_depth": hnsw.get("ef_search")}
        return data

    @property
    def served_files(self) -> dict[str, str]:
        """``files`` less the card (card.json, README.md): the files that make what the bundle
        serves, and its id. The card describes them and may be rewritten (figures recorded)."""
        return {name: digest for name, digest in self.files.items() if name not in CARD_FILES}

    @property
    def search_breadth(self) -> int:
        """The default breadth of a search of this bundle's index: hnswlib's ef, or the compressed
        index's re-rank depth."""
        return self.ivfpq.rerank_depth if self.ivfpq is not None else self.hnsw.ef_search

    @model_validator(mode="after")
    def _label_index_keys_are_labels(self) -> Manifest:
        # key id = label id in a label index: any other count would shift every answer's ids
        if self.index_kind == "labels" and (self.counts.memory_rows, self.counts.train_instances) != (
            self.counts.labels,
            0,
        ):
            raise ValueError("a label index has one key per label and no instance keys")
        return self

    @model_validator(mode="after")
    def _fusion_fuses_an_rae_memory(self) -> Manifest:
        if self.fusion is not None and self.index_kind != "rae_memory":
            raise ValueError("score fusion reranks an rae_memory bundle's labels, and only those")
        if self.fusion is not None and self.fusion.lexical is not None:
            if len(self.fusion.lexical) != len(self.shards or [None]):
                raise ValueError("a lexical fusion has one key term file per shard")
            if len(set(self.fusion.lexical)) != len(self.fusion.lexical):
                raise ValueError("two shards name the same key term file")
        if self.fusion is not None and self.fusion.sparse is not None:
            if self.fusion.lexical is None:
                raise ValueError("a sparse ranker reads the lexical fusion's term space: it needs lexical features")
            if self.fusion.sparse.labels > self.counts.labels:
                covered = self.fusion.sparse.labels
                raise ValueError(f"the sparse ranker covers {covered} labels, the bundle has {self.counts.labels}")
        return self

    @model_validator(mode="after")
    def _compressed_index_has_its_parameters(self) -> Manifest:
        if (self.ivfpq is not None) != (self.ann == "ivfpq"):
            raise ValueError("ivfpq parameters go with an ivfpq index (ann), and only with one")
        if self.ivfpq is not None and self.dim % self.ivfpq.pq_m:
            raise ValueError(f"pq_m {self.ivfpq.pq_m} does not divide the dimension {self.dim}")
        return self

    @model_validator(mode="after")
    def _shards_cover_the_keys(self) -> Manifest:
        next_key = 0
        for i, shard in enumerate(self.shards or []):
            if shard.first_key != next_key:
                raise ValueError(f"shard {i} starts at key {shard.first_key}, not {next_key} (ranges are contiguous)")
            if (shard.values is not None) != (self.index_kind == "rae_memory"):
                raise ValueError(f"shard {i}: value rows go with an rae_memory bundle, and only with one")
            if (shard.rerank is not None) != (self.ann == "ivfpq"):
                raise ValueError(f"shard {i}: re-rank vectors go with an ivfpq index, and only with one")
            next_key += shard.keys
        names = [name for shard in self.shards or [] for name in (shard.index, shard.values, shard.rerank) if name]
        if len(names) != len(set(names)):
            raise ValueError("two shards name the same file")
        if self.shards and next_key != self.counts.memory_rows:
            raise ValueError(f"the shards hold {next_key} keys, counts.memory_rows says {self.counts.memory_rows}")
        return self


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def bundle_id_from(files: dict[str, str], prefix: str) -> str:
    """A content-derived id: the same files give the same id."""
    joined = "".join(f"{name}:{digest}" for name, digest in sorted(files.items()))
    return f"{prefix}-{hashlib.sha256(joined.encode()).hexdigest()[:12]}"


def content_id(manifest: Manifest) -> str:
    """The bundle id that ``manifest``'s files, RAE parameters and lineage give, e.g.
    ``labels-64d-<12 hex>``: what the export writer names a bundle, and what a loader checks the
    claimed id against. The lineage is part of it because it is part of what the bundle serves: two
    compactions with the same files but different folded log prefixes are different bundles."""
    rae = {"rae": manifest.rae.model_dump_json()} if manifest.rae else {}
    # the card describes what the bundle serves and does not change it: measuring a bundle and
    # recording the figures in its card keeps its id (bundle/card.py)
    served = manifest.served_files
    # exclude_none: a field added to Lineage later (``seen``) leaves the ids of bundles without it as they were
    lineage = {"lineage": manifest.lineage.model_dump_json(exclude_none=True)} if manifest.lineage else {}
    return bundle_id_from(served | rae | lineage, prefix=f"{manifest.index_kind.replace('_', '-')}-{manifest.dim}d")


def utc_now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def shard_list(manifest: Manifest) -> list[Shard]:
    """The bundle's shards; an unsharded bundle is one shard over every key."""
    if manifest.shards:
        return list(manifest.shards)
    values = VALUES_FILE if manifest.index_kind == "rae_memory" else None
    index, rerank = shard_file_names(manifest.ann, 1, 0)
    return [Shard(index=index, values=values, rerank=rerank, first_key=0, keys=manifest.counts.memory_rows)]


def required_files(manifest: Manifest) -> list[str]:
    files = [ENCODER_FILE, TOKENIZER_FILE, *label_files(manifest.labels_format)]
    for shard in shard_list(manifest):
        files += [name for name in (shard.index, shard.values, shard.rerank) if name]
    if manifest.fusion is not None:
        fusion = manifest.fusion
        files += [fusion.file, *([fusion.model] if fusion.model else []), *(fusion.lexical or [])]
        files += [fusion.sparse.file] if fusion.sparse is not None else []
    return files


def label_files(labels_format: LabelsFormat) -> list[str]:
    """The files that hold a bundle's labels."""
    return [LABELS_FILE] if labels_format == "jsonl" else list(LABEL_ARRAY_FILES)


def shard_file_names(ann: AnnKind, shards: int, i: int) -> tuple[str, str | None]:
    """Shard ``i``'s index file and (ivfpq) re-rank vector file, in a bundle of ``shards`` shards."""
    if ann == "ivfpq":
        return (IVF_INDEX_FILE, RERANK_FILE) if shards == 1 else (f"index-{i}.faiss", f"rerank-{i}.npy")
    return (INDEX_FILE, None) if shards == 1 else (f"index-{i}.hnsw", None)


def lexical_file_names(shards: int) -> list[str]:
    """The key term files of a lexical fusion: ``lexical.npz``, or ``lexical-<i>.npz`` per shard."""
    return [LEXICAL_FILE] if shards == 1 else [f"lexical-{i}.npz" for i in range(shards)]
