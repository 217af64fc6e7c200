"""``Deployment``: a live model inside a long-running Python process, swapped atomically on reload.

    dep = Deployment.from_manifest("manifests/minilm.yaml", watch=True)
    with dep.acquire() as model:        # pins the current generation for the duration
        model(**inputs)
    dep.generation, dep.status()
    dep.close()

Each successful (re)load makes a new *generation*. A caller that acquired generation N keeps it until
its ``with`` block ends, even if N+1 has been swapped in meanwhile; N is freed (references dropped,
``gc.collect()``, ``torch.cuda.empty_cache()`` where CUDA exists) when its last caller leaves.

Reloads (``reload()``, or the watcher with ``watch=True``) follow ``spec.rollout.strategy``:

- ``blue-green``: the new generation is planned around the memory the old one still holds, loaded
  and health-checked beside it, then swapped in; callers never wait.
- ``recreate``: new ``acquire()`` calls wait (up to ``acquire_timeout``), in-flight calls drain, the
  old generation is freed, then the new one is loaded. If that fails, the old one is loaded again.
- ``auto``: blue-green when the plan fits beside the old generation, else recreate.

A reload that fails at any step (bad manifest, missing file, plan infeasible, load error, failed
health check) leaves the serving generation untouched; the error appears in ``status()`` (with the
manifest's file:line where it applies) and in the state store's events.

Generations whose model carries accelerate offload hooks (GPU plans with CPU/disk blocks) run one
forward at a time: those hooks move weights in and out around each forward and are not thread-safe.
CPU-only plans (disk blocks memory-mapped, no hooks) run concurrent forwards.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from .errors import ApplyError, DeploykitError, ManifestError, PlanInfeasible
from .inventory import Gpu, Inventory, process_rss
from .manifest import LoadedManifest, load_manifests
from .state import StateStore

log = logging.getLogger(__name__)
DEFAULT_ACQUIRE_TIMEOUT = 300.0  # seconds acquire() waits while a recreate rollout reloads


@dataclass
class Generation:
    number: int
    revision: int
    loaded: Any  # loader.LoadedModel; None once freed
    plan: Any
    strategy: str = ""
    refs: int = 0
    retired: bool = False
    forward_lock: threading.Lock | None = None
    created: float = field(default_factory=time.time)


@dataclass
class ReloadRecord:
    generation: int
    revision: int | None
    ok: bool
    seconds: float
    strategy: str
    error: str | None = None
    rss_before: int | None = None
    rss_after: int | None = None


class Deployment:
    """A deployed model held by this process. Thread-safe. See the module docstring."""

    def __init__(self, manifest_path: Path, *, name: str | None = None, devices: str | None = None,
                 store: StateStore | None = None, acquire_timeout: float = DEFAULT_ACQUIRE_TIMEOUT) -> None:
        self.manifest_path = Path(manifest_path)
        self._wanted_name = name
        self.devices = devices
        self.store = store or StateStore()
        self.acquire_timeout = acquire_timeout
        self._cond = threading.Condition()
        self._current: Generation | None = None
        self._reload_lock = threading.Lock()  # one reload at a time
        self._generation = 0
        self._phase = "Pending"
        self._last_error: str | None = None
        self._callbacks: list[Callable[[Deployment], None]] = []
        self.reloads: list[ReloadRecord] = []
        self.memory: list[tuple[int, int]] = []  # (generation freed, process RSS after)
        self._baseline_rss: int | None = None
        self.name: str | None = None
        self._watcher: Any = None
        self._closed = False

    # ---- construction ---------------------------------------------------------------------------

    @classmethod
    def from_manifest(cls, path: str | Path, *, watch: bool = False, name: str | None = None,
                      devices: str | None = None, state_dir: str | Path | None = None,
                      acquire_timeout: float = DEFAULT_ACQUIRE_TIMEOUT,
                      debounce: float = 0.3) -> Deployment:
        """Apply the manifest at ``path`` and hold its model. ``watch=True`` reloads on changes."""
        store = StateStore(Path(state_dir)) if state_dir is not None else StateStore()
        dep = cls(Path(path), name=name, devices=devices, store=store, acquire_timeout=acquire_timeout)
        dep._start()
        if watch:
            dep.watch(debounce=debounce)
        return dep

    def _manifest(self) -> LoadedManifest:
        manifests = load_manifests(self.manifest_path)
        if self._wanted_name is not None:
            chosen = [m for m in manifests if m.name == self._wanted_name]
            if not chosen:
                raise ApplyError(f"{self.manifest_path}: no manifest named {self._wanted_name!r}")
            return chosen[0]
        if len(manifests) != 1:
            raise ApplyError(f"{self.manifest_path} holds {len(manifests)} manifests; pass name=")
        return manifests[0]

    def _start(self) -> None:
        from .reconciler import apply

        loaded = self._manifest()
        self.name = loaded.name
        self._phase = "Progressing"
        try:
            outcome = apply(loaded, store=self.store, devices=self.devices, keep_model=True,
                            load_if_unchanged=True)
        except DeploykitError as exc:
            self._phase, self._last_error = "Failed", _describe(exc, loaded)
            raise
        self._install(outcome.loaded, outcome.plan, outcome.revision or 0, "initial")
        self._phase = "Ready"
        self._baseline_rss = process_rss()

    # ---- serving --------------------------------------------------------------------------------

    @property
    def generation(self) -> int:
        return self._generation

    @contextmanager
    def acquire(self, timeout: float | None = None) -> Iterator[Any]:
        """Pin the current generation and yield its model (``torch.nn.Module``)."""
        with self.acquire_loaded(timeout) as loaded:
            yield loaded.model

    @contextmanager
    def acquire_loaded(self, timeout: float | None = None) -> Iterator[Any]:
        """Like ``acquire`` but yields the LoadedModel (model, tokenizer, input device, plan)."""
        gen = self._pin(self.acquire_timeout if timeout is None else timeout)
        try:
            if gen.forward_lock is not None:  # accelerate offload hooks: one forward at a time
                with gen.forward_lock:
                    yield gen.loaded
            else:
                yield gen.loaded
        finally:
            self._unpin(gen)

    def _pin(self, timeout: float) -> Generation:
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._current is None:
                if self._closed:
                    raise ApplyError(f"deployment {self.name!r} is closed")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise ApplyError(f"deployment {self.name!r} has no model ready after {timeout:g}s "
                                     "(a recreate rollout is reloading it)")
                self._cond.wait(remaining)
            gen = self._current
            gen.refs += 1
            return gen

    def _unpin(self, gen: Generation) -> None:
        free = False
        with self._cond:
            gen.refs -= 1
            if gen.retired and gen.refs == 0 and gen.loaded is not None:
                free = True
            self._cond.notify_all()
        if free:
            self._free(gen)

    def _install(self, loaded: Any, plan: Any, revision: int, strategy: str) -> Generation:
        with self._cond:
            self._generation += 1
            gen = Generation(self._generation, revision, loaded, plan, strategy,
                             forward_lock=threading.Lock() if loaded.serialize_forward else None)
            old, self._current = self._current, gen
            free_old = old is not None and old.refs == 0
            if old is not None:
                old.retired = True
            self._cond.notify_all()
        if free_old and old is not None:
            self._free(old)
        return gen

    def _free(self, gen: Generation) -> None:
        with self._cond:
            if gen.loaded is None:
                return
            gen.loaded = None
        gc.collect()
        try:
            import torch

            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        except ImportError:  # pragma: no cover
            pass
        self._check_memory(gen)

    def _check_memory(self, freed: Generation) -> None:
        """Leak guard: after a generation is freed, RSS should be near the first generation's."""
        rss = process_rss()
        current = self._current
        model_bytes = sum(d.bytes for d in current.plan.devices) if current and current.plan else 0
        self.memory.append((freed.number, rss))
        if self._baseline_rss is None or not model_bytes:
            return
        excess = rss - self._baseline_rss
        if excess > 1.5 * model_bytes:
            log.warning("%s: memory not reclaimed after freeing generation %d: RSS %d MiB is %d MiB above "
                        "the first generation's (the model is %d MiB); is a model kept outside acquire()?",
                        self.name, freed.number, rss >> 20, excess >> 20, model_bytes >> 20)
        else:
            log.info("generation %d of %s freed; RSS %d MiB", freed.number, self.name, rss >> 20)

    def _drain(self, timeout: float) -> None:
        """Recreate: stop handing out the current generation, wait for its callers, free it."""
        with self._cond:
            old, self._current = self._current, None
            if old is None:
                return
            old.retired = True
            deadline = time.monotonic() + timeout
            while old.refs > 0 and time.monotonic() < deadline:
                self._cond.wait(deadline - time.monotonic())
            if old.refs > 0:
                log.warning("%s: %d request(s) still in flight after %gs; freeing when they end",
                            self.name, old.refs, timeout)
                return
        self._free(old)

    # ---- reloading ------------------------------------------------------------------------------

    def on_reload(self, callback: Callable[[Deployment], None]) -> None:
        """Call ``callback(deployment)`` after every successful swap."""
        self._callbacks.append(callback)

    def reload(self) -> bool:
        """Re-read the manifest and roll out what changed. True when a new generation serves.

        Never raises for a bad manifest or a failed rollout: the error goes to ``status()``.
        """
        with self._reload_lock:
            if self._closed:
                return False
            started, rss_before = time.perf_counter(), process_rss()
            loaded: LoadedManifest | None = None
            strategy = "none"
            try:
                loaded = self._manifest()
                if loaded.name != self.name:
                    raise ApplyError(f"the manifest now names {loaded.name!r}, this deployment is "
                                     f"{self.name!r}; a rename is a new deployment")
                swapped, strategy = self._rollout(loaded)
            except DeploykitError as exc:
                self._last_error = _describe(exc, loaded)
                self._phase = "Ready" if self._current is not None else "Failed"
                log.warning("reload of %s failed; generation %d keeps serving: %s", self.name,
                            self._generation, self._last_error)
                if self.name:
                    self.store.record_event(self.name, "ReloadFailed", self._last_error)
                self.reloads.append(ReloadRecord(self._generation, None, False,
                                                 time.perf_counter() - started, strategy, self._last_error,
                                                 rss_before, process_rss()))
                return False
            if not swapped:  # nothing changed that needs a new generation
                self._phase = "Ready" if self._current is not None else self._phase
                return False
            self._last_error = None
            self._phase = "Ready"
            gc.collect()
            record = ReloadRecord(self._generation, self._current.revision if self._current else None, True,
                                  time.perf_counter() - started, strategy, None, rss_before, process_rss())
            self.reloads.append(record)
        for callback in list(self._callbacks):
            try:
                callback(self)
            except Exception:  # a callback's bug must not break serving
                log.exception("on_reload callback failed")
        return True

    def _rollout(self, loaded: LoadedManifest) -> tuple[bool, str]:
        from .reconciler import apply

        strategy = loaded.manifest.spec.rollout.strategy
        self._phase = "Progressing"
        if strategy in ("blue-green", "auto"):
            try:
                beside = self._inventory_beside_current(loaded)
                outcome = apply(loaded, store=self.store, inventory=beside, keep_model=True)
            except PlanInfeasible:
                if strategy == "blue-green":
                    raise
                strategy = "recreate"  # auto: it does not fit beside the old generation
            else:
                if outcome.status == "unchanged":
                    return False, "none"
                self._install(outcome.loaded, outcome.plan, outcome.revision or 0, "blue-green")
                return True, "blue-green"
        return self._recreate(loaded), "recreate"

    def _recreate(self, loaded: LoadedManifest) -> bool:
        from .reconciler import apply

        drained = False

        def before_load() -> None:
            nonlocal drained
            self._drain(self.acquire_timeout)
            drained = True

        try:
            outcome = apply(loaded, store=self.store, devices=self.devices, keep_model=True,
                            before_load=before_load)
        except DeploykitError:
            if drained:
                self._restore_current_revision()
            raise
        if outcome.status == "unchanged":
            return False
        self._install(outcome.loaded, outcome.plan, outcome.revision or 0, "recreate")
        return True

    def _restore_current_revision(self) -> None:
        """After a failed recreate: load the last Ready revision again, so something serves."""
        from .planner import Plan
        from .reconciler import _load, recorded_manifest

        current = self.store.current(self.name or "")
        if current is None or current.plan is None:
            return
        loaded = recorded_manifest(current)
        model = _load(loaded, Plan.from_dict(current.plan), Path(current.shards_path or ""))
        self._install(model, Plan.from_dict(current.plan), current.revision, "restore")
        log.warning("%s: restored revision %d after a failed recreate", self.name, current.revision)

    def _inventory_beside_current(self, loaded: LoadedManifest) -> Inventory:
        """The inventory minus what the serving generation holds, for planning a blue-green load."""
        from .planning import inventory_for

        inventory = inventory_for(loaded, self.devices)
        gen = self._current
        if gen is None or gen.plan is None or not inventory.simulated:
            return inventory  # a probed host already reports the old generation's memory as used
        held = {d.device: d.bytes for d in gen.plan.devices}
        gpus = tuple(Gpu(g.index, max(0, g.memory - held.get(g.index, 0)), g.name) for g in inventory.gpus)
        cpu = None if inventory.cpu is None else max(0, inventory.cpu - held.get("cpu", 0))
        return replace(inventory, gpus=gpus, cpu=cpu)

    # ---- watching -------------------------------------------------------------------------------

    def watch(self, *, debounce: float = 0.3) -> None:
        """Reload in a background thread whenever the manifest's content changes."""
        from .watcher import ManifestWatcher

        if self._watcher is None:
            self._watcher = ManifestWatcher([self.manifest_path], lambda paths: self.reload(),
                                            debounce=debounce)
            self._watcher.start()

    # ---- status and shutdown --------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        gen = self._current
        revision = gen.revision if gen else None
        return {
            "name": self.name,
            "phase": self._phase,
            "generation": self._generation,
            "revision": revision,
            "serving": gen is not None,
            "in_flight": gen.refs if gen else 0,
            "last_error": self._last_error,
            "manifest": str(self.manifest_path),
            "serialize_forward": bool(gen and gen.forward_lock),
            "reloads": {"total": len(self.reloads), "failed": sum(not r.ok for r in self.reloads)},
            "memory": {"rss": process_rss(), "baseline_rss": self._baseline_rss},
            "plan": _plan_summary(gen.plan) if gen and gen.plan else None,
        }

    def close(self, timeout: float = 30.0) -> None:
        """Stop watching, let in-flight calls finish (up to ``timeout``), free the model."""
        if self._watcher is not None:
            self._watcher.stop()
            self._watcher = None
        with self._reload_lock:
            self._closed = True
            self._drain(timeout)
            self._phase = "Closed"
            with self._cond:
                self._cond.notify_all()

    def __enter__(self) -> Deployment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _plan_summary(plan: Any) -> list[dict[str, Any]]:
    return [{"device": d.device, "blocks": list(d.blocks), "bytes": d.bytes} for d in plan.devices if d.blocks]


def _describe(exc: Exception, loaded: LoadedManifest | None) -> str:
    """An error as the user should read it: with file:line:column where the manifest is to blame."""
    if isinstance(exc, ManifestError):
        return "\n".join(str(i) for i in exc.issues)
    if isinstance(exc, PlanInfeasible) and exc.field and loaded is not None:
        return loaded.located(exc.field, str(exc))
    return str(exc)
