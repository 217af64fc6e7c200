"""Speculative decoding in the padded loop under the cases its own tests leave out, on tiny real models: a
verification next to a row at the end of its context (absolute positions), rows whose accepted runs
alternate (the batch's padding), the draft model's caches once their rows have left, and a draft model whose
context is shorter than the rows."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from deploykit.engine.batching import GenerationRequest
from deploykit.engine.forwards import Forwards
from deploykit.engine.kvcache import all_pad_columns, growing_cache, keep_verified, returned_cache, with_cache
from deploykit.engine.requests import RequestHandle
from deploykit.engine.types import Speculation
from test_speculative import engine, repeating_prompts


def prefilled(model: Any, prompts: list[list[int]]) -> tuple[Any, torch.Tensor]:
    """The left-padded batch cache of ``prompts`` but each one's last id (the loop's state before a step)."""
    width = max(len(p) for p in prompts) - 1
    ids = torch.tensor([[0] * (width - len(p) + 1) + p[:-1] for p in prompts])
    mask = torch.tensor([[0] * (width - len(p) + 1) + [1] * (len(p) - 1) for p in prompts])
    with torch.inference_mode():
        out = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0),
                    use_cache=True, **with_cache(model, growing_cache(model.config)))
    return returned_cache(out), mask


def rows_of(prompts: list[list[int]]) -> list[RequestHandle]:
    """Handles whose prompt is all but the last id of ``prompts``, that last id their one token so far."""
    return [RequestHandle(GenerationRequest(tuple(p[:-1]), max_new_tokens=8), id=str(i), tokens=[p[-1]])
            for i, p in enumerate(prompts)]


def test_a_verification_beside_a_row_at_the_end_of_its_context_runs(tiny_model: Callable[[str], Path]) -> None:
    """gpt2 has n_positions = 128 absolute positions. Row 0 has used 127 of them (its last token at position
    126, no draft: its max_tokens ends it at 128); row 1 drafts 3 tokens. Row 0's filler positions must stay
    inside the model's positions (on CPU an index error made the whole step a plain decode step; on CUDA an
    out-of-range embedding index is a device-side assert, which leaves the context unusable), and row 1's logits are its own."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model("gpt2"), dtype=torch.float32).eval()
    prompts = [[(7 * i) % 250 + 3 for i in range(127)], [5, 9, 11, 5, 9, 11, 5, 9]]
    cache, mask = prefilled(model, prompts)
    draft = [11, 5, 9]
    with torch.inference_mode():
        logits, _, _ = Forwards(model, None, None).verify(rows_of(prompts), [[], draft], cache, mask)
        alone = model(input_ids=torch.tensor([prompts[1] + draft])).logits[0, -4:]
    torch.testing.assert_close(logits[1], alone, atol=1e-4, rtol=1e-4)


def test_verification_keeps_no_column_that_is_padding_in_every_row(tiny_model: Callable[[str], Path]) -> None:
    """Two rows whose accepted runs alternate (4 kept, then 1, then 4 ...): each step moves the row that kept
    fewer right, and a column that is padding in every row is dead weight in every layer's cache (it grew by
    the shorter run at every step, the admission counting it as used room) until a row left the batch."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model("llama"), dtype=torch.float32).eval()
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14, 15, 16, 17, 18]]
    cache, mask = prefilled(model, prompts)
    rows, fw = rows_of(prompts), Forwards(model, None, None)
    for kept in ([4, 1], [1, 4], [4, 1], [1, 4], [2, 3]):
        with torch.inference_mode():
            _, cache, wide = fw.verify(rows, [[30, 31, 32], [40, 41, 42]], cache, mask)
            mask = keep_verified(cache, wide, mask.shape[1], kept)
        assert all_pad_columns(mask) == 0, mask
        assert [layer.keys.shape[2] for layer in cache.layers] == [mask.shape[1]] * len(cache.layers)
        for h, k in zip(rows, kept):
            h.tokens += [h.tokens[-1]] * k
    assert mask.shape[1] == max(int(mask[i].sum()) for i in range(2))


def test_the_draft_models_caches_go_with_their_rows(tiny_model: Callable[[str], Path]) -> None:
    """A row's draft KV (its whole context in every layer of the draft) is freed when the row leaves, not
    held until the next step that drafts: here a request answered by its prefill alone comes after one that
    drafted, and the engine then idles with the first one's draft cache."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model("llama"), dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_pretrained(tiny_model("llama"), dtype=torch.float32).eval()
    prompt = repeating_prompts(2, seed=3)[1]
    with engine(model, speculative=Speculation(method="draft", num_tokens=4), draft_model=draft) as eng:
        first = eng.submit(GenerationRequest(prompt, max_new_tokens=24)).result(120)
        assert eng.stats()["speculative_accepted"] > 0  # the draft model drafted for it
        eng.submit(GenerationRequest(prompt, max_new_tokens=1)).result(120)
        assert first.finish_reason == "length"
        assert eng._batcher.speculator.draft_model.cached_positions() == 0


def test_a_draft_model_with_a_shorter_context_drafts_within_it(caplog: pytest.LogCaptureFixture) -> None:
    """A draft checkpoint (``draft.path``) whose absolute positions end before the model's context: a row
    longer than the draft's context gets no draft (it ran a forward of its whole sequence that failed, and
    logged a warning, at every step, and again once its cache was dropped), one near its end a shorter one."""
    from transformers import GPT2Config

    from deploykit.engine.drafting import DraftModel

    torch.manual_seed(0)
    small = AutoModelForCausalLM.from_config(GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=256,
                                                        n_positions=32)).eval()
    draft = DraftModel(small, confidence=0)  # random weights: every token unsure, and the drafts must be long
    seq = [(5 * i) % 250 + 3 for i in range(40)]
    with caplog.at_level("WARNING", logger="deploykit.engine.drafting"):
        assert draft.draft("long", seq, 4) == []
        assert len(draft.draft("near", seq[:30], 4)) == 3  # fed at positions 30 and 31, the last one never fed
        assert len(draft.draft("short", seq[:10], 4)) == 4
    assert not caplog.records, [r.getMessage() for r in caplog.records]
    assert draft.cached_positions() == 32 + 13  # the rows that drafted: their sequences and the fed drafts
