"""Golden references for a rollout's gates: one JSON object per line, a prompt (``"prompt"``: text, or
``"messages"``: a chat) and the ``"completion"`` a good model gives it.

Read here, with the line of every problem, so ``deploykit validate`` refuses a missing, empty or malformed
file before anything loads; scoring the cases is the engine's (``engine.scoring``). No torch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..files import read_regular_file

MAX_GOLDEN_CASES = 1000  # bounded: every case is one forward of each generation before any traffic
MAX_GOLDEN_BYTES = 8 << 20  # read at most this much: a manifest may name /dev/zero or a huge file


class GoldenError(ValueError):
    """What is wrong with a golden file, with the line it is on (``line``: 0 for the file as a whole)."""

    def __init__(self, message: str, line: int = 0) -> None:
        super().__init__(message)
        self.line = line


@dataclass(frozen=True)
class GoldenCase:
    """One reference: ``prompt`` text or chat ``messages`` (exactly one), and the expected completion."""

    completion: str
    prompt: str | None = None
    messages: tuple[dict[str, Any], ...] | None = None

    def to_json(self) -> dict[str, Any]:
        head: dict[str, Any] = {"messages": list(self.messages)} if self.messages is not None else {
            "prompt": self.prompt}
        return {**head, "completion": self.completion}


def _case(data: object, line: int) -> GoldenCase:
    if not isinstance(data, dict):
        raise GoldenError(f"line {line}: a case must be a JSON object, found {type(data).__name__}", line)
    unknown = sorted(set(data) - {"prompt", "messages", "completion"})
    if unknown:
        raise GoldenError(f"line {line}: unknown key {unknown[0]!r} (a case has prompt or messages, and "
                          "completion)", line)
    if ("prompt" in data) == ("messages" in data):
        raise GoldenError(f"line {line}: give exactly one of prompt and messages", line)
    completion = data.get("completion")
    if not isinstance(completion, str) or not completion:
        raise GoldenError(f"line {line}: completion must be a non-empty string", line)
    if "prompt" in data:
        if not isinstance(data["prompt"], str):
            raise GoldenError(f"line {line}: prompt must be a string", line)
        return GoldenCase(completion, prompt=data["prompt"])
    messages = data["messages"]
    if (not isinstance(messages, list) or not messages
            or not all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                       for m in messages)):
        raise GoldenError(f"line {line}: messages must be a non-empty list of {{\"role\", \"content\"}} objects",
                          line)
    return GoldenCase(completion, messages=tuple(messages))


def parse_golden(text: str) -> list[GoldenCase]:
    """The cases of a golden file's text; blank lines are skipped. Raises ``GoldenError``."""
    cases = []
    for number, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            data = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise GoldenError(f"line {number}: not JSON ({exc.msg}); a golden file holds one JSON object per "
                              "line", number) from None
        cases.append(_case(data, number))
        if len(cases) > MAX_GOLDEN_CASES:
            raise GoldenError(f"more than {MAX_GOLDEN_CASES} cases; every case is scored before any traffic "
                              "moves: keep the file small", number)
    if not cases:
        raise GoldenError("the file holds no cases (one JSON object per line)")
    return cases


def read_golden(path: Path) -> list[GoldenCase]:
    """The cases of the golden file at ``path``: a regular file of at most ``MAX_GOLDEN_BYTES``. Raises
    ``GoldenError`` (missing, unreadable, not a regular file, too large, empty, malformed)."""
    try:
        text = read_regular_file(path, MAX_GOLDEN_BYTES).decode("utf-8")
    except FileNotFoundError:
        raise GoldenError(f"golden file {str(path)!r} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise GoldenError(f"cannot read golden file {str(path)!r}: {exc}") from None
    return parse_golden(text)
