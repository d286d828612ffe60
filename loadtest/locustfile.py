"""Locust user for xmcserve: dev-split titles, mostly single-text requests, some batches.

locust -f loadtest/locustfile.py --host http://127.0.0.1:8000
"""

from __future__ import annotations

import gzip
import json
import os
import random
from pathlib import Path

from locust import HttpUser, between, task

DATA = Path(os.environ.get("XMCSERVE_LOADTEST_DATA", Path(__file__).resolve().parents[1] / "data/debian-sample"))


def load_titles(split: str = "dev") -> list[str]:
    with gzip.open(DATA / f"{split}.json.gz", "rt", encoding="utf-8") as fh:
        return [json.loads(line)["title"] for line in fh if line.strip()]


TITLES = load_titles()


class PredictUser(HttpUser):
    wait_time = between(0.05, 0.2)

    @task(8)
    def single(self) -> None:
        self.client.post("/predict", json={"text": random.choice(TITLES), "k": 10}, name="/predict single")

    @task(1)
    def batch(self) -> None:
        self.client.post("/predict", json={"texts": random.sample(TITLES, 8), "k": 10}, name="/predict batch8")
