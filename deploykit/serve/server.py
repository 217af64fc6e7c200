"""Run the app with uvicorn: bind first (``/healthz`` answers at once, ``/readyz`` says what is still
loading), then load the deployments on a background thread; SIGTERM or SIGINT stops accepting
connections, lets running requests and streams finish (up to ``drain_timeout``), then returns so the
caller can free the models.

With a control listener of its own (``--control-socket``: a unix socket, mode 0600), a second uvicorn
server on the same event loop answers there, without TLS, and stops with the first."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import stat
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import uvicorn

from ..errors import DeploykitError
from ..threads import ThreadGroup
from .connections import HEADER_TIMEOUT, MAX_HEADER_BYTES, bounded_h11

log = logging.getLogger(__name__)


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, or an error that says why not (port in use, address not here)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise DeploykitError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def bind_unix(path: str) -> socket.socket:
    """A listening unix socket at ``path`` with mode 0600 (only this user may connect), made so from the
    start; a stale socket left by a crash is replaced, any other file is an error."""
    try:
        if stat.S_ISSOCK(os.lstat(path).st_mode):
            os.unlink(path)
        else:
            raise DeploykitError(f"cannot listen on {path}: it exists and is not a socket")
    except FileNotFoundError:
        pass
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    previous = os.umask(0o177)
    try:
        sock.bind(path)
    except OSError as exc:
        sock.close()
        raise DeploykitError(f"cannot listen on {path}: {exc.strerror or exc}") from None
    finally:
        os.umask(previous)
    os.chmod(path, 0o600)
    sock.listen(2048)
    return sock


class _Server(uvicorn.Server):
    """uvicorn's server that starts ``on_started`` (on a thread of ``threads``) once it listens, and
    ``on_stopping`` (on another) as soon as a signal asks it to stop, before it drains."""

    def __init__(self, config: uvicorn.Config, on_started: Callable[[], None], threads: ThreadGroup,
                 on_stopping: Callable[[], None] | None = None) -> None:
        super().__init__(config)
        self._on_started, self._threads, self._on_stopping = on_started, threads, on_stopping
        self._stopping = False
        self.beside: uvicorn.Server | None = None  # the control listener's server, stopped with this one

    def handle_exit(self, sig: int, frame: Any) -> None:
        super().handle_exit(sig, frame)
        for server in (self, self.beside):
            if server is not None and hasattr(server.config.app, "stopping"):  # the drain's cancels are no error
                server.config.app.stopping = True
        if self.beside is not None:
            self.beside.should_exit, self.beside.force_exit = self.should_exit, self.force_exit
        if self._on_stopping is not None and not self._stopping:  # once: a second signal forces the exit
            self._stopping = True
            self._threads.start(self._on_stopping, name="deploykit-stopping")  # never block the handler

    async def serve_beside(self, sock: socket.socket, beside: uvicorn.Server, beside_sock: socket.socket) -> None:
        """Serve ``sock``, and ``beside`` on ``beside_sock``, until a signal stops both."""
        self.beside = beside
        with self.capture_signals():
            await asyncio.gather(self._serve([sock]), beside._serve([beside_sock]))

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        if self.started:
            self._threads.start(self._run_on_started, name="deploykit-start")

    def _run_on_started(self) -> None:
        try:
            self._on_started()
        except Exception:  # the server keeps answering /healthz and /readyz says what failed
            log.exception("loading the deployments failed")


MAX_CONNECTIONS = 1024  # open connections and tasks; beyond, uvicorn answers 503 at once


@dataclass(frozen=True)
class Listening:
    """How ``run`` listens: drain on stop, header deadline, TLS (uvicorn's own ``ssl_certfile`` and
    ``ssl_keyfile``), and the most connections served at once."""

    drain_timeout: float = 30.0
    header_timeout: float = HEADER_TIMEOUT
    tls_cert: str | None = None
    tls_key: str | None = None
    max_connections: int = MAX_CONNECTIONS


def _config(app: Any, listening: Listening, *, tls: bool) -> uvicorn.Config:
    return uvicorn.Config(app, log_level="warning", lifespan="off",
                          timeout_graceful_shutdown=int(listening.drain_timeout), access_log=False,
                          http=bounded_h11(listening.header_timeout), h11_max_incomplete_event_size=MAX_HEADER_BYTES,
                          ssl_certfile=listening.tls_cert if tls else None,
                          ssl_keyfile=listening.tls_key if tls else None,
                          limit_concurrency=listening.max_connections,
                          server_header=False)  # no "server: uvicorn": what runs behind is not the client's


def run(app: Any, sock: socket.socket, *, on_started: Callable[[], None], threads: ThreadGroup,
        listening: Listening = Listening(), on_stopping: Callable[[], None] | None = None,
        control: tuple[Any, socket.socket] | None = None) -> None:
    """Serve ``app`` on ``sock`` until a signal; ``on_started`` runs on a thread of ``threads`` (the caller
    joins it) once serving, ``on_stopping`` on another as soon as a signal arrives (a canary's step must
    not outlast the drain: an apply streaming its progress would hold its connection open). Connections
    are ``connections.BoundedH11``: headers bounded in size and in time (``header_timeout``). ``control``:
    (app, unix socket) of the control listener, served beside ``sock`` (plain HTTP) and stopped with it."""
    server = _Server(_config(app, listening, tls=True), on_started, threads, on_stopping)
    # uvicorn handles SIGTERM/SIGINT while it runs, then raises them again for the handler it found:
    # make that one a no-op, so the caller goes on to free the models and exits 0.
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        if control is None:
            server.run(sockets=[sock])
        else:
            beside = uvicorn.Server(_config(control[0], listening, tls=False))
            asyncio.run(server.serve_beside(sock, beside, control[1]))
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
