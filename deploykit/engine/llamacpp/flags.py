"""A plan's placement as llama-server's flags: ``--n-gpu-layers``, ``--tensor-split``, ``--device`` and the
``--override-tensor`` pins, chosen so that llama.cpp's own placement rule gives each GPU the plan's layers.

llama.cpp's rule (``llama_model::load_tensors`` in ``src/llama-model.cpp``, reproduced by ``llamacpp_devices``):
there are ``n_layer + 1`` slots, the decoder layers then the output head; ``--n-gpu-layers`` offloads the
*last* slots (the output head first, then layers from the last backwards); ``--tensor-split`` weights become
cumulative fractions over the offloaded slots, and slot ``i`` goes to the first device whose fraction exceeds
``i / offloaded``; the input embeddings always stay on the CPU. So deploykit asks for the plan's GPU layers
plus the output slot (``gpu_layers = layers on GPUs + 1``) and weighs each GPU by its layer count, the last
GPU's plus one for the output slot: each GPU then holds exactly the plan's number of layers. Which layers
is llama.cpp's choice (the CPU keeps the first ones, not the last): ``placement.llamacpp`` gives a llama.cpp
plan those layers, so its bytes per device are llama.cpp's also when a GGUF's layers differ in size.

Two tensors are pinned where the plan put them (``--override-tensor``), since the rule alone would move
them: the output head and its norm to the CPU when the plan keeps them there (the rule offloads the output
slot first), and the input embeddings to the plan's GPU (the rule keeps them on the CPU). A tied-embedding
GGUF has no ``output.weight``: llama.cpp loads ``token_embd.weight`` a second time as the output tensor,
under that same name, so the embeddings' pin places it too, and llama.cpp, finding it already in that
buffer, makes no copy (unpinned, the copy would land on the last GPU). The head then runs on the
embeddings' GPU, which also holds the logits of a micro-batch (``model.gguf_blocks``: the largest part of
llama.cpp's compute buffers; the layers' scratch is left to ``placement.reserve``). Pure: no process, no
I/O. GPU execution of these flags is unverified on deploykit's CPU-only test machine.
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

_LAYER = re.compile(r"\.(\d+)$")
_OUTPUT_ON_CPU = r"^output(_norm)?\.weight$=CPU"


@dataclass(frozen=True)
class PlacementFlags:
    gpu_layers: int  # --n-gpu-layers: the plan's GPU layers and the output slot
    tensor_split: tuple[int, ...]  # --tensor-split: slots per GPU, in ``devices`` order (the last: + the output)
    devices: tuple[int, ...]  # --device CUDA<i>,...
    cpu_layers: int
    overrides: tuple[str, ...] = ()  # --override-tensor PATTERN=DEVICE

    def as_args(self) -> list[str]:
        args = ["--n-gpu-layers", str(self.gpu_layers)]
        if self.devices:
            args += ["--device", ",".join(f"CUDA{d}" for d in self.devices)]
        if len(self.tensor_split) > 1:
            args += ["--split-mode", "layer", "--tensor-split", ",".join(map(str, self.tensor_split))]
        if self.overrides:
            args += ["--override-tensor", ",".join(self.overrides)]
        return args


def _layer_keys(device_map: dict[str, Any]) -> dict[str, Any]:
    """The decoder layers of a device_map (keys ending in a layer index), with their device."""
    return {k: d for k, d in device_map.items() if _LAYER.search(k)}


def placement_flags(device_map: dict[str, Any]) -> PlacementFlags:
    """llama-server's placement flags for a plan's ``device_map`` (accelerate's convention)."""
    layers = _layer_keys(device_map)
    gpus = sorted({d for d in device_map.values() if isinstance(d, int)},
                  key=lambda g: min(i for i, d in enumerate(device_map.values()) if d == g))
    per_gpu = [sum(1 for d in layers.values() if d == g) for g in gpus]
    on_gpus = sum(per_gpu)
    if not gpus or on_gpus == 0:
        return PlacementFlags(0, (), (), len(layers))
    per_gpu[-1] += 1  # the output slot: llama.cpp offloads it with the layers, on the last device
    overrides = []
    embeddings = device_map.get("token_embd")
    if isinstance(embeddings, int):
        overrides.append(rf"^token_embd\.weight$=CUDA{embeddings}")
    if not isinstance(device_map.get("output"), int):
        overrides.append(_OUTPUT_ON_CPU)
    return PlacementFlags(on_gpus + 1, tuple(per_gpu), tuple(gpus), len(layers) - on_gpus, tuple(overrides))


def llamacpp_devices(n_layer: int, gpu_layers: int, tensor_split: Sequence[float], n_devices: int) -> list[int | None]:
    """llama.cpp's own rule: the device index of each of the ``n_layer + 1`` slots (the decoder layers, then
    the output head), None for the CPU. ``tensor_split`` must name every device's weight (deploykit always
    sends it; without it llama.cpp weighs devices by their free memory)."""
    weights = list(tensor_split) if len(tensor_split) == n_devices else [1.0] * n_devices
    total, cumulative = sum(weights), []
    running = 0.0
    for w in weights:
        running += w
        cumulative.append(running / total)
    start = max(n_layer + 1 - gpu_layers, 0)
    offloaded = min(gpu_layers, n_layer + 1) if n_devices else 0
    slots: list[int | None] = []
    for il in range(n_layer + 1):
        if il < start or il - start >= offloaded:
            slots.append(None)
        else:  # std::upper_bound over the cumulative fractions
            slots.append(min(bisect.bisect_right(cumulative, (il - start) / offloaded), n_devices - 1))
    return slots


# ``spec.speculative`` as llama-server's flags (this build's names: ``--spec-*``; the older ``--draft-max``,
# ``--draft-min`` and ``--spec-ngram-size-n`` are refused by it as removed):
#   method ngram  -> --spec-type ngram-simple --spec-ngram-simple-size-n <ngram_max>
#                    --spec-ngram-simple-size-m <num_tokens>
#                    (the draft: the num_tokens tokens that followed the last earlier occurrence of the last
#                    ngram_max tokens; ngram-simple matches that one length only, so ngram_min must equal it:
#                    ``spec.speculative`` refuses another)
#   method draft  -> --spec-type draft-simple --spec-draft-model <draft.path> --spec-draft-n-max <num_tokens>
#                    --spec-draft-ngl <layers + 1 on a GPU, else 0>
#                    [--spec-draft-device CUDA<i> --spec-draft-override-tensor ^token_embd\.weight$=CUDA<i>]
#                    (the plan's ``draft.device``: the whole draft on that GPU, its layers and output slot by
#                    the same rule as the model's, its input embeddings pinned there as the model's are; or
#                    the whole draft on the CPU)


@dataclass(frozen=True)
class SpeculativeFlags:
    method: str  # "ngram" | "draft"
    num_tokens: int
    ngram: int = 0  # method ngram: the lookup length (ngram_max)
    draft: str | None = None  # method draft: the GGUF file
    draft_gpu: int | None = None  # the GPU holding the whole draft; None: the CPU
    draft_layers: int = 0

    def as_args(self) -> list[str]:
        if self.method == "ngram":
            return ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", str(self.ngram),
                    "--spec-ngram-simple-size-m", str(self.num_tokens)]
        assert self.draft is not None
        args = ["--spec-type", "draft-simple", "--spec-draft-model", self.draft,
                "--spec-draft-n-max", str(self.num_tokens)]
        if self.draft_gpu is None:
            return [*args, "--spec-draft-ngl", "0"]
        return [*args, "--spec-draft-ngl", str(self.draft_layers + 1), "--spec-draft-device", f"CUDA{self.draft_gpu}",
                "--spec-draft-override-tensor", rf"^token_embd\.weight$=CUDA{self.draft_gpu}"]

    def describe(self) -> dict[str, Any]:
        """What status shows: the method, its settings and the flags they became."""
        out: dict[str, Any] = {"method": self.method, "num_tokens": self.num_tokens}
        if self.method == "ngram":
            out["ngram"] = self.ngram
        else:
            out["draft"] = self.draft
            out["draft_device"] = "cpu" if self.draft_gpu is None else f"cuda:{self.draft_gpu}"
        return {**out, "flags": self.as_args()}


def speculative_flags(speculative: Any, draft: Any) -> SpeculativeFlags | None:
    """The flags of a manifest's ``spec.speculative`` (None: no speculation) with the plan's ``draft``
    (``placement.plan.DraftPlan``: where the draft model is held)."""
    if speculative is None:
        return None
    if speculative.method == "ngram":
        return SpeculativeFlags("ngram", speculative.num_tokens, ngram=speculative.ngram_max)
    if draft is None:
        raise ValueError("method draft needs the plan's draft model (plan it again)")
    gpu = draft.device if isinstance(draft.device, int) else None
    return SpeculativeFlags("draft", speculative.num_tokens, draft=draft.path, draft_gpu=gpu,
                            draft_layers=draft.layers)
