"""``<state dir>/server.json``: how the CLI finds a running ``deploykit serve`` (docs/control.md).

The server writes its URL (``https://`` when it serves TLS, with the path of its certificate, which the
CLI then trusts), its process id and a random control token there (mode 0600, written to a
temporary file and renamed, so a reader never sees half a file) once it listens, and removes it on a
clean exit. With ``--control-socket`` it also names the control API's own listener (``control``,
``unix:PATH``): the CLI sends its work there, over ``UnixHandler``, and the URL serves no ``/control``. A file
whose process is gone (``kill -9``, a crash, a reboot) is stale: ``find_server``
ignores it and the next server overwrites it. Stdlib only: the CLI reads this without importing the
web stack.
"""

from __future__ import annotations

import http.client
import json
import os
import secrets
import socket
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

FILE_NAME = "server.json"


@dataclass(frozen=True)
class ServerInfo:
    url: str
    token: str
    pid: int
    started_at: float
    version: str = ""
    cacert: str | None = None  # the server's TLS certificate, which the CLI trusts for an https URL
    control: str | None = None  # the control API's own listener (``unix:PATH``), if it has one

    @property
    def control_url(self) -> str:
        """Where the CLI sends its work: the control listener, else the URL."""
        return self.control or self.url


def server_file(state_dir: Path) -> Path:
    return Path(state_dir) / FILE_NAME


def new_token() -> str:
    return secrets.token_urlsafe(32)


def write_server_file(state_dir: Path, info: ServerInfo) -> Path:
    """Write ``server.json`` atomically with mode 0600 (the token is a credential)."""
    path = server_file(state_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".server.", suffix=".json", dir=path.parent)  # mkstemp: mode 0600
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(asdict(info), f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def remove_server_file(state_dir: Path, token: str) -> None:
    """Remove ``server.json`` if it is still this server's (another server may have taken over)."""
    path = server_file(state_dir)
    current = read_server_file(state_dir)
    if current is not None and current.token == token:
        path.unlink(missing_ok=True)


def read_server_file(state_dir: Path) -> ServerInfo | None:
    """What ``server.json`` says, live or not; None when absent or unreadable."""
    try:
        data = json.loads(server_file(state_dir).read_text())
        return ServerInfo(url=str(data["url"]), token=str(data["token"]), pid=int(data["pid"]),
                          started_at=float(data.get("started_at", 0)), version=str(data.get("version", "")),
                          cacert=str(data["cacert"]) if data.get("cacert") else None,
                          control=str(data["control"]) if data.get("control") else None)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def process_alive(pid: int) -> bool:
    """Whether ``pid`` runs and (where /proc says) is a deploykit process: a recycled pid is not."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # it exists, owned by someone else
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return True  # no /proc (macOS): trust the pid
    return b"deploykit" in cmdline


def find_server(state_dir: Path) -> ServerInfo | None:
    """The live server of ``state_dir``, or None (no file, or a stale one whose process is gone)."""
    info = read_server_file(state_dir)
    if info is None or not process_alive(info.pid):
        return None
    return info


def server_info(url: str, token: str, *, cacert: str | None = None, control_socket: str | None = None) -> ServerInfo:
    """The ``ServerInfo`` a server writes for itself (``cacert``: its TLS certificate, if it serves https;
    ``control_socket``: the unix socket of its control listener, if it has one)."""
    from .. import __version__

    return ServerInfo(url=url, token=token, pid=os.getpid(), started_at=time.time(), version=__version__,
                      cacert=str(Path(cacert).resolve()) if cacert else None,
                      control=f"{UNIX}{Path(control_socket).resolve()}" if control_socket else None)


UNIX = "unix:"  # a control URL on a unix socket: ``unix:/abs/path``


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float | None) -> None:
        super().__init__("localhost", timeout=timeout)  # Host: localhost (a loopback name: auth.Guard's rule)
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self._path)
        except OSError:
            sock.close()
            raise
        self.sock = sock


class UnixHandler(urllib.request.HTTPHandler):
    """urllib's ``http://`` over the unix socket at ``path``, whatever host the URL names."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path

    def http_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        return self.do_open(lambda _host, timeout=None, **_: _UnixConnection(self.path, timeout), req)
