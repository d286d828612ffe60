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
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import Depends, FastAPI, HTTPException, Request

from engine import (
    AppendIdReused,
    AppendLogError,
    AppendLogHeld,
    AppendRefused,
    BundleChanged,
    BundleError,
    BusyRetry,
    CatchUpFailed,
    LineageDiverged,
    MemoryBusy,
    VariantUnavailable,
)
from service.api.schemas import ConfigUpdate, ReloadRequest, build_append_request
from service.http.group import GroupError
from service.http.state import ServingState, refused_fields

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


async def reload_variant(
    state: ServingState,
    variant: str,
    path: Path,
    vet: bool = True,
    counted: bool = True,
    busy: BusyRetry | None = None,
) -> dict:
    """Load, verify and warm the bundle at ``path`` and swap it into ``variant``; a bundle refused
    leaves the variant as it was (422). ``vet``: load it in a memory-capped child first (a worker
    applying another worker's reload skips it: that worker vetted the bundle). ``counted``: in
    ``xmcserve_reloads_total`` (not when applying another worker's reload: the group's counters
    are summed over its workers, and that worker counted it). ``busy``: how a load that found the
    append log held is tried again (applying another worker's reload); None: 503 at once."""
    try:
        swap = await state.engine.reload(variant, path, vet=vet, busy=busy)
    except MemoryBusy as exc:  # a group's append log held past the read wait: nothing changed, try again
        raise HTTPException(503, f"variant {variant} unchanged: {exc}", headers={"Retry-After": "1"}) from None
    except BundleError as exc:
        if counted:
            state.metrics.reloads.labels(variant=variant, outcome="refused").inc()
        log.warning(
            "reload of %s refused, variant %s unchanged: %s",
            path,
            variant,
            exc,
            extra=refused_fields(variant, path, exc),
        )
        raise HTTPException(422, f"bundle refused, variant {variant} unchanged: {exc}") from None
    predictor, previous = swap.predictor, swap.previous
    state.count_install(variant, predictor, str(path), counted)
    if counted:
        state.metrics.reloads.labels(variant=variant, outcome="loaded").inc()
    previous_id = previous.bundle.bundle_id if previous else None
    log.info(
        "variant %s reloaded: %s (was %s)",
        variant,
        predictor.bundle.bundle_id,
        previous_id,
        extra={
            "event": "reload",
            "variant": variant,
            "bundle_id": predictor.bundle.bundle_id,
            "previous_bundle_id": previous_id,
        },
    )
    return {"variant": variant, "bundle_id": predictor.bundle.bundle_id, "previous_bundle_id": previous_id}


async def swapped(state: ServingState, swap: Awaitable) -> tuple[str, str]:
    """A promote's or a rollback's (bundle id now serving A, bundle id it replaced); 409 when there
    is nothing to swap in, 503 when the incoming A cannot catch up with its lineage."""
    try:
        done = await swap
    except VariantUnavailable as exc:
        raise HTTPException(409, str(exc)) from None
    except CatchUpFailed as exc:
        raise HTTPException(503, str(exc), headers={"Retry-After": "1"}) from None
    state.publish_bundle_info()
    return done.predictor.bundle.bundle_id, done.previous.bundle.bundle_id


async def promote_candidate(state: ServingState, busy: BusyRetry | None = None) -> dict:
    """B becomes A (409 without a B), caught up with its lineage first (503 when it cannot be);
    ``busy``: how a catch-up that found the log held is tried again (None: 503 at once)."""
    promoted, previous = await swapped(state, state.engine.promote(busy))
    log.info(
        "promoted %s to A (was %s)",
        promoted,
        previous,
        extra={"event": "promote", "bundle_id": promoted, "previous_bundle_id": previous},
    )
    return {"promoted_bundle_id": promoted, "previous_bundle_id": previous}


async def roll_back(state: ServingState, busy: BusyRetry | None = None) -> dict:
    """A's previous bundle serves A again (409 without one); ``busy``: see :func:`promote_candidate`."""
    restored, replaced = await swapped(state, state.engine.rollback(busy))
    log.info(
        "rolled A back to %s (was %s)",
        restored,
        replaced,
        extra={"event": "rollback", "bundle_id": restored, "previous_bundle_id": replaced},
    )
    return {"restored_bundle_id": restored, "previous_bundle_id": replaced}


def configure(state: ServingState, split_b: float | None, shadow_fraction: float | None) -> None:
    if shadow_fraction is not None and shadow_fraction > 0 and (state.shadow is None or not state.shadow.target):
        raise HTTPException(409, "no shadow configured: set XMCSERVE_SHADOW_URL")
    if split_b is not None:
        state.engine.set_split(split_b)
    if shadow_fraction is not None and state.shadow is not None:
        state.shadow.set_fraction(shadow_fraction)
    changed = {k: v for k, v in (("split_b", split_b), ("shadow_fraction", shadow_fraction)) if v is not None}
    log.info(
        "config changed: %s",
        ", ".join(f"{k}={v}" for k, v in changed.items()),
        extra={"event": "config_change", **changed},
    )


async def apply_change(state: ServingState, change: dict) -> None:
    """Make a change another worker of the group made and logged (:mod:`service.http.group`).
    A load or a catch-up that finds the lineage's append log held past the read wait (a writer's
    brief hold: nothing diverged) is tried again for a while (:attr:`ServingState.busy_retry`):
    failing here stops this worker, and no client would retry for it."""
    op, busy = change.get("op"), state.busy_retry
    if op == "reload":
        await reload_variant(state, change["variant"], Path(change["path"]), vet=False, counted=False, busy=busy)
    elif op == "promote":
        await promote_candidate(state, busy)
    elif op == "rollback":
        await roll_back(state, busy)
    elif op == "config":
        configure(state, change.get("split_b"), change.get("shadow_fraction"))
    else:
        raise GroupError(f"unknown admin change {op!r}")


async def follow_group(state: ServingState) -> int:
    """Apply the changes the group's other workers logged since this one last looked (none in a
    server of one process), under the lock that serialises this worker's own changes."""
    group = state.group
    if group is None or not group.grown():
        return 0
    async with state.reload_lock:
        return await group.follow(lambda change: apply_change(state, change))


@asynccontextmanager
async def admin_change(state: ServingState) -> AsyncIterator[None]:
    """One change at a time: this worker's lock, and in a group the group's turn, with the other
    workers' changes applied first (so this one is made on the state the group is in)."""
    async with state.reload_lock:
        if state.group is None:
            yield
            return
        async with state.group.turn():
            await state.group.follow(lambda change: apply_change(state, change))
            refuse_if_replaced(state.group)
            yield


def refuse_if_replaced(group) -> None:
    """A worker that could not apply a change another made no longer holds the group's state: it
    makes no admin change (it is being replaced). The failure itself is in that change's answer and
    in this worker's log, not in this call's reason."""
    if group.failed is not None:
        raise HTTPException(
            503,
            f"worker {group.pid} is being replaced (it could not apply the group's admin change "
            f"{group.failed['generation']}): nothing changed; retry",
            headers={"Retry-After": "1"},
        )


async def publish(state: ServingState, change: dict) -> dict:
    """Log a change just made (inside :func:`admin_change`) for the group's other workers; {} for
    a server of one process."""
    if state.group is None:
        return {}
    state.group.record(change)
    state.group.acknowledge()
    return {"generation": state.group.applied}


async def converged(state: ServingState, logged: dict) -> dict:
    """Wait for the group's workers to apply a logged change; the answer's ``workers`` field."""
    if state.group is None or not logged:
        return {}
    done = await state.group.converged(logged["generation"])
    if done.applied < done.workers:
        log.warning(
            "admin change %d applied by %d of %d workers%s",
            done.generation,
            done.applied,
            done.workers,
            "".join(
                f"; worker {f['pid']} could not apply change {f['generation']}: {f['reason']}" for f in done.failed
            ),
            extra={"event": "group_lagging", **done.describe()},
        )
    return {"workers": done.describe()}


def add_admin_routes(app: FastAPI) -> None:
    guarded = [Depends(require_admin)]
    AppendRequest = build_append_request(app.state.settings.limits)

    @app.get("/admin/state", dependencies=guarded)
    async def admin_state(request: Request) -> dict:
        state = serving_state(request)
        await follow_group(state)
        return state.describe()

    @app.post("/admin/reload", dependencies=guarded)
    async def reload(body: ReloadRequest, request: Request) -> dict:
        state = serving_state(request)
        try:
            path = confined_bundle_path(state.settings.admin.bundle_root, body.bundle)
        except ValueError as exc:
            raise HTTPException(400, str(exc)) from None
        async with admin_change(state):
            answer = await reload_variant(state, body.variant, path)
            logged = await publish(state, {"op": "reload", "variant": body.variant, "path": str(path)})
        return {**answer, **await converged(state, logged)}

    @app.post("/admin/promote", dependencies=guarded)
    async def promote(request: Request) -> dict:
        state = serving_state(request)
        async with admin_change(state):
            answer = await promote_candidate(state)
            logged = await publish(state, {"op": "promote"})
        return {**answer, **state.describe(), **await converged(state, logged)}

    @app.post("/admin/rollback", dependencies=guarded)
    async def rollback(request: Request) -> dict:
        """A's previous bundle (the one a promote or a reload of A replaced, kept loaded) serves A
        again; a second rollback undoes the first."""
        state = serving_state(request)
        async with admin_change(state):
            answer = await roll_back(state)
            logged = await publish(state, {"op": "rollback"})
        return {**answer, **state.describe(), **await converged(state, logged)}

    @app.post("/admin/append", dependencies=guarded)
    async def append(body: AppendRequest, request: Request) -> dict:  # type: ignore[valid-type]
        """Encode and add the labels and instances to the variant's memory, logged before applied;
        the next /predict sees all of them (never a part)."""
        state = serving_state(request)
        batch = body.batch()
        # Encoded on the variant's encode thread between requests, and without the admin lock, so a
        # long append never holds up a reload or promote; logged and applied under it.
        try:
            prepared = await state.engine.prepare_append(body.variant, batch)
            async with admin_change(state):  # in a group: after the changes the others made first
                outcome = await state.engine.commit_append(prepared)
        except VariantUnavailable as exc:
            raise HTTPException(409, str(exc)) from None
        except BundleChanged as exc:
            raise HTTPException(409, str(exc)) from None
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
        except (AppendLogError, LineageDiverged, MemoryBusy) as exc:
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
                "bundle_id": prepared.predictor.bundle.bundle_id,
                "version": outcome.version,
                "repeated": outcome.repeated,
                "labels": len(outcome.label_ids),
                "instances": outcome.instances,
            },
        )
        return {
            "variant": body.variant,
            "bundle_id": prepared.predictor.bundle.bundle_id,
            "version": outcome.version,
            "repeated": outcome.repeated,
            "label_ids": outcome.label_ids,
            "instances": outcome.instances,
            "memory": prepared.predictor.view.describe(),
        }

    @app.post("/admin/config", dependencies=guarded)
    async def configure_route(body: ConfigUpdate, request: Request) -> dict:
        state = serving_state(request)
        async with admin_change(state):
            configure(state, body.split_b, body.shadow_fraction)
            logged = await publish(state, {"op": "config", **body.model_dump(exclude_none=True)})
        return {**state.describe(), **await converged(state, logged)}
