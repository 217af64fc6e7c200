"""Pieces of bench/serve.py: prompts, a peak-RSS sampler, OpenAI-compatible streaming clients and
server processes (started in their own session, polled for readiness, killed with SIGTERM then
SIGKILL)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

TOPICS = ["a lighthouse keeper", "a lost robot", "the first snow", "a dragon who bakes", "a city under the sea",
          "a clockmaker's apprentice", "a cat that can talk", "a journey to Mars", "an old violin",
          "a haunted library", "a garden on the moon", "a pirate's map", "a friendly ghost", "a tiny giant",
          "the last train home", "a secret forest"]
FORMS = ["Write a short story about {}.", "Write a poem about {}.", "Describe {} in a few sentences."]


def prompts(n: int) -> list[str]:
    """n distinct short prompts, the same for every system."""
    base = [form.format(topic) for form in FORMS for topic in TOPICS]
    return [base[i % len(base)] + ("" if i < len(base) else f" (#{i})") for i in range(n)]


def tree_rss(pid: int) -> int:
    """VmRSS bytes of pid and all its descendants (0 for processes already gone)."""
    total, stack = 0, [pid]
    while stack:
        p = stack.pop()
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
            for task in Path(f"/proc/{p}/task").iterdir():
                stack += [int(c) for c in (task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue
    return total


class RssSampler:
    """Polls tree_rss(pid) every `interval` s in a thread; `peak` is the maximum since the last reset()."""

    def __init__(self, pid: int, interval: float = 0.2) -> None:
        self.pid, self.interval, self.peak = pid, interval, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, tree_rss(self.pid))
            self._stop.wait(self.interval)

    def reset(self) -> None:
        self.peak = tree_rss(self.pid)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


@dataclass
class Result:
    """One request: time to the first content chunk, generated tokens (None: unknown), error."""

    ttft: float = 0.0
    tokens: int | None = None
    chunks: int = 0
    error: str = ""


async def chat(client, model: str, prompt: str, max_tokens: int, usage: bool, timeout: float) -> Result:
    """One streamed greedy chat completion, bounded by `timeout` s; tokens from `usage` when sent."""
    res, start = Result(), time.perf_counter()
    extra = {"stream_options": {"include_usage": True}} if usage else {}
    try:
        async with asyncio.timeout(timeout):
            stream = await client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
                temperature=0, stream=True, **extra)
            async for chunk in stream:
                if chunk.usage is not None:
                    res.tokens = chunk.usage.completion_tokens
                if chunk.choices and chunk.choices[0].delta.content:
                    res.chunks += 1
                    if res.chunks == 1:
                        res.ttft = time.perf_counter() - start
    except Exception as e:  # noqa: BLE001 - a failed request is counted, not fatal
        res.error = f"{type(e).__name__}: {e}"[:300]
    return res


def client_for(base_url: str, timeout: float):
    from openai import AsyncOpenAI

    return AsyncOpenAI(base_url=base_url, api_key="bench", timeout=timeout, max_retries=0)


async def warm_up(base_url: str, model: str, max_tokens: int, timeout: float,
                  wait: float) -> tuple[float, float, bool]:
    """First request: (seconds of 503 answers -- a server still loading its model -- retried for up to
    `wait` s, seconds of the request itself, whether stream_options is accepted: retried without it
    when the server rejects it with 400/422)."""
    from openai import APIStatusError, BadRequestError, UnprocessableEntityError

    async with client_for(base_url, timeout) as client:
        begin = start = time.perf_counter()
        usage = True
        while True:
            try:
                stream = await client.chat.completions.create(
                    model=model, messages=[{"role": "user", "content": "Say hello."}], max_tokens=max_tokens,
                    temperature=0, stream=True,
                    **({"stream_options": {"include_usage": True}} if usage else {}))
                async for _ in stream:
                    pass
                return start - begin, time.perf_counter() - start, usage
            except (BadRequestError, UnprocessableEntityError):
                if not usage:
                    raise
                usage = False
            except APIStatusError as e:
                if e.status_code != 503 or time.perf_counter() - begin > wait:
                    raise
                await asyncio.sleep(1)
                start = time.perf_counter()


async def load(base_url: str, model: str, clients: int, per_client: int, max_tokens: int, timeout: float,
               usage: bool) -> tuple[list[Result], float]:
    """`clients` concurrent clients, each sending `per_client` requests one after another."""
    texts = prompts(clients * per_client)
    async with client_for(base_url, timeout) as client:
        async def one(c: int) -> list[Result]:
            return [await chat(client, model, texts[c * per_client + r], max_tokens, usage, timeout)
                    for r in range(per_client)]

        start = time.perf_counter()
        per = await asyncio.gather(*(one(c) for c in range(clients)))
        return [r for rs in per for r in rs], time.perf_counter() - start


class Server:
    """A server subprocess in its own session (so its children are killed with it), logging to a file."""

    def __init__(self, cmd: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        self.cmd, self.log, self.env = cmd, log, env
        self.proc: subprocess.Popen | None = None

    def start(self, base_url: str, timeout: float) -> float:
        """Spawn, then poll GET {base_url}/models until 200: seconds to ready."""
        import httpx

        start = time.perf_counter()
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(self.cmd, stdout=out, stderr=subprocess.STDOUT, env=self.env,
                                         start_new_session=True)
        while time.perf_counter() - start < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.cmd[0]} exited ({self.proc.returncode}); see {self.log}")
            try:
                if httpx.get(f"{base_url}/models", timeout=5).status_code == 200:
                    return time.perf_counter() - start
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"not ready in {timeout:.0f} s; see {self.log}")

    def stop(self, grace: float = 15.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.proc.pid, sig)
                self.proc.wait(grace)
                return
            except subprocess.TimeoutExpired:
                continue
            except ProcessLookupError:
                return
