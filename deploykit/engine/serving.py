"""What serving a generation needs, apart from the manifest: the frozen ``ServingSpec`` the control layer
builds from a manifest and hands down (engines, pipeline stages and Ray Serve replicas never see the
manifest itself), and the ``TextEngine`` protocol every text engine implements (in process, pipeline
stages, replicas), so the API and the control layer meet one interface whatever runs the model.

It must never import torch: replicas and the control layer build and pickle these without a model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from ..names import Task
from .adapters import AdapterSource
from .loader import LoadOptions
from .types import Limits, Speculation

if TYPE_CHECKING:
    from .requests import GenerationRequest, GenerationResult, RequestHandle


@dataclass(frozen=True)
class ServingSpec:
    """One deployment's serving options, as the manifest gave them (``spec.model``, ``spec.serving``,
    ``spec.rollout.health_check``)."""

    name: str
    load: LoadOptions
    limits: Limits
    health_input: str = "Hello"
    health_timeout: float = 60.0
    adapters: tuple[AdapterSource, ...] = ()  # spec.adapters, paths resolved
    speculative: Speculation | None = None  # spec.speculative (the padded loop's drafts: ngram, or a draft model)

    @property
    def task(self) -> Task:
        return Task(self.load.task)


@runtime_checkable
class TextEngine(Protocol):
    """Requests in, token ids out: ``submit`` queues (``QueueFull`` past ``max_queued``) and returns a
    handle that yields ids and ends with a result; ``listener`` gets each id, then the result."""

    eos_ids: set[int]

    def submit(self, request: GenerationRequest,
               listener: Callable[[int | GenerationResult], None] | None = None) -> RequestHandle: ...

    def cancel(self, handle: RequestHandle) -> None: ...

    def stats(self) -> dict[str, int]: ...

    def close(self, timeout: float | None = None) -> None: ...
