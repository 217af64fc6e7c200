"""The control API of ``deploykit serve`` (``/control/v1``): the CLI hands the running server its work
(docs/control.md). Every route needs the control token (``Guard`` checks it before any route runs).

Long operations (apply, rollback, delete) answer with newline-delimited JSON events while they run:

    {"event": "step", "step": "reshard"}                      a step of the apply starts
    {"event": "progress", "total": N, "done": D}              reshard bytes: a bar starts...
    {"event": "advance", "bytes": n}                          ...and advances (coalesced, ~10 per second)
    {"event": "wait", "message": "..."}                       another change of this name runs first
    {"event": "heartbeat"}                                    nothing new for 5 s (the server lives)
    {"event": "result", ...}                                  the outcome; last line
    {"event": "error", "kind": "manifest", "issues": [...]}   or the error; last line
    {"event": "error", "kind": "plan" | "error" | "internal", "message": "..."}

A manifest that cannot be read or validated is answered at once, before any stream: HTTP 422 with the
``manifest`` error event (its located issues). A manifest that the admission gate refuses
(``control/admission.py``: an engine binary, remote code, a cluster, a path outside the allowed roots) is a
403 naming the field, before anything else runs: ``{"error": {..., "param": FIELD, "code":
"forbidden_by_policy"}, "event": "error", "kind": "policy", "message": "FILE:LINE:COL: FIELD: ..."}``; a
refusal found once the work runs (a rollback's recorded revision) is the stream's last event,
``{"event": "error", "kind": "policy", "field": FIELD, "message": ...}``. A
field of a body that no operation could take (a NUL in a path, a revision beyond SQLite's integers) is a
400 naming it, as the /v1 API answers.

The work runs on its own thread (never on the event loop) and finishes even if the client goes away:
a change either completes or leaves the last good revision serving.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import AfterValidator, BaseModel, Field
from starlette.concurrency import run_in_threadpool

from ..control.admission import PolicyError, admit
from ..errors import DeploykitError, ManifestError, PlanInfeasible
from .errors import error_body

if TYPE_CHECKING:
    from ..control.live.supervisor import Supervisor
    from ..spec.manifest import LoadedManifest

log = logging.getLogger(__name__)
router = APIRouter(prefix="/control/v1")
HEARTBEAT = 5.0
ADVANCE_EVERY = 0.1


def _no_nul(text: str) -> str:
    if "\x00" in text:
        raise ValueError("must not contain a NUL character")
    return text


# Checked here, at the edge: a NUL in a path or a revision beyond SQLite's integers is a 400 naming the
# field, not an error deep inside the filesystem or the state store.
Text = Annotated[str, AfterValidator(_no_nul)]
Revision = Annotated[int, Field(ge=1, le=2**63 - 1)]  # SQLite's INTEGER


class ManifestBody(BaseModel):
    manifest: str  # the file's text, as the CLI read it (parsed as a manifest, with located errors)
    source: Text  # the file's absolute path: relative paths in it resolve against its directory
    name: Text  # which manifest of the file
    devices: Text | None = None  # only for dry runs and diff: the server's inventory applies otherwise
    dry_run: bool = False
    force: bool = False


class RollbackBody(BaseModel):
    name: Text
    to_revision: Revision | None = None


class DeleteBody(BaseModel):
    name: Text
    keep_shards: bool = False


class PruneBody(BaseModel):
    directory: Text
    keep: list[Text]


class _Events:
    """Events from the worker thread to the response; also the reshard ``ProgressSink``."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        self._lock = threading.Lock()
        self._pending = 0
        self._last = 0.0

    def put(self, event: dict[str, Any] | None) -> None:
        if event is not None:
            self._flush()
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, event)
        except RuntimeError:  # the server is shutting down; the work still finishes
            pass

    def step(self, step: str) -> None:
        self.put({"event": "step", "step": step})

    def wait(self, message: str) -> None:
        self.put({"event": "wait", "message": message})

    def start(self, total: int, done: int) -> None:
        self.put({"event": "progress", "total": total, "done": done})

    def advance(self, n: int) -> None:
        with self._lock:
            self._pending += n
            now = time.monotonic()
            if now - self._last < ADVANCE_EVERY:
                return
            self._last, n, self._pending = now, self._pending, 0
        self._send_advance(n)

    def _flush(self) -> None:
        with self._lock:
            n, self._pending = self._pending, 0
        if n:
            self._send_advance(n)

    def _send_advance(self, n: int) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, {"event": "advance", "bytes": n})
        except RuntimeError:
            pass


def error_event(exc: BaseException, loaded: LoadedManifest | None = None) -> dict[str, Any]:
    """An error as the CLI prints it in local mode (located where the manifest is to blame)."""
    if isinstance(exc, ManifestError):
        return {"event": "error", "kind": "manifest", "issues": [str(i) for i in exc.issues]}
    if isinstance(exc, PolicyError):
        return {"event": "error", "kind": "policy", "field": exc.field, "message": str(exc)}
    if isinstance(exc, PlanInfeasible):
        message = loaded.located(exc.field, str(exc)) if loaded is not None else str(exc)
        return {"event": "error", "kind": "plan", "message": message}
    if isinstance(exc, DeploykitError):
        return {"event": "error", "kind": "error", "message": str(exc)}
    log.error("control API: internal error", exc_info=exc)
    return {"event": "error", "kind": "internal", "message": f"{type(exc).__name__}: {exc}"}


def _streamed(request: Request, work: Callable[[_Events], dict[str, Any]]) -> StreamingResponse:
    """Run ``work`` on a thread the supervisor owns (it joins it when it closes); stream its events, then
    its result (or its error)."""
    events = _Events(asyncio.get_running_loop())

    def run() -> None:
        try:
            final = work(events)
        except BaseException as exc:  # noqa: BLE001 - every failure becomes the stream's last event
            final = error_event(exc, getattr(exc, "_loaded", None))
        events.put(final)
        events.put(None)

    _supervisor(request).tasks.start(run, name="deploykit-control")

    async def body() -> AsyncIterator[bytes]:
        while True:
            try:
                event = await asyncio.wait_for(events.queue.get(), HEARTBEAT)
            except asyncio.TimeoutError:
                event = {"event": "heartbeat"}
            if event is None:
                return
            yield (json.dumps(event) + "\n").encode()

    return StreamingResponse(body(), media_type="application/x-ndjson")


def _supervisor(request: Request) -> Supervisor:
    return request.app.state.registry


def _checked(request: Request, body: ManifestBody) -> LoadedManifest:
    """The manifest of ``body``, parsed and admitted under the server's policy (``PolicyError``), whatever
    file it says it is. Blocking (links are resolved): run it off the event loop."""
    loaded = _parse(body)
    admit(loaded, _supervisor(request).policy)
    return loaded


def _parse(body: ManifestBody) -> LoadedManifest:
    from ..spec.manifest import parse_manifests

    source = Path(body.source)
    if not source.is_absolute():
        raise DeploykitError(f"source {body.source!r} must be an absolute path")
    chosen = [m for m in parse_manifests(body.manifest.encode(), source=str(source), base_dir=source.parent)
              if m.name == body.name]
    if not chosen:
        raise DeploykitError(f"{source}: no manifest named {body.name!r}")
    return chosen[0]


def _failed(exc: BaseException, loaded: LoadedManifest | None = None) -> JSONResponse:
    if isinstance(exc, PolicyError):
        refused = error_body(403, exc.message, param=exc.field, code="forbidden_by_policy")
        return JSONResponse({**refused, "event": "error", "kind": "policy", "message": str(exc)}, status_code=403)
    event = error_event(exc, loaded)
    return JSONResponse(event, status_code=422 if event["kind"] == "manifest" else 400)


@router.post("/apply", response_model=None)
async def apply(request: Request, body: ManifestBody) -> StreamingResponse | JSONResponse:
    supervisor = _supervisor(request)
    try:  # before the stream: a manifest that cannot be read is an error answer, located
        loaded = await run_in_threadpool(_checked, request, body)
    except Exception as exc:
        return _failed(exc)

    def work(events: _Events) -> dict[str, Any]:
        from ..control.revisions.lifecycle import outcome_summary

        try:  # a dry run takes the same path: ownership checked, planned once (--devices: dry runs only)
            outcome = supervisor.apply_manifest(loaded, dry_run=body.dry_run, force=body.force, devices=body.devices,
                                                progress=events, on_step=events.step, on_wait=events.wait)
        except PlanInfeasible as exc:
            exc._loaded = loaded  # type: ignore[attr-defined]
            raise
        return {"event": "result", **outcome_summary(outcome)}

    return _streamed(request, work)


@router.post("/rollback")
async def rollback(request: Request, body: RollbackBody) -> StreamingResponse:
    supervisor = _supervisor(request)

    def work(events: _Events) -> dict[str, Any]:
        from ..control.revisions.lifecycle import outcome_summary

        target, outcome = supervisor.rollback(body.name, to_revision=body.to_revision, progress=events,
                                              on_step=events.step, on_wait=events.wait)
        return {"event": "result", "target": target.revision, **outcome_summary(outcome)}

    return _streamed(request, work)


@router.post("/delete")
async def delete(request: Request, body: DeleteBody) -> StreamingResponse:
    supervisor = _supervisor(request)

    def work(events: _Events) -> dict[str, Any]:
        supervisor.delete(body.name, keep_shards=body.keep_shards, on_wait=events.wait)
        return {"event": "result", "name": body.name, "deleted": True, "keep_shards": body.keep_shards}

    return _streamed(request, work)


@router.post("/prune")
async def prune(request: Request, body: PruneBody) -> JSONResponse:
    supervisor = _supervisor(request)
    try:
        pruned = await run_in_threadpool(supervisor.prune_directory, Path(body.directory), keep=set(body.keep))
    except Exception as exc:
        return _failed(exc)
    return JSONResponse({"pruned": pruned})


@router.post("/diff")
async def diff(request: Request, body: ManifestBody) -> JSONResponse:
    supervisor = _supervisor(request)

    def work() -> list[str]:
        from ..control.revisions.differ import diff_manifest

        loaded = _checked(request, body)
        try:
            return diff_manifest(loaded, store=supervisor.store, devices=body.devices or supervisor.devices)
        except PlanInfeasible as exc:
            exc._loaded = loaded  # type: ignore[attr-defined]
            raise

    try:
        lines = await run_in_threadpool(work)
    except Exception as exc:
        return _failed(exc, getattr(exc, "_loaded", None))
    return JSONResponse({"lines": lines})


@router.get("/status")
async def status(request: Request, name: str | None = None) -> JSONResponse:
    supervisor = _supervisor(request)

    def work() -> list[dict[str, Any]]:
        from ..control.live.status import served_status

        held = [n for n, _ in supervisor.items()]  # an on-demand deployment is recorded by its first load
        names = supervisor.store.names() + [n for n in held if n not in supervisor.store.names()]
        if name is not None and name not in names:
            raise DeploykitError(f"no deployment named {name!r} (known: {', '.join(names) or 'none'})")
        reports = []
        for n in [name] if name else names:
            dep = supervisor.get(n)
            reports.append(served_status(supervisor.store, n, dep.state() if dep is not None else None))
        return reports

    try:
        return JSONResponse(await run_in_threadpool(work))
    except Exception as exc:
        return _failed(exc)


@router.get("/history/{name}")
async def history(request: Request, name: str) -> JSONResponse:
    from ..control.revisions.report import history_rows

    try:
        return JSONResponse(await run_in_threadpool(history_rows, _supervisor(request).store, name))
    except Exception as exc:
        return _failed(exc)
