"""schemathesis hooks for the schema fuzz run of `deploykit serve` (tests/test_serve_fuzz.py): bodies name
a served model in turn (the schema alone makes up names, and every request would be a 404), and a
check that a stream the server ended itself ends with `data: [DONE]`."""

from __future__ import annotations

import itertools
from typing import Any

import schemathesis

MODELS = itertools.cycle([None, "tiny-chat", "minilm"])  # None: keep the name the schema made up


@schemathesis.hook
def before_call(context: schemathesis.HookContext, case: schemathesis.Case, kwargs: dict[str, Any]) -> None:
    model = next(MODELS)
    if model is not None and isinstance(case.body, dict) and "model" in case.body:
        case.body["model"] = model


@schemathesis.check
def streams_end_with_done(ctx: schemathesis.CheckContext, response: schemathesis.Response,
                          case: schemathesis.Case) -> bool | None:
    content_type = (response.headers.get("content-type") or [""])[0]
    if not content_type.startswith("text/event-stream") or response.stream_cut_short:
        return None  # not a stream, or schemathesis stopped reading it (it reads 20 events)
    if not response.text.rstrip().endswith("data: [DONE]"):
        raise AssertionError(f"the stream ended without data: [DONE]: ...{response.text[-300:]!r}")
    return True
