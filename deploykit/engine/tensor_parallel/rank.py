"""One tensor-parallel rank: a process that joins the ranks' gloo (CPU) or NCCL (GPU) group, builds the
model on the meta device with transformers' tensor-parallel plan applied (every split weight a ``DTensor``
placeholder), fills it from its *own* rank file only, and then runs forwards in lockstep with the other
ranks on the driver's orders.

Why not ``from_pretrained(tp_plan="auto")``: it maps the whole checkpoint in every rank (1153-1236 MiB
per rank for a 1044 MiB model, measured) and needs ``torchrun``'s environment; here each rank reads its
slices only, and deploykit starts the ranks itself. The splitting itself (which weights, which forward
hooks, the collectives) stays transformers' own: ``apply_tensor_parallelism`` with the model's plan.

Protocol (a ``multiprocessing`` pipe to the driver, one message at a time):
``("step", group, ids, mask, positions)`` -> ``("ok", logits | None)`` (rank 0 sends the float32 logits
of the last position, the others None); ``("release", group)`` -> ``("ok", None)``; ``("info",)`` ->
``("ok", dict)``; ``("close",)`` ends the process. Any failure answers ``("error", text)``.
The rank exits when its driver's end of the pipe closes (the driver died), so no rank outlives it.
"""

from __future__ import annotations

import os
import resource
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Tests: a file whose text, read when a rank starts, is "exit-on-step:R" makes rank R exit at its first
# step (a rank dying during a generation's health check).
FAILPOINT_ENV = "DEPLOYKIT_TP_FAILPOINT"


@dataclass(frozen=True)
class RankSpec:
    rank: int
    ranks: int
    port: int  # the rendezvous port on 127.0.0.1 (rank 0 listens)
    shards: str  # directory holding rank-R-of-N.safetensors and config.json
    dtype: str = "float32"
    threads: int = 1
    device: str = "cpu"  # "cpu", or "cuda" (rank R on GPU gpus[R]; unverified without GPUs)
    gpu: int | None = None
    trust_remote_code: bool = False
    timeout: float = 600.0


def peak_rss() -> int:
    """This process's peak resident memory in bytes: ``VmHWM``, which starts afresh at ``exec``
    (``getrusage``'s ``ru_maxrss`` keeps the high-water mark of the process that spawned this one)."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _watch_parent(parent: int) -> None:
    while True:  # the pipe's EOF ends a waiting rank; this ends one stuck in a collective
        if os.getppid() != parent:
            os._exit(3)
        time.sleep(1.0)


def main(spec: RankSpec, conn: Any, parent: int) -> None:
    """The rank process (spawned by ``group.RankGroup``)."""
    threading.Thread(target=_watch_parent, args=(parent,), daemon=True, name="deploykit-rank-parent").start()
    try:
        rank = RankModel(spec)
    except BaseException as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ok", rank.info()))
    failpoint = _failpoint()
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            os._exit(0)
        if message[0] == "close":
            break
        if message[0] == "step" and failpoint == f"exit-on-step:{spec.rank}":
            os._exit(17)
        try:
            conn.send(("ok", rank.handle(message)))
        except Exception as exc:
            conn.send(("error", f"{type(exc).__name__}: {exc}"))
    rank.close()


def _failpoint() -> str:
    path = os.environ.get(FAILPOINT_ENV)
    try:
        return Path(path).read_text().strip() if path else ""
    except OSError:
        return ""


class RankModel:
    """This rank's share of the model and its per-request-group KV caches."""

    def __init__(self, spec: RankSpec) -> None:
        import torch

        torch.set_num_threads(max(1, spec.threads))
        self.spec = spec
        self.caches: dict[str, Any] = {}
        self.device = "cpu" if spec.device == "cpu" else f"cuda:{spec.gpu or 0}"
        self.mesh = self._join()
        self.model, self.config = self._build()
        self.files_read = [str(self._file())]

    def _file(self) -> Path:
        from ...artifacts.rank_shards import rank_file

        return Path(self.spec.shards) / rank_file(self.spec.rank, self.spec.ranks)

    def _join(self) -> Any:
        from datetime import timedelta

        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        spec = self.spec
        backend = "nccl" if spec.device == "cuda" else "gloo"
        # the ranks share one host: gloo over loopback, whatever the host name resolves to
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        if spec.device == "cuda":
            import torch

            torch.cuda.set_device(self.device)
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{spec.port}", rank=spec.rank,
                                world_size=spec.ranks, timeout=timedelta(seconds=spec.timeout))
        return init_device_mesh(spec.device, (spec.ranks,), mesh_dim_names=("tp",))

    def _build(self) -> tuple[Any, Any]:
        import torch
        from safetensors.torch import load_file
        from transformers import AutoConfig, AutoModelForCausalLM
        from transformers.distributed.tensor_parallel import apply_tensor_parallelism

        from ...model.tensor_parallel import resolved_plan

        spec = self.spec
        config = AutoConfig.from_pretrained(spec.shards, trust_remote_code=spec.trust_remote_code)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, spec.dtype),
                                                     trust_remote_code=spec.trust_remote_code)
        apply_tensor_parallelism(model, self.mesh, resolved_plan(model))
        state = load_file(str(self._file()), device=self.device)
        self._fill(model, state)
        self._rebuild_meta_buffers(model, config)
        model.eval()
        return model, config

    def _fill(self, model: Any, state: dict[str, Any]) -> None:
        """Each parameter from this rank's file: a split one as the local shard of its DTensor."""
        import torch
        from torch.distributed.tensor import DTensor

        missing = []
        for mname, module in model.named_modules():
            for pname, p in list(module._parameters.items()):
                if p is None:
                    continue
                name = f"{mname}.{pname}" if mname else pname
                local = state.get(name)
                if local is None:
                    missing.append(name)
                    continue
                if isinstance(p, DTensor):
                    local = DTensor.from_local(local, self.mesh, p.placements, run_check=False, shape=p.shape,
                                               stride=p.stride())
                module._parameters[pname] = torch.nn.Parameter(local, requires_grad=False)
            for bname in list(module._buffers):
                name = f"{mname}.{bname}" if mname else bname
                if name in state:
                    module._buffers[bname] = state[name]
        if missing:
            raise KeyError(f"{self._file()}: {len(missing)} weight(s) missing (first: {missing[0]!r}); lay the "
                           "rank shards out again")

    def _rebuild_meta_buffers(self, model: Any, config: Any) -> None:
        """Buffers that are not weights (rotary ``inv_freq``) are rebuilt off the meta device."""
        for mname, module in list(model.named_modules()):
            if any(b is not None and b.is_meta for b in module._buffers.values()):
                if not hasattr(module, "rope_type") and "Rotary" not in type(module).__name__:
                    raise ValueError(f"{mname}: a buffer deploykit cannot rebuild ({type(module).__name__})")
                fresh = type(module)(config=getattr(module, "config", config))
                parent_name, _, child = mname.rpartition(".")
                setattr(model.get_submodule(parent_name) if parent_name else model, child, fresh)

    def handle(self, message: tuple[Any, ...]) -> Any:
        if message[0] == "step":
            return self.step(*message[1:])
        if message[0] == "release":
            return self.caches.pop(message[1], None) is not None
        if message[0] == "info":
            return self.info()
        raise ValueError(f"unknown message {message[0]!r}")

    def step(self, group: str, ids: Any, mask: Any, positions: Any) -> Any:
        import torch
        from transformers import DynamicCache

        from ..kvcache import with_cache

        try:
            with torch.inference_mode():
                cache = self.caches.get(group)
                if cache is None:
                    cache = self.caches[group] = DynamicCache(config=self.config)
                ids, mask, positions = (t.to(self.device) for t in (ids, mask, positions))
                out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                                 logits_to_keep=1, **with_cache(self.model, cache))
                return out.logits[:, -1].float().cpu() if self.spec.rank == 0 else None
        except Exception:
            self.caches.pop(group, None)
            raise

    def info(self) -> dict[str, Any]:
        import torch

        return {"rank": self.spec.rank, "pid": os.getpid(), "peak_rss": peak_rss(), "files_read": self.files_read,
                "open_groups": sorted(self.caches), "threads": torch.get_num_threads()}

    def close(self) -> None:
        import torch.distributed as dist

        self.caches.clear()
        if dist.is_initialized():
            dist.destroy_process_group()
