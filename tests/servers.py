"""A real `deploykit serve` process on a free port, for tests that talk to it over HTTP."""

from __future__ import annotations

import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def get(url: str, headers: dict[str, str] | None = None, cafile: str | None = None) -> tuple[int, Any]:
    request = urllib.request.Request(url, headers=headers or {})
    context = ssl.create_default_context(cafile=cafile) if url.startswith("https:") else None
    try:
        with urllib.request.urlopen(request, timeout=30, context=context) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as exc:
        body = exc.read()
        return exc.code, json.loads(body) if body.startswith(b"{") else body.decode()


class Server:
    """``deploykit serve PATH`` as a subprocess; ``with Server(...) as s: s.url``. ``path`` None: no PATH
    (the recorded deployments). ``cafile``: the server serves https (pass --tls-cert/--tls-key in ``args``).
    ``expect_ready`` False: a deployment that cannot serve is expected (its reason in ``/readyz``)."""

    def __init__(self, path: Path | None, state: Path, *args: str, env: dict[str, str] | None = None,
                 ready_timeout: float = 180.0, cafile: str | None = None, expect_ready: bool = True) -> None:
        self.port = free_port()
        self.cafile = cafile
        self.url = f"{'https' if cafile else 'http'}://127.0.0.1:{self.port}"
        self.command = [sys.executable, "-m", "deploykit.cli", "serve", *([str(path)] if path else []), "--port",
                        str(self.port), "--debounce", "0.1", *args]
        self.env = {**os.environ, "DEPLOYKIT_STATE": str(state), **(env or {})}
        self.ready_timeout = ready_timeout
        self.expect_ready = expect_ready  # False: started once nothing loads any more, ready or not
        token = args[args.index("--control-token") + 1] if "--control-token" in args else None
        # /readyz says what is not ready to the control token's holder only
        self.readyz_headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.process: subprocess.Popen[str] | None = None
        self.stderr = ""

    def __enter__(self) -> Server:
        self.process = subprocess.Popen(self.command, env=self.env, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + self.ready_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(f"deploykit serve exited: {self.process.communicate()[1]}")
            try:
                status, body = get(f"{self.url}/readyz", self.readyz_headers, cafile=self.cafile)
                if status == 200:
                    return self
                if not self.expect_ready and isinstance(body, dict) and not any(
                        "loading" in str(m) for m in body.get("not_ready", [])):
                    return self
                if self.expect_ready and isinstance(body, dict) and any(
                        "loading" not in str(m) for m in body.get("not_ready", [])):
                    self.stop()  # a deployment failed: say why now rather than at the timeout
                    raise AssertionError(f"deploykit serve could not deploy: {body['not_ready']}\n{self.stderr}")
            except OSError:
                pass
            time.sleep(0.2)
        self.stop()
        raise AssertionError(f"deploykit serve was not ready in {self.ready_timeout}s: {self.stderr}")

    def stop(self) -> int:
        assert self.process is not None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            _, self.stderr = self.process.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            _, self.stderr = self.process.communicate()
        return self.process.returncode

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def metric(self, name: str, **labels: str) -> float:
        """The value of one sample of ``/metrics`` (0 when absent)."""
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=30) as r:
            text = r.read().decode()
        for line in text.splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                if all(f'{k}="{v}"' in line for k, v in labels.items()):
                    return float(line.rsplit(" ", 1)[1])
        return 0.0
