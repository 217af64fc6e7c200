"""The generations of one deployment held in memory: pin, swap, drain, free, and the leak guard.

A caller pins the current generation for the duration of its work; a swap makes a new generation
current at once, and the old one is freed (references dropped, ``gc.collect()``, the CUDA cache
emptied where CUDA exists) when its last caller unpins it. A recreate drains first: no generation is
current, new pins wait, and the old one is freed once its callers leave.

Generations whose model carries accelerate offload hooks (GPU plans with CPU/disk blocks) run one
forward at a time (``forward_lock``): those hooks move weights around each forward and are not
thread-safe. CPU-only plans (disk blocks memory-mapped, no hooks) run concurrent forwards.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..errors import ApplyError
from ..placement.inventory import process_rss
from ..placement.planner import Plan

if TYPE_CHECKING:
    from ..engine.loader import LoadedModel
    from ..engine.runtime import Limits, Runtime
    from ..spec.manifest import LoadedManifest

log = logging.getLogger(__name__)
MEMORY_HISTORY = 64  # leak-guard samples kept


@dataclass
class Generation:
    number: int
    revision: int
    loaded: LoadedModel | None  # None once freed
    plan: Plan | None
    strategy: str = ""
    refs: int = 0
    retired: bool = False
    freeing: bool = False  # claimed by the one caller that frees it
    forward_lock: threading.Lock | None = None
    runtime: Runtime | None = None  # what serves requests on this generation (closed when freed)
    task: str = "causal-lm"
    created: float = field(default_factory=time.time)


def kv_cache_budget(plan: Plan | None) -> int:
    """Bytes the KV cache may take: what the input device's tier has left after the weights (the
    plan knows both), else 1 GiB. Sizing it here keeps a batching engine from guessing from host RAM."""
    default = 1 << 30
    if plan is None:
        return default
    first = next((d for d in plan.devices if d.blocks), None)
    if first is None or first.budget is None:
        return default
    return max(64 << 20, first.budget - first.bytes)


def limits_of(manifest: LoadedManifest) -> Limits:
    """The engine's limits from the manifest's ``spec.serving``."""
    from ..engine.runtime import Limits

    s = manifest.manifest.spec.serving
    return Limits(s.context_length, s.max_tokens, s.default_max_tokens, s.max_concurrent, s.max_queued,
                  s.max_input_items, s.batching)


def new_generation(number: int, loaded: LoadedModel, plan: Plan | None, revision: int, strategy: str,
                   manifest: LoadedManifest) -> Generation:
    """A generation with its runtime (batching engine or embedder) built from the manifest's limits."""
    from ..engine.runtime import build_runtime

    lock = threading.Lock() if loaded.serialize_forward else None
    task = manifest.manifest.spec.model.task
    runtime = loaded.runtime or build_runtime(loaded, limits_of(manifest), task=task,
                                              kv_cache_bytes=kv_cache_budget(plan), forward_lock=lock)
    return Generation(number, revision, loaded, plan, strategy, forward_lock=lock, runtime=runtime, task=task)


class GenerationPool:
    """Thread-safe holder of the current generation and the retiring ones of one deployment."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._cond = threading.Condition()
        self._current: Generation | None = None
        self._number = 0
        self._closed = False
        self.baseline_rss: int | None = None
        self.memory: deque[tuple[int, int]] = deque(maxlen=MEMORY_HISTORY)  # (generation freed, RSS after)

    @property
    def current(self) -> Generation | None:
        return self._current

    @property
    def number(self) -> int:
        return self._number

    def try_pin(self) -> Generation | None:
        """The current generation pinned, or None at once when there is none (a recreate is reloading)."""
        with self._cond:
            gen = self._current
            if gen is not None:
                gen.refs += 1
            return gen

    def pin(self, timeout: float) -> Generation:
        """The current generation, pinned; waits up to ``timeout`` while a recreate has none."""
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

    def unpin(self, gen: Generation) -> None:
        """Unpin; frees a retired generation on this thread when this was its last caller."""
        if self._unpinned(gen):
            self._free(gen)

    def release(self, gen: Generation) -> None:
        """Unpin without ever blocking: a retired generation left with no caller is freed on a thread
        of its own (for the event loop, and for cleanup that must not be interrupted halfway)."""
        if self._unpinned(gen):
            threading.Thread(target=self._free, args=(gen,), name=f"deploykit-free-{self.name}", daemon=True).start()

    def _unpinned(self, gen: Generation) -> bool:
        with self._cond:
            if gen.refs <= 0:  # a caller released twice: never let the count go negative
                log.error("%s: generation %d unpinned more often than pinned", self.name, gen.number)
                return False
            gen.refs -= 1
            free = gen.retired and gen.refs == 0 and gen.loaded is not None
            self._cond.notify_all()
        return free

    def install(self, loaded: LoadedModel, plan: Plan | None, revision: int, strategy: str,
                manifest: LoadedManifest) -> Generation:
        """Make ``loaded`` the current generation; the previous one is freed once unpinned."""
        with self._cond:
            self._number += 1
            number = self._number
        gen = new_generation(number, loaded, plan, revision, strategy, manifest)
        with self._cond:
            old, self._current = self._current, gen
            if old is not None:
                old.retired = True
            free_old = old is not None and old.refs == 0
            self._cond.notify_all()
        if self.baseline_rss is None:
            self.baseline_rss = process_rss()
        if free_old and old is not None:
            self._free(old)
        return gen

    def drain(self, timeout: float) -> None:
        """Stop handing out the current generation, wait up to ``timeout`` for its callers, free it."""
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

    def close(self, timeout: float) -> None:
        self.drain(timeout)
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def _free(self, gen: Generation) -> None:
        with self._cond:
            if gen.loaded is None or gen.freeing:
                return
            gen.freeing = True
            runtime, gen.runtime = gen.runtime, None
        if runtime is not None:
            runtime.close()  # its in-flight requests held pins: none are left
        with self._cond:
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
        if self.baseline_rss is None or not model_bytes:
            return
        excess = rss - self.baseline_rss
        if excess > 1.5 * model_bytes:
            log.warning("%s: memory not reclaimed after freeing generation %d: RSS %d MiB is %d MiB above "
                        "the first generation's (the model is %d MiB); is a model kept outside acquire()?",
                        self.name, freed.number, rss >> 20, excess >> 20, model_bytes >> 20)
        else:
            log.info("generation %d of %s freed; RSS %d MiB", freed.number, self.name, rss >> 20)
