"""Watching manifests: watchdog events, debounced, deduplicated by content digest.

Directories are watched, not files: editors and ``git checkout`` replace a file by writing a new one
and renaming it over the old, which a watch on the old inode would miss. A burst of events (write,
rename, chmod) settles for ``debounce`` seconds, then the content of each watched path is hashed;
only a path whose digest changed (or that appeared or vanished) is reported, so ``touch`` and an
identical rewrite do nothing.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Callable, Iterable
from pathlib import Path

from watchdog.events import FileSystemEvent, FileSystemEventHandler
from watchdog.observers import Observer

from ...spec.manifest import manifest_files

log = logging.getLogger(__name__)


def digest(path: Path) -> str | None:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None


class ManifestWatcher:
    """Calls ``on_change(changed_paths)`` from its own thread after debounced, real content changes.

    ``paths`` are files or directories; for a directory every ``*.yaml``/``*.yml`` inside counts
    (new and removed files too).
    """

    def __init__(self, paths: Iterable[Path], on_change: Callable[[list[Path]], object], *,
                 debounce: float = 0.3) -> None:
        self.paths = [Path(p).resolve() for p in paths]
        self.on_change = on_change
        self.debounce = debounce
        self._dirty = threading.Event()
        self._stop = threading.Event()
        self._digests = self._snapshot()
        self._observer = Observer()
        self._thread = threading.Thread(target=self._loop, name="deploykit-watch", daemon=True)
        handler = _Handler(self)
        self._dirs = {p if p.is_dir() else p.parent for p in self.paths}
        for directory in sorted(self._dirs):
            self._observer.schedule(handler, str(directory), recursive=False)

    def _files(self) -> list[Path]:
        return [f for p in self.paths for f in manifest_files(p)]

    def _snapshot(self) -> dict[Path, str | None]:
        return {f: digest(f) for f in self._files()}

    def relevant(self, path: str) -> bool:
        # Any event in a watched directory may change a watched file (a rename onto it, say); the
        # digest comparison afterwards drops those that did not.
        p = Path(path)
        return p in self._dirs or p.parent in self._dirs

    def start(self) -> None:
        self._observer.start()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._dirty.set()
        self._observer.stop()
        self._observer.join(timeout=5)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=30)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._dirty.wait()
            if self._stop.is_set():
                return
            # Debounce: wait until no event has arrived for `debounce` seconds.
            while self._dirty.is_set() and not self._stop.is_set():
                self._dirty.clear()
                self._stop.wait(self.debounce)
            if self._stop.is_set():
                return
            current = self._snapshot()
            changed = [p for p in sorted(set(current) | set(self._digests))
                       if current.get(p) != self._digests.get(p)]
            self._digests = current
            if changed:
                try:
                    self.on_change(changed)
                except Exception:  # the callback reports its own errors; keep watching
                    log.exception("manifest change handler failed")


class _Handler(FileSystemEventHandler):
    def __init__(self, watcher: ManifestWatcher) -> None:
        self.watcher = watcher

    def on_any_event(self, event: FileSystemEvent) -> None:
        if event.event_type in ("opened", "closed_no_write"):
            return
        paths = [str(event.src_path), str(getattr(event, "dest_path", "") or "")]
        if any(p and self.watcher.relevant(p) for p in paths):
            self.watcher._dirty.set()
