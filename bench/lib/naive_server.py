"""The baseline a user would write first: per-request transformers + torch encoding in a
FastAPI endpoint, hnswlib search over the same bundle's index, the same RAE aggregation.

    XMCSERVE_BUNDLE_DIR=bundles/default uvicorn bench.lib.naive_server:create_app --factory

It reproduces the bundle's query vectors (encoder from the checkpoint, the bundle's head.npz),
so the two servers answer the same question with the same index; only the serving path differs.
"""

import os
from pathlib import Path

import numpy as np
import torch
from fastapi import FastAPI
from pydantic import BaseModel
from transformers import AutoModel, AutoTokenizer

from engine import Predictor
from engine.offline import Neighbours, load_bundle, rank_batch
from xmc.checkpoint import ServingHead, default_encoder_dir


class Query(BaseModel):
    text: str
    k: int = 10


def create_app() -> FastAPI:
    bundle_dir = Path(os.environ.get("XMCSERVE_BUNDLE_DIR", "bundles/default"))
    checkpoint = Path(os.environ.get("NAIVE_CHECKPOINT", default_encoder_dir()))
    bundle = load_bundle(bundle_dir)  # for the index, labels and values only
    head = ServingHead.load(bundle_dir)
    tokenizer = AutoTokenizer.from_pretrained(str(checkpoint))
    model = AutoModel.from_pretrained(str(checkpoint)).eval()
    rae = bundle.manifest.rae
    view = Predictor(bundle).view  # the keys' labels and value rows, as the bundle was built
    app = FastAPI(title="naive baseline")

    @app.get("/readyz")
    def readyz() -> dict:
        return {"ready": True}

    @app.post("/predict")
    def predict(query: Query) -> dict:
        batch = tokenizer(
            [query.text], truncation=True, max_length=bundle.manifest.tokenizer.max_length, return_tensors="pt"
        )
        with torch.inference_mode():
            hidden = model(**batch).last_hidden_state
            mask = batch["attention_mask"].unsqueeze(-1).float()
            pooled = ((hidden * mask).sum(1) / mask.sum(1)).numpy()
        vector = head.query_vectors(pooled)
        keys, distances = bundle.index.search(vector, rae.top_b if rae else query.k, bundle.manifest.search_breadth)
        if rae:
            keys = keys.astype(np.int64)
            found = Neighbours(keys, 1 - distances, view.labels_of_keys(keys), view.values, None, ef=0)
            (ranking,) = rank_batch(bundle.manifest, found, [query.k], [()])
            ids, values = ranking.ids, ranking.scores
        else:
            ids, values = keys[0][: query.k], 1 - distances[0][: query.k]
        return {
            "labels": [
                {"id": int(i), "uid": bundle.label_uids[i], "text": bundle.label_texts[i], "score": float(v)}
                for i, v in zip(ids, values, strict=True)
            ]
        }

    return app
