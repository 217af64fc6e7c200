"""How a recorded revision becomes a model that serves: verified shards loaded in this process, pipeline
stages on a Ray cluster, or Ray Serve replicas — each health-checked before anything serves it. The
reconciler calls ``load_checked`` after recording a revision; a rollout restoring the last good revision
calls ``load_revision``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...artifacts.verify import read_lock, recorded_problem, shard_problem
from ...errors import ApplyError, CheckpointError
from ...placement.plan import Plan
from ...spec.engines import LLAMA_CPP
from ...spec.manifest import LoadedManifest
from .state import Revision, StateStore

if TYPE_CHECKING:
    from ...engine.llamacpp.process import ServerOptions
    from ...engine.loader import LoadedModel
    from ...engine.serving import ServingSpec
    from ...engine.types import Speculation


def shards_problem(revision: Revision | None, *, hashes: bool) -> str | None:
    """Why the shards ``revision`` recorded cannot be reused (None: they can). ``hashes`` reads every
    byte and compares checksums (before a load); without it only presence and sizes are checked."""
    if revision is None or not revision.shards_path:
        return "no shards recorded"
    path = Path(revision.shards_path)
    lock = read_lock(path)
    if lock is not None:
        return shard_problem(path, lock, hashes=hashes)
    if revision.checksums:  # the source itself, used in place: its files as recorded
        recorded = revision.checksums if hashes else {f: {**e, "hash": None} for f, e in revision.checksums.items()}
        return recorded_problem(path, recorded)
    return None if (path / "config.json").is_file() else f"{path}: no config.json"


class StepTimer:
    def __init__(self, on_step: Callable[[str], None] | None) -> None:
        self.timings: dict[str, float] = {}
        self.on_step = on_step

    @contextmanager
    def step(self, name: str) -> Iterator[None]:
        if self.on_step:
            self.on_step(name)
        start = time.perf_counter()
        try:
            yield
        finally:
            self.timings[name] = round(time.perf_counter() - start, 4)


def serving_of(loaded: LoadedManifest, *, show_progress: bool = False) -> ServingSpec:
    """What the layers below need of a manifest to load and serve it (they never see the manifest)."""
    from ...engine.loader import LoadOptions
    from ...engine.runtime import Limits
    from ...engine.serving import ServingSpec

    spec = loaded.manifest.spec
    disk, s, hc = spec.offload.disk, spec.serving, spec.rollout.health_check
    load = LoadOptions(task=spec.model.task, dtype=spec.model.dtype, trust_remote_code=spec.model.trust_remote_code,
                       allow_pickle=spec.model.allow_pickle, offload_dir=loaded.resolve(disk.path) if disk else None,
                       show_progress=show_progress)
    limits = Limits(s.context_length, s.max_tokens, s.default_max_tokens, s.max_concurrent, s.max_queued,
                    s.max_input_items, s.batching, s.tool_call_parser, prefill_chunk=s.prefill_chunk,
                    tool_format=s.tool_format)
    if spec.engine.name == LLAMA_CPP:  # its slots decode together; each holds engine.context tokens
        limits = Limits(s.context_length or spec.engine.context, s.max_tokens, s.default_max_tokens, spec.engine.slots,
                        s.max_queued, s.max_input_items, s.batching, s.tool_call_parser, tool_format=s.tool_format)
    from ...engine.adapters import AdapterSource

    adapters = tuple(AdapterSource(a.name, str(loaded.resolve(a.path)), a.scale) for a in spec.adapters)
    return ServingSpec(loaded.name, load, limits, health_input=hc.input, health_timeout=hc.timeout,
                       adapters=adapters, speculative=speculation_of(loaded))


def speculation_of(loaded: LoadedManifest) -> Speculation | None:
    """``spec.speculative`` as the transformers engine serves it (the llama.cpp engine reads the manifest's
    own: its flags); a draft's path resolved against the manifest's directory."""
    from ...engine.types import Speculation

    s = loaded.manifest.spec.speculative
    if s is None or is_llama_cpp(loaded):
        return None
    draft = s.draft
    path = str(loaded.resolve(draft.path)) if draft is not None and draft.path is not None else None
    return Speculation(s.method, s.num_tokens, s.ngram_min, s.ngram_max, draft_path=path,
                       draft_quantized=draft.quantized if draft is not None else None)


def load_checked(loaded: LoadedManifest, plan: Plan, shards: Path, timer: StepTimer, *,
                  show_progress: bool = False,
                  interrupted: Callable[[], None] | None = None) -> tuple[LoadedModel, str]:
    """Load ``shards`` as ``plan`` places them, where the manifest says (this process, pipeline stages on
    its cluster, or Serve replicas), and health-check the result. ``interrupted`` (raising to stop: a
    rollout's abort) is checked between the weights this process loads (``engine.loader.interruptible``)."""
    from ...engine.health import check

    serving = serving_of(loaded, show_progress=show_progress)
    if is_llama_cpp(loaded):
        return _start_llama_server(loaded, plan, shards, serving, timer)
    cluster = loaded.manifest.spec.cluster
    if cluster is not None and is_replicated(loaded):
        return _start_replicas(plan, shards, serving, cluster.address, loaded.manifest.spec.replicas, timer)
    if cluster is not None and is_pipeline(loaded):
        return _start_pipeline(plan, shards, serving, cluster.address, timer)
    if is_tensor_parallel(loaded):
        return _start_ranks(plan, shards, serving, loaded.manifest.spec.placement.tensor_parallel, timer)
    with timer.step("load"):
        model = load_model(plan, shards, serving, interrupted=interrupted)
    with timer.step("health-check"):
        health = check(model, task=serving.load.task, text=serving.health_input, timeout=serving.health_timeout)
    return model, health.detail


def is_llama_cpp(loaded: LoadedManifest) -> bool:
    """A llama-server process serves the GGUF file in place (``spec.engine.name: llama.cpp``)."""
    return loaded.manifest.spec.engine.name == LLAMA_CPP


def llama_server_options(loaded: LoadedManifest, plan: Plan) -> ServerOptions:
    """The flags of the deployment's llama-server: ``spec.engine``, the plan's placement (its draft model's
    too) and ``spec.speculative``; the binary checked with ``--version`` (``BinaryError`` when there is none
    that runs)."""
    from ...engine.llamacpp.binary import find_binary
    from ...engine.llamacpp.flags import placement_flags, speculative_flags
    from ...engine.llamacpp.process import ServerOptions

    spec = loaded.manifest.spec
    engine = spec.engine
    binary = find_binary(loaded.resolve(engine.binary) if engine.binary else None)
    if spec.speculative is not None and spec.speculative.draft is not None and plan.draft is None:
        raise ApplyError("the plan has no draft model for spec.speculative (a plan recorded before it): "
                         "apply again to plan it")
    return ServerOptions(binary.path, loaded.model_path.resolve(), slots=engine.slots, context=engine.context,
                         threads=engine.threads, batch_size=engine.batch_size,
                         placement=placement_flags(plan.device_map),
                         speculative=speculative_flags(spec.speculative, plan.draft))


def _start_llama_server(loaded: LoadedManifest, plan: Plan, shards: Path, serving: ServingSpec,
                        timer: StepTimer) -> tuple[LoadedModel, str]:
    """Start the generation's llama-server, wait for it to load, and check it with a greedy request."""
    from ...engine.llamacpp.runtime import LlamaOptions, LlamaRuntime

    options = LlamaOptions(llama_server_options(loaded, plan), serving.health_input, serving.health_timeout)
    return _started_and_checked(lambda: LlamaRuntime(options, serving.limits), plan, shards, serving, timer)


def is_pipeline(loaded: LoadedManifest) -> bool:
    """One pipeline of stages on several nodes of a Ray cluster, driven from this process."""
    spec = loaded.manifest.spec
    return spec.cluster is not None and spec.placement.nodes > 1 and spec.replicas == 1


def is_replicated(loaded: LoadedManifest) -> bool:
    """Ray Serve replicas (``spec.replicas`` of them; each one model, or one pipeline of its own stages
    when ``placement.nodes > 1``) rather than a model in this process."""
    spec = loaded.manifest.spec
    return spec.cluster is not None and (spec.placement.nodes == 1 or spec.replicas > 1)


def is_tensor_parallel(loaded: LoadedManifest) -> bool:
    """Rank processes, each holding its slices of every layer, rather than one model in this process."""
    return loaded.manifest.spec.placement.tensor_parallel > 1


def _start_ranks(plan: Plan, shards: Path, serving: ServingSpec, ranks: int,
                 timer: StepTimer) -> tuple[LoadedModel, str]:
    """Start the ranks on their own rank files and check them through one forward across all of them."""
    from ...engine.tensor_parallel.runtime import (
        RankOptions,
        build_tensor_parallel_runtime,
    )

    gpus = tuple(d.device for d in plan.devices if isinstance(d.device, int))
    options = RankOptions(ranks=ranks, dtype=serving.load.dtype, gpus=gpus,
                          trust_remote_code=serving.load.trust_remote_code)
    return _started_and_checked(lambda: build_tensor_parallel_runtime(shards, options, serving.limits), plan,
                                shards, serving, timer)


def _started_and_checked(build: Callable[[], Any], plan: Plan, shards: Path, serving: ServingSpec,
                         timer: StepTimer) -> tuple[LoadedModel, str]:
    """A runtime whose model lives elsewhere (stage actors, rank processes), built and health-checked
    like an in-process model, and closed if the check fails. The LoadedModel carries the runtime."""
    from ...engine.loader import LoadedModel

    with timer.step("load"):
        runtime = build()
    try:
        with timer.step("health-check"):
            health = runtime.health_check(serving.health_input, timeout=serving.health_timeout)
    except BaseException:
        runtime.close()
        raise
    return LoadedModel(None, plan, shards, "cpu", False, runtime.tokenizer, runtime=runtime), health.detail


def _start_replicas(plan: Plan, shards: Path, serving: ServingSpec, address: str, replicas: int,
                    timer: StepTimer) -> tuple[LoadedModel, str]:
    """A new Serve application of ``replicas`` replicas, checked with one generated token."""
    from ...cluster.replica_runtime import build_replica_runtime
    from ...engine.health import within
    from ...engine.loader import LoadedModel
    from ...engine.runtime import Sampling

    with timer.step("load"):
        runtime = build_replica_runtime(plan, shards, serving, address=address, replicas=replicas)
    try:
        with timer.step("health-check"):
            ids = runtime.tokenizer(serving.health_input)["input_ids"] or [0]
            done, elapsed = within(lambda: runtime.complete(ids, Sampling(max_tokens=1)),
                                   timeout=serving.health_timeout)
    except BaseException:
        runtime.close()
        raise
    stages = f" of {len(plan.nodes)} stages each" if plan.nodes else ""
    detail = f"{replicas} replica(s){stages} answered in {elapsed:.2f}s ({done.finish_reason})"
    return LoadedModel(None, plan, shards, "cpu", False, runtime.tokenizer, runtime=runtime), detail


def _start_pipeline(plan: Plan, shards: Path, serving: ServingSpec, address: str,
                    timer: StepTimer) -> tuple[LoadedModel, str]:
    """Start the plan's stages on the cluster (each reads its own tensors from ``shards``) and check them
    like an in-process model. No model lives here: the LoadedModel carries the runtime instead."""
    from ...cluster.runtime import build_pipeline_runtime

    return _started_and_checked(lambda: build_pipeline_runtime(plan, shards, serving, address), plan, shards,
                                serving, timer)


def load_model(plan: Plan, shards: Path, serving: ServingSpec,
               interrupted: Callable[[], None] | None = None) -> LoadedModel:
    """Load ``shards`` as ``plan`` places them, with the manifest's model options (not health-checked:
    callers go through ``load_revision`` or ``apply``)."""
    from ...engine.loader import load

    return load(plan, shards, serving.load, interrupted)


def load_revision(revision: Revision) -> LoadedModel:
    """Load a recorded Ready revision again (a failed recreate restores it): shards verified against
    their checksums, then loaded and health-checked."""
    if revision.plan is None:
        raise ApplyError(f"revision {revision.revision} of {revision.name!r} has no plan")
    problem = shards_problem(revision, hashes=True)
    if problem is not None:
        raise CheckpointError(f"revision {revision.revision} of {revision.name!r} cannot be loaded: {problem}")
    model, _ = load_checked(recorded_manifest(revision), revision.plan,
                             Path(revision.shards_path or ""), StepTimer(None))
    return model


def checked_current(store: StateStore, name: str, *, verified: int | None) -> Revision:
    """``name``'s current revision, its laid-out shards checked: by hash unless ``verified`` is that
    revision (this process checked it by hash before), else by presence and size."""
    current = store.current(name)
    if current is None or current.plan is None:
        raise ApplyError(f"{name!r} has no Ready revision to load")
    problem = shards_problem(current, hashes=verified != current.revision)
    if problem is not None:
        raise CheckpointError(f"revision {current.revision} of {name!r} cannot be loaded: {problem}")
    return current


def load_laid_out(revision: Revision) -> tuple[LoadedModel, Plan, ServingSpec]:
    """Load ``revision`` (shards already checked: ``checked_current``) from its shards, no reshard, and
    health-check it: the model, its plan and what serving it needs."""
    assert revision.plan is not None
    manifest, plan = recorded_manifest(revision), revision.plan
    model, _ = load_checked(manifest, plan, Path(revision.shards_path or ""), StepTimer(None))
    return model, plan, serving_of(manifest)


def recorded_manifest(revision: Revision) -> LoadedManifest:
    """The manifest a revision recorded (normalised, absolute paths), loaded again."""
    from ...spec.manifest import parse_manifests

    from dataclasses import replace

    [loaded] = parse_manifests(revision.manifest_text.encode(), source=revision.manifest_path,
                               base_dir=Path(revision.manifest_path).parent)
    if loaded.name != revision.name:
        raise ApplyError(f"revision {revision.revision} of {revision.name!r} records another name")
    return replace(loaded, commit=revision.git_commit)  # a rollback records the commit its content came from
