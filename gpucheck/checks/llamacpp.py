"""The llama.cpp engine on the GPU (``--n-gpu-layers`` / ``--tensor-split`` from the plan): not run. The GPU
machine has no ``llama-server`` built for CUDA, and building llama.cpp's sources there (``-DGGML_CUDA=ON``)
takes longer than the whole run may."""

from __future__ import annotations

from ..context import Context
from ..record import Recorder


def run(ctx: Context, rec: Recorder) -> None:
    rec.skip("llama-server with the plan's --n-gpu-layers / --tensor-split",
             "no CUDA build of llama-server on the GPU machine (building one takes longer than the run)")
