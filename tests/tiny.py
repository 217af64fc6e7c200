"""Tiny real models for tests: real transformers architectures with random weights, saved with
``save_pretrained`` as safetensors. Small enough to build in well under a second each."""

from __future__ import annotations

from pathlib import Path
from typing import Any

TINY: dict[str, tuple[str, dict[str, Any], str]] = {
    # name: (config class, config kwargs, task)
    "llama": ("LlamaConfig", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                  max_position_embeddings=128), "causal-lm"),
    "llama-tied": ("LlamaConfig", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                       num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                       max_position_embeddings=128, tie_word_embeddings=True),
                   "causal-lm"),
    "mistral": ("MistralConfig", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=1, vocab_size=256,
                                      max_position_embeddings=128), "causal-lm"),
    "qwen2": ("Qwen2Config", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                  max_position_embeddings=128), "causal-lm"),
    "gemma": ("GemmaConfig", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                  num_attention_heads=4, num_key_value_heads=1, head_dim=16,
                                  vocab_size=256, max_position_embeddings=128), "causal-lm"),
    "gpt2": ("GPT2Config", dict(n_embd=64, n_layer=3, n_head=4, vocab_size=256, n_positions=128,
                                bos_token_id=0, eos_token_id=0), "causal-lm"),
    "bert": ("BertConfig", dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                                intermediate_size=128, vocab_size=256, max_position_embeddings=128),
             "feature-extraction"),
    "t5": ("T5Config", dict(d_model=64, d_ff=128, num_layers=2, num_decoder_layers=2, num_heads=4,
                            d_kv=16, vocab_size=256, decoder_start_token_id=0), "seq2seq-lm"),
}


def build(name: str, directory: Path, *, seed: int = 0) -> Path:
    """Build the tiny model ``name`` with random weights and save it (safetensors) to ``directory``."""
    import torch
    import transformers

    cls_name, kwargs, task = TINY[name]
    config = getattr(transformers, cls_name)(**kwargs)
    auto = {"causal-lm": transformers.AutoModelForCausalLM,
            "seq2seq-lm": transformers.AutoModelForSeq2SeqLM,
            "feature-extraction": transformers.AutoModel}[task]
    torch.manual_seed(seed)
    model = auto.from_config(config)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True)
    return directory
