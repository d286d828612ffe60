"""Which features a one-vs-rest ranker should see on a many-shot set: the ranker alone (no memory,
no fusion), each label a liblinear logistic regression (export.baseline's solver, C 10), fitted on
80 % of the training split and scored on the other 20 % (never dev or tst).

    python -m studies.sparse_dense_ranker --data data/cooking-stackexchange \\
        --bundle bundles/cooking-pretrained --out studies/sparse_dense_ranker/cooking-stackexchange.json

Feature sets: the peer's word 1–2 + character 3–5-gram TF-IDF; the lexical fusion's term vectors
(the bundle tokenizer's word pieces and hashed pairs, idf over the fitted share: what the served
ranker reads); the bundle encoder's unit serving vector (``--bundle``'s, as the server encodes);
and each of the first two ⊕ that vector at weight 1.
"""

from __future__ import annotations

import argparse
import platform
import time
from pathlib import Path

import numpy as np
import scipy.sparse as sp

from engine import load_predictor
from engine.offline import Lexicon
from export.baseline import ovr_logreg, word_and_char_tfidf
from xmc.data import load_jsonl_split, split_holdout
from xmc.metrics import score_ranking
from xmc.results import write_result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, required=True, help="data set folder (docs/own-data.md layout)")
    parser.add_argument("--bundle", type=Path, required=True, help="a bundle whose encoder gives the dense vectors")
    parser.add_argument("--out", type=Path, required=True, help="result JSON file")
    parser.add_argument("--threads", type=int, default=1, help="liblinear worker processes (default 1)")
    args = parser.parse_args()
    train = load_jsonl_split(args.data, "trn")
    fit, held = split_holdout(train, len(train) // 5, seed=0)
    predictor = load_predictor(args.bundle)
    Vf, Vh = (predictor.bundle.encoder.encode(list(split.texts))[0] for split in (fit, held))
    Xf, Xh = word_and_char_tfidf(fit, held)
    manifest = predictor.bundle.manifest
    lexicon = Lexicon.fit(args.bundle / "tokenizer.json", manifest.tokenizer.max_length, list(fit.texts))
    Lf, Lh = lexicon.rows(list(fit.texts)), lexicon.rows(list(held.texts))
    dense = sp.csr_matrix
    sets = {
        "word+char TF-IDF": (Xf, Xh),
        "word+char TF-IDF ⊕ dense": (sp.hstack([Xf, dense(Vf)]), sp.hstack([Xh, dense(Vh)])),
        "lexical terms": (Lf, Lh),
        "lexical terms ⊕ dense": (sp.hstack([Lf, dense(Vf)]), sp.hstack([Lh, dense(Vh)])),
        "dense vector alone": (dense(Vf), dense(Vh)),
    }
    rows = {}
    for name, (A, B) in sets.items():
        started = time.perf_counter()
        ranked = np.asarray(ovr_logreg(A.tocsr(), fit.Y, B.tocsr(), 100, args.threads))
        rows[name] = {**score_ranking(ranked, held, fit), "seconds": round(time.perf_counter() - started, 1)}
        print(name, rows[name], flush=True)
    result = {
        "data": str(args.data),
        "bundle": str(args.bundle),
        "fitted_on": f"{len(fit)} of trn's {len(train)} instances (split_holdout seed 0)",
        "scored_on": f"the other {len(held)}",
        "dense_dim": manifest.dim,
        "machine": {"cpu": platform.processor() or platform.machine(), "python": platform.python_version()},
        "rows": rows,
    }
    write_result(args.out, result)


if __name__ == "__main__":
    main()
