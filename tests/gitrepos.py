"""Real git repositories for the git source tests: made with `git`, served over file:// or by `git daemon`
on a loopback port, commits signed with ssh-keygen keys, and a TCP listener that never answers."""

from __future__ import annotations

import socket
import subprocess
import threading
from pathlib import Path

from servers import free_port

from helpers import wait_until


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
    """Write (None: delete) ``files`` and commit them; the new commit's id."""
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
    git(repo, *signing, "-qm", message)
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
