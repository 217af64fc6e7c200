"""A generation served by Ray Serve replicas (``spec.cluster`` with one node per replica): the runtime the
OpenAI routes and ``Deployment.generate`` use, backed by one Serve application of N ``ModelReplica``s.

Each generation gets its own application (``<name>-<id>``): a rollout starts the new replicas beside the
old ones, health-checks them, and swaps; requests already running finish on the old replicas, then the
old application is deleted when the generation is freed. Scaling ``spec.replicas`` is such a rollout, so
it never fails a request, and a broken revision never replaces the replicas that serve.

Requests go to a replica whole and come back whole (ids, then the result), so a stream through replicas
arrives in one burst per request; the replica's own engine batches concurrent requests.
"""

from __future__ import annotations

import itertools
import logging
import threading
import uuid
from typing import TYPE_CHECKING, Any, Callable

from ..engine.batching import GenerationRequest, GenerationResult, RequestHandle, request_generator
from ..engine.runtime import MAX_DEFAULT_CONTEXT, Limits, TextRuntime
from .ray_env import connect
from .replicas import ReplicaOptions, delete_replicas, run_replicas, start_serve

if TYPE_CHECKING:
    from ..spec.manifest import LoadedManifest

log = logging.getLogger(__name__)


class ReplicaEngine:
    """The engine interface (submit, cancel, stats, close) over a Serve DeploymentHandle."""

    def __init__(self, handle: Any, eos_ids: set[int]) -> None:
        self.handle = handle
        self.eos_ids = eos_ids
        self._ids = itertools.count()
        self._running = 0
        self._lock = threading.Lock()

    def submit(self, request: GenerationRequest,
               listener: Callable[[int | GenerationResult], None] | None = None) -> RequestHandle:
        if not request.is_plain():  # a replica answers with token ids only
            raise ValueError("logprobs, echo, presence/frequency penalties and logit_bias are not served "
                             "through replicas (spec.replicas > 1)")
        h = RequestHandle(request, f"rep-{next(self._ids)}", rng=request_generator(request), listener=listener)
        threading.Thread(target=self._run, args=(h,), name="deploykit-replica-request", daemon=True).start()
        return h

    def _run(self, h: RequestHandle) -> None:
        r = h.request
        with self._lock:
            self._running += 1
        try:
            out = self.handle.generate_ids.remote(list(r.prompt_ids), r.max_new_tokens, r.temperature, r.top_p,
                                                  r.seed, list(r.stop_strings)).result()
            for token in out["token_ids"]:
                if h.done:
                    return
                h.push(token)
            h.finish(out["finish_reason"], out.get("error"))
        except Exception as exc:  # a replica died mid-request: this request fails, the engine goes on
            h.finish("error", f"{type(exc).__name__}: {exc}")
        finally:
            with self._lock:
                self._running -= 1

    def cancel(self, handle: RequestHandle) -> None:
        handle.finish("cancelled")  # the replica finishes its copy; its answer is dropped

    def stats(self) -> dict[str, int]:
        return {"running": self._running, "waiting": 0}

    def close(self, timeout: float | None = None) -> None:
        pass


class ReplicaRuntime(TextRuntime):
    """TextRuntime whose engine is N replicas on the cluster; ``close`` deletes their application."""

    def __init__(self, app: str, handle: Any, tokenizer: Any, limits: Limits, *, context_length: int,
                 eos_ids: set[int]) -> None:  # noqa: D107 (TextRuntime's __init__ loads a model: not here)
        self.app = app
        self.loaded = None  # type: ignore[assignment]
        self.tokenizer = tokenizer
        self.limits = limits
        self.context_length = context_length
        self.engine = ReplicaEngine(handle, eos_ids)  # type: ignore[assignment]

    def close(self, timeout: float | None = 30.0) -> None:
        try:
            delete_replicas(self.app)
        except Exception:  # the cluster is gone: nothing is left to delete
            log.warning("could not delete Serve application %s", self.app, exc_info=True)


def build_replica_runtime(loaded: LoadedManifest, limits: Limits) -> ReplicaRuntime:
    """Start ``spec.replicas`` replicas of ``loaded`` as a new Serve application and return its runtime
    once every replica is up (each loads and plans on its own node)."""
    from transformers import AutoConfig, AutoTokenizer

    spec = loaded.manifest.spec
    assert spec.cluster is not None
    connect(spec.cluster.address)
    start_serve()
    app = f"{loaded.name}-{uuid.uuid4().hex[:8]}"
    handle = run_replicas(app, loaded.text, str(loaded.base_dir), spec.replicas, ReplicaOptions())
    try:
        tokenizer = AutoTokenizer.from_pretrained(loaded.model_path)
        config = AutoConfig.from_pretrained(loaded.model_path)
        eos = getattr(config, "eos_token_id", None)
        eos_ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        own = getattr(config, "max_position_embeddings", None) or MAX_DEFAULT_CONTEXT
        context = int(limits.context_length or min(own, MAX_DEFAULT_CONTEXT))
        return ReplicaRuntime(app, handle, tokenizer, limits, context_length=context, eos_ids=eos_ids)
    except Exception:
        delete_replicas(app)
        raise
