"""`deploykit rollback`: re-apply a recorded revision's content."""

from __future__ import annotations

import click

from .console import STATE_OPTION, handle_errors, out, step_printer, store


@click.command()
@click.argument("name")
@click.option("--to-revision", type=int, default=None, help="Default: the Ready revision before the current one.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bars.")
@STATE_OPTION
@handle_errors
def rollback(name: str, to_revision: int | None, quiet: bool, state_dir: str | None) -> None:
    """Re-apply a recorded revision of NAME (as a new revision with that content)."""
    from ..control.lifecycle import rollback as run

    target, outcome = run(store(state_dir), name, to_revision=to_revision,
                          on_step=None if quiet else step_printer(name))
    out.print(f"[green]rolled back[/] {name} to the content of revision {target.revision}: "
              f"now revision {outcome.revision}")
