"""`deploykit apply`: make manifests the deployed revisions (through a running server when there is one)."""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path
from typing import Any

import click

from ..errors import DeploykitError, ManifestError, PlanInfeasible
from .console import (EXIT_FAILED, EXIT_INVALID, OUTPUT_OPTION, STATE_OPTION, Bar, fail, handle_errors, load_all,
                      located, out, plan_json, plan_table, print_json, show_progress, step_printer, store,
                      using_server, waiter)
from .remote import SERVER_OPTION, Remote, connect, localise, manifest_payload


def _summary(outcome: dict[str, Any]) -> None:
    from ..placement.plan import Plan

    plan = Plan.from_dict(outcome["plan"]) if outcome["plan"] else None
    name, revision = outcome["name"], outcome["revision"]
    steps = ", ".join(f"{k} {v:.2f}s" for k, v in outcome["timings"].items())
    if outcome["status"] == "unchanged":
        out.print(f"[green]unchanged[/] {name}: revision {revision} is current; nothing to do ({steps})")
        return
    if outcome["status"] == "deferred":
        out.print(f"[green]deferred[/] {name}: validated and planned; it is not loaded, so its next request applies "
                  "it (lays out, loads, health-checks and records it) under the server's budget")
        return
    if outcome["status"] == "dry-run":
        actions = outcome["actions"]
        out.print(f"[yellow]dry run[/] {name}: would {', '.join(a['step'] for a in actions)} "
                  f"({actions[0]['reason']}); nothing changed")
        out.print(plan_table(plan))
        return
    if outcome["status"] == "loaded":
        out.print(f"[green]loaded[/] {name}: revision {revision} is current; loaded and health-checked ({steps})")
    else:
        out.print(f"[green]applied[/] {name}: revision {revision} Ready ({steps})")
    if outcome["reshard"] is not None:
        r = outcome["reshard"]
        out.print(f"  shards: {outcome['shards']} ({r['files']} files, {r['status']})")
    elif outcome["status"] == "applied":
        out.print(f"  shards: {outcome['shards']} (the checkpoint's own layout fits; used in place)")
    out.print(f"  health: {outcome['health']}")
    if plan is not None:
        out.print(plan_table(plan))


def outcome_json(outcome: Any) -> dict[str, Any]:
    """An apply's outcome (``ApplyOutcome``, or the control API's result event) as `-o json` prints it."""
    if not isinstance(outcome, dict):
        from ..control.revisions.lifecycle import outcome_summary

        outcome = outcome_summary(outcome)
    from ..placement.plan import Plan

    data = {k: v for k, v in outcome.items() if k != "event"}
    if data.get("plan"):
        data["plan"] = plan_json(Plan.from_dict(data["plan"]))
    return data


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
@SERVER_OPTION
@STATE_OPTION
@handle_errors
def apply(target: str, devices: str | None, dry_run: bool, force: bool, prune: bool, output: str,
          quiet: bool, server: str | None, state_dir: str | None) -> None:
    """Apply TARGET (a manifest file, or a directory of them, in name order): validate, plan, reshard
    if the layout on disk differs, load, health-check, record a new revision.

    With a running `deploykit serve` (its server.json in the state directory, or --server), the server
    does the work and serves the result; this command only streams its progress.

    An unchanged manifest with an unchanged checkpoint does nothing.
    """
    loaded = load_all((target,))  # located manifest errors here, before anything is sent
    remote = connect(server, state_dir)
    if remote is not None:
        using_server("apply", remote)
        _apply_remote(remote, loaded, target, dry_run=dry_run, force=force, prune=prune, output=output,
                      quiet=quiet, devices=devices)
        return
    from ..control.revisions.lifecycle import prune_directory
    from ..control.revisions.reconciler import ApplyOptions
    from ..control.revisions.reconciler import apply as run

    states = store(state_dir)
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
        results.append(outcome_json(outcome))
        if output == "table":
            _summary(results[-1])
    if prune and Path(target).is_dir() and not dry_run:
        for name in prune_directory(states, Path(target), keep={item.name for item in loaded}):
            out.print(f"[yellow]pruned[/] {name}: its manifest is gone (state and shards removed)")
    if output == "json":
        print_json(results)
    if failures:
        fail(EXIT_FAILED, failures)


def _apply_remote(remote: Remote, loaded: list[Any], target: str, *, dry_run: bool, force: bool, prune: bool,
                  output: str, quiet: bool, devices: str | None) -> None:
    results, failures = [], []
    for item in loaded:
        payload = manifest_payload(item, devices=devices, dry_run=dry_run, force=force)
        bars = show_progress(quiet) and not dry_run
        with Bar(f"{item.name}: resharding") if bars else nullcontext() as bar:
            final = remote.run("/apply", payload, what=f"apply of {item.name}", bar=bar,
                               on_step=step_printer(item.name) if bars else None, on_wait=waiter(item.name))
        if final["event"] == "error":
            if final["kind"] == "manifest":
                fail(EXIT_INVALID, [localise(i, item.source) for i in final["issues"]])
            message = localise(final["message"], item.source)
            if final["kind"] == "plan":
                failures.append(message)
            else:
                where = "internal error on the server: " if final["kind"] == "internal" else ""
                failures.append(f"{item.source}: {item.name}: apply failed: {where}{message}")
            continue
        results.append(outcome_json(final))
        if output == "table":
            _summary(results[-1])
    if prune and Path(target).is_dir() and not dry_run:
        answer = remote.call("POST", "/prune", {"directory": str(Path(target).resolve()),
                                                "keep": sorted(item.name for item in loaded)})
        for name in answer["pruned"]:
            out.print(f"[yellow]pruned[/] {name}: its manifest is gone (state and shards removed)")
    if output == "json":
        print_json(results)
    if failures:
        fail(EXIT_FAILED, failures)
