"""``python -m gpucheck``: every GPU check of deploykit in one command, one report.

    python3 -m gpucheck --out "$OUT" --wheels .gpucheck/wheels   # on the GPU machine (make gpu-check prints it)
    .venv/bin/python -m gpucheck --out .gpucheck/report           # anywhere: without CUDA, the dry run
    .venv/bin/python -m gpucheck --only serve,budget              # some checks (set-up always runs)

It installs the carried wheels into a scratch path, then runs each check (``checks.CHECKS``) in its own
process group with its own time limit, never past the run's deadline, and rewrites the report in ``--out``
after each. Without CUDA (or with ``--dry``) it runs the dry run: every step that needs no GPU, on tiny
models, the rest skipped with the reason.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from . import wheels
from .checks import CHECKS, Check
from .context import ROOT, Context
from .record import CheckRecord, Status, Step
from .report import Report

DEADLINE_S = wheels.DEADLINE_S  # the whole run, on one H100: 8 minutes leave room in 15 to start and rerun
RESERVE_S = 8.0  # kept back from every check for writing the report
LOG_LINES = 60  # lines of each check's output kept in the report


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m gpucheck", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or ROOT / ".gpucheck" / "report"),
                        help="where the report goes (default: $OUT, else .gpucheck/report)")
    parser.add_argument("--wheels", type=Path, default=ROOT / wheels.FOLDER, help="carried wheels to install first")
    parser.add_argument("--work", type=Path, default=None, help="scratch space (default: a new temporary directory)")
    parser.add_argument("--dry", action="store_true", help="the dry run even where CUDA is present")
    parser.add_argument("--only", default="", help="comma-separated checks to run (set-up always runs)")
    parser.add_argument("--deadline", type=float, default=DEADLINE_S, help="seconds for the whole run")
    parser.add_argument("--commit", default="", help="the deploykit commit under test (default: git's)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    start = time.monotonic()
    deadline = start + args.deadline
    work = args.work or Path(tempfile.mkdtemp(prefix="gpucheck-"))
    (work / "logs").mkdir(parents=True, exist_ok=True)
    dry = args.dry or not cuda_available()
    report = Report(date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                    mode="dry" if dry else "gpu", commit=args.commit or wheels.commit(), deadline_s=args.deadline)
    (site, base), report.wheels = install_wheels(args.wheels, work, use=not dry)
    ctx = Context(work=work, dry=dry, site=site, machine_site=base)
    print(f"gpucheck: {report.mode} run, work in {work}, report in {args.out}", flush=True)
    for check in selected(args.only):
        record = run_check(check, ctx, min(check.limit_s, deadline - time.monotonic() - RESERVE_S), work)
        report.checks.append(record)
        if check.name == "setup":
            ctx = dataclasses.replace(ctx, models=record.metrics.get("models", {}))
        report.seconds = time.monotonic() - start
        report.write(args.out)
        print(f"gpucheck: {check.name}: {record.status.value} in {record.seconds:.0f} s", flush=True)
    write_logs(work / "logs", args.out / "gpu-check-logs.txt")
    print(report.brief(), flush=True)  # last: what a caller sees of the output first
    return 1 if report.not_passed() else 0


def selected(only: str) -> list[Check]:
    names = {n.strip() for n in only.split(",") if n.strip()}
    unknown = names - {c.name for c in CHECKS}
    if unknown:
        raise SystemExit(f"unknown checks: {', '.join(sorted(unknown))}; known: {', '.join(c.name for c in CHECKS)}")
    return [c for c in CHECKS if not names or c.name in names or c.name == "setup"]


def cuda_available() -> bool:
    """Whether torch sees a CUDA device (asked in a child: this process stays free of torch)."""
    try:
        done = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.is_available())"],
                              capture_output=True, text=True, timeout=120)
        return done.stdout.strip().endswith("True")
    except (OSError, subprocess.TimeoutExpired):
        return False


def install_wheels(folder: Path, work: Path, *, use: bool) -> tuple[tuple[str, str], dict[str, object]]:
    """Install the carried wheels into ``work/site`` (what the machine lacks) and ``work/site-overrides``
    (newer versions of what it has). Returns the two paths the checks import from (``site`` alone: the
    machine's own versions of the overridden packages; both: as deploykit's suite runs), empty unless
    ``use`` (on the GPU machine); the dry run installs them for CPython 3.12 all the same, to check them."""
    found = sorted(folder.glob("*.whl")) if folder.is_dir() else []
    if not found:
        return ("", ""), {"summary": f"none in {folder}", "count": 0}
    size = sum(w.stat().st_size for w in found)
    start = time.monotonic()
    parts = {"site": [w for w in found if not wheels.is_override(w)],
             "site-overrides": [w for w in found if wheels.is_override(w)]}
    done = [wheels.install(ws, work / name) for name, ws in parts.items() if ws]
    failed = [d.stderr.strip()[-500:] for d in done if d.returncode != 0]
    summary = (f"install failed: {failed[0]}" if failed else
               f"{len(found)} wheels, {size / 2**20:.2f} MiB, installed in {time.monotonic() - start:.1f} s"
               + ("" if use else " (dry run: installed to check them, not used)"))
    info = {"summary": summary, "count": len(found), "bytes": size, "installed": not failed,
            "names": [w.name for w in found], "overrides": [w.name for w in parts["site-overrides"]]}
    if failed or not use:
        return ("", ""), info
    base = str(work / "site") if parts["site"] else ""
    full = os.pathsep.join(str(work / n) for n, ws in (("site-overrides", parts["site-overrides"]),
                                                      ("site", parts["site"])) if ws)
    return (full, base), info


def run_check(check: Check, ctx: Context, limit: float, work: Path) -> CheckRecord:
    """Run ``check`` in its own process group for at most ``limit`` seconds; its record, however it ended."""
    path = work / f"{check.name}.record.json"
    if limit < 10:
        return CheckRecord(check.name, check.title, Status.SKIPPED, 0.0, check.limit_s,
                           [Step("not started", Status.SKIPPED, "no time left before the run's deadline")])
    if check.needs_models and not ctx.models:
        return CheckRecord(check.name, check.title, Status.SKIPPED, 0.0, check.limit_s,
                           [Step("not started", Status.SKIPPED, "set-up built no models")])
    (work / f"{check.name}.context.json").write_text(ctx.to_json())
    log = work / "logs" / f"{check.name}.log"
    start = time.monotonic()
    with open(log, "ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "gpucheck.child", check.name,
                                 str(work / f"{check.name}.context.json"), str(path)],
                                stdout=out, stderr=subprocess.STDOUT, env=ctx.env(), cwd=ROOT, start_new_session=True)
        timed_out = _wait(proc, limit)
    _end_group(proc.pid)
    record = _read(path, check)
    record.limit_s = round(limit, 1)
    record.seconds = round(time.monotonic() - start, 1)
    if timed_out:
        record.steps.append(Step("time limit", Status.TIMEOUT, f"stopped after {limit:.0f} s"))
    elif proc.returncode != 0 and not any(s.status is Status.ERROR for s in record.steps):
        record.steps.append(Step("process", Status.ERROR, f"exited {proc.returncode}"))
    record.settle()
    record.log_tail = tail(log, LOG_LINES)
    return record


def _wait(proc: subprocess.Popen[bytes], limit: float) -> bool:
    """Wait for ``proc``; past ``limit``, stop its whole process group (servers too). True if stopped."""
    try:
        proc.wait(timeout=limit)
        return False
    except subprocess.TimeoutExpired:
        for sig, grace in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
            try:
                os.killpg(proc.pid, sig)
                proc.wait(timeout=grace)
                break
            except subprocess.TimeoutExpired:
                continue
            except ProcessLookupError:
                break
        return True


def _end_group(pgid: int) -> None:
    """Whatever a finished check left running in its process group (a server, an apply) ends with it."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _read(path: Path, check: Check) -> CheckRecord:
    import json

    try:
        return CheckRecord.from_dict(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError):
        return CheckRecord(check.name, check.title, Status.ERROR, 0.0, check.limit_s,
                           [Step("record", Status.ERROR, "the check wrote no record")])


def tail(path: Path, lines: int) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def write_logs(folder: Path, dest: Path) -> None:
    """The end of every log of the run (checks and the servers they started), in one file."""
    parts = [f"===== {log.name}\n{tail(log, 120)}\n" for log in sorted(folder.glob("*.log"))]
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text("".join(parts))
