"""The report of one run: ``gpu-check.json`` (everything measured) and ``gpu-check.md`` (the same, to read),
rewritten after every check so that a run cut short still leaves one."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .record import CheckRecord, Status, write_json

MARK = {Status.PASS: "pass", Status.FAIL: "**FAIL**", Status.ERROR: "**ERROR**", Status.TIMEOUT: "**TIMEOUT**",
        Status.SKIPPED: "skipped"}


@dataclass
class Report:
    date: str
    mode: str  # "gpu" or "dry"
    commit: str
    deadline_s: float
    seconds: float = 0.0
    wheels: dict[str, Any] = field(default_factory=dict)
    checks: list[CheckRecord] = field(default_factory=list)

    @property
    def setup(self) -> dict[str, Any]:
        return next((c.metrics for c in self.checks if c.name == "setup"), {})

    def machine(self) -> str:
        gpu = self.setup.get("gpu")
        if gpu:
            return f"{gpu['name']} ({gpu['memory_bytes'] / 2**30:.0f} GiB, CUDA {gpu['cuda']})"
        return "no CUDA device (dry run)"

    def to_dict(self) -> dict[str, Any]:
        return {"date": self.date, "mode": self.mode, "commit": self.commit, "machine": self.machine(),
                "versions": self.setup.get("versions", {}), "seconds": round(self.seconds, 1),
                "deadline_s": self.deadline_s, "wheels": self.wheels,
                "summary": {c.name: c.status.value for c in self.checks},
                "checks": [c.to_dict() for c in self.checks]}

    def markdown(self) -> str:
        versions = self.setup.get("versions", {})
        lines = [f"# deploykit GPU check: {self.date}", "",
                 f"- machine: {self.machine()}", f"- mode: {self.mode}", f"- deploykit commit: {self.commit}",
                 f"- torch {versions.get('torch', '?')}, transformers {versions.get('transformers', '?')}, "
                 f"accelerate {versions.get('accelerate', '?')}",
                 f"- wall time: {self.seconds:.0f} s (deadline {self.deadline_s:.0f} s)",
                 f"- carried wheels: {self.wheels.get('summary', 'none')}", "",
                 "| check | status | seconds | limit s |", "| --- | --- | --- | --- |"]
        lines += [f"| {c.name}: {c.title} | {MARK[c.status]} | {c.seconds:.0f} | {c.limit_s:.0f} |"
                  for c in self.checks]
        for check in self.checks:
            lines += ["", *_section(check)]
        return "\n".join(lines) + "\n"

    def not_passed(self) -> list[CheckRecord]:
        return [c for c in self.checks if c.status in (Status.FAIL, Status.ERROR, Status.TIMEOUT)]

    def brief(self) -> str:
        """The summary table and every step that did not pass, short enough to read in a terminal."""
        lines = [f"gpucheck: {self.machine()}, {self.seconds:.0f} s, deploykit {self.commit}", ""]
        lines += [f"  {c.name:<22} {c.status.value:<8} {c.seconds:>5.0f} s" for c in self.checks]
        for check in self.not_passed():
            for step in check.steps:
                if step.status not in (Status.PASS, Status.SKIPPED):
                    lines.append(f"  {check.name}: {step.name}: {step.status.value}: {_cell(step.detail)[:300]}")
        return "\n".join(lines)

    def write(self, out: Path) -> None:
        out.mkdir(parents=True, exist_ok=True)
        write_json(out / "gpu-check.json", self.to_dict())
        tmp = out / ".gpu-check.md.tmp"
        tmp.write_text(self.markdown())
        tmp.replace(out / "gpu-check.md")


def _section(check: CheckRecord) -> list[str]:
    lines = [f"## {check.name}: {MARK[check.status]}", "", check.title, "", "| step | status | detail | s |",
             "| --- | --- | --- | --- |"]
    lines += [f"| {s.name} | {MARK[s.status]} | {_cell(s.detail)} | {s.seconds:.1f} |" for s in check.steps]
    shown = {k: v for k, v in check.metrics.items() if k not in ("models",)}
    if shown:
        lines += ["", "```json", json.dumps(shown, indent=1, default=str)[:6000], "```"]
    return lines


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")[:700]
