"""The CUDA path of the quantized linears, checked on this CPU: which kernel each layer gets, the bytes its
kernel forms hold against the plan, the fallback's log line, and the nibble order the int4 kernel reads.
The layers live on a ``cuda`` device of torch's ``FakeTensorMode`` (shapes, dtypes and devices without
data or a GPU; torch's own fake kernels of the int4 packing and matmul), so the code that runs is the code
a GPU runs. What it computes on a GPU is tests/test_cuda.py's and the GPU check's (docs/gpu.md)."""

from __future__ import annotations

import logging

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from deploykit.engine.quantized import QuantizedLinear, cuda_kernel, log_cuda_fallbacks
from deploykit.model.quantization import quantized_nbytes

HOPPER, TURING = (9, 0), (7, 5)


@pytest.mark.parametrize(("scheme", "out", "capability", "kernel"), [
    ("int4", 2048, HOPPER, "tinygemm"),
    ("int4", 2048, (8, 0), "tinygemm"),
    ("int4", 2048, TURING, "dequantize"),
    ("int4", 2044, HOPPER, "dequantize"),
    ("int8", 2048, HOPPER, "int8-convert"),
    ("int8", 2044, TURING, "int8-convert"),
])
def test_each_layer_gets_the_kernel_its_gpu_and_shape_allow(scheme, out, capability, kernel):
    chosen = cuda_kernel(scheme, out, capability)
    assert chosen.name == kernel
    assert bool(chosen.reason) == (kernel == "dequantize")


@pytest.fixture
def fake_cuda():
    with FakeTensorMode():
        yield


def _cuda_layer(out: int, inputs: int, scheme: str, dtype: torch.dtype = torch.bfloat16) -> QuantizedLinear:
    with torch.device("cuda"):
        return QuantizedLinear(inputs, out, bias=False, scheme=scheme, dtype=dtype)


def _x(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.empty(*shape, dtype=dtype, device="cuda")


def _held(layer: QuantizedLinear) -> int:
    return sum(p.nbytes for p in layer.parameters())


@pytest.mark.parametrize("scheme", ["int4", "int8"])
@pytest.mark.parametrize("shape", [(8192, 2048), (2048, 8192), (1536, 576), (576, 1536), (64, 96)])
def test_the_cuda_forms_hold_the_plans_bytes_at_bfloat16(fake_cuda, scheme, shape):
    """Llama-3.2-1B's and SmolLM2's MLP shapes and a tiny one: the kernel's forms replace the stored
    tensors, so a layer holds what the plan sizes (int4: packed int32 tiles and scale-and-zero pairs)."""
    out, inputs = shape
    layer = _cuda_layer(out, inputs, scheme)
    assert _held(layer) == quantized_nbytes(shape, scheme, "bfloat16")
    layer.prepare_for_cuda(HOPPER)
    assert layer.kernel is not None and layer.kernel.name != "dequantize"
    assert _held(layer) == quantized_nbytes(shape, scheme, "bfloat16")
    y = layer(_x(3, 5, inputs))
    assert (y.shape, y.dtype, y.device.type) == ((3, 5, out), torch.bfloat16, "cuda")


def test_at_float32_the_int4_kernel_holds_its_scales_at_bfloat16_under_the_plan(fake_cuda):
    layer = _cuda_layer(2048, 8192, "int4", torch.float32)
    layer.prepare_for_cuda(HOPPER)
    groups = 8192 // 32
    assert _held(layer) == quantized_nbytes((2048, 8192), "int4", "float32") - 2 * 2048 * groups * 2
    y = layer(_x(4, 8192, dtype=torch.float32))
    assert (y.dtype, y.device.type) == (torch.float32, "cuda")


def test_a_layer_the_kernel_cannot_run_dequantizes_and_the_load_says_so(fake_cuda, caplog):
    layers = [_cuda_layer(2048, 512, "int4"), _cuda_layer(2048, 512, "int4"), _cuda_layer(512, 2048, "int8")]
    for layer in layers:
        layer.prepare_for_cuda(TURING)
    assert [layer.kernel.name for layer in layers] == ["dequantize", "dequantize", "int8-convert"]
    assert _held(layers[0]) == quantized_nbytes((2048, 512), "int4", "bfloat16")  # stored form kept
    with caplog.at_level(logging.WARNING, logger="deploykit.engine.quantized"):
        log_cuda_fallbacks(layers)
    [record] = caplog.records
    assert "2 quantized layer(s) on CUDA dequantize" in record.getMessage()
    assert "compute capability 8.0 or more, this GPU has 7.5" in record.getMessage()


def test_the_int4_kernel_reads_the_stored_nibbles_in_its_own_order():
    """torch's CUDA int4 packing takes input 2j from the high nibble of byte j (torchao packs
    ``q[:, ::2] << 4 | q[:, 1::2]`` for it); the shards store 2j in the low nibble. The swapped bytes the
    CUDA path hands to the packing must read back, in the kernel's order, as the stored values."""
    from deploykit.artifacts.quantize import quantize_rows

    torch.manual_seed(0)
    stored, _, _ = quantize_rows(torch.randn(16, 64), "int4", torch.bfloat16)
    layer = QuantizedLinear(64, 16, bias=False, scheme="int4", dtype=torch.bfloat16)
    layer.weight.data.copy_(stored)
    values = torch.stack([stored & 15, stored >> 4], dim=-1).reshape(16, 64)  # the shards' order
    handed = layer.nibbles_for_cuda()
    kernel_order = torch.stack([handed >> 4, handed & 15], dim=-1).reshape(16, 64)
    assert torch.equal(kernel_order, values)
