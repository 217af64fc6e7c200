"""What every verb shares: the two consoles, error-to-exit-code mapping, manifest loading, the state
option, progress bars and the plan table. Printing happens here and in the verb modules only; the
library never prints.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import click
from rich.console import Console
from rich.table import Table

from ..errors import DeploykitError, Issue, ManifestError, PlanInfeasible
from ..units import format_size

if TYPE_CHECKING:
    from ..control.revisions.state import StateStore
    from ..spec.manifest import LoadedManifest

EXIT_OK, EXIT_FAILED, EXIT_INVALID = 0, 1, 2
out = Console(highlight=False, soft_wrap=True)
err = Console(stderr=True, highlight=False, soft_wrap=True)
F = TypeVar("F", bound=Callable[..., Any])

STATE_OPTION = click.option("--state-dir", metavar="DIR", default=None, envvar="DEPLOYKIT_STATE",
                            help="State directory (default: $DEPLOYKIT_STATE, else ~/.local/state/deploykit).")
OUTPUT_OPTION = click.option("--output", "-o", type=click.Choice(["table", "json"]), default="table",
                             show_default=True)


def fail(code: int, messages: list[str]) -> NoReturn:
    for message in messages:
        err.print(message, markup=False)
    sys.exit(code)


def handle_errors(func: F) -> F:
    """Map deploykit's errors to messages and exit codes; never show a traceback for bad input."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except ManifestError as exc:
            fail(EXIT_INVALID, [str(i) for i in exc.issues])
        except DeploykitError as exc:
            if getattr(exc, "kind", None) == "manifest":  # the server found the manifest invalid
                fail(EXIT_INVALID, list(getattr(exc, "issues", [str(exc)])))
            fail(EXIT_FAILED, [f"error: {exc}"])
        except (KeyboardInterrupt, click.exceptions.Abort):
            fail(130, ["interrupted"])
        except click.ClickException:
            raise  # usage errors: click prints them and exits 2
        except Exception as exc:  # a bug, not bad input: say so, keep the traceback available
            if os.environ.get("DEPLOYKIT_DEBUG"):
                raise
            fail(EXIT_FAILED, [f"internal error: {type(exc).__name__}: {exc}",
                               "(set DEPLOYKIT_DEBUG=1 to see the traceback)"])

    wrapper.__name__ = func.__name__
    wrapper.__doc__ = func.__doc__
    return wrapper  # type: ignore[return-value]


def load_all(targets: tuple[str, ...] | list[str]) -> list[LoadedManifest]:
    """Load every file (a directory stands for its *.yaml files), collecting the issues of all files
    before failing."""
    from ..spec.manifest import load_manifests, manifest_files

    loaded: list[LoadedManifest] = []
    issues: list[Issue] = []
    for target in targets:
        files = manifest_files(Path(target))
        if Path(target).is_dir() and not files:
            issues.append(Issue("no *.yaml manifests in this directory", target))
        for file in files:
            try:
                loaded.extend(load_manifests(file))
            except ManifestError as exc:
                issues.extend(exc.issues)
    if issues:
        raise ManifestError(issues)
    return loaded


def store(state_dir: str | None) -> StateStore:
    from ..control.revisions.state import StateStore

    return StateStore(Path(state_dir) if state_dir else None)


def located(loaded: LoadedManifest, exc: PlanInfeasible) -> str:
    return loaded.located(exc.field, str(exc))


def show_progress(quiet: bool) -> bool:
    return not quiet and err.is_terminal


def step_printer(name: str) -> Callable[[str], None]:
    def show(step: str) -> None:
        if err.is_terminal:
            err.print(f"[dim]{name}: {step}…[/]")

    return show


class Bar:
    """A rich progress bar (bytes, rate, ETA) behind the library's ProgressSink protocol."""

    def __init__(self, description: str) -> None:
        from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn,
                                   TransferSpeedColumn)

        self.progress = Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(binary_units=True),
                                 TransferSpeedColumn(), TimeRemainingColumn(), console=err, transient=False)
        self.description = description
        self.task: Any = None

    def __enter__(self) -> Bar:
        self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.stop()

    def start(self, total: int, done: int) -> None:
        self.task = self.progress.add_task(self.description, total=total, completed=done)

    def advance(self, n: int) -> None:
        self.progress.advance(self.task, n)


def plan_table(plan: Any) -> Any:
    """The plan as a table (a rich renderable); a multi-node plan first lists its stages, then every
    device with the node it is on."""
    multi = bool(getattr(plan, "nodes", ()))
    quantized = f" ({plan.quantization} linear weights)" if getattr(plan, "is_quantized", False) else ""
    table = Table(title=f"{plan.name}: {plan.architecture} at {plan.dtype}{quantized}, balance by {plan.balance}"
                        + (f", KV cache for {plan.kv_cache_tokens} tokens" if plan.kv_cache_tokens else "")
                        + (f", prefix cache {format_size(plan.prefix_cache_bytes)} where its KV lives"
                           if getattr(plan, "prefix_cache_bytes", 0) else ""),
                  title_justify="left")
    columns = ["device", "blocks", "bytes", "budget", "% budget", "target", "actual"]
    if plan.kv_cache_tokens:
        columns.insert(3, "of which KV+logits")
    if multi:
        columns.insert(0, "node")
    for column in columns:
        if column == "blocks":
            table.add_column(column, min_width=24, ratio=1, overflow="fold")
        else:
            table.add_column(column, justify="left" if column in ("device", "node") else "right", no_wrap=True)
    for i, d in enumerate(plan.devices):
        device = f"cuda:{d.device}" if isinstance(d.device, int) else str(d.device)
        budget = "unlimited" if d.budget is None else format_size(d.budget)
        pct = f"{100 * d.bytes / d.budget:.1f}%" if d.budget else "-"
        row = [device, ", ".join(d.blocks) or "-", format_size(d.bytes), budget, pct,
               f"{100 * d.target_share:.1f}%" if d.target_share is not None else "-",
               f"{100 * d.actual_share:.1f}%" if d.actual_share is not None else "-"]
        if plan.kv_cache_tokens:
            row.insert(3, format_size(d.bytes - d.weight_bytes))
        if multi:
            row.insert(0, plan.nodes[plan.device_nodes[i]].name)
        table.add_row(*row)
    if not multi:
        return table
    from rich.console import Group

    stages = Table(title=f"{plan.name}: {len(plan.nodes)} pipeline stages, one per node", title_justify="left")
    for column in ("stage", "node", "layers", "blocks", "bytes", "target", "actual"):
        if column == "blocks":
            stages.add_column(column, min_width=24, ratio=1, overflow="fold")
        else:
            stages.add_column(column, justify="left" if column == "node" else "right", no_wrap=True)
    for n in plan.nodes:
        where = n.name + (f" ({n.address})" if n.address and n.address != n.name else "")
        layers = f"{n.layers[0]}-{n.layers[1]}" if n.layers else "-"
        stages.add_row(str(n.node), where, layers, ", ".join(n.blocks), format_size(n.bytes),
                       f"{100 * n.target_share:.1f}%", f"{100 * n.actual_share:.1f}%")
    return Group(stages, table)


def plan_json(p: Any) -> dict[str, Any]:
    data = p.to_dict()
    keys: tuple[str, ...] = ("name", "digest", "device_map", "devices", "bottleneck_factor")
    if data.get("nodes"):  # several nodes: every block's node (node_map) beside its device on that node
        keys = ("name", "digest", "device_map", "node_map", "nodes", "devices", "bottleneck_factor")
        for device, node in zip(data["devices"], data["device_nodes"]):
            device["node"] = node
            device["node_name"] = data["nodes"][node]["name"]
    ordered = {k: data[k] for k in keys}
    ordered.update({k: v for k, v in data.items() if k not in ordered})
    return ordered


def print_json(payload: Any) -> None:
    out.print_json(json.dumps(payload))


def using_server(verb: str, remote: Any) -> None:
    """Say where the work goes (stderr: stdout stays the verb's output)."""
    err.print(f"[dim]{verb}: sending to the deploykit server at {remote.url} ({remote.origin})[/]")


def waiter(name: str) -> Callable[[str], None]:
    def show(message: str) -> None:
        err.print(f"{name}: {message}", markup=False)

    return show
