"""``spec.replicas`` on Ray Serve: N copies of one model behind one Serve deployment (one application
per deployment name). Each replica is a Ray actor that plans the manifest on its own node (one host),
loads it with deploykit's loader and serves requests with deploykit's batching engine.

Scaling is re-running ``serve.run`` with only ``num_replicas`` changed: Serve adds (or drains and
removes) replicas while the existing ones keep serving; deleting and re-running would be an outage
(docs/scale-out.md). A replica asks for fractional CPUs (``num_cpus``): a blue-green rollout needs room
for twice the replicas, and Serve's default of 1 CPU each would not fit on small nodes.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from .ray_env import require_ray, worker_env


class ModelReplica:
    """What runs in each Serve replica: one loaded model and its runtime (plain class; wrapped by
    :func:`deployment_of`)."""

    def __init__(self, manifest_text: str, base_dir: str, threads: int = 1) -> None:
        from pathlib import Path

        import torch

        from ..engine.loader import LoadOptions, load
        from ..engine.runtime import Limits, build_runtime
        from ..placement.planning import plan_manifest
        from ..spec.manifest import parse_manifests

        torch.set_num_threads(max(1, threads))
        loaded = parse_manifests(manifest_text.encode(), source="<replica>", base_dir=Path(base_dir))[0]
        spec = loaded.manifest.spec
        plan = plan_manifest(loaded)  # this replica's own host
        model = load(plan, loaded.model_path, LoadOptions(task=spec.model.task, dtype=spec.model.dtype,
                                                          trust_remote_code=spec.model.trust_remote_code,
                                                          allow_pickle=spec.model.allow_pickle))
        s = spec.serving
        limits = Limits(s.context_length, s.max_tokens, s.default_max_tokens, s.max_concurrent, s.max_queued,
                        s.max_input_items, s.batching)
        self.runtime: Any = build_runtime(model, limits, task=spec.model.task, kv_cache_bytes=256 << 20,
                                          forward_lock=None)
        self.name = loaded.name

    async def complete(self, prompt_ids: list[int], max_tokens: int = 16, temperature: float = 0.0) -> dict[str, Any]:
        from ..engine.runtime import Sampling

        result = await asyncio.to_thread(self.runtime.complete, list(prompt_ids),
                                         Sampling(max_tokens=max_tokens, temperature=temperature))
        return {"text": result.text, "finish_reason": result.finish_reason,
                "completion_tokens": result.completion_tokens, "replica": _replica_id()}

    async def generate_ids(self, prompt_ids: list[int], max_new_tokens: int, temperature: float, top_p: float,
                           seed: int | None, stop_strings: list[str]) -> dict[str, Any]:
        """One request through this replica's batching engine: the generated ids and how it ended."""
        from ..engine.batching import GenerationRequest

        request = GenerationRequest(prompt_ids=list(prompt_ids), max_new_tokens=max_new_tokens,
                                    temperature=temperature, top_p=top_p, seed=seed,
                                    stop_strings=tuple(stop_strings))
        handle = self.runtime.engine.submit(request)
        result = await asyncio.to_thread(handle.result)
        return {"token_ids": result.token_ids, "finish_reason": result.finish_reason, "error": result.error}

    def check_health(self) -> None:  # Serve calls it periodically; a closed runtime fails it
        if self.runtime is None:
            raise RuntimeError("no runtime")

    def __del__(self) -> None:
        runtime = getattr(self, "runtime", None)
        if runtime is not None:
            runtime.close(5)


def _replica_id() -> str:
    try:
        from ray import serve

        return str(serve.get_replica_context().replica_id.unique_id)
    except Exception:
        return "local"


@dataclass(frozen=True)
class ReplicaOptions:
    num_cpus: float = 0.5
    threads: int = 1
    max_ongoing_requests: int = 16


def start_serve() -> None:
    """Start Serve on the connected cluster without HTTP proxies: deploykit's own server is the front
    door and reaches replicas through a DeploymentHandle."""
    require_ray()
    from ray import serve

    serve.start(proxy_location="Disabled")


def run_replicas(name: str, manifest_text: str, base_dir: str, replicas: int,
                 options: ReplicaOptions = ReplicaOptions()) -> Any:
    """Deploy (or scale) ``replicas`` copies of the manifest's model as the Serve application ``name``;
    returns its DeploymentHandle once every replica is up. Calling it again with another count only
    scales: replicas already serving keep serving."""
    require_ray()
    from ray import serve

    deployment: Any = serve.deployment(ModelReplica, name=name)
    deployment = deployment.options(
        num_replicas=replicas, max_ongoing_requests=options.max_ongoing_requests,
        ray_actor_options={"num_cpus": options.num_cpus, "runtime_env": {"env_vars": worker_env()}},
        health_check_period_s=2, graceful_shutdown_timeout_s=20)
    return serve.run(deployment.bind(manifest_text, base_dir, options.threads), name=name, route_prefix=None)


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
