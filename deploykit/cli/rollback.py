"""`deploykit rollback`: re-apply a recorded revision's content."""

from __future__ import annotations

import click

from .console import STATE_OPTION, handle_errors, out, step_printer, store, using_server, waiter
from .remote import SERVER_OPTION, RemoteError, connect


@click.command()
@click.argument("name")
@click.option("--to-revision", type=int, default=None, help="Default: the Ready revision before the current one.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bars.")
@SERVER_OPTION
@STATE_OPTION
@handle_errors
def rollback(name: str, to_revision: int | None, quiet: bool, server: str | None, state_dir: str | None) -> None:
    """Re-apply a recorded revision of NAME (as a new revision with that content). With a running
    server, it serves the result."""
    remote = connect(server, state_dir)
    if remote is not None:
        using_server("rollback", remote)
        final = remote.run("/rollback", {"name": name, "to_revision": to_revision}, what=f"rollback of {name}",
                           on_step=None if quiet else step_printer(name), on_wait=waiter(name))
        if final["event"] == "error":
            raise RemoteError(final)
        target, revision = final["target"], final["revision"]
    else:
        from ..control.revisions.lifecycle import rollback as run

        found, outcome = run(store(state_dir), name, to_revision=to_revision,
                             on_step=None if quiet else step_printer(name))
        target, revision = found.revision, outcome.revision
    out.print(f"[green]rolled back[/] {name} to the content of revision {target}: now revision {revision}")
