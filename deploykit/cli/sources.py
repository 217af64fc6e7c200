"""`deploykit sources`: the git sources a running server follows (``deploykit serve --source``), and
`--sync NAME` to fetch one now rather than at its next interval."""

from __future__ import annotations

import time
import urllib.parse
from typing import Any

import click

from ..errors import DeploykitError
from .console import OUTPUT_OPTION, STATE_OPTION, handle_errors, out, print_json
from .remote import SERVER_OPTION, connect


@click.command()
@click.option("--sync", "sync_name", metavar="NAME", default=None, help="Ask the server to fetch NAME now.")
@OUTPUT_OPTION
@SERVER_OPTION
@STATE_OPTION
@handle_errors
def sources(sync_name: str | None, output: str, server: str | None, state_dir: str | None) -> None:
    """Phase, fetched and applied commit, last error and next fetch of each git source, and the commit
    each of its deployments serves."""
    remote = connect(server, state_dir)
    if remote is None:
        raise DeploykitError("no deploykit serve is running (git sources are followed by `deploykit serve --source`)")
    if sync_name is not None:
        remote.call("POST", f"/sources/{urllib.parse.quote(sync_name, safe='')}/sync")
        out.print(f"{sync_name}: sync requested", markup=False)
        return
    reports: list[dict[str, Any]] = list(remote.call("GET", "/sources"))
    if output == "json":
        print_json(reports)
        return
    if not reports:
        out.print("no git sources")
    for r in reports:
        out.print(_summary(r), markup=False)
        for d in r["deployments"]:
            state = "in sync" if d["in_sync"] else "differs"
            out.print(f"  {d['name']}: serves {_short(d['serving_commit'])} ({state})", markup=False)


def _summary(r: dict[str, Any]) -> str:
    lines = [f"{r['name']}  {r['phase']}  {r['url']} ({r['ref']}, path {r['path']})",
             f"  fetched {_short(r['fetched_commit'])}  applied {_short(r['applied_commit'])}  "
             f"next fetch {_when(r['next_fetch'])}"]
    if r.get("verified") and not r["verified"]["status"]:
        lines.append(f"  SourceVerified=False: commit {_short(r['verified']['commit'])}: {r['verified']['reason']}")
    if r["last_error"]:
        lines.append(f"  error: {r['last_error']}")
    return "\n".join(lines)


def _short(commit: str | None) -> str:
    return commit[:12] if commit else "-"


def _when(at: float | None) -> str:
    return "-" if at is None else f"in {max(0.0, at - time.time()):.0f}s"
