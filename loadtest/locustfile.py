"""Locust scenarios for xmcserve: dev-split titles, mostly single-text requests, some batches,
some with the query's own item excluded, optional sticky ``X-Request-Key`` for A/B.

    locust -f loadtest/locustfile.py --host http://127.0.0.1:8000

Environment:
    XMCSERVE_LOADTEST_SCENARIO  steady | ramp | spike (default steady), a LoadTestShape below
    XMCSERVE_LOADTEST_SECONDS   total duration (default 60)
    XMCSERVE_LOADTEST_USERS     peak simulated users (default 16)
    XMCSERVE_LOADTEST_AB_KEYS   1: each user sends a fixed X-Request-Key (sticky A/B routing)
    XMCSERVE_LOADTEST_DATA      dataset dir with dev.json.gz (default data/debian-sample)
"""

from __future__ import annotations

import gzip
import json
import os
import random
import uuid
from pathlib import Path

from locust import LoadTestShape, between, task
from locust.contrib.fasthttp import FastHttpUser

DATA = Path(os.environ.get("XMCSERVE_LOADTEST_DATA", Path(__file__).resolve().parents[1] / "data/debian-sample"))
SCENARIO = os.environ.get("XMCSERVE_LOADTEST_SCENARIO", "steady")
SECONDS = float(os.environ.get("XMCSERVE_LOADTEST_SECONDS", "60"))
USERS = int(os.environ.get("XMCSERVE_LOADTEST_USERS", "16"))
AB_KEYS = os.environ.get("XMCSERVE_LOADTEST_AB_KEYS", "0") == "1"


def load_items(split: str = "dev") -> list[tuple[str, str]]:
    """(uid, title) of the split's instances: the title is the query, the uid its own item."""
    with gzip.open(DATA / f"{split}.json.gz", "rt", encoding="utf-8") as fh:
        return [(row["uid"], row["title"]) for row in map(json.loads, fh) if row]


ITEMS = load_items()


class PredictUser(FastHttpUser):
    wait_time = between(0.05, 0.25)

    def on_start(self) -> None:
        self.headers = {"X-Request-Key": uuid.uuid4().hex} if AB_KEYS else {}

    @task(16)
    def single(self) -> None:
        _, title = random.choice(ITEMS)
        self.client.post("/predict", json={"text": title, "k": 10}, headers=self.headers, name="/predict single")

    @task(3)
    def batch(self) -> None:
        titles = [title for _, title in random.sample(ITEMS, 8)]
        self.client.post("/predict", json={"texts": titles, "k": 10}, headers=self.headers, name="/predict batch8")

    @task(1)
    def own_item_excluded(self) -> None:
        uid, title = random.choice(ITEMS)
        body = {"text": title, "k": 10, "exclude": [uid]}
        self.client.post("/predict", json=body, headers=self.headers, name="/predict exclude")


def stages(scenario: str, seconds: float, users: int) -> list[tuple[float, int, float]]:
    """(end time s, users, spawn rate/s) per stage of a scenario."""
    if scenario == "steady":
        return [(seconds, users, users)]
    if scenario == "ramp":
        steps = 4
        return [(seconds * (i + 1) / steps, max(1, users * (i + 1) // steps), users) for i in range(steps)]
    if scenario == "spike":
        low = max(1, users // 4)
        return [(seconds * 0.4, low, users), (seconds * 0.6, users, users * 4), (seconds, low, users * 4)]
    raise ValueError(f"unknown scenario {scenario!r} (steady, ramp, spike)")


class ScenarioShape(LoadTestShape):
    """The scenario named by XMCSERVE_LOADTEST_SCENARIO; stops by itself at XMCSERVE_LOADTEST_SECONDS."""

    plan = stages(SCENARIO, SECONDS, USERS)

    def tick(self):
        run_time = self.get_run_time()
        for end, users, rate in self.plan:
            if run_time < end:
                return users, rate
        return None
