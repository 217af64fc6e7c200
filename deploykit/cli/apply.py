"""`deploykit apply`: make manifests the deployed revisions."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from ..errors import DeploykitError, ManifestError, PlanInfeasible
from .console import (EXIT_FAILED, OUTPUT_OPTION, STATE_OPTION, Bar, fail, handle_errors, load_all, located,
                      out, plan_json, plan_table, print_json, show_progress, step_printer, store)


def _summary(outcome: Any) -> None:
    steps = ", ".join(f"{k} {v:.2f}s" for k, v in outcome.timings.items())
    if outcome.status == "unchanged":
        out.print(f"[green]unchanged[/] {outcome.name}: revision {outcome.revision} is current; nothing to do "
                  f"({steps})")
        return
    if outcome.status == "dry-run":
        out.print(f"[yellow]dry run[/] {outcome.name}: would {', '.join(a.step for a in outcome.actions)} "
                  f"({outcome.actions[0].reason}); nothing changed")
        out.print(plan_table(outcome.plan))
        return
    out.print(f"[green]applied[/] {outcome.name}: revision {outcome.revision} Ready ({steps})")
    if outcome.reshard is not None:
        r = outcome.reshard
        out.print(f"  shards: {outcome.shards} ({len(r.layout.shards)} files, {r.status})")
    else:
        out.print(f"  shards: {outcome.shards} (the checkpoint's own layout fits; used in place)")
    out.print(f"  health: {outcome.health}")
    out.print(plan_table(outcome.plan))


def outcome_json(outcome: Any) -> dict[str, Any]:
    return {"name": outcome.name, "status": outcome.status, "revision": outcome.revision,
            "actions": [{"step": a.step, "reason": a.reason} for a in outcome.actions],
            "timings": outcome.timings, "shards": str(outcome.shards) if outcome.shards else None,
            "health": outcome.health, "plan": plan_json(outcome.plan) if outcome.plan else None}


@click.command()
@click.argument("target", type=click.Path(exists=True))
@click.option("--devices", metavar="SPEC", default=None, help="Simulated inventory (only with --dry-run "
              "unless this host has those GPUs).")
@click.option("--dry-run", is_flag=True, help="Show what would happen; change nothing.")
@click.option("--force", is_flag=True, help="Apply even if nothing changed.")
@click.option("--prune", is_flag=True, help="With a directory: remove deployments (state and shards) whose "
              "manifests are gone.")
@OUTPUT_OPTION
@click.option("--quiet", "-q", is_flag=True, help="No progress bars.")
@STATE_OPTION
@handle_errors
def apply(target: str, devices: str | None, dry_run: bool, force: bool, prune: bool, output: str,
          quiet: bool, state_dir: str | None) -> None:
    """Apply TARGET (a manifest file, or a directory of them, in name order): validate, plan, reshard
    if the layout on disk differs, load, health-check, record a new revision.

    An unchanged manifest with an unchanged checkpoint does nothing.
    """
    from ..control.lifecycle import prune_directory
    from ..control.reconciler import ApplyOptions
    from ..control.reconciler import apply as run

    states = store(state_dir)
    loaded = load_all((target,))
    results, failures = [], []
    for item in loaded:
        options = ApplyOptions(devices=devices, dry_run=dry_run, force=force)
        try:
            if show_progress(quiet) and not dry_run:
                with Bar(f"{item.name}: resharding") as bar:
                    outcome = run(item, store=states, options=options, progress=bar,
                                  on_step=step_printer(item.name))
            else:
                outcome = run(item, store=states, options=options)
        except PlanInfeasible as exc:
            failures.append(located(item, exc))
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
        for name in prune_directory(states, Path(target), keep={item.name for item in loaded}):
            out.print(f"[yellow]pruned[/] {name}: its manifest is gone (state and shards removed)")
    if output == "json":
        print_json([outcome_json(o) for o in results])
    if failures:
        fail(EXIT_FAILED, failures)
