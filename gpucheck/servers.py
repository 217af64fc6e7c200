"""Servers the checks start (``deploykit serve``, ``transformers serve``) and the clients they send.

A server runs in the check's own process group, so the runner's kill at a check's time limit takes it too.
Clients speak plain HTTP (httpx): streamed chat completions timed to the first content chunk, from
threads, one request per client; and whole completions for comparing answers.
"""

from __future__ import annotations

import json
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TOPICS = ["a lighthouse keeper", "a lost robot", "the first snow", "a dragon who bakes", "a city under the sea",
          "a clockmaker's apprentice", "a cat that can talk", "a journey to Mars", "an old violin",
          "a haunted library", "a garden on the moon", "a pirate's map", "a friendly ghost", "a tiny giant",
          "the last train home", "a secret forest"]


def prompts(n: int) -> list[str]:
    """n distinct short prompts, the same for every system."""
    return [f"Write a short story about {TOPICS[i % len(TOPICS)]}" + (f" (#{i})" if i >= len(TOPICS) else ".")
            for i in range(n)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """A server subprocess logging to ``log``; ``with Server(...) as s:`` waits until ``ready_path`` answers
    200 and stops it (SIGTERM, then SIGKILL) on the way out."""

    def __init__(self, cmd: list[str], *, port: int, log: Path, env: dict[str, str], ready_path: str,
                 ready_timeout: float, failed: Callable[[Any], str | None] | None = None) -> None:
        self.cmd, self.port, self.log, self.env = cmd, port, log, env
        self.ready_path, self.ready_timeout = ready_path, ready_timeout
        self.failed = failed  # reads a not-ready answer: why the server will never be ready, or None
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.ready_s = 0.0

    def __enter__(self) -> Server:
        return self.start()

    def start(self) -> Server:
        import httpx

        start = time.monotonic()
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(self.cmd, stdout=out, stderr=subprocess.STDOUT, env=self.env)
        while time.monotonic() - start < self.ready_timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{' '.join(self.cmd[:4])} exited {self.proc.returncode}: {self.tail()}")
            try:
                answer = httpx.get(self.url + self.ready_path, timeout=5)
            except httpx.HTTPError:
                answer = None
            if answer is not None and answer.status_code == 200:
                self.ready_s = time.monotonic() - start
                return self
            if answer is not None and self.failed is not None and (why := self.failed(answer)):
                self.stop()  # a deployment failed: say why now, not at the time limit
                raise RuntimeError(f"not ready: {why}: {self.tail(8)}")
            time.sleep(0.3)
        self.stop()
        raise TimeoutError(f"not ready in {self.ready_timeout:.0f} s: {self.tail()}")

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self, grace: float = 20.0) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def deploykit_serve(path: Path, *, env: dict[str, str], log: Path, ready_timeout: float,
                    args: tuple[str, ...] = ()) -> Server:
    """``deploykit serve PATH`` on a free port, ready when ``/readyz`` answers 200 (failing early when a
    manifest failed)."""
    port = free_port()
    cmd = [sys.executable, "-m", "deploykit.cli", "serve", str(path), "--port", str(port), *args]
    return Server(cmd, port=port, log=log, env=env, ready_path="/readyz", ready_timeout=ready_timeout,
                  failed=deploykit_failure)


def deploykit_failure(answer: Any) -> str | None:
    """``/readyz``'s reason never to be ready: a manifest that failed (``FILE: error``), not one loading."""
    try:
        entries = answer.json().get("not_ready", [])
    except ValueError:
        return None
    failed = [str(e) for e in entries if ": " in str(e) and not str(e).endswith("loading")]
    return "; ".join(failed)[:600] or None


@dataclass
class Answer:
    """One streamed request: time to the first content chunk, tokens, text, error."""

    ttft: float = 0.0
    tokens: int = 0
    text: str = ""
    error: str = ""


def stream_chat(url: str, model: str, prompt: str, *, max_tokens: int, timeout: float) -> Answer:
    """One greedy streamed chat completion; tokens from the final ``usage`` when sent, else chunks."""
    import httpx

    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    answer, start, chunks = Answer(), time.perf_counter(), 0
    try:
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=timeout) as r:
            if r.status_code != 200:
                r.read()
                return Answer(error=f"HTTP {r.status_code}: {r.text[:200]}")
            for line in r.iter_lines():
                data = line.removeprefix("data: ").strip() if line.startswith("data: ") else ""
                if not data or data == "[DONE]":
                    continue
                event = json.loads(data)
                if event.get("usage"):
                    answer.tokens = int(event["usage"].get("completion_tokens") or 0)
                for choice in event.get("choices") or []:
                    if text := (choice.get("delta") or {}).get("content"):
                        chunks += 1
                        answer.ttft = answer.ttft or time.perf_counter() - start
                        answer.text += text
    except Exception as exc:  # noqa: BLE001 - a failed request is counted, not fatal
        answer.error = f"{type(exc).__name__}: {exc}"[:300]
    answer.tokens = answer.tokens or chunks
    return answer


def load(url: str, model: str, texts: list[str], *, max_tokens: int, timeout: float) -> dict[str, Any]:
    """One client per prompt, all at once: tokens/s over the wall time, TTFT percentiles, errors."""
    answers: list[Answer] = [Answer() for _ in texts]

    def one(i: int) -> None:
        answers[i] = stream_chat(url, model, texts[i], max_tokens=max_tokens, timeout=timeout)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(texts))]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    ok = [a for a in answers if not a.error]
    ttfts = sorted(a.ttft for a in ok) or [0.0]
    return {"clients": len(texts), "errors": [a.error for a in answers if a.error][:3],
            "failed": len(answers) - len(ok), "tokens": sum(a.tokens for a in ok), "wall_s": round(wall, 3),
            "tok_s": round(sum(a.tokens for a in ok) / wall, 1) if wall else 0.0,
            "ttft_p50_s": round(statistics.median(ttfts), 3),
            "ttft_p95_s": round(ttfts[min(len(ttfts) - 1, int(0.95 * len(ttfts)))], 3),
            "texts": [a.text for a in answers]}


def complete(url: str, model: str, prompt_ids: list[int], *, max_tokens: int, timeout: float) -> str:
    """A whole greedy completion of a token-id prompt; its text."""
    import httpx

    body = {"model": model, "prompt": prompt_ids, "max_tokens": max_tokens, "temperature": 0}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=timeout)
    if r.status_code != 200:
        raise RuntimeError(f"/v1/completions answered {r.status_code}: {r.text[:300]}")
    return str(r.json()["choices"][0]["text"])


def metric(url: str, name: str, **labels: str) -> float:
    """One sample of ``/metrics`` (0 when absent)."""
    import httpx

    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith((name + "{", name + " ")) and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def model_states(url: str) -> dict[str, str]:
    """``/v1/models``: each deployment's state (loaded, unloaded, loading)."""
    import httpx

    return {m["id"]: str(m.get("state")) for m in httpx.get(f"{url}/v1/models", timeout=30).json()["data"]}
