"""`deploykit status` and `deploykit history`: what is deployed, and how it got there."""

from __future__ import annotations

import time
import urllib.parse
from typing import Any

import click
from rich.table import Table

from ..errors import DeploykitError
from ..units import format_size
from .console import OUTPUT_OPTION, STATE_OPTION, handle_errors, out, print_json, store
from .remote import SERVER_OPTION, connect
from .rollout import rollout_lines
from .source_lines import source_lines


def _reports(name: str | None, server: str | None, state_dir: str | None) -> list[dict[str, Any]]:
    remote = connect(server, state_dir)
    if remote is not None:  # the server's view: what it serves, and its state store
        query = f"?name={urllib.parse.quote(name)}" if name else ""
        return list(remote.call("GET", f"/status{query}"))
    from ..control.revisions.report import status_report

    states = store(state_dir)
    names = [name] if name else states.names()
    if name and states.latest(name) is None:
        raise DeploykitError(f"no deployment named {name!r} (known: {', '.join(states.names()) or 'none'})")
    return [status_report(states, n) for n in names]


@click.command()
@click.argument("name", required=False)
@OUTPUT_OPTION
@SERVER_OPTION
@STATE_OPTION
@handle_errors
def status(name: str | None, output: str, server: str | None, state_dir: str | None) -> None:
    """Phase, serving revision, conditions, plan summary and last error of NAME (default: all)."""
    reports = _reports(name, server, state_dir)
    sources = _sources(server, state_dir) if name is None and output != "json" else []
    if output == "json":
        print_json(reports[0] if name else reports)
        return
    if not reports:
        out.print("no deployments")
    for r in reports:
        colour = {"Ready": "green", "Failed": "red", "Progressing": "yellow"}.get(r["phase"], "white")
        serving = f"  serving generation {r['generation']}" if r.get("generation") else ""
        out.print(f"[bold]{r['name']}[/]  phase [{colour}]{r['phase']}[/]  revision {r['revision']}{serving}")
        for c in r["conditions"]:
            if c["status"] or c["type"] == "Ready":
                out.print(f"  {c['type']}={c['status']} ({c['reason']}) {c['message']}", markup=False)
        if r["plan"]:
            for d in r["plan"]["devices"]:
                device = f"cuda:{d['device']}" if isinstance(d["device"], int) else d["device"]
                out.print(f"  {device}: {', '.join(d['blocks'])} ({format_size(d['bytes'])})", markup=False)
            if r["plan"].get("draft"):  # speculative decoding's draft model (llama.cpp)
                d = r["plan"]["draft"]
                device = f"cuda:{d['device']}" if isinstance(d["device"], int) else d["device"]
                out.print(f"  {device}: draft model {d['path']} ({format_size(d['bytes'])})", markup=False)
        speculative = (r.get("engine_process") or {}).get("speculative")
        if speculative:  # spec.speculative as the engine runs it
            out.print(f"  speculative: {speculative['method']}, up to {speculative['num_tokens']} tokens drafted: "
                      + " ".join(speculative["flags"]), markup=False)
        if r.get("budget"):
            out.print("  " + _memory_line(r["budget"]), markup=False)
        if r.get("adapters"):  # LoRA adapters the serving generation answers as NAME:ADAPTER
            out.print("  adapters: " + ", ".join(f"{a['name']} ({format_size(a['bytes'])})" for a in r["adapters"]),
                      markup=False)
        if r.get("rollout") and r["rollout"]["stage"] in ("golden", "traffic"):
            for line in rollout_lines(r["rollout"]):
                out.print(f"  {line}", markup=False)
        if r.get("git_commit"):
            out.print(f"  commit {r['git_commit'][:12]}", markup=False)
        if r["last_error"]:
            out.print(f"  last error: {r['last_error']}", markup=False)
    for source in sources:
        for line in source_lines(source):
            out.print(f"git source {line}" if not line.startswith(" ") else line, markup=False)


def _sources(server: str | None, state_dir: str | None) -> list[dict[str, Any]]:
    """The git sources of the server (none without one)."""
    remote = connect(server, state_dir)
    return list(remote.call("GET", "/sources")) if remote is not None else []


def _memory_line(b: dict[str, Any]) -> str:
    """A deployment under deploykit serve's budget: loaded, unloaded or loading; bytes; last used; keep-alive."""
    if b["keep_alive"] is None:
        keep = "keep-alive forever"
    elif b["keep_alive_left"] is None:
        keep = f"keep-alive {b['keep_alive']:g}s"
    else:
        keep = f"keep-alive left {b['keep_alive_left']:g}s of {b['keep_alive']:g}s"
    busy = f", {b['busy']} request(s) in flight" if b["busy"] else ""
    waiting = f"; {b['waiting']}" if b.get("waiting") else ""  # its load waits for room, and why
    return (f"memory: {b['state']}, {format_size(b['bytes'])}, priority {b['priority']}; last used "
            f"{b['idle_seconds']:g}s ago{busy}; {keep}{waiting}")


@click.command()
@click.argument("name")
@OUTPUT_OPTION
@SERVER_OPTION
@STATE_OPTION
@handle_errors
def history(name: str, output: str, server: str | None, state_dir: str | None) -> None:
    """Every revision of NAME with its outcome."""
    remote = connect(server, state_dir)
    if remote is not None:
        rows = list(remote.call("GET", f"/history/{urllib.parse.quote(name, safe='')}"))
    else:
        from ..control.revisions.report import history_rows

        rows = history_rows(store(state_dir), name)
    if output == "json":
        print_json(rows)
        return
    table = Table(title=f"{name}: revisions", title_justify="left")
    for col in ("rev", "phase", "created", "manifest", "plan", "git", "reason"):
        table.add_column(col, overflow="fold")
    for row in rows:
        created = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(row["created_at"]))
        table.add_row(f"{row['revision']}{' *' if row['current'] else ''}", row["phase"], created,
                      row["manifest_digest"][7:19], (row["plan_digest"] or "")[7:19],
                      (row["git_commit"] or "")[:10], row["reason"] or "")
    out.print(table)
