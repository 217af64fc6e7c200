"""Random-weight models from real configs, with a tokenizer that needs no download.

The GPU machine has no network, so no checkpoint or tokenizer can be fetched there. Each model is built
from a real architecture's config (``configs/``: Llama-3.2-1B's shape, about 1.24B parameters, and
SmolLM2-135M's), with random weights (seeded) and a character-level tokenizer whose vocabulary is exactly
the config's: id ``i`` is one distinct character (specials at the config's own BOS/EOS ids), so every
generated id decodes to exactly one character and two answers have the same text only if they have the
same tokens. ``tiny`` keeps the architecture and shrinks it to a few layers of width 64 (the dry run).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

CONFIGS = Path(__file__).resolve().parent / "configs"
CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<s>assistant: {% endif %}")
SPECIALS = ("<s>", "</s>", "<pad>", "<unk>")
TINY = {"hidden_size": 64, "intermediate_size": 256, "num_hidden_layers": 6, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 256, "bos_token_id": 1, "eos_token_id": 2,
        "max_position_embeddings": 1024}  # the blocks outweigh the embeddings, as at full size
_SKIPPED = ((0xD800, 0xDFFF), (0xFDD0, 0xFDEF), (0xFFF0, 0xFFFF))  # surrogates, non-characters, specials


def config_dict(name: str, *, tiny: bool) -> dict[str, Any]:
    """The config of ``name`` (a file in ``configs/``), shrunk when ``tiny``."""
    data: dict[str, Any] = json.loads((CONFIGS / f"{name}.json").read_text())
    if tiny:
        data.update(TINY, rope_scaling=None)
    return data


def characters(count: int) -> list[str]:
    """``count`` distinct characters: printable ASCII and newline first (prompts encode), then code points
    upward from U+00A1, leaving out surrogates and non-characters (the same list on every Python)."""
    chars = ["\n", *(chr(c) for c in range(0x20, 0x7F))]
    code = 0xA1
    while len(chars) < count:
        if not any(lo <= code <= hi for lo, hi in _SKIPPED):
            chars.append(chr(code))
        code += 1
    return chars[:count]


def vocabulary(config: dict[str, Any]) -> tuple[dict[str, int], dict[str, int]]:
    """(token -> id for every id of the config's vocabulary, special token -> id)."""
    size = int(config["vocab_size"])
    bos, eos = int(config["bos_token_id"]), int(config["eos_token_id"])
    free = (i for i in range(size) if i not in (bos, eos))
    special = {"<s>": bos, "</s>": eos, "<pad>": next(free), "<unk>": next(free)}
    taken = set(special.values())
    ids = [i for i in range(size) if i not in taken]
    vocab = dict(zip(characters(len(ids)), ids))
    vocab.update(special)
    return vocab, special


def save_tokenizer(config: dict[str, Any], directory: Path) -> None:
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab, special = vocabulary(config)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tokenizer.decoder = decoders.Fuse()
    tokenizer.add_special_tokens(list(special))
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>", unk_token="<unk>", clean_up_tokenization_spaces=False)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(directory)


def build(name: str, directory: Path, *, tiny: bool, device: str, dtype: str, seed: int = 0) -> dict[str, Any]:
    """Save the model ``name`` (random weights at ``dtype``, initialised on ``device``) and its tokenizer
    into ``directory``; return what was built (parameters, bytes)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    data = config_dict(name, tiny=tiny)
    directory.mkdir(parents=True, exist_ok=True)
    config = AutoConfig.for_model(**{k: v for k, v in data.items() if k != "architectures"})
    config.architectures = data["architectures"]
    config.pad_token_id = vocabulary(data)[1]["<pad>"]
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    model.save_pretrained(directory, max_shard_size="1GB")
    save_tokenizer(data, directory)
    params = sum(p.numel() for p in model.parameters())
    size = sum(f.stat().st_size for f in directory.glob("*.safetensors"))
    return {"name": name, "path": str(directory), "parameters": params, "bytes": size, "dtype": dtype,
            "tiny": tiny, "layers": data["num_hidden_layers"], "vocab_size": data["vocab_size"]}
