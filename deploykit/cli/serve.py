"""`deploykit serve`: the long-running owner of deployments."""

from __future__ import annotations

from pathlib import Path

import click

from ..errors import DeploykitError
from .console import STATE_OPTION, err, handle_errors, store


@click.command()
@click.argument("path", type=click.Path(exists=True))
@click.option("--port", type=int, default=8765, show_default=True, help="Port on 127.0.0.1.")
@click.option("--prune", is_flag=True, help="Remove deployments whose manifest files are removed.")
@click.option("--devices", metavar="SPEC", default=None, help="Simulated inventory (CPU-only plans).")
@click.option("--debounce", type=float, default=0.3, show_default=True, help="Seconds a burst of file "
              "events must settle before reloading.")
@STATE_OPTION
@handle_errors
def serve(path: str, port: int, prune: bool, devices: str | None, debounce: float,
          state_dir: str | None) -> None:
    """Hold every deployment in PATH (a manifest or a directory of manifests), reload them when their
    files change, and answer /healthz, /readyz, /status and /metrics on 127.0.0.1:PORT."""
    import signal
    import threading

    from ..control.supervisor import Supervisor
    from ..serve.server import make_server

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    supervisor = Supervisor(Path(path), store=store(state_dir), devices=devices, prune=prune,
                            debounce=debounce)
    try:
        server = make_server(supervisor, port=port)
    except OSError as exc:
        raise DeploykitError(f"cannot listen on 127.0.0.1:{port}: {exc.strerror}") from None
    threading.Thread(target=server.serve_forever, name="deploykit-http", daemon=True).start()
    err.print(f"deploykit serve: http://127.0.0.1:{port} (/healthz /readyz /status /metrics); loading…")
    supervisor.start()
    names = ", ".join(supervisor.deployments) or "none"
    err.print(f"deploykit serve: serving {len(supervisor.deployments)} deployment(s): {names}; "
              f"watching {supervisor.path}")
    for file, problem in supervisor.errors.items():
        err.print(f"deploykit serve: {file}: not deployed: {problem}", markup=False)
    stop.wait()
    err.print("deploykit serve: stopping: draining in-flight work")
    server.shutdown()
    supervisor.close()
    err.print("deploykit serve: stopped")
