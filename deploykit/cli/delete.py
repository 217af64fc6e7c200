"""`deploykit delete`: stop serving a deployment and forget it."""

from __future__ import annotations

import click

from .console import STATE_OPTION, handle_errors, out, store, using_server, waiter
from .remote import SERVER_OPTION, RemoteError, connect


@click.command()
@click.argument("name")
@click.option("--keep-shards", is_flag=True, help="Leave the shard directories on disk.")
@SERVER_OPTION
@STATE_OPTION
@handle_errors
def delete(name: str, keep_shards: bool, server: str | None, state_dir: str | None) -> None:
    """Delete NAME: a running server stops serving it (running requests finish first) and frees its
    memory; its shards are removed unless --keep-shards, and it leaves the current set (its history
    stays in the state store)."""
    remote = connect(server, state_dir)
    if remote is not None:
        using_server("delete", remote)
        final = remote.run("/delete", {"name": name, "keep_shards": keep_shards}, what=f"delete of {name}",
                           on_wait=waiter(name))
        if final["event"] == "error":
            raise RemoteError(final)
    else:
        from ..control.revisions.lifecycle import delete as run

        run(store(state_dir), name, keep_shards=keep_shards)
    out.print(f"[green]deleted[/] {name}" + (" (shards kept)" if keep_shards else " (shards removed)"))
