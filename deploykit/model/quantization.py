"""What ``spec.model.quantization`` quantizes, and how many bytes it takes: one rule shared by the
planner (sizes), the reshard (which tensors it quantizes, in which on-disk format) and the loader.

Weight-only quantization of the ``nn.Linear`` modules inside the model's decoder/encoder layers (the
structure's ``layer`` blocks), and of the output head (``lm_head``) of a causal LM. Embeddings, norms,
biases, other modules (GPT-2's ``Conv1D``, T5's relative attention bias) and the scales stay at the
deployment dtype.

The head is stored at dtype (it is often tied to the input embeddings, which a lookup reads) and
quantized when it is loaded (``quantized_head``): a tied head then holds a quantized copy beside the
embeddings, an untied one replaces its weight. Why: after the layers, the head is the largest matmul of
a decode step (SmolLM2-135M int8: 18.8 ms of float32 head in a 40 ms step, 3.4 ms with the int8 kernel).

On disk (safetensors, docs/quantization.md), a quantized ``<module>.weight`` of shape ``[out, in]`` becomes:

- int8: ``<module>.weight`` I8 ``[out, in]`` and ``<module>.weight_scale`` ``[out]`` at dtype;
  ``w = q * scale`` (symmetric, one scale per output channel, ``scale = max|w| / 127``).
- int4: ``<module>.weight`` U8 ``[out, in / 2]`` (column ``2j`` in the low nibble of byte ``j``, ``2j + 1``
  in the high one), ``<module>.weight_scale`` and ``<module>.weight_zero`` ``[out, in / 32]`` at dtype;
  ``w = (q - 8) * scale + zero`` for each group of 32 inputs (asymmetric: ``scale = (max - min) / 15``,
  ``zero = min + 8 * scale``; the convention of torch's int4 kernels).

A linear layer the scheme cannot hold (int4 with ``in`` not a multiple of 32) stays at dtype; sizes and
layout apply the same ``quantizable`` test, so plan bytes are the bytes laid out and loaded.

This module never imports torch at module level; only ``quantized_linears`` needs a (meta) model.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ..names import DTYPE_SIZES, FROM_TORCH, Quantization

GROUP_SIZE = 32  # int4: inputs sharing one scale and zero; 32 as llama.cpp's Q4_1 and torch's kernels
SCALE_SUFFIX, ZERO_SUFFIX = "_scale", "_zero"


def is_quantized(scheme: str) -> bool:
    return scheme != Quantization.NONE.value


def quantizable(in_features: int, scheme: str) -> bool:
    """Whether a linear layer with ``in_features`` inputs is quantized under ``scheme``."""
    if scheme == Quantization.INT8.value:
        return True
    if scheme == Quantization.INT4.value:
        return in_features % GROUP_SIZE == 0
    return False


def quantized_tensors(weight: str, shape: tuple[int, ...], scheme: str,
                      dtype: str) -> list[tuple[str, str, tuple[int, ...]]]:
    """The tensors (name, safetensors dtype, shape) a quantized linear ``weight`` of ``shape`` [out, in]
    is stored as; ``dtype`` is the deployment's (torch's name) for scales and zeros."""
    out, inputs = shape
    scale_dtype = FROM_TORCH[dtype]
    if scheme == Quantization.INT8.value:
        return [(weight, "I8", (out, inputs)), (weight + SCALE_SUFFIX, scale_dtype, (out,))]
    groups = inputs // GROUP_SIZE
    return [(weight, "U8", (out, inputs // 2)), (weight + SCALE_SUFFIX, scale_dtype, (out, groups)),
            (weight + ZERO_SUFFIX, scale_dtype, (out, groups))]


def quantized_nbytes(shape: tuple[int, ...], scheme: str, dtype: str) -> int:
    """Bytes of a quantized linear weight of ``shape`` [out, in], scales and zeros included."""
    total = 0
    for _, st_dtype, dims in quantized_tensors("w", shape, scheme, dtype):
        count = 1
        for d in dims:
            count *= d
        total += count * DTYPE_SIZES[st_dtype]
    return total


def quantized_linears(model: Any, layer_modules: Iterable[str], scheme: str) -> dict[str, tuple[int, int]]:
    """``{module name: (out, in)}`` of the linear layers ``scheme`` quantizes inside ``layer_modules`` of
    ``model`` (a meta or real model). Empty for ``none``."""
    import torch

    if not is_quantized(scheme):
        return {}
    found: dict[str, tuple[int, int]] = {}
    for prefix in layer_modules:
        for name, module in model.get_submodule(prefix).named_modules(prefix=prefix):
            if isinstance(module, torch.nn.Linear) and quantizable(module.in_features, scheme):
                found[name] = (module.out_features, module.in_features)
    return found


def layer_modules(structure: Any) -> list[str]:
    """The device_map modules of a structure's ``layer`` blocks: where quantized linears live."""
    return [m for block in structure.blocks if block.kind == "layer" for m in block.modules]


def quantized_head(model: Any, task: str, scheme: str) -> tuple[str, tuple[int, int]] | None:
    """(module name, (out, in)) of the output head ``scheme`` quantizes at load, or None: a causal LM's
    ``nn.Linear`` head that the scheme can hold (``quantizable``; int4 also needs a vocabulary that is a
    multiple of 16, as torch's int4 kernel does, else the head stays at dtype)."""
    import torch

    if not is_quantized(scheme) or task != "causal-lm":
        return None
    head = model.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear) or not quantizable(head.in_features, scheme):
        return None
    if scheme == Quantization.INT4.value and head.out_features % 16:
        return None
    name = next(n for n, m in model.named_modules() if m is head)
    return name, (head.out_features, head.in_features)
