"""What a live deployment shows: ``LiveStatus``, built from its one state (``machine.State``) and its pool,
and how a server shows a deployment it holds (``served_status``: the store's record with the live state
over it)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...names import Phase
from ...placement.inventory import process_rss
from ..revisions.report import Held, status_report
from ..revisions.state import StateStore

if TYPE_CHECKING:
    from ..budget.host import BudgetView, Host
    from .canary import CanaryProgress
    from .machine import State
    from .pool import Generation, GenerationPool
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


def engine_process(gen: Generation | None) -> EngineProcess | None:
    from ...engine.llamacpp.runtime import LlamaRuntime

    runtime: Any = gen.runtime if gen is not None else None
    if not isinstance(runtime, LlamaRuntime):
        return None
    report = runtime.report()
    return EngineProcess(report.pid, report.state.value, report.reason, report.crashes, report.restarts,
                         report.last_crash)


@dataclass(frozen=True)
class LiveStatus:
    """What a live ``Deployment`` is now (``Deployment.state()``; ``status()`` is its ``to_dict``)."""

    name: str
    phase: Phase
    trigger: str
    generation: int
    revision: int | None
    serving: bool  # a generation serves, or it loads at its next request (unloaded under a budget)
    loaded: str  # "loaded" | "unloaded" | "loading" ... as the host says
    budget: BudgetView | None
    in_flight: int
    last_error: str | None
    manifest: str
    serialize_forward: bool
    reloads: dict[str, float]
    memory: dict[str, int | None]
    plan: list[PlacedDevice] | None
    engine_process: EngineProcess | None = None  # llama.cpp: its llama-server
    rollout: CanaryProgress | None = None  # the latest gated rollout: in progress, promoted or rolled back
    adapters: list[ServedAdapter] | None = None  # the LoRA adapters served beside the base

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["phase"] = self.phase.value
        out["rollout"] = self.rollout.to_dict() if self.rollout is not None else None
        return out


def live_status(gen: Generation | None, state: State, *, name: str, pool: GenerationPool, host: Host | None,
                manifest: Path, reloads: ReloadLog, rollout: CanaryProgress | None = None) -> LiveStatus:
    """``gen`` (its pool's current generation, read first) and ``state`` (the deployment's one state) as
    one status, with its budget under ``host`` (if any) and its reloads."""
    return LiveStatus(
        name=name, phase=state.phase, trigger=str(state.trigger), generation=pool.number,
        revision=gen.revision if gen else None,
        serving=state.phase != Phase.CLOSED and (gen is not None or pool.unloaded),
        loaded=(host.state(name) if host is not None else None) or ("loaded" if gen else "unloaded"),
        budget=host.describe(name) if host is not None else None,
        in_flight=gen.refs if gen else 0, last_error=state.message, manifest=str(manifest),
        serialize_forward=bool(gen and gen.forward_lock),
        reloads=reloads.summary(),
        memory={"rss": process_rss(), "baseline_rss": pool.baseline_rss},
        plan=[PlacedDevice(d.device, list(d.blocks), d.bytes) for d in gen.plan.devices if d.blocks]
        if gen and gen.plan else None,
        engine_process=engine_process(gen),
        rollout=rollout,
        adapters=served_adapters(gen),
    )


def served_status(store: StateStore, name: str, live: LiveStatus | None) -> dict[str, Any]:
    """One deployment as a server shows it (``/status``, ``deploykit status`` through a server): the
    store's record (``status_report``) and, where this process holds it, its live state, which decides
    the phase and the error (a pending broken change, a conflict)."""
    held = None if live is None else Held(progressing=live.phase == Phase.PROGRESSING, error=live.last_error,
                                          activity=_activity(live.rollout), serving=live.serving)
    report = status_report(store, name, held)  # one place decides phase, error and conditions
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
    return report


def _activity(rollout: CanaryProgress | None) -> str | None:
    """What a gated rollout in progress is doing, in a word for the Progressing condition."""
    if rollout is None or rollout.stage not in ("golden", "traffic"):
        return None
    if rollout.stage == "golden":
        return "scoring the golden references on both generations"
    return (f"canary step {rollout.step} of {len(rollout.steps)}: {rollout.share}% of new requests "
            f"({rollout.step_requests} of {rollout.min_requests} requests needed so far)")
