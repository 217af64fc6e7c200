"""Finding a running ``deploykit serve`` and handing it work over its control API (docs/control.md).

``connect`` returns a ``Remote`` when a server is there (``--server URL`` with ``$DEPLOYKIT_TOKEN``, else
a live ``<state dir>/server.json``), else None: the verb then works alone. Stdlib HTTP only: this path
never imports torch, transformers, accelerate or the web stack.
"""

from __future__ import annotations

import http.client
import json
import os
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import click

from ..errors import DeploykitError

_SERVER = click.option("--server", metavar="URL", default=None, envvar="DEPLOYKIT_SERVER",
                       help="A running `deploykit serve` to send the work to (token: $DEPLOYKIT_TOKEN). "
                            "Default: the one in <state dir>/server.json, if it runs; else work alone.")
_CACERT_KEY = "deploykit.cacert"


def _remember_cacert(ctx: click.Context, _: click.Parameter, value: str | None) -> None:
    if value:
        ctx.meta[_CACERT_KEY] = value


_CACERT = click.option("--cacert", metavar="FILE", envvar="DEPLOYKIT_CACERT", expose_value=False,
                       callback=_remember_cacert, type=click.Path(exists=True, dir_okay=False),
                       help="CA certificate(s) (PEM) to trust for an https --server (default: $DEPLOYKIT_CACERT, "
                            "else the system's store; server.json names a local server's own).")


def SERVER_OPTION(command: Any) -> Any:  # noqa: N802 - used as the decorator constant it replaces
    """``--server URL`` and ``--cacert FILE``: where the control API is, and whom to trust for https."""
    return _SERVER(_CACERT(command))


def given_cacert() -> str | None:
    """The ``--cacert`` (or ``$DEPLOYKIT_CACERT``) of the running command, if any."""
    ctx = click.get_current_context(silent=True)
    return ctx.meta.get(_CACERT_KEY) if ctx is not None else os.environ.get("DEPLOYKIT_CACERT")


def is_local(host: str) -> bool:
    """Whether ``host`` is this machine: a loopback name or address, or the unspecified address a server
    listening on every interface is reached at here (``0.0.0.0``, ``::``)."""
    import ipaddress

    if host.lower() == "localhost":
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    return address.is_loopback or address.is_unspecified


def opener_for(url: str, cacert: str | None) -> urllib.request.OpenerDirector:
    """A stdlib opener for ``url``: no proxy for a local server (``HTTP(S)_PROXY`` would otherwise carry
    the control token off this machine), and for https a context that verifies the server against
    ``cacert`` (else the system's CA store)."""
    import ssl

    from ..serve.discovery import UNIX, UnixHandler

    if url.startswith(UNIX):  # the server's own control socket: this machine, no proxy
        return urllib.request.build_opener(urllib.request.ProxyHandler({}), UnixHandler(url[len(UNIX):]))
    host = urllib.parse.urlsplit(url).hostname or ""
    handlers: list[urllib.request.BaseHandler] = []
    if is_local(host):
        handlers.append(urllib.request.ProxyHandler({}))
    if url.startswith("https:"):
        handlers.append(urllib.request.HTTPSHandler(context=ssl.create_default_context(cafile=cacert)))
    return urllib.request.build_opener(*handlers)
TIMEOUT = 60.0  # seconds without a byte from the server (it sends a heartbeat every 5 s while working)


class Remote:
    """The control API of one server."""

    def __init__(self, url: str, token: str, origin: str, cacert: str | None = None,
                 api_url: str | None = None) -> None:
        self.url = url.rstrip("/")
        self.api_url = (api_url or url).rstrip("/")  # the /v1 API's (``url`` may be the control socket)
        self.token = token
        self.origin = origin  # where the URL came from, for messages
        self.cacert = cacert
        self._opener = opener_for(self.url, cacert)

    def _open(self, method: str, path: str, payload: Any = None) -> Any:
        data = json.dumps(payload).encode() if payload is not None else None
        base = "http://localhost" if self.url.startswith("unix:") else self.url  # a socket: UnixHandler's
        request = urllib.request.Request(f"{base}/control/v1{path}", data=data, method=method,
                                         headers={"Authorization": f"Bearer {self.token}",
                                                  "Content-Type": "application/json"})
        try:
            return self._opener.open(request, timeout=TIMEOUT)
        except urllib.error.HTTPError as exc:
            body = exc.read()
            if exc.code == 401:
                raise DeploykitError(f"the deploykit server at {self.url} refused the control token (401); "
                                     f"the token comes from {self.origin}") from None
            try:
                event = json.loads(body)
            except ValueError:
                raise DeploykitError(f"the deploykit server at {self.url} answered {exc.code}: "
                                     f"{body.decode(errors='replace')[:500]}") from None
            if isinstance(event, dict) and event.get("event") == "error":
                raise RemoteError(event) from None
            raise DeploykitError(f"the deploykit server at {self.url} answered {exc.code}: {event}") from None
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise DeploykitError(f"cannot reach the deploykit server at {self.url} ({self.origin}): {reason}") from None

    def call(self, method: str, path: str, payload: Any = None) -> Any:
        """A request with a JSON answer; an error answer raises ``RemoteError``."""
        with self._open(method, path, payload) as response:
            try:
                return json.loads(response.read())
            except (OSError, http.client.HTTPException) as exc:
                raise self._gone(f"{method} {path}", exc) from None

    def run(self, path: str, payload: Any, *, what: str, bar: Any = None,
            on_step: Callable[[str], None] | None = None,
            on_wait: Callable[[str], None] | None = None) -> dict[str, Any]:
        """A streamed operation: render its progress, return its last event (a result or an error)."""
        for event in self._stream(path, payload, what):
            kind = event.get("event")
            if kind == "step" and on_step is not None:
                on_step(event["step"])
            elif kind == "progress" and bar is not None:
                bar.start(event["total"], event["done"])
            elif kind == "advance" and bar is not None and bar.task is not None:
                bar.advance(event["bytes"])
            elif kind == "wait" and on_wait is not None:
                on_wait(event["message"])
            elif kind in ("result", "error"):
                return event
        raise self._gone(what, None)

    def _stream(self, path: str, payload: Any, what: str) -> Iterator[dict[str, Any]]:
        response = self._open("POST", path, payload)
        try:
            while True:
                try:
                    line = response.readline()
                except (OSError, http.client.HTTPException) as exc:
                    raise self._gone(what, exc) from None
                if not line:
                    return
                if line.strip():
                    yield json.loads(line)
        finally:
            response.close()

    def _gone(self, what: str, exc: BaseException | None) -> DeploykitError:
        why = f" ({type(exc).__name__}: {exc})" if exc is not None else ""
        return DeploykitError(f"the deploykit server at {self.url} went away during the {what}{why}. On the "
                              "server the change either completed or the last good revision still serves: "
                              "`deploykit status` says which; applying again resumes it")


class RemoteError(DeploykitError):
    """An error event from the server: ``kind`` manifest (``issues``), plan, error or internal (``message``)."""

    def __init__(self, event: dict[str, Any]) -> None:
        self.event = event
        self.kind = str(event.get("kind", "error"))
        self.issues = [str(i) for i in event.get("issues") or []]
        self.message = str(event.get("message") or "\n".join(self.issues))
        super().__init__(self.message if self.kind != "internal" else f"internal error on the server: {self.message}")


def connect(server: str | None, state_dir: str | None) -> Remote | None:
    """The server to send work to, or None to work alone."""
    from ..control.revisions.state import default_state_dir
    from ..serve.discovery import find_server, read_server_file

    directory = Path(state_dir) if state_dir else default_state_dir()
    cacert = given_cacert()
    if server:
        token = os.environ.get("DEPLOYKIT_TOKEN")
        recorded = read_server_file(directory)
        if not token and recorded is not None and server.rstrip("/") in (recorded.url.rstrip("/"), recorded.control):
            return Remote(recorded.control_url, recorded.token, str(directory / "server.json"),
                          cacert or recorded.cacert, recorded.url)
        if not token:
            raise DeploykitError(f"--server {server} needs the server's control token in $DEPLOYKIT_TOKEN "
                                 "(it is in server.json in the server's state directory)")
        return Remote(server, token, "$DEPLOYKIT_TOKEN", cacert)
    info = find_server(directory)
    if info is None:
        return None
    return Remote(info.control_url, info.token, str(directory / "server.json"), cacert or info.cacert, info.url)


def localise(text: str, source: str) -> str:
    """The server names a manifest by its absolute path; say it as the user named it."""
    absolute = str(Path(source).resolve())
    return text.replace(absolute, source) if absolute != source else text


def manifest_payload(item: Any, **extra: Any) -> dict[str, Any]:
    """What the control API needs of a manifest: the file's text, where it lives, which one it is."""
    source = Path(item.source)
    return {"manifest": source.read_text(), "source": str(source.resolve()), "name": item.name, **extra}
