"""Real PEFT LoRA adapters for tests: trained a few steps with peft on a tiny real model, so that the adapter
visibly changes the model's greedy answers, and saved with ``save_pretrained`` (adapter_config.json +
adapter_model.safetensors); peft's own greedy answers to compare with, and manifests that serve them."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def train_adapter(base: Path, out: Path, *, text: str, steps: int = 30, rank: int = 4, seed: int = 0,
                  target_modules: tuple[str, ...] = ("q_proj", "v_proj", "down_proj")) -> Path:
    """Fine-tune a LoRA adapter of ``base`` on ``text`` (in a byte-level tokenizer's ids, or bytes modulo
    the vocabulary when ``base`` ships no tokenizer) and save it to ``out``."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    ids = _ids(base, text, model.config.vocab_size)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(target_modules), lora_dropout=0.0,
                        init_lora_weights=True, task_type="CAUSAL_LM")
    peft_model = get_peft_model(model, config)
    optimizer = torch.optim.Adam([p for p in peft_model.parameters() if p.requires_grad], lr=3e-2)
    batch = torch.tensor([ids])
    for _ in range(steps):
        loss = peft_model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    peft_model.save_pretrained(out)
    return out


def _ids(base: Path, text: str, vocab: int) -> list[int]:
    if (base / "tokenizer.json").is_file():
        from transformers import AutoTokenizer

        return list(AutoTokenizer.from_pretrained(base)(text)["input_ids"])
    return [b % vocab for b in text.encode()]


def peft_reference(base: Path, adapter: Path | None, prompt_ids: list[int], max_new_tokens: int) -> str:
    """peft's own greedy ``generate`` with ``adapter`` (the base's without one): the text up to EOS."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter)
    tokenizer = AutoTokenizer.from_pretrained(base)
    with torch.inference_mode():
        out = model.generate(input_ids=torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False,
                             attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long))
    new = out[0, len(prompt_ids):].tolist()
    if tokenizer.eos_token_id in new:
        new = new[:new.index(tokenizer.eos_token_id)]
    return str(tokenizer.decode(new, skip_special_tokens=True))


def chat_ids(base: Path, content: str) -> list[int]:
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(base).apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def adapters_manifest(base: Path, adapters: dict[str, Path], name: str = "chat", max_tokens: int = 64) -> str:
    text = (f"apiVersion: deploykit/v1\nkind: ModelDeployment\nmetadata: {{name: {name}}}\nspec:\n"
            f"  model: {{path: {base}, dtype: float32}}\n  placement: {{gpus: []}}\n"
            f"  serving: {{max_tokens: {max_tokens}, max_concurrent: 16}}\n")
    if adapters:
        text += "  adapters:\n" + "".join(f"    - {{name: {n}, path: {p}}}\n" for n, p in adapters.items())
    return text


def altered_copy(adapter: Path, out: Path, *, config: dict | None = None, truncate: bool = False) -> Path:
    """A copy of ``adapter`` with ``config`` merged into its adapter_config.json, or with its weights file cut
    after its header (``truncate``: it validates, from the header, and fails to load)."""
    import json
    import shutil

    shutil.copytree(adapter, out)
    if config:
        file = out / "adapter_config.json"
        file.write_text(json.dumps({**json.loads(file.read_text()), **config}))
    if truncate:
        weights = out / "adapter_model.safetensors"
        data = weights.read_bytes()
        weights.write_bytes(data[:8 + int.from_bytes(data[:8], "little") + 16])
    return out


def last_logits(adapters: Any, ids: list[int], slot: str | None = None) -> Any:
    """The model's logits after ``ids``, computed with the adapter ``slot`` (``Adapters.hold``'s; None: the
    base), as one row of the engine's forwards computes them."""
    import torch

    with torch.inference_mode(), adapters.rows([slot]):
        return adapters.model(input_ids=torch.tensor([ids])).logits[0, -1].clone()
