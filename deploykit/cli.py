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
    table = Table(title=f"{plan.name}: {plan.architecture} at {plan.dtype}, balance by {plan.balance}"
                        + (f", KV cache for {plan.kv_cache_tokens} tokens" if plan.kv_cache_tokens else ""),
                  title_justify="left")
    columns = ["device", "blocks", "bytes", "budget", "% budget", "target", "actual"]
    if plan.kv_cache_tokens:
        columns.insert(3, "of which KV+logits")
    for column in columns:
        if column == "blocks":
            table.add_column(column, min_width=24, ratio=1, overflow="fold")
        else:
            table.add_column(column, justify="left" if column == "device" else "right", no_wrap=True)
    for d in plan.devices:
        device = f"cuda:{d.device}" if isinstance(d.device, int) else str(d.device)
        budget = "unlimited" if d.budget is None else format_size(d.budget)
        pct = f"{100 * d.bytes / d.budget:.1f}%" if d.budget else "-"
        row = [device, ", ".join(d.blocks) or "-", format_size(d.bytes), budget, pct,
               f"{100 * d.target_share:.1f}%" if d.target_share is not None else "-",
               f"{100 * d.actual_share:.1f}%" if d.actual_share is not None else "-"]
        if plan.kv_cache_tokens:
            row.insert(3, format_size(d.bytes - d.weight_bytes))
        table.add_row(*row)
    return table


def _located(loaded: LoadedManifest, exc: PlanInfeasible) -> str:
    return loaded.located(exc.field, str(exc))


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


def _manifest_files(target: str) -> list[str]:
    path = Path(target)
    if path.is_dir():
        files = sorted(str(p) for p in path.iterdir() if p.suffix in (".yaml", ".yml") and p.is_file())
        if not files:
            raise ManifestError([Issue("no *.yaml manifests in this directory", target)])
        return files
    return [target]


def _store(state_dir: str | None) -> Any:
    from .state import StateStore

    return StateStore(Path(state_dir) if state_dir else None)


_STATE_OPTION = click.option("--state-dir", metavar="DIR", default=None, envvar="DEPLOYKIT_STATE",
                             help="State directory (default: $DEPLOYKIT_STATE, else ~/.local/state/deploykit).")


def _step_printer(name: str) -> Callable[[str], None]:
    def show(step: str) -> None:
        if err.is_terminal:
            err.print(f"[dim]{name}: {step}…[/]")

    return show


def _summary(outcome: Any) -> None:
    steps = ", ".join(f"{k} {v:.2f}s" for k, v in outcome.timings.items())
    if outcome.status == "unchanged":
        out.print(f"[green]unchanged[/] {outcome.name}: revision {outcome.revision} is current; nothing to do "
                  f"({steps})")
        return
    if outcome.status == "dry-run":
        out.print(f"[yellow]dry run[/] {outcome.name}: would {', '.join(a.step for a in outcome.actions)} "
                  f"({outcome.actions[0].reason}); nothing changed")
        out.print(_plan_table(outcome.plan))
        return
    out.print(f"[green]applied[/] {outcome.name}: revision {outcome.revision} Ready ({steps})")
    if outcome.reshard is not None:
        r = outcome.reshard
        out.print(f"  shards: {outcome.shards} ({len(r.layout.shards)} files, {r.status})")
    else:
        out.print(f"  shards: {outcome.shards} (the checkpoint's own layout fits; used in place)")
    out.print(f"  health: {outcome.health}")
    out.print(_plan_table(outcome.plan))


def _outcome_json(outcome: Any) -> dict[str, Any]:
    return {"name": outcome.name, "status": outcome.status, "revision": outcome.revision,
            "actions": [{"step": a.step, "reason": a.reason} for a in outcome.actions],
            "timings": outcome.timings, "shards": str(outcome.shards) if outcome.shards else None,
            "health": outcome.health, "plan": _plan_json(outcome.plan) if outcome.plan else None}


@main.command()
@click.argument("target", type=click.Path(exists=True))
@click.option("--devices", metavar="SPEC", default=None, help="Simulated inventory (only with --dry-run "
              "unless this host has those GPUs).")
@click.option("--dry-run", is_flag=True, help="Show what would happen; change nothing.")
@click.option("--force", is_flag=True, help="Apply even if nothing changed.")
@click.option("--prune", is_flag=True, help="With a directory: remove deployments whose manifests are gone.")
@click.option("--output", "-o", type=click.Choice(["table", "json"]), default="table", show_default=True)
@click.option("--quiet", "-q", is_flag=True, help="No progress bars.")
@_STATE_OPTION
@_handle_errors
def apply(target: str, devices: str | None, dry_run: bool, force: bool, prune: bool, output: str,
          quiet: bool, state_dir: str | None) -> None:
    """Apply TARGET (a manifest file, or a directory of them, in name order): validate, plan, reshard
    if the layout on disk differs, load, health-check, record a new revision.

    An unchanged manifest with an unchanged checkpoint does nothing.
    """
    from .reconciler import apply as run

    store = _store(state_dir)
    loaded = _load_all(tuple(_manifest_files(target)))
    results, failures = [], []
    for item in loaded:
        try:
            if _show_progress(quiet) and not dry_run:
                with _Bar(f"{item.name}: resharding") as bar:
                    outcome = run(item, store=store, devices=devices, dry_run=dry_run, force=force,
                                  progress=bar, on_step=_step_printer(item.name))
            else:
                outcome = run(item, store=store, devices=devices, dry_run=dry_run, force=force)
        except PlanInfeasible as exc:
            failures.append(_located(item, exc))
            continue
        except ManifestError:
            raise
        except DeploykitError as exc:
            failures.append(f"{item.source}: {item.name}: apply failed: {exc}")
            continue
        results.append(outcome)
        if output == "table":
            _summary(outcome)
    if prune and Path(target).is_dir() and not dry_run:
        keep = {item.name for item in loaded}
        for name in store.names():
            manifest = store.deployment_manifest(name) or ""
            if name not in keep and Path(manifest).parent == Path(target).resolve():
                store.forget(name)
                out.print(f"[yellow]pruned[/] {name}: its manifest is gone")
    if output == "json":
        out.print_json(json.dumps([_outcome_json(o) for o in results]))
    if failures:
        _fail(EXIT_FAILED, failures)


@main.command()
@click.argument("files", nargs=-1, required=True, type=click.Path(exists=True))
@click.option("--devices", metavar="SPEC", default=None, help="Simulated inventory for the new plan.")
@_STATE_OPTION
@_handle_errors
def diff(files: tuple[str, ...], devices: str | None, state_dir: str | None) -> None:
    """What applying FILES would change against the current revisions: manifest fields, modules that
    move device, and whether a reshard is needed."""
    from .differ import diff_manifest

    store = _store(state_dir)
    for item in _load_all(tuple(f for target in files for f in _manifest_files(target))):
        report = diff_manifest(item, store=store, devices=devices)
        for line in report:
            out.print(line, markup=False)


@main.command()
@click.argument("name", required=False)
@click.option("--output", "-o", type=click.Choice(["table", "json"]), default="table", show_default=True)
@_STATE_OPTION
@_handle_errors
def status(name: str | None, output: str, state_dir: str | None) -> None:
    """Phase, serving revision, conditions, plan summary and last error of NAME (default: all)."""
    store = _store(state_dir)
    names = [name] if name else store.names()
    if name and store.latest(name) is None:
        raise DeploykitError(f"no deployment named {name!r} (known: {', '.join(store.names()) or 'none'})")
    reports = [store.status(n) for n in names]
    if output == "json":
        out.print_json(json.dumps(reports[0] if name else reports))
        return
    if not reports:
        out.print("no deployments")
    for r in reports:
        colour = {"Ready": "green", "Failed": "red", "Progressing": "yellow"}.get(r["phase"], "white")
        out.print(f"[bold]{r['name']}[/]  phase [{colour}]{r['phase']}[/]  revision {r['revision']}")
        for c in r["conditions"]:
            if c["status"] or c["type"] == "Ready":
                out.print(f"  {c['type']}={c['status']} ({c['reason']}) {c['message']}", markup=False)
        if r["plan"]:
            for d in r["plan"]["devices"]:
                device = f"cuda:{d['device']}" if isinstance(d["device"], int) else d["device"]
                out.print(f"  {device}: {', '.join(d['blocks'])} ({format_size(d['bytes'])})", markup=False)
        if r["last_error"]:
            out.print(f"  last error: {r['last_error']}", markup=False)


@main.command()
@click.argument("name")
@click.option("--output", "-o", type=click.Choice(["table", "json"]), default="table", show_default=True)
@_STATE_OPTION
@_handle_errors
def history(name: str, output: str, state_dir: str | None) -> None:
    """Every revision of NAME with its outcome."""
    import time as _time

    store = _store(state_dir)
    revisions = store.history(name)
    if not revisions:
        raise DeploykitError(f"no deployment named {name!r}")
    current = store.current(name)
    rows = [{"revision": r.revision, "phase": r.phase, "current": current is not None and
             r.revision == current.revision, "created": _time.strftime("%Y-%m-%d %H:%M:%S",
                                                                         _time.localtime(r.created_at)),
             "manifest_digest": r.manifest_digest, "plan_digest": r.plan_digest, "git_commit": r.git_commit,
             "reason": r.reason} for r in revisions]
    if output == "json":
        out.print_json(json.dumps(rows))
        return
    table = Table(title=f"{name}: revisions", title_justify="left")
    for col in ("rev", "phase", "created", "manifest", "plan", "git", "reason"):
        table.add_column(col, overflow="fold")
    for row in rows:
        table.add_row(f"{row['revision']}{' *' if row['current'] else ''}", row["phase"], row["created"],
                      row["manifest_digest"][7:19], (row["plan_digest"] or "")[7:19],
                      (row["git_commit"] or "")[:10], row["reason"] or "")
    out.print(table)


@main.command()
@click.argument("name")
@click.option("--to-revision", type=int, default=None, help="Default: the Ready revision before the current one.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bars.")
@_STATE_OPTION
@_handle_errors
def rollback(name: str, to_revision: int | None, quiet: bool, state_dir: str | None) -> None:
    """Re-apply a recorded revision of NAME (as a new revision with that content)."""
    from .reconciler import apply_recorded

    store = _store(state_dir)
    current = store.current(name)
    if to_revision is None:
        ready = [r for r in store.history(name) if r.phase == "Ready"
                 and (current is None or r.revision < current.revision)]
        if not ready:
            raise DeploykitError(f"{name!r} has no Ready revision before the current one to roll back to")
        target = ready[-1]
    else:
        found = store.get(name, to_revision)
        if found is None:
            raise DeploykitError(f"{name!r} has no revision {to_revision}")
        target = found
    outcome = apply_recorded(target, store=store, on_step=None if quiet else _step_printer(name))
    out.print(f"[green]rolled back[/] {name} to the content of revision {target.revision}: "
              f"now revision {outcome.revision}")


@main.command()
@click.argument("path", type=click.Path(exists=True))
@click.option("--port", type=int, default=8765, show_default=True, help="Port on 127.0.0.1.")
@click.option("--prune", is_flag=True, help="Remove deployments whose manifest files are removed.")
@click.option("--devices", metavar="SPEC", default=None, help="Simulated inventory (CPU-only plans).")
@click.option("--debounce", type=float, default=0.3, show_default=True, help="Seconds a burst of file "
              "events must settle before reloading.")
@_STATE_OPTION
@_handle_errors
def serve(path: str, port: int, prune: bool, devices: str | None, debounce: float,
          state_dir: str | None) -> None:
    """Hold every deployment in PATH (a manifest or a directory of manifests), reload them when their
    files change, and answer /healthz, /readyz, /status and /metrics on 127.0.0.1:PORT."""
    import signal
    import threading

    from .server import Supervisor, make_server

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    supervisor = Supervisor(Path(path), store=_store(state_dir), devices=devices, prune=prune,
                            debounce=debounce)
    try:
        server = make_server(supervisor, port=port)
    except OSError as exc:
        raise DeploykitError(f"cannot listen on 127.0.0.1:{port}: {exc.strerror}") from None
    threading.Thread(target=server.serve_forever, name="deploykit-http", daemon=True).start()
    err.print(f"deploykit serve: http://127.0.0.1:{port} (/healthz /readyz /status /metrics); loading…")
    supervisor.start()
    names = ", ".join(supervisor.deployments) or "none"
    err.print(f"deploykit serve: serving {len(supervisor.deployments)} deployment(s): {names}; "
              f"watching {supervisor.path}")
    for file, problem in supervisor.errors.items():
        err.print(f"deploykit serve: {file}: not deployed: {problem}", markup=False)
    stop.wait()
    err.print("deploykit serve: stopping: draining in-flight work")
    server.shutdown()
    supervisor.close()
    err.print("deploykit serve: stopped")


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
