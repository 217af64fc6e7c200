"""`deploykit serve`: the long-running owner of deployments and their OpenAI-compatible API."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path

import click

from ..errors import DeploykitError
from .console import STATE_OPTION, err, handle_errors, store


@click.command()
@click.argument("path", type=click.Path(exists=True), required=False)
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on; anything but loopback needs --api-key.")
@click.option("--port", type=int, default=8765, show_default=True, help="Port to listen on.")
@click.option("--api-key", envvar="DEPLOYKIT_API_KEY", default=None,
              help="Bearer key every request must send (default: $DEPLOYKIT_API_KEY; none on loopback).")
@click.option("--control-token", envvar="DEPLOYKIT_TOKEN", default=None,
              help="Bearer token of the control API (default: $DEPLOYKIT_TOKEN, else a random one); "
                   "written to <state dir>/server.json (mode 0600) for the CLI.")
@click.option("--prune", is_flag=True, help="Remove deployments whose manifest files are removed.")
@click.option("--devices", metavar="SPEC", default=None, help="Simulated inventory (CPU-only plans).")
@click.option("--debounce", type=float, default=0.3, show_default=True, help="Seconds a burst of file "
              "events must settle before reloading.")
@click.option("--budget", envvar="DEPLOYKIT_BUDGET", metavar="TIER=SIZE,...", default=None,
              help="The most all deployments may hold together, e.g. cpu=6GiB or cpu=32GiB,gpu0=20GiB "
                   "(default: $DEPLOYKIT_BUDGET, else what the host has). docs/budget.md.")
@click.option("--budget-timeout", type=float, default=120.0, show_default=True,
              help="Seconds a request for an unloaded model waits for room before a 503.")
@click.option("--drain-timeout", type=float, default=30.0, show_default=True,
              help="Seconds running requests get to finish on SIGTERM.")
@click.option("--header-timeout", type=click.FloatRange(min=0, min_open=True), default=10.0, show_default=True,
              help="Seconds a client has to send a request's headers; then 408 and the connection is closed.")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default="warning",
              show_default=True, help="Least severe log lines written to stderr (loads, frees, client disconnects).")
@STATE_OPTION
@handle_errors
def serve(path: str | None, host: str, port: int, api_key: str | None, control_token: str | None, prune: bool,
          devices: str | None, budget: str | None, budget_timeout: float, debounce: float, drain_timeout: float,
          header_timeout: float, log_level: str, state_dir: str | None) -> None:
    """Hold every deployment in PATH (a manifest or a directory of manifests), reload them when their
    files change, and serve them: the OpenAI-compatible API (/v1/models, /v1/chat/completions,
    /v1/completions, /v1/embeddings) and /healthz, /readyz, /status, /metrics.

    Without PATH: serve every deployment recorded in the state store (restored after a restart). Either
    way, `deploykit apply/diff/status/history/rollback/delete` send their work to this server through
    its control API (/control/v1), found via <state dir>/server.json.
    """
    from ..cluster.ray_env import disconnect
    from ..control.budget import serve_budget
    from ..control.budget.host import Host
    from ..control.revisions.state import open_store
    from ..control.live.supervisor import Supervisor
    from ..serve.app import create_app
    from ..serve.auth import check_bind
    from ..serve.discovery import find_server, new_token, remove_server_file, server_info, write_server_file
    from ..serve.server import bind, run
    from ..threads import ThreadGroup

    check_bind(host, api_key)
    _log_to_stderr(log_level)
    states = open_store(store(state_dir).directory)
    other = find_server(states.directory)
    if other is not None:
        raise DeploykitError(f"another deploykit serve (pid {other.pid}, {other.url}) already owns the state "
                             f"directory {states.directory}; stop it, or use another --state-dir")
    token = control_token or new_token()
    budget_source = "--budget" if budget is None or os.environ.get("DEPLOYKIT_BUDGET") != budget else "DEPLOYKIT_BUDGET"
    budgeted = Host(serve_budget(budget, devices, source=budget_source), wait_timeout=budget_timeout)
    supervisor = Supervisor(Path(path) if path else None, store=states, devices=devices, prune=prune,
                            debounce=debounce, host=budgeted)
    sock = bind(host, port)
    url = f"http://{host if ':' not in host else f'[{host}]'}:{sock.getsockname()[1]}"
    written = False
    owned = ThreadGroup()  # the thread that loads the deployments once the server listens

    def start() -> None:
        nonlocal written
        write_server_file(states.directory, server_info(url, token))
        written = True
        supervisor.start()
        names = ", ".join(n for n, _ in supervisor.items()) or "none"
        source = f"watching {supervisor.path}" if supervisor.path else "restored from the state store"
        err.print(f"deploykit serve: serving {len(supervisor.items())} deployment(s): {names}; {source}; "
                  f"under {budgeted.budget.describe()}", markup=False)
        for file, problem in supervisor.problems().items():
            err.print(f"deploykit serve: {file}: not deployed: {problem}", markup=False)

    err.print(f"deploykit serve: {url} (/v1 API, /healthz /readyz /status /metrics, /control/v1); loading…",
              markup=False)
    try:
        run(create_app(supervisor, api_key=api_key, control_token=token), sock, on_started=start,
            threads=owned, drain_timeout=drain_timeout, header_timeout=header_timeout,
            on_stopping=supervisor.interrupt)
    finally:
        if written:
            remove_server_file(states.directory, token)
        err.print("deploykit serve: stopping: draining in-flight work")
        try:
            supervisor.close()  # waits for loads under way: nothing uses Ray after this
            _report_left(owned.join(drain_timeout))
        finally:
            _leave_ray(disconnect)
        err.print("deploykit serve: stopped")
        # daemon threads (Ray's, engines') may still log while the interpreter shuts down; a write to
        # stderr then aborts the process ("could not acquire lock ... at interpreter shutdown")
        logging.getLogger("deploykit").handlers.clear()
    os.environ.pop("DEPLOYKIT_API_KEY", None)


def _report_left(names: list[str]) -> None:
    """Say which of deploykit's threads are still running once everything was closed (none should be)."""
    import threading

    left = sorted({t.name for t in threading.enumerate() if t.name.startswith("deploykit")} | set(names))
    if left:
        err.print(f"deploykit serve: threads still running after close: {', '.join(left)}", markup=False)


def _leave_ray(disconnect: Callable[[], None]) -> None:
    """Leave the Ray cluster (if joined) without hiding why the server stopped."""
    try:
        disconnect()
    except Exception as exc:  # noqa: BLE001 - stopping anyway; say it, keep the original error
        err.print(f"deploykit serve: leaving the Ray cluster failed: {exc}", markup=False)


def _log_to_stderr(level: str) -> None:
    """deploykit's own log lines, one per line, on stderr (library code only logs; it never prints).
    At the default level Python's own last-resort handler already writes warnings and errors: no
    handler is installed then (one installed aborted a Ray-connected server at exit, seen here)."""
    if level in ("warning", "error"):
        logging.getLogger("deploykit").setLevel(level.upper())
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("deploykit serve: %(levelname)s %(name)s: %(message)s"))
    logger = logging.getLogger("deploykit")
    logger.addHandler(handler)
    logger.setLevel(level.upper())
    logger.propagate = False  # libraries that configure the root logger (Ray) would print each line twice
