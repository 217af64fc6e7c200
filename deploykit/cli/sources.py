"""`deploykit sources`: the git sources a running server follows (``deploykit serve --source``), and
`--sync NAME` to fetch one now rather than at its next interval."""

from __future__ import annotations

import urllib.parse
from typing import Any

import click

from ..errors import DeploykitError
from .console import OUTPUT_OPTION, STATE_OPTION, handle_errors, out, print_json
from .remote import SERVER_OPTION, connect
from .source_lines import source_lines


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
        for line in source_lines(r):
            out.print(line, markup=False)
