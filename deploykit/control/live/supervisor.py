"""The deployments of one manifest file or directory, kept in step with the files, and those the control
API hands over: the facade ``deploykit serve`` holds. It composes the parts, each run by threads of its
own, and the views every answer reads:

- ``roster``: what serves and what is loading, who owns each name, one change of a name at a time, and
  ``create``, the one way a deployment comes to exist;
- ``files`` (``FollowedFiles``): the files followed and the names they own (the start's loads, the
  watcher's thread, the add threads);
- ``api_changes`` (``ApiChanges``): apply, rollback, delete, prune and restore (the control API's task
  threads, ``tasks``);
- here: start and close (every thread above joined), and the views (``statuses``, ``ready``), built from
  one snapshot of each deployment (``status``).

Each deployment changes on its own worker: a slow reload of one never delays another's. Readiness means
every deployment can serve: a deployment whose newest manifest is broken but whose last good generation
serves is ready (the pending error shows in ``statuses()``, ``deploykit status`` and a metric); one still
loading, or one that never loaded, is not.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...threads import ThreadGroup
from ..admission import Policy
from ..budget.host import Host
from ..revisions.state import StateStore
from .api_changes import ApiChanges
from .deployment import Deployment
from .files import FollowedFiles
from .roster import Roster
from .served import ServedSet
from .status import not_ready as not_serving
from .status import served_status

if TYPE_CHECKING:
    from ...artifacts.reshard import ProgressSink
    from ...spec.manifest import LoadedManifest
    from ..revisions.change import Change
    from ..revisions.reconciler import ApplyOutcome
    from ..revisions.state import Revision

log = logging.getLogger(__name__)
StepSink = Callable[[str], None]


class Supervisor:
    """Holds the deployments of ``path`` (None: no files; the recorded deployments, restored at
    start) and follows the files. ``rollback_owned``: the files are a git source's published commit, and
    ``rollback`` may serve a recorded revision of a name they own (an emergency; the files stay its owner).
    ``policy``: the operator's (default ``Policy()``: no engine binary, remote
    code or cluster), which every manifest of every source passes before it becomes live. ``host``: the
    budget every deployment loads under (default: ``Host.unlimited()``, no budget); ``close`` stops it."""

    def __init__(self, path: Path | None, *, store: StateStore, devices: str | None = None, prune: bool = False,
                 debounce: float = 0.3, host: Host | None = None, policy: Policy | None = None,
                 rollback_owned: bool = False) -> None:
        self.path = Path(path).resolve() if path is not None else None
        self.roster = Roster(store=store, devices=devices, host=host or Host.unlimited(), policy=policy or Policy())
        self.files = (FollowedFiles(self.roster, self.path, prune=prune, debounce=debounce)
                      if self.path is not None else None)
        self.api_changes = ApiChanges(self.roster, self.files, rollback_owned=rollback_owned)
        self.close_timeout = 120.0  # how long close waits for loads under way
        self._starting = False
        self._started = threading.Event()  # start() returned
        self.tasks = ThreadGroup()  # changes asked through the control API, each on a thread of its own

    @property
    def store(self) -> StateStore:
        return self.roster.store

    @property
    def policy(self) -> Policy:
        """What every manifest this supervisor makes live is admitted under (``admission.admit``)."""
        return self.roster.policy

    @property
    def devices(self) -> str | None:
        return self.roster.devices

    @property
    def host(self) -> Host:
        return self.roster.host

    @property
    def served(self) -> ServedSet:
        return self.roster.served

    def manifest_files(self) -> list[Path]:
        return self.files.manifest_files() if self.files is not None else []

    def start(self) -> None:
        """Load every file's deployments (in parallel, one worker each), then follow the files.
        Without a path: restore every recorded deployment instead."""
        self._starting = True
        try:
            self.host.start()
            if self.files is None:
                self.api_changes.restore()
            else:
                self.files.start()
        finally:
            self._started.set()

    @property
    def deployments(self) -> dict[str, Deployment]:
        """The deployments that serve now (a copy)."""
        return dict(self.roster.served.items())

    def problems(self) -> dict[str, str]:
        """manifest file -> why it (or a deployment it declares) does not serve."""
        return self.roster.served.errors()

    def owner(self, name: str) -> Path | None:
        """The watched file that owns ``name``, if any (it alone may change the deployment)."""
        return self.roster.owners.file_of(name)

    # ---- the control API: deployments handed over without a file (``api_changes``) ---------------

    def restore(self) -> None:
        """Serve every deployment the state store records with a current revision."""
        self.api_changes.restore()

    def apply_manifest(self, loaded: LoadedManifest, *, dry_run: bool = False, force: bool = False,
                       progress: ProgressSink | None = None, on_step: StepSink | None = None,
                       on_wait: StepSink | None = None, what: str = "apply",
                       devices: str | None = None) -> ApplyOutcome:
        """Make ``loaded`` what serves under its name: a new deployment, or a rollout of the one that
        serves (blue-green/recreate as its manifest says). Recorded in the state store, so a restart
        without a path restores it. Raises what the apply raised; what served keeps serving.
        ``dry_run`` says what it would do (planned against ``devices`` if given) and changes nothing."""
        return self.api_changes.apply_manifest(loaded, dry_run=dry_run, force=force, progress=progress,
                                               on_step=on_step, on_wait=on_wait, what=what, devices=devices)

    def dry_run(self, change: Change, *, force: bool = False) -> ApplyOutcome:
        """What applying ``change`` would do here (planned against this server's inventory), changing nothing."""
        return self.api_changes.dry_run(change, force=force)

    def rollback(self, name: str, *, to_revision: int | None = None, progress: ProgressSink | None = None,
                 on_step: StepSink | None = None, on_wait: StepSink | None = None) -> tuple[Revision, ApplyOutcome]:
        """Re-apply a recorded revision's manifest (``lifecycle.rollback_target`` chooses) and serve it; during
        a gated rollout, end it instead (the serving revision stays)."""
        return self.api_changes.rollback(name, to_revision=to_revision, progress=progress, on_step=on_step,
                                         on_wait=on_wait)

    def delete(self, name: str, *, keep_shards: bool = False, reason: str = "deleted",
               on_wait: StepSink | None = None) -> None:
        """Stop serving ``name`` (running requests drain), free its memory, forget it in the store and
        remove its shards unless ``keep_shards``."""
        self.api_changes.delete(name, keep_shards=keep_shards, reason=reason, on_wait=on_wait)

    def prune_directory(self, directory: Path, *, keep: set[str]) -> list[str]:
        """Delete the deployments whose manifests lived in ``directory`` and are not in ``keep`` (names
        a watched file owns are left to the watcher)."""
        return self.api_changes.prune_directory(directory, keep=keep)

    # ---- views: one snapshot of each deployment per answer ---------------------------------------

    def get(self, name: str) -> Deployment | None:
        return self.roster.get(name)

    def loading_names(self) -> list[str]:
        """Names declared by a file or applied, still loading for the first time (never one that serves)."""
        return self.roster.served.loading_names()

    def items(self) -> list[tuple[str, Deployment]]:
        return self.roster.served.items()

    def when_served(self, name: str) -> Future[None]:
        return self.roster.served.when_served(name)

    def why_not_served(self, name: str) -> str | None:
        return self.roster.served.why_not_served(name)

    def statuses(self) -> list[dict[str, Any]]:
        out = [served_status(self.store, name, dep.state()) for name, dep in self.items()]
        out += [{"name": n, "phase": "Progressing", "serving_revision": None, "last_error": None}
                for n in self.loading_names()]
        out += [{"name": None, "manifest": f, "phase": "Failed", "last_error": e}
                for f, e in self._unserved_errors(self.items())]
        return out

    def _unserved_errors(self, items: list[tuple[str, Deployment]]) -> list[tuple[str, str]]:
        """Errors of files none of whose deployments serve (a served one shows its own error)."""
        served = {self.owner(n) for n, _ in items}
        return [(f, e) for f, e in self.problems().items() if Path(f) not in served]

    def ready(self) -> tuple[bool, list[str]]:
        """(every deployment can serve, what cannot)."""
        items = self.items()
        not_ready = not_serving([d.state() for _, d in items])
        not_ready += [f"{n}: loading" for n in self.loading_names()]
        not_ready += [f"{f}: {e}" for f, e in self._unserved_errors(items)]
        return (not not_ready and bool(items)), not_ready

    # ---- stopping ----------------------------------------------------------------------------------

    def interrupt(self, reason: str = "the server is stopping") -> None:
        """The server is stopping (SIGTERM): every gated rollout in progress ends now, and none starts, so
        that nothing waits behind a canary's step (any thread; ``close`` follows)."""
        for _, dep in self.items():
            dep.interrupt(reason)
        self.host.interrupt()  # a load waiting for room (a start, a request's load) ends now

    def close(self) -> None:
        self.roster.served.close()  # requests waiting for a load are answered: the server is stopping
        self.interrupt()  # first: an apply waiting on a canary's step ends, so its task can be joined
        if self.files is not None:
            self.files.stop()
        if self._starting:
            self._started.wait(self.close_timeout)  # the first loads end first (each loaded late is closed)
        left = self.roster.adds.join(self.close_timeout) + self.tasks.join(self.close_timeout)
        if left:  # loads under way end first (one loaded late is closed)
            log.warning("still loading after %gs: %s", self.close_timeout, ", ".join(left))
        for _, dep in self.items():
            dep.interrupt("the server is stopping")  # loaded meanwhile: the same reason
            dep.close()
        self.host.stop()
