"""The ``deploykit`` command. Thin: every verb calls the library, and this is the only place that
prints to the terminal and maps errors to exit codes (0 ok, 2 invalid manifest, 1 anything else).

Heavy imports (torch, transformers) happen only inside the verbs that need them, so ``validate`` and
``schema`` start in a fraction of a second.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import click
from rich.console import Console
from rich.table import Table

from . import __version__
from .errors import DeploykitError, Issue, ManifestError, PlanInfeasible
from .units import format_size

if TYPE_CHECKING:
    from .manifest import LoadedManifest

EXIT_OK, EXIT_FAILED, EXIT_INVALID = 0, 1, 2
out = Console(highlight=False, soft_wrap=True)
err = Console(stderr=True, highlight=False, soft_wrap=True)
F = TypeVar("F", bound=Callable[..., Any])


def _fail(code: int, messages: list[str]) -> NoReturn:
    for message in messages:
        err.print(message, markup=False)
    sys.exit(code)


def _handle_errors(func: F) -> F:
    """Map deploykit's errors to messages and exit codes; never show a traceback for bad input."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except ManifestError as exc:
            _fail(EXIT_INVALID, [str(i) for i in exc.issues])
        except DeploykitError as exc:
            _fail(EXIT_FAILED, [f"error: {exc}"])
        except (KeyboardInterrupt, click.exceptions.Abort):
            _fail(130, ["interrupted"])
        except click.ClickException:
            raise  # usage errors: click prints them and exits 2
        except Exception as exc:  # a bug, not bad input: say so, keep the traceback available
            if os.environ.get("DEPLOYKIT_DEBUG"):
                raise
            _fail(EXIT_FAILED, [f"internal error: {type(exc).__name__}: {exc}",
                                "(set DEPLOYKIT_DEBUG=1 to see the traceback)"])

    wrapper.__name__ = func.__name__
    wrapper.__doc__ = func.__doc__
    return wrapper  # type: ignore[return-value]


def _load_all(files: tuple[str, ...]) -> list[LoadedManifest]:
    """Load every file, collecting the issues of all files before failing."""
    from .manifest import load_manifests

    loaded: list[LoadedManifest] = []
    issues: list[Issue] = []
    for file in files:
        try:
            loaded.extend(load_manifests(file))
        except ManifestError as exc:
            issues.extend(exc.issues)
    if issues:
        raise ManifestError(issues)
    return loaded


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="deploykit")
@click.option("-v", "--verbose", count=True, help="More log output (-vv for debug).")
def main(verbose: int) -> None:
    """Declarative deployments of large language models: validate, plan, apply."""
    level = logging.WARNING - 10 * verbose
    logging.basicConfig(level=max(level, logging.DEBUG), format="%(levelname)s %(name)s: %(message)s")


@main.command()
@click.argument("files", nargs=-1, required=True, type=click.Path(dir_okay=False))
@click.option("--schema-only", is_flag=True, help="Check the schema only, not this machine's files.")
@_handle_errors
def validate(files: tuple[str, ...], schema_only: bool) -> None:
    """Check manifests: schema, and what can be checked on this machine (model directory, config.json).

    Exit code 0 when every manifest is valid, 2 when any is invalid.
    """
    from .manifest import check_on_host

    loaded = _load_all(files)
    issues: list[Issue] = []
    if not schema_only:
        for item in loaded:
            issues.extend(check_on_host(item))
    if issues:
        raise ManifestError(issues)
    for item in loaded:
        out.print(f"[green]valid[/] {item.source}: {item.name} "
                  f"(line {item.document.line})")


def _plan_table(plan: Any) -> Table:
    table = Table(title=f"{plan.name}: {plan.architecture} at {plan.dtype}, balance by {plan.balance}",
                  title_justify="left")
    for column in ("device", "blocks", "bytes", "budget", "% budget", "target", "actual"):
        if column == "blocks":
            table.add_column(column, min_width=24, ratio=1, overflow="fold")
        else:
            table.add_column(column, justify="left" if column == "device" else "right", no_wrap=True)
    for d in plan.devices:
        device = f"cuda:{d.device}" if isinstance(d.device, int) else str(d.device)
        budget = "unlimited" if d.budget is None else format_size(d.budget)
        pct = f"{100 * d.bytes / d.budget:.1f}%" if d.budget else "-"
        table.add_row(device, ", ".join(d.blocks) or "-", format_size(d.bytes), budget, pct,
                      f"{100 * d.target_share:.1f}%" if d.target_share is not None else "-",
                      f"{100 * d.actual_share:.1f}%" if d.actual_share is not None else "-")
    return table


def _located(loaded: LoadedManifest, exc: PlanInfeasible) -> str:
    if exc.field is None:
        return f"{loaded.source}: error: {exc}"
    line, column = loaded.locate(exc.field)
    return f"{loaded.source}:{line}:{column}: {exc.field}: {exc}"


@main.command()
@click.argument("files", nargs=-1, required=True, type=click.Path(dir_okay=False))
@click.option("--devices", metavar="SPEC", default=None,
              help="Simulated inventory, e.g. 4x80GiB or 2x24GiB,1x48GiB,cpu=64GiB "
                   "(default: $DEPLOYKIT_DEVICES, else this host).")
@click.option("--output", "-o", type=click.Choice(["table", "json"]), default="table", show_default=True)
@_handle_errors
def plan(files: tuple[str, ...], devices: str | None, output: str) -> None:
    """Plan where every block of the model goes. Reads config.json only: no weights needed."""
    from .planning import plan_manifest

    loaded = _load_all(files)
    plans, failures = [], []
    for item in loaded:
        try:
            plans.append(plan_manifest(item, devices=devices))
        except PlanInfeasible as exc:
            failures.append(_located(item, exc))
    if output == "json":
        payload = [_plan_json(p) for p in plans]
        out.print_json(json.dumps(payload[0] if len(payload) == 1 else payload))
    else:
        for p in plans:
            out.print(_plan_table(p))
            factor = "n/a (no GPU)" if p.bottleneck_factor is None else f"{p.bottleneck_factor:.4f}"
            out.print(f"bottleneck factor: {factor}   total: {format_size(p.total_bytes)}   "
                      f"digest: {p.digest[:19]}")
            for note in p.notes:
                out.print(f"  note: {note}")
    if failures:
        _fail(EXIT_FAILED, failures)


def _plan_json(p: Any) -> dict[str, Any]:
    data = p.to_dict()
    ordered = {k: data[k] for k in ("name", "digest", "device_map", "devices", "bottleneck_factor")}
    ordered.update({k: v for k, v in data.items() if k not in ordered})
    return ordered


class _Bar:
    """A rich progress bar (bytes, rate, ETA) behind the library's ProgressSink protocol."""

    def __init__(self, description: str) -> None:
        from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn,
                                   TransferSpeedColumn)

        self.progress = Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(binary_units=True),
                                 TransferSpeedColumn(), TimeRemainingColumn(), console=err, transient=False)
        self.description = description
        self.task: Any = None

    def __enter__(self) -> _Bar:
        self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.stop()

    def start(self, total: int, done: int) -> None:
        self.task = self.progress.add_task(self.description, total=total, completed=done)

    def advance(self, n: int) -> None:
        self.progress.advance(self.task, n)


def _show_progress(quiet: bool) -> bool:
    return not quiet and err.is_terminal


@main.command()
@click.argument("src", type=click.Path(file_okay=False))
@click.argument("dst", type=click.Path(file_okay=False))
@click.option("--max-shard-size", required=True, metavar="SIZE", help="Largest shard, e.g. 2GiB.")
@click.option("--dtype", type=click.Choice(["float32", "float16", "bfloat16"]), default=None,
              help="Convert floating tensors (decodes a chunk at a time); default: keep each dtype.")
@click.option("--allow-pickle", is_flag=True,
              help="Accept *.bin/*.pt checkpoints (read with torch.load(weights_only=True)).")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
@_handle_errors
def reshard(src: str, dst: str, max_shard_size: str, dtype: str | None, allow_pickle: bool,
            quiet: bool) -> None:
    """Rewrite the checkpoint SRC into DST with shards of at most --max-shard-size.

    Streams tensor by tensor with bounded memory, writes atomically (DST is either as it was or
    complete, even after kill -9), resumes an interrupted run, and does nothing when DST is already
    up to date.
    """
    from .reshard import reshard as run
    from .units import parse_size

    try:
        size = parse_size(max_shard_size)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--max-shard-size") from None
    if size <= 0:
        raise click.BadParameter("must be greater than 0", param_hint="--max-shard-size")
    if _show_progress(quiet):
        with _Bar("resharding") as bar:
            result = run(src, dst, max_shard_size=size, dtype=dtype, allow_pickle=allow_pickle, progress=bar)
    else:
        result = run(src, dst, max_shard_size=size, dtype=dtype, allow_pickle=allow_pickle)
    for warning in result.warnings:
        err.print(f"warning: {warning}", markup=False)
    if result.status == "unchanged":
        out.print(f"{dst}: up to date ({len(result.layout.shards)} shards), nothing written")
        return
    rate = result.bytes_written / result.seconds / 2**20 if result.seconds else 0
    resumed = f", {result.resumed_shards} resumed" if result.resumed_shards else ""
    out.print(f"{dst}: wrote {len(result.layout.shards)} shards{resumed}, "
              f"{format_size(result.bytes_written)} in {result.seconds:.2f}s ({rate:.0f} MiB/s)")


@main.command()
@click.argument("directory", type=click.Path(file_okay=False))
@_handle_errors
def verify(directory: str) -> None:
    """Check a resharded checkpoint: every shard against the lock file, the index against the files.

    Exit 0 when everything matches, 1 otherwise.
    """
    from .reshard import verify as check

    problems = check(directory)
    if problems:
        _fail(EXIT_FAILED, problems)
    out.print(f"{directory}: verified")


@main.command()
@click.option("--format", "fmt", type=click.Choice(["json", "markdown"]), default="json",
              show_default=True, help="JSON Schema, or the Markdown reference (docs/manifest.md).")
@_handle_errors
def schema(fmt: str) -> None:
    """Print the manifest's JSON Schema (for editors and CI) or its Markdown reference."""
    if fmt == "json":
        from .manifest import json_schema

        click.echo(json.dumps(json_schema(), indent=2))
    else:
        from .reference import render

        click.echo(render(), nl=False)


if __name__ == "__main__":  # pragma: no cover
    main()
