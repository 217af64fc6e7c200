"""The manifest: its schema (pydantic), its loading from YAML, and errors located in the file.

A manifest is the single source of truth for a deployment. This module turns a file into validated,
immutable values, or into a ``ManifestError`` that lists *every* problem with its file, line, column,
field path and, where one helps, a hint. It must never import torch or transformers: ``deploykit
validate`` stays fast because of that.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    StrictBool,
    ValidationError,
    ValidationInfo,
    SerializerFunctionWrapHandler,
    WithJsonSchema,
    field_validator,
    model_serializer,
    model_validator,
)
from pydantic_core import PydanticCustomError

from ..errors import Issue, ManifestError
from ..names import Task
from ..units import SIZE_UNITS_TEXT, format_duration, parse_duration, parse_size
from .yamlsource import Document, load_documents
from .tensor_parallel import heads_issues

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
    trust_remote_code: StrictBool = Field(
        False, description="Run Python code shipped with the checkpoint. Strictly true or false.")
    allow_pickle: StrictBool = Field(
        False, description="Accept pickle weights (*.bin, *.pt), read with torch.load(weights_only=True). "
                           "Off: unpickling can run code.")


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


class Rollout(_Strict):
    """How a new revision replaces the running one."""

    strategy: Literal["auto", "blue-green", "recreate"] = Field(
        "auto", description="blue-green loads beside the old model; recreate unloads first; auto picks.")
    health_check: HealthCheck = Field(default_factory=HealthCheck,
                                      description="Run before a new model serves.")


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

    @model_validator(mode="after")
    def _tensor_parallel_alone(self) -> Spec:
        from .tensor_parallel import spec_problem

        problem = spec_problem(self.placement.tensor_parallel, cluster=self.cluster is not None,
                               offload=self.offload.disk is not None,
                               task=self.model.task, batching=self.serving.batching)
        if problem:
            raise PydanticCustomError("tensor_parallel", problem, {"at": "placement.tensor_parallel"})
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


@dataclass(frozen=True)
class LoadedManifest:
    """A validated manifest with where it came from, so later errors can point into the file."""

    manifest: ModelDeployment
    source: str  # the file as the user named it
    base_dir: Path  # relative paths in the manifest resolve against this
    document: Document

    @property
    def name(self) -> str:
        return self.manifest.metadata.name

    def resolve(self, path: Path) -> Path:
        return path if path.is_absolute() else (self.base_dir / path)

    @property
    def model_path(self) -> Path:
        return self.resolve(self.manifest.spec.model.path)

    @property
    def digest(self) -> str:
        """What the manifest asks for, independent of comments, formatting and how paths are written."""
        import hashlib

        return "sha256:" + hashlib.sha256(self.text.encode()).hexdigest()

    @property
    def text(self) -> str:
        """This manifest as YAML, for the record of a revision (re-applied by rollback)."""
        import yaml

        data = self.manifest.model_dump(mode="json", by_alias=True)
        for section, key in (("model", "path"), ("sharding", "path")):
            value = data["spec"][section].get(key)
            if value is not None:
                data["spec"][section][key] = str(self.resolve(Path(value)).resolve())
        disk = data["spec"]["offload"].get("disk")
        if disk:
            disk["path"] = str(self.resolve(Path(disk["path"])).resolve())
        return yaml.safe_dump(data, sort_keys=False)

    def locate(self, field: str) -> tuple[int, int]:
        parts: tuple[str | int, ...] = tuple(int(p) if p.isdigit() else p for p in field.split("."))
        return self.document.locate(parts)

    def located(self, field: str | None, message: str) -> str:
        """``message`` as ``FILE:LINE:COL: field: message``, or ``FILE: error: message`` without a field."""
        if field is None:
            return f"{self.source}: error: {message}"
        line, column = self.locate(field)
        return f"{self.source}:{line}:{column}: {field}: {message}"

    def issue(self, field: str, message: str, hint: str | None = None) -> Issue:
        line, column = self.locate(field)
        return Issue(message, self.source, line, column, field, hint)


def _fields_of(model: type[BaseModel]) -> list[str]:
    return [f.alias or name for name, f in model.model_fields.items()]


def _submodel(path: tuple[str | int, ...]) -> type[BaseModel] | None:
    """The pydantic model found at a field path, for 'did you mean' hints."""
    model: Any = ModelDeployment
    for part in path:
        if isinstance(part, int) or model is None:
            continue
        fields = {(f.alias or n): f for n, f in model.model_fields.items()}
        if part not in fields:
            return None
        annotation = fields[part].annotation
        candidates = [annotation, *getattr(annotation, "__args__", ())]
        model = next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None)
    return model


def _hint_for(err: Any, path: tuple[str | int, ...]) -> str | None:
    if err["type"] == "extra_forbidden" and path:
        parent = _submodel(path[:-1])
        if parent is not None:
            close = difflib.get_close_matches(str(path[-1]), _fields_of(parent), n=1, cutoff=0.6)
            if close:
                return f"did you mean {close[0]!r}?"
            return "allowed keys here: " + ", ".join(_fields_of(parent))
    if err["type"] == "literal_error" and isinstance(err.get("input"), str):
        expected = re.findall(r"'([^']*)'", err.get("ctx", {}).get("expected", ""))
        close = difflib.get_close_matches(err["input"], expected, n=1, cutoff=0.5)
        if close:
            return f"did you mean {close[0]!r}?"
    return None


def _clean_path(loc: tuple[Any, ...]) -> tuple[str | int, ...]:
    # pydantic adds union-member tags ("list[...]", "literal['all']") and validator names to loc.
    out: list[str | int] = []
    for part in loc:
        if isinstance(part, str) and ("[" in part or part.startswith("function-")):
            continue
        out.append(part)
    return tuple(out)


def _issues_from_validation(exc: ValidationError, doc: Document, source: str) -> list[Issue]:
    issues: list[Issue] = []
    for err in exc.errors():
        path = _clean_path(err["loc"])
        at = (err.get("ctx") or {}).get("at")
        if at:  # a cross-field check raised on the model holding the field to fix: point at that field
            path = path + tuple(str(at).split("."))
        if err["type"] == "missing":
            line, column = doc.locate(path[:-1], key=True) if path[:-1] else (doc.line, 1)
            message = f"required field {path[-1]!r} is missing"
        elif err["type"] == "extra_forbidden":
            line, column = doc.locate(path, key=True)
            message = f"unknown field {path[-1]!r}"
        else:
            line, column = doc.locate(path)
            message = err["msg"]
            given = err.get("input")
            if (err["type"] != "literal_error" and given is not None
                    and not isinstance(given, (dict, list)) and str(given) not in message):
                message += f" (got {given!r})"
        field = ".".join(str(p) for p in path)
        previous = next((i for i, issue in enumerate(issues) if issue.field == (field or None)
                         and (issue.line, issue.column) == (line, column)), None)
        if previous is not None:  # one complaint per union member: say them as one
            issues[previous] = _merge(issues[previous], message)
            continue
        issues.append(Issue(message, source, line, column, field or None, _hint_for(err, path)))
    return issues


def _merge(issue: Issue, message: str) -> Issue:
    prefix = "Input should be "
    got = re.search(r" \(got .*\)$", issue.message)
    first = issue.message[: got.start()] if got else issue.message
    second = re.sub(r" \(got .*\)$", "", message)
    if first.startswith(prefix) and second.startswith(prefix):
        merged = f"{first} or {second[len(prefix):]}"
    else:
        merged = f"{first}; or {second}"
    return Issue(merged + (got.group(0) if got else ""), issue.path, issue.line, issue.column,
                 issue.field, issue.hint)


def _check_header(doc: Document, source: str) -> list[Issue]:
    """apiVersion and kind first: if they are wrong, field errors below would only be noise."""
    data = doc.data
    if not isinstance(data, dict):
        line, column = doc.values.get((), (doc.line, 1))
        kind = type(data).__name__ if data is not None else "null"
        return [Issue(f"a manifest must be a mapping, found {kind}", source, line, column,
                      hint="start with 'apiVersion: deploykit/v1' and 'kind: ModelDeployment'")]
    issues = []
    for key, want in (("apiVersion", API_VERSION), ("kind", KIND)):
        if key in data and data[key] != want:
            line, column = doc.locate((key,))
            issues.append(Issue(f"expected {want!r}, got {data[key]!r}", source, line, column, key,
                                hint="this file may not be a deploykit manifest"))
    return issues


def parse_manifests(data: bytes, *, source: str, base_dir: Path) -> list[LoadedManifest]:
    """Validate every document in ``data``. Raises ManifestError listing all issues of the file."""
    documents, issues = load_documents(data, source)
    documents = [d for d in documents if d.data is not None]
    loaded: list[LoadedManifest] = []
    names: dict[str, int] = {}
    for doc in documents:
        header = _check_header(doc, source)
        if header:
            issues.extend(header)
            continue
        try:
            manifest = ModelDeployment.model_validate(doc.data)
        except ValidationError as exc:
            issues.extend(_issues_from_validation(exc, doc, source))
            continue
        if manifest.metadata.name in names:
            line, column = doc.locate(("metadata", "name"))
            issues.append(Issue(f"name {manifest.metadata.name!r} is already used by the manifest at "
                                f"line {names[manifest.metadata.name]}", source, line, column,
                                "metadata.name"))
            continue
        names[manifest.metadata.name] = doc.line
        loaded.append(LoadedManifest(manifest, source, base_dir, doc))
    if issues:
        issues.sort(key=lambda i: (i.line or 0, i.column or 0))
        raise ManifestError(issues)
    return loaded


MANIFEST_SUFFIXES = (".yaml", ".yml")


def manifest_files(path: Path) -> list[Path]:
    """The manifest files ``path`` stands for: itself, or a directory's ``*.yaml``/``*.yml`` files in
    name order (not recursive). The one place that decides which files are manifests."""
    if path.is_dir():
        return sorted(p for p in path.iterdir() if p.suffix in MANIFEST_SUFFIXES and p.is_file())
    return [path]


def load_manifests(path: str | Path) -> list[LoadedManifest]:
    """Read and validate a manifest file. Raises ManifestError (also for an unreadable file)."""
    source = str(path)
    file = Path(path)
    try:
        data = file.read_bytes()
    except FileNotFoundError:
        raise ManifestError.single("no such file", path=source) from None
    except IsADirectoryError:
        raise ManifestError.single("is a directory; give a manifest file", path=source) from None
    except OSError as exc:
        raise ManifestError.single(f"cannot read the file: {exc.strerror}", path=source) from None
    return parse_manifests(data, source=source, base_dir=file.resolve().parent)


def check_on_host(loaded: LoadedManifest) -> list[Issue]:
    """What can be checked about a manifest on this machine without reading weights."""
    issues: list[Issue] = []
    model_dir = loaded.model_path
    if model_dir.is_file():  # a GGUF file (llama.cpp, Ollama); its magic is checked, not its name
        try:
            with open(model_dir, "rb") as fh:
                magic = fh.read(4)
        except OSError as exc:
            magic, reason = b"", f": {exc.strerror}"
        else:
            reason = ""
        if magic != b"GGUF":
            issues.append(loaded.issue("spec.model.path", f"{str(model_dir)!r} is a file but not a GGUF file "
                                       f"(it does not start with the bytes 'GGUF'){reason}",
                                       hint="point path at a Hugging Face checkpoint directory or a .gguf file"))
    elif not model_dir.is_dir():
        kind = "GGUF file" if model_dir.suffix == ".gguf" else "model directory"
        issues.append(loaded.issue("spec.model.path", f"{kind} {str(model_dir)!r} does not exist"))
    elif not (model_dir / "config.json").is_file():
        issues.append(loaded.issue("spec.model.path", f"{str(model_dir)!r} holds no config.json",
                                   hint="point path at a Hugging Face checkpoint directory or a .gguf file"))
    if not issues:
        issues.extend(heads_issues(loaded))
    issues.extend(_scale_out_issues(loaded))
    disk = loaded.manifest.spec.offload.disk
    if disk is not None:
        disk_dir = loaded.resolve(disk.path)
        if disk_dir.exists() and not disk_dir.is_dir():
            issues.append(loaded.issue("spec.offload.disk.path", f"{str(disk_dir)!r} is not a directory"))
    return issues


def _scale_out_issues(loaded: LoadedManifest) -> list[Issue]:
    """What a deployment on a Ray cluster cannot serve. Planning does not need these (a plan against
    ``--devices`` needs no cluster); deploying does."""
    spec, issues = loaded.manifest.spec, []
    if spec.placement.nodes > 1 and spec.cluster is None:
        issues.append(loaded.issue("spec.placement.nodes", f"{spec.placement.nodes} nodes need a cluster: add "
                                   "spec.cluster.address (a Ray address, 'auto' or 'local'), or set nodes to 1"))
    if spec.replicas > 1 and spec.cluster is None:
        issues.append(loaded.issue("spec.replicas", f"{spec.replicas} replicas need a cluster: add "
                                   "spec.cluster.address (a Ray address, 'auto' or 'local'), or set replicas to 1"))
    if spec.cluster is not None and spec.model.task != Task.CAUSAL_LM:
        issues.append(loaded.issue("spec.model.task", f"a cluster (replicas, pipeline stages) serves causal-lm "
                                   f"models only, not {spec.model.task}", hint="remove spec.cluster"))
    return issues


def json_schema() -> dict[str, Any]:
    """The JSON Schema of a manifest, for editors (yaml-language-server) and CI."""
    schema = ModelDeployment.model_json_schema(by_alias=True, mode="validation")
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["$id"] = "https://deploykit.dev/schema/deploykit-v1.json"
    return schema
