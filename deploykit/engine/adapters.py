"""The LoRA adapters loaded into one generation's model, and each batch row's adapter.

peft's LoRA layers wrap the model's linear layers in place (one ``LoraModel`` over the engine's own model
object, so every caller of ``model(...)`` keeps working); each adapter is a pair of small matrices per
adapted layer. The layers' active adapter is peft's ``"__base__"`` (no adapter), so a forward that names
none (health check, grammar, scoring) computes the base model. A batch whose rows use adapters runs inside
``rows(slots)``: peft's per-row ``adapter_names`` (``LoraModel._enable_peft_forward_hooks``, the mixed-batch
path of ``LoraLayer._mixed_batch_forward``) adds each row's own adapter, so rows of one batch may use
different adapters, and the base's rows compute exactly what they compute without adapters.

Why peft rather than deploykit's own LoRA matmuls: it owns the layer wrapping for every architecture
transformers has, the checkpoint format, the scaling (``lora_alpha / r``, rsLoRA) and the per-row path;
deploykit only decides when adapters come and go.

Swap, never mutate: each load of an adapter goes into a peft adapter of its own (a *slot*, ``pirate~3``),
beside whatever serves. ``stage`` loads one and checks it is whole; a load that fails anywhere deletes what
it added (and gives back the plain linear layers when nothing else is loaded), so the base and the other
adapters compute bit for bit what they computed before. ``commit`` then switches names to their new slots
and retires removed ones in one step. A request holds the slot its name had when it was taken (``hold``
returns it; the engine computes the request's rows with it), so a request in flight finishes with the
version it started with, never with the base or a newer version; a retired slot is deleted once its last
request ended (at the next forward or change after that). Nothing here waits for requests except
``remove``'s bounded, interruptible wait for the deletion.

Adding or removing slots changes the model's modules, so it happens between forwards: every forward of the
engine holds ``rows``'s lock, and ``stage`` / deletions take it. This module must never know about
manifests.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ..spec.adapters import BASE, SAFE_INITS, WEIGHTS_FILE, AdapterFileError, adapter_fingerprint
_PREFIX = "base_model.model."  # of every tensor name in a PEFT adapter file


@dataclass(frozen=True)
class AdapterSource:
    """One adapter to load: its served name, its PEFT directory and its scale (``spec.adapters``), and the
    fingerprint of its files (``spec.adapters.adapter_fingerprint``): given, a load refuses files that no
    longer have it; set by the load to what it read."""

    name: str
    path: str
    scale: float = 1.0
    fingerprint: str = ""


@dataclass(frozen=True)
class Staged:
    """An adapter loaded into a slot of its own, taking no requests until ``Adapters.commit``."""

    source: AdapterSource
    slot: str


class UnknownAdapter(LookupError):
    """The adapter is not loaded (never was, or was removed)."""


class AdapterLoadError(ValueError):
    """The adapter's files could not be loaded into the model; nothing of it is left in the model."""


class Adapters:
    """The adapters of one model. Every method is safe from any thread."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self._lock = threading.RLock()  # held by each forward, and while modules change
        self._changed = threading.Condition()  # holds, releases, and which slot serves which name
        self._lora: Any = None  # peft's LoraModel over ``model``, while any slot is loaded
        self._sources: dict[str, AdapterSource] = {}  # served name -> what it serves
        self._serving: dict[str, str] = {}  # served name -> its slot
        self._held: dict[str, int] = {}  # slot -> requests running or queued on it
        self._slots: set[str] = set()  # every slot in the model: serving, staged or retired
        self._retired: set[str] = set()  # take no request; deleted once their requests ended
        self._serial = itertools.count(1)

    def names(self) -> list[str]:
        """The adapters that take requests, in the order they were first loaded."""
        with self._changed:
            return list(self._sources)

    def sources(self) -> list[AdapterSource]:
        with self._changed:
            return list(self._sources.values())

    def slots(self) -> set[str]:
        """The peft adapters in the model now (serving, staged, or retired and still running requests)."""
        with self._changed:
            return set(self._slots)

    def hold(self, name: str) -> str:
        """Count a request on ``name``'s current version until ``release``: its slot, which the request's
        rows compute with. UnknownAdapter when ``name`` takes no requests."""
        with self._changed:
            slot = self._serving.get(name)
            if slot is None:
                raise UnknownAdapter(name)
            self._held[slot] = self._held.get(slot, 0) + 1
            return slot

    def release(self, slot: str) -> None:
        with self._changed:
            self._held[slot] = self._held.get(slot, 1) - 1
            self._changed.notify_all()

    # ---- loading: stage beside what serves, then commit --------------------------------------------

    def load(self, source: AdapterSource) -> None:
        """``stage`` and ``commit`` one adapter: it serves ``source.name`` from now on (a previous version
        finishes the requests it holds)."""
        self.commit(serve=[self.stage(source)])

    def stage(self, source: AdapterSource) -> Staged:
        """Read ``source`` and add it to the model in a slot of its own, taking no requests yet (its
        matrices at the base's dtype, on the devices of the layers they adapt). The files are read before
        the forwards are paused. AdapterLoadError (or the file's own error) when it cannot be loaded whole:
        then nothing of it is left in the model."""
        config, weights, fingerprint = _read(source)
        slot = f"{source.name.replace('.', '_')}~{next(self._serial)}"  # peft's names may hold no '.'
        with self._lock:
            with self._changed:
                self._slots.add(slot)
            try:
                self._inject(slot, config, weights)
                self._scale(slot, source.scale)
            except BaseException:
                self._delete(slot)
                raise
            finally:
                self._activate_base()
        return Staged(replace(source, fingerprint=fingerprint), slot)

    def discard(self, staged: Staged) -> None:
        """Delete a staged adapter that will not serve (it never took a request)."""
        with self._lock:
            self._delete(staged.slot)

    def commit(self, *, serve: Sequence[Staged] = (), remove: Sequence[str] = ()) -> None:
        """In one step: each staged adapter serves its name (the version it replaces is retired), and each
        name in ``remove`` takes no more requests (its slot is retired). A retired slot finishes the requests
        it holds and is deleted once they ended."""
        with self._changed:
            for staged in serve:
                old = self._serving.get(staged.source.name)
                if old is not None:
                    self._retired.add(old)
                self._serving[staged.source.name] = staged.slot
                self._sources[staged.source.name] = staged.source
            for name in remove:
                old = self._serving.pop(name, None)
                self._sources.pop(name, None)
                if old is not None:
                    self._retired.add(old)
            self._changed.notify_all()
        self.collect()

    def remove(self, name: str, *, timeout: float | None = None, stop: threading.Event | None = None) -> bool:
        """``name`` takes no more requests, at once; then wait (up to ``timeout``, or until ``stop`` is set)
        for its requests to end and its matrices to be deleted. True when they are; False when its requests
        still run (it is deleted once they end, and never takes a request again)."""
        with self._changed:
            slot = self._serving.get(name)
        self.commit(remove=[name])
        return slot is None or self.wait_deleted(slot, timeout=timeout, stop=stop)

    def wait_deleted(self, slot: str, *, timeout: float | None = None, stop: threading.Event | None = None) -> bool:
        """Wait until ``slot`` is deleted, at most ``timeout`` seconds and no longer than ``stop`` stays unset
        (looked at every ``STOP_POLL`` seconds: an Event cannot wake a Condition)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            self.collect()
            with self._changed:
                if slot not in self._slots:
                    return True
                left = None if deadline is None else deadline - time.monotonic()
                if (left is not None and left <= 0) or (stop is not None and stop.is_set()):
                    return False
                wait = STOP_POLL if stop is not None else left
                self._changed.wait_for(lambda: not self._held.get(slot),
                                       wait if left is None or wait is None else min(wait, left))

    def collect(self, keep: Sequence[str | None] = ()) -> None:
        """Delete the retired slots whose requests ended (but those in ``keep``: rows about to compute with
        them, a request cancelled while its row is still in the batch)."""
        with self._changed:
            done = [s for s in self._retired if not self._held.get(s) and s not in keep]
        if not done:
            return
        with self._lock:
            for slot in done:
                self._delete(slot)
            self._activate_base()

    # ---- forwards -----------------------------------------------------------------------------------

    @contextmanager
    def rows(self, slots: Sequence[str | None]) -> Iterator[None]:
        """One forward of a batch whose row i uses the adapter slot ``slots[i]`` (``hold``'s; None: the
        base). Retired slots whose requests ended are deleted first."""
        with self._lock:
            if self._retired:
                self.collect(keep=slots)
            if self._lora is None or all(n is None for n in slots):
                yield
                return
            per_row = [n or BASE for n in slots]
            with self._lora._enable_peft_forward_hooks(adapter_names=per_row):
                yield

    @contextmanager
    def packed(self, slots: Sequence[str | None], kept: Sequence[int]) -> Iterator[None]:
        """One forward of one packed sequence (``mixed.py``: the running rows' next tokens, then a prompt's
        chunk) whose token i uses the adapter slot ``slots[i]`` (None: the base); a layer that sees only the
        tokens whose logits are kept (the head, under ``logits_to_keep=kept``) uses theirs. peft's per-row
        path applied per token: each adapted layer takes its ``[1, tokens, ...]`` input as ``[tokens, 1, ...]``
        (one row per token, a view) with ``adapter_names`` per token, and gives its output back as
        ``[1, tokens, ...]``; the base layer's matmul is the same as unpacked."""
        with self._lock:
            if self._retired:
                self.collect(keep=slots)
            if self._lora is None or all(n is None for n in slots):
                yield
                return
            names = [n or BASE for n in slots]
            by_length = {len(names): names, len(kept): [names[i] for i in kept]}
            handles = [hook for module in _per_row_modules(self.model)
                       for hook in (module.register_forward_pre_hook(_tokens_as_rows(by_length), with_kwargs=True),
                                    module.register_forward_hook(_rows_as_tokens))]
            try:
                yield
            finally:
                for hook in handles:
                    hook.remove()

    # ---- the model's modules (under ``_lock``) --------------------------------------------------------

    def _inject(self, slot: str, config: Any, weights: dict[str, Any]) -> None:
        from peft import LoraModel, set_peft_model_state_dict

        if self._lora is None:
            self._lora = _lora_model(self.model, config, slot)
        else:
            self._lora.peft_config[slot] = config
            self._lora.inject_adapter(self.model, slot, autocast_adapter_dtype=False)
        assert isinstance(self._lora, LoraModel)
        result: Any = set_peft_model_state_dict(self.model, weights, adapter_name=slot)
        stray = sorted(k for k in result.unexpected_keys if "lora_" in k)
        if stray:
            raise AdapterLoadError(f"{len(stray)} tensors fit no layer of the model ({stray[0]})")
        bare = sorted(set(_adapted(self.model, slot)) - {_module_of(k) for k in weights})
        if bare:
            raise AdapterLoadError(f"target_modules names {bare[0]!r}"
                                   f"{f' and {len(bare) - 1} more' if len(bare) > 1 else ''}, for which the "
                                   "adapter holds no weights (peft would leave it random)")
        self._lora.eval()  # peft refuses per-row adapters in training mode

    def _scale(self, slot: str, scale: float) -> None:
        from peft.tuners.lora import LoraLayer

        if scale != 1.0:
            for module in self.model.modules():
                if isinstance(module, LoraLayer):
                    module.set_scale(slot, scale)

    def _delete(self, slot: str) -> None:
        """Take ``slot`` out of the model, whole or half-loaded; with it the last, the plain layers return."""
        with self._changed:
            self._slots.discard(slot)
            self._retired.discard(slot)
            self._held.pop(slot, None)
            last = not self._slots
        if self._lora is not None and slot in self._lora.peft_config:
            self._lora.delete_adapter(slot)
        else:  # never registered: drop it from any layer it reached
            _drop_from_layers(self.model, slot)
        if last:
            if self._lora is not None:
                self._lora.unload()
                self._lora = None
            _unwrap(self.model)  # layers a failed first injection wrapped before it had a LoraModel

    def _activate_base(self) -> None:
        """The layers' active adapter is none (peft's "__base__"), so forwards outside ``rows`` are the base's."""
        from peft.tuners.tuners_utils import BaseTunerLayer

        for module in self.model.modules():
            if isinstance(module, BaseTunerLayer):
                module.set_adapter(BASE, inference_mode=True)


STOP_POLL = 0.05  # seconds between looks at a stop Event while waiting for a deletion


def _read(source: AdapterSource) -> tuple[Any, dict[str, Any], str]:
    """The adapter's peft config (refused when its initialisation would touch the base) and tensors, and the
    fingerprint of the files read (AdapterLoadError when it is not ``source.fingerprint``)."""
    from peft import LoraConfig
    from safetensors.torch import load_file

    directory = Path(source.path)
    try:
        fingerprint = adapter_fingerprint(directory)
    except AdapterFileError as exc:
        raise AdapterLoadError(str(exc)) from None
    if source.fingerprint and fingerprint != source.fingerprint:
        raise AdapterLoadError(f"adapter {source.name!r}: the files in {str(directory)!r} changed since the revision "
                               "that serves them was recorded; apply the manifest again to serve them")
    config = LoraConfig.from_pretrained(str(directory))
    init = config.init_lora_weights
    if not any(init is safe or (isinstance(safe, str) and init == safe) for safe in SAFE_INITS):
        raise AdapterLoadError(f"adapter {source.name!r}: init_lora_weights {init!r} rewrites the base model's "
                               "weights when injected; it is not served")
    config.init_lora_weights = False  # the file's tensors replace whatever an init would make
    config.inference_mode = True
    return config, load_file(str(directory / WEIGHTS_FILE)), fingerprint


def _lora_model(model: Any, config: Any, slot: str) -> Any:
    """peft's LoraModel over ``model`` with its first slot, at the base's dtype like every later one (only
    ``PeftModel`` upcasts bfloat16/float16 adapters to float32; LoraModel keeps the base layer's dtype, as
    ``inject_adapter(autocast_adapter_dtype=False)`` does for the later slots)."""
    from peft import LoraModel

    return LoraModel(model, config, slot)


def _per_row_modules(model: Any) -> list[Any]:
    """The modules that peft's per-row path gives ``adapter_names`` to (as ``LoraModel._enable_peft_forward_hooks``)."""
    from peft.tuners.lora import LoraLayer
    from peft.utils.other import AuxiliaryTrainingWrapper

    return [m for m in model.modules() if isinstance(m, (LoraLayer, AuxiliaryTrainingWrapper))]


def _tokens_as_rows(by_length: dict[int, list[str]]) -> Any:
    """A forward pre-hook: a packed ``[1, tokens, ...]`` input as ``[tokens, 1, ...]``, with each token's adapter."""
    def hook(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        x = args[0]
        names = by_length.get(x.shape[1]) if x.dim() >= 2 and x.shape[0] == 1 else None
        if names is None:
            raise ValueError(f"a packed forward's adapted layer got {tuple(x.shape)}, not one row of "
                             f"{' or '.join(map(str, sorted(by_length)))} tokens")
        return (x.transpose(0, 1), *args[1:]), {**kwargs, "adapter_names": names}
    return hook


def _rows_as_tokens(module: Any, args: tuple[Any, ...], output: Any) -> Any:
    """A forward hook: the ``[tokens, 1, ...]`` output back as the packed ``[1, tokens, ...]``."""
    return output.transpose(0, 1)


def _module_of(key: str) -> str:
    """``base_model.model.model.layers.0.q_proj.lora_A.weight`` -> ``model.layers.0.q_proj``."""
    return key.removeprefix(_PREFIX).rsplit(".lora_", 1)[0]


def _adapted(model: Any, slot: str) -> list[str]:
    from peft.tuners.lora import LoraLayer

    return [name for name, m in model.named_modules() if isinstance(m, LoraLayer) and slot in m.lora_A]


def _drop_from_layers(model: Any, slot: str) -> None:
    from peft.tuners.lora import LoraLayer

    for module in model.modules():
        if isinstance(module, LoraLayer) and slot in module.lora_A:
            module.delete_adapter(slot)


def _unwrap(model: Any) -> None:
    """Put each layer peft wrapped back as its plain base layer."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    for name, module in list(model.named_modules()):
        if name and isinstance(module, BaseTunerLayer):
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, module.get_base_layer())
