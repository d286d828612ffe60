"""Lexical similarity of a query to the memory's keys, a signal the dense vectors blur.

Short XMC texts (package names, product titles) share literal pieces with their labels and with
the training instances that carry them (``tryton-modules-sale`` → ``tryton-modules-stock``), which
is what the TF-IDF peers (Parabel, Bonsai, XR-Linear) rank by. The score fusion
(:mod:`engine.fusion`) reads, for each key a query retrieves, the idf-weighted cosine of
their term sets:

    lex(q, key) = Σ_{t ∈ T(q) ∩ T(key)} idf_t² / (‖idf·T(q)‖ ‖idf·T(key)‖)

A text's terms T are the word pieces of the bundle's own tokenizer (special tokens left out, at
most its ``max_length``) and the pairs of consecutive word pieces, hashed into
:data:`BIGRAM_BUCKETS` ids after the vocabulary: no second tokenizer, the same ids for every
language the tokenizer knows. ``idf_t = log((n + 1) / (df_t + 1))`` over the n keys of the memory
the fusion was fitted on (:class:`Lexicon`, stored in the fusion file).

Each key's unit term vector is computed once, at export (:class:`KeyTerms`, one file per shard,
so a shard of a distributed deployment holds the rows of its own keys and answers the lexical
similarities of the keys it returns, as it returns their value rows); a key appended to a live
memory gets its row from its text when it is added.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import scipy.sparse as sp
from tokenizers import Encoding

from engine.encoder import load_tokenizer
from engine.rae import gather_rows

# Hash buckets of word-piece pairs (term ids vocab_size .. vocab_size + BIGRAM_BUCKETS − 1).
BIGRAM_BUCKETS = 1 << 20
_PAIR_HASH = 1_000_003
# Retrieved keys per batch from which KeyTerms.similarities merges term lists in compiled code. On
# this project's 2-core VM the lookup was 1.35x faster for one query's 200 keys, the merge 1.6x
# faster at 800 keys and 2.8x at 12,800 (64 queries).
MERGE_FROM_KEYS = 400


@dataclass(frozen=True)
class QueryTerms:
    """One text's unit term vector: sorted term ids and their weights."""

    ids: np.ndarray
    weights: np.ndarray


class Lexicon:
    """The term space (the tokenizer's vocabulary + hashed pairs) and its idf weights."""

    def __init__(self, tokenizer_path: Path, max_length: int, idf: np.ndarray):
        self.tokenizer, _ = load_tokenizer(tokenizer_path, max_length)
        self.vocab_size = self.tokenizer.get_vocab_size(with_added_tokens=True)
        if idf.shape != (self.vocab_size + BIGRAM_BUCKETS,) or idf.dtype.kind not in "fiu":
            raise ValueError(f"idf must be {self.vocab_size + BIGRAM_BUCKETS} finite non-negative weights")
        with np.errstate(over="ignore"):  # an overflow to inf is refused just below
            self.idf = idf.astype(np.float32)
        # checked as served (float32): a float64 1e39 is finite as stored and inf here
        if not np.all(np.isfinite(self.idf)) or np.any(self.idf < 0):
            raise ValueError(f"idf must be {self.vocab_size + BIGRAM_BUCKETS} finite non-negative weights")

    @classmethod
    def fit(cls, tokenizer_path: Path, max_length: int, texts: list[str]) -> Lexicon:
        """The idf of ``texts`` (the memory's keys)."""
        tokenizer, _ = load_tokenizer(tokenizer_path, max_length)
        rows = term_rows(tokenizer, texts)
        document_frequency = np.bincount(rows.indices, minlength=rows.shape[1])
        return cls(tokenizer_path, max_length, np.log((len(texts) + 1) / (document_frequency + 1)))

    def rows(self, texts: list[str]) -> sp.csr_matrix:
        """The unit idf-weighted term vectors of ``texts`` (texts x terms, float32; a text with
        no terms has an empty row): :meth:`query_terms` as one matrix."""
        terms = self.query_terms(texts)
        indptr = np.concatenate([[0], np.cumsum([len(t.ids) for t in terms])]).astype(np.int64)
        indices = np.concatenate([t.ids for t in terms]) if terms else np.zeros(0, dtype=np.int64)
        data = np.concatenate([t.weights for t in terms]) if terms else np.zeros(0, dtype=np.float32)
        return sp.csr_matrix((data, indices.astype(np.int32), indptr), shape=(len(texts), len(self.idf)))

    def query_terms(self, texts: list[str]) -> list[QueryTerms]:
        """Each text's unit term vector: its terms' idf, scaled to norm 1 (all 0 when it has none)."""
        return self.terms_of(self.tokenizer.encode_batch(texts))

    def terms_of(self, encodings: list[Encoding]) -> list[QueryTerms]:
        """:meth:`query_terms` of texts already tokenized by this lexicon's tokenizer (the bundle's,
        whose encodings the encoder computed: one tokenization serves the vector and the terms)."""
        out = []
        for ids in encoding_terms(encodings, self.vocab_size):
            weights = self.idf[ids]
            norm = float(np.sqrt(np.dot(weights, weights)))
            out.append(QueryTerms(ids, weights / norm if norm > 0 else np.zeros_like(weights)))
        return out


def term_ids(tokenizer, texts: list[str]) -> list[np.ndarray]:
    """Each text's sorted, distinct term ids: its word pieces (special tokens left out) and its
    hashed pairs of consecutive word pieces."""
    return encoding_terms(tokenizer.encode_batch(texts), tokenizer.get_vocab_size(with_added_tokens=True))


def encoding_terms(encodings: list[Encoding], vocab_size: int) -> list[np.ndarray]:
    """:func:`term_ids` of the texts the tokenizer's ``encodings`` are of."""
    terms = []
    for encoding in encodings:
        ids = np.asarray(encoding.ids, dtype=np.int64)[np.asarray(encoding.special_tokens_mask) == 0]
        pairs = vocab_size + (ids[:-1] * _PAIR_HASH + ids[1:]) % BIGRAM_BUCKETS
        terms.append(np.unique(np.concatenate([ids, pairs])))
    return terms


def term_rows(tokenizer, texts: list[str]) -> sp.csr_matrix:
    """Binary (texts x terms) CSR of :func:`term_ids`, term ids sorted per row."""
    parts = term_ids(tokenizer, texts)
    indptr = np.concatenate([[0], np.cumsum([len(t) for t in parts])]).astype(np.int64)
    indices = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    return sp.csr_matrix(
        (np.ones(len(indices), dtype=np.float32), indices.astype(np.int32), indptr),
        shape=(len(texts), tokenizer.get_vocab_size(with_added_tokens=True) + BIGRAM_BUCKETS),
    )


@dataclass(frozen=True)
class KeyTerms:
    """The unit term vectors of the keys ``first_key`` .. ``first_key + len(rows) − 1`` (a
    bundle's, or one shard's) and of keys appended after them (a live memory's, ``appended``)."""

    rows: sp.csr_matrix
    first_key: int = 0
    appended: sp.csr_matrix | None = None

    def with_appended(self, appended: sp.csr_matrix | None) -> KeyTerms:
        return self if appended is None else KeyTerms(self.rows, self.first_key, appended)

    @property
    def parts(self) -> list[tuple[sp.csr_matrix, int]]:
        """The term rows as :func:`~engine.rae.gather_rows` reads them: (part, its first row)."""
        return [(self.rows, 0)] + ([(self.appended, self.rows.shape[0])] if self.appended is not None else [])

    def similarities(self, queries: list[QueryTerms], keys: np.ndarray) -> np.ndarray:
        """``lex(query i, keys[i, j])`` (``nq x n``, float32; 0 for no key, −1), in one pass over
        the batch: :meth:`merged_products` for a batch of many keys, :meth:`looked_up_products`
        for a few (an idle server's single query), where the merge's per-call overhead is most
        of its cost."""
        out = np.zeros(keys.shape, dtype=np.float32)
        query_of, column = np.nonzero(keys >= 0)
        if not len(query_of) or not any(len(query.ids) for query in queries):
            return out
        products = self.merged_products if len(query_of) >= MERGE_FROM_KEYS else self.looked_up_products
        out[query_of, column] = products(queries, query_of, keys[query_of, column] - self.first_key)
        return out

    def merged_products(self, queries: list[QueryTerms], query_of: np.ndarray, keys: np.ndarray) -> np.ndarray:
        """Key ``keys[j]``'s dot product with query ``query_of[j]``: the keys' rows and, beside
        each, its query's row form two CSR matrices of one shape, whose elementwise product (a
        merge of two sorted term lists per row, in scipy's compiled code) summed by row is the
        dot products."""
        key_rows = self.rows_of(keys)
        query_rows = query_matrix(queries, key_rows.shape[1])[query_of]
        products = key_rows.multiply(query_rows).tocsr()
        # summed in float64 in term order, as the lookup sums: a key's similarity is the same
        # float32 whatever the size of the batch it came in
        owner = np.repeat(np.arange(len(keys)), np.diff(products.indptr))
        return np.bincount(owner, weights=products.data, minlength=len(keys))

    def looked_up_products(self, queries: list[QueryTerms], query_of: np.ndarray, keys: np.ndarray) -> np.ndarray:
        """:meth:`merged_products` by looking every key term up among its query's terms: every
        (query, term) pair is a single id ``i·width + term``, so all queries' terms form one sorted
        array that every key term is searched in at once."""
        terms, weights, counts = gather_rows(self.parts, keys)
        width = self.rows.shape[1]
        query_ids, query_weights = [np.zeros(0, dtype=np.int64)], [np.zeros(0, dtype=np.float32)]
        for i, query in enumerate(queries):
            inside = query.ids < width  # a term outside the keys' term space matches no key
            query_ids.append(query.ids[inside].astype(np.int64) + i * width)
            query_weights.append(query.weights[inside])
        query_ids, query_weights = np.concatenate(query_ids), np.concatenate(query_weights)
        if not len(query_ids) or not len(terms):
            return np.zeros(len(keys), dtype=np.float32)
        owner = np.repeat(np.arange(len(keys)), counts)
        wanted = query_of[owner] * width + terms
        at = np.minimum(np.searchsorted(query_ids, wanted), len(query_ids) - 1)
        products = np.where(query_ids[at] == wanted, weights * query_weights[at], 0.0)
        return np.bincount(owner, weights=products, minlength=len(keys))

    def rows_of(self, keys: np.ndarray) -> sp.csr_matrix:
        """The term rows of ``keys`` (ids from :attr:`first_key`), in that order."""
        held = self.rows.shape[0] + (self.appended.shape[0] if self.appended is not None else 0)
        if keys.min() < 0 or keys.max() >= held:  # numpy indexing would wrap a negative id silently
            raise IndexError(f"keys {keys.min()}..{keys.max()} outside the {held} held from key {self.first_key}")
        if self.appended is None or keys.max() < self.rows.shape[0]:
            return self.rows[keys]
        terms, weights, counts = gather_rows(self.parts, keys)
        indptr = np.concatenate([[0], np.cumsum(counts)])
        return sp.csr_matrix((weights, terms.astype(np.int32), indptr), shape=(len(keys), self.rows.shape[1]))


def query_matrix(queries: list[QueryTerms], width: int) -> sp.csr_matrix:
    """The queries' unit term vectors as a (queries x ``width``) CSR matrix, term ids sorted per
    row; a term outside the keys' term space (an id ≥ ``width``) matches no key and is left out."""
    inside = [query.ids < width for query in queries]
    indptr = np.concatenate([[0], np.cumsum([int(mask.sum()) for mask in inside])])
    if not indptr[-1]:
        return sp.csr_matrix((len(queries), width), dtype=np.float32)
    indices = np.concatenate([query.ids[mask] for query, mask in zip(queries, inside, strict=True)])
    data = np.concatenate([query.weights[mask] for query, mask in zip(queries, inside, strict=True)])
    return sp.csr_matrix((data.astype(np.float32), indices.astype(np.int32), indptr), shape=(len(queries), width))


def save_key_terms(path: Path, rows: sp.csr_matrix) -> None:
    sp.save_npz(path, rows.astype(np.float32), compressed=True)


def key_terms_of(rows: sp.csr_matrix, first_key: int = 0) -> KeyTerms:
    """``rows`` (float32 CSR, its structure sound) as the keys' term vectors, checked to be unit rows."""
    rows.sort_indices()
    norms = np.asarray(rows.multiply(rows).sum(axis=1)).ravel()
    if not np.all(np.isfinite(rows.data)) or not np.all((np.abs(norms - 1) < 1e-3) | (norms == 0)):
        raise ValueError("key term rows must be finite unit vectors")
    return KeyTerms(rows, first_key)
