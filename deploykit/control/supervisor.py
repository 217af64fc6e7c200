"""The deployments of one manifest file or directory, kept in step with the files.

Each deployment reloads on its own worker (``Deployment.request_reload``): a slow reload of one (a
70B reshard) never delays another's. At start, every deployment a file declares is known before any
loads, so readiness can say which are still loading.

Readiness means every deployment can serve: a deployment whose newest manifest is broken but whose
last good generation serves is ready (the pending error shows in ``statuses()``, ``deploykit status``
and a metric); one still loading, or one that never loaded, is not.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ..errors import DeploykitError
from ..spec.manifest import load_manifests, manifest_files
from .deployment import Deployment
from .report import status_report
from .state import StateStore
from .watcher import ManifestWatcher

log = logging.getLogger(__name__)


class Supervisor:
    """Holds the deployments of ``path`` and follows the files."""

    def __init__(self, path: Path, *, store: StateStore, devices: str | None = None, prune: bool = False,
                 debounce: float = 0.3) -> None:
        self.path = Path(path).resolve()
        self.store = store
        self.devices = devices
        self.prune = prune
        self.debounce = debounce
        self.deployments: dict[str, Deployment] = {}
        self.files: dict[str, Path] = {}  # deployment name -> manifest file
        self.errors: dict[str, str] = {}  # manifest file -> why it (or a deployment in it) is not serving
        self.loading: set[str] = set()  # names declared by a file, not yet serving
        self._lock = threading.Lock()
        self._watcher: ManifestWatcher | None = None

    def manifest_files(self) -> list[Path]:
        return [f for f in manifest_files(self.path) if f.exists()]

    def start(self) -> None:
        """Load every file's deployments (in parallel, one worker each), then follow the files."""
        files = self.manifest_files()
        declared = [(file, self._names(file)) for file in files]
        with self._lock:
            self.loading.update(name for _, names in declared for name in names)
        if len(files) > 1:
            from ..model.hf import preload

            preload()  # before the loads run in parallel
        with ThreadPoolExecutor(max_workers=max(1, min(4, len(files))), thread_name_prefix="deploykit-load") as pool:
            for file, names in declared:
                pool.submit(self._add, file, names)
        self._watcher = ManifestWatcher([self.path], self._on_change, debounce=self.debounce)
        self._watcher.start()

    def _names(self, file: Path) -> list[str]:
        try:
            names = [m.name for m in load_manifests(file)]
        except DeploykitError as exc:
            self.errors[str(file)] = str(exc)
            log.error("%s", exc)
            return []
        self.errors.pop(str(file), None)
        return names

    def _add(self, file: Path, names: list[str]) -> None:
        for name in names:
            if name in self.deployments:
                continue
            try:
                dep = Deployment.from_manifest(file, name=name, devices=self.devices, store=self.store)
            except DeploykitError as exc:
                self.errors[str(file)] = f"{name}: {exc}"
                log.error("%s: %s could not be deployed: %s", file, name, exc)
                continue
            except Exception as exc:  # a bug, or a library failing oddly: report it, keep the others
                self.errors[str(file)] = f"{name}: internal error: {type(exc).__name__}: {exc}"
                log.exception("%s: %s could not be deployed", file, name)
                continue
            finally:
                with self._lock:
                    self.loading.discard(name)
            with self._lock:
                self.deployments[name] = dep
                self.files[name] = file
            log.info("%s: serving %s (generation %d)", file, name, dep.generation)

    def _on_change(self, changed: list[Path]) -> None:
        for file in changed:
            with self._lock:
                owned = [n for n, f in self.files.items() if f == file]
            if not file.exists():
                self._file_removed(file, owned)
                continue
            for name in owned:
                self.deployments[name].request_reload()
            new = [n for n in self._names(file) if n not in self.deployments]
            if new:
                with self._lock:
                    self.loading.update(new)
                threading.Thread(target=self._add, args=(file, new), daemon=True,
                                 name="deploykit-add").start()

    def _file_removed(self, file: Path, owned: list[str]) -> None:
        self.errors.pop(str(file), None)
        for name in owned:
            if self.prune:
                self._remove(name)
            else:
                log.warning("%s was removed; %s keeps serving (use --prune to remove it)", file, name)

    def _remove(self, name: str) -> None:
        from .lifecycle import delete

        with self._lock:
            dep = self.deployments.pop(name)
            self.files.pop(name, None)
        dep.close()
        delete(self.store, name, reason="manifest removed; deployment pruned")
        log.info("pruned %s", name)

    def get(self, name: str) -> Deployment | None:
        with self._lock:
            return self.deployments.get(name)

    def loading_names(self) -> list[str]:
        with self._lock:
            return sorted(self.loading)

    def items(self) -> list[tuple[str, Deployment]]:
        with self._lock:
            return list(self.deployments.items())

    def statuses(self) -> list[dict[str, Any]]:
        out = []
        for name, dep in self.items():
            report = status_report(self.store, name)
            live = dep.status()
            report.update({"phase": live["phase"], "generation": live["generation"],
                           "serving_revision": live["revision"], "in_flight": live["in_flight"],
                           "reloads": live["reloads"]})
            if live["last_error"]:
                report["last_error"] = live["last_error"]
            out.append(report)
        with self._lock:
            loading = sorted(self.loading)
        out += [{"name": n, "phase": "Progressing", "serving_revision": None, "last_error": None}
                for n in loading]
        served = {self.files[n] for n in self.deployments if n in self.files}
        out += [{"name": None, "manifest": f, "phase": "Failed", "last_error": e}
                for f, e in self.errors.items() if Path(f) not in served]
        return out

    def ready(self) -> tuple[bool, list[str]]:
        """(every deployment can serve, what cannot)."""
        items = self.items()
        not_ready = [n for n, d in items if not d.status()["serving"]]
        with self._lock:
            not_ready += [f"{n}: loading" for n in sorted(self.loading)]
            served = {self.files[n] for n, _ in items if n in self.files}
        not_ready += [f"{f}: {e}" for f, e in self.errors.items() if Path(f) not in served]
        return (not not_ready and bool(items)), not_ready

    def close(self) -> None:
        if self._watcher is not None:
            self._watcher.stop()
        for _, dep in self.items():
            dep.close()
