"""schemathesis hooks for the schema fuzz run of `deploykit serve` (tests/test_serve_fuzz.py): bodies name
a served model in turn (the schema alone makes up names, and every request would be a 404), and a
check that a stream the server ended itself ends as its API ends one: `data: [DONE]` (chat, completions),
a response's last event (`/v1/responses`) or `message_stop` / `error` (`/v1/messages`)."""

from __future__ import annotations

import itertools
from typing import Any

import schemathesis

# the last event of a whole stream, by route (the others end with ``data: [DONE]``)
LAST_EVENTS = {"/v1/responses": {"response.completed", "response.incomplete", "response.failed"},
               "/v1/messages": {"message_stop", "error"}}
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
    last = LAST_EVENTS.get(case.path)
    if last is not None:
        events = [line.removeprefix("event: ") for line in response.text.splitlines() if line.startswith("event: ")]
        if not events or events[-1] not in last:
            raise AssertionError(f"the stream ended without its last event: ...{response.text[-300:]!r}")
        return True
    if not response.text.rstrip().endswith("data: [DONE]"):
        raise AssertionError(f"the stream ended without data: [DONE]: ...{response.text[-300:]!r}")
    return True
