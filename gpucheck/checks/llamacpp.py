"""The llama.cpp engine on the GPU (``--n-gpu-layers`` / ``--tensor-split`` from the plan): deploykit has no
llama.cpp engine yet, so there is nothing to run."""

from __future__ import annotations

from ..context import Context
from ..record import Recorder


def run(ctx: Context, rec: Recorder) -> None:
    rec.skip("llama-server with the plan's --n-gpu-layers / --tensor-split",
             "deploykit has no llama.cpp engine yet (no spec.engine): nothing to run")
