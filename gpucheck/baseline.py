"""Plain transformers on the same weights: what deploykit's answers and speed are compared with.

``from_pretrained`` onto one device, chat prompts through the tokenizer's own template, greedy ``generate``
one prompt at a time (the reference answers) or all prompts in one left-padded batch (the speed baseline).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any


def load(path: Path, *, dtype: str, device: str) -> tuple[Any, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=getattr(torch, dtype), device_map={"": device})
    model.eval()
    return model, AutoTokenizer.from_pretrained(str(path))


def chat_ids(tokenizer: Any, text: str) -> list[int]:
    """The prompt ids of one user message, with the generation prompt (as a chat endpoint builds them)."""
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
    if hasattr(ids, "keys"):  # transformers 5 may return a BatchEncoding
        ids = ids["input_ids"]
    return [int(i) for i in ids]


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def generate_one(model: Any, tokenizer: Any, ids: list[int], *, max_new_tokens: int) -> list[int]:
    """Greedy new tokens of one prompt, alone (batch of one, no padding); EOS included when reached."""
    import torch

    with torch.no_grad():
        out = model.generate(torch.tensor([ids], device=model.device), attention_mask=torch.ones(
            1, len(ids), dtype=torch.long, device=model.device), max_new_tokens=max_new_tokens, do_sample=False,
            pad_token_id=tokenizer.pad_token_id)
    return [int(t) for t in out[0, len(ids):]]


def generate_batch(model: Any, tokenizer: Any, prompts: list[list[int]], *,
                   max_new_tokens: int) -> tuple[list[list[int]], float]:
    """Greedy new tokens of all prompts in one left-padded batch, and the seconds it took."""
    import torch

    width = max(map(len, prompts))
    pad = tokenizer.pad_token_id
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=model.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=model.device)
    _sync(str(model.device))
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad)
    _sync(str(model.device))
    seconds = time.perf_counter() - start
    return [_until_eos([int(t) for t in row[width:]], tokenizer) for row in out], seconds


def _until_eos(tokens: list[int], tokenizer: Any) -> list[int]:
    eos = tokenizer.eos_token_id
    return tokens[: tokens.index(eos) + 1] if eos in tokens else tokens


def text_of(tokenizer: Any, tokens: list[int]) -> str:
    """What an OpenAI-style endpoint returns for these tokens: their text, special tokens left out."""
    return str(tokenizer.decode(tokens, skip_special_tokens=True))


def common_prefix(a: str, b: str) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def agreement(ours: list[str], theirs: list[str]) -> dict[str, Any]:
    """How many answers are equal; where the others first differ (characters: one per token here)."""
    pairs = list(zip(ours, theirs))
    differ = [(i, common_prefix(a, b), len(b)) for i, (a, b) in enumerate(pairs) if a != b]
    return {"equal": len(pairs) - len(differ), "of": len(pairs),
            "first_differences": [{"prompt": i, "same_prefix": p, "reference_length": n} for i, p, n in differ[:4]]}
