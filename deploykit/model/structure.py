"""A model's placement blocks, in execution order, from its ``config.json`` alone.

The planner places *blocks*: the smallest units that may go to different devices. They come from a
meta-device model (no weights read, no memory used), built by transformers' own ``AutoModel*`` class for
the task, so the module names are the model's own and a plan's device_map can be handed to
``from_pretrained(device_map=...)`` unchanged.

A block is a module that holds no layer list (``nn.ModuleList``) and is not split further, or one of the
model's no-split classes (``_no_split_modules``), e.g. ``model.layers.3``. Modules tied to an earlier
block (a tied ``lm_head``, T5's per-stack ``embed_tokens``) join that block, since tied weights must share
a device; modules without weights join the block before them.

The meta model is built under the ``torch.device("meta")`` context, not accelerate's
``init_empty_weights``: the latter patches ``nn.Module.register_parameter`` for the whole process
(diffusers#4296), which would hand meta tensors to any other thread building a module meanwhile.

``load_structure`` caches its result in memory and on disk (``structure_cache``), so a known config is
planned without importing torch or transformers. This module must never import either at module level.
"""

from __future__ import annotations


import logging
import threading

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, get_args

from . import gguf, structure_cache
from . import quantization as quant
from .meta import build_meta_model, load_config, read_config_json
from ..names import DTYPE_SIZES, FROM_TORCH
from ..names import Task as TaskName

if TYPE_CHECKING:
    import torch

Task = Literal["causal-lm", "seq2seq-lm", "feature-extraction"]
BlockKind = Literal["embedding", "layer", "norm", "head", "other"]
log = logging.getLogger(__name__)

# Bump whenever what ``structure_from_model`` returns for a given config may change (the rules, the
# fields of Block/Structure): it is part of the on-disk cache key, so old cache files stop matching.
FORMAT_VERSION = 4


def _expect(value: Any, kind: type) -> Any:
    """``value`` if it is a ``kind`` (bool is not an int here), else TypeError: for strict decoding."""
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise TypeError(f"expected {kind.__name__}, got {type(value).__name__}")
    return value


def _strings(value: Any) -> tuple[str, ...]:
    return tuple(_expect(v, str) for v in _expect(value, list))


def _exact_fields(cls: type, data: Mapping[str, Any]) -> None:
    names = {f.name for f in fields(cls)}
    if set(data) != names:
        raise ValueError(f"{cls.__name__}: fields {sorted(set(data) ^ names)} missing or unknown")


@dataclass(frozen=True)
class Block:
    """One unit of placement. ``modules`` are the device_map keys it covers (first is its own)."""

    name: str
    modules: tuple[str, ...]
    kind: BlockKind
    weight_bytes: int  # parameters and buffers at the deployment dtype (and quantization), shared tensors once
    flops_per_token: int  # ~2 x parameters of the matmuls it runs; embedding lookups cost ~0
    kv_bytes_per_token: int = 0  # KV cache per cached token, for decoder layers
    logits_bytes_per_token: int = 0  # for the block that computes the output logits
    split_bytes: int = 0  # of weight_bytes, what the model's tensor-parallel plan splits across ranks

    @classmethod
    def from_dict(cls, data: Any) -> Block:
        """The inverse of ``asdict`` after a JSON round trip; TypeError/ValueError on anything else."""
        _exact_fields(cls, _expect(data, dict))
        kind = _expect(data["kind"], str)
        if kind not in get_args(BlockKind):
            raise ValueError(f"unknown block kind {kind!r}")
        return cls(name=_expect(data["name"], str), modules=_strings(data["modules"]), kind=kind,
                   **{k: _expect(data[k], int) for k in
                      ("weight_bytes", "flops_per_token", "kv_bytes_per_token", "logits_bytes_per_token",
                       "split_bytes")})


@dataclass(frozen=True)
class Structure:
    """The blocks of a model in execution order, with what the planner must respect."""

    architecture: str
    model_type: str
    dtype: str
    blocks: tuple[Block, ...]
    embedding_block: int  # index of the block holding the input embeddings
    no_split: tuple[str, ...] = ()
    notes: tuple[str, ...] = field(default=(), compare=False)

    @property
    def weight_bytes(self) -> int:
        return sum(b.weight_bytes for b in self.blocks)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Any) -> Structure:
        """The inverse of ``to_dict`` after a JSON round trip; TypeError/ValueError on anything else."""
        _exact_fields(cls, _expect(data, dict))
        blocks = tuple(Block.from_dict(b) for b in _expect(data["blocks"], list))
        embedding_block = _expect(data["embedding_block"], int)
        if not 0 <= embedding_block < len(blocks):
            raise ValueError(f"embedding_block {embedding_block} out of range")
        return cls(architecture=_expect(data["architecture"], str), model_type=_expect(data["model_type"], str),
                   dtype=_expect(data["dtype"], str), blocks=blocks, embedding_block=embedding_block,
                   no_split=_strings(data["no_split"]),
                   notes=_strings(data["notes"]))


def _holds_layer_list(module: torch.nn.Module, cache: dict[int, bool]) -> bool:
    import torch

    key = id(module)
    if key not in cache:
        cache[key] = isinstance(module, torch.nn.ModuleList) or any(
            _holds_layer_list(c, cache) for c in module.children())
    return cache[key]


def _leaves(model: torch.nn.Module, no_split: set[str]) -> list[tuple[str, torch.nn.Module, bool]]:
    """(name, module, is_layer) for every placement leaf, in registration (= execution) order."""
    import torch

    cache: dict[int, bool] = {}
    out: list[tuple[str, torch.nn.Module, bool]] = []

    def walk(prefix: str, module: torch.nn.Module, parent_is_list: bool) -> None:
        splittable = type(module).__name__ not in no_split and _holds_layer_list(module, cache)
        if prefix and not splittable:
            out.append((prefix, module, parent_is_list))
            return
        is_list = isinstance(module, torch.nn.ModuleList)
        for name, child in module._modules.items():
            if child is not None:
                walk(f"{prefix}.{name}" if prefix else name, child, is_list)

    walk("", model, False)
    return out


def _kv_bytes_per_token(config: Any, dtype_bytes: int) -> int:
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = getattr(cfg, "num_attention_heads", None)
    hidden = getattr(cfg, "hidden_size", None)
    if not heads or not hidden:
        return 0
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or getattr(cfg, "d_kv", None) or hidden // heads
    return 2 * kv_heads * head_dim * dtype_bytes


def _tensor_bytes(t: torch.Tensor, dtype_bytes: int) -> int:
    return t.numel() * (dtype_bytes if t.is_floating_point() else t.element_size())


def quantized_linears(model: Any, scheme: str) -> dict[str, tuple[int, int]]:
    """``{module: (out, in)}`` of the linear layers ``scheme`` quantizes in ``model`` (those inside its
    layer blocks, ``quantization.quantizable``): the one list sizes, reshard and loader share."""
    no_split = set(getattr(model, "_no_split_modules", None) or ())
    layers = [name for name, _, is_layer in _leaves(model, no_split) if is_layer]
    return quant.quantized_linears(model, layers, scheme)


def _size_quantized_head(model: Any, task: str, quantization: str, dtype: str, leaves: list[Any],
                         sizes: list[int], owner: dict[int, int]) -> None:
    """A head quantized at load (``quantization.quantized_head``): its leaf holds the quantized weight,
    in place of its own weight at dtype, or beside the input embeddings' when the two are tied."""
    found = quant.quantized_head(model, task, quantization)
    if found is None:
        return
    name, shape = found
    i = next(j for j, (leaf, _, _) in enumerate(leaves) if name == leaf or name.startswith(f"{leaf}."))
    weight = model.get_submodule(name).weight
    if owner.get(id(weight)) == i:  # untied: the weight at dtype is replaced
        sizes[i] -= _tensor_bytes(weight, DTYPE_SIZES[FROM_TORCH[dtype]])
    sizes[i] += quant.quantized_nbytes(shape, quantization, dtype)


def structure_from_model(model: Any, *, task: Task, dtype: str, quantization: str = "none") -> Structure:
    """Blocks of an already-built (meta or real) model. See the module docstring for the rules.
    ``quantization`` sizes the quantized linear weights of the layers as laid out (model.quantization)."""
    import torch
    from accelerate.utils import find_tied_parameters

    from .tensor_parallel import split_parameters

    dtype_bytes = DTYPE_SIZES[FROM_TORCH[dtype]]
    split = set(split_parameters(model)) if task == "causal-lm" else set()
    config = model.config
    no_split = set(getattr(model, "_no_split_modules", None) or ())
    leaves = _leaves(model, no_split)
    quantized = {f"{m}.weight": shape for m, shape in quantized_linears(model, quantization).items()}

    # Which leaf owns each tensor (first in execution order), so a shared tensor is counted once.
    owner: dict[int, int] = {}
    param_leaf: dict[str, int] = {}
    sizes = [0] * len(leaves)
    split_sizes = [0] * len(leaves)
    flops = [0] * len(leaves)
    for i, (name, module, _) in enumerate(leaves):
        for sub in module.modules():
            if not isinstance(sub, torch.nn.Embedding):  # a lookup, not a matmul
                flops[i] += sum(2 * p.numel() for p in sub.parameters(recurse=False))
        for pname, p in module.named_parameters(prefix=name, remove_duplicate=False):
            param_leaf[pname] = i
            if id(p) not in owner:
                owner[id(p)] = i
                size = (quant.quantized_nbytes(quantized[pname], quantization, dtype) if pname in quantized
                        else _tensor_bytes(p, dtype_bytes))
                sizes[i] += size
                split_sizes[i] += size if pname in split else 0
        for _, b in module.named_buffers(prefix=name, remove_duplicate=False):
            if id(b) not in owner:
                owner[id(b)] = i
                sizes[i] += _tensor_bytes(b, dtype_bytes)

    _size_quantized_head(model, task, quantization, dtype, leaves, sizes, owner)

    # Union leaves that share tensors: a tied group goes to the device of its first leaf.
    leader = list(range(len(leaves)))

    def find(i: int) -> int:
        while leader[i] != i:
            i = leader[i]
        return i

    tied_groups = [sorted(g) for g in find_tied_parameters(model)]
    for group in tied_groups:
        members = sorted({param_leaf[p] for p in group if p in param_leaf})
        for m in members[1:]:
            leader[find(m)] = find(members[0])
    for i, (_, module, _) in enumerate(leaves):
        for p in module.parameters():
            if owner[id(p)] != i:
                leader[find(i)] = find(owner[id(p)])

    input_emb = model.get_input_embeddings()
    output_emb = model.get_output_embeddings() if task != TaskName.FEATURE_EXTRACTION else None
    emb_leaf = next(i for i, (_, m, _) in enumerate(leaves)
                    if m is input_emb or any(s is input_emb for s in m.modules()))
    kv = _kv_bytes_per_token(config, dtype_bytes)
    vocab = getattr(config.get_text_config() if hasattr(config, "get_text_config") else config,
                    "vocab_size", 0) or 0

    groups: dict[int, list[int]] = {}
    for i in range(len(leaves)):
        groups.setdefault(find(i), []).append(i)
    # Leaves with nothing to place (dropout, activations) ride along with the block before them.
    order = sorted(groups)
    merged: list[list[int]] = []
    for lead in order:
        members = groups[lead]
        empty = all(sizes[m] == 0 and flops[m] == 0 for m in members)
        if empty and merged:
            merged[-1].extend(members)
        else:
            merged.append(list(members))
    if len(merged) > 1 and all(sizes[m] == 0 and flops[m] == 0 for m in merged[0]):
        merged[1] = merged[0] + merged[1]
        merged.pop(0)

    blocks: list[Block] = []
    embedding_block = 0
    for members in merged:
        name, module, is_layer = leaves[members[0]]
        in_decoder = task == TaskName.CAUSAL_LM or (task == TaskName.SEQ2SEQ_LM and ".decoder." in f".{name}.")
        has_head = output_emb is not None and any(
            m is output_emb or any(s is output_emb for s in m.modules())
            for m in (leaves[j][1] for j in members))
        if emb_leaf in members:
            kind = "embedding"
            embedding_block = len(blocks)
        elif is_layer:
            kind = "layer"
        elif has_head:
            kind = "head"
        elif "norm" in type(module).__name__.lower():
            kind = "norm"
        else:
            kind = "other"
        blocks.append(Block(
            name=name,
            modules=tuple(leaves[j][0] for j in members),
            kind=kind,  # type: ignore[arg-type]
            weight_bytes=sum(sizes[j] for j in members),
            flops_per_token=sum(flops[j] for j in members),
            kv_bytes_per_token=kv if (is_layer and in_decoder) else 0,
            logits_bytes_per_token=vocab * dtype_bytes if has_head else 0,
            split_bytes=sum(split_sizes[j] for j in members),
        ))
    notes = tuple(
        f"{', '.join(leaves[j][0] for j in members[1:])} share weights with {leaves[lead][0]}: "
        "placed on the same device"
        for lead, members in groups.items() if len(members) > 1)
    return Structure(
        architecture=type(model).__name__,
        model_type=str(getattr(config, "model_type", "")),
        dtype=dtype,
        blocks=tuple(blocks),
        embedding_block=embedding_block,
        no_split=tuple(sorted(no_split)),
        notes=notes,
    )


def structure_from_config(config: Any, *, task: Task, dtype: str, trust_remote_code: bool = False,
                          quantization: str = "none") -> Structure:
    model = build_meta_model(config, task=task, trust_remote_code=trust_remote_code)
    return structure_from_model(model, task=task, dtype=dtype, quantization=quantization)


_STRUCTURES: dict[str, Structure] = {}  # in-process, by the same key as the on-disk cache
_STRUCTURES_LOCK = threading.Lock()  # deployments plan in parallel at start


def load_structure(model_dir: Path, *, task: Task, dtype: str, trust_remote_code: bool = False,
                   quantization: str = "none") -> Structure:
    """Blocks of the checkpoint at ``model_dir``, from its config.json alone (no weights read), or of
    the GGUF file ``model_dir`` names, from its metadata alone (nothing dequantized), sized at ``dtype``
    and ``quantization``.

    Cached in this process and on disk (see ``structure_cache``): for a config seen before, neither
    torch nor transformers is imported.
    """
    if gguf.is_gguf(Path(model_dir)):
        return _load_gguf_structure(Path(model_dir), task=task, dtype=dtype, quantization=quantization)
    config_json = read_config_json(model_dir)
    key = structure_cache.structure_key(config_json, model_dir=Path(model_dir), task=task, dtype=dtype,
                                        trust_remote_code=trust_remote_code, format_version=FORMAT_VERSION,
                                        quantization=quantization)
    structure = _cached(key)
    if structure is None:
        config = load_config(model_dir, trust_remote_code=trust_remote_code)
        structure = structure_from_config(config, task=task, dtype=dtype, trust_remote_code=trust_remote_code,
                                          quantization=quantization)
        if read_config_json(model_dir) == config_json:  # not edited while we built: the key still holds
            structure_cache.store(key, structure.to_dict())
    return _remember(key, structure)


def _load_gguf_structure(gguf_file: Path, *, task: Task, dtype: str, quantization: str) -> Structure:
    """Blocks of the model a GGUF file holds, from its metadata (never its tensors). Keyed by the
    file's fingerprint; remote code does not apply (transformers builds GGUF models only from its own
    architectures)."""
    fingerprint = gguf.gguf_fingerprint(gguf_file)
    key = structure_cache.structure_key(b"", model_dir=gguf_file.parent, task=task, dtype=dtype,
                                        trust_remote_code=False, format_version=FORMAT_VERSION,
                                        gguf_fingerprint=fingerprint, quantization=quantization)
    structure = _cached(key)
    if structure is None:
        structure = structure_from_config(gguf.load_gguf_config(gguf_file), task=task, dtype=dtype,
                                          quantization=quantization)
        if gguf.gguf_fingerprint(gguf_file) == fingerprint:  # not rewritten while we built
            structure_cache.store(key, structure.to_dict())
    return _remember(key, structure)


def _remember(key: str, structure: Structure) -> Structure:
    with _STRUCTURES_LOCK:
        if len(_STRUCTURES) > 64:
            _STRUCTURES.clear()
        _STRUCTURES[key] = structure
    return structure


def _cached(key: str) -> Structure | None:
    with _STRUCTURES_LOCK:
        found = _STRUCTURES.get(key)
    return found or _from_disk(key)


def _from_disk(key: str) -> Structure | None:
    payload = structure_cache.load(key)
    if payload is None:
        return None
    try:
        return Structure.from_dict(payload)
    except (KeyError, TypeError, ValueError) as exc:
        log.debug("structure cache: ignoring malformed entry %s: %s", key, exc)
        return None
