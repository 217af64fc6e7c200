"""`deploykit diff`: what applying manifests would change."""

from __future__ import annotations

import click

from .console import STATE_OPTION, handle_errors, load_all, out, store, using_server
from .remote import SERVER_OPTION, RemoteError, connect, localise, manifest_payload


@click.command()
@click.argument("files", nargs=-1, required=True, type=click.Path(exists=True))
@click.option("--devices", metavar="SPEC", default=None, help="Simulated inventory for the new plan.")
@SERVER_OPTION
@STATE_OPTION
@handle_errors
def diff(files: tuple[str, ...], devices: str | None, server: str | None, state_dir: str | None) -> None:
    """What applying FILES would change against the current revisions: manifest fields, modules that
    move device, and whether a reshard is needed (against the running server's, if there is one)."""
    loaded = load_all(files)
    remote = connect(server, state_dir)
    if remote is not None:
        using_server("diff", remote)
        for item in loaded:
            try:
                lines = remote.call("POST", "/diff", manifest_payload(item, devices=devices))["lines"]
            except RemoteError as exc:
                if exc.kind == "manifest":
                    from ..errors import Issue, ManifestError

                    raise ManifestError([Issue(localise(i, item.source)) for i in exc.issues]) from None
                raise
            for line in lines:
                out.print(localise(line, item.source), markup=False)
        return
    from ..control.revisions.differ import diff_manifest

    states = store(state_dir)
    for item in loaded:
        for line in diff_manifest(item, store=states, devices=devices):
            out.print(line, markup=False)
