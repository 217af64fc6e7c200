"""What one check found: its steps (each passed, failed, skipped or broken, with why), its measurements,
and its status. A check writes its record to a JSON file after every step, so a check stopped at its time
limit still leaves what it had found."""

from __future__ import annotations

import json
import os
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


class Status(str, Enum):
    PASS = "pass"
    FAIL = "fail"  # ran, and found deploykit wrong
    ERROR = "error"  # could not run to the end (an exception)
    TIMEOUT = "timeout"  # stopped at its time limit
    SKIPPED = "skipped"  # not run here, with the reason


@dataclass
class Step:
    name: str
    status: Status
    detail: str = ""
    seconds: float = 0.0


@dataclass
class CheckRecord:
    name: str
    title: str
    status: Status = Status.SKIPPED
    seconds: float = 0.0
    limit_s: float = 0.0
    steps: list[Step] = field(default_factory=list)
    metrics: dict[str, Any] = field(default_factory=dict)
    log_tail: str = ""

    def settle(self) -> None:
        """The status from the steps: any error, else any failure, else any pass, else skipped."""
        found = {s.status for s in self.steps}
        for status in (Status.TIMEOUT, Status.ERROR, Status.FAIL, Status.PASS):
            if status in found:
                self.status = status
                return
        self.status = Status.SKIPPED

    def to_dict(self) -> dict[str, Any]:
        return json.loads(json.dumps(asdict(self), default=str))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CheckRecord:
        steps = [Step(s["name"], Status(s["status"]), s.get("detail", ""), s.get("seconds", 0.0))
                 for s in data.get("steps", [])]
        return cls(data["name"], data["title"], Status(data["status"]), data.get("seconds", 0.0),
                   data.get("limit_s", 0.0), steps, data.get("metrics", {}), data.get("log_tail", ""))


def write_json(path: Path, data: Any) -> None:
    """Write ``data`` to ``path`` atomically (a temporary file renamed over it)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str) + "\n")
    os.replace(tmp, path)


class Recorder:
    """Collects one check's steps and measurements into ``path`` as they happen."""

    def __init__(self, record: CheckRecord, path: Path) -> None:
        self.record, self.path = record, path
        self.started = time.monotonic()
        self.recorded: set[int] = set()  # ids of exceptions already recorded by a step

    def _add(self, step: Step) -> None:
        self.record.steps.append(step)
        self.flush()

    def flush(self) -> None:
        self.record.seconds = round(time.monotonic() - self.started, 2)
        self.record.settle()
        write_json(self.path, self.record.to_dict())

    def expect(self, name: str, ok: bool, detail: str = "") -> bool:
        """A verdict: passed when ``ok``, else failed (the check goes on)."""
        self._add(Step(name, Status.PASS if ok else Status.FAIL, detail))
        return ok

    def note(self, name: str, detail: str) -> None:
        """A step that ran and is reported, not judged."""
        self._add(Step(name, Status.PASS, detail))

    def skip(self, name: str, reason: str) -> None:
        self._add(Step(name, Status.SKIPPED, reason))

    def error(self, exc: BaseException) -> None:
        """An exception that ended the check, unless a step already recorded it."""
        if id(exc) not in self.recorded:
            self._add(Step("unexpected error", Status.ERROR, describe(exc)))

    def attempt(self, fn: Callable[..., T], *args: Any) -> T | None:
        """``fn(*args)``, or None when it raises (recorded as an error): the check goes on with the next part."""
        try:
            return fn(*args)
        except Exception as exc:  # noqa: BLE001 - recorded; the other parts of the check still run
            self.error(exc)
            return None

    def metric(self, key: str, value: Any) -> None:
        self.record.metrics[key] = value
        self.flush()

    @contextmanager
    def step(self, name: str) -> Iterator[Step]:
        """Run a block as a step: passed when it returns, an error (re-raised) when it raises. The block may
        set ``step.detail``."""
        step, start = Step(name, Status.PASS), time.monotonic()
        try:
            yield step
        except BaseException as exc:
            step.status = Status.ERROR
            step.detail = (f"{step.detail}; " if step.detail else "") + describe(exc)
            self.recorded.add(id(exc))
            raise
        finally:
            step.seconds = round(time.monotonic() - start, 2)
            self._add(step)


def describe(exc: BaseException) -> str:
    last = traceback.extract_tb(exc.__traceback__)[-1:] if exc.__traceback__ else []
    where = f" (at {Path(last[0].filename).name}:{last[0].lineno})" if last else ""
    return f"{type(exc).__name__}: {str(exc).strip()[:600]}{where}"
