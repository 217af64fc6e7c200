"""What a chat request's ``response_format``, ``tools`` and ``tool_choice`` ask, apart from any engine:
``plan_of`` turns them into a ``Structured`` (the JSON schema the answer must follow, if any, as an
engine ``Constraint``, and how tool calls are read from the answer); ``tool_calls_of`` reads them.
Which schema keywords an engine can enforce is the engine's to say (``TextRuntime.check_grammar``), so an
engine with its own grammar support (llama.cpp) can take the same ``Constraint``.

Forced calls (as vLLM does): ``tool_choice`` naming a function constrains the answer to that function's
``parameters``, and the whole answer is its ``arguments``; ``"required"`` constrains it to a JSON array of
``{"name", "arguments"}`` objects, one per call (at most one when ``parallel_tool_calls`` is false).
``"auto"`` leaves the answer free and reads the calls the model wrote in its family's format, named by
``spec.serving.tool_call_parser`` (``hermes``: ``<tool_call>{"name": ..., "arguments": ...}</tool_call>``,
Hermes and Qwen2/2.5/3).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from ...engine.text import RequestError
from ...engine.types import Constraint
from .protocol import ChatCompletionRequest

ToolMode = Literal["none", "auto", "required", "named"]
ToolFormat = Literal["template", "generic"]
PARSERS = ("hermes",)
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


@dataclass(frozen=True)
class Structured:
    constraint: Constraint | None = None
    mode: ToolMode = "none"
    function: str | None = None  # the named function ("named")
    tools: list[dict[str, Any]] = field(default_factory=list)  # for the chat template ("auto", forced)
    generic: bool = False  # the tools described in a system message, not by the chat template (``generic``)
    one_call: bool = False  # "auto" with parallel_tool_calls false: at most one call (the generic format only)


def plan_of(body: ChatCompletionRequest) -> Structured:
    """What ``body`` asks of the answer (RequestError with ``param`` when it asks two things at once, or
    ``stop`` beside a constraint: a stop string that matches inside the constrained JSON would cut it and
    return broken JSON with finish ``stop``)."""
    plan = _plan(body)
    if plan.constraint is not None and body.stop_strings():
        raise RequestError(f"stop cannot be used with {plan.constraint.param}: the answer must be whole JSON, and "
                           "a stop string matching inside it would cut it; drop stop (the grammar ends the answer "
                           "when the JSON is complete)", param="stop")
    return plan


def _plan(body: ChatCompletionRequest) -> Structured:
    mode = body.tool_mode()
    tools = [t.model_dump(exclude_none=True) for t in body.tools or []] if mode != "none" else []
    fmt = body.response_format
    if mode != "none" and fmt is not None and fmt.type != "text":
        raise RequestError("response_format and tools cannot both shape one answer: use tool_choice 'none' or "
                           "drop response_format", param="response_format")
    if mode == "named":
        assert not isinstance(body.tool_choice, str) and body.tool_choice is not None
        name = body.tool_choice.function.name
        return Structured(Constraint(json.dumps(_parameters(body, name)), param="tools"), mode, name, tools)
    if mode == "required":
        return Structured(Constraint(json.dumps(_calls_schema(body)), param="tools"), mode, None, tools)
    if mode == "auto":
        return Structured(None, mode, None, tools, one_call=body.parallel_tool_calls is False)
    return Structured(_format_constraint(body), "none")


def _format_constraint(body: ChatCompletionRequest) -> Constraint | None:
    fmt = body.response_format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return Constraint(json.dumps({"type": "object"}), strict=False)
    assert fmt.json_schema is not None
    return Constraint(json.dumps(fmt.json_schema.schema_ or {"type": "object"}))


def _parameters(body: ChatCompletionRequest, name: str) -> dict[str, Any]:
    [tool] = [t for t in body.tools or [] if t.function.name == name]
    return tool.function.parameters or {"type": "object", "properties": {}}


def _calls_schema(body: ChatCompletionRequest) -> dict[str, Any]:
    return calls_schema([t.model_dump(exclude_none=True) for t in body.tools or []],
                        one=body.parallel_tool_calls is False)


def calls_schema(tools: list[dict[str, Any]], *, one: bool = False) -> dict[str, Any]:
    """A JSON array of calls, each ``{"name": one of the tools, "arguments": that tool's parameters}`` (at
    most ``one``). A tool's parameters nested here lose their root: their ``$defs``/``definitions`` move to
    this schema's ``$defs`` under the tool's name, and their references follow (``_hoisted``)."""
    defs: dict[str, Any] = {}
    each = []
    for t in tools:
        name = t["function"]["name"]
        arguments, own = _hoisted(_tool_parameters(t), f"{name}.")
        defs.update(own)
        each.append({"type": "object", "properties": {"name": {"const": name}, "arguments": arguments},
                     "required": ["name", "arguments"]})
    schema: dict[str, Any] = {"type": "array", "items": {"anyOf": each}, "minItems": 1}
    if defs:
        schema["$defs"] = defs
    if one:
        schema["maxItems"] = 1
    return schema


def _tool_parameters(tool: dict[str, Any]) -> dict[str, Any]:
    return tool["function"].get("parameters") or {"type": "object", "properties": {}}


_DEF_KEYS = ("$defs", "definitions")


def _hoisted(parameters: dict[str, Any], prefix: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """``parameters`` to nest under another root, and the definitions that root must hold for it: its own
    definitions renamed ``prefix + name``, every ``$ref`` to them (or to its root, ``#``) rewritten; a
    schema without definitions or root references comes back as it is."""
    if not any(k in parameters for k in _DEF_KEYS) and '"#' not in json.dumps(parameters):
        return parameters, {}

    def moved(node: Any) -> Any:
        if isinstance(node, list):
            return [moved(x) for x in node]
        if not isinstance(node, dict):
            return node
        out = {k: moved(v) for k, v in node.items() if k not in _DEF_KEYS}
        ref = node.get("$ref")
        if isinstance(ref, str):
            for key in _DEF_KEYS:
                if ref.startswith(f"#/{key}/"):
                    out["$ref"] = f"#/$defs/{prefix}{ref[len(key) + 3:]}"
            if ref == "#":
                out["$ref"] = f"#/$defs/{prefix.rstrip('.')}"
        return out

    defs = {f"{prefix}{name}": moved(sub) for key in _DEF_KEYS
            for name, sub in (parameters.get(key) or {}).items()}
    defs[prefix.rstrip(".")] = moved(parameters)
    return {"$ref": f"#/$defs/{prefix.rstrip('.')}"}, defs


def tool_format(setting: str | None, *, template_takes_tools: bool, mode: ToolMode) -> ToolFormat:
    """How a request's tools reach the model (``spec.serving.tool_format``): ``template`` (the chat
    template renders them, the model's own call syntax is parsed), or ``generic`` (a system message
    describes them, the grammar shapes the answer). Unset: the template's, except for ``"auto"`` where the
    template renders no tools (generic: rather than a 400)."""
    if setting == "generic" or (setting is None and mode == "auto" and not template_takes_tools):
        return "generic"
    return "template"


def generic(plan: Structured, *, stop: bool) -> Structured:
    """``plan`` in the generic tool format: ``"auto"``'s answer is constrained to one JSON object, either
    ``{"content": text}`` or ``{"tool_calls": [{"name", "arguments"}, ...]}``; forced calls keep their
    constraint. A stop string would cut that JSON: refused, as beside any constraint."""
    if plan.mode != "auto":
        return replace(plan, generic=True)
    if stop:
        raise RequestError("stop cannot be used with tools in the generic tool format (the answer is JSON a stop "
                           "string could cut); drop stop", param="stop")
    calls = calls_schema(plan.tools, one=plan.one_call)
    defs = calls.pop("$defs", None)
    schema: dict[str, Any] = {"anyOf": [
        {"type": "object", "properties": {"content": {"type": "string"}}, "required": ["content"]},
        {"type": "object", "properties": {"tool_calls": calls}, "required": ["tool_calls"]}]}
    if defs:
        schema["$defs"] = defs
    return replace(plan, constraint=Constraint(json.dumps(schema), param="tools"), generic=True)


def described(messages: list[dict[str, Any]], plan: Structured) -> list[dict[str, Any]]:
    """``messages`` with the tools and the answer's form described in the system message (the first one,
    or a new one before the others)."""
    lines = ["You can call these tools (their arguments are JSON following the parameters schema):"]
    lines += [json.dumps({"name": t["function"]["name"], "description": t["function"].get("description", ""),
                          "parameters": _tool_parameters(t)}, separators=(",", ":")) for t in plan.tools]
    if plan.mode == "auto":
        lines.append('Answer with one JSON object: {"content": "your answer"} to answer in text, or '
                     '{"tool_calls": [{"name": "a tool", "arguments": {...}}]} to call tools.')
    elif plan.mode == "required":
        lines.append('Answer with the calls, a JSON array: [{"name": "a tool", "arguments": {...}}].')
    else:
        lines.append(f"Answer with the arguments of {plan.function} as one JSON object.")
    text = "\n".join(lines)
    if messages and messages[0]["role"] == "system":
        return [{**messages[0], "content": f"{messages[0]['content']}\n\n{text}"}] + messages[1:]
    return [{"role": "system", "content": text}] + messages


def check_auto(plan: Structured, *, parser: str | None, template_takes_tools: bool) -> None:
    """``tool_choice: auto`` needs a template that renders tools and a parser for the model's calls."""
    if plan.mode != "auto":
        return
    if plan.one_call:
        raise RequestError("parallel_tool_calls: false cannot be enforced with tool_choice 'auto' in the template "
                           "tool format (the model writes its calls freely); use tool_choice 'required' or a named "
                           "function, or spec.serving.tool_format: generic", param="parallel_tool_calls")
    if not template_takes_tools:
        raise RequestError("tool_choice 'auto' needs a chat template that renders tools, and this model's has no "
                           "tool support; use tool_choice 'required' or a named function (deploykit then "
                           "constrains the answer to the call)", param="tool_choice", code="no_tool_template")
    if parser is None:
        raise RequestError("tool_choice 'auto' needs spec.serving.tool_call_parser (how this model family writes "
                           "tool calls, e.g. hermes) in the deployment's manifest; use tool_choice 'required' or a "
                           "named function meanwhile", param="tool_choice", code="no_tool_call_parser")


def new_call(name: str, arguments: str) -> dict[str, Any]:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def tool_calls_of(plan: Structured, text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """The answer's content (None when it is all calls) and its tool calls."""
    if plan.mode == "named":
        assert plan.function is not None
        return None, [new_call(plan.function, text)]
    if plan.mode == "required":
        calls = json.loads(text)
        return None, [new_call(c["name"], json.dumps(c["arguments"])) for c in calls]
    if plan.mode == "auto" and plan.generic:
        return generic_calls(text)
    if plan.mode == "auto":
        return hermes_calls(text, {t["function"]["name"] for t in plan.tools})
    return text, []


def generic_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """A whole answer in the generic format: ``{"content": ...}`` or ``{"tool_calls": [...]}``."""
    answer = json.loads(text)
    if "tool_calls" in answer:
        return None, [new_call(c["name"], json.dumps(c["arguments"])) for c in answer["tool_calls"]]
    return answer["content"], []


def hermes_calls(text: str, names: set[str]) -> tuple[str | None, list[dict[str, Any]]]:
    """Calls in the Hermes/Qwen form, ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``; a block
    that is not such a call of a known function stays in the content (as vLLM's hermes parser does)."""
    calls, kept, last = [], [], 0
    for match in _HERMES.finditer(text):
        try:
            call = json.loads(match.group(1))
            name, arguments = call["name"], call.get("arguments", call.get("parameters", {}))
        except (ValueError, KeyError, TypeError):
            continue
        if name not in names:
            continue
        kept.append(text[last:match.start()])
        last = match.end()
        calls.append(new_call(name, arguments if isinstance(arguments, str) else json.dumps(arguments)))
    kept.append(text[last:])
    content = "".join(kept).strip() if calls else text
    return (content or None), calls


class RequiredStream:
    """A ``"required"`` answer read as it is generated. The grammar writes ``[{"name": N, "arguments": A}, ...]``
    (compact, properties in the schema's order), so a call's name is known once ``"arguments": `` follows it,
    and its arguments are the JSON value written next. ``push`` returns OpenAI's tool-call deltas: a call's
    id and name, then pieces of its arguments as they come, never content; a cut answer leaves its last
    call's arguments partial, as OpenAI's does. ``calls`` holds what was read so far."""

    _HEAD = re.compile(r'[\[},\s]*\{"name":\s*"([^"\\]*)",\s*"arguments":\s*(?=\S)')

    def __init__(self) -> None:
        self.text, self.pos = "", 0
        self.calls: list[dict[str, Any]] = []
        self._in_value = self._in_string = self._escaped = False
        self._depth = 0

    def push(self, delta: str) -> list[dict[str, Any]]:
        self.text += delta
        out: list[dict[str, Any]] = []
        while True:
            if not self._in_value:
                head = self._HEAD.match(self.text, self.pos)
                if head is None:
                    return out
                self.calls.append(new_call(head.group(1), ""))
                out.append({"index": len(self.calls) - 1, **new_call_delta(self.calls[-1])})
                self.pos, self._in_value, self._depth = head.end(), True, 0
                continue
            start, ended = self.pos, self._scan()
            if self.pos > start:
                piece = self.text[start:self.pos]
                self.calls[-1]["function"]["arguments"] += piece
                out.append({"index": len(self.calls) - 1, "function": {"arguments": piece}})
            if not ended:
                return out
            self._in_value = False

    def _scan(self) -> bool:
        """Advance over the arguments' JSON value; True once it is whole."""
        while self.pos < len(self.text):
            c = self.text[self.pos]
            if self._in_string:
                self._escaped, self._in_string = (False, True) if self._escaped else (c == "\\", c != '"')
            elif c == '"':
                self._in_string = True
            elif c in "{[":
                self._depth += 1
            elif c in "}]" or (c == "," and self._depth == 0):
                if self._depth == 0:  # a scalar ended by the call's own "}" or ","
                    return True
                self._depth -= 1
                if self._depth == 0:
                    self.pos += 1
                    return True
            self.pos += 1
        return False


def new_call_delta(call: dict[str, Any]) -> dict[str, Any]:
    return {"id": call["id"], "type": "function", "function": {"name": call["function"]["name"], "arguments": ""}}


class HermesStream:
    """A streamed ``"auto"`` answer: its content goes out as it comes, up to the first ``<tool_call>``;
    from there on the text is held and read for calls once the answer ended (``finish``). A tail that
    may be the start of the tag is held back until it cannot be. The content sent before a call keeps
    its whitespace (the whole answer's content is stripped around calls)."""

    TAG = "<tool_call>"

    def __init__(self, names: set[str]) -> None:
        self.names = names
        self.text = ""
        self.sent = 0  # characters of ``text`` already sent as content
        self.calling = False

    def push(self, delta: str) -> str:
        """Content that can be sent now ("" when none)."""
        self.text += delta
        if self.calling:
            return ""
        at = self.text.find(self.TAG, max(0, self.sent - len(self.TAG)))
        if at >= 0:
            self.calling = True
            return self._take(at)
        held = next((k for k in range(len(self.TAG) - 1, 0, -1) if self.text.endswith(self.TAG[:k])), 0)
        return self._take(len(self.text) - held)

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """The content not sent yet and the calls of the whole answer."""
        rest = self.text[self.sent:]
        content, calls = hermes_calls(rest, self.names)
        if not calls:
            return rest, []
        return content or "", calls

    def _take(self, upto: int) -> str:
        out = self.text[self.sent:upto]
        self.sent = max(self.sent, upto)
        return out


class GenericStream:
    """A streamed ``"auto"`` answer in the generic format. ``{"content": "...`` is text: sent as its JSON
    string is decoded (an escape cut in half waits for its end); ``{"tool_calls": ...`` is read once the
    answer ended (``finish``), as ``HermesStream`` reads its calls."""

    _CONTENT = re.compile(r'\s*\{\s*"content"\s*:\s*"')

    def __init__(self) -> None:
        self.text = ""
        self.sent = 0  # characters of the decoded content already sent

    def push(self, delta: str) -> str:
        self.text += delta
        content = self._content()
        if content is None:
            return ""
        out = content[self.sent:]
        self.sent = len(content)
        return out

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        try:
            content, calls = generic_calls(self.text)
        except (ValueError, KeyError, TypeError, AttributeError):  # cut (``length``): the text as far as it went
            partial = self._content()
            content, calls = self.text if partial is None else partial, []
        return (content or "")[self.sent:], calls

    def _content(self) -> str | None:
        """The content's text decoded so far (None: this answer is not content)."""
        head = self._CONTENT.match(self.text)
        if head is None:
            return None
        body = self.text[head.end():]
        for end in range(len(body), max(-1, len(body) - 12), -1):  # at most an escape and the closing '"}'
            try:
                return str(json.loads(f'"{body[:end]}"'))
            except ValueError:
                continue
        return ""


def auto_reader(plan: Structured) -> HermesStream | GenericStream:
    """What reads a streamed ``"auto"`` answer of ``plan``."""
    return GenericStream() if plan.generic else HermesStream({t["function"]["name"] for t in plan.tools})
