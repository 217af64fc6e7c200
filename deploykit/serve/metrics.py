"""Prometheus metrics of the server, in vLLM's style with a ``deploykit_`` prefix.

Request metrics (time to first token, latency, tokens) are recorded as requests run, labelled by model
and generation; state (requests running and waiting, reloads, generation, bytes per device) is read from
the deployments at scrape time, so it is never stale.
"""

from __future__ import annotations

import threading

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

if TYPE_CHECKING:
    from ..control.budget.host import Host
    from ..control.live.status import LiveStatus
    from ..control.sources.worker import Sources
    from .openai.common import Registry

_LABELS = ("model_name", "generation")
_LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, float("inf"))
_LOAD_BUCKETS = (0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, float("inf"))
_RELOAD_BUCKETS = (0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600, float("inf"))


class ServingMetrics:
    """The request-time metrics of one app, in its own registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.time_to_first_token = Histogram(
            "deploykit_time_to_first_token_seconds", "Time from submission to the first generated token",
            _LABELS, buckets=_LATENCY_BUCKETS, registry=registry)
        self.request_latency = Histogram(
            "deploykit_e2e_request_latency_seconds", "Time from submission to the last token", _LABELS,
            buckets=_LATENCY_BUCKETS, registry=registry)
        self.prompt_tokens = Counter("deploykit_prompt_tokens", "Prompt tokens processed", _LABELS,
                                     registry=registry)
        self.generation_tokens = Counter("deploykit_generation_tokens", "Tokens generated", _LABELS,
                                         registry=registry)
        self.client_disconnects = Counter("deploykit_client_disconnects", "Requests whose client closed the "
                                          "connection before the answer ended (each was cancelled)",
                                          ["model_name"], registry=registry)
        self.requests = Counter("deploykit_generation_requests", "Text requests that ran to their end, per "
                                "generation (a canary's split)", _LABELS, registry=registry)
        self.relayed_speculation = RelayedSpeculation()
        self.embedding_inputs = Counter("deploykit_embedding_inputs", "Texts embedded", _LABELS,
                                        registry=registry)

    @staticmethod
    def labels(model: str, generation: int) -> tuple[str, str]:
        return model, str(generation)


class RelayedSpeculation:
    """Drafted and accepted tokens that llama-server reported with each answer (``timings``), per model and
    generation; the scrape adds them to the speculative families beside the transformers engine's own
    counts (one metric name, whatever engine drafted)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[tuple[str, str], tuple[int, int]] = {}

    def add(self, labels: tuple[str, str], drafted: int, accepted: int) -> None:
        with self._lock:
            old = self._counts.get(labels, (0, 0))
            self._counts[labels] = (old[0] + drafted, old[1] + accepted)

    def counts(self) -> dict[tuple[str, str], tuple[int, int]]:
        with self._lock:
            return dict(self._counts)


class DeploymentCollector:
    """Reads the deployments at scrape time."""

    def __init__(self, registry: Registry, relayed: RelayedSpeculation | None = None) -> None:
        self.registry = registry
        self.relayed = relayed or RelayedSpeculation()

    def collect(self) -> Iterator[Any]:
        running = GaugeMetricFamily("deploykit_requests_running", "Requests in a batch now", labels=list(_LABELS))
        waiting = GaugeMetricFamily("deploykit_requests_waiting", "Requests waiting for a batch slot",
                                    labels=list(_LABELS))
        reloads = CounterMetricFamily("deploykit_reloads", "Reloads attempted", labels=["deployment"])
        failed = CounterMetricFamily("deploykit_reload_failures", "Reloads that failed; the last good "
                                     "generation kept serving", labels=["deployment"])
        duration = HistogramMetricFamily("deploykit_reload_duration_seconds", "Manifest change to new "
                                         "generation serving (or to failure)", labels=["deployment"])
        generation = GaugeMetricFamily("deploykit_generation", "Generation serving", labels=["deployment"])
        in_flight = GaugeMetricFamily("deploykit_in_flight_requests", "Callers holding a generation",
                                      labels=["deployment"])
        pending = GaugeMetricFamily("deploykit_pending_error", "1 while the newest manifest could not be "
                                    "rolled out and the last good generation serves", labels=["deployment"])
        device_bytes = GaugeMetricFamily("deploykit_device_bytes", "Bytes placed per device by the serving "
                                         "plan", labels=["deployment", "device"])
        engine_ready = GaugeMetricFamily("deploykit_engine_ready", "llama.cpp: 1 while the serving generation's "
                                         "engine process answers, 0 while it starts, restarts or has failed",
                                         labels=["deployment"])
        engine_crashes = CounterMetricFamily("deploykit_engine_crashes", "llama.cpp: deaths, hangs and stalls of "
                                             "the serving generation's engine process", labels=["deployment"])
        prefix = _prefix_families()
        speculative, rates = _speculative_families(), _speculative_rates()
        snapshots = [(name, dep, dep.state()) for name, dep in self.registry.items()]  # one per deployment
        for name, dep, snap in snapshots:
            stats = snap.requests
            if stats is not None:
                for key, family in {"running": running, "waiting": waiting, **prefix, **speculative}.items():
                    if key in stats:
                        family.add_metric([name, str(snap.generation)], stats[key])
                _add_rates(rates, [name, str(snap.generation)], stats)
            reloads.add_metric([name], snap.reloads["total"])
            failed.add_metric([name], snap.reloads["failed"])
            records = list(dep.reload_log.records)
            buckets = [(str(b) if b != float("inf") else "+Inf", sum(r.seconds <= b for r in records))
                       for b in _RELOAD_BUCKETS]
            duration.add_metric([name], buckets, sum(r.seconds for r in records))
            generation.add_metric([name], snap.generation)
            in_flight.add_metric([name], snap.in_flight)
            engine_failed = snap.engine_process is not None and snap.engine_process.state == "failed"
            pending.add_metric([name], 1 if snap.last_error and not engine_failed else 0)  # the engine's own below
            for device in snap.plan or []:
                device_bytes.add_metric([name, str(device.device)], device.bytes)
            if snap.engine_process is not None:
                engine_ready.add_metric([name], 1 if snap.engine_process.state == "ready" else 0)
                engine_crashes.add_metric([name], snap.engine_process.crashes)
        yield from (running, waiting, reloads, failed, duration, generation, in_flight, pending, device_bytes,
                    engine_ready, engine_crashes)
        for (model, number), (drafted, accepted) in self.relayed.counts().items():  # llama-server's
            speculative["speculative_drafted"].add_metric([model, number], drafted)
            speculative["speculative_accepted"].add_metric([model, number], accepted)
        yield from prefix.values()
        yield from speculative.values()
        yield from rates
        yield from rollout_metrics([(name, snap) for name, _, snap in snapshots])
        host = getattr(self.registry, "host", None)
        if host is not None:  # no budget set (``Host.unlimited``): its loads and unloads, no budget metrics
            yield from budget_metrics(host, {name: snap.loaded for name, _, snap in snapshots})


def _prefix_families() -> dict[str, Any]:
    """The prefix cache of each serving generation (``engine.prefixcache``), by the engine's stats keys."""
    labels = list(_LABELS)
    return {
        "prefix_cache_bytes": GaugeMetricFamily("deploykit_prefix_cache_bytes", "Bytes of KV the prefix cache "
                                                "holds now", labels=labels),
        "prefix_cache_lookups": CounterMetricFamily("deploykit_prefix_cache_lookups", "Prompts looked up in the "
                                                    "prefix cache", labels=labels),
        "prefix_cache_hits": CounterMetricFamily("deploykit_prefix_cache_hits", "Prompts whose beginning the "
                                                 "prefix cache held", labels=labels),
        "prefix_cache_tokens_reused": CounterMetricFamily("deploykit_prefix_cache_tokens_reused", "Prompt tokens "
                                                          "read from the prefix cache instead of computed",
                                                          labels=labels),
        "prefix_cache_evictions": CounterMetricFamily("deploykit_prefix_cache_evictions", "Prefixes evicted to "
                                                      "stay within prefix_cache.max_bytes", labels=labels),
    }


def _speculative_families() -> dict[str, Any]:
    """Speculative decoding of each serving generation (``engine.speculative``), by the engine's stats keys."""
    labels = list(_LABELS)
    return {
        "speculative_drafted": CounterMetricFamily("deploykit_speculative_drafted_tokens", "Drafted tokens "
                                                   "verified by the model", labels=labels),
        "speculative_accepted": CounterMetricFamily("deploykit_speculative_accepted_tokens", "Drafted tokens "
                                                    "the model accepted (each a token without a step of its own)",
                                                    labels=labels),
        "speculative_steps": CounterMetricFamily("deploykit_speculative_verification_steps", "Verification "
                                                 "forwards", labels=labels),
    }


def _speculative_rates() -> tuple[Any, Any]:
    labels = list(_LABELS)
    return (GaugeMetricFamily("deploykit_speculative_acceptance_rate", "Accepted of drafted tokens since the "
                              "generation started", labels=labels),
            GaugeMetricFamily("deploykit_speculative_tokens_per_step", "Tokens each row got per verification "
                              "forward, on average (1: no draft accepted)", labels=labels))


def _add_rates(rates: tuple[Any, Any], labels: list[str], stats: dict[str, int]) -> None:
    if "speculative_drafted" not in stats:
        return
    acceptance, per_step = rates
    acceptance.add_metric(labels, stats["speculative_accepted"] / max(1, stats["speculative_drafted"]))
    rows = stats["speculative_emitted"] - stats["speculative_accepted"]  # one chosen token per row and step
    per_step.add_metric(labels, stats["speculative_emitted"] / max(1, rows))


def rollout_metrics(deployments: list[tuple[str, LiveStatus]]) -> Iterator[Any]:
    """Each deployment's latest gated rollout: its step, the new generation's share, its gates."""
    step = GaugeMetricFamily("deploykit_rollout_step", "Canary step in progress (1..n; 0 before traffic moves)",
                             labels=["deployment", "stage"])
    share = GaugeMetricFamily("deploykit_rollout_traffic_share", "Percent of new requests sent to the new "
                              "generation", labels=["deployment", "generation"])
    value = GaugeMetricFamily("deploykit_rollout_gate_value", "A gate's latest measured value",
                              labels=["deployment", "gate"])
    passed = GaugeMetricFamily("deploykit_rollout_gate_passed", "1 when the gate passed, 0 when it failed",
                               labels=["deployment", "gate"])
    for name, snap in deployments:
        progress = snap.rollout
        if progress is None:
            continue
        step.add_metric([name, progress.stage], progress.step)
        share.add_metric([name, str(progress.new_generation)], progress.share)
        for gate in progress.gates:
            if gate.value is not None:
                value.add_metric([name, gate.gate], gate.value)
            passed.add_metric([name, gate.gate], 1 if gate.passed else 0)
    yield from (step, share, value, passed)


def budget_metrics(host: Host, loaded_of: dict[str, str]) -> Iterator[Any]:
    """The host: what is loaded, loads and unloads by reason (keep-alive unloads without a budget too), and,
    where a budget is set (``host.limited``), the budget and its use per tier."""
    loaded = GaugeMetricFamily("deploykit_model_loaded", "1 while the model is in memory, else 0 (unloaded "
                               "ones load at their next request)", labels=["model"])
    loads = CounterMetricFamily("deploykit_model_loads", "Loads under the budget", labels=["model", "reason"])
    unloads = CounterMetricFamily("deploykit_model_unloads", "Unloads under the budget (idle: keep-alive "
                                  "expired; pressure: room made for another model)", labels=["model", "reason"])
    budget = GaugeMetricFamily("deploykit_budget_bytes", "The most all models may hold together", labels=["tier"])
    used = GaugeMetricFamily("deploykit_budget_used_bytes", "The plan bytes of the loaded (and loading) models",
                             labels=["tier"])
    seconds = HistogramMetricFamily("deploykit_model_load_seconds", "Room made, model loaded and checked")
    states = {**{e.name: e.state for e in host.entries()}, **loaded_of}  # a served one: as its snapshot says
    for name in sorted(states):
        loaded.add_metric([name], 1 if states.get(name) == "loaded" else 0)
    for (name, reason), n in sorted(host.loads.items()):
        loads.add_metric([name, reason], n)
    for (name, reason), n in sorted(host.unloads.items()):
        unloads.add_metric([name, reason], n)
    usage = host.used()
    for tier, b in sorted(host.budget.tiers.items()):
        budget.add_metric([tier], b)
        used.add_metric([tier], usage.get(tier, 0))
    records = list(host.load_seconds)
    seconds.add_metric([], [(str(b) if b != float("inf") else "+Inf", sum(r <= b for r in records))
                            for b in _LOAD_BUCKETS], sum(records))
    yield from (loaded, loads, unloads, seconds)
    if host.limited:
        yield from (budget, used)


def new_registry(deployments: Registry, sources: Sources | None = None) -> tuple[CollectorRegistry, ServingMetrics]:
    registry = CollectorRegistry(auto_describe=True)
    serving = ServingMetrics(registry)
    registry.register(DeploymentCollector(deployments, serving.relayed_speculation))
    if sources is not None:
        registry.register(SourceCollector(sources))
    return registry, serving


_SOURCE_PHASES = ("Synced", "Progressing", "OutOfSync", "Degraded")


class SourceCollector:
    """The git sources at scrape time: phase, sync and error counts, when they last fetched and applied."""

    def __init__(self, sources: Sources) -> None:
        self.sources = sources

    def collect(self) -> Iterator[Any]:
        phase = GaugeMetricFamily("deploykit_source_phase", "1 for the phase a git source is in",
                                  labels=["source", "phase"])
        syncs = CounterMetricFamily("deploykit_source_syncs", "Fetches that ended without an error", labels=["source"])
        errors = CounterMetricFamily("deploykit_source_errors", "Fetches or commits that failed", labels=["source"])
        fetched = GaugeMetricFamily("deploykit_source_last_fetch_timestamp_seconds", "When the source last fetched",
                                    labels=["source"])
        applied = GaugeMetricFamily("deploykit_source_last_applied_timestamp_seconds",
                                    "When this process last applied a commit of the source", labels=["source"])
        for sync in self.sources.all():
            status = sync.status()
            for name in _SOURCE_PHASES:
                phase.add_metric([sync.name, name], 1.0 if status.phase.value == name else 0.0)
            syncs.add_metric([sync.name], status.record.syncs)
            errors.add_metric([sync.name], status.record.errors)
            fetched.add_metric([sync.name], status.record.last_fetch or 0.0)
            applied.add_metric([sync.name], status.record.applied_at or 0.0)
        yield from (phase, syncs, errors, fetched, applied)
