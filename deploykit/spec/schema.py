"""The manifest's schema: the pydantic models of a ``ModelDeployment`` and the value parsers they use.

Each model says what a section of a manifest may hold, with the defaults, bounds and cross-field checks
that make a validated manifest an immutable value. Sizes, durations and keep-alives are parsed here from
what a person writes ('2GiB', '120s', 'forever'). Loading a file into these models, and locating what is
wrong in it, is ``deploykit.spec.manifest``'s. No torch, no transformers: ``deploykit validate`` stays fast.
"""

from __future__ import annotations

import re
from itertools import pairwise
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    StrictBool,
    ValidationInfo,
    SerializerFunctionWrapHandler,
    WithJsonSchema,
    field_validator,
    model_serializer,
    model_validator,
)
from pydantic_core import PydanticCustomError

from ..units import SIZE_UNITS_TEXT, format_duration, parse_duration, parse_size

API_VERSION = "deploykit/v1"
KIND = "ModelDeployment"
_NAME_RE = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")


def _size(value: object) -> int:
    try:
        return parse_size(value)
    except ValueError as exc:
        raise PydanticCustomError("size", str(exc)) from None


def _duration(value: object) -> float:
    try:
        return parse_duration(value)
    except ValueError as exc:
        raise PydanticCustomError("duration", str(exc)) from None


Size = Annotated[
    int,
    BeforeValidator(_size),
    WithJsonSchema({
        "anyOf": [
            {"type": "integer", "minimum": 0},
            {"type": "string", "pattern": r"^\s*\d+(\.\d+)?\s*([KMGT]i?B|[kK]i?B|B)?\s*$"},
        ],
        "description": f"A size: {SIZE_UNITS_TEXT}.",
    }),
]
Duration = Annotated[
    float,
    BeforeValidator(_duration),
    PlainSerializer(format_duration, return_type=str),
    WithJsonSchema({
        "anyOf": [{"type": "number", "exclusiveMinimum": 0},
                  {"type": "string", "pattern": r"^\s*\d+(\.\d+)?\s*(ms|s|m|h)?\s*$"}],
        "description": "A duration: '500ms', '120s', '2m', '1h', or a number of seconds.",
    }),
]


def _keep_alive(value: object) -> float | None:
    if value is None or value == "forever":
        return None
    try:
        return parse_duration(value)
    except ValueError as exc:
        raise PydanticCustomError("keep_alive", f"{exc}, or 'forever'") from None


KeepAlive = Annotated[
    float | None,
    BeforeValidator(_keep_alive),
    PlainSerializer(lambda v: "forever" if v is None else format_duration(v), return_type=str),
    WithJsonSchema({
        "anyOf": [{"type": "number", "exclusiveMinimum": 0},
                  {"type": "string", "pattern": r"^\s*(forever|\d+(\.\d+)?\s*(ms|s|m|h)?)\s*$"}],
        "description": "A duration ('30s', '5m', '1h', or a number of seconds), or 'forever'.",
    }),
]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


class ModelSpec(_Strict):
    """The checkpoint to deploy."""

    path: Path = Field(description="Checkpoint directory (config.json + *.safetensors). "
                                   "A relative path resolves against the manifest's directory.")
    task: Literal["causal-lm", "seq2seq-lm", "feature-extraction"] = Field(
        "causal-lm", description="What the model is loaded for; picks the AutoModel class.")
    dtype: Literal["float32", "float16", "bfloat16"] = Field(
        "float16", description="Weights are loaded (and sized for planning) at this dtype.")
    quantization: Literal["none", "int8", "int4"] = Field(
        "none", description="Weight-only quantization of the linear layers of the transformer blocks: int8 "
                            "(per output channel) or int4 (groups of 32, asymmetric). Embeddings, lm_head, "
                            "norms and scales stay at dtype. Planned, laid out and loaded quantized.")
    trust_remote_code: StrictBool = Field(
        False, description="Run Python code shipped with the checkpoint. Strictly true or false.")
    allow_pickle: StrictBool = Field(
        False, description="Accept pickle weights (*.bin, *.pt), read with torch.load(weights_only=True). "
                           "Off: unpickling can run code.")

    @model_serializer(mode="wrap")
    def _omit_no_quantization(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data: dict[str, Any] = handler(self)
        if self.quantization == "none":  # manifests that never name quantization keep their digest
            data.pop("quantization", None)
        return data


class KVCache(_Strict):
    """Room reserved for the KV cache of each decoder layer, on the device holding that layer."""

    tokens: int = Field(ge=1, description="Cached tokens to plan for (batch x sequence length).")


class Placement(_Strict):
    """Which GPUs hold the model, and in what proportion."""

    gpus: list[Annotated[int, Field(ge=0)]] | Literal["all"] = Field(
        default=[], description='CUDA device indices, "all", or [] for no GPU.')
    ratios: list[Annotated[float, Field(ge=0)]] | None = Field(
        None, description="Relative share of the model per GPU, same length as gpus; default equal.")
    reserve: Size = Field(2 * 2**30, description="Per-GPU headroom kept free: CUDA context, "
                                                 "activations, KV cache not planned with kv_cache.")
    embeddings: Literal["first"] = Field(
        "first", description="Input embeddings go on the first listed GPU.")
    balance: Literal["memory", "compute"] = Field(
        "memory", description="Balance bytes per GPU (memory) or estimated FLOPs per token (compute).")
    kv_cache: KVCache | None = Field(None, description="Plan KV-cache and logits memory per layer.")
    nodes: int = Field(1, ge=1, description="Pipeline stages, one per node of spec.cluster: layers are split "
                                            "node-major (contiguous runs per node, then per GPU within a node; "
                                            "embeddings on the first node's first GPU). 1: one host. "
                                            "Deploying more than 1 needs spec.cluster; `deploykit plan "
                                            "--devices` does not.")
    tensor_parallel: int = Field(1, ge=1, description="Ranks every attention and MLP layer is split across "
                                                      "(transformers' tp_plan): one per listed GPU, or that many "
                                                      "worker processes on a CPU-only host. Must divide the "
                                                      "attention and key-value heads. 1: no split.")

    @model_serializer(mode="wrap")
    def _omit_default_nodes(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data: dict[str, Any] = handler(self)
        if self.nodes == 1:  # manifests that never name nodes keep their digest
            data.pop("nodes", None)
        if self.tensor_parallel == 1:
            data.pop("tensor_parallel", None)
        return data

    @field_validator("tensor_parallel")
    @classmethod
    def _ranks_fit_placement(cls, ranks: int, info: ValidationInfo) -> int:
        from .tensor_parallel import placement_problem

        problem = placement_problem(ranks, gpus=info.data.get("gpus"), nodes=info.data.get("nodes"))
        if problem:
            raise PydanticCustomError("tensor_parallel", problem)
        return ranks

    @field_validator("gpus")
    @classmethod
    def _distinct(cls, gpus: list[int] | str) -> list[int] | str:
        if isinstance(gpus, list) and len(set(gpus)) != len(gpus):
            dupes = sorted({g for g in gpus if gpus.count(g) > 1})
            raise PydanticCustomError("duplicate_gpu", "GPU {gpus} listed more than once",
                                      {"gpus": ", ".join(map(str, dupes))})
        return gpus

    @field_validator("ratios")
    @classmethod
    def _ratios_match_gpus(cls, ratios: list[float] | None, info: ValidationInfo) -> list[float] | None:
        if ratios is None:
            return None
        if not any(r > 0 for r in ratios):
            raise PydanticCustomError("ratios_zero", "at least one ratio must be greater than 0")
        gpus = info.data.get("gpus")
        if gpus == "all":
            raise PydanticCustomError(
                "ratios_all", 'ratios need an explicit GPU list; gpus is "all", which depends on the host')
        if isinstance(gpus, list) and len(ratios) != len(gpus):
            raise PydanticCustomError(
                "ratios_length", "{n} ratios for {m} GPUs; give one ratio per GPU in gpus",
                {"n": len(ratios), "m": len(gpus)})
        if isinstance(gpus, list) and gpus and ratios[0] == 0:
            raise PydanticCustomError(
                "ratios_first", "the first GPU's ratio is 0, but embeddings: first puts the input "
                                "embeddings on it; give it a ratio above 0")
        return ratios


class Sharding(_Strict):
    """How the checkpoint is cut into files for this deployment."""

    max_shard_size: Size = Field(2 * 2**30, description="Largest shard file.")
    path: Path | None = Field(None, description="Where resharded checkpoints live (relative to the "
                              "manifest): each deployment writes <path>/<name>/<key>, one directory per "
                              "content and layout. Default: <state dir>/shards.")

    @field_validator("max_shard_size")
    @classmethod
    def _positive(cls, v: int) -> int:
        if v <= 0:
            raise PydanticCustomError("size_zero", "max_shard_size must be greater than 0")
        return v


class CpuOffload(_Strict):
    """CPU RAM tier: blocks the GPUs cannot hold."""

    max_memory: Size | None = Field(None, description="CPU RAM the model may use; default: what is "
                                                      "available on the host.")


class DiskOffload(_Strict):
    """Disk tier: read in place from the safetensors files when the CPU tier is full."""

    path: Path = Field(description="Directory for offloaded weights (relative to the manifest).")
    max_size: Size | None = Field(None, description="Disk the model may use; default: free space.")


class Offload(_Strict):
    """Tiers after the GPUs, in order: CPU RAM, then disk."""

    cpu: CpuOffload | None = Field(default_factory=CpuOffload,
                                   description="CPU tier; null disables it.")
    disk: DiskOffload | None = Field(None, description="Disk tier; off unless given.")


class HealthCheck(_Strict):
    """A forward pass on a known input; the model serves only if it passes."""

    input: str = Field("Hello", description="Text run through the model before it serves.")
    timeout: Duration = Field(120.0, description="Longest the check may take.")


class Canary(_Strict):
    """How a canary moves new requests to the new generation, step by step (docs/rollout.md)."""

    steps: list[Annotated[int, Field(ge=1, le=100)]] = Field(
        default=[10, 50, 100], description="Percent of new requests sent to the new generation, one step after "
                                           "another: increasing, ending at 100 (the new generation alone).")
    step_seconds: Duration = Field(30.0, description="How long each step lasts: its traffic gates are checked "
                                                     "on the requests of that window.")

    @field_validator("steps")
    @classmethod
    def _increasing_to_100(cls, steps: list[int]) -> list[int]:
        if not steps or steps[-1] != 100:
            raise PydanticCustomError("canary_steps", "the last step must be 100 (the new generation takes "
                                                      "every request); got {steps}", {"steps": steps})
        if any(b <= a for a, b in pairwise(steps)):
            raise PydanticCustomError("canary_steps", "steps must increase strictly; got {steps}",
                                      {"steps": steps})
        return steps


class Gates(_Strict):
    """What a new generation must show before (golden) and while (traffic) it takes requests; a gate that
    fails ends the rollout and the serving generation keeps every request. Each gate is optional."""

    golden: Path | None = Field(None, description="JSON lines of reference cases, one per line: {\"messages\": "
                                                  "[...]} or {\"prompt\": \"...\"}, and \"completion\" (relative "
                                                  "to the manifest). Scored by both generations before any traffic.")
    max_nll_increase: float | None = Field(
        None, ge=0, description="Most the mean per-token negative log-likelihood of the golden completions may "
                                "rise, new generation minus serving one, in nats. Needs golden.")
    min_top1_agreement: float | None = Field(
        None, ge=0, le=1, description="Least share of golden completion positions where both generations' "
                                      "most likely next token agree. Needs golden.")
    max_error_rate: float | None = Field(
        None, ge=0, le=1, description="Most share of the new generation's requests in a canary step that may "
                                      "fail (5xx). Needs strategy canary.")
    max_ttft_p95: Duration | None = Field(
        None, description="Longest time to first token, 95th percentile, of the new generation's requests in "
                          "a canary step. Needs strategy canary.")

    @model_validator(mode="after")
    def _golden_and_its_gates(self) -> Gates:
        scored = self.max_nll_increase is not None or self.min_top1_agreement is not None
        if scored and self.golden is None:
            at = "max_nll_increase" if self.max_nll_increase is not None else "min_top1_agreement"
            raise PydanticCustomError("gates_golden", "{at} compares the generations on golden references: add "
                                                      "golden (a JSON lines file)", {"at": at})
        if self.golden is not None and not scored:
            raise PydanticCustomError("gates_golden", "golden is scored only to check max_nll_increase or "
                                                      "min_top1_agreement: set one of them", {"at": "golden"})
        return self

    @property
    def traffic(self) -> bool:
        """Gates checked on each canary step's requests."""
        return self.max_error_rate is not None or self.max_ttft_p95 is not None

    @model_serializer(mode="wrap")
    def _omit_unset(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data: dict[str, Any] = handler(self)
        return {k: v for k, v in data.items() if v is not None}


class Rollout(_Strict):
    """How a new revision replaces the running one."""

    strategy: Literal["auto", "blue-green", "recreate", "canary"] = Field(
        "auto", description="blue-green loads beside the old model; recreate unloads first; auto picks; canary "
                            "loads beside and moves new requests over by steps (canary), checking gates.")
    health_check: HealthCheck = Field(default_factory=HealthCheck,
                                      description="Run before a new model serves.")
    canary: Canary | None = Field(None, description="The steps of a canary (strategy canary; default steps "
                                                    "[10, 50, 100] of 30s).")
    gates: Gates | None = Field(None, description="Checks that end a rollout when the new generation is worse "
                                                  "(strategy canary or blue-green).")

    @model_validator(mode="after")
    def _strategy_honours(self) -> Rollout:
        if self.canary is not None and self.strategy != "canary":
            raise PydanticCustomError("rollout_canary", "canary steps need strategy canary (it is {s})",
                                      {"s": self.strategy, "at": "canary"})
        gates = self.gates
        if gates is None:
            return self
        if self.strategy in ("recreate", "auto"):
            raise PydanticCustomError(
                "rollout_gates", "gates compare the new generation with the serving one, which {s} may free "
                                 "before the new one loads; set strategy to canary or blue-green",
                {"s": self.strategy, "at": "gates"})
        if self.strategy == "blue-green" and gates.traffic:
            field = "max_error_rate" if gates.max_error_rate is not None else "max_ttft_p95"
            raise PydanticCustomError(
                "rollout_gates", "{f} is checked on canary steps' traffic; blue-green moves every request at "
                                 "once: set strategy to canary", {"f": field, "at": f"gates.{field}"})
        return self

    @model_serializer(mode="wrap")
    def _omit_unset(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data: dict[str, Any] = handler(self)
        for key in ("canary", "gates"):  # manifests that never name them keep their digest
            if data.get(key) is None:
                data.pop(key, None)
        return data

    @property
    def steps(self) -> Canary:
        """The canary's steps as written, else the defaults."""
        return self.canary if self.canary is not None else Canary()


class PrefixCache(_Strict):
    """The KV cache of finished requests' token sequences, kept to serve later requests that share their
    beginning (a shared system prompt, a conversation's earlier turns, a document sent again)."""

    enabled: bool = Field(False, description="Keep and reuse prompt prefixes (padded batching of a causal LM "
                                             "in one process or Ray Serve replica; others keep none). Off by "
                                             "default: its max_bytes count in the plan and the host budget.")
    max_bytes: Size = Field(256 * 2**20, description="Most bytes the kept KV may hold, on the device of the "
                                                    "input embeddings; least recently used evicted first. "
                                                    "Part of the plan's bytes (and of the host budget).")


class Serving(_Strict):
    """Limits of the inference API for this model (``deploykit serve``, ``Deployment.generate``)."""

    context_length: int | None = Field(
        None, ge=8, description="Longest prompt plus generated tokens; default: the model's "
                                "max_position_embeddings, at most 8192.")
    max_tokens: int = Field(512, ge=1, description="Most tokens one request may generate; a request "
                                                  "asking for more is refused (400).")
    default_max_tokens: int = Field(256, ge=1, description="Tokens generated when a request names no "
                                                          "max_tokens (capped by max_tokens).")
    max_concurrent: int = Field(16, ge=1, le=1024, description="Requests decoded together in one batch.")
    max_queued: int = Field(64, ge=0, description="Requests waiting for a batch slot beyond "
                                                  "max_concurrent; more are refused (429 with Retry-After).")
    max_input_items: int = Field(256, ge=1, description="Most prompts or embedding inputs in one request.")
    batching: Literal["padded", "continuous"] = Field(
        "padded", description="padded: deploykit's batch loop (per-request sampling); continuous: "
                              "transformers' continuous batching (greedy requests only).")
    tool_call_parser: Literal["hermes"] | None = Field(
        None, description="How this model family writes tool calls, read from answers to tool_choice 'auto' "
                          "(hermes: <tool_call>{json}</tool_call>, Hermes and Qwen2/2.5/3); unset: 'auto' is "
                          "refused (400) and only forced calls (required, a named function) are served.")
    prefix_cache: PrefixCache = Field(default_factory=PrefixCache,
                                      description="Reuse of prompt prefixes across requests (padded batching).")
    prefill_chunk: int = Field(256, ge=16, le=65536,
                               description="The most prompt tokens read in one step (padded batching): a "
                                           "longer prompt is read in chunks between the decode steps of the "
                                           "running requests, each sized to take about 1.5 of their steps "
                                           "(at most this many tokens; this many when nothing else runs).")

    @field_validator("prefix_cache")
    @classmethod
    def _padded_only(cls, cache: PrefixCache, info: ValidationInfo) -> PrefixCache:
        if cache.enabled and info.data.get("batching") == "continuous":
            raise PydanticCustomError(
                "prefix_cache_continuous", "the prefix cache needs batching: padded (transformers' continuous "
                                           "batching keeps no prefixes here); set prefix_cache.enabled: false", {})
        return cache

    @model_serializer(mode="wrap")
    def _omit_defaults(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data: dict[str, Any] = handler(self)
        if self.prefix_cache == PrefixCache():  # manifests that never name them keep their digest
            data.pop("prefix_cache", None)
        if self.prefill_chunk == 256:
            data.pop("prefill_chunk", None)
        if self.tool_call_parser is None:
            data.pop("tool_call_parser", None)
        return data

    @field_validator("max_tokens")
    @classmethod
    def _room_for_a_prompt(cls, max_tokens: int, info: ValidationInfo) -> int:
        context = info.data.get("context_length")
        if context is not None and max_tokens >= context:
            raise PydanticCustomError(
                "max_tokens_context", "max_tokens {m} leaves no room for a prompt in context_length {c}; "
                                      "make it smaller than context_length", {"m": max_tokens, "c": context})
        return max_tokens


class Lifecycle(_Strict):
    """When ``deploykit serve`` holds this model in memory, under its budget (docs/budget.md)."""

    keep_alive: KeepAlive = Field(None, description="Unload after being idle this long (counted from the end "
                                                    "of the last request); 'forever' never unloads when idle.")
    load: Literal["eager", "on-demand"] = Field(
        "eager", description="eager: loaded when served or applied; on-demand: loaded at its first request.")
    priority: int = Field(0, description="Making room for a deployment unloads idle ones of this priority or "
                                         "lower (lowest first, then least recently used).")


class Engine(_Strict):
    """What computes the model: deploykit's own transformers engine, in process, or llama.cpp: one
    ``llama-server`` process per generation that deploykit starts, checks, routes to and stops
    (docs/engines.md). The llama.cpp fields are llama-server's options that change what it serves."""

    name: Literal["transformers", "llama.cpp"] = Field(
        "transformers", description="transformers (default): safetensors checkpoints and GGUF imports, in "
                                    "process. llama.cpp: a GGUF file served by a llama-server process.")
    binary: Path | None = Field(
        None, description="llama.cpp: the llama-server executable (relative to the manifest). Default: "
                          "$DEPLOYKIT_LLAMA_SERVER, else the one the deploykit[llamacpp] extra installed, else "
                          "llama-server on PATH.")
    slots: int = Field(4, ge=1, le=256, description="llama.cpp: requests decoded together (llama-server "
                                                    "--parallel); more wait in deploykit's queue "
                                                    "(spec.serving.max_queued).")
    context: int = Field(4096, ge=64, le=1 << 20, description="llama.cpp: tokens of context per slot (prompt plus "
                                                              "generated); the KV cache holds slots x context.")
    threads: int | None = Field(None, ge=1, le=1024, description="llama.cpp: CPU threads for generation "
                                                                 "(--threads); default: llama-server's choice.")
    batch_size: int = Field(512, ge=1, le=1 << 16, description="llama.cpp: prompt tokens evaluated per step "
                                                                "(--batch-size and --ubatch-size).")

    @model_validator(mode="after")
    def _llama_fields_need_llama(self) -> Engine:
        if self.name == "transformers":
            named = sorted(self.model_fields_set - {"name"})
            if named:
                raise PydanticCustomError(
                    "engine_field", "{f} is an option of the llama.cpp engine; set engine.name: llama.cpp or "
                    "remove it", {"f": named[0], "at": named[0]})
        return self


_RAY_ADDRESS_RE = re.compile(r"^(auto|local|(ray://)?[A-Za-z0-9._-]+:\d{1,5})$")


class Cluster(_Strict):
    """A Ray cluster to run on (extra ``deploykit[ray]``). Absent: in-process on this host."""

    address: str = Field(
        description="'auto' (the cluster this machine is part of, as `ray start` left it), 'local' (start a "
                    "private Ray on this host), or a head address: HOST:PORT or ray://HOST:PORT.")

    @field_validator("address")
    @classmethod
    def _ray_address(cls, address: str) -> str:
        if not _RAY_ADDRESS_RE.match(address.strip()):
            raise PydanticCustomError(
                "ray_address", "not a Ray address: use 'auto', 'local', HOST:PORT or ray://HOST:PORT")
        return address.strip()


class Spec(_Strict):
    """The desired state of one deployment."""

    model: ModelSpec = Field(description="The checkpoint.")
    cluster: Cluster | None = Field(None, description="Ray cluster for replicas and pipeline stages; "
                                                      "absent: in-process on this host.")
    replicas: int = Field(1, ge=1, description="Copies of the model serving behind one endpoint: Ray Serve "
                                               "replicas, each with its own pipeline stages when "
                                               "placement.nodes > 1. More than 1 needs spec.cluster.")
    placement: Placement = Field(default_factory=Placement, description="GPUs and their shares.")
    sharding: Sharding = Field(default_factory=Sharding, description="Checkpoint file layout.")
    offload: Offload = Field(default_factory=Offload, description="CPU and disk tiers after the GPUs.")
    rollout: Rollout = Field(default_factory=Rollout, description="How a change goes live.")
    serving: Serving = Field(default_factory=Serving, description="Limits of the inference API.")
    lifecycle: Lifecycle = Field(default_factory=Lifecycle, description="Loading, unloading and priority "
                                                                        "under deploykit serve's budget.")
    engine: Engine = Field(default_factory=Engine, description="What computes the model: transformers (in "
                                                                "process) or llama.cpp (llama-server).")

    @model_validator(mode="after")
    def _what_llama_cpp_honours(self) -> Spec:
        from .engines import llama_cpp_problem

        problem = llama_cpp_problem(self)
        if problem:
            field, message = problem
            raise PydanticCustomError("llama_cpp", message, {"at": field})
        return self

    @model_validator(mode="after")
    def _tensor_parallel_alone(self) -> Spec:
        from .tensor_parallel import spec_problem

        problem = spec_problem(self.placement.tensor_parallel, cluster=self.cluster is not None,
                               offload=self.offload.disk is not None,
                               task=self.model.task, batching=self.serving.batching)
        if problem:
            raise PydanticCustomError("tensor_parallel", problem, {"at": "placement.tensor_parallel"})
        return self

    @model_validator(mode="after")
    def _quantization_in_process(self) -> Spec:
        if self.cluster is not None and self.model.quantization != "none":
            raise PydanticCustomError(
                "quantization_cluster", "quantization {q} is not available on a Ray cluster yet (its replicas "
                "and pipeline stages load full-precision weights); remove spec.cluster or set quantization "
                "to none", {"q": self.model.quantization, "at": "model.quantization"})
        if self.placement.tensor_parallel > 1 and self.model.quantization != "none":
            raise PydanticCustomError(
                "quantization_tensor_parallel", "quantization {q} is not available with tensor_parallel yet (its "
                "ranks load full-precision slices); set tensor_parallel to 1 or quantization to none",
                {"q": self.model.quantization, "at": "model.quantization"})
        return self

    @model_validator(mode="after")
    def _canary_in_process(self) -> Spec:
        rollout = self.rollout
        where = ("a Ray cluster" if self.cluster is not None
                 else "tensor_parallel ranks" if self.placement.tensor_parallel > 1
                 else "the llama.cpp engine" if self.engine.name == "llama.cpp" else None)
        if where is None:
            return self
        if rollout.strategy == "canary":
            raise PydanticCustomError(
                "canary_engine", "strategy canary keeps two in-process generations side by side; {w} cannot "
                                 "(yet): use blue-green", {"w": where, "at": "rollout.strategy"})
        if rollout.gates is not None and rollout.gates.golden is not None:
            raise PydanticCustomError(
                "gates_engine", "golden gates score the model in this process; {w} cannot: remove "
                                "rollout.gates.golden", {"w": where, "at": "rollout.gates.golden"})
        return self

    @model_validator(mode="after")
    def _golden_needs_text(self) -> Spec:
        gates = self.rollout.gates
        if gates is not None and gates.golden is not None and self.model.task != "causal-lm":
            raise PydanticCustomError(
                "gates_task", "golden gates score text completions; a {t} model has none", {
                    "t": self.model.task, "at": "rollout.gates.golden"})
        return self

    @model_serializer(mode="wrap")
    def _omit_defaults(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data: dict[str, Any] = handler(self)
        if self.cluster is None:  # manifests that never name a cluster keep their digest
            data.pop("cluster", None)
        if self.replicas == 1:
            data.pop("replicas", None)
        if self.lifecycle == Lifecycle():  # manifests that never name a lifecycle keep their digest
            data.pop("lifecycle", None)
        if self.engine == Engine():  # manifests that never name an engine keep their digest
            data.pop("engine", None)
        return data


class Metadata(_Strict):
    """Identity of the deployment."""

    name: str = Field(description="DNS-1123 label: a-z, 0-9 and '-', 1 to 63 characters, "
                                  "starting and ending with a letter or digit.")
    labels: dict[str, str] = Field(default_factory=dict, description="Free-form labels.")

    @field_validator("name")
    @classmethod
    def _dns_label(cls, name: str) -> str:
        if not _NAME_RE.match(name):
            raise PydanticCustomError(
                "name", "not a valid name: use 1 to 63 of a-z, 0-9 and '-', starting and "
                        "ending with a letter or digit")
        return name


class ModelDeployment(_Strict):
    """A deploykit manifest: one model, where it runs, and how it is rolled out."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True,
                              title="deploykit ModelDeployment")

    api_version: Literal["deploykit/v1"] = Field(alias="apiVersion", description="Always deploykit/v1.")
    kind: Literal["ModelDeployment"] = Field(description="Always ModelDeployment.")
    metadata: Metadata = Field(description="Name and labels.")
    spec: Spec = Field(description="What to deploy and how.")
