"""Admin endpoints: load a bundle into a variant, promote B to A, roll A back to the bundle it
served before, change split and shadow share, append labels and instances to a variant's memory.

Every route needs ``X-Admin-Token`` (or ``Authorization: Bearer``) equal to
``XMCSERVE_ADMIN_TOKEN``, compared in constant time: missing → 401, wrong → 403, and with no
token configured the admin API is off (403). A bundle is loaded, verified (checksums, shapes) and
warmed beside the one serving, then swapped in atomically; one that fails is refused with the
reason and the old one keeps serving. Bundle paths must resolve inside ``XMCSERVE_BUNDLE_ROOT``.
Loads, promotes, rollbacks and appends are serialised (one at a time); none of them stops /predict.
A promote or a rollback first applies to the incoming bundle what its lineage logged since it was
loaded (docs/operations.md, "Lineage model"), so no acknowledged append is missing from the new A.
"""

# No `from __future__ import annotations` here: FastAPI must resolve the locally built append
# model from the endpoint annotation at runtime.
import hmac
import logging
from pathlib import Path

import anyio
from fastapi import Depends, FastAPI, HTTPException, Request

from service.api.schemas import ConfigUpdate, ReloadRequest, build_append_request
from service.engine import (
    AppendIdReused,
    AppendLogError,
    AppendLogHeld,
    AppendRefused,
    BundleError,
    LineageDiverged,
    Predictor,
)
from service.http.state import ServingState, load_for_serving, refused_fields

log = logging.getLogger("xmcserve.admin")


def confined_bundle_path(root: Path, requested: str) -> Path:
    """``requested`` resolved under ``root``; ``..`` or symlink escapes are refused."""
    root = root.resolve()
    path = (root / requested).resolve()
    if not path.is_relative_to(root):
        raise ValueError(f"bundle path {requested!r} is outside the bundle root")
    return path


def require_admin(request: Request) -> None:
    expected = request.app.state.settings.admin.token
    if expected is None or not expected.get_secret_value():
        raise HTTPException(403, "admin API disabled: set XMCSERVE_ADMIN_TOKEN")
    given = request.headers.get("x-admin-token")
    authorization = request.headers.get("authorization", "")
    if given is None and authorization.lower().startswith("bearer "):
        given = authorization[7:]
    if not given:
        raise HTTPException(401, "admin token required (X-Admin-Token header)", headers={"WWW-Authenticate": "Bearer"})
    if not hmac.compare_digest(given.encode(), expected.get_secret_value().encode()):
        raise HTTPException(403, "admin token rejected")


def serving_state(request: Request) -> ServingState:
    state = request.app.state.serving
    if state is None:
        raise HTTPException(503, "service not started")
    return state


def add_admin_routes(app: FastAPI) -> None:
    guarded = [Depends(require_admin)]
    AppendRequest = build_append_request(app.state.settings.limits)

    @app.get("/admin/state", dependencies=guarded)
    async def admin_state(request: Request) -> dict:
        return serving_state(request).describe()

    @app.post("/admin/reload", dependencies=guarded)
    async def reload(body: ReloadRequest, request: Request) -> dict:
        state = serving_state(request)
        try:
            path = confined_bundle_path(state.settings.admin.bundle_root, body.bundle)
        except ValueError as exc:
            raise HTTPException(400, str(exc)) from None
        async with state.reload_lock:
            try:
                predictor = await load_for_serving(path, state.settings)
            except BundleError as exc:
                state.metrics.reloads.labels(variant=body.variant, outcome="refused").inc()
                log.warning(
                    "reload of %s refused, variant %s unchanged: %s",
                    path,
                    body.variant,
                    exc,
                    extra=refused_fields(body.variant, path, exc),
                )
                raise HTTPException(422, f"bundle refused, variant {body.variant} unchanged: {exc}") from None
            previous = state.install(body.variant, predictor, str(path))
        state.metrics.reloads.labels(variant=body.variant, outcome="loaded").inc()
        previous_id = previous.bundle.bundle_id if previous else None
        log.info(
            "variant %s reloaded: %s (was %s)",
            body.variant,
            predictor.bundle.bundle_id,
            previous_id,
            extra={
                "event": "reload",
                "variant": body.variant,
                "bundle_id": predictor.bundle.bundle_id,
                "previous_bundle_id": previous_id,
            },
        )
        return {
            "variant": body.variant,
            "bundle_id": predictor.bundle.bundle_id,
            "previous_bundle_id": previous.bundle.bundle_id if previous else None,
        }

    async def caught_up(predictor: Predictor | None) -> None:
        """Apply what the incoming A's lineage logged since it was loaded (another slot's appends)."""
        if predictor is None:
            return
        try:
            await anyio.to_thread.run_sync(predictor.memory.catch_up)
        except (AppendLogError, LineageDiverged) as exc:
            raise HTTPException(503, f"nothing changed: cannot catch up its append log: {exc}") from None

    @app.post("/admin/promote", dependencies=guarded)
    async def promote(request: Request) -> dict:
        state = serving_state(request)
        async with state.reload_lock:
            await caught_up(state.variants["B"].predictor)
            try:
                previous = state.variants.promote()
            except LookupError as exc:
                raise HTTPException(409, str(exc)) from None
            state.publish_bundle_info()
        promoted = state.variants["A"].bundle_id
        log.info(
            "promoted %s to A (was %s)",
            promoted,
            previous.bundle.bundle_id,
            extra={"event": "promote", "bundle_id": promoted, "previous_bundle_id": previous.bundle.bundle_id},
        )
        return {
            "promoted_bundle_id": state.variants["A"].bundle_id,
            "previous_bundle_id": previous.bundle.bundle_id,
            **state.describe(),
        }

    @app.post("/admin/rollback", dependencies=guarded)
    async def rollback(request: Request) -> dict:
        """A's previous bundle (the one a promote or a reload of A replaced, kept loaded) serves A
        again; a second rollback undoes the first."""
        state = serving_state(request)
        async with state.reload_lock:
            if state.variants.previous is None:
                raise HTTPException(409, "no previous A bundle to roll back to (A has not changed since start-up)")
            await caught_up(state.variants.previous.predictor)
            replaced = state.variants.rollback()
            state.publish_bundle_info()
        restored = state.variants["A"].bundle_id
        log.info(
            "rolled A back to %s (was %s)",
            restored,
            replaced.bundle.bundle_id,
            extra={"event": "rollback", "bundle_id": restored, "previous_bundle_id": replaced.bundle.bundle_id},
        )
        return {"restored_bundle_id": restored, "previous_bundle_id": replaced.bundle.bundle_id, **state.describe()}

    @app.post("/admin/append", dependencies=guarded)
    async def append(body: AppendRequest, request: Request) -> dict:  # type: ignore[valid-type]
        """Encode and add the labels and instances to the variant's memory, logged before applied;
        the next /predict sees all of them (never a part)."""
        state = serving_state(request)
        slot = state.variants[body.variant]
        predictor, batch = slot.predictor, body.batch()
        if predictor is None:
            raise HTTPException(409, f"variant {body.variant} has no bundle loaded")
        # Encoded on the variant's encode thread between requests, and without the admin lock, so a
        # long append never holds up a reload or promote; logged and applied under it.
        idle_time = slot.batcher.run_when_idle
        try:
            vectors = await anyio.to_thread.run_sync(
                predictor.prepare_append, batch, lambda work: anyio.from_thread.run(idle_time, work)
            )
            async with state.reload_lock:
                if slot.predictor is not predictor:
                    raise HTTPException(
                        409, f"variant {body.variant} changed bundles during the append: nothing appended"
                    )
                outcome = await anyio.to_thread.run_sync(predictor.memory.commit, batch, vectors)
        except AppendRefused as exc:
            state.metrics.appends.labels(variant=body.variant, outcome="refused").inc()
            log.warning(
                "append to %s refused: %s",
                body.variant,
                exc,
                extra={"event": "append_refused", "variant": body.variant, "reason": str(exc)},
            )
            status = 409 if isinstance(exc, AppendIdReused) else 422
            raise HTTPException(status, f"nothing appended: {exc}") from None
        except AppendLogHeld as exc:  # another process writes this lineage: one writer, one order
            state.metrics.appends.labels(variant=body.variant, outcome="refused").inc()
            log.warning(
                "append to %s refused: %s",
                body.variant,
                exc,
                extra={"event": "append_refused", "variant": body.variant, "reason": str(exc)},
            )
            raise HTTPException(409, f"nothing appended: {exc}") from None
        except (AppendLogError, LineageDiverged) as exc:
            state.metrics.appends.labels(variant=body.variant, outcome="failed").inc()
            log.error(
                "append to %s failed, nothing appended: %s",
                body.variant,
                exc,
                extra={"event": "append_failed", "variant": body.variant, "reason": str(exc)},
            )
            raise HTTPException(503, f"nothing appended: {exc}", headers={"Retry-After": "5"}) from None
        state.metrics.appends.labels(variant=body.variant, outcome="repeated" if outcome.repeated else "applied").inc()
        log.info(
            "append to %s %s: version %s, %d labels, %d instances",
            body.variant,
            "repeated (already applied)" if outcome.repeated else "applied",
            outcome.version,
            len(outcome.label_ids),
            outcome.instances,
            extra={
                "event": "append_applied",
                "variant": body.variant,
                "bundle_id": predictor.bundle.bundle_id,
                "version": outcome.version,
                "repeated": outcome.repeated,
                "labels": len(outcome.label_ids),
                "instances": outcome.instances,
            },
        )
        if not outcome.repeated:
            state.metrics.appended_keys.labels(variant=body.variant, kind="label").inc(len(outcome.label_ids))
            state.metrics.appended_keys.labels(variant=body.variant, kind="instance").inc(outcome.instances)
        return {
            "variant": body.variant,
            "bundle_id": predictor.bundle.bundle_id,
            "version": outcome.version,
            "repeated": outcome.repeated,
            "label_ids": outcome.label_ids,
            "instances": outcome.instances,
            "memory": predictor.view.describe(),
        }

    @app.post("/admin/config", dependencies=guarded)
    async def configure(body: ConfigUpdate, request: Request) -> dict:
        state = serving_state(request)
        if body.split_b is not None:
            state.variants.split_b = body.split_b
        if body.shadow_fraction is not None and state.shadow is not None:
            if body.shadow_fraction > 0 and not state.shadow.target:
                raise HTTPException(409, "no shadow configured: set XMCSERVE_SHADOW_URL")
            state.shadow.set_fraction(body.shadow_fraction)
        changed = body.model_dump(exclude_none=True)
        log.info(
            "config changed: %s",
            ", ".join(f"{k}={v}" for k, v in changed.items()),
            extra={"event": "config_change", **changed},
        )
        return state.describe()
