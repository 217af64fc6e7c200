"""`deploykit schema`: the manifest's JSON Schema or its Markdown reference."""

from __future__ import annotations

import json

import click

from .console import handle_errors


@click.command()
@click.option("--format", "fmt", type=click.Choice(["json", "markdown"]), default="json",
              show_default=True, help="JSON Schema, or the Markdown reference (docs/manifest.md).")
@handle_errors
def schema(fmt: str) -> None:
    """Print the manifest's JSON Schema (for editors and CI) or its Markdown reference."""
    if fmt == "json":
        from ..spec.manifest import json_schema

        click.echo(json.dumps(json_schema(), indent=2))
    else:
        from ..spec.reference import render

        click.echo(render(), nl=False)
