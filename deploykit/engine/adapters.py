"""The LoRA adapters loaded into one generation's model, and each batch row's adapter.

peft's LoRA layers wrap the model's linear layers in place (one ``LoraModel`` over the engine's own model
object, so every caller of ``model(...)`` keeps working); each adapter is a pair of small matrices per
adapted layer. The layers' active adapter is peft's ``"__base__"`` (no adapter), so a forward that names
none (health check, grammar, scoring) computes the base model. A batch whose rows use adapters runs inside
``rows(names)``: peft's per-row ``adapter_names`` (``LoraModel._enable_peft_forward_hooks``, the mixed-batch
path of ``LoraLayer._mixed_batch_forward``) adds each row's own adapter, so rows of one batch may use
different adapters, and the base's rows compute exactly what they compute without adapters.

Why peft rather than deploykit's own LoRA matmuls: it owns the layer wrapping for every architecture
transformers has, the checkpoint format, the scaling (``lora_alpha / r``, rsLoRA) and the per-row path;
deploykit only decides when adapters come and go.

Adding or removing an adapter changes the model's modules, so it happens between forwards: every forward
of the engine holds ``rows``'s lock, and ``load`` / ``remove`` take it. A removed adapter stops taking new
requests at once (``hold`` refuses it) and is deleted once its requests ended, so none of them is served by
the base instead. This module must never know about manifests.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BASE = "__base__"  # peft's per-row name of "no adapter"


@dataclass(frozen=True)
class AdapterSource:
    """One adapter to load: its served name, its PEFT directory and its scale (``spec.adapters``)."""

    name: str
    path: str
    scale: float = 1.0


class UnknownAdapter(LookupError):
    """The adapter is not loaded (never was, or is being removed)."""


class Adapters:
    """The adapters of one model. Every method is safe from any thread."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self._lock = threading.RLock()  # held by each forward, and while modules change
        self._changed = threading.Condition()  # holds, releases and the set of adapters
        self._lora: Any = None  # peft's LoraModel over ``model``, from the first adapter on
        self._sources: dict[str, AdapterSource] = {}
        self._held: dict[str, int] = {}  # requests running or queued per adapter
        self._going: set[str] = set()  # being removed: no new requests

    def names(self) -> list[str]:
        """The adapters that take requests, in the order they were loaded."""
        with self._changed:
            return [n for n in self._sources if n not in self._going]

    def sources(self) -> list[AdapterSource]:
        with self._changed:
            return [s for n, s in self._sources.items() if n not in self._going]

    def hold(self, name: str) -> None:
        """Count a request on ``name`` until ``release``; UnknownAdapter when it takes none."""
        with self._changed:
            if name not in self._sources or name in self._going:
                raise UnknownAdapter(name)
            self._held[name] = self._held.get(name, 0) + 1

    def release(self, name: str) -> None:
        with self._changed:
            self._held[name] = self._held.get(name, 1) - 1
            self._changed.notify_all()

    def load(self, source: AdapterSource) -> None:
        """Read ``source`` and add it to the model (its matrices at the base's dtype, on the devices of
        the layers they adapt). The files are read before the forwards are paused."""
        from peft import LoraConfig
        from safetensors.torch import load_file

        directory = Path(source.path)
        config = LoraConfig.from_pretrained(str(directory))
        config.inference_mode = True
        weights = load_file(str(directory / "adapter_model.safetensors"))
        with self._lock:
            self._inject(source.name, config, weights)
            self._scale(source.name, source.scale)
            self._activate_base()
        with self._changed:
            self._sources[source.name] = source
            self._going.discard(source.name)
            self._changed.notify_all()

    def remove(self, name: str, *, timeout: float | None = None) -> bool:
        """Stop taking requests for ``name``, wait for its requests to end (up to ``timeout``), then delete
        its matrices. False when its requests did not end in time: it is kept, and takes requests again."""
        with self._changed:
            if name not in self._sources:
                return True
            self._going.add(name)
            if not self._changed.wait_for(lambda: not self._held.get(name), timeout):
                self._going.discard(name)  # kept: it takes requests again
                return False
            del self._sources[name]
            self._held.pop(name, None)
        with self._lock:
            self._lora.delete_adapter(name)
            if not self._sources:  # the last one: the plain linear layers come back
                self._lora.unload()
                self._lora = None
            else:
                self._activate_base()
        return True

    @contextmanager
    def rows(self, names: Sequence[str | None]) -> Iterator[None]:
        """One forward of a batch whose row i uses adapter ``names[i]`` (None: the base)."""
        with self._lock:
            if self._lora is None or all(n is None for n in names):
                yield
                return
            per_row = [n or BASE for n in names]
            with self._lora._enable_peft_forward_hooks(adapter_names=per_row):
                yield

    def _inject(self, name: str, config: Any, weights: dict[str, Any]) -> None:
        from peft import LoraModel, set_peft_model_state_dict

        if self._lora is None:
            self._lora = LoraModel(self.model, config, name)
        else:
            self._lora.peft_config[name] = config
            self._lora.inject_adapter(self.model, name, autocast_adapter_dtype=False)
        result: Any = set_peft_model_state_dict(self.model, weights, adapter_name=name)
        missing = [k for k in result.unexpected_keys if "lora_" in k]
        if missing:
            raise ValueError(f"adapter {name!r}: {len(missing)} tensors fit no layer of the model ({missing[0]})")
        self._lora.eval()  # peft refuses per-row adapters in training mode

    def _scale(self, name: str, scale: float) -> None:
        from peft.tuners.lora import LoraLayer

        if scale != 1.0:
            for module in self.model.modules():
                if isinstance(module, LoraLayer):
                    module.set_scale(name, scale)

    def _activate_base(self) -> None:
        """The layers' active adapter is none (peft's "__base__"), so forwards outside ``rows`` are the base's."""
        from peft.tuners.tuners_utils import BaseTunerLayer

        for module in self.model.modules():
            if isinstance(module, BaseTunerLayer):
                module.set_adapter(BASE, inference_mode=True)
