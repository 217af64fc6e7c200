"""The point of no return of a change that makes a new generation serve: a revision is recorded Ready only
once it serves.

    build the generation (its runtime: batching engine, adapters) -> record the revision Ready -> make it
    current (a swap under the pool's lock: nothing can fail there)

Anything that fails before the swap gives the new generation up (freed) and records the revision Failed with
the reason, so the store never names as current a revision that nothing serves: a restart, or a recreate's
restore, loads the last revision that did serve. Used by every path that installs a newly applied revision
(a first load, blue-green, recreate); a canary's promotion does the same in ``canary.GatedRollout``. It
must never record Ready before the runtime exists.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from ...errors import DeploykitError
from ..revisions.layouts import collect_old_shards
from ..revisions.reconciler import finish_gated

if TYPE_CHECKING:
    from ...engine.serving import ServingSpec
    from ...spec.manifest import LoadedManifest
    from ..revisions.reconciler import ApplyOutcome
    from ..revisions.state import StateStore
    from .pool import Generation, GenerationPool

log = logging.getLogger(__name__)


def serve_applied(pool: GenerationPool, store: StateStore, loaded: LoadedManifest, outcome: ApplyOutcome,
                  strategy: str, serving: ServingSpec, *, commit: Callable[[], None] | None = None) -> Generation:
    """Make ``outcome``'s model (applied with ``ApplyOptions(gated=True)``: loaded, checked, left
    Progressing) the current generation of ``pool``, recording its revision Ready just before the swap;
    an outcome without a new revision (a restart loading the current one) is installed as it is.
    ``commit``: the rollout's point of no return, which raises when it was aborted meanwhile (the model is
    then closed and the revision recorded Failed, as for a runtime that cannot be built)."""
    model, revision = outcome.loaded, outcome.revision
    assert model is not None
    outcome.loaded = None  # the pool owns the model from here: a kept outcome must not pin it
    if outcome.status != "applied" or revision is None:
        return pool.install(model, outcome.plan, revision or 0, strategy, serving)
    try:
        if commit is not None:
            commit()
        gen = pool.build(model, outcome.plan, revision, strategy, serving)
    except BaseException as exc:
        _close(model)
        _failed(store, loaded, revision, exc, outcome)
        raise
    try:
        finish_gated(loaded, store, revision, ready=True, reason=outcome.health, timings=outcome.timings,
                     collect=False)
    except BaseException as exc:
        pool.abandon(gen)
        _failed(store, loaded, revision, exc, outcome)
        raise
    pool.put(gen)  # recorded Ready: it serves from here
    try:
        collect_old_shards(loaded, store)
    except Exception:  # the promotion stands; the next one tries again
        log.exception("%s: removing old shards failed; they stay on disk", loaded.name)
    return gen


def _close(model: object) -> None:
    runtime = getattr(model, "runtime", None)
    if runtime is not None:
        try:
            runtime.close()
        except Exception:
            log.exception("closing a generation that never served failed")


def _failed(store: StateStore, loaded: LoadedManifest, revision: int, exc: BaseException,
            outcome: ApplyOutcome) -> None:
    reason = str(exc) if isinstance(exc, DeploykitError) else f"{type(exc).__name__}: {exc}"
    try:
        finish_gated(loaded, store, revision, ready=False, reason=reason or type(exc).__name__,
                     timings=outcome.timings)
    except Exception:  # the store itself failed: the revision stays Progressing, the next start says so
        log.exception("%s: recording revision %d Failed failed", loaded.name, revision)
