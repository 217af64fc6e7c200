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
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from ..control.supervisor import Supervisor

log = logging.getLogger(__name__)
_BUCKETS = (0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600, float("inf"))


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
        pending = GaugeMetricFamily("deploykit_pending_error", "1 while the newest manifest could not be "
                                    "rolled out and the last good generation serves", labels=["deployment"])
        for name, dep in self.supervisor.items():
            status = dep.status()
            reloads.add_metric([name], status["reloads"]["total"])
            failed.add_metric([name], status["reloads"]["failed"])
            pending.add_metric([name], 1 if status["last_error"] else 0)
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
        yield from (reloads, failed, duration, generation, in_flight, device_bytes, pending)


def make_server(supervisor: Supervisor, *, host: str = "127.0.0.1", port: int = 8765) -> ThreadingHTTPServer:
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
