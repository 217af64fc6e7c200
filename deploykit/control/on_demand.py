"""How a ``Deployment``'s model comes to serve: its first load (``load_initial``: the whole apply, then
serve), and the loads on demand when ``pin`` finds it serving nothing: under a host (``deploykit
serve``) a request finds an unloaded deployment loaded for it once the host has made room — a new
revision of an on-demand deployment by the whole apply, else the current revision from its laid-out
shards (``load_current``). A failed load on demand shows in ``status()`` like a failed reload.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from ..errors import DeploykitError
from .loading import checked_current, load_laid_out, serving_of
from .reconciler import ApplyOptions, ApplyOutcome, apply
from .reloads import describe

if TYPE_CHECKING:
    from collections.abc import Callable

    from ..artifacts.reshard import ProgressSink
    from ..spec.manifest import LoadedManifest
    from .host import Host
    from .pool import Generation, GenerationPool
    from .state import StateStore

log = logging.getLogger(__name__)


class OnDemandLoading:
    """The loads of ``Deployment`` and its ``pin``, over its pool, store, host and pending manifest."""

    if TYPE_CHECKING:
        name: str
        pool: GenerationPool
        store: StateStore
        host: Host | None
        acquire_timeout: float
        pending: LoadedManifest | None
        _verified: int | None
        _load_error: str | None
        devices: str | None
        last_outcome: ApplyOutcome | None

    def load_initial(self, loaded: LoadedManifest, *, force: bool = False, progress: ProgressSink | None = None,
                      on_step: Callable[[str], None] | None = None) -> None:
        """Apply ``loaded`` (or load its current revision, verified and health-checked) and serve it."""
        outcome = apply(loaded, store=self.store, options=ApplyOptions(
            devices=self.devices, keep_model=True, load_if_unchanged=True, force=force),
            progress=progress, on_step=on_step)
        assert outcome.loaded is not None
        self.pool.install(outcome.loaded, outcome.plan, outcome.revision or 0, "initial", serving_of(loaded))
        outcome.loaded = None  # the pool owns the model now: a kept outcome must not pin it
        self.last_outcome = outcome
        if outcome.revision is not None:
            self._verified = outcome.revision

    def pin(self, timeout: float | None = None) -> Generation:
        """The current generation, pinned (``pool.unpin`` it). An unloaded deployment is loaded first,
        once the host has made room (a ``BudgetError`` naming the budget if it cannot in time)."""
        timeout = self.acquire_timeout if timeout is None else timeout
        if self.host is None:
            return self.pool.pin(timeout)
        from .pool import NotLoaded

        deadline = time.monotonic() + timeout
        with self.host.wanted(self.name):  # busy from now: what loads for this request stays loaded
            while True:
                try:
                    return self.pool.pin(max(0.0, deadline - time.monotonic()))
                except NotLoaded:
                    self._load_for_request()

    def _load_for_request(self) -> None:
        """Load on demand; a failed load (not a lack of room) shows in ``status()`` like a failed reload."""
        from .budget import BudgetError

        assert self.host is not None
        try:
            self.host.load(self.name, self.load_current, reason="request")
        except BudgetError:
            raise
        except DeploykitError as exc:
            self._load_error = describe(exc, self.pending)
            log.warning("loading %s on demand failed: %s", self.name, self._load_error)
            raise
        self._load_error = None

    def load_current(self) -> None:
        """Load the current revision from its laid-out shards (no reshard) and serve it: shards checked
        (by hash the first time this process loads that revision, by presence and size after), then
        loaded and health-checked."""
        if self.pending is not None:  # a new revision of an on-demand deployment: the whole apply, now
            self.load_initial(self.pending)
            self.pending = None
            return
        current = checked_current(self.store, self.name, verified=self._verified)
        self._verified = current.revision
        model, plan, serving = load_laid_out(current)
        self.pool.install(model, plan, current.revision, "on-demand", serving)
