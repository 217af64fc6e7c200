"""One check in its own process: ``python -m gpucheck.child NAME CONTEXT_JSON RECORD_JSON``. Whatever the check
raises is recorded as an error step; the record file is written after every step."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

from .checks import by_name
from .context import Context
from .record import CheckRecord, Recorder


def main(argv: list[str]) -> int:
    name, context_path, record_path = argv
    check = by_name(name)
    ctx = Context.from_json(Path(context_path).read_text())
    rec = Recorder(CheckRecord(name, check.title, limit_s=check.limit_s), Path(record_path))
    rec.flush()
    try:
        importlib.import_module(f"gpucheck.checks.{name}").run(ctx, rec)
    except BaseException as exc:  # noqa: BLE001 - every failure becomes part of the report
        rec.error(exc)
        raise
    finally:
        rec.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
