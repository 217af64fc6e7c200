"""Where the engine puts the tensors it makes: never on torch's default device (the CPU unless something
changed it), always on the device of the tensor they meet. Inputs (ids, positions, attention masks) go
where the model reads them, its input embedding; what sampling makes goes to its logits' device
(``sampling.py``); the KV cache's tensors are made ``like`` each layer's own (``kvcache.py``), so each
layer's cache stays on that layer's device.
"""

from __future__ import annotations

from typing import Any

import torch


def input_device(model: Any) -> torch.device:
    """The device of ``model``'s input embedding weight; the CPU when accelerate offloaded it (its weight
    is then on "meta" and accelerate's hook moves the inputs to where the weight is brought)."""
    weight = model.get_input_embeddings().weight
    return torch.device("cpu") if weight.device.type == "meta" else weight.device
