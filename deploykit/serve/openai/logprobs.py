"""Token logprobs in the API's two shapes: chat's ``logprobs.content`` (token, logprob, bytes,
top_logprobs) and the legacy completions object (tokens, token_logprobs, top_logprobs, text_offset,
with the first prompt token's logprob null when the prompt is echoed)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

from ...engine.sampling import TokenLogprobs

LOGPROB_FLOOR = -9999.0  # JSON has no -Infinity: a token the model rules out gets this (as vLLM does)


class TokenTexts:
    """What single token ids stand for, for one tokenizer: their raw bytes (a byte-level BPE token may
    hold part of a character) and a text, ``bytes:\\xNN...`` where those bytes are not UTF-8 on their own
    (OpenAI's own notation: decoding them would give U+FFFD, and every such token the same string)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self._byte_level = "ByteLevel" in repr(decoder)
        self._special = set(getattr(tokenizer, "all_special_ids", ()))
        self.raw = lru_cache(maxsize=65536)(self._raw)
        self.text = lru_cache(maxsize=65536)(self._text)

    def _raw(self, token: int) -> bytes:
        piece = str(self.tokenizer.convert_ids_to_tokens(token))
        if self._byte_level and token not in self._special and all(c in _BYTE_DECODER for c in piece):
            return bytes(_BYTE_DECODER[c] for c in piece)
        if match := _BYTE_FALLBACK.fullmatch(piece):  # sentencepiece's byte fallback: <0xE2>
            return bytes([int(match.group(1), 16)])
        return str(self.tokenizer.decode([token])).encode()

    def _text(self, token: int) -> str:
        raw = self.raw(token)
        try:
            return raw.decode()
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: the character a byte-level BPE piece uses -> its byte."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {char: byte for byte, char in bytes_to_unicode().items()}


_BYTE_DECODER = _byte_decoder()
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _logprob(value: float) -> float:
    return max(value, LOGPROB_FLOOR)


def chat_content(lps: Sequence[TokenLogprobs], texts: TokenTexts) -> list[dict[str, Any]]:
    """``choices[].logprobs.content`` of a chat completion (or of one streamed chunk)."""

    def entry(token: int, logprob: float) -> dict[str, Any]:
        return {"token": texts.text(token), "logprob": _logprob(logprob), "bytes": list(texts.raw(token))}

    return [{**entry(lp.token, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]} for lp in lps]


class LegacyLogprobs:
    """The legacy ``logprobs`` object of one completions choice, built in pieces (a stream sends one
    per chunk) with ``text_offset`` counted across them."""

    def __init__(self, texts: TokenTexts) -> None:
        self.texts = texts
        self.offset = 0

    def echo(self, prompt: Sequence[int], lps: Sequence[TokenLogprobs]) -> dict[str, Any]:
        """The prompt's tokens: the first has no logprob (nothing comes before it)."""
        first = self._piece([prompt[0]], [None], [None])
        rest = self.piece(lps)
        return {key: first[key] + rest[key] for key in first}

    def piece(self, lps: Sequence[TokenLogprobs]) -> dict[str, Any]:
        tops = [{self.texts.text(t): _logprob(v) for t, v in lp.top} for lp in lps]
        return self._piece([lp.token for lp in lps], [_logprob(lp.logprob) for lp in lps], tops)

    def _piece(self, tokens: Sequence[int], logprobs: Sequence[float | None],
               tops: Sequence[dict[str, float] | None]) -> dict[str, Any]:
        strings = [self.texts.text(t) for t in tokens]
        offsets = []
        for text in strings:
            offsets.append(self.offset)
            self.offset += len(text)
        return {"tokens": strings, "token_logprobs": list(logprobs), "top_logprobs": list(tops),
                "text_offset": offsets}
