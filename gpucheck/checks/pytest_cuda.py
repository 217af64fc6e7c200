"""`pytest -m cuda` over the test modules that hold CUDA tests (collecting the whole suite would import
modules for extras this machine lacks, such as Ray). Every test is one step; without CUDA they are
skipped by the suite itself."""

from __future__ import annotations

import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

from ..context import ROOT, Context
from ..record import Recorder

MARK = "pytest.mark.cuda"


def cuda_test_files(root: Path = ROOT) -> list[Path]:
    return sorted(p for p in (root / "tests").glob("test_*.py") if MARK in p.read_text())


def run(ctx: Context, rec: Recorder) -> None:
    files = cuda_test_files()
    junit = ctx.work / "pytest-cuda.xml"
    cmd = [sys.executable, "-m", "pytest", "-m", "cuda", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}",
           "--basetemp", str(ctx.work / "pytest"), *map(str, files)]
    rec.metric("command", " ".join(["pytest", *cmd[3:]]))
    done = subprocess.run(cmd, env=ctx.env(), cwd=ROOT, capture_output=True, text=True, timeout=110)
    rec.metric("pytest_tail", "\n".join(done.stdout.splitlines()[-12:]))
    if not junit.exists():
        rec.expect("pytest ran", False, f"exit {done.returncode}: {done.stdout[-800:]}{done.stderr[-800:]}")
        return
    cases = _record_cases(rec, junit)
    if cases and all(s == "skipped" for s in cases):
        rec.skip("pytest exit status", f"exit {done.returncode}: all {len(cases)} tests skipped")
    else:
        rec.expect("pytest exit status", done.returncode in (0, 5), f"exit {done.returncode}")


def _record_cases(rec: Recorder, junit: Path) -> list[str]:
    """One step per test case; their outcomes."""
    outcomes = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = f"{Path(case.get('file') or case.get('classname', '').replace('.', '/')).stem}::{case.get('name')}"
        problem = case.find("failure") if case.find("failure") is not None else case.find("error")
        skipped = case.find("skipped")
        if problem is not None:
            rec.expect(name, False, (problem.get("message") or "")[:600])
            outcomes.append("failed")
        elif skipped is not None:
            rec.skip(name, skipped.get("message") or "skipped")
            outcomes.append("skipped")
        else:
            rec.expect(name, True, f"{float(case.get('time', 0)):.1f} s")
            outcomes.append("passed")
    return outcomes

