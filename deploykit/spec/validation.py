"""A manifest's validation errors as located issues: file, line, column, field path and a hint.

Pydantic says what is wrong by field path; this module points each complaint into the YAML document it
came from, merges the complaints of a union's members into one, and adds 'did you mean' hints for
misspelt keys and values. A wrong ``apiVersion`` or ``kind`` is reported alone, before any field.
"""

from __future__ import annotations

import difflib
import re
from typing import Any

from pydantic import BaseModel, ValidationError

from ..errors import Issue
from .schema import API_VERSION, KIND, ModelDeployment
from .yamlsource import Document


def _fields_of(model: type[BaseModel]) -> list[str]:
    return [f.alias or name for name, f in model.model_fields.items()]


def _submodel(path: tuple[str | int, ...]) -> type[BaseModel] | None:
    """The pydantic model found at a field path, for 'did you mean' hints."""
    model: Any = ModelDeployment
    for part in path:
        if isinstance(part, int) or model is None:
            continue
        fields = {(f.alias or n): f for n, f in model.model_fields.items()}
        if part not in fields:
            return None
        annotation = fields[part].annotation
        candidates = [annotation, *getattr(annotation, "__args__", ())]
        model = next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None)
    return model


def _hint_for(err: Any, path: tuple[str | int, ...]) -> str | None:
    if err["type"] == "extra_forbidden" and path:
        parent = _submodel(path[:-1])
        if parent is not None:
            close = difflib.get_close_matches(str(path[-1]), _fields_of(parent), n=1, cutoff=0.6)
            if close:
                return f"did you mean {close[0]!r}?"
            return "allowed keys here: " + ", ".join(_fields_of(parent))
    if err["type"] == "literal_error" and isinstance(err.get("input"), str):
        expected = re.findall(r"'([^']*)'", err.get("ctx", {}).get("expected", ""))
        close = difflib.get_close_matches(err["input"], expected, n=1, cutoff=0.5)
        if close:
            return f"did you mean {close[0]!r}?"
    return None


def _clean_path(loc: tuple[Any, ...]) -> tuple[str | int, ...]:
    # pydantic adds union-member tags ("list[...]", "literal['all']") and validator names to loc.
    out: list[str | int] = []
    for part in loc:
        if isinstance(part, str) and ("[" in part or part.startswith("function-")):
            continue
        out.append(part)
    return tuple(out)


def validation_issues(exc: ValidationError, doc: Document, source: str) -> list[Issue]:
    """Every error of ``exc`` as an issue located in ``doc``, a union's complaints about one field merged."""
    issues: list[Issue] = []
    for err in exc.errors():
        path = _clean_path(err["loc"])
        at = (err.get("ctx") or {}).get("at")
        if at:  # a cross-field check raised on the model holding the field to fix: point at that field
            path = path + tuple(int(p) if p.isdigit() else p for p in str(at).split("."))
        line, column, message = _located_message(err, path, doc)
        field = ".".join(str(p) for p in path)
        previous = next((i for i, issue in enumerate(issues) if issue.field == (field or None)
                         and (issue.line, issue.column) == (line, column)), None)
        if previous is not None:  # one complaint per union member: say them as one
            issues[previous] = _merge(issues[previous], message)
            continue
        issues.append(Issue(message, source, line, column, field or None, _hint_for(err, path)))
    return issues


def _located_message(err: Any, path: tuple[str | int, ...], doc: Document) -> tuple[int, int, str]:
    """Where in ``doc`` one pydantic error points (a missing or unknown key: at the key), and what it says."""
    if err["type"] == "missing":
        line, column = doc.locate(path[:-1], key=True) if path[:-1] else (doc.line, 1)
        return line, column, f"required field {path[-1]!r} is missing"
    if err["type"] == "extra_forbidden":
        line, column = doc.locate(path, key=True)
        return line, column, f"unknown field {path[-1]!r}"
    line, column = doc.locate(path)
    message = err["msg"]
    given = err.get("input")
    if (err["type"] != "literal_error" and given is not None
            and not isinstance(given, (dict, list)) and str(given) not in message):
        message += f"{_GOT}{_short_repr(given)})"
    return line, column, message


_GOT = " (got "
_MAX_GOT = 80  # a value quoted back in a message; a 1 MiB string is shown by its start


def _short_repr(value: object) -> str:
    text = repr(value)
    return text if len(text) <= _MAX_GOT else f"{text[:_MAX_GOT]}... ({len(text)} characters)"


def _split_got(message: str) -> tuple[str, str]:
    """``message`` without its trailing `` (got VALUE)``, and that part. String search rather than a
    regex: ``" \\(got .*\\)$"`` retries ``.*`` from every ``(got`` a hostile value holds (quadratic)."""
    at = message.find(_GOT)
    if at < 0 or not message.endswith(")"):
        return message, ""
    return message[:at], message[at:]


def _merge(issue: Issue, message: str) -> Issue:
    prefix = "Input should be "
    first, got = _split_got(issue.message)
    second, _ = _split_got(message)
    if first.startswith(prefix) and second.startswith(prefix):
        merged = f"{first} or {second[len(prefix):]}"
    else:
        merged = f"{first}; or {second}"
    return Issue(merged + got, issue.path, issue.line, issue.column, issue.field, issue.hint)


def header_issues(doc: Document, source: str) -> list[Issue]:
    """apiVersion and kind first: if they are wrong, field errors below would only be noise."""
    data = doc.data
    if not isinstance(data, dict):
        line, column = doc.values.get((), (doc.line, 1))
        kind = type(data).__name__ if data is not None else "null"
        return [Issue(f"a manifest must be a mapping, found {kind}", source, line, column,
                      hint="start with 'apiVersion: deploykit/v1' and 'kind: ModelDeployment'")]
    issues = []
    for key, want in (("apiVersion", API_VERSION), ("kind", KIND)):
        if key in data and data[key] != want:
            line, column = doc.locate((key,))
            issues.append(Issue(f"expected {want!r}, got {data[key]!r}", source, line, column, key,
                                hint="this file may not be a deploykit manifest"))
    return issues
