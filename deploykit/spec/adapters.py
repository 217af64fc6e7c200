"""``spec.adapters``: PEFT LoRA adapters served beside the base model, and what is checked about them from
their files alone (no weights read, no torch).

An adapter is a PEFT LoRA directory (``adapter_config.json`` + ``adapter_model.safetensors``). Validation
reads the adapter's config and its safetensors header, and the base checkpoint's safetensors headers, and
refuses at ``spec.adapters[i].path`` an adapter that targets modules the base does not have or whose
shapes do not fit them (an adapter made for another model), one whose files disagree with its own config
(a tensor's rank is not the config's ``r``; tensors for modules ``target_modules`` does not name, or a named
module without tensors: peft would leave it at its random initial value), and what deploykit does not serve
(DoRA, embedding or bias LoRA, ``modules_to_save``, ranks above ``MAX_RANK``, and an ``init_lora_weights``
that rewrites the base's weights when the adapter is injected: PiSSA, OLoRA, CorDA, LoftQ, LoRA-GA; such an
adapter was saved without peft's conversion and only fits the residual base it was trained on). A base that
is not a safetensors checkpoint (a GGUF file, pickle weights) is refused with adapters: their modules cannot
be checked against it without reading weights. The fields deploykit cannot serve
adapters with (llama.cpp, tensor-parallel ranks, Ray, quantized bases, continuous batching, canaries) are
refused by ``spec_problem`` at that field, never ignored.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import Field, field_validator
from pydantic_core import PydanticCustomError

from .values import Strict

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
BASE = "__base__"  # peft's per-row name of "no adapter" (adapter_names)
MAX_RANK = 256  # larger ranks are fine-tunes in all but name: serve them as a model
MAX_HEADER_BYTES = 64 << 20  # a safetensors header larger than this is refused before it is read
# used with fullmatch: "$" would also take a trailing newline
_ADAPTER_NAME_RE = re.compile(r"[A-Za-z0-9]([A-Za-z0-9._-]{0,62}[A-Za-z0-9])?")
_KEY_RE = re.compile(r"base_model\.model\.(?P<module>.+)\.lora_(?P<part>[AB])\.weight")
# init_lora_weights values whose initialisation leaves the base's weights as they are (peft's
# ``LoraLayer.update_layer``); every other one (pissa*, olora, corda*, loftq, lora_ga, mica, ...) rewrites
# them or changes the layer's forward, and is refused
SAFE_INITS: tuple[bool | str, ...] = (True, False, "gaussian", "eva", "orthogonal")
# adapter_config.json keys that ask for more than plain LoRA on linear layers, and why deploykit refuses them
_UNSERVED = {
    "use_dora": "DoRA (peft cannot mix DoRA adapters in one batch)",
    "lora_bias": "LoRA biases",
    "modules_to_save": "modules_to_save (whole copies of modules, not low-rank deltas)",
    "layer_replication": "layer_replication",
    "alora_invocation_tokens": "activated LoRA (aLoRA)",
    "target_parameters": "target_parameters (LoRA on raw parameters)",
    "trainable_token_indices": "trainable_token_indices",
    "use_qalora": "QALoRA",
}
_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


class Adapter(Strict):
    """One LoRA adapter, served as model ``<deployment>:<name>``."""

    name: str = Field(description="The adapter's part of the model id <deployment>:<name>: 1 to 64 of A-Z, a-z, "
                                  "0-9, '.', '_' and '-', starting and ending with a letter or digit.")
    path: Path = Field(description="PEFT LoRA directory (adapter_config.json + adapter_model.safetensors). "
                                   "A relative path resolves against the manifest's directory.")
    scale: float = Field(1.0, gt=0, le=16, description="Multiplies the adapter's delta (lora_alpha / r x scale).")

    @field_validator("name")
    @classmethod
    def _model_name_part(cls, name: str) -> str:
        if not _ADAPTER_NAME_RE.fullmatch(name):
            raise PydanticCustomError(
                "adapter_name", "not a valid adapter name: use 1 to 64 of A-Z, a-z, 0-9, '.', '_' and '-', "
                                "starting and ending with a letter or digit")
        return name


def duplicate_problem(adapters: list[Adapter]) -> tuple[str, str] | None:
    """(field under ``adapters``, why) for the first name used twice."""
    seen: dict[str, int] = {}
    for i, adapter in enumerate(adapters):
        if adapter.name in seen:
            return f"{i}.name", f"adapter name {adapter.name!r} is already used by spec.adapters[{seen[adapter.name]}]"
        seen[adapter.name] = i
    return None


def spec_problem(spec: Any) -> tuple[str, str] | None:
    """(field under ``spec``, why) for the first field deploykit cannot serve adapters with."""
    if not spec.adapters:
        return None
    if spec.engine.name != "transformers":
        return ("engine.name", "LoRA adapters are served by the transformers engine only (llama.cpp takes GGUF "
                "LoRA files, not PEFT directories): remove spec.adapters or use engine.name: transformers")
    if spec.model.task != "causal-lm":
        return "model.task", f"LoRA adapters are served for causal-lm models only, not {spec.model.task}"
    if spec.model.quantization != "none":
        return ("model.quantization", f"LoRA adapters on a {spec.model.quantization}-quantized base are not served "
                "yet (peft's LoRA layers wrap float linear layers): set quantization to none")
    if spec.placement.tensor_parallel > 1:
        return ("placement.tensor_parallel", "LoRA adapters are not served on tensor-parallel ranks yet (each rank "
                "holds slices of the layers they adapt): set tensor_parallel to 1")
    if spec.cluster is not None:
        return ("cluster", "LoRA adapters are not served by Ray replicas or pipeline stages yet: remove "
                "spec.cluster")
    if spec.serving.batching != "padded":
        return ("serving.batching", "LoRA adapters are served by the padded batch loop (each row with its own "
                "adapter); transformers' continuous batching has no per-row adapters: use batching: padded")
    if spec.rollout.strategy == "canary":
        return ("rollout.strategy", "a change of spec.adapters is applied live on the serving generation, not "
                "canaried: use blue-green, recreate or auto with adapters")
    if spec.rollout.gates is not None and spec.rollout.gates.golden is not None:
        return ("rollout.gates.golden", "golden gates score the base model only, and adapter changes are applied "
                "live without gates: remove rollout.gates.golden with adapters")
    return None


@dataclass(frozen=True)
class AdapterFiles:
    """What an adapter directory holds, from its config and safetensors header."""

    config: dict[str, Any]
    tensors: dict[str, tuple[str, tuple[int, ...]]]  # key -> (dtype, shape)

    def modules(self) -> dict[str, dict[str, tuple[int, ...]]]:
        """module path in the base (``model.layers.0.self_attn.q_proj``) -> {"A": shape, "B": shape}."""
        out: dict[str, dict[str, tuple[int, ...]]] = {}
        for key, (_, shape) in self.tensors.items():
            match = _KEY_RE.fullmatch(key)
            if match:
                out.setdefault(match["module"], {})[match["part"]] = shape
        return out

    def bytes_at(self, dtype: str) -> int:
        """Bytes of the adapter's weights loaded at ``dtype`` (the base's: peft casts them to it)."""
        size = _DTYPE_BYTES.get(dtype, 4)
        return sum(_numel(shape) * size for _, shape in self.tensors.values())


class AdapterFileError(ValueError):
    """The directory is not a PEFT LoRA adapter deploykit can read."""


def read_adapter(directory: Path) -> AdapterFiles:
    """An adapter's config and tensor table (its safetensors header only), or AdapterFileError."""
    if not directory.is_dir():
        raise AdapterFileError(f"adapter directory {str(directory)!r} does not exist"
                               if not directory.exists() else f"{str(directory)!r} is not a directory")
    missing = [f for f in (CONFIG_FILE, WEIGHTS_FILE) if not (directory / f).is_file()]
    if missing:
        raise AdapterFileError(f"{str(directory)!r} is not a PEFT LoRA adapter: it has no {' and no '.join(missing)}")
    try:
        config = json.loads((directory / CONFIG_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise AdapterFileError(f"{directory / CONFIG_FILE}: not readable JSON: {exc}") from None
    if not isinstance(config, dict):
        raise AdapterFileError(f"{directory / CONFIG_FILE}: not a JSON object")
    return AdapterFiles(config, safetensors_table(directory / WEIGHTS_FILE))


def adapter_fingerprint(directory: Path) -> str:
    """What identifies an adapter's content cheaply, as ``model.checkpoint.fingerprint`` does a checkpoint's:
    its config's bytes, and its weights file's size, modification time (ns) and safetensors header. It changes
    when the adapter is saved again in place. AdapterFileError when the files cannot be read."""
    weights = directory / WEIGHTS_FILE
    h = hashlib.sha256()
    try:
        h.update((directory / CONFIG_FILE).read_bytes())
        st = weights.stat()
        h.update(f"\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
        with open(weights, "rb") as fh:
            raw = fh.read(8)
            h.update(raw + fh.read(min(int.from_bytes(raw.ljust(8, b"\0"), "little"), MAX_HEADER_BYTES)))
    except OSError as exc:
        raise AdapterFileError(f"adapter {str(directory)!r}: cannot read: {exc.strerror}") from None
    return "sha256:" + h.hexdigest()


def safetensors_table(file: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """The tensor table of a safetensors file: name -> (dtype, shape). Read here rather than with the
    ``safetensors`` package so that validation stays free of it: the format's header is an 8-byte little
    endian length and that many bytes of JSON."""
    try:
        with open(file, "rb") as fh:
            head = fh.read(8)
            if len(head) != 8:
                raise AdapterFileError(f"{file}: not a safetensors file (shorter than its header)")
            (length,) = struct.unpack("<Q", head)
            if length > MAX_HEADER_BYTES:
                raise AdapterFileError(f"{file}: not a safetensors file (a header of {length} bytes)")
            header = json.loads(fh.read(length))
    except OSError as exc:
        raise AdapterFileError(f"{file}: cannot read: {exc.strerror}") from None
    except ValueError:
        raise AdapterFileError(f"{file}: not a safetensors file (its header is not JSON)") from None
    if not isinstance(header, dict):
        raise AdapterFileError(f"{file}: not a safetensors file")
    return {k: (str(v.get("dtype")), tuple(int(n) for n in v.get("shape", ())))
            for k, v in header.items() if k != "__metadata__" and isinstance(v, dict)}


def base_weight_shapes(model_dir: Path) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape in a checkpoint directory's safetensors files (headers only). AdapterFileError
    when the base is not a safetensors checkpoint (a GGUF file, pickle weights): what an adapter adapts cannot
    be checked against it without reading its weights, so adapters are not served on it."""
    files = sorted(model_dir.glob("*.safetensors")) if model_dir.is_dir() else []
    if not files:
        what = "a GGUF file" if model_dir.is_file() else "a directory without safetensors weights (pickle weights?)"
        raise AdapterFileError(f"LoRA adapters are served on safetensors checkpoints only; {str(model_dir)!r} is "
                               f"{what}, so the modules the adapters adapt cannot be checked against it: convert "
                               "the base to a safetensors checkpoint directory, or remove spec.adapters")
    shapes: dict[str, tuple[int, ...]] = {}
    for file in files:
        shapes.update({k: shape for k, (_, shape) in safetensors_table(file).items()})
    return shapes


def fit_problem(files: AdapterFiles, base: dict[str, tuple[int, ...]]) -> str | None:
    """Why the adapter cannot be served on a base with these weight shapes (None: it can)."""
    config = files.config
    if str(config.get("peft_type", "")).upper() != "LORA":
        return f"not a LoRA adapter (peft_type {config.get('peft_type')!r}); deploykit serves LoRA adapters only"
    for key, what in _UNSERVED.items():
        if config.get(key):
            return f"uses {what}, which deploykit does not serve; plain LoRA on linear layers only"
    init = config.get("init_lora_weights", True)
    if not any(init is safe or (isinstance(safe, str) and init == safe) for safe in SAFE_INITS):
        return (f"init_lora_weights {init!r} rewrites the base model's weights when peft injects the adapter (or "
                "changes the layer's forward): such an adapter fits only the residual base it was trained on. Save "
                "it converted to plain LoRA (peft's save_pretrained(path_initial_model_for_weight_conversion=...)) "
                f"or set init_lora_weights to one of {', '.join(repr(v) for v in SAFE_INITS)}")
    ranks = [_int(config.get("r")), *(_int(r) for r in (config.get("rank_pattern") or {}).values())]
    if max(ranks) > MAX_RANK or min(ranks) < 1:
        return f"rank {max(ranks) if max(ranks) > MAX_RANK else min(ranks)} is not served (1 to {MAX_RANK})"
    other = sorted(k for k in files.tensors if not _KEY_RE.fullmatch(k))
    if other:
        return (f"holds {other[0]!r}{f' and {len(other) - 1} more' if len(other) > 1 else ''}, not a LoRA A/B "
                "matrix of a linear layer (embedding LoRA, biases or saved modules are not served)")
    modules = files.modules()
    if not modules:
        return "holds no LoRA weights"
    try:
        for module, parts in sorted(modules.items()):
            problem = (_module_problem(module, parts, base, transposed=bool(config.get("fan_in_fan_out")))
                       or _rank_problem(module, parts, config))
            if problem:
                return problem
        return _target_problem(config, set(modules), base)
    except re.error as exc:
        return f"a pattern of its target_modules, exclude_modules or rank_pattern is not a regular expression: {exc}"


def _int(value: Any) -> int:
    try:
        return int(value or 0)
    except (TypeError, ValueError):
        return 0


def _rank_problem(module: str, parts: dict[str, tuple[int, ...]], config: dict[str, Any]) -> str | None:
    """The rank peft gives ``module`` (``rank_pattern``'s first key that matches it, else ``r``: peft's
    ``get_pattern_key``) against its A matrix's rows: peft sizes the layer by the config, then the tensors
    do not load into it."""
    pattern = config.get("rank_pattern") or {}
    key = next((k for k in pattern if re.match(rf"(.*\.)?({k})$", module)), None) if isinstance(pattern, dict) else None
    want = _int(pattern[key]) if key is not None else _int(config.get("r"))
    if parts["A"][0] != want:
        return (f"{module!r}: its lora_A has rank {parts['A'][0]}, but adapter_config.json gives this module rank "
                f"{want} ({'rank_pattern ' + repr(key) if key is not None else 'r'}): the config and the weights "
                "were not saved together")
    return None


def _target_problem(config: dict[str, Any], modules: set[str], base: dict[str, tuple[int, ...]]) -> str | None:
    """The tensors' modules against the base modules ``target_modules`` names (peft's
    ``check_target_module_exists``): peft adds a LoRA layer to each module it names and loads the tensors
    into those; a tensor for a module it does not name fits nowhere, and a named module without tensors keeps
    its random initial matrices. ``all-linear`` and a missing ``target_modules`` (peft's per-architecture
    default) depend on the model's classes: the engine checks those when it loads the adapter."""
    targets = config.get("target_modules")
    if not isinstance(targets, (str, list)) or targets == "all-linear":
        return None
    linear = {k[:-len(".weight")] for k, shape in base.items() if k.endswith(".weight") and len(shape) == 2}
    named = {m for m in linear if _targets(config, m)}
    stray = sorted(modules - named)
    if stray:
        return (f"holds LoRA weights for {stray[0]!r}{f' and {len(stray) - 1} more' if len(stray) > 1 else ''}, "
                f"which target_modules {targets!r} does not name: the config and the weights do not agree")
    bare = sorted(named - modules)
    if bare:
        return (f"target_modules {targets!r} names {bare[0]!r}{f' and {len(bare) - 1} more' if len(bare) > 1 else ''}"
                ", for which the adapter holds no weights (peft would add it with random matrices)")
    return None


def _targets(config: dict[str, Any], module: str) -> bool:
    """peft's ``check_target_module_exists`` for LoRA on linear layers, from the config's JSON."""
    exclude = config.get("exclude_modules")
    if isinstance(exclude, str) and re.fullmatch(exclude, module):
        return False
    if isinstance(exclude, list) and (module in exclude or any(module.endswith(f".{e}") for e in exclude)):
        return False
    targets = config["target_modules"]
    if isinstance(targets, str):
        return re.fullmatch(targets, module) is not None
    if module in targets:
        return True
    if not any(module.endswith(f".{t}") for t in targets):
        return False
    indexes = config.get("layers_to_transform")
    if indexes is None or indexes == []:
        return True
    patterns = config.get("layers_pattern")
    patterns = [patterns] if isinstance(patterns, str) else patterns or []
    match = None
    if not patterns:
        match = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", module)
    for pattern in patterns:
        match = re.match(rf"(?:^|.*?\.){pattern}\.(?P<idx>\d+)\.", module)
        if match is not None:
            break
    if match is None:
        return False
    index = int(match["idx"])
    return index == indexes if isinstance(indexes, int) else index in indexes


def _module_problem(module: str, parts: dict[str, tuple[int, ...]], base: dict[str, tuple[int, ...]], *,
                    transposed: bool) -> str | None:
    weight = base.get(f"{module}.weight")
    if weight is not None and transposed:  # GPT-2's Conv1D stores [in, out] (peft's fan_in_fan_out)
        weight = weight[::-1]
    if weight is None:
        return (f"targets {module!r}, which the base model does not have: an adapter made for another model "
                "(or another architecture)")
    if set(parts) != {"A", "B"} or len(parts["A"]) != 2 or len(parts["B"]) != 2 or len(weight) != 2:
        return f"{module!r}: LoRA on linear layers only (an A and a B matrix per module)"
    a, b = parts["A"], parts["B"]
    out_features, in_features = weight
    if a[1] != in_features or b[0] != out_features or a[0] != b[1]:
        return (f"{module!r}: lora_A {list(a)} and lora_B {list(b)} do not fit the base's weight {list(weight)} "
                "(an adapter made for another model size)")
    return None


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
