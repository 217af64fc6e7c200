"""Real PEFT LoRA adapters for tests: trained a few steps with peft on a tiny real model, so that the adapter
visibly changes the model's greedy answers, and saved with ``save_pretrained`` (adapter_config.json +
adapter_model.safetensors)."""

from __future__ import annotations

from pathlib import Path


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
