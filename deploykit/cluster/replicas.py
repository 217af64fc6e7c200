"""``spec.replicas`` on Ray Serve: N copies of one model behind one Serve deployment (one application
per generation). Each replica is a Ray actor that loads the plan it is given (the plan the revision
recorded, never planned again) from the laid-out shards and serves it with deploykit's engine: the
batching engine in the replica's process for a one-node plan, or, for a plan of ``placement.nodes``
stages, its own pipeline of stage actors. A pipeline replica asks Serve for one placement-group
bundle per stage (``placement_group_bundles``, ``STRICT_SPREAD``): the replica runs in the first bundle
with stage 0 and each further stage in its own bundle, so two stages of one replica never share a node
and a replica's stages live and die with it.

Tokens stream back as they are produced (``stream_ids`` is a Serve streaming method: the caller reads
a ``DeploymentResponseGenerator``); a caller that stops reading cancels the request in the replica.

Scaling is re-running ``serve.run`` with only ``num_replicas`` changed: Serve adds (or drains and
removes) replicas while the existing ones keep serving; deleting and re-running would be an outage
(docs/scale-out.md). Replicas ask for fractional CPUs (``num_cpus``): a blue-green rollout needs room
for twice the replicas, and Serve's default of 1 CPU each would not fit on small nodes.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .ray_env import ClusterError, require_ray, worker_env

if TYPE_CHECKING:
    from ..engine.serving import ServingSpec
    from ..placement.planner import Plan


@dataclass(frozen=True)
class ReplicaOptions:
    num_cpus: float = 0.25  # the replica actor itself (and stage 0 of a pipeline beside it)
    stage_cpus: float = 0.25  # each pipeline stage actor
    threads: int = 1  # torch threads of the replica's model, or of each stage
    timeout: float = 600.0  # seconds for every replica to be placed, loaded and healthy


class ModelReplica:
    """What runs in each Serve replica: one loaded model (or one pipeline of stage actors) and its
    runtime (plain class; deployed by :func:`run_replicas`)."""

    def __init__(self, plan_json: str, path: str, serving: ServingSpec, options: ReplicaOptions) -> None:
        import json

        import torch

        from ..placement.planner import Plan

        torch.set_num_threads(max(1, options.threads))
        plan = Plan.from_dict(json.loads(plan_json))
        self.runtime: Any = (_pipeline_runtime(plan, path, serving, options) if plan.nodes
                             else _local_runtime(plan, path, serving))
        self.name = serving.name

    async def stream_ids(self, prompt_ids: list[int], max_new_tokens: int, temperature: float, top_p: float,
                         seed: int | None, stop_strings: list[str]) -> AsyncIterator[list[int] | dict[str, Any]]:
        """One request through this replica's engine: lists of new token ids as they come, then a dict
        saying how it ended. Closing the stream early (the caller cancelled) cancels the request here."""
        from ..engine.requests import GenerationRequest, GenerationResult

        request = GenerationRequest(prompt_ids=list(prompt_ids), max_new_tokens=max_new_tokens,
                                    temperature=temperature, top_p=top_p, seed=seed,
                                    stop_strings=tuple(stop_strings))
        loop = asyncio.get_running_loop()
        items: asyncio.Queue[int | GenerationResult] = asyncio.Queue()
        engine = self.runtime.engine
        handle = engine.submit(request, lambda item: loop.call_soon_threadsafe(items.put_nowait, item))
        try:
            while True:
                chunk: list[int] = []
                item = await items.get()
                while isinstance(item, int):  # whatever else has arrived goes in the same message
                    chunk.append(item)
                    if items.empty():
                        break
                    item = items.get_nowait()
                if chunk:
                    yield chunk
                if isinstance(item, GenerationResult):
                    yield {"finish_reason": item.finish_reason, "error": item.error}
                    return
        finally:
            if not handle.done:  # the caller went away: free the slot
                engine.cancel(handle)

    def stats(self) -> dict[str, int]:
        return dict(self.runtime.engine.stats())

    def whoami(self) -> str:
        """This replica's Serve id (which replica answered)."""
        from ray import serve

        return str(serve.get_replica_context().replica_id.unique_id)

    def check_health(self) -> None:  # Serve calls it periodically; a closed runtime fails it
        if self.runtime is None:
            raise RuntimeError("no runtime")

    def __del__(self) -> None:
        runtime = getattr(self, "runtime", None)
        if runtime is not None:
            runtime.close(5)


def _local_runtime(plan: Plan, path: str, serving: ServingSpec) -> Any:
    from pathlib import Path

    from ..engine.loader import load
    from ..engine.runtime import build_runtime

    model = load(plan, Path(path), serving.load)
    return build_runtime(model, serving.limits, task=serving.load.task, kv_cache_bytes=256 << 20, forward_lock=None)


def _pipeline_runtime(plan: Plan, path: str, serving: ServingSpec, options: ReplicaOptions) -> Any:
    """The replica's own stages, one per bundle of the placement group Serve reserved for it."""
    from pathlib import Path

    from .runtime import PipelineOptions, build_pipeline_runtime

    return build_pipeline_runtime(plan, Path(path), serving, None, PipelineOptions(
        num_cpus=options.stage_cpus, threads=options.threads, in_replica_group=True))


def replica_bundles(plan: Plan, options: ReplicaOptions) -> list[dict[str, float]] | None:
    """Serve's per-replica placement group for a pipeline plan: the replica and stage 0 in bundle 0,
    each further stage in its own bundle (None: a one-node plan needs none)."""
    if not plan.nodes:
        return None
    gpu = {"GPU": 1.0} if _gpus(plan) else {}  # as RayPipeline asks: one GPU per stage when any uses one
    return ([{"CPU": options.num_cpus + options.stage_cpus, **gpu}]
            + [{"CPU": options.stage_cpus, **gpu} for _ in plan.nodes[1:]])


def _gpus(plan: Plan) -> int:
    """The GPUs a one-node plan uses (a replica asks Ray for them), or whether a pipeline plan uses any."""
    return len({d for d in plan.device_map.values() if isinstance(d, int)})


def start_serve() -> None:
    """Start Serve on the connected cluster without HTTP proxies: deploykit's own server is the front
    door and reaches replicas through a DeploymentHandle."""
    require_ray()
    from ray import serve

    serve.start(proxy_location="Disabled")


def run_replicas(name: str, plan: Plan, path: str, serving: ServingSpec, replicas: int,
                 options: ReplicaOptions = ReplicaOptions()) -> Any:
    """Deploy (or scale) ``replicas`` copies of ``plan`` as the Serve application ``name``; returns its
    DeploymentHandle once every replica is up. Calling it again with another count only scales:
    replicas already serving keep serving."""
    require_ray()
    from ray import serve

    limits = serving.limits
    bundles = replica_bundles(plan, options)
    placement: dict[str, Any] = {}
    if bundles is not None:
        placement = {"placement_group_bundles": bundles, "placement_group_strategy": "STRICT_SPREAD"}
    deployment: Any = serve.deployment(ModelReplica, name=name)
    deployment = deployment.options(  # a replica takes what its own engine would admit, no more
        num_replicas=replicas, max_ongoing_requests=limits.max_concurrent + limits.max_queued,
        ray_actor_options={"num_cpus": options.num_cpus, "num_gpus": 0 if plan.nodes else _gpus(plan),
                           "runtime_env": {"env_vars": worker_env()}},
        health_check_period_s=2, graceful_shutdown_timeout_s=20, **placement)
    app = deployment.bind(plan.to_json(), path, serving, options)
    what = f"{replicas} replica(s) of {bundles or {'CPU': options.num_cpus}}"
    return _run_within(app, name, options.timeout, what)


def _run_within(app: Any, name: str, timeout: float, what: str) -> Any:
    """``serve.run`` with a deadline: Serve waits forever for replicas the cluster cannot place, so past
    ``timeout`` the application is deleted and a ClusterError says what did not fit."""
    ray = require_ray()
    from ray import serve

    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["handle"] = serve.run(app, name=name, route_prefix=None)
        except BaseException as exc:  # handed to the caller's thread
            outcome["error"] = exc

    runner = threading.Thread(target=run, name="deploykit-serve-run", daemon=True)
    runner.start()
    runner.join(timeout)
    if runner.is_alive():
        free = ray.available_resources()
        serve.delete(name)
        raise ClusterError(f"Ray Serve could not start {what} within {timeout:g}s; the cluster has "
                           f"{free.get('CPU', 0):g} CPU and {free.get('GPU', 0):g} GPU free") from None
    if "error" in outcome:
        raise outcome["error"]
    return outcome["handle"]


def replica_count(name: str) -> int:
    """Replicas of application ``name`` that are RUNNING now."""
    require_ray()
    from ray import serve

    status = serve.status().applications.get(name)
    if status is None:
        return 0
    return sum(int(count) for d in status.deployments.values() for state, count in d.replica_states.items()
               if str(getattr(state, "value", state)) == "RUNNING")


def delete_replicas(name: str) -> None:
    require_ray()
    from ray import serve

    serve.delete(name)
