"""`deploykit plan`: where every block goes, from config.json alone."""

from __future__ import annotations

from typing import Any

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
@click.option("--budget", metavar="TIER=SIZE,...", default=None,
              help="Also show how the deployments pack into this budget of deploykit serve (e.g. cpu=6GiB): "
                   "sizes, what fits together, what can never fit.")
@OUTPUT_OPTION
@handle_errors
def plan(files: tuple[str, ...], devices: str | None, budget: str | None, output: str) -> None:
    """Plan where every block of the model goes. Reads config.json only: no weights needed.
    FILES may be directories (their *.yaml manifests)."""
    from ..control.revisions.reconciler import plan_deployment

    plans, failures, manifests = [], [], []
    for item in load_all(files):
        try:
            plans.append(plan_deployment(item, devices=devices))
            manifests.append(item)
        except PlanInfeasible as exc:
            failures.append(located(item, exc))
    if budget is not None:
        _packing(budget, devices, manifests, plans, output)
    elif output == "json":
        payload = [{**plan_json(p), **_engine_json(m, p)} for m, p in zip(manifests, plans)]
        print_json(payload[0] if len(payload) == 1 else payload)
    else:
        for m, p in zip(manifests, plans):
            out.print(plan_table(p))
            if "llama_server" in (engine := _engine_json(m, p)):
                out.print("llama-server flags: " + " ".join(engine["llama_server"]["flags"]))
            factor = "n/a (no GPU)" if p.bottleneck_factor is None else f"{p.bottleneck_factor:.4f}"
            out.print(f"bottleneck factor: {factor}   total: {format_size(p.total_bytes)}   "
                      f"digest: {p.digest[:19]}")
            for note in p.notes:
                out.print(f"  note: {note}")
            for a in p.adapters:  # LoRA adapters, beside the layers they adapt (in the total above)
                where = ", ".join(f"{d if isinstance(d, str) else f'cuda:{d}'} {format_size(b)}" for d, b in a.devices)
                out.print(f"adapter {a.name}: {format_size(a.bytes)} ({where})")
            if p.draft is not None:  # speculative decoding's draft model (in the total above)
                d = p.draft
                where = d.device if isinstance(d.device, str) else f"cuda:{d.device}"
                out.print(f"draft model {d.path}: {format_size(d.bytes)} on {where} (weights "
                          f"{format_size(d.weight_bytes)}, KV of its {d.layers} layers {format_size(d.kv_bytes)})")
            for n in p.nodes:  # one line per pipeline stage, easy to grep
                layers = f"layers {n.layers[0]}-{n.layers[1]}" if n.layers else "no layers"
                out.print(f"node {n.node} {n.name}: {layers}, {format_size(n.bytes)}, load {100 * n.actual_share:.2f}%")
    if failures:
        fail(EXIT_FAILED, failures)


def _engine_json(manifest: Any, plan: Any) -> dict[str, Any]:
    """For the llama.cpp engine, the llama-server placement flags the plan becomes."""
    if manifest.manifest.spec.engine.name != "llama.cpp":
        return {}
    from ..engine.llamacpp.flags import placement_flags, speculative_flags

    flags = placement_flags(plan.device_map)
    speculative = manifest.manifest.spec.speculative
    spec_flags = speculative_flags(speculative, plan.draft) if speculative is not None else None
    return {"llama_server": {"flags": flags.as_args() + (spec_flags.as_args() if spec_flags else []),
                             "gpu_layers": flags.gpu_layers, "tensor_split": list(flags.tensor_split),
                             "cpu_layers": flags.cpu_layers}}


def _packing(text: str, devices: str | None, manifests: list, plans: list, output: str) -> None:
    """The plans against deploykit serve's budget: sizes, what fits together, what can never fit."""
    from rich.table import Table

    from ..control.budget import plan_tiers, serve_budget
    from ..control.budget.packing import Item, pack
    from ..names import Load

    budget = serve_budget(text, devices)
    items = [Item(m.name, plan_tiers(p), m.manifest.spec.lifecycle.priority,
                  m.manifest.spec.lifecycle.load == Load.EAGER) for m, p in zip(manifests, plans)]
    packing = pack(budget, items)
    if output == "json":
        print_json({"budget": dict(budget.tiers), "deployments": [
            {"name": i.name, "bytes": dict(i.bytes), "priority": i.priority, "load": "eager" if i.eager else "on-demand",
             "fits_alone": i.name not in packing.never, "plan": plan_json(p)} for i, p in zip(items, plans)],
            "packing": packing.to_dict()})
        return
    table = Table(title=f"under {budget.describe()}", title_justify="left")
    for column in ("deployment", "bytes", "priority", "load", "fits alone"):
        table.add_column(column, justify="right" if column in ("bytes", "priority") else "left")
    for i in items:
        size = ", ".join(f"{t} {format_size(b)}" for t, b in sorted(i.bytes.items())) or "0 B"
        table.add_row(i.name, size, str(i.priority), "eager" if i.eager else "on-demand",
                      "no: can never load" if i.name in packing.never else "yes")
    out.print(table)
    total = ", ".join(f"{t} {format_size(b)}" for t, b in sorted(packing.used_by_all.items())) or "0 B"
    out.print(f"all at once ({total}): {'fit' if packing.all_fit else 'do not fit'}; "
              f"eager ones together: {'fit' if packing.eager_fit else 'do not fit (later ones unload earlier ones)'}")
    out.print(f"most held at once: {len(packing.most_at_once)} ({', '.join(packing.most_at_once) or 'none'})")
    if packing.never:
        out.print(f"can never load (alone over the budget): {', '.join(packing.never)}")
