"""`deploykit rollout NAME`: a gated rollout (canary, or blue-green with gates) as the server holding NAME
sees it: in progress (step, shares, gate values so far), promoted, or rolled back and why."""

from __future__ import annotations

import urllib.parse
from typing import Any

import click

from ..errors import DeploykitError
from .console import OUTPUT_OPTION, STATE_OPTION, handle_errors, out, print_json
from .remote import SERVER_OPTION, connect


def rollout_lines(progress: dict[str, Any]) -> list[str]:
    """A rollout's progress as lines for the terminal (``status`` prints them too)."""
    steps = progress["steps"]
    where = {"golden": "scoring the golden references", "traffic": f"step {progress['step']} of {len(steps)}",
             "promoted": "promoted", "rolled-back": "rolled back"}.get(progress["stage"], progress["stage"])
    old, new = progress["serving_generation"], progress["new_generation"]
    share = progress["share"]
    lines = [f"rollout of revision {progress['revision']}: {where}; generation {new} takes {share}% of new "
             f"requests, generation {old} {100 - share}%" + (f" (steps {steps})" if steps else "")]
    if progress["requests"]:
        lines.append("requests served: " + ", ".join(f"generation {g}: {n}" for g, n in progress["requests"].items()))
    for gate in progress["gates"]:
        value = "nothing measured" if gate["value"] is None else f"{gate['value']:.4g}"
        lines.append(f"gate {gate['gate']}: {value} (limit {gate['limit']:g}) "
                     f"{'passed' if gate['passed'] else 'FAILED'}")
    if progress["message"]:
        lines.append(progress["message"])
    return lines


@click.command()
@click.argument("name")
@OUTPUT_OPTION
@SERVER_OPTION
@STATE_OPTION
@handle_errors
def rollout(name: str, output: str, server: str | None, state_dir: str | None) -> None:
    """The gated rollout of NAME in progress (or the latest one), from the server that holds it."""
    remote = connect(server, state_dir)
    if remote is None:
        raise DeploykitError("a gated rollout lives in the server that runs it, and none is running "
                             "(`deploykit history NAME` shows how past ones ended)")
    reports = list(remote.call("GET", f"/status?name={urllib.parse.quote(name)}"))
    progress = reports[0].get("rollout") if reports else None
    if output == "json":
        print_json(progress)
        return
    if progress is None:
        out.print(f"{name}: no gated rollout since the server started")
        return
    for line in rollout_lines(progress):
        out.print(f"{name}: {line}" if line.startswith("rollout") else f"  {line}", markup=False)
