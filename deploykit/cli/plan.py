"""`deploykit plan`: where every block goes, from config.json alone."""

from __future__ import annotations

import click

from ..errors import PlanInfeasible
from ..units import format_size
from .console import EXIT_FAILED, OUTPUT_OPTION, fail, handle_errors, load_all, located, out, plan_json, plan_table, print_json


@click.command()
@click.argument("files", nargs=-1, required=True, type=click.Path())
@click.option("--devices", metavar="SPEC", default=None,
              help="Simulated inventory, e.g. 4x80GiB or 2x24GiB,1x48GiB,cpu=64GiB, or nodes: 2x(8x80GiB) "
                   "(default: $DEPLOYKIT_DEVICES, else this host; for a manifest with spec.cluster and "
                   "placement.nodes > 1, the Ray cluster's nodes).")
@OUTPUT_OPTION
@handle_errors
def plan(files: tuple[str, ...], devices: str | None, output: str) -> None:
    """Plan where every block of the model goes. Reads config.json only: no weights needed."""
    from ..control.reconciler import plan_deployment

    plans, failures = [], []
    for item in load_all(files):
        try:
            plans.append(plan_deployment(item, devices=devices))
        except PlanInfeasible as exc:
            failures.append(located(item, exc))
    if output == "json":
        payload = [plan_json(p) for p in plans]
        print_json(payload[0] if len(payload) == 1 else payload)
    else:
        for p in plans:
            out.print(plan_table(p))
            factor = "n/a (no GPU)" if p.bottleneck_factor is None else f"{p.bottleneck_factor:.4f}"
            out.print(f"bottleneck factor: {factor}   total: {format_size(p.total_bytes)}   "
                      f"digest: {p.digest[:19]}")
            for note in p.notes:
                out.print(f"  note: {note}")
            for n in p.nodes:  # one line per pipeline stage, easy to grep
                layers = f"layers {n.layers[0]}-{n.layers[1]}" if n.layers else "no layers"
                out.print(f"node {n.node} {n.name}: {layers}, {format_size(n.bytes)}, load {100 * n.actual_share:.2f}%")
    if failures:
        fail(EXIT_FAILED, failures)
