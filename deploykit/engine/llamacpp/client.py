"""HTTP to one llama-server: the health check's greedy request (blocking), and the relay's requests
(asyncio, httpx): a JSON answer, or the data events of a streamed (SSE) answer, parsed.

Errors are typed so the API can answer as OpenAI does: ``UpstreamError`` (llama-server refused the request:
its status and message), ``EngineGone`` (the connection broke: the process died or was stopped). It knows
nothing of deploykit's API models; ``serve.openai.relay`` builds the bodies and rewrites the answers.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request
from collections.abc import AsyncGenerator
from typing import Any

import httpx

CONNECT_TIMEOUT = 5.0


class UpstreamError(Exception):
    """llama-server answered with an error status."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


class EngineGone(Exception):
    """The llama-server connection broke mid-request (the process ended)."""


def post_blocking(url: str, api_key: str, path: str, body: dict[str, Any], *, timeout: float) -> dict[str, Any]:
    """One JSON request on this thread (the health check; ``Deployment.generate`` and ``chat``)."""
    request = urllib.request.Request(f"{url}{path}", data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json",
                                              "Authorization": f"Bearer {api_key}"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            answer: dict[str, Any] = json.loads(response.read())
            return answer
    except urllib.error.HTTPError as exc:
        raise UpstreamError(exc.code, _message(exc.code, exc.read())) from None
    except (urllib.error.URLError, OSError) as exc:
        raise EngineGone(str(exc)) from None


def greedy_probe(url: str, api_key: str, text: str, *, max_tokens: int, timeout: float) -> tuple[str, int, float]:
    """(text, completion tokens, seconds) of one greedy completion of ``text``: the health check's request."""
    start = time.monotonic()
    answer = post_blocking(url, api_key, "/v1/completions",
                           {"prompt": text, "max_tokens": max_tokens, "temperature": 0.0, "seed": 0}, timeout=timeout)
    choice = answer["choices"][0]
    return str(choice.get("text", "")), int(answer.get("usage", {}).get("completion_tokens", 0)), \
        time.monotonic() - start


def _message(status: int, raw: bytes) -> str:
    try:
        error = json.loads(raw).get("error", {})
        return str(error.get("message") or raw.decode(errors="replace"))
    except (ValueError, AttributeError):
        return raw.decode(errors="replace")[:500] or f"status {status}"


class RelayClient:
    """Async requests to one llama-server (its URL and key); one connection pool per event loop."""

    def __init__(self, url: str, api_key: str) -> None:
        self.url = url
        self._headers = {"Authorization": f"Bearer {api_key}"}
        self._clients: dict[int, tuple[asyncio.AbstractEventLoop, httpx.AsyncClient]] = {}

    def _client(self) -> httpx.AsyncClient:
        loop = asyncio.get_running_loop()
        held = self._clients.get(id(loop))
        if held is None or held[0] is not loop:
            client = httpx.AsyncClient(base_url=self.url, headers=self._headers,
                                       timeout=httpx.Timeout(None, connect=CONNECT_TIMEOUT),
                                       limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))
            held = self._clients[id(loop)] = (loop, client)
        return held[1]

    async def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        try:
            response = await self._client().post(path, json=body)
        except httpx.TransportError as exc:
            raise EngineGone(f"{type(exc).__name__}: {exc}") from None
        if response.status_code != 200:
            raise UpstreamError(response.status_code, _message(response.status_code, response.content))
        answer: dict[str, Any] = response.json()
        return answer

    async def events(self, path: str, body: dict[str, Any]) -> AsyncGenerator[dict[str, Any], None]:
        """The JSON data events of a streamed answer, up to (not including) ``[DONE]``. Closing the
        iterator early closes the connection: llama-server then stops generating."""
        try:
            async with self._client().stream("POST", path, json=body) as response:
                if response.status_code != 200:
                    raise UpstreamError(response.status_code, _message(response.status_code, await response.aread()))
                async for line in response.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[6:]
                    if data == "[DONE]":
                        return
                    event = json.loads(data)
                    if "error" in event:
                        error = event["error"]
                        raise UpstreamError(int(error.get("code", 500)), str(error.get("message", error)))
                    yield event
        except httpx.TransportError as exc:
            raise EngineGone(f"{type(exc).__name__}: {exc}") from None

    def close(self) -> None:
        """Close every pool: on its own loop when that loop still runs, else drop it (its connections
        die with the server)."""
        clients, self._clients = list(self._clients.values()), {}
        for loop, client in clients:
            if not loop.is_closed() and loop.is_running():
                asyncio.run_coroutine_threadsafe(client.aclose(), loop)
