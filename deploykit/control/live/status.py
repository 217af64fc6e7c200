"""What a live deployment shows: ``LiveStatus``, the one snapshot of it, built once per answer from its one
state (``machine.State``) and its pool read at one moment (``PoolView``), and how every view formats it:
``status()`` and ``deploykit status`` of the library, ``/status`` and ``/control/v1/status``
(``served_status``: the store's record with the snapshot over it), ``/readyz`` (``not_ready``),
``/v1/models`` and the metrics. None of them looks at the pool or the machine on its own, so none can
disagree with another about what serves, its phase or its generation and revision."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...names import Phase
from ...placement.inventory import process_rss
from ..revisions.report import LiveFacts, status_report
from ..revisions.state import StateStore

if TYPE_CHECKING:
    from ..budget.host import BudgetView, Host
    from .canary import CanaryProgress
    from .machine import State
    from .pool import Generation, PoolView
    from .reloads import ReloadLog


@dataclass(frozen=True)
class PlacedDevice:
    """A device of the serving plan that holds blocks."""

    device: str | int
    blocks: list[str]
    bytes: int


@dataclass(frozen=True)
class ServedAdapter:
    """A LoRA adapter the serving generation answers as ``<deployment>:<name>``, and its planned bytes."""

    name: str
    bytes: int
    devices: dict[str, int]  # device -> bytes there


def served_adapters(gen: Generation | None) -> list[ServedAdapter]:
    adapters = getattr(gen.runtime, "adapters", None) if gen is not None else None
    if gen is None or adapters is None:
        return []
    planned = {a.name: a for a in gen.plan.adapters} if gen.plan is not None else {}
    return [ServedAdapter(n, planned[n].bytes if n in planned else 0,
                          {str(d): b for d, b in planned[n].devices} if n in planned else {})
            for n in adapters.names()]


@dataclass(frozen=True)
class EngineProcess:
    """The process computing a llama.cpp generation: its pid now, its state (starting, ready, restarting,
    failed, closed) and why, and the deaths and hangs it recovered from (each replaced by its watchdog with a
    fresh, checked process)."""

    pid: int | None
    state: str
    reason: str | None
    crashes: int
    restarts: int
    last_crash: str | None
    speculative: dict[str, Any] | None = None  # spec.speculative: its settings and llama-server's flags


def engine_process(gen: Generation | None) -> EngineProcess | None:
    from ...engine.llamacpp.runtime import LlamaRuntime

    runtime: Any = gen.runtime if gen is not None else None
    if not isinstance(runtime, LlamaRuntime):
        return None
    report = runtime.report()
    speculative = runtime.options.server.speculative
    return EngineProcess(report.pid, report.state.value, report.reason, report.crashes, report.restarts,
                         report.last_crash, speculative.describe() if speculative is not None else None)


@dataclass(frozen=True)
class LiveStatus:
    """What a live ``Deployment`` is now (``Deployment.state()``; ``status()`` is its ``to_dict``)."""

    name: str
    phase: Phase
    trigger: str
    generation: int  # read with ``revision`` at one moment (``PoolView``)
    revision: int | None  # the serving generation's
    serving: bool  # a generation serves, or it loads at its next request (unloaded under a budget)
    loaded: str  # "loaded" | "unloaded" | "loading" ... as the host says
    budget: BudgetView | None
    in_flight: int
    last_error: str | None
    conflict: str | None  # a watched file declares this API-owned name (also in ``last_error``)
    staged: int | None  # a canary's candidate generation, loaded beside the serving one
    created: float | None  # when the serving generation was made
    requests: dict[str, int] | None  # the serving engine's running and waiting requests
    manifest: str
    serialize_forward: bool
    reloads: dict[str, float]
    memory: dict[str, int | None]
    plan: list[PlacedDevice] | None
    engine_process: EngineProcess | None = None  # llama.cpp: its llama-server
    rollout: CanaryProgress | None = None  # the latest gated rollout: in progress, promoted or rolled back
    adapters: list[ServedAdapter] | None = None  # the LoRA adapters served beside the base
    speculative: dict[str, Any] | None = None  # spec.speculative as the engine serves it, and its acceptance

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["phase"] = self.phase.value
        out["rollout"] = self.rollout.to_dict() if self.rollout is not None else None
        return out


def live_status(view: PoolView, state: State, *, name: str, host: Host, manifest: Path,
                reloads: ReloadLog, rollout: CanaryProgress | None = None) -> LiveStatus:
    """The snapshot of one deployment: its pool ``view`` (read at one moment, first) and ``state`` (its one
    state, read after: it can only be newer), its load state as ``host`` says (once closed, as its pool
    does: the host may still hold its last word), its budget where ``host`` has
    one (None under ``Host.unlimited``: no budget was set) and its reloads."""
    gen = view.current
    engine = getattr(gen.runtime, "engine", None) if gen is not None else None
    process = engine_process(gen)
    degraded = process is not None and process.state == "failed"  # held, but every request would be a 503
    return LiveStatus(
        name=name, phase=_phase(state, process), trigger=str(state.trigger), generation=view.number,
        revision=view.revision, serving=state.phase != Phase.CLOSED and view.serving and not degraded,
        loaded=(host.state(name) if state.phase != Phase.CLOSED else None) or ("loaded" if gen else "unloaded"),
        budget=host.describe(name) if host.limited else None,
        in_flight=view.in_flight, last_error=state.message or (_engine_failure(process) if degraded else None),
        conflict=state.conflict, staged=view.candidate,
        created=gen.created if gen is not None else None,
        requests=engine.stats() if engine is not None else None,
        manifest=str(manifest),
        serialize_forward=bool(gen and gen.forward_lock),
        reloads=reloads.summary(),
        memory={"rss": process_rss(), "baseline_rss": view.baseline_rss},
        plan=[PlacedDevice(d.device, list(d.blocks), d.bytes) for d in gen.plan.devices if d.blocks]
        if gen and gen.plan else None,
        engine_process=process,
        rollout=rollout,
        adapters=served_adapters(gen),
        speculative=speculation_of(engine),
    )


def speculation_of(engine: Any) -> dict[str, Any] | None:
    """The engine's speculative decoding settings and acceptance so far (None: it does not speculate)."""
    settings = getattr(engine, "speculative", None)
    if settings is None:
        return None
    stats = engine.stats()
    drafted, accepted = stats.get("speculative_drafted", 0), stats.get("speculative_accepted", 0)
    error = getattr(engine, "speculative_error", None)  # not speculating: a draft model that failed to load
    return {**asdict(settings), "drafted": drafted, "accepted": accepted,
            "acceptance_rate": round(accepted / drafted, 4) if drafted else None,
            **({"error": error} if error else {})}


def _phase(state: State, process: EngineProcess | None) -> Phase:
    """The state's phase, or Degraded while its engine has failed (and is retried) where it would say Ready."""
    if process is not None and process.state == "failed" and state.phase == Phase.READY:
        return Phase.DEGRADED
    return state.phase


def _engine_failure(process: EngineProcess | None) -> str:
    return f"the llama.cpp engine failed: {process.reason if process is not None else 'unknown'}"


def not_ready(snapshots: list[LiveStatus]) -> list[str]:
    """The deployments that cannot serve (``/readyz``): the one rule, for a supervisor and an embedding."""
    return [s.name for s in snapshots if not s.serving]


def served_status(store: StateStore, name: str, live: LiveStatus | None) -> dict[str, Any]:
    """One deployment as a server shows it (``/status``, ``deploykit status`` through a server): the
    store's record (``status_report``) and, where this process holds it, its live state, which decides
    the phase and the error (a pending broken change, a conflict)."""
    waiting = live.budget.waiting if live is not None and live.budget is not None else None  # for room
    held = None if live is None else LiveFacts(progressing=live.phase == Phase.PROGRESSING, error=live.last_error,
                                          activity=waiting or _activity(live.rollout), serving=live.serving,
                                          conflict=live.conflict is not None)
    report = status_report(store, name, held)  # one place decides phase, error and conditions
    if waiting is not None:  # its load waits for the host budget: say so, and why
        report["conditions"].append({"type": "Loaded", "status": False, "reason": "WaitingForRoom",
                                     "message": waiting})
    if live is not None and live.phase == Phase.DEGRADED:  # held, but its engine cannot answer: not Ready
        report["phase"], report["last_error"] = Phase.DEGRADED.value, live.last_error
        report["conditions"] = [{"type": "Ready", "status": False, "reason": "EngineFailed",
                                 "message": live.last_error or ""} if c["type"] == "Ready" else c
                                for c in report["conditions"]]
    report["serving"] = bool(live and live.serving)
    report["serving_revision"] = live.revision if live else None
    report["generation"] = live.generation if live else None
    report["in_flight"] = live.in_flight if live else 0
    report["reloads"] = live.reloads if live else None
    report["loaded"] = live.loaded if live else None
    report["budget"] = asdict(live.budget) if live and live.budget else None
    if live is not None and live.engine_process is not None:  # llama.cpp: its process, and deaths recovered from
        report["engine_process"] = asdict(live.engine_process)
    report["rollout"] = live.rollout.to_dict() if live and live.rollout else None
    report["adapters"] = [asdict(a) for a in live.adapters or []] if live else []
    report["speculative"] = live.speculative if live else None
    return report


def _activity(rollout: CanaryProgress | None) -> str | None:
    """What a gated rollout in progress is doing, in a word for the Progressing condition."""
    if rollout is None or rollout.stage not in ("golden", "traffic"):
        return None
    if rollout.stage == "golden":
        return "scoring the golden references on both generations"
    return (f"canary step {rollout.step} of {len(rollout.steps)}: {rollout.share}% of new requests "
            f"({rollout.step_requests} of {rollout.min_requests} requests needed so far)")
