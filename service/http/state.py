"""What the single server serves: the engine (its variants A and B, their predictors and
batchers: :class:`engine.Engine`), the shadow mirror, the metrics that describe them, and the
lock and group turn its admin changes take.

The app's lifespan builds one :class:`ServingState`; the /predict route reads it and the admin
routes (:mod:`service.http.admin`) change it through the engine.
"""

from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import dataclass, field, replace
from pathlib import Path

from engine import BusyRetry, Engine, Predictor
from service.http.group import WorkerGroup
from service.http.metrics import Metrics
from service.http.settings import Settings
from service.rollout.live import LiveTraffic
from service.rollout.shadow import ShadowMirror

log = logging.getLogger("xmcserve.admin")


def refused_fields(variant: str, path: Path | str, exc: Exception) -> dict:
    """The structured fields of the log line saying a bundle was refused for ``variant``."""
    return {"event": "bundle_refused", "variant": variant, "path": str(path), "reason": str(exc)}


def build_engine(settings: Settings, metrics: Metrics, group: WorkerGroup | None = None) -> Engine:
    """The engine the settings describe, its batches and drops counted in ``metrics``; in a
    ``group``, each bundle vetted once for all its workers and appends made in turns with them."""
    return Engine(
        replace(settings.engine_params(), shared_appends=group is not None),
        metrics.batch_observer,
        metrics.drop_observer,
        vet_once=group.vet_once if group is not None else None,
    )


@dataclass
class ServingState:
    """The engine, the shadow mirror and the lock that serialises this worker's admin changes
    (with, in a group, the group's turn: :func:`service.http.admin.admin_change`)."""

    settings: Settings
    metrics: Metrics
    engine: Engine
    shadow: ShadowMirror | None = None
    live: LiveTraffic | None = None  # each variant's recent /predict traffic, for the rollout page
    group: WorkerGroup | None = None  # the server's other worker processes (XMCSERVE_WORKERS), if any
    reload_lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # this worker's admin changes
    # how this worker outwaits a held append log where no client retries for it: applying another
    # worker's change, loading its start-up state
    busy_retry: BusyRetry = field(default_factory=BusyRetry)

    def __post_init__(self) -> None:
        self.metrics.appended_keys_of = self.appended_keys

    def appended_keys(self) -> list[tuple[str, int, int]]:
        """Each variant's appended labels and instances, as its memory (and /info) says."""
        out = []
        for name in self.engine.variants:
            predictor = self.engine.predictor(name)
            view = predictor.view if predictor is not None else None
            out.append((name, view.appended_labels if view else 0, view.appended_instances if view else 0))
        return out

    def install(
        self, name: str, predictor: Predictor, source: str, counted: bool = True, at_start: bool = False
    ) -> Predictor | None:
        """``counted``: its skipped replays in the metrics (not when applying another worker's
        reload: that worker counted them, and a group's counters are summed). ``at_start``: a
        start-up load, which every worker of a group makes alike: counted by the first only."""
        previous = self.engine.install(name, predictor, source)
        self.count_install(name, predictor, source, counted, at_start)
        return previous

    def count_install(
        self, name: str, predictor: Predictor, source: str, counted: bool = True, at_start: bool = False
    ) -> None:
        """The metrics of a bundle swapped into ``name`` (see :meth:`install`)."""
        skipped = predictor.view.replay_skipped
        if counted and skipped and at_start and self.group is not None:
            event = f"replay_skipped {name} {predictor.bundle.bundle_id} {source} {len(skipped)}"
            counted = self.group.claim(event)
        if counted:
            self.metrics.replay_skipped.labels(variant=name).inc(len(predictor.view.replay_skipped))
        self.publish_bundle_info()

    def publish_bundle_info(self) -> None:
        for name in self.engine.variants:
            predictor = self.engine.predictor(name)
            bundle = predictor.bundle if predictor else None
            self.metrics.bundle_info.labels(variant=name).info(
                {
                    "bundle_id": bundle.bundle_id if bundle else "",
                    "index_kind": bundle.manifest.index_kind if bundle else "",
                    "provider": bundle.encoder.provider if bundle else "",
                    "dim": str(bundle.manifest.dim) if bundle else "",
                }
            )

    def reloadable(self, source: str | None) -> str | None:
        """``source`` as ``/admin/reload`` takes it (relative to the bundle root), None when the
        bundle lies outside the root (only a restart serves it again)."""
        if not source:
            return None
        root, path = self.settings.admin.bundle_root.resolve(), Path(source).resolve()
        return str(path.relative_to(root)) if path.is_relative_to(root) else None

    def worker(self) -> dict:
        """Which process answered: its pid, and in a group, how many workers and the admin changes
        it has applied."""
        group = self.group
        return {
            "pid": os.getpid(),
            "workers": group.workers if group else 1,
            "admin_generation": group.applied if group else None,
        }

    def describe(self) -> dict:
        shadow = self.shadow
        routing = self.engine.describe()
        for slot in [*routing["variants"].values(), routing["previous"]]:
            slot["bundle"] = self.reloadable(slot["source"])
        return {
            **routing,
            "shadow": {
                "target": shadow.target if shadow else None,
                "fraction": shadow.config.fraction if shadow else 0.0,
                "queue_depth": shadow.depth if shadow else 0,
            },
        }
