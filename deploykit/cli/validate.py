"""`deploykit validate`: schema and what this machine can check, without reading weights."""

from __future__ import annotations

import re

import click

from ..errors import Issue, ManifestError
from .console import handle_errors, load_all, out


@click.command()
@click.argument("files", nargs=-1, required=True, type=click.Path())
@click.option("--schema-only", is_flag=True, help="Check the schema only, not this machine's files.")
@handle_errors
def validate(files: tuple[str, ...], schema_only: bool) -> None:
    """Check manifests: schema, and what can be checked on this machine (model directory, config.json).
    A `kind: GitSource` file (deploykit serve --source) is checked against its own schema.

    Exit code 0 when every manifest is valid, 2 when any is invalid.
    """
    from ..control.revisions.change import host_issues

    sources = [f for f in files if _is_source(f)]
    _validate_sources(sources)
    loaded = load_all(tuple(f for f in files if f not in sources)) if len(sources) < len(files) else []
    issues: list[Issue] = []
    if not schema_only:
        for item in loaded:
            issues.extend(host_issues(item))
    if issues:
        raise ManifestError(issues)
    for item in loaded:
        out.print(f"[green]valid[/] {item.source}: {item.name} (line {item.document.line})")


_SOURCE_KIND = re.compile(rb"^kind:\s*GitSource\s*$", re.MULTILINE)


def _is_source(file: str) -> bool:
    try:
        with open(file, "rb") as handle:
            return bool(_SOURCE_KIND.search(handle.read(64 << 10)))
    except OSError:
        return False  # said by the manifest reader


def _validate_sources(files: list[str]) -> None:
    from ..spec.source import load_source

    issues: list[Issue] = []
    for file in files:
        try:
            source = load_source(file)
        except ManifestError as exc:
            issues.extend(exc.issues)
            continue
        out.print(f"[green]valid[/] {file}: GitSource {source.name} ({source.spec.url}, {source.spec.ref.describe()})")
    if issues:
        raise ManifestError(issues)
