"""How a git source's status reads on a terminal (``deploykit sources`` and ``deploykit status``)."""

from __future__ import annotations

import time
from typing import Any


def source_lines(r: dict[str, Any]) -> list[str]:
    lines = [f"{r['name']}  {r['phase']}  {r['url']} ({r['ref']}, path {r['path']})",
             f"  fetched {_short(r['fetched_commit'])}  applied {_short(r['applied_commit'])}  "
             f"next fetch {_when(r['next_fetch'])}"]
    if r.get("verified") and not r["verified"]["status"]:
        lines.append(f"  SourceVerified=False: commit {_short(r['verified']['commit'])}: {r['verified']['reason']}")
    if r["last_error"]:
        lines.append(f"  error: {r['last_error']}")
    for d in r["deployments"]:
        state = "in sync" if d["in_sync"] else "differs: " + ", ".join(x["field"] for x in d["differs"])
        lines.append(f"  {d['name']}: serves {_short(d['serving_commit'])} ({state})")
    return lines


def _short(commit: str | None) -> str:
    return commit[:12] if commit else "-"


def _when(at: float | None) -> str:
    return "-" if at is None else f"in {max(0.0, at - time.time()):.0f}s"
