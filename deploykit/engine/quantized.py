"""Loading quantized shards (``model.quantization``'s format) with kernels that run on this host.

transformers does the loading: deploykit registers a small quantizer (transformers' ``HfQuantizer`` API,
``register_quantizer``) whose only job is to swap the quantized ``nn.Linear`` modules for
``QuantizedLinear`` on the meta model before the weights are read; transformers then reads the int8 / int4
tensors and their scales straight into those modules (memory-mapped, never expanded to full precision),
and handles device maps, tied weights and buffers as for any model.

Kernels, chosen by measurement on this CPU (docs/quantization.md has the figures):

- CPU, int8: ``torch._weight_int8pack_mm`` (weight-only int8 matmul) with bfloat16 activations for up to
  ``_SMALL`` rows (decoding, mixed steps: as fast as float32 or faster); for more rows (prefill) the
  weights are dequantized to bfloat16 for that call and multiplied by oneDNN's bfloat16 GEMM, faster than
  float32 there. The crossover is measured in a whole forward (``bench/int8_rows.py``: 72-80 rows on
  SmolLM2, 2 cores), where the weights come from memory; one layer whose weight stays in the CPU's caches
  (``bench/quantize_kernels.py``) crosses over sooner, at ~32 rows. The same kernels with float32 activations run 10-20x slower than float32, hence bfloat16.
- CPU, int4: ``torch._weight_int4pack_mm_for_cpu`` (groups of 32, scales and zeros) with bfloat16
  activations; its weights are repacked once at load into the kernel's layout (same size).
- CUDA, int4: torch's tinygemm kernel ``torch._weight_int4pack_mm`` (the kernel torchao's
  ``Int4WeightOnlyConfig`` runs; its scale-and-zero convention is the one stored), bfloat16 activations, the
  weights repacked once at load into the kernel's tiles (same bytes). torchao itself is not used: it pads
  the inputs to a multiple of 1024 (576 -> 1024 on SmolLM2), which would hold more than the plan. Where
  the kernel cannot run (compute capability below 8.0, outputs not a multiple of 8) the layer dequantizes
  per call, and the load logs how many layers do and why (``cuda_kernel``).
- CUDA, int8: no eager weight-only int8 kernel beats a GEMM (torch's CUDA ``_weight_int8pack_mm`` computes
  each output in its own thread; torchao's ``Int8WeightOnlyConfig`` without ``torch.compile`` converts the
  weight per call): the int8 weight is converted to the activation dtype per call and the output scaled,
  as torchao does, one weight-sized temporary instead of two.
- Neither CUDA path has been measured here (no GPU): ``gpucheck``'s ``quantized_kernels`` check compares
  them with dequantizing per call and with the plan's bytes.

Outputs are returned in the activation dtype, so the rest of the model runs at ``spec.model.dtype``.
"""

from __future__ import annotations

import logging
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.nn import functional as F
from transformers.quantizers import HfQuantizer, register_quantization_config, register_quantizer
from transformers.utils.quantization_config import QuantizationConfigMixin

from ..model.quantization import GROUP_SIZE

METHOD = "deploykit"
_SMALL = 64  # rows up to which int8's weight-only kernel beats dequantize + GEMM in a forward (bench/int8_rows.py)
_COMPUTE = torch.bfloat16
_ALIGN = 64  # bytes: what torch's CPU allocator gives and the int8 kernel's vector loads need
_MADV_DONTNEED = 4
_TINYGEMM_CAPABILITY = (8, 0)  # the int4 kernel's bfloat16 tensor-core instructions (Ampere and later)
_TINYGEMM_N = 8  # outputs per tile of the int4 kernel's layout
_INNER_K_TILES = (8, 4, 2)  # the int4 layout's inner tiles of 16 inputs, largest first

log = logging.getLogger(__name__)


class CudaKernel(NamedTuple):
    """What a quantized layer runs on a CUDA device: ``name`` is ``"tinygemm"`` (int4 kernel),
    ``"int8-convert"`` (int8 converted per call) or ``"dequantize"`` (the fallback, with the ``reason``)."""

    name: str
    reason: str = ""


def cuda_kernel(scheme: str, out_features: int, capability: tuple[int, int]) -> CudaKernel:
    """The kernel a layer of ``scheme`` with ``out_features`` outputs runs on a CUDA device of compute
    ``capability``."""
    if scheme == "int8":
        return CudaKernel("int8-convert")
    if capability < _TINYGEMM_CAPABILITY:
        return CudaKernel("dequantize", f"the int4 kernel needs compute capability 8.0 or more, this GPU has "
                                        f"{capability[0]}.{capability[1]}")
    if out_features % _TINYGEMM_N:
        return CudaKernel("dequantize", f"the int4 kernel needs outputs in multiples of {_TINYGEMM_N}, "
                                        f"this layer has {out_features}")
    return CudaKernel("tinygemm")


class QuantizedLinear(nn.Module):
    """``nn.Linear`` with int8 (per output channel) or int4 (groups of 32) weights, as laid out on disk."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool, scheme: str, dtype: torch.dtype) -> None:
        super().__init__()
        self.in_features, self.out_features, self.scheme = in_features, out_features, scheme
        frozen = {"requires_grad": False}
        if scheme == "int8":
            self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=torch.int8), **frozen)
            self.weight_scale = nn.Parameter(torch.empty(out_features, dtype=dtype), **frozen)
        else:
            groups = in_features // GROUP_SIZE
            self.weight = nn.Parameter(torch.empty(out_features, in_features // 2, dtype=torch.uint8), **frozen)
            self.weight_scale = nn.Parameter(torch.empty(out_features, groups, dtype=dtype), **frozen)
            self.weight_zero = nn.Parameter(torch.empty(out_features, groups, dtype=dtype), **frozen)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), **frozen) if bias else None
        self._packed: torch.Tensor | None = None  # int4 on CPU or CUDA: the kernel's layout
        self._scales: torch.Tensor | None = None  # bfloat16 scales (int8) or scales and zeros (int4)
        self.kernel: CudaKernel | None = None  # on CUDA, once prepared

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, scheme={self.scheme}"

    def prepare(self) -> None:
        """After loading: the kernels' forms of the weights (int4 replaces its stored weight)."""
        device = self.weight.device
        if device.type == "cuda":
            self.prepare_for_cuda(torch.cuda.get_device_capability(device))
        elif device.type == "cpu":
            self._prepare_for_cpu()

    def prepare_for_cuda(self, capability: tuple[int, int]) -> None:
        """The CUDA kernel's forms, for a device of compute ``capability`` (an argument, so that the tests
        run it on fake CUDA tensors, without a GPU, and check its bytes against the plan's)."""
        self.kernel = cuda_kernel(self.scheme, self.out_features, capability)
        if self.kernel.name != "tinygemm":
            return
        # int4 layers have inputs in multiples of 32 (GROUP_SIZE), so 2 tiles of 16 always fit
        tiles = next(t for t in _INNER_K_TILES if self.in_features % (t * 16) == 0)
        self._packed = torch._convert_weight_to_int4pack(self.nibbles_for_cuda(), tiles)
        self._scales = torch.stack([self.weight_scale.detach().t(), self.weight_zero.detach().t()],
                                   dim=-1).to(_COMPUTE).contiguous()
        # the kernel's forms replace the stored ones (the same bytes at bfloat16), so memory holds one copy
        self.weight = nn.Parameter(self._packed, requires_grad=False)
        self.weight_scale = nn.Parameter(self._scales, requires_grad=False)
        del self.weight_zero

    def nibbles_for_cuda(self) -> torch.Tensor:
        """The stored int4 bytes in the order torch's CUDA packing reads them: input 2j in the high nibble
        of byte j (the shards keep it in the low one)."""
        stored = self.weight.detach()
        return ((stored << 4) | (stored >> 4)).contiguous()

    def _prepare_for_cpu(self) -> None:
        stored = self.weight.detach()
        if self.scheme == "int8":
            self._scales = self.weight_scale.detach().to(_COMPUTE)
            replaced: list[torch.Tensor] = [self.weight_scale]
            if stored.data_ptr() % _ALIGN:
                # safetensors aligns tensor data to 8 bytes only; the int8 kernel's vector loads need 64
                self.weight = nn.Parameter(stored.clone(), requires_grad=False)
                replaced.append(stored)
        else:
            self._packed = torch._convert_weight_to_int4pack_for_cpu(_unpack_int4(stored), 1)
            self._scales = torch.stack([self.weight_scale.t(), self.weight_zero.t()], dim=-1).to(_COMPUTE).contiguous()
            self.weight = nn.Parameter(self._packed, requires_grad=False)  # the stored layout is no longer needed
            replaced = [stored, self.weight_scale, self.weight_zero]
        for tensor in replaced:  # the CPU forward reads only the kernels' forms from here on
            _release_pages(tensor.detach())

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The full weight at ``dtype`` (for a call with many rows, or on a GPU)."""
        if self.scheme == "int8":
            return self.weight.to(dtype) * self.weight_scale.to(dtype)[:, None]
        q = _unpack_int4(self.weight).to(dtype).reshape(self.out_features, -1, GROUP_SIZE)
        w = (q - 8) * self.weight_scale.to(dtype)[..., None] + self.weight_zero.to(dtype)[..., None]
        return w.reshape(self.out_features, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None:
            return self._forward_cuda(x)
        if x.device.type != "cpu" or self._scales is None:
            return F.linear(x, self.dequantized(x.dtype), self.bias)
        rows = x.reshape(-1, self.in_features).to(_COMPUTE)
        if self._packed is not None:  # int4
            y = torch._weight_int4pack_mm_for_cpu(rows, self._packed, GROUP_SIZE, self._scales)
        elif rows.shape[0] <= _SMALL:
            y = torch._weight_int8pack_mm(rows, self.weight, self._scales)
        else:
            y = F.linear(rows, self.weight.to(_COMPUTE) * self._scales[:, None])
        y = y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        return y + self.bias if self.bias is not None else y

    def _forward_cuda(self, x: torch.Tensor) -> torch.Tensor:
        assert self.kernel is not None
        if self.kernel.name == "tinygemm":
            rows = x.reshape(-1, self.in_features).to(_COMPUTE)
            y = torch._weight_int4pack_mm(rows, self.weight, GROUP_SIZE, self.weight_scale)
            y = y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        elif self.kernel.name == "int8-convert":
            y = F.linear(x, self.weight.to(x.dtype)) * self.weight_scale.to(x.dtype)
        else:
            return F.linear(x, self.dequantized(x.dtype), self.bias)
        return y + self.bias if self.bias is not None else y


def _release_pages(t: torch.Tensor) -> None:
    """Drop the memory pages wholly inside ``t`` from this process once a copy replaced it and nothing
    reads ``t`` any more. The weights are memory-mapped from the shard files (read-only), so a dropped
    page is never lost (it would be read again from the file), and a page of heap memory wholly inside
    ``t`` holds only ``t``'s bytes; without this, the replaced weights would stay in resident memory."""
    import ctypes
    import mmap

    start = -(-t.data_ptr() // mmap.PAGESIZE) * mmap.PAGESIZE
    end = (t.data_ptr() + t.numel() * t.element_size()) // mmap.PAGESIZE * mmap.PAGESIZE
    if end > start:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        libc.madvise(start, end - start, _MADV_DONTNEED)


def _trim_heap() -> None:
    """Give the heap pages freed by ``prepare``'s temporaries back to the system (glibc's ``malloc_trim``).
    Without it, the kernels' copies interleave with freed buffers and glibc keeps them all: measured on
    SmolLM2 int4, 440 MiB of heap for 70 MiB of kernel weights."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if name is not None:
        libc = ctypes.CDLL(name)
        if hasattr(libc, "malloc_trim"):  # glibc only
            libc.malloc_trim(0)


def _unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """[out, in / 2] bytes -> [out, in] int32 values 0..15 (low nibble first)."""
    return torch.stack([packed & 15, packed >> 4], dim=-1).reshape(packed.shape[0], -1).to(torch.int32)


class DeploykitQuantConfig(QuantizationConfigMixin):
    """The quantization transformers sees: ``scheme`` for the linear ``modules`` (names in the model), their
    scales and zeros at ``dtype`` (torch's name: the deployment's, as the plan sizes and the shards store
    them)."""

    def __init__(self, scheme: str = "int8", modules: list[str] | None = None, dtype: str = "float32",
                 **_: Any) -> None:
        self.quant_method = METHOD  # type: ignore[assignment]
        self.scheme = scheme
        self.modules = list(modules or [])
        self.dtype = dtype


class DeploykitQuantizer(HfQuantizer):
    """Swaps the quantized linears before loading and prepares their kernels after. Weights are read as
    stored: nothing is quantized at load time (the reshard did it)."""

    requires_calibration = False
    quantization_config: DeploykitQuantConfig

    def _process_model_before_weight_loading(self, model: Any, **kwargs: Any) -> Any:
        # the config's dtype: transformers keeps from_pretrained's ``dtype`` out of these kwargs (5.x), and
        # float32 scales beside bfloat16 shards took 116 MiB more than planned on Llama-3.2-1B int4
        dtype = getattr(torch, self.quantization_config.dtype)
        for name in self.quantization_config.modules:
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            linear = getattr(parent, child)
            with torch.device("meta"):
                replacement = QuantizedLinear(linear.in_features, linear.out_features, bias=linear.bias is not None,
                                              scheme=self.quantization_config.scheme, dtype=dtype)
            setattr(parent, child, replacement)
        return model

    def _process_model_after_weight_loading(self, model: Any, **kwargs: Any) -> Any:
        layers = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
        for module in layers:
            module.prepare()
        log_cuda_fallbacks(layers)
        _trim_heap()
        return model

    def is_serializable(self) -> bool:
        return False

    @property
    def is_trainable(self) -> bool:
        return False


def log_cuda_fallbacks(layers: list[QuantizedLinear]) -> None:
    """Say in the log how many of ``layers`` dequantize per call on CUDA instead of running a kernel, and
    why (the load goes on: the fallback is correct, only slower)."""
    reasons: dict[str, int] = {}
    for layer in layers:
        if layer.kernel is not None and layer.kernel.name == "dequantize":
            reasons[layer.kernel.reason] = reasons.get(layer.kernel.reason, 0) + 1
    for reason, count in reasons.items():
        log.warning("%d quantized layer(s) on CUDA dequantize their weights per call (slower): %s", count, reason)


def _register() -> None:
    from transformers.quantizers.auto import AUTO_QUANTIZATION_CONFIG_MAPPING, AUTO_QUANTIZER_MAPPING

    if METHOD not in AUTO_QUANTIZATION_CONFIG_MAPPING:
        register_quantization_config(METHOD)(DeploykitQuantConfig)
    if METHOD not in AUTO_QUANTIZER_MAPPING:
        register_quantizer(METHOD)(DeploykitQuantizer)


def quantize_head(model: Any, task: str, scheme: str) -> None:
    """Quantize ``model``'s output head under ``scheme`` now that it is loaded (``model.quantization``:
    the head is stored at dtype). A head tied to the input embeddings leaves them as they are (lookups
    read them); an untied head's weight at dtype is dropped."""
    from ..model.quantization import quantized_head

    found = quantized_head(model, task, scheme)
    if found is None:
        return
    name, _ = found
    head: nn.Linear = model.get_submodule(name)
    if hasattr(head, "_hf_hook") or head.weight.device.type == "meta":
        return  # offloaded under accelerate's hooks (GPU plans with CPU/disk blocks): left at dtype
    weight = head.weight.detach()
    tied = any(weight is p.detach() or weight.data_ptr() == p.data_ptr()
               for p in model.get_input_embeddings().parameters())
    q = quantized_linear(head, scheme)
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, q)
    if not tied and weight.device.type == "cpu":
        _release_pages(weight)
    _trim_heap()


def quantized_linear(linear: nn.Linear, scheme: str) -> QuantizedLinear:
    """``linear`` quantized under ``scheme`` in memory, ready to run (its weight is left as it was)."""
    from ..artifacts.quantize import quantize_rows

    weight = linear.weight.detach()
    stored = quantize_rows(weight.float(), scheme, weight.dtype)
    q = QuantizedLinear(linear.in_features, linear.out_features, bias=linear.bias is not None, scheme=scheme,
                        dtype=weight.dtype)
    q.weight = nn.Parameter(stored[0], requires_grad=False)
    q.weight_scale = nn.Parameter(stored[1], requires_grad=False)
    if scheme != "int8":
        q.weight_zero = nn.Parameter(stored[2], requires_grad=False)
    if linear.bias is not None:
        q.bias = nn.Parameter(linear.bias.detach(), requires_grad=False)
    q.prepare()
    return q


def quantize_linears(model: Any, scheme: str) -> int:
    """Quantize, in memory, every ``nn.Linear`` of ``model`` that ``scheme`` can hold (int4: inputs in
    groups of 32 and outputs a multiple of 16, as torch's int4 kernel needs), the head included (a tied
    head leaves the input embeddings as they are): the quantized self-draft of
    ``spec.speculative.draft.quantized``. Returns how many were quantized."""
    from ..model.quantization import quantizable

    found = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)
             and quantizable(m.in_features, scheme) and (scheme == "int8" or m.out_features % 16 == 0)]
    for name, linear in found:
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, quantized_linear(linear, scheme))
    _trim_heap()
    return len(found)


def quantization_config(scheme: str, modules: list[str], dtype: str) -> DeploykitQuantConfig:
    """What to pass as ``from_pretrained(quantization_config=...)`` for shards quantized with ``scheme`` at
    ``dtype`` (torch's name)."""
    _register()
    return DeploykitQuantConfig(scheme=scheme, modules=sorted(modules), dtype=dtype)
