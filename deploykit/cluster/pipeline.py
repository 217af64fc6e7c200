"""Pipeline stages across the nodes of a Ray cluster: one actor per stage, one stage per node
(a STRICT_SPREAD placement group), hidden states handed from actor to actor through Ray (an ObjectRef
passed as an argument: the driver never sees them, only the last stage's logits).

``stages_of(plan, ...)`` turns a multi-node plan into the stages' specs; ``RayPipeline.start`` places
and builds them; ``step`` runs one forward of a request group through every stage; ``release`` frees
that group's KV cache on every stage; ``close`` kills the actors and removes the placement group.
``LocalPipeline`` runs the same stages in this process (tests, benchmarks).
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..placement.plan import Plan
from .ray_env import ClusterError, require_ray, worker_env
from .stage import Stage, StageSpec

_LAYER_KEY = re.compile(r"\.layers\.(\d+)$")


def stages_of(plan: Plan, checkpoint: Path, *, dtype: str, threads: int = 1) -> list[StageSpec]:
    """One stage per node of ``plan``: its decoder layers [start, end) and its device (CPU, or the
    first GPU the plan gives it on its node)."""
    if not plan.nodes:
        raise ClusterError(f"plan {plan.name!r} has one node: it needs no pipeline (set placement.nodes)")
    count = len(plan.nodes)
    specs, expected = [], 0
    for node in plan.nodes:
        layers = sorted(int(m.group(1)) for key, k in plan.node_map.items() if k == node.node
                        for m in [_LAYER_KEY.search(key)] if m)
        start, end = (layers[0], layers[-1] + 1) if layers else (expected, expected)
        if start != expected or layers != list(range(start, end)):
            raise ClusterError(f"plan {plan.name!r}: node {node.name} does not hold one contiguous run of "
                               f"layers after layer {expected - 1}")
        gpus = sorted(d for key, d in plan.stage_device_map(node.node).items() if isinstance(d, int))
        specs.append(StageSpec(index=node.node, count=count, start=start, end=end, checkpoint=str(checkpoint),
                               dtype=dtype, device=f"cuda:{gpus[0]}" if gpus else "cpu", threads=threads))
        expected = end
    return specs


def _new_group(count: int, bundle: dict[str, float], timeout: float) -> Any:
    """A STRICT_SPREAD placement group of ``count`` bundles, ready (or a ClusterError naming the nodes)."""
    ray = require_ray()
    from ray.util.placement_group import placement_group, remove_placement_group

    group = placement_group([dict(bundle) for _ in range(count)], strategy="STRICT_SPREAD",
                            name=f"deploykit-pipeline-{uuid.uuid4().hex[:8]}")
    try:
        ray.get(group.ready(), timeout=timeout)
    except Exception as exc:
        remove_placement_group(group)
        nodes = sum(1 for n in ray.nodes() if n.get("Alive"))
        raise ClusterError(f"cannot place {count} pipeline stages on distinct nodes ({bundle} each) "
                           f"within {timeout:g}s: the cluster has {nodes} alive node(s) "
                           f"({type(exc).__name__})") from None
    return group


def _current_group(count: int) -> Any:
    """The placement group this actor runs in (a Ray Serve replica's), which must hold a bundle per stage."""
    require_ray()
    from ray.util import get_current_placement_group

    group = get_current_placement_group()
    if group is None or len(group.bundle_specs) < count:
        have = 0 if group is None else len(group.bundle_specs)
        raise ClusterError(f"the replica's placement group has {have} bundle(s), {count} stages need one each")
    return group


def split_layers(num_layers: int, count: int) -> list[tuple[int, int]]:
    """An even split of ``num_layers`` into ``count`` contiguous runs (for tests and benchmarks)."""
    bounds = [round(i * num_layers / count) for i in range(count + 1)]
    return list(zip(bounds, bounds[1:]))


class LocalPipeline:
    """The stages in this process, one after the other (no Ray)."""

    def __init__(self, specs: Sequence[StageSpec]) -> None:
        self.stages = [Stage(s) for s in specs]

    def step(self, group: str, ids: Any, mask: Any, positions: Any) -> Any:
        x = ids
        for stage in self.stages:
            x = stage.forward(group, x, mask, positions)
        return x

    def release(self, group: str) -> None:
        for stage in self.stages:
            stage.release(group)

    def close(self) -> None:
        self.stages = []


class RayPipeline:
    """Stage actors on distinct nodes of the connected Ray cluster."""

    def __init__(self, actors: list[Any], group: Any, specs: list[StageSpec]) -> None:
        self.actors, self.placement_group, self.specs = actors, group, specs

    @classmethod
    def start(cls, specs: list[StageSpec], *, num_cpus: float = 1.0, num_gpus: float = 0.0,
              timeout: float = 300.0, env: dict[str, str] | None = None,
              in_current_group: bool = False) -> RayPipeline:
        """Reserve one bundle per stage on distinct nodes (STRICT_SPREAD), start a stage actor in each and
        wait until every stage has built its model. ``num_cpus`` may be fractional. ``in_current_group``:
        the caller (a Ray Serve replica) already holds such a group, one bundle per stage: use it (it is
        the caller's, so ``close`` leaves it)."""
        ray = require_ray()
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        bundle: dict[str, float] = {"CPU": num_cpus}
        if num_gpus:
            bundle["GPU"] = num_gpus
        group = _current_group(len(specs)) if in_current_group else _new_group(len(specs), bundle, timeout)
        actor_cls = ray.remote(Stage)
        runtime_env = {"env_vars": {**worker_env(), **(env or {})}}
        actors = [actor_cls.options(
            num_cpus=num_cpus, num_gpus=num_gpus, runtime_env=runtime_env, max_concurrency=1,
            scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=i),
        ).remote(spec) for i, spec in enumerate(specs)]
        pipeline = cls(actors, None if in_current_group else group, specs)
        try:
            ray.get([a.info.remote() for a in actors], timeout=timeout)
        except Exception as exc:
            pipeline.close()
            raise ClusterError(f"a pipeline stage failed to start: {exc}") from None
        return pipeline

    def step(self, group: str, ids: Any, mask: Any, positions: Any) -> Any:
        ray = require_ray()
        x: Any = ids
        mask_ref, pos_ref = ray.put(mask), ray.put(positions)
        for actor in self.actors:  # each call gets the previous one's ObjectRef: no driver round trip
            x = actor.forward.remote(group, x, mask_ref, pos_ref)
        return ray.get(x)

    def release(self, group: str) -> None:
        ray = require_ray()
        try:
            ray.get([a.release.remote(group) for a in self.actors], timeout=60)
        except Exception:  # an actor that died has no cache left to free
            pass

    def info(self) -> list[dict[str, Any]]:
        ray = require_ray()
        return list(ray.get([a.info.remote() for a in self.actors]))

    def node_ids(self) -> list[str]:
        ray = require_ray()
        return list(ray.get([a.node_id.remote() for a in self.actors]))

    def close(self) -> None:
        ray = require_ray()
        from ray.util.placement_group import remove_placement_group

        for actor in self.actors:
            try:
                ray.kill(actor)
            except Exception:
                pass
        self.actors = []
        if self.placement_group is not None:
            try:
                remove_placement_group(self.placement_group)
            except Exception:
                pass
            self.placement_group = None


def greedy(pipeline: Any, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
           group: str | None = None, eos: Sequence[int] = ()) -> list[list[int]]:
    """Greedy continuation of a left-padded batch through ``pipeline``, the way ``generate`` does it
    (2-D mask growing by one per step, position ids cumsum(mask) - 1). Frees the group's caches."""
    import torch

    group = group or uuid.uuid4().hex
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + list(p) for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out: list[list[int]] = [[] for _ in prompts]
    done = [False] * len(prompts)
    try:
        positions = (mask.cumsum(1) - 1).clamp(min=0)
        for _ in range(max_new_tokens):
            logits = pipeline.step(group, ids, mask, positions)
            nxt = logits.argmax(-1)
            for i, t in enumerate(nxt.tolist()):
                if not done[i]:
                    out[i].append(t)
                    done[i] = t in eos
            if all(done):
                break
            ids = nxt[:, None]
            mask = torch.cat([mask, torch.ones(len(prompts), 1, dtype=mask.dtype)], 1)
            positions = mask.sum(1, keepdim=True) - 1
    finally:
        pipeline.release(group)
    return out
