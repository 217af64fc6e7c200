"""Materialise a Plan into a model on its devices. The only module that moves tensors.

Two paths, both through transformers' ``from_pretrained`` on the (resharded) checkpoint:

- **A plan with GPUs** is handed to ``from_pretrained(device_map=plan.device_map, offload_folder=...)``
  as is: transformers and accelerate place GPU blocks, and attach accelerate's offload hooks to CPU
  and disk blocks (disk blocks are read in place from the safetensors files, nothing is copied).
  Those hooks are not safe for concurrent forwards, so such a model reports ``serialize_forward``.
- **A plan without GPUs** (everything executes on the CPU) needs no hooks: transformers already maps
  safetensors weights into memory on CPU. The CPU tier's blocks are faulted into memory at load time;
  the disk tier's blocks are read from their shard files on demand (and can be evicted by the kernel
  under memory pressure). Nothing is copied. Forwards are then as fast as all-CPU once pages are
  warm, and safe to run concurrently. (accelerate's disk hooks copy every offloaded weight on every
  forward: 1.26x the all-CPU latency here, and unsafe under threads.)

Missing weights, shape mismatches and a plan that names GPUs this host does not have are errors here,
before the model is returned.
"""

from __future__ import annotations


import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ApplyError
from ..model.hf import BUILD_LOCK, auto_class, quiet_transformers
from ..placement.keys import placement_key
from ..placement.plan import Plan

log = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    model: Any  # torch.nn.Module; None when the model runs elsewhere (pipeline stages on Ray)
    plan: Plan
    source: Path
    input_device: str  # where inputs go: the device of the input embeddings
    serialize_forward: bool  # accelerate offload hooks present: one forward at a time
    tokenizer: Any | None = None
    runtime: Any = None  # a serving runtime built with the model (pipeline stages), else built later


@dataclass(frozen=True)
class LoadOptions:
    """How to load, from the manifest's model and offload sections."""

    task: str
    dtype: str  # torch's name, e.g. "float16"
    trust_remote_code: bool = False
    allow_pickle: bool = False
    offload_dir: Path | None = None  # needed when a GPU plan uses the disk tier
    show_progress: bool = False


def gpus_of(plan: Plan) -> list[int]:
    return sorted({d for d in plan.device_map.values() if isinstance(d, int)})


def check_fits_host(plan: Plan) -> None:
    """A plan made for GPUs this host lacks (a simulated inventory) cannot be loaded here."""
    gpus = gpus_of(plan)
    if not gpus:
        return
    import torch

    available = torch.cuda.device_count() if torch.cuda.is_available() else 0
    missing = [g for g in gpus if g >= available]
    if missing:
        raise ApplyError(f"the plan places blocks on GPU {', '.join(map(str, missing))} but this host has "
                         f"{available} CUDA device(s); plan against this host (no --devices), or apply on "
                         "the host the plan was made for")


def _check_loading_info(info: dict[str, Any], source: Path) -> None:
    missing = sorted(info.get("missing_keys") or [])
    mismatched = info.get("mismatched_keys") or []
    if missing:
        raise ApplyError(f"{source}: {len(missing)} weight(s) the model needs are not in the checkpoint "
                         f"(first: {missing[0]!r}); the checkpoint does not match its config.json")
    if mismatched:
        first = mismatched[0]
        raise ApplyError(f"{source}: {len(mismatched)} weight(s) have the wrong shape (first: {first})")


def check_shapes(checkpoint_dir: Path, *, task: str, trust_remote_code: bool = False,
                 allow_pickle: bool = False, quantization: str = "none", dtype: str = "float32") -> list[str]:
    """Every checkpoint tensor the model has must have the shape its config.json implies (quantized
    linear weights: the shapes of their stored form). Returns the quantized linear modules.

    transformers reports a mismatch only as "ignore_mismatched_sizes is False" after logging the
    details; deploykit names the tensors and both shapes, before anything is loaded.
    """
    from ..model.checkpoint import open_checkpoint
    from ..model.quantization import quantized_tensors
    from ..model.structure import build_meta_model, load_config, quantized_linears

    model = build_meta_model(load_config(checkpoint_dir, trust_remote_code=trust_remote_code),
                             task=task, trust_remote_code=trust_remote_code)
    expected = {n: tuple(t.shape) for n, t in model.state_dict().items()}
    linears = quantized_linears(model, quantization)
    for module, shape in linears.items():
        expected.update({name: dims for name, _, dims in
                         quantized_tensors(f"{module}.weight", shape, quantization, dtype)})
    prefix = getattr(model, "base_model_prefix", "")
    wrong = []
    for t in open_checkpoint(checkpoint_dir, allow_pickle=allow_pickle).tensors:
        name = t.name if t.name in expected else t.name.removeprefix(f"{prefix}.")
        if name in expected and expected[name] != t.shape:
            wrong.append(f"{t.name} is {list(t.shape)} in the checkpoint, {list(expected[name])} expected")
    if wrong:
        what = f"quantization {quantization}" if linears else "config.json"
        raise ApplyError(f"{checkpoint_dir}: {len(wrong)} weight(s) do not match {what}: "
                         + "; ".join(wrong[:3]) + ("; ..." if len(wrong) > 3 else ""))
    return sorted(linears)


_MADV_WILLNEED, _MADV_POPULATE_READ = 3, 22


def _prefetch(model: Any, modules: list[str]) -> None:
    """Bring the weights of ``modules`` into memory now (the CPU tier), without copying them.

    transformers maps safetensors weights on CPU; the pages are read on first use. For the CPU tier
    deploykit faults them in at load time (``madvise(MADV_POPULATE_READ)``, or ``MADV_WILLNEED`` on
    kernels before 5.14), so the first request does not wait on the disk. The disk tier's pages are
    left to be read on demand.
    """
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    page = mmap.PAGESIZE
    seen: set[int] = set()
    for name in modules:
        for t in [*model.get_submodule(name).parameters(), *model.get_submodule(name).buffers()]:
            if t.device.type != "cpu" or id(t) in seen or t.numel() == 0:
                continue
            seen.add(id(t))
            start = t.data_ptr() // page * page
            length = t.data_ptr() + t.numel() * t.element_size() - start
            if libc.madvise(start, length, _MADV_POPULATE_READ) != 0:
                libc.madvise(start, length, _MADV_WILLNEED)


class _Checked:
    """A transformers progress bar whose every step first calls ``interrupted`` (which raises to stop)."""

    def __init__(self, bar: Any, interrupted: Callable[[], None]) -> None:
        self._bar, self._interrupted = bar, interrupted

    def __iter__(self) -> Iterator[Any]:
        for item in self._bar:
            self._interrupted()
            yield item

    def update(self, *args: Any, **kwargs: Any) -> Any:
        self._interrupted()
        return self._bar.update(*args, **kwargs)

    def __enter__(self) -> _Checked:
        self._bar.__enter__()
        return self

    def __exit__(self, *exc: Any) -> Any:
        return self._bar.__exit__(*exc)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._bar, name)


@contextmanager
def interruptible(interrupted: Callable[[], None] | None) -> Iterator[None]:
    """While inside, transformers' weight loading on this thread calls ``interrupted`` before each tensor, so
    an abort (a rollback, SIGTERM) ends a ``from_pretrained`` in progress within one tensor's time instead of
    at its end. Through transformers' own progress-bar hook (``utils.logging.set_tqdm_hook``: the one
    per-tensor callback ``from_pretrained`` offers), chained to any hook already set; other threads' bars
    pass through untouched. Callers hold ``BUILD_LOCK`` (one ``from_pretrained`` at a time)."""
    if interrupted is None:
        yield
        return
    from transformers.utils import logging as hf_logging

    me = threading.get_ident()
    check: Callable[[], None] = interrupted

    def hook(factory: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        bar = previous(factory, args, kwargs) if previous is not None else factory(*args, **kwargs)
        return _Checked(bar, check) if threading.get_ident() == me else bar

    previous = hf_logging.set_tqdm_hook(hook)
    try:
        yield
    finally:
        hf_logging.set_tqdm_hook(previous)


def load(plan: Plan, checkpoint_dir: Path, options: LoadOptions,
         interrupted: Callable[[], None] | None = None) -> LoadedModel:
    """Load the checkpoint at ``checkpoint_dir`` placed as ``plan`` says. ``model.hf_device_map`` is
    the plan's placement on every path (transformers sets it for GPU plans; the CPU path sets it
    here, with the plan's tiers: "cpu" or "disk"). ``interrupted`` (raising to stop) is called between
    the weights loaded (``interruptible``) and before the CPU tier is faulted in."""
    import torch

    task, dtype, offload_dir = options.task, options.dtype, options.offload_dir
    trust_remote_code, show_progress = options.trust_remote_code, options.show_progress
    check_fits_host(plan)
    torch_dtype = getattr(torch, dtype)  # the manifest's dtype names are torch's
    gpus = gpus_of(plan)
    kwargs: dict[str, Any] = {"dtype": torch_dtype, "trust_remote_code": trust_remote_code,
                              "output_loading_info": True}
    if gpus:
        kwargs["device_map"] = plan.device_map
        if "disk" in plan.device_map.values():
            if offload_dir is None:
                raise ApplyError("the plan uses the disk tier but offload.disk.path is not set")
            offload_dir.mkdir(parents=True, exist_ok=True)
            kwargs["offload_folder"] = str(offload_dir)
    else:
        kwargs["device_map"] = "cpu"
    quantized = check_shapes(checkpoint_dir, task=task, trust_remote_code=trust_remote_code,
                             allow_pickle=options.allow_pickle, quantization=plan.quantization, dtype=dtype)
    if plan.is_quantized:
        from .quantized import quantization_config

        kwargs["quantization_config"] = quantization_config(plan.quantization, quantized, dtype)
    try:
        with BUILD_LOCK, quiet_transformers(progress=show_progress), interruptible(interrupted):
            model, info = auto_class(task).from_pretrained(str(checkpoint_dir), **kwargs)  # model.hf.BUILD_LOCK
    except (OSError, ValueError, RuntimeError, KeyError) as exc:
        raise ApplyError(f"loading {checkpoint_dir} failed: {str(exc).strip().splitlines()[0]}") from None
    _check_loading_info(info, checkpoint_dir)
    model.eval()
    if plan.is_quantized:
        from .quantized import quantize_head

        quantize_head(model, task, plan.quantization)
    if interrupted is not None:
        interrupted()
    if not gpus:
        _prefetch(model, [m for m, d in plan.device_map.items() if d == "cpu"])
        model.hf_device_map = dict(plan.device_map)
    embeddings = next(n for n, m in model.named_modules() if m is model.get_input_embeddings())
    key = placement_key(embeddings, plan.device_map)
    device = plan.device_map[key] if key is not None else "cpu"
    serialize = bool(gpus) and any(d in ("cpu", "disk") for d in plan.device_map.values())
    return LoadedModel(model, plan, checkpoint_dir,
                       f"cuda:{device}" if isinstance(device, int) else "cpu", serialize,
                       _tokenizer(checkpoint_dir))


def _tokenizer(directory: Path) -> Any | None:
    if not any((directory / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "vocab.txt",
                                                   "tokenizer.model")):
        return None
    from transformers import AutoTokenizer

    try:
        with quiet_transformers():
            return AutoTokenizer.from_pretrained(str(directory))
    except (OSError, ValueError) as exc:
        log.warning("tokenizer in %s not usable: %s", directory, exc)
        return None
