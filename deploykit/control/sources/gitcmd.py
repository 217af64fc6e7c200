"""Running ``git``: one process group per command, killed whole on a timeout or a stop, with an environment
that carries credentials by file name only. The one place deploykit starts git.

Credentials never appear on a command line, in an environment value, a log line or a status: an SSH key
and known_hosts file are named in ``GIT_SSH_COMMAND``; an https token is read by an askpass program from
the token file at the moment git asks for it. Must never print or log what git reads from a credential.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path

from ...errors import DeploykitError

MAX_OUTPUT = 16 << 20  # a `git show` of a manifest, a ref list: far below this
_POLL = 0.1  # seconds between looks at the stop event while git runs
_ASKPASS = """#!/bin/sh
case "$1" in
  Username*) echo x-access-token ;;
  *) head -n 1 "$DEPLOYKIT_GIT_TOKEN_FILE" ;;
esac
"""


class GitError(DeploykitError):
    """A git command failed (its stderr, trimmed), timed out or was stopped."""


@dataclass(frozen=True)
class Credentials:
    """Files only: an SSH key with the known_hosts it trusts, or a token for https."""

    ssh_key_file: Path | None = None
    known_hosts_file: Path | None = None
    token_file: Path | None = None
    ca_file: Path | None = None  # not a secret: the CA an https server's certificate is checked against


class GitRunner:
    """Runs git commands for one source. ``stop()`` kills the command under way (its process group) and
    refuses new ones; ``scratch``: a directory of deploykit's own for the askpass program."""

    def __init__(self, credentials: Credentials, scratch: Path, *, timeout: float) -> None:
        self.credentials = credentials
        self.scratch = scratch
        self.timeout = timeout
        self._stopped = threading.Event()

    def stop(self) -> None:
        self._stopped.set()

    def env(self) -> dict[str, str]:
        """A scrubbed environment: no user config, no prompts, credentials by file name."""
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(self.scratch), "LC_ALL": "C",
               "GIT_TERMINAL_PROMPT": "0", "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": os.devnull,
               "GIT_ASKPASS": "/bin/false", "SSH_ASKPASS": "/bin/false"}
        creds = self.credentials
        # never a prompt, never an unknown host key accepted (whatever the user's ~/.ssh/config says)
        ssh = ["ssh", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=yes"]
        if creds.ssh_key_file is not None and creds.known_hosts_file is not None:
            ssh += ["-i", str(creds.ssh_key_file), "-o", "IdentitiesOnly=yes",
                    "-o", f"UserKnownHostsFile={creds.known_hosts_file}"]
        env["GIT_SSH_COMMAND"] = " ".join(shlex.quote(a) for a in ssh)
        if creds.ca_file is not None:
            env["GIT_SSL_CAINFO"] = str(creds.ca_file)
        if creds.token_file is not None:
            env["GIT_ASKPASS"] = str(self._askpass())
            env["DEPLOYKIT_GIT_TOKEN_FILE"] = str(creds.token_file)
        return env

    def _askpass(self) -> Path:
        program = self.scratch / "askpass.sh"
        if not program.exists():
            self.scratch.mkdir(parents=True, exist_ok=True)
            tmp = program.with_suffix(".tmp")
            tmp.write_text(_ASKPASS)
            tmp.chmod(0o700)
            os.replace(tmp, program)
        return program

    def run(self, args: list[str], *, git_dir: Path | None = None, timeout: float | None = None) -> bytes:
        """git ``args``; its stdout. Raises GitError when it fails, runs past ``timeout`` (default: the
        source's) or the runner is stopped; the whole process group (ssh, remote helpers) is killed then."""
        if self._stopped.is_set():
            raise GitError("stopped")
        limit = self.timeout if timeout is None else timeout
        env = self.env() if git_dir is None else {**self.env(), "GIT_DIR": str(git_dir)}
        proc = subprocess.Popen(["git", *args], env=env, stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        out, err = self._wait(proc, args, limit)
        if proc.returncode != 0:
            raise GitError(f"git {args[0]} failed: {_last_lines(err)}")
        if len(out) > MAX_OUTPUT:
            raise GitError(f"git {args[0]} wrote more than {MAX_OUTPUT} bytes")
        return out

    def _wait(self, proc: subprocess.Popen[bytes], args: list[str], limit: float) -> tuple[bytes, bytes]:
        waited = 0.0
        while True:
            try:
                return proc.communicate(timeout=_POLL)
            except subprocess.TimeoutExpired:
                waited += _POLL
            if self._stopped.is_set() or waited >= limit:
                _kill_group(proc)
                why = "stopped (the server is stopping)" if self._stopped.is_set() else f"timed out after {limit:g}s"
                raise GitError(f"git {args[0]} {why}")


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.communicate()


def _last_lines(err: bytes, lines: int = 3) -> str:
    text = [line for line in err.decode("utf-8", "replace").splitlines() if line.strip()]
    return " / ".join(text[-lines:]) or "no message"
