"""`deploykit serve`: the long-running owner of deployments and their OpenAI-compatible API."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import click

from ..errors import DeploykitError
from ..files import read_regular_file
from .console import STATE_OPTION, err, handle_errors, store

if TYPE_CHECKING:
    from ..spec.source import GitSource


@click.command()
@click.argument("path", type=click.Path(exists=True), required=False)
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on; anything but loopback needs --api-key.")
@click.option("--port", type=int, default=8765, show_default=True, help="Port to listen on.")
@click.option("--api-key", envvar="DEPLOYKIT_API_KEY", default=None,
              help="Bearer key every request must send (default: $DEPLOYKIT_API_KEY; none on loopback); at least "
                   "16 characters. On the command line every local user can read it: prefer the variable or "
                   "--api-key-file.")
@click.option("--api-key-file", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Read --api-key from this file (its first line).")
@click.option("--control-token", envvar="DEPLOYKIT_TOKEN", default=None,
              help="Bearer token of the control API (default: $DEPLOYKIT_TOKEN, else a random one); at least 16 "
                   "characters; written to <state dir>/server.json (mode 0600) for the CLI. Prefer the variable "
                   "or --control-token-file to the command line.")
@click.option("--control-token-file", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Read --control-token from this file (its first line).")
@click.option("--control-socket", type=click.Path(dir_okay=False), default=None, metavar="PATH",
              help="Serve the control API on this unix socket only (mode 0600: this user alone), not on --host: "
                   "/control there answers 404, so /v1 can face the network while /control does not. The CLI "
                   "finds it through server.json.")
@click.option("--source", "source_file", type=click.Path(exists=True, dir_okay=False), default=None, metavar="FILE",
              help="Follow the git repository a `kind: GitSource` file declares (instead of PATH): fetched into "
                   "the state directory, each commit checked whole before it applies. docs/gitops.md.")
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
@click.option("--allow-path", "allow_paths", multiple=True, type=click.Path(file_okay=False), metavar="DIR",
              help="A directory the manifests this server makes live (watched, applied, rolled back, restored) may "
                   "name paths in (every path field, links followed); repeatable. Default: any path. "
                   "docs/control.md#the-admission-gate.")
@click.option("--allow-engine-binary", is_flag=True,
              help="Let manifests name spec.engine.binary (a program this server runs).")
@click.option("--allow-remote-code", is_flag=True,
              help="Let manifests set spec.model.trust_remote_code (Python from the checkpoint).")
@click.option("--allow-cluster", is_flag=True, help="Let manifests name spec.cluster (a Ray cluster to join).")
@click.option("--tls-cert", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Serve HTTPS with this certificate (PEM; with --tls-key). The CLI trusts it through "
                   "server.json, other clients through their CA store.")
@click.option("--tls-key", type=click.Path(exists=True, dir_okay=False), default=None,
              help="The private key of --tls-cert (PEM).")
@click.option("--body-timeout", type=click.FloatRange(min=0, min_open=True), default=30.0, show_default=True,
              help="Seconds a client has to send a request's body; then 408.")
@click.option("--stream-send-timeout", type=click.FloatRange(min=0, min_open=True), default=30.0, show_default=True,
              help="Seconds a stream waits for its client to take a chunk; then the stream ends and its "
                   "generation is released.")
@click.option("--openapi", is_flag=True, help="Serve /openapi.json (behind --api-key, if given); off by default.")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default="warning",
              show_default=True, help="Least severe log lines written to stderr (loads, frees, client disconnects).")
@STATE_OPTION
@handle_errors
def serve(path: str | None, source_file: str | None, host: str, port: int, api_key: str | None,
          api_key_file: str | None, control_token: str | None, control_token_file: str | None,
          control_socket: str | None, prune: bool,
          devices: str | None, budget: str | None, budget_timeout: float, debounce: float, drain_timeout: float,
          header_timeout: float, allow_paths: tuple[str, ...], allow_engine_binary: bool, allow_remote_code: bool,
          allow_cluster: bool, tls_cert: str | None, tls_key: str | None, body_timeout: float,
          stream_send_timeout: float, openapi: bool, log_level: str, state_dir: str | None) -> None:
    """Hold every deployment in PATH (a manifest or a directory of manifests), reload them when their
    files change, and serve them: the OpenAI-compatible API (/v1/models, /v1/chat/completions,
    /v1/completions, /v1/embeddings) and /healthz, /readyz, /status, /metrics.

    Without PATH: serve every deployment recorded in the state store (restored after a restart). Either
    way, `deploykit apply/diff/status/history/rollback/delete` send their work to this server through
    its control API (/control/v1), found via <state dir>/server.json.
    """
    from ..cluster.ray_env import disconnect
    from ..control.budget import serve_budget
    from ..control.admission import Policy
    from ..control.budget.host import Host
    from ..control.revisions.state import open_store
    from ..control.live.supervisor import Supervisor
    from ..control.sources.worker import SourceSync, Sources, live_directory, source_root
    from ..serve.app import WithoutControl, create_app
    from ..serve.auth import check_bind, loopback_hosts
    from ..serve.discovery import find_server, new_token, remove_server_file, server_info, write_server_file
    from ..serve.server import Listening, bind, bind_unix, run
    from ..threads import ThreadGroup

    api_key = _secret("--api-key", api_key, api_key_file)
    control_token = _secret("--control-token", control_token, control_token_file)
    _distinct_secrets(api_key, control_token)
    for variable in ("DEPLOYKIT_API_KEY", "DEPLOYKIT_TOKEN"):  # read: no child process inherits them
        os.environ.pop(variable, None)
    check_bind(host, api_key)
    _check_tls(tls_cert, tls_key)
    policy = Policy.of(path_roots=allow_paths, engine_binary=allow_engine_binary,
                              remote_code=allow_remote_code, cluster=allow_cluster)
    _log_to_stderr(log_level)
    states = open_store(store(state_dir).directory)
    source = _load_source(source_file, path)
    other = find_server(states.directory)
    if other is not None:
        raise DeploykitError(f"another deploykit serve (pid {other.pid}, {other.url}) already owns the state "
                             f"directory {states.directory}; stop it, or use another --state-dir")
    token = control_token or new_token()
    budget_source = "--budget" if budget is None or os.environ.get("DEPLOYKIT_BUDGET") != budget else "DEPLOYKIT_BUDGET"
    budgeted = Host(serve_budget(budget, devices, source=budget_source), wait_timeout=budget_timeout)
    followed = source_root(states.directory, source.name) if source is not None else None
    if followed is not None:
        followed.mkdir(parents=True, exist_ok=True, mode=0o700)
    watched = live_directory(followed) if followed is not None else Path(path) if path else None
    supervisor = Supervisor(watched, store=states, devices=devices, prune=prune or bool(source and source.spec.prune),
                            debounce=debounce, host=budgeted, policy=policy, rollback_owned=source is not None)
    sources = Sources([SourceSync(source, root=followed, supervisor=supervisor)]
                      if source is not None and followed is not None else [])
    sock = bind(host, port)
    control_sock = bind_unix(control_socket) if control_socket else None
    scheme = "https" if tls_cert else "http"
    url = _url(scheme, host, sock.getsockname()[1])
    local_url = _url(scheme, _connectable(host), sock.getsockname()[1])  # server.json's: one the CLI can reach
    written = False
    owned = ThreadGroup()  # the thread that loads the deployments once the server listens

    def start() -> None:
        nonlocal written
        write_server_file(states.directory, server_info(local_url, token, cacert=tls_cert,
                                                        control_socket=control_socket))
        written = True
        supervisor.start()  # a source's last applied commit serves from disk: nothing is fetched first
        sources.start()
        names = ", ".join(n for n, _ in supervisor.items()) or "none"
        following = (f"following the git source {source.name} ({source.spec.url}, {source.spec.ref.describe()})"
                     if source is not None else f"watching {supervisor.path}" if supervisor.path
                     else "restored from the state store")
        err.print(f"deploykit serve: serving {len(supervisor.items())} deployment(s): {names}; {following}; "
                  f"under {budgeted.budget.describe()}", markup=False)
        for file, problem in supervisor.problems().items():
            err.print(f"deploykit serve: {file}: not deployed: {problem}", markup=False)

    where = f"/control/v1 on {control_socket} only" if control_socket else "/control/v1"
    err.print(f"deploykit serve: {url} (/v1 API, /healthz /readyz /status /metrics, {where}); "
              f"{policy.describe()}; loading…", markup=False)
    listening = Listening(drain_timeout=drain_timeout, header_timeout=header_timeout, tls_cert=tls_cert,
                          tls_key=tls_key)
    try:
        app = create_app(supervisor, api_key=api_key, control_token=token, openapi=openapi, sources=sources,
                         allowed_hosts=loopback_hosts(host, api_key), body_timeout=body_timeout,
                         stream_send_timeout=stream_send_timeout)
        main, control = (app, None) if control_sock is None else (WithoutControl(app), (app, control_sock))
        run(main, sock, on_started=start, threads=owned, listening=listening, on_stopping=supervisor.interrupt,
            control=control)
    finally:
        if control_socket:
            Path(control_socket).unlink(missing_ok=True)
        if written:
            remove_server_file(states.directory, token)
        err.print("deploykit serve: stopping: draining in-flight work")
        try:
            sources.close()  # a fetch under way is killed: nothing is published while the deployments close
            supervisor.close()  # waits for loads under way: nothing uses Ray after this
            _report_left(owned.join(drain_timeout))
        finally:
            _leave_ray(disconnect)
        err.print("deploykit serve: stopped")
        # daemon threads (Ray's, engines') may still log while the interpreter shuts down; a write to
        # stderr then aborts the process ("could not acquire lock ... at interpreter shutdown")
        logging.getLogger("deploykit").handlers.clear()


def _load_source(source_file: str | None, path: str | None) -> GitSource | None:
    """The GitSource of ``--source`` (refused beside PATH: a server follows one or the other)."""
    if source_file is None:
        return None
    if path is not None:
        raise DeploykitError("give PATH or --source, not both: a server follows a directory or a git source")
    from ..spec.source import load_source

    return load_source(source_file)


MIN_SECRET = 16  # characters of an API key or control token: guessing one online must be hopeless
MAX_SECRET_FILE = 64 << 10  # a key file holds one line; a device or a huge file is refused, not read


def _secret(flag: str, given: str | None, file: str | None) -> str | None:
    """An API key or control token from its flag, its variable or its file; said on stderr when it was
    typed on the command line (every local user can read a process's arguments)."""
    if file is not None:
        if given is not None and _from_command_line(flag):
            raise DeploykitError(f"give {flag} or {flag}-file, not both")
        try:
            lines = read_regular_file(file, MAX_SECRET_FILE).decode("utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            raise DeploykitError(f"cannot read {flag}-file {file}: {exc}") from None
        given = lines[0].strip() if lines else ""
    elif given is not None and _from_command_line(flag):
        err.print(f"deploykit serve: warning: {flag} on the command line is visible to every user of this machine "
                  f"(ps, /proc); use {flag}-file or the environment variable", markup=False)
    if given is not None and len(given) < MIN_SECRET:
        raise DeploykitError(f"{flag} must be at least {MIN_SECRET} characters (got {len(given)}); "
                             "e.g. python -c 'import secrets; print(secrets.token_urlsafe(32))'")
    return given


def _distinct_secrets(api_key: str | None, control_token: str | None) -> None:
    """The control token changes deployments; the API key only uses them: one secret for both would give
    every API client the operator's power."""
    import hmac

    if api_key and control_token and hmac.compare_digest(api_key.encode(), control_token.encode()):
        raise DeploykitError("the control token is the API key: every API client could then change deployments; "
                             "give --control-token (or DEPLOYKIT_TOKEN) a secret of its own, or leave it unset "
                             "(a new one is made and written to <state dir>/server.json)")


def _url(scheme: str, host: str, port: int) -> str:
    return f"{scheme}://{host if ':' not in host else f'[{host}]'}:{port}"


def _connectable(host: str) -> str:
    """Where a client on this machine reaches a server bound to ``host``: the loopback address for an
    unspecified one (``0.0.0.0``, ``::``), which is no address to connect to (and, through a proxy, would
    send the control token off this machine)."""
    import ipaddress

    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return host
    if address.is_unspecified:
        return "127.0.0.1" if address.version == 4 else "::1"
    return host


def _from_command_line(flag: str) -> bool:
    from click.core import ParameterSource

    name = flag.lstrip("-").replace("-", "_")
    return click.get_current_context().get_parameter_source(name) == ParameterSource.COMMANDLINE


def _check_tls(cert: str | None, key: str | None) -> None:
    """Both or neither, and a pair that loads: said now, not as a traceback once uvicorn starts."""
    import ssl

    if (cert is None) != (key is None):
        raise DeploykitError("--tls-cert and --tls-key go together: give both, or neither")
    if cert is None:
        return
    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(cert, key)
    except (ssl.SSLError, OSError) as exc:
        raise DeploykitError(f"cannot use --tls-cert {cert} with --tls-key {key}: {exc}") from None


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
