"""`deploykit serve PATH`: hold every deployment of a manifest or a directory of manifests, follow the
files, and answer health, status and metrics on localhost.

    /healthz   200 while the process runs
    /readyz    200 when every deployment serves a Ready generation, else 503 with the ones that do not
    /status    JSON: one object per deployment, the shape of `deploykit status -o json` plus the live
               generation, in-flight requests and reload counts
    /metrics   Prometheus text (prometheus-client): reloads, failed reloads, reload duration,
               generation, bytes per device, in-flight requests

A changed manifest reloads its deployment (``Deployment.reload``: the last good generation serves
until the new one is ready, and keeps serving if it fails). A new file adds deployments; a removed
file's deployments keep serving unless ``--prune``. SIGTERM or SIGINT stops watching, drains
in-flight work and frees every model.

Binds 127.0.0.1 only: it exposes operations, not inference (see examples/service.py for that).
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from .errors import DeploykitError
from .manifest import load_manifests
from .runtime import Deployment
from .state import StateStore
from .watcher import ManifestWatcher

log = logging.getLogger(__name__)
DEFAULT_PORT = 8765
_BUCKETS = (0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600, float("inf"))


class Supervisor:
    """The deployments of one manifest file or directory, kept in step with the files."""

    def __init__(self, path: Path, *, store: StateStore, devices: str | None = None, prune: bool = False,
                 debounce: float = 0.3) -> None:
        self.path = Path(path).resolve()
        self.store = store
        self.devices = devices
        self.prune = prune
        self.debounce = debounce
        self.deployments: dict[str, Deployment] = {}
        self.files: dict[str, Path] = {}  # deployment name -> manifest file
        self.errors: dict[str, str] = {}  # manifest file -> why it could not be loaded
        self._lock = threading.Lock()
        self._watcher: ManifestWatcher | None = None

    def manifest_files(self) -> list[Path]:
        if self.path.is_dir():
            return sorted(p for p in self.path.iterdir() if p.suffix in (".yaml", ".yml") and p.is_file())
        return [self.path] if self.path.exists() else []

    def start(self) -> None:
        for file in self.manifest_files():
            self._add_file(file)
        self._watcher = ManifestWatcher([self.path], self._on_change, debounce=self.debounce)
        self._watcher.start()

    def _add_file(self, file: Path) -> None:
        try:
            names = [m.name for m in load_manifests(file)]
        except DeploykitError as exc:
            self.errors[str(file)] = str(exc)
            log.error("%s", exc)
            return
        for name in names:
            if name in self.deployments:
                continue
            try:
                dep = Deployment.from_manifest(file, name=name, devices=self.devices,
                                               state_dir=self.store.directory)
            except DeploykitError as exc:
                self.errors[str(file)] = f"{name}: {exc}"
                log.error("%s: %s could not be deployed: %s", file, name, exc)
                continue
            with self._lock:
                self.deployments[name] = dep
                self.files[name] = file
            self.errors.pop(str(file), None)
            log.info("%s: serving %s (generation %d)", file, name, dep.generation)

    def _on_change(self, changed: list[Path]) -> None:
        for file in changed:
            owned = [n for n, f in self.files.items() if f == file]
            if not file.exists():
                for name in owned:
                    if self.prune:
                        self._remove(name)
                    else:
                        log.warning("%s was removed; %s keeps serving (use --prune to remove it)", file, name)
                continue
            for name in owned:
                self.deployments[name].reload()
            self._add_file(file)  # new names in this file (or a file that failed before)

    def _remove(self, name: str) -> None:
        with self._lock:
            dep = self.deployments.pop(name)
            self.files.pop(name, None)
        dep.close()
        self.store.forget(name)
        log.info("pruned %s", name)

    def statuses(self) -> list[dict[str, Any]]:
        with self._lock:
            items = list(self.deployments.items())
        out = []
        for name, dep in items:
            report = self.store.status(name)
            live = dep.status()
            report.update({"phase": live["phase"], "generation": live["generation"],
                           "serving_revision": live["revision"], "in_flight": live["in_flight"],
                           "reloads": live["reloads"]})
            if live["last_error"]:
                report["last_error"] = live["last_error"]
            out.append(report)
        return out

    def ready(self) -> tuple[bool, list[str]]:
        with self._lock:
            items = list(self.deployments.items())
        not_ready = [n for n, d in items if not d.status()["serving"]]
        not_ready += [f"{f}: {e}" for f, e in self.errors.items()]
        return (not not_ready and bool(items)), not_ready

    def close(self) -> None:
        if self._watcher is not None:
            self._watcher.stop()
        with self._lock:
            deployments = list(self.deployments.values())
        for dep in deployments:
            dep.close()


class _Metrics:
    """A prometheus-client collector that reads the deployments at scrape time."""

    def __init__(self, supervisor: Supervisor) -> None:
        self.supervisor = supervisor

    def collect(self) -> Iterator[Any]:
        reloads = CounterMetricFamily("deploykit_reloads", "Reloads attempted", labels=["deployment"])
        failed = CounterMetricFamily("deploykit_reload_failures", "Reloads that failed; the last good "
                                     "generation kept serving", labels=["deployment"])
        duration = HistogramMetricFamily("deploykit_reload_duration_seconds", "Manifest change to new "
                                         "generation serving (or to failure)", labels=["deployment"])
        generation = GaugeMetricFamily("deploykit_generation", "Generation serving", labels=["deployment"])
        in_flight = GaugeMetricFamily("deploykit_in_flight_requests", "Callers holding a generation",
                                      labels=["deployment"])
        device_bytes = GaugeMetricFamily("deploykit_device_bytes", "Bytes placed per device by the serving "
                                         "plan", labels=["deployment", "device"])
        with self.supervisor._lock:
            items = list(self.supervisor.deployments.items())
        for name, dep in items:
            status = dep.status()
            reloads.add_metric([name], len(dep.reloads))
            failed.add_metric([name], sum(not r.ok for r in dep.reloads))
            buckets, total = [], 0.0
            for bound in _BUCKETS:
                buckets.append((str(bound) if bound != float("inf") else "+Inf",
                                sum(r.seconds <= bound for r in dep.reloads)))
            total = sum(r.seconds for r in dep.reloads)
            duration.add_metric([name], buckets, total)
            generation.add_metric([name], status["generation"])
            in_flight.add_metric([name], status["in_flight"])
            for device in status["plan"] or []:
                device_bytes.add_metric([name, str(device["device"])], device["bytes"])
        yield from (reloads, failed, duration, generation, in_flight, device_bytes)


def make_server(supervisor: Supervisor, *, host: str = "127.0.0.1", port: int = DEFAULT_PORT) -> ThreadingHTTPServer:
    registry = CollectorRegistry(auto_describe=True)
    registry.register(_Metrics(supervisor))

    class Handler(BaseHTTPRequestHandler):
        def _send(self, code: int, body: bytes, content_type: str = "application/json") -> None:
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
            if self.path == "/healthz":
                self._send(200, b'{"ok": true}')
            elif self.path == "/readyz":
                ok, missing = supervisor.ready()
                self._send(200 if ok else 503, json.dumps({"ready": ok, "not_ready": missing}).encode())
            elif self.path == "/status":
                self._send(200, json.dumps(supervisor.statuses(), indent=2).encode())
            elif self.path == "/metrics":
                self._send(200, generate_latest(registry), "text/plain; version=0.0.4")
            else:
                self._send(404, b'{"error": "not found"}')

        def log_message(self, format: str, *args: Any) -> None:  # quiet: scrapes are frequent
            log.debug(format, *args)

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    return server
