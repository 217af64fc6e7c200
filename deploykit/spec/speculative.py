"""The manifest's ``spec.speculative``: speculative decoding, where cheap drafts of the next tokens are checked
by the serving model in one forward, and every accepted draft is a token that cost no step of its own.

Two ways to draft:
- ``method: ngram`` (prompt lookup): the tokens that followed the last ``ngram_max`` .. ``ngram_min`` tokens
  where they occurred before, in the prompt or the output so far. No second model; it pays where answers
  repeat spans of the prompt (copying, quoting, editing code).
- ``method: draft``: a small model with the serving model's tokenizer proposes the tokens: ``draft.path`` (a
  checkpoint, or a GGUF file for the llama.cpp engine), or ``draft.quantized`` (the serving checkpoint
  quantized int4/int8, transformers engine only).

What each engine can honour is checked here (no torch); what needs the files (a draft's vocabulary,
tokenizer and chat template) is checked at validation.
No torch, no transformers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator
from pydantic_core import PydanticCustomError

from .values import Strict

MAX_DRAFT_TOKENS = 32  # drafted per step: each is a position every verification step computes
MAX_NGRAM = 32
VERIFY_POSITIONS = 64  # the transformers engine: positions of one verification forward at most, rows x (drafts + 1)


def verification_room(num_tokens: int, rows: int) -> int:
    """Positions each of ``rows`` rows appends in a verification step at most (the transformers engine): its
    last token and its drafts, within ``VERIFY_POSITIONS`` for the batch."""
    return min(num_tokens + 1, VERIFY_POSITIONS // max(1, rows))


def verification_positions(spec: Any) -> int:
    """KV positions verification adds beside the rows' own at most (0: no speculation, or the llama.cpp
    engine, which plans its own): counted in the plan's KV room."""
    s = spec.speculative
    if s is None or spec.engine.name == "llama.cpp":
        return 0
    rows = spec.serving.max_concurrent
    return rows * verification_room(s.num_tokens, rows)


class Draft(Strict):
    """The draft model of ``method: draft``: exactly one of ``path`` and ``quantized``."""

    path: Path | None = Field(
        None, description="A draft model sharing the serving model's tokenizer: a checkpoint directory "
                          "(transformers engine) or a GGUF file (llama.cpp engine). A relative path resolves "
                          "against the manifest's directory.")
    quantized: Literal["int8", "int4"] | None = Field(
        None, description="The serving checkpoint itself, loaded a second time with its linear layers quantized "
                          "this way, as its own draft (transformers engine; the serving model must not be "
                          "quantized already).")

    @model_validator(mode="after")
    def _one_source(self) -> Draft:
        if (self.path is None) == (self.quantized is None):
            raise PydanticCustomError(
                "draft_source", "name exactly one of draft.path (a draft model) and draft.quantized (int4 or "
                                "int8: the serving checkpoint quantized as its own draft)", {"at": ""})
        return self


class Speculative(Strict):
    """Speculative decoding: drafted tokens verified by the serving model in one forward. Greedy answers are
    identical with and without it; sampled answers follow the serving model's distribution."""

    method: Literal["ngram", "draft"] = Field(
        description="ngram: drafts looked up in the prompt and output so far (no second model); draft: drafts "
                    "chosen greedily by the model of spec.speculative.draft.")
    num_tokens: int = Field(
        8, ge=1, le=MAX_DRAFT_TOKENS, strict=True,
        description="Most tokens drafted per step; each is one more position in the verification forward.")
    ngram_min: int = Field(
        1, ge=1, le=MAX_NGRAM, strict=True,
        description="ngram: the shortest match of the last tokens that proposes a draft.")
    ngram_max: int = Field(
        4, ge=1, le=MAX_NGRAM, strict=True,
        description="ngram: the longest match tried first.")
    draft: Draft | None = Field(None, description="method draft: the draft model.")

    @model_validator(mode="after")
    def _consistent(self) -> Speculative:
        if self.ngram_min > self.ngram_max:
            raise PydanticCustomError(
                "ngram_range", "ngram_min ({lo}) is above ngram_max ({hi})",
                {"lo": self.ngram_min, "hi": self.ngram_max, "at": "ngram_min"})
        if self.method == "draft" and self.draft is None:
            raise PydanticCustomError(
                "draft_missing", "method draft needs spec.speculative.draft (a path, or quantized: int4)",
                {"at": "method"})
        if self.method == "ngram" and self.draft is not None:
            raise PydanticCustomError(
                "draft_unused", "method ngram drafts from the token history; remove draft, or set method: draft",
                {"at": "draft"})
        if self.method == "draft":  # (a recorded manifest names the defaults: only another value is refused)
            for name in ("ngram_min", "ngram_max"):
                if getattr(self, name) != type(self).model_fields[name].default:
                    raise PydanticCustomError(
                        "ngram_unused", "{f} sets the prompt lookup of method ngram; a draft model drafts "
                        "without it: remove {f}, or set method: ngram", {"f": name, "at": name})
        return self


def speculative_problem(spec: Any) -> tuple[str, str] | None:
    """(field under ``spec``, why) for a ``spec.speculative`` the deployment's engine cannot honour."""
    speculative = spec.speculative
    if speculative is None:
        return None
    if spec.model.task != "causal-lm":
        return "speculative", f"speculative decoding drafts text; a {spec.model.task} model generates none"
    draft = speculative.draft
    if spec.engine.name == "llama.cpp":
        if draft is not None and draft.quantized is not None:
            return ("speculative.draft.quantized", "llama.cpp drafts with a GGUF model of its own: set "
                    "draft.path to a GGUF file (a smaller model, or this one quantized with llama-quantize)")
        if draft is not None and draft.path is not None and draft.path.suffix.lower() != ".gguf":
            return "speculative.draft.path", "the llama.cpp engine's draft model is a GGUF file"
        if speculative.method == "ngram" and speculative.ngram_min != speculative.ngram_max:
            return ("speculative.ngram_min", f"llama.cpp's ngram lookup (ngram-simple) matches one length only, "
                    f"ngram_max ({speculative.ngram_max}), never a shorter one: set ngram_min to "
                    f"{speculative.ngram_max} too")
        return None
    if draft is not None and draft.path is not None and draft.path.suffix.lower() == ".gguf":
        return ("speculative.draft.path", "the transformers engine's draft model is a checkpoint directory "
                "(config.json + *.safetensors), not a GGUF file")
    if draft is not None and draft.quantized is not None and spec.model.quantization != "none":
        return ("speculative.draft.quantized", f"the serving model is already quantized "
                f"({spec.model.quantization}): a quantized copy of it drafts at no gain; set draft.path to a "
                "smaller model, or serve the model unquantized")
    if spec.serving.batching == "continuous":
        return ("speculative", "transformers' continuous batching has no speculative decoding; use batching: "
                "padded (deploykit's batch loop)")
    if spec.cluster is not None or spec.placement.tensor_parallel > 1:
        return "speculative", "speculative decoding runs in one process: remove spec.cluster and tensor_parallel"
    return None


_TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "merges.txt", "tokenizer.model", "vocab.txt")


def draft_checkpoint_problem(model_dir: Path, draft_dir: Path) -> str | None:
    """Why the checkpoint at ``draft_dir`` cannot draft for the one at ``model_dir`` (transformers engine), from
    their files: missing, not a checkpoint, another vocabulary size, tokenizer or chat template. None: it can."""
    if not draft_dir.is_dir():
        return f"the draft checkpoint {str(draft_dir)!r} " + ("is not a directory" if draft_dir.exists()
                                                             else "does not exist")
    if not (draft_dir / "config.json").is_file():
        return f"{str(draft_dir)!r} holds no config.json: not a checkpoint directory"
    try:
        mine, its = _vocab_size(model_dir), _vocab_size(draft_dir)
    except (OSError, ValueError) as exc:
        return f"{str(draft_dir)!r}: config.json is not readable JSON ({exc})"
    if mine is not None and its is not None and mine != its:
        return f"the draft's vocabulary has {its} tokens, the model's {mine}: a draft must share the model's tokenizer"
    theirs = [f for f in _TOKENIZER_FILES if (draft_dir / f).is_file()]
    if not theirs:
        return f"{str(draft_dir)!r} ships no tokenizer: a draft must share the model's (copy its tokenizer files)"
    for name in sorted(set(theirs) | {f for f in _TOKENIZER_FILES if (model_dir / f).is_file()}):
        if _tokenizer_part(model_dir / name) != _tokenizer_part(draft_dir / name):
            return f"the draft's tokenizer differs from the model's ({name}): a draft must share the model's tokenizer"
    if _chat_template(model_dir) != _chat_template(draft_dir):
        return "the draft's chat template differs from the model's: a draft must share the model's tokenizer files"
    return None


def _vocab_size(directory: Path) -> int | None:
    import json

    config = json.loads((directory / "config.json").read_text())
    size = config.get("vocab_size", (config.get("text_config") or {}).get("vocab_size"))
    return size if isinstance(size, int) else None


def _tokenizer_part(path: Path) -> Any:
    """What of a tokenizer file decides the ids of a text (tokenizer.json: its model, added tokens, normalizer
    and pre-tokenizer, not its padding or truncation settings); None for a missing file."""
    import hashlib
    import json

    if not path.is_file():
        return None
    data = path.read_bytes()
    if path.name == "tokenizer.json":
        try:
            parsed = json.loads(data)
        except ValueError:
            return hashlib.sha256(data).hexdigest()
        return [parsed.get(k) for k in ("model", "added_tokens", "normalizer", "pre_tokenizer", "post_processor")]
    return hashlib.sha256(data).hexdigest()


def _chat_template(directory: Path) -> Any:
    import json

    jinja = directory / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    config = directory / "tokenizer_config.json"
    try:
        return json.loads(config.read_text()).get("chat_template") if config.is_file() else None
    except ValueError:
        return None
