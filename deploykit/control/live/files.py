"""The manifest files a supervisor follows, and the names they own. Runs on the threads of a supervisor's
start (its first loads, in parallel), on the watcher's thread (a file saved, added or removed) and on the
add threads it starts (a new file's deployments, a deleted name's heir), which ``Roster.adds`` joins.

A file's deployment is created only once the file owns its name (``Owners.claim_for_file``): a name the
control API deployed first makes the file *in conflict* on it, shown as that deployment's error. A saved
file reloads its deployments on their own change threads; a removed one hands each name to another file
that declares it (a renamed manifest), else prunes it with ``--prune``, else its deployments keep serving.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ...errors import DeploykitError
from ...spec.manifest import load_manifests, manifest_files
from .deployment import Deployment
from .roster import Roster
from .watcher import ManifestWatcher

log = logging.getLogger(__name__)


class FollowedFiles:
    """The files of ``path`` (a manifest file or directory) and the deployments they own."""

    def __init__(self, roster: Roster, path: Path, *, prune: bool, debounce: float) -> None:
        self.roster = roster
        self.path = path
        self.prune = prune
        self.debounce = debounce
        self._watcher: ManifestWatcher | None = None
        self._watching = threading.Lock()  # start's watcher against a stop (a close during the first loads)
        self._stopped = False

    def manifest_files(self) -> list[Path]:
        return [f for f in manifest_files(self.path) if f.exists()]

    def start(self) -> None:
        """Load every file's deployments (in parallel, one worker each), then follow the files."""
        files = sorted(self.manifest_files())
        declared = [(file, self.names(file)) for file in files]
        for file, names in declared:  # in path order, before the parallel loads: the first file owns a name
            for name in names:
                self.roster.owners.claim_for_file(name, file)
        self.roster.served.begin_loading(name for _, names in declared for name in names)
        if len(files) > 1:
            from ...model.hf import preload

            preload()  # before the loads run in parallel
        with ThreadPoolExecutor(max_workers=max(1, min(4, len(files))), thread_name_prefix="deploykit-load") as pool:
            for file, names in declared:
                pool.submit(self.add, file, names)
        with self._watching:
            if self._stopped:  # closed while the first loads ran: nothing to follow
                return
            self._watcher = ManifestWatcher([self.path], self._on_change, debounce=self.debounce)
            self._watcher.start()

    def stop(self) -> None:
        """Follow the files no more (joins the watcher); a watcher not started yet never starts."""
        with self._watching:
            self._stopped = True
            watcher = self._watcher
        if watcher is not None:
            watcher.stop()

    def set_error(self, file: Path, error: str | None) -> None:
        self.roster.served.set_error(str(file), error)

    def names(self, file: Path) -> list[str]:
        """The names ``file`` declares now (none when it cannot be read: its error is recorded); a conflict
        on a name it no longer declares is over."""
        try:
            names = [m.name for m in load_manifests(file)]
        except DeploykitError as exc:
            self.set_error(file, str(exc))
            log.error("%s", exc)
            return []
        self.set_error(file, None)
        for name in self.roster.owners.drop_conflicts(file, keep=set(names)):
            self.roster.show_conflict(name)
        return names

    def add(self, file: Path, names: list[str]) -> None:
        for name in names:
            try:
                self.add_one(file, name)
            except DeploykitError as exc:
                self.set_error(file, f"{name}: {exc}")
                log.error("%s: %s could not be deployed: %s", file, name, exc)
            except Exception as exc:  # a bug, or a library failing oddly: report it, keep the others
                self.set_error(file, f"{name}: internal error: {type(exc).__name__}: {exc}")
                log.exception("%s: %s could not be deployed", file, name)

    def add_later(self, file: Path, names: list[str]) -> None:
        """``add`` on a thread of its own (listed as loading from now), joined when the supervisor closes."""
        self.roster.served.begin_loading([n for n in names if self.roster.get(n) is None])
        self.roster.adds.start(self.add, file, names, name="deploykit-add")

    def add_one(self, file: Path, name: str) -> Deployment | None:
        """Deploy ``name`` from ``file`` if the file owns it (None when it does not, or it serves already)."""
        with self.roster.turns.exclusive(name, "load"):
            return self.add_owned(file, name)

    def add_owned(self, file: Path, name: str) -> Deployment | None:
        """``add_one`` with the name's turn held."""
        roster = self.roster

        def claim() -> bool:
            found = roster.owners.claim_for_file(name, file)
            if found.conflict is not None:
                log.error("%s", found.conflict)
                roster.show_conflict(name)
            return found.ok

        dep = roster.create(name, claim, lambda: Deployment.from_manifest(
            file, name=name, devices=roster.devices, store=roster.store, host=roster.host, policy=roster.policy))
        if dep is not None and roster.owners.conflict_of(name) is not None:
            roster.show_conflict(name)  # another file declares the name too
        if dep is not None:
            log.info("%s: serving %s (generation %d)", file, name, dep.generation)
        return dep

    def _on_change(self, changed: list[Path]) -> None:
        for file in changed:
            owned = self.roster.owners.names_of(file)
            if not file.exists():
                self.file_removed(file, owned)
                continue
            for name in owned:
                dep = self.roster.get(name)
                if dep is not None:
                    dep.request_reload()
            new = [n for n in self.names(file) if self.roster.get(n) is None or self.roster.owners.owned_by_api(n)]
            if new:
                self.add_later(file, new)

    def file_removed(self, file: Path, owned: list[str]) -> None:
        self.set_error(file, None)
        for name in self.roster.owners.drop_conflicts(file, keep=set()):
            self.roster.show_conflict(name)
        for name in owned:
            heir = self._heir(file, name) if self.roster.owners.conflict_of(name) is None else None
            if heir is not None:  # a renamed manifest: the deployment follows its new file, never pruned
                self._hand_over(name, heir)
            elif self.prune:  # on a thread of its own: it waits for the name's turn, not the watcher
                self.roster.adds.start(self._remove, name, name="deploykit-prune")
            else:
                log.warning("%s was removed; %s keeps serving (use --prune to remove it)", file, name)

    def _heir(self, removed: Path, name: str) -> Path | None:
        """Another followed file that declares ``name`` now, if any (the first in path order): a manifest
        renamed (a file in conflict on the name is the heir of a prune instead: ``_remove``)."""
        for file in sorted(self.manifest_files()):
            if file == removed:
                continue
            try:
                if name in (m.name for m in load_manifests(file)):
                    return file
            except DeploykitError:
                continue  # its error is said when its own change is seen
        return None

    def _hand_over(self, name: str, heir: Path) -> None:
        self.roster.owners.hand_over(name, heir)
        dep = self.roster.get(name)
        if dep is not None:
            dep.manifest_path = heir
            dep.request_reload()  # the new file's content, as a saved file's
        log.info("%s now owns %s (its file was removed)", heir, name)

    def _remove(self, name: str) -> None:
        """Prune ``name`` with its turn held, so that no API apply or delete of it runs meanwhile (one that
        waited runs after, on a name that is gone); a file in conflict on it then owns it."""
        from ..revisions.lifecycle import delete

        try:
            with self.roster.turns.exclusive(name, "prune"):
                dep = self.roster.served.pop(name)
                heir = self.roster.owners.release(name)
                if dep is not None:
                    dep.close()
                self.roster.forget(name)
                delete(self.roster.store, name, reason="manifest removed; deployment pruned")
                log.info("pruned %s", name)
        except Exception:
            log.exception("%s could not be pruned", name)
            return
        if heir is not None and heir.exists():
            log.info("%s now owns %s", heir, name)
            self.add_later(heir, [name])
