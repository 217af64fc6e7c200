"""What a supervisor serves, in one place behind one lock: the deployments that serve, the names still
loading for the first time, and why a declared one does not serve. A request for a listed name waits on
``when_served`` (a future: the event loop waits on it without holding a thread) until its load ends; a
served deployment is added before its name stops loading, so a reader always finds a declared name in one of
the two.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from concurrent.futures import Future
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .deployment import Deployment


STOPPING = "the server is stopping"  # ``why_not_served`` once the set closes


class ServedSet:
    """Thread-safe. ``errors`` are keyed by what failed (a manifest file, or ``revision of NAME``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._deployments: dict[str, Deployment] = {}
        self._loading: set[str] = set()
        self._errors: dict[str, str] = {}
        self._closing = False
        self._watchers: dict[str, list[Future[None]]] = {}  # ``when_served``'s futures, by name

    @property
    def closing(self) -> bool:
        return self._closing

    def begin_loading(self, names: Iterable[str]) -> None:
        with self._lock:
            self._loading.update(names)

    def end_loading(self, name: str) -> None:
        with self._lock:
            self._loading.discard(name)
            self._changed_now(name)

    def hold(self, name: str, dep: Deployment) -> bool:
        """Serve ``dep`` as ``name``; False (nothing held) once closing, or when another deployment serves
        the name (never overwritten: the displaced one would leak its thread and its model)."""
        with self._lock:
            if self._closing or self._deployments.get(name, dep) is not dep:
                return False
            self._deployments[name] = dep
            self._changed_now(name)
            return True

    def pop(self, name: str) -> Deployment | None:
        with self._lock:
            return self._deployments.pop(name, None)

    def get(self, name: str) -> Deployment | None:
        with self._lock:
            return self._deployments.get(name)

    def items(self) -> list[tuple[str, Deployment]]:
        with self._lock:
            return list(self._deployments.items())

    def loading_names(self) -> list[str]:
        """Names still loading for the first time (never one that serves)."""
        with self._lock:
            return sorted(self._loading - self._deployments.keys())

    def when_served(self, name: str) -> Future[None]:
        """A future that ends once ``name`` serves, stops loading (its first load or restore failed), or
        the set closes: at once if one of these holds already. Then ``get`` says which."""
        future: Future[None] = Future()
        with self._lock:
            if name in self._deployments or name not in self._loading or self._closing:
                future.set_result(None)
            else:
                self._watchers.setdefault(name, []).append(future)
        return future

    def _changed_now(self, name: str | None) -> None:
        """Under the lock: ``name`` began serving or stopped loading (None: the set closes)."""
        names = list(self._watchers) if name is None else [name]
        for key in names:
            for future in self._watchers.pop(key, []):
                future.set_result(None)

    def why_not_served(self, name: str) -> str | None:
        """Why a declared ``name`` does not serve (its load failed, or the server is stopping), if known."""
        with self._lock:
            if self._closing:
                return STOPPING
            return next((e for e in self._errors.values() if e.startswith(f"{name}: ")), None)

    def set_error(self, key: str, error: str | None) -> None:
        with self._lock:
            if error is None:
                self._errors.pop(key, None)
            else:
                self._errors[key] = error

    def errors(self) -> dict[str, str]:
        with self._lock:
            return dict(self._errors)

    def close(self) -> None:
        """Serve nothing more; requests waiting for a load are answered now."""
        with self._lock:
            self._closing = True
            self._changed_now(None)
