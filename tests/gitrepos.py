"""Real git repositories for the git source tests: made with `git`, served over file:// or by `git daemon`
on a loopback port, commits signed with ssh-keygen keys, a TCP listener that never answers, and a supervisor
following a source as `deploykit serve --source` composes them."""

from __future__ import annotations

import socket
import subprocess
import threading
from pathlib import Path

from servers import free_port

from helpers import wait_until

from deploykit.control.live.supervisor import Supervisor
from deploykit.control.revisions.state import StateStore
from deploykit.control.sources.worker import SourceSync, live_directory, source_root
from deploykit.spec.source import parse_source


def git(repo: Path, *args: str) -> str:
    result = subprocess.run(["git", "-C", str(repo), "-c", "user.name=ci", "-c", "user.email=ci@example.com",
                             "-c", "commit.gpgsign=false", *args], capture_output=True, text=True, check=True)
    return result.stdout.strip()


def new_repo(path: Path) -> Path:
    path.mkdir(parents=True)
    git(path, "init", "-q", "-b", "main")
    return path


def commit_files(repo: Path, files: dict[str, str | None], message: str = "change", *,
                 signing_key: Path | None = None) -> str:
    """Write (None: delete) ``files`` and commit them (a commit even when nothing changed); its id."""
    for name, text in files.items():
        target = repo / name
        if text is None:
            target.unlink()
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
    git(repo, "add", "-A")
    signing = ["-c", "gpg.format=ssh", "-c", f"user.signingkey={signing_key}", "commit", "-S"] if signing_key else [
        "commit"]
    git(repo, *signing, "--allow-empty", "-qm", message)
    return git(repo, "rev-parse", "HEAD")


def ssh_key(directory: Path, name: str) -> tuple[Path, str]:
    """A new ed25519 key: its private key file and the public key line."""
    directory.mkdir(parents=True, exist_ok=True)
    key = directory / name
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", name, "-f", str(key)], check=True)
    return key, (directory / f"{name}.pub").read_text().strip()


def allowed_signers(path: Path, *public_keys: str) -> Path:
    path.write_text("".join(f"ci@example.com {key}\n" for key in public_keys))
    return path


class GitDaemon:
    """`git daemon` serving every repository under ``base`` on a free loopback port (start / stop)."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None

    def url(self, repo: Path) -> str:
        return f"git://127.0.0.1:{self.port}/{repo.relative_to(self.base)}"

    def start(self) -> GitDaemon:
        self.process = subprocess.Popen(
            ["git", "daemon", "--export-all", "--reuseaddr", "--listen=127.0.0.1", f"--port={self.port}",
             f"--base-path={self.base}", str(self.base)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_until(self._accepts, 20, "git daemon accepts connections")
        return self

    def _accepts(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                return True
        except OSError:
            return False

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(10)


class SilentListener:
    """A TCP port that accepts connections and never answers (a hung remote), until ``close``."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.accepted: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, name="silent-listener", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted.append(conn)

    def close(self) -> None:
        self.sock.shutdown(socket.SHUT_RDWR)  # wakes the accept
        self.sock.close()
        for conn in self.accepted:
            conn.close()
        self._thread.join(5)


def self_signed(directory: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 and its key (openssl), the certificate its own CA."""
    cert, key = directory / "git-cert.pem", directory / "git-key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
                    "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    return cert, key


class HttpsGit:
    """`git http-backend` behind HTTPS on a loopback port, answering only requests that carry
    ``x-access-token:TOKEN`` as Basic credentials (as GitHub does); ``seen`` collects every Authorization."""

    def __init__(self, base: Path, token: str, cert: Path, key: Path) -> None:
        import base64
        import http.server
        import ssl

        outer = self
        self.base = base
        self.seen: list[str] = []
        want = "Basic " + base64.b64encode(f"x-access-token:{token}".encode()).decode()

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                self._cgi()

            def do_POST(self) -> None:
                self._cgi()

            def _cgi(self) -> None:
                auth = self.headers.get("Authorization", "")
                outer.seen.append(auth)
                if auth != want:
                    self.send_response(401)
                    self.send_header("WWW-Authenticate", 'Basic realm="git"')
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                path, _, query = self.path.partition("?")
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                env = {"GIT_PROJECT_ROOT": str(outer.base), "GIT_HTTP_EXPORT_ALL": "1", "PATH_INFO": path,
                       "QUERY_STRING": query, "REQUEST_METHOD": self.command, "REMOTE_USER": "ci",
                       "CONTENT_TYPE": self.headers.get("Content-Type", ""), "CONTENT_LENGTH": str(len(body)),
                       "PATH": "/usr/bin:/bin"}
                out = subprocess.run(["git", "http-backend"], input=body, env=env, capture_output=True).stdout
                head, _, payload = out.partition(b"\r\n\r\n")
                headers = [line.split(": ", 1) for line in head.decode().split("\r\n") if ": " in line]
                status = next((int(v.split()[0]) for k, v in headers if k.lower() == "status"), 200)
                self.send_response(status)
                for name, value in headers:
                    if name.lower() != "status":
                        self.send_header(name, value)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(cert, key)
        self.server.socket = context.wrap_socket(self.server.socket, server_side=True)
        self.port = self.server.server_address[1]
        self._thread = threading.Thread(target=self.server.serve_forever, name="https-git", daemon=True)
        self._thread.start()

    def url(self, repo: Path) -> str:
        return f"https://127.0.0.1:{self.port}/{repo.relative_to(self.base)}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(10)


class Followed:
    """A supervisor following a git source, as ``deploykit serve --source`` composes them."""

    def __init__(self, state: Path, text: str) -> None:
        source = parse_source(text.encode(), source="source.yaml")
        self.store = StateStore(state)
        root = source_root(state, source.name)
        live_directory(root).mkdir(parents=True, exist_ok=True)
        self.supervisor = Supervisor(live_directory(root), store=self.store, debounce=0.1,
                                     prune=source.spec.prune, rollback_owned=True)
        self.sync = SourceSync(source, root=root, supervisor=self.supervisor)
        self.supervisor.start()
        self.sync.start()

    def close(self) -> None:
        self.sync.close()
        self.supervisor.close()

    def commit_of(self, name: str) -> str | None:
        current = self.store.current(name)
        return current.git_commit if current else None

    def phase(self) -> str:
        return self.sync.status().phase.value
