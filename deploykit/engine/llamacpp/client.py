"""HTTP to one llama-server over its unix socket: the health check's greedy request and the watchdog's
``/health`` (blocking), and the relay's requests (asyncio): a JSON answer, or a streamed answer's raw bytes.

Every client is built here, with ``trust_env=False`` (no proxy variable, netrc or certificate setting of
deploykit's environment applies to engine traffic) and timeouts on every phase: connecting, writing,
waiting in httpx's pool, and reading (``READ_TIMEOUT_SECONDS``, a backstop: a hung engine is found by the
watchdog's ``/health``, a stalled decode loop by its ``/slots``, long before it, and killed, which ends every
read at once). The health check's request also ends when its stop event is set (``greedy_probe``).

Errors are typed so the API can answer as OpenAI does, and so that only a real death counts as one:
``UpstreamError`` (llama-server refused the request: its status and message); ``EngineBusy`` (no connection
within the connect or pool timeout: the engine is loaded, not gone); ``EngineGone`` (the connection was
refused or broke: the process may have ended; the watchdog decides from its exit status). It knows nothing of
deploykit's API models; ``serve.openai.relay`` builds the bodies and rewrites the answers.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx

CONNECT_TIMEOUT = 5.0
READ_TIMEOUT_SECONDS = 600.0
STOP_POLL_SECONDS = 0.05  # how often a stoppable request looks at its stop event
BASE_URL = "http://llama-server"  # the host is not used: every request goes to the unix socket


class UpstreamError(Exception):
    """llama-server answered with an error status."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


class EngineGone(Exception):
    """The connection to llama-server was refused or broke mid-request (the process may have ended)."""


class EngineRefused(EngineGone):
    """The connection was refused (nothing was sent): safe to send again once the engine is ready."""


class ProbeStopped(Exception):
    """A request was given up because its engine is being stopped (the stop event was set)."""


class EngineBusy(Exception):
    """No connection to llama-server within the timeout (a loaded engine, or a hung one: not a death)."""


def _timeout(read: float) -> httpx.Timeout:
    return httpx.Timeout(read, connect=CONNECT_TIMEOUT, write=CONNECT_TIMEOUT, pool=CONNECT_TIMEOUT)


def unix_client(socket: Path, *, timeout: float, api_key: str | None = None) -> httpx.Client:
    """A blocking client of the llama-server listening on ``socket``."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return httpx.Client(transport=httpx.HTTPTransport(uds=str(socket)), base_url=BASE_URL, headers=headers,
                        timeout=_timeout(timeout), trust_env=False)


def _typed(exc: httpx.HTTPError) -> Exception:
    """The typed error of a transport failure: a timeout before any connection is not a death."""
    if isinstance(exc, (httpx.ConnectTimeout, httpx.PoolTimeout)):
        return EngineBusy(f"no connection to llama-server within {CONNECT_TIMEOUT:g}s ({type(exc).__name__})")
    if isinstance(exc, httpx.ReadTimeout):
        return UpstreamError(504, "llama-server sent nothing for a long time (read timeout)")
    if isinstance(exc, httpx.ConnectError):
        return EngineRefused(f"{type(exc).__name__}: {exc}")
    return EngineGone(f"{type(exc).__name__}: {exc}")


def post_blocking(socket: Path, api_key: str, path: str, body: dict[str, Any], *, timeout: float) -> dict[str, Any]:
    """One JSON request on this thread (the health check; ``Deployment.generate`` and ``chat``)."""
    return _blocking(socket, api_key, "POST", path, body, timeout=timeout)


def get_blocking(socket: Path, api_key: str, path: str, *, timeout: float) -> dict[str, Any]:
    """One GET (``/v1/models``: the model's vocabulary size)."""
    return _blocking(socket, api_key, "GET", path, None, timeout=timeout)


def _blocking(socket: Path, api_key: str, method: str, path: str, body: dict[str, Any] | None, *,
              timeout: float) -> dict[str, Any]:
    """One request on this thread; its JSON answer, or the typed error of what went wrong."""
    try:
        with unix_client(socket, timeout=timeout, api_key=api_key) as client:
            response = client.request(method, path, json=body)
    except httpx.HTTPError as exc:
        raise _typed(exc) from None
    return _answer(response)


def _answer(response: httpx.Response) -> dict[str, Any]:
    """A finished request's JSON answer, or llama.cpp's error as an ``UpstreamError``."""
    if response.status_code != 200:
        raise UpstreamError(response.status_code, _message(response.status_code, response.content))
    answer: dict[str, Any] = response.json()
    return answer


def greedy_probe(socket: Path, api_key: str, text: str, *, max_tokens: int, timeout: float,
                 stop: threading.Event | None = None) -> tuple[str, int, float]:
    """(text, completion tokens, seconds) of one greedy completion of ``text``: the health check's request.
    ``ProbeStopped`` as soon as ``stop`` is set (checked every ``STOP_POLL_SECONDS``; the request is cancelled,
    its connection closed), whatever ``timeout`` is left."""
    start = time.monotonic()
    body = {"prompt": text, "max_tokens": max_tokens, "temperature": 0.0, "seed": 0}
    answer = asyncio.run(_stoppable_post(socket, api_key, "/v1/completions", body, timeout=timeout, stop=stop))
    choice = answer["choices"][0]
    return str(choice.get("text", "")), int(answer.get("usage", {}).get("completion_tokens", 0)), \
        time.monotonic() - start


async def _stoppable_post(socket: Path, api_key: str, path: str, body: dict[str, Any], *, timeout: float,
                          stop: threading.Event | None) -> dict[str, Any]:
    """One JSON request on a private event loop, given up (cancelled) once ``stop`` is set."""
    transport = httpx.AsyncHTTPTransport(uds=str(socket))
    async with httpx.AsyncClient(transport=transport, base_url=BASE_URL, timeout=_timeout(timeout), trust_env=False,
                                 headers={"Authorization": f"Bearer {api_key}"}) as client:
        request = asyncio.ensure_future(client.post(path, json=body))
        try:
            while not request.done():
                if stop is not None and stop.is_set():
                    raise ProbeStopped("the request was given up: its engine is being stopped")
                await asyncio.wait({request}, timeout=STOP_POLL_SECONDS)
        finally:
            request.cancel()
            await asyncio.gather(request, return_exceptions=True)
        try:
            response = request.result()
        except httpx.HTTPError as exc:
            raise _typed(exc) from None
    return _answer(response)


def _message(status: int, raw: bytes) -> str:
    try:
        error = json.loads(raw).get("error", {})
        return str(error.get("message") or raw.decode(errors="replace"))
    except (ValueError, AttributeError):
        return raw.decode(errors="replace")[:500] or f"status {status}"


class RelayClient:
    """Async requests to one llama-server (its socket and key); one connection pool per event loop."""

    def __init__(self, socket: Path, api_key: str) -> None:
        self.socket = socket
        self._headers = {"Authorization": f"Bearer {api_key}"}
        self._clients: dict[int, tuple[asyncio.AbstractEventLoop, httpx.AsyncClient]] = {}

    def _client(self) -> httpx.AsyncClient:
        loop = asyncio.get_running_loop()
        held = self._clients.get(id(loop))
        if held is None or held[0] is not loop:
            transport = httpx.AsyncHTTPTransport(uds=str(self.socket),
                                                 limits=httpx.Limits(max_connections=None,
                                                                     max_keepalive_connections=64))
            client = httpx.AsyncClient(transport=transport, base_url=BASE_URL, headers=self._headers,
                                       timeout=_timeout(READ_TIMEOUT_SECONDS), trust_env=False)
            held = self._clients[id(loop)] = (loop, client)
        return held[1]

    async def post(self, path: str, body: dict[str, Any]) -> bytes:
        """The raw JSON answer of a request that is not streamed."""
        try:
            response = await self._client().post(path, json=body)
        except httpx.HTTPError as exc:
            raise _typed(exc) from None
        if response.status_code != 200:
            raise UpstreamError(response.status_code, _message(response.status_code, response.content))
        return response.content

    async def open_stream(self, path: str, body: dict[str, Any]) -> Upstream:
        """A streamed (SSE) answer whose status is known (``UpstreamError`` when it is not 200): its raw
        bytes follow with ``Upstream.chunks``. Closing it early closes the connection: llama-server then
        stops generating."""
        client = self._client()
        try:
            response = await client.send(client.build_request("POST", path, json=body), stream=True)
        except httpx.HTTPError as exc:
            raise _typed(exc) from None
        if response.status_code != 200:
            try:
                raise UpstreamError(response.status_code, _message(response.status_code, await response.aread()))
            finally:
                await response.aclose()
        return Upstream(response)

    def close(self) -> None:
        """Close every pool: on its own loop when that loop still runs, else drop it (its connections
        die with the server)."""
        clients, self._clients = list(self._clients.values()), {}
        for loop, client in clients:
            if not loop.is_closed() and loop.is_running():
                asyncio.run_coroutine_threadsafe(client.aclose(), loop)


class Upstream:
    """An open streamed answer: its raw bytes as they arrive, and ``aclose`` (idempotent)."""

    def __init__(self, response: httpx.Response) -> None:
        self._response = response

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body's bytes; a broken connection raises ``EngineGone`` (a read timeout ``UpstreamError``)."""
        try:
            async for chunk in self._response.aiter_raw():
                yield chunk
        except httpx.HTTPError as exc:
            raise _typed(exc) from None

    async def aclose(self) -> None:
        await self._response.aclose()
