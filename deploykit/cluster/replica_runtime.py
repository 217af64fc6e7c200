"""A generation served by Ray Serve replicas (``spec.cluster``, ``spec.replicas``): the runtime the OpenAI
routes and ``Deployment.generate`` use, backed by one Serve application of N ``ModelReplica``s, each a
one-node model or a pipeline of its own stage actors.

Each generation gets its own application (``<name>-<id>``): a rollout starts the new replicas beside the
old ones, health-checks them, and swaps; requests already running finish on the old replicas, then the
old application is deleted when the generation is freed. Scaling ``spec.replicas`` is such a rollout, so
it never fails a request, and a broken revision never replaces the replicas that serve.

The front engine here admits like the in-process one (the shared ``engine.admission`` core): at most
``max_concurrent`` requests per replica are sent on, at most ``max_queued`` wait, the next one is refused
with ``QueueFull`` (429 and ``Retry-After`` in the API). Requests are sent by a fixed pool of as many
threads as there are slots, never a thread per request. Tokens stream back as each replica produces
them (a Serve streaming call), and a cancelled request stops its stream, which cancels it in the replica.
"""

from __future__ import annotations

import logging
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

from ..engine.admission import Admission
from ..engine.requests import GenerationRequest, GenerationResult, RequestHandle
from ..engine.runtime import TextRuntime, context_length, eos_ids_of
from ..engine.sampling import request_generator
from ..engine.serving import ServingSpec
from ..names import Task
from ..placement.plan import Plan
from .ray_env import ClusterError, connect
from .replicas import ReplicaOptions, delete_replicas, run_replicas, start_serve

log = logging.getLogger(__name__)


class ReplicaEngine:
    """The TextEngine over a Serve DeploymentHandle: ``slots`` requests in flight, ``max_queued`` waiting."""

    def __init__(self, handle: Any, eos_ids: set[int], *, slots: int, max_queued: int) -> None:
        self.handle = handle
        self.eos_ids = eos_ids
        self.slots = slots
        self._queue = Admission(max_queued=max_queued, prefix="rep")
        self._senders = ThreadPoolExecutor(max_workers=slots, thread_name_prefix="deploykit-replica")
        self._thread = threading.Thread(target=self._dispatch, name="deploykit-replica-dispatch", daemon=True)
        self._thread.start()

    def submit(self, request: GenerationRequest,
               listener: Callable[[int | GenerationResult], None] | None = None) -> RequestHandle:
        if not request.is_plain():  # a replica answers with token ids only
            raise ValueError("logprobs, echo, presence/frequency penalties and logit_bias are not served "
                             "through replicas (spec.replicas > 1)")
        h = RequestHandle(request, self._queue.check(request), rng=request_generator(request), listener=listener)
        self._queue.put(h, free_slots=max(0, self.slots - self._queue.running))  # free senders take them at once
        return h

    def cancel(self, handle: RequestHandle) -> None:
        handle.finish("cancelled")  # its sender stops reading the stream, which cancels it in the replica

    def stats(self) -> dict[str, int]:
        return self._queue.stats()

    def close(self, timeout: float | None = None) -> None:
        self._queue.close()
        self._thread.join(timeout)
        self._senders.shutdown(wait=True)

    def _dispatch(self) -> None:
        """Hand waiting requests to free sender slots, FIFO."""
        while self._queue.wait_for_work(0.5, ready=lambda: self._queue.running < self.slots):
            with self._queue.cond:
                batch = self._queue.take(self.slots - self._queue.running)
                self._queue.running += len(batch)
            for h in batch:
                self._senders.submit(self._send, h)

    def _send(self, h: RequestHandle) -> None:
        try:
            self._stream(h)
        except Exception as exc:  # a replica died mid-request: this request fails, the engine goes on
            h.finish("error", f"{type(exc).__name__}: {exc}")
        finally:
            with self._queue.cond:
                self._queue.running -= 1
                self._queue.cond.notify_all()

    def _stream(self, h: RequestHandle) -> None:
        r = h.request
        stream = self.handle.options(stream=True).stream_ids.remote(
            list(r.prompt_ids), r.max_new_tokens, r.temperature, r.top_p, r.seed, list(r.stop_strings))
        for item in stream:
            if h.done:  # cancelled here: stop the replica's copy too
                stream.cancel()
                return
            if isinstance(item, dict):
                h.finish(item["finish_reason"], item.get("error"))
                return
            for token in item:
                h.push(token)
        h.finish("error", "the replica's stream ended without a result")


class ReplicaRuntime(TextRuntime):
    """TextRuntime whose engine is N replicas on the cluster; ``close`` deletes their application."""

    def __init__(self, app: str, engine: ReplicaEngine, tokenizer: Any, serving: ServingSpec, *,
                 context_length: int) -> None:
        super().__init__(engine, tokenizer, serving.limits, context_length=context_length)
        self.app = app

    def close(self, timeout: float | None = 30.0) -> None:
        try:
            self.engine.close(timeout)
            delete_replicas(self.app)
        except Exception:  # the cluster is gone: nothing is left to delete
            log.warning("could not delete Serve application %s", self.app, exc_info=True)


def build_replica_runtime(plan: Plan, path: Path, serving: ServingSpec, *, address: str, replicas: int,
                          options: ReplicaOptions = ReplicaOptions()) -> ReplicaRuntime:
    """Start ``replicas`` replicas of ``plan`` (each loads ``path``: the shards laid out for it) as a new
    Serve application and return its runtime once every replica is up."""
    from transformers import AutoConfig, AutoTokenizer

    if serving.task != Task.CAUSAL_LM:
        raise ClusterError(f"{serving.name}: replicas on a cluster serve causal-lm models only")
    connect(address)
    start_serve()
    app = f"{serving.name}-{uuid.uuid4().hex[:8]}"
    handle = run_replicas(app, plan, str(path), serving, replicas, options)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        config = AutoConfig.from_pretrained(path, trust_remote_code=serving.load.trust_remote_code)
        engine = ReplicaEngine(handle, eos_ids_of(path, config), slots=serving.limits.max_concurrent * replicas,
                               max_queued=serving.limits.max_queued)
        return ReplicaRuntime(app, engine, tokenizer, serving, context_length=context_length(config, serving.limits))
    except Exception:
        delete_replicas(app)
        raise
