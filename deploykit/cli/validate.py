"""`deploykit validate`: schema and what this machine can check, without reading weights."""

from __future__ import annotations

import click

from ..errors import Issue, ManifestError
from .console import handle_errors, load_all, out


@click.command()
@click.argument("files", nargs=-1, required=True, type=click.Path())
@click.option("--schema-only", is_flag=True, help="Check the schema only, not this machine's files.")
@handle_errors
def validate(files: tuple[str, ...], schema_only: bool) -> None:
    """Check manifests: schema, and what can be checked on this machine (model directory, config.json).

    Exit code 0 when every manifest is valid, 2 when any is invalid.
    """
    from ..control.revisions.change import host_issues

    loaded = load_all(files)
    issues: list[Issue] = []
    if not schema_only:
        for item in loaded:
            issues.extend(host_issues(item))
    if issues:
        raise ManifestError(issues)
    for item in loaded:
        out.print(f"[green]valid[/] {item.source}: {item.name} (line {item.document.line})")
