"""GPU memory as the checks read it: the device's used memory from ``nvidia-smi`` (every process, CUDA
contexts included: what a server process holds is seen from outside it), sampled in a thread for peaks,
and this process's own view through torch's allocator."""

from __future__ import annotations

import shutil
import subprocess
import threading
from typing import Any

MIB = 1 << 20


def device_used_mib(index: int = 0) -> int | None:
    """Used memory of GPU ``index`` in MiB (``nvidia-smi``), None where it cannot be read."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits",
                              "-i", str(index)], capture_output=True, text=True, timeout=20)
        return int(out.stdout.strip().splitlines()[0])
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        return None


def describe_gpus() -> str:
    """``nvidia-smi``'s one line per GPU (name, memory, driver), or why there is none."""
    if shutil.which("nvidia-smi") is None:
        return "nvidia-smi not found"
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,memory.used,driver_version",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
        return out.stdout.strip() or out.stderr.strip()
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"nvidia-smi failed: {exc}"


class UsedSampler:
    """Samples ``device_used_mib`` every ``interval`` s in a thread; ``peak`` since the last ``reset``."""

    def __init__(self, interval: float = 0.5, index: int = 0) -> None:
        self.interval, self.index = interval, index
        self.peak: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gpu-used-sampler", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval)

    def sample(self) -> None:
        used = device_used_mib(self.index)
        if used is not None:
            self.peak = used if self.peak is None else max(self.peak, used)

    def reset(self) -> None:
        self.peak = None
        self.sample()

    def __enter__(self) -> UsedSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def torch_memory(device: int = 0) -> dict[str, Any]:
    """This process's allocator on GPU ``device``: allocated, reserved and peak allocated bytes."""
    import torch

    torch.cuda.synchronize(device)
    return {"allocated": torch.cuda.memory_allocated(device), "reserved": torch.cuda.memory_reserved(device),
            "peak_allocated": torch.cuda.max_memory_allocated(device)}


def mib(n: float | None) -> str:
    return "n/a" if n is None else f"{n / MIB:.1f} MiB"
