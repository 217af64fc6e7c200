"""From requests to token ids and from generated ids back to text, for one tokenizer.

- prompts: a chat goes through the tokenizer's own chat template (``apply_chat_template`` with the
  generation prompt); a completion prompt is encoded as is (with the tokenizer's special tokens).
- output: ``TextStream`` turns the growing list of generated ids into text deltas that are safe to
  send: a delta never ends inside a multi-byte character (the tokenizer decodes half a character as
  U+FFFD; that tail waits for the next token), never contains the end-of-sequence token's text, and
  never shows a stop string or a prefix of one that may still complete (held back until it cannot).
  When a stop string appears, the text ends just before it, as OpenAI's API does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..errors import DeploykitError

_REPLACEMENT = "\ufffd"


class RequestError(DeploykitError):
    """A request the model cannot take as it is (too long, wrong kind): the client's to fix (400)."""

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


def template_takes_tools(tokenizer: Any) -> bool:
    """Whether the model's chat template renders ``tools`` (it reads the variable at all)."""
    template = getattr(tokenizer, "chat_template", None)
    texts = template.values() if isinstance(template, dict) else [template or ""]
    return any("tools" in text for text in texts)


def chat_prompt_ids(tokenizer: Any, messages: Sequence[dict[str, Any]],
                    tools: Sequence[dict[str, Any]] | None = None) -> list[int]:
    """The prompt of a chat, through the model's chat template (which renders ``tools`` when given)."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise RequestError("this model has no chat template; use /v1/completions with a prompt",
                           param="messages", code="no_chat_template")
    try:
        ids = tokenizer.apply_chat_template(list(messages), tools=list(tools) if tools else None,
                                            add_generation_prompt=True, tokenize=True)
    except Exception as exc:  # a template that rejects these messages (roles out of order, say)
        raise RequestError(f"the chat template rejected the messages: {exc}", param="messages") from None
    if isinstance(ids, dict) or hasattr(ids, "keys"):  # transformers 5 may return a BatchEncoding
        ids = ids["input_ids"]
    return [int(i) for i in ids]


def completion_prompt_ids(tokenizer: Any, prompt: str | Sequence[int]) -> list[int]:
    """A prompt's ids; token ids given by the client must be in the vocabulary (one bad id would
    otherwise fail every request batched with it)."""
    if isinstance(prompt, str):
        return [int(i) for i in tokenizer(prompt)["input_ids"]]
    vocab = len(tokenizer)
    bad = [i for i in prompt if not 0 <= int(i) < vocab]
    if bad:
        raise RequestError(f"token id {bad[0]} is not in this model's vocabulary (0 to {vocab - 1})",
                           param="prompt", code="invalid_token_id")
    return [int(i) for i in prompt]


def check_length(prompt_tokens: int, max_tokens: int, *, context_length: int, limit: int,
                 prompt_param: str = "prompt") -> None:
    """Refuse what cannot fit: a prompt longer than the context, or max_tokens above the limit."""
    if max_tokens > limit:
        raise RequestError(f"max_tokens is {max_tokens}, above this model's limit of {limit} "
                           "(spec.serving.max_tokens)", param="max_tokens", code="max_tokens_too_large")
    if prompt_tokens + max_tokens > context_length:
        raise RequestError(f"this model's context is {context_length} tokens; the prompt has {prompt_tokens} "
                           f"and max_tokens asks for {max_tokens} more: shorten the prompt or lower max_tokens",
                           param=prompt_param, code="context_length_exceeded")


class TextStream:
    """Text deltas of one generation (see the module docstring)."""

    def __init__(self, tokenizer: Any, *, stop: Sequence[str] = (), skip_ids: Sequence[int] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.skip_ids = set(skip_ids)
        self.ids: list[int] = []
        self.sent = 0  # characters of the decoded text already handed out
        self.stopped = False

    def _text(self) -> str:
        ids = [i for i in self.ids if i not in self.skip_ids]
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))

    def push(self, token_id: int) -> str:
        """Add one generated id; return the text that can be sent now ("" when none yet)."""
        if self.stopped:
            return ""
        self.ids.append(token_id)
        text = self._text()
        cut = self._stop_at(text)
        if cut is not None:
            self.stopped = True
            return self._take(text[:cut])
        safe = len(text.rstrip(_REPLACEMENT)) if text.endswith(_REPLACEMENT) else len(text)
        safe = min(safe, self._hold_back(text))
        return self._take(text[:safe])

    def finish(self) -> str:
        """The rest of the text once generation ended."""
        if self.stopped:
            return ""
        text = self._text()
        cut = self._stop_at(text)
        self.stopped = True
        return self._take(text if cut is None else text[:cut])

    def _take(self, upto: str) -> str:
        delta = upto[self.sent:]
        self.sent = max(self.sent, len(upto))
        return delta

    def _stop_at(self, text: str) -> int | None:
        found = [i for i in (text.find(s, max(0, self.sent - len(s))) for s in self.stop) if i >= 0]
        return min(found) if found else None

    def _hold_back(self, text: str) -> int:
        """Where text may be sent up to: before the longest tail that starts a stop string."""
        for start in range(max(self.sent, len(text) - max((len(s) for s in self.stop), default=0)), len(text)):
            tail = text[start:]
            if any(s.startswith(tail) for s in self.stop):
                return start
        return len(text)

    @property
    def stopped_by_string(self) -> bool:
        return self.stopped and self._stop_at(self._text()) is not None
