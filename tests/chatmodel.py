"""A tiny real chat model for serving tests: a random 2-layer Llama with a byte-level tokenizer (every
byte a token, so any text encodes) and a chat template. Built in well under a second."""

from __future__ import annotations

from pathlib import Path

CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<s>assistant: {% endif %}")


# A golden set for canary gates: 4 cases of 64 to 90 completion tokens (the chat model's tokenizer is one token
# per byte), over the 256 reference tokens golden gates need by default
GOLDEN = [{"prompt": "The capital of France is",
           "completion": " Paris, a city on the Seine, known for its museums, its bridges and its cafes."},
          {"messages": [{"role": "user", "content": "Say hi"}],
           "completion": "Hi! How can I help you today? Ask me anything you like, I am listening."},
          {"prompt": "Water boils at", "completion": " one hundred degrees Celsius at sea level, less on a mountain."},
          {"messages": [{"role": "user", "content": "Name three colours"}],
           "completion": "Red, green and blue: the three primary colours of light, mixed on every screen."}]


def build_chat_model(directory: Path, *, seed: int = 0, context: int = 256, hidden: int = 64, layers: int = 2,
                     intermediate: int = 128) -> Path:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    for special in ("<s>", "</s>", "<pad>"):
        vocab[special] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(["<s>", "</s>", "<pad>"])
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    directory.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(directory)
    config = LlamaConfig(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=len(vocab), max_position_embeddings=context,
                         bos_token_id=vocab["<s>"], eos_token_id=vocab["</s>"], pad_token_id=vocab["<pad>"])
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(directory, safe_serialization=True)
    return directory
