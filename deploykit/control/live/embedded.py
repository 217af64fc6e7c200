"""Using a ``Deployment`` from Python in this process: ``acquire`` its model (or ``acquire_loaded``
the whole ``LoadedModel``) for the length of a ``with`` block, or call its runtime directly with
``generate``, ``chat`` and ``embed``. Every call pins the current generation and unpins it when done,
so a reload never pulls a model from under a caller.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from ...errors import ApplyError

if TYPE_CHECKING:
    from ...engine.loader import LoadedModel
    from ...engine.runtime import Completion, Sampling, TextRuntime
    from .pool import Generation


class EmbeddedApi(ABC):
    """The in-process calls of ``Deployment``, over the two it provides: ``pin`` and ``unpin``."""

    name: str

    @abstractmethod
    def pin(self, timeout: float | None = None) -> Generation:
        """The current generation, pinned (loaded first if it is not)."""

    @abstractmethod
    def unpin(self, gen: Generation) -> None:
        """Release what ``pin`` returned."""

    @contextmanager
    def acquire(self, timeout: float | None = None) -> Iterator[Any]:
        """Pin the current generation and yield its model (``torch.nn.Module``)."""
        with self.acquire_loaded(timeout) as loaded:
            yield loaded.model

    @contextmanager
    def acquire_loaded(self, timeout: float | None = None) -> Iterator[LoadedModel]:
        """Like ``acquire`` but yields the LoadedModel (model, tokenizer, input device, plan)."""
        gen = self.pin(timeout)
        try:
            assert gen.loaded is not None  # pinned generations are never freed
            if gen.loaded.model is None:
                raise ApplyError(f"{self.name!r} runs outside this process (pipeline stages on a Ray cluster, "
                                 "tensor-parallel ranks, or a llama-server): there is no model here; use "
                                 "generate/chat or the API")
            if gen.forward_lock is not None:  # accelerate offload hooks: one forward at a time
                with gen.forward_lock:
                    yield gen.loaded
            else:
                yield gen.loaded
        finally:
            self.unpin(gen)

    def generate(self, prompt: str, **sampling: Any) -> Completion:
        """Complete ``prompt`` on the current generation (batched with concurrent calls).
        ``sampling``: max_tokens, temperature (0 = greedy, the default), top_p, seed, stop."""
        from ...engine.text import completion_prompt_ids

        with self._text_runtime() as runtime:  # one pin per call: a canary's split counts each call once
            if (relayed := _relayed(runtime, "/v1/completions", {"prompt": prompt}, sampling)) is not None:
                return relayed
            return runtime.complete(completion_prompt_ids(runtime.tokenizer, prompt), _sampling(sampling))

    def chat(self, messages: list[dict[str, Any]], **sampling: Any) -> Completion:
        """Answer a chat (``[{"role": "user", "content": "..."}]``) through the model's chat template."""
        from ...engine.text import chat_prompt_ids

        with self._text_runtime() as runtime:
            if (relayed := _relayed(runtime, "/v1/chat/completions", {"messages": messages}, sampling)) is not None:
                return relayed
            return runtime.complete(chat_prompt_ids(runtime.tokenizer, messages), _sampling(sampling),
                                    prompt_param="messages")

    def embed(self, texts: list[str]) -> list[list[float]]:
        """Sentence embeddings of a feature-extraction deployment, pooled as its checkpoint says."""
        from ...engine.runtime import EmbeddingRuntime

        gen = self.pin()
        try:
            if not isinstance(gen.runtime, EmbeddingRuntime):
                raise ApplyError(f"{self.name!r} ({gen.task}) does not serve embeddings")
            return gen.runtime.submit(list(texts)).result()[0]
        finally:
            self.unpin(gen)

    @contextmanager
    def _text_runtime(self) -> Iterator[TextRuntime]:
        """The pinned generation's text runtime (a ``TextRuntime``, or a llama.cpp ``LlamaRuntime`` that
        ``_relayed`` answers through), its outcome recorded as a canary's evidence."""
        from ...engine.llamacpp.runtime import LlamaRuntime
        from ...engine.runtime import TextRuntime
        from ...engine.text import RequestError

        gen = self.pin()
        try:
            if not isinstance(gen.runtime, (TextRuntime, LlamaRuntime)):
                raise ApplyError(f"{self.name!r} ({gen.task}) does not generate text")
            try:
                yield gen.runtime
            except (RequestError, ApplyError):  # the caller's request, not the generation, is to blame
                raise
            except Exception:
                gen.traffic.record(ttft=None, failed=True)  # a canary's evidence, as the API's requests are
                raise
            gen.traffic.record(ttft=None, failed=False)
        finally:
            self.unpin(gen)


def _relayed(runtime: Any, path: str, body: dict[str, Any], sampling: dict[str, Any]) -> Completion | None:
    """A llama.cpp generation's answer (its llama-server computes it); None for any other engine."""
    from ...engine.llamacpp.runtime import LlamaRuntime
    from ...engine.llamacpp.sampling import sampling_fields
    from ...engine.runtime import Completion
    from ...engine.text import RequestError

    if not isinstance(runtime, LlamaRuntime):
        return None
    options, limits = _sampling(dict(sampling)), runtime.limits
    max_tokens = options.max_tokens or min(limits.default_max_tokens, limits.max_tokens)
    if max_tokens > limits.max_tokens:
        raise RequestError(f"max_tokens {max_tokens} is more than this model allows ({limits.max_tokens}, "
                           "spec.serving.max_tokens)", param="max_tokens")
    fields = sampling_fields(temperature=options.temperature, top_p=options.top_p, seed=options.seed)
    answer = runtime.answer(path, {**body, **fields, "stop": list(options.stop) or None, "max_tokens": max_tokens})
    choice, usage = answer["choices"][0], answer.get("usage", {})
    text = choice["message"]["content"] if "message" in choice else choice["text"]
    return Completion(text or "", "stop" if choice.get("finish_reason") == "stop" else "length",
                      int(usage.get("prompt_tokens", 0)), int(usage.get("completion_tokens", 0)))


def _sampling(options: dict[str, Any]) -> Sampling:
    from ...engine.runtime import Sampling

    stop = options.pop("stop", ())
    return Sampling(stop=(stop,) if isinstance(stop, str) else tuple(stop), **options)
