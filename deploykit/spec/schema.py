"""The manifest's schema: the pydantic models of a ``ModelDeployment``, and the checks across its sections.

Each model says what a section of a manifest may hold, with the defaults, bounds and cross-field checks
that make a validated manifest an immutable value. The model, placement, sharding, offload and cluster
sections are here; ``rollout.py`` holds ``spec.rollout``, ``serving.py`` ``spec.serving``, ``spec.lifecycle``
and ``spec.engine``, and ``values.py`` parses sizes, durations and keep-alives from what a person writes
('2GiB', '120s', 'forever'). Loading a file into these models, and locating what is
wrong in it, is ``deploykit.spec.manifest``'s. No torch, no transformers: ``deploykit validate`` stays fast.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    StrictBool,
    ValidationInfo,
    field_validator,
    model_serializer,
    model_validator,
)
from pydantic_core import PydanticCustomError

from .adapters import Adapter, duplicate_problem
from .limits import MAX_GPUS, MAX_NODES, MAX_REPLICAS
from .rollout import Canary, Gates, HealthCheck, Rollout
from .serving import Engine, Lifecycle, PrefixCache, Serving
from .speculative import Speculative
from .values import Duration, KeepAlive, Size, Strict

__all__ = ["API_VERSION", "KIND", "Adapter", "Canary", "Cluster", "CpuOffload", "DiskOffload", "Duration", "Engine", "Gates",
           "HealthCheck", "KVCache", "KeepAlive", "Lifecycle", "Metadata", "ModelDeployment", "ModelSpec", "Offload",
           "Placement", "PrefixCache", "Rollout", "Serving", "Sharding", "Size", "Spec"]

API_VERSION = "deploykit/v1"
KIND = "ModelDeployment"
# Upper bounds of the manifest's numbers: each far above any real deployment, low enough that nothing
# sized from them (a device list, a thread pool, a queue) can exhaust the host (docs/control.md).
MAX_RATIO = 1e6  # a relative share per GPU
MAX_KV_TOKENS = 1 << 24  # KV-cache tokens planned per layer (batch x sequence)
_DEPLOYMENT_NAME_RE = re.compile(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?")  # fullmatch: "$" would take a trailing newline


class ModelSpec(Strict):
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


class KVCache(Strict):
    """Room reserved for the KV cache of each decoder layer, on the device holding that layer."""

    tokens: int = Field(
        ge=1, le=MAX_KV_TOKENS, strict=True,
        description="Cached tokens to plan for (batch x sequence length).")


class Placement(Strict):
    """Which GPUs hold the model, and in what proportion."""

    gpus: list[Annotated[int, Field(ge=0, lt=MAX_GPUS, strict=True)]] | Literal["all"] = Field(
        default=[], max_length=MAX_GPUS, description='CUDA device indices, "all", or [] for no GPU.')
    ratios: list[Annotated[float, Field(ge=0, le=MAX_RATIO, strict=True)]] | None = Field(
        None, max_length=MAX_GPUS,
        description="Relative share of the model per GPU, same length as gpus; default equal.")
    reserve: Size = Field(2 * 2**30, description="Per-GPU headroom kept free: CUDA context, "
                                                 "activations, KV cache not planned with kv_cache.")
    embeddings: Literal["first"] = Field(
        "first", description="Input embeddings go on the first listed GPU.")
    balance: Literal["memory", "compute"] = Field(
        "memory", description="Balance bytes per GPU (memory) or estimated FLOPs per token (compute).")
    kv_cache: KVCache | None = Field(None, description="Plan KV-cache and logits memory per layer.")
    nodes: int = Field(
        1, ge=1, le=MAX_NODES, strict=True,
        description="Pipeline stages, one per node of spec.cluster: layers are split node-major (contiguous runs "
                    "per node, then per GPU within a node; embeddings on the first node's first GPU). 1: one host. "
                    "Deploying more than 1 needs spec.cluster; `deploykit plan --devices` does not.")
    tensor_parallel: int = Field(
        1, ge=1, le=MAX_GPUS, strict=True,
        description="Ranks every attention and MLP layer is split across (transformers' tp_plan): one per listed "
                    "GPU, or that many worker processes on a CPU-only host. Must divide the attention and key-value "
                    "heads. 1: no split.")

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


class Sharding(Strict):
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


class CpuOffload(Strict):
    """CPU RAM tier: blocks the GPUs cannot hold."""

    max_memory: Size | None = Field(None, description="CPU RAM the model may use; default: what is "
                                                      "available on the host.")


class DiskOffload(Strict):
    """Disk tier: read in place from the safetensors files when the CPU tier is full."""

    path: Path = Field(description="Directory for offloaded weights (relative to the manifest).")
    max_size: Size | None = Field(None, description="Disk the model may use; default: free space.")


class Offload(Strict):
    """Tiers after the GPUs, in order: CPU RAM, then disk."""

    cpu: CpuOffload | None = Field(default_factory=CpuOffload,
                                   description="CPU tier; null disables it.")
    disk: DiskOffload | None = Field(None, description="Disk tier; off unless given.")


_RAY_ADDRESS_RE = re.compile(r"auto|local|(ray://)?[A-Za-z0-9._-]+:\d{1,5}")  # fullmatch


class Cluster(Strict):
    """A Ray cluster to run on (extra ``deploykit[ray]``). Absent: in-process on this host."""

    address: str = Field(
        description="'auto' (the cluster this machine is part of, as `ray start` left it), 'local' (start a "
                    "private Ray on this host), or a head address: HOST:PORT or ray://HOST:PORT.")

    @field_validator("address")
    @classmethod
    def _ray_address(cls, address: str) -> str:
        if not _RAY_ADDRESS_RE.fullmatch(address.strip()):
            raise PydanticCustomError(
                "ray_address", "not a Ray address: use 'auto', 'local', HOST:PORT or ray://HOST:PORT")
        return address.strip()


class Spec(Strict):
    """The desired state of one deployment."""

    model: ModelSpec = Field(description="The checkpoint.")
    cluster: Cluster | None = Field(None, description="Ray cluster for replicas and pipeline stages; "
                                                      "absent: in-process on this host.")
    replicas: int = Field(
        1, ge=1, le=MAX_REPLICAS, strict=True,
        description="Copies of the model serving behind one endpoint: Ray Serve replicas, each with its own "
                    "pipeline stages when placement.nodes > 1. More than 1 needs spec.cluster.")
    placement: Placement = Field(default_factory=Placement, description="GPUs and their shares.")
    sharding: Sharding = Field(default_factory=Sharding, description="Checkpoint file layout.")
    offload: Offload = Field(default_factory=Offload, description="CPU and disk tiers after the GPUs.")
    rollout: Rollout = Field(default_factory=Rollout, description="How a change goes live.")
    serving: Serving = Field(default_factory=Serving, description="Limits of the inference API.")
    lifecycle: Lifecycle = Field(default_factory=Lifecycle, description="Loading, unloading and priority "
                                                                        "under deploykit serve's budget.")
    engine: Engine = Field(default_factory=Engine, description="What computes the model: transformers (in "
                                                                "process) or llama.cpp (llama-server).")
    adapters: list[Adapter] = Field(default_factory=list, description="PEFT LoRA adapters served beside the base, "
                                    "each as model <metadata.name>:<name>; a change of this list alone is applied "
                                    "live (docs/adapters.md).")
    speculative: Speculative | None = Field(
        None, description="Speculative decoding (docs/engines.md): drafts of the next tokens, from the token "
                          "history (ngram) or a draft model, verified by this model in one forward. Absent: off.")

    @field_validator("adapters")
    @classmethod
    def _unique_adapters(cls, adapters: list[Adapter]) -> list[Adapter]:
        problem = duplicate_problem(adapters)
        if problem:
            field, message = problem
            raise PydanticCustomError("adapter_duplicate", message, {"at": field})
        return adapters

    @model_validator(mode="after")
    def _what_adapters_need(self) -> Spec:
        from .adapters import spec_problem

        problem = spec_problem(self)
        if problem:
            field, message = problem
            raise PydanticCustomError("adapters", message, {"at": field})
        return self

    @model_validator(mode="after")
    def _what_llama_cpp_honours(self) -> Spec:
        from .engines import llama_cpp_problem

        problem = llama_cpp_problem(self)
        if problem:
            field, message = problem
            raise PydanticCustomError("llama_cpp", message, {"at": field})
        return self

    @model_validator(mode="after")
    def _what_speculation_needs(self) -> Spec:
        from .speculative import speculative_problem

        problem = speculative_problem(self)
        if problem:
            field, message = problem
            raise PydanticCustomError("speculative", message, {"at": field})
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
        if not self.adapters:  # manifests without adapters keep their digest
            data.pop("adapters", None)
        if self.speculative is None:  # manifests without speculation keep their digest
            data.pop("speculative", None)
        return data


class Metadata(Strict):
    """Identity of the deployment."""

    name: str = Field(description="DNS-1123 label: a-z, 0-9 and '-', 1 to 63 characters, "
                                  "starting and ending with a letter or digit.")
    labels: dict[str, str] = Field(default_factory=dict, description="Free-form labels.")

    @field_validator("name")
    @classmethod
    def _dns_label(cls, name: str) -> str:
        if not _DEPLOYMENT_NAME_RE.fullmatch(name):
            raise PydanticCustomError(
                "name", "not a valid name: use 1 to 63 of a-z, 0-9 and '-', starting and "
                        "ending with a letter or digit")
        return name


class ModelDeployment(Strict):
    """A deploykit manifest: one model, where it runs, and how it is rolled out."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True,
                              title="deploykit ModelDeployment")

    api_version: Literal["deploykit/v1"] = Field(alias="apiVersion", description="Always deploykit/v1.")
    kind: Literal["ModelDeployment"] = Field(description="Always ModelDeployment.")
    metadata: Metadata = Field(description="Name and labels.")
    spec: Spec = Field(description="What to deploy and how.")
