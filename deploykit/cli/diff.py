"""`deploykit diff`: what applying manifests would change."""

from __future__ import annotations

import click

from .console import STATE_OPTION, handle_errors, load_all, out, store


@click.command()
@click.argument("files", nargs=-1, required=True, type=click.Path(exists=True))
@click.option("--devices", metavar="SPEC", default=None, help="Simulated inventory for the new plan.")
@STATE_OPTION
@handle_errors
def diff(files: tuple[str, ...], devices: str | None, state_dir: str | None) -> None:
    """What applying FILES would change against the current revisions: manifest fields, modules that
    move device, and whether a reshard is needed."""
    from ..control.differ import diff_manifest

    states = store(state_dir)
    for item in load_all(files):
        for line in diff_manifest(item, store=states, devices=devices):
            out.print(line, markup=False)
