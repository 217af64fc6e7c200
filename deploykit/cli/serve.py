"""`deploykit serve`: the long-running owner of deployments and their OpenAI-compatible API."""

from __future__ import annotations

import os
from pathlib import Path

import click

from .console import STATE_OPTION, err, handle_errors, store


@click.command()
@click.argument("path", type=click.Path(exists=True))
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on; anything but loopback needs --api-key.")
@click.option("--port", type=int, default=8765, show_default=True, help="Port to listen on.")
@click.option("--api-key", envvar="DEPLOYKIT_API_KEY", default=None,
              help="Bearer key every request must send (default: $DEPLOYKIT_API_KEY; none on loopback).")
@click.option("--prune", is_flag=True, help="Remove deployments whose manifest files are removed.")
@click.option("--devices", metavar="SPEC", default=None, help="Simulated inventory (CPU-only plans).")
@click.option("--debounce", type=float, default=0.3, show_default=True, help="Seconds a burst of file "
              "events must settle before reloading.")
@click.option("--drain-timeout", type=float, default=30.0, show_default=True,
              help="Seconds running requests get to finish on SIGTERM.")
@STATE_OPTION
@handle_errors
def serve(path: str, host: str, port: int, api_key: str | None, prune: bool, devices: str | None,
          debounce: float, drain_timeout: float, state_dir: str | None) -> None:
    """Hold every deployment in PATH (a manifest or a directory of manifests), reload them when their
    files change, and serve them: the OpenAI-compatible API (/v1/models, /v1/chat/completions,
    /v1/completions, /v1/embeddings) and /healthz, /readyz, /status, /metrics."""
    from ..control.state import open_store
    from ..control.supervisor import Supervisor
    from ..serve.app import create_app
    from ..serve.auth import check_bind
    from ..serve.server import bind, run

    check_bind(host, api_key)
    supervisor = Supervisor(Path(path), store=open_store(store(state_dir).directory), devices=devices,
                            prune=prune, debounce=debounce)
    sock = bind(host, port)
    url = f"http://{host if ':' not in host else f'[{host}]'}:{sock.getsockname()[1]}"

    def start() -> None:
        supervisor.start()
        names = ", ".join(n for n, _ in supervisor.items()) or "none"
        err.print(f"deploykit serve: serving {len(supervisor.items())} deployment(s): {names}; "
                  f"watching {supervisor.path}", markup=False)
        for file, problem in supervisor.errors.items():
            err.print(f"deploykit serve: {file}: not deployed: {problem}", markup=False)

    err.print(f"deploykit serve: {url} (/v1 API, /healthz /readyz /status /metrics); loading…", markup=False)
    try:
        run(create_app(supervisor, api_key=api_key), sock, on_started=start, drain_timeout=drain_timeout)
    finally:
        err.print("deploykit serve: stopping: draining in-flight work")
        supervisor.close()
        err.print("deploykit serve: stopped")
    os.environ.pop("DEPLOYKIT_API_KEY", None)
