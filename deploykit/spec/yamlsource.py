"""YAML reading that remembers where every value came from.

PyYAML alone loses positions, silently keeps the last of two duplicate keys, reads ``yes``/``on`` as
booleans (YAML 1.1) and expands aliases without limit. deploykit composes the node graph with PyYAML
and builds plain Python values itself, so that:

- every mapping key and value has a (line, column), looked up by field path (``("spec", "gpus", 1)``);
- duplicate keys, merge keys and runaway alias expansion ("billion laughs") are errors, not surprises:
  aliases are counted in values and in bytes, so a few large values repeated by aliases cannot grow
  past what a file of ``MAX_BYTES`` could hold;
- booleans are YAML 1.2's ``true``/``false`` only; numbers are YAML 1.2's core forms only (``12``, ``-3``,
  ``0x1f``, ``0o17``, ``1.5``, ``2e3``: no base 60 ``1:30``, no ``0b1``, no ``1_000``), of at most
  ``MAX_DIGITS`` digits, and finite (``.inf`` and ``.nan`` are refused where they are written): PyYAML's
  base-60 reading is quadratic in the digits, and ``int()`` refuses more than 4300 of them;
- input that is empty, binary, not UTF-8 or too large is refused before parsing.

This module never imports torch and never touches the filesystem beyond reading the bytes it is given.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

import yaml

from ..errors import Issue, ManifestError

MAX_BYTES = 1 << 20  # a manifest is a page of text; 1 MiB is generous
MAX_NODES = 20_000  # values built after alias expansion; a real manifest has a few dozen
MAX_EXPANDED_BYTES = MAX_BYTES  # text of keys and values after alias expansion: what the file could hold
MAX_DEPTH = 64
MAX_DIGITS = 30  # digits of a number: every bound in the schema has fewer than 20

Path_ = tuple[str | int, ...]


class _Loader(yaml.SafeLoader):
    """SafeLoader whose implicit booleans are YAML 1.2's: ``true``/``false`` only, and whose composer stops
    at ``MAX_DEPTH`` (PyYAML composes nested nodes by recursion: ``[[[...]]]`` 900 deep exhausted Python's
    stack before any depth check on the composed nodes could run)."""

    _depth = 0

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node | None:
        if self._depth > MAX_DEPTH:
            raise yaml.composer.ComposerError(None, None, f"the document nests deeper than {MAX_DEPTH} levels",
                                              self.peek_event().start_mark)
        self._depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


_INT_TAG, _FLOAT_TAG = "tag:yaml.org,2002:int", "tag:yaml.org,2002:float"
_Loader.yaml_implicit_resolvers = {
    key: [(tag, rx) for tag, rx in resolvers if tag not in ("tag:yaml.org,2002:bool", _INT_TAG, _FLOAT_TAG)]
    for key, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)
# YAML 1.2's core schema (https://yaml.org/spec/1.2.2/#1032-tag-resolution), matched with ``fullmatch``
_CORE_INT = re.compile(r"[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+")
_CORE_FLOAT = re.compile(r"[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?")
_CORE_SPECIAL = re.compile(r"[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN)")
_Loader.add_implicit_resolver(_INT_TAG, re.compile(r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$"),
                              list("-+0123456789"))
_Loader.add_implicit_resolver(
    _FLOAT_TAG, re.compile(r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?|[-+]?\.(?:inf|Inf|INF)"
                           r"|\.(?:nan|NaN|NAN))$"), list("-+.0123456789"))


def core_number(text: str, tag: str) -> int | float:
    """The number a YAML 1.2 core int or float scalar stands for; ValueError (saying why) for any other
    form, more than ``MAX_DIGITS`` digits, or a float that is not finite."""
    digits = sum(c.isalnum() for c in text) - (2 if text[:2] in ("0x", "0o") else 0)
    if digits > MAX_DIGITS:
        raise ValueError(f"a number of {digits} digits; at most {MAX_DIGITS} are read")
    if tag == _INT_TAG and _CORE_INT.fullmatch(text):
        return int(text, 16 if text.startswith("0x") else 8 if text.startswith("0o") else 10)
    if tag == _FLOAT_TAG and _CORE_FLOAT.fullmatch(text):
        value = float(text)
        if math.isfinite(value):
            return value
        raise ValueError(f"{text} is too large for a number")
    if tag == _FLOAT_TAG and _CORE_SPECIAL.fullmatch(text):
        raise ValueError(f"{text} is not a finite number")
    raise ValueError(f"{text!r} is not a YAML 1.2 {'integer' if tag == _INT_TAG else 'number'} (base 60, binary "
                     "and underscores are not read)")


@dataclass
class Document:
    """One YAML document: its value, and the position of every key and value in it."""

    data: Any
    index: int  # 0-based position of the document in the file
    line: int  # 1-based line where the document starts
    values: dict[Path_, tuple[int, int]] = field(default_factory=dict)
    keys: dict[Path_, tuple[int, int]] = field(default_factory=dict)

    def locate(self, path: Path_, *, key: bool = False) -> tuple[int, int]:
        """The best (line, column) for a field path: the exact node, else its nearest ancestor."""
        table = self.keys if key else self.values
        for n in range(len(path), -1, -1):
            sub = path[:n]
            if sub in table:
                return table[sub]
            if sub in self.keys:
                return self.keys[sub]
        return (self.line, 1)


class _Builder:
    """Turns composed nodes into Python values, recording positions and problems."""

    def __init__(self, source: str, loader: _Loader) -> None:
        self.source = source
        self.loader = loader
        self.nodes = 0
        self.bytes = 0  # scalar text built so far, aliases counted each time they are used
        self.issues: list[Issue] = []

    def issue(self, message: str, mark: yaml.Mark, path: Path_, hint: str | None = None) -> None:
        self.issues.append(Issue(message, self.source, mark.line + 1, mark.column + 1,
                                 _dotted(path) or None, hint))

    def build(self, node: yaml.Node, path: Path_, doc: Document, depth: int = 0) -> Any:
        self.nodes += 1
        if self.nodes > MAX_NODES or depth > MAX_DEPTH:
            raise _TooLarge(node.start_mark, f"the document expands to more than {MAX_NODES} values or nests "
                                             f"deeper than {MAX_DEPTH} levels (an alias bomb?)")
        if isinstance(node, yaml.ScalarNode):
            self._count(node)
        # A block mapping or list starts on the line after its key: point at the key instead.
        if isinstance(node, yaml.ScalarNode) or getattr(node, "flow_style", False) or not path:
            doc.values.setdefault(path, (node.start_mark.line + 1, node.start_mark.column + 1))
        if isinstance(node, yaml.MappingNode):
            return self._mapping(node, path, doc, depth)
        if isinstance(node, yaml.SequenceNode):
            return [self.build(item, path + (i,), doc, depth + 1) for i, item in enumerate(node.value)]
        if isinstance(node, yaml.ScalarNode) and node.tag in (_INT_TAG, _FLOAT_TAG):
            return self._number(node, path)
        return self.loader.construct_object(node, deep=True)

    def _number(self, node: yaml.ScalarNode, path: Path_) -> int | float | str:
        """The node's number; its text, and an issue where it is, when it is not one deploykit reads."""
        try:
            return core_number(node.value, node.tag)
        except ValueError as exc:
            self.issue(str(exc), node.start_mark, path, hint="write a plain decimal number such as 30 or 1.5, "
                                                             "or quote the value to make it a string")
            return node.value

    def _count(self, node: yaml.ScalarNode) -> None:
        self.bytes += len(node.value)
        if self.bytes > MAX_EXPANDED_BYTES:
            raise _TooLarge(node.start_mark, f"the document expands to more than {MAX_EXPANDED_BYTES} characters "
                                             "of keys and values (an alias repeats its value in full each time)")

    def _mapping(self, node: yaml.MappingNode, path: Path_, doc: Document, depth: int) -> dict:
        result: dict[Any, Any] = {}
        first_seen: dict[Any, yaml.Mark] = {}
        for key_node, value_node in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                self.issue("merge keys ('<<') are not supported; write the fields out",
                           key_node.start_mark, path)
                continue
            if not isinstance(key_node, yaml.ScalarNode):
                self.issue("a mapping key must be a plain scalar", key_node.start_mark, path)
                continue
            self._count(key_node)
            key = self.loader.construct_object(key_node)
            if not isinstance(key, (str, int)):
                key = str(key)
            if key in first_seen:
                self.issue(f"duplicate key {key!r} (first defined at line {first_seen[key].line + 1})",
                           key_node.start_mark, path + (key,),
                           hint="remove one of them; YAML parsers silently keep the last")
                continue  # keep the first value so schema checks still run on the rest
            first_seen[key] = key_node.start_mark
            doc.keys[path + (key,)] = (key_node.start_mark.line + 1, key_node.start_mark.column + 1)
            result[key] = self.build(value_node, path + (key,), doc, depth + 1)
        return result


class _TooLarge(Exception):
    def __init__(self, mark: yaml.Mark, message: str) -> None:
        super().__init__(message)
        self.mark = mark
        self.message = message


def _dotted(path: Path_) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _decode(data: bytes, source: str) -> str:
    if not data.strip():
        raise ManifestError.single(
            "the file is empty; expected a manifest with apiVersion, kind, metadata and spec",
            path=source, line=1, column=1)
    if len(data) > MAX_BYTES:
        raise ManifestError.single(f"the file is {len(data)} bytes; a manifest may be at most "
                                   f"{MAX_BYTES} bytes", path=source, line=1, column=1)
    if b"\x00" in data:
        line = data[: data.index(b"\x00")].count(b"\n") + 1
        raise ManifestError.single("this is a binary file (it contains NUL bytes), not a YAML manifest",
                                   path=source, line=line, column=1)
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        before = data[: exc.start]
        line = before.count(b"\n") + 1
        column = exc.start - (before.rfind(b"\n") + 1) + 1
        raise ManifestError.single(f"the file is not valid UTF-8 (byte 0x{data[exc.start]:02x})",
                                   path=source, line=line, column=column,
                                   hint="save the manifest as UTF-8") from None
    return text


def _syntax_issue(exc: yaml.MarkedYAMLError, source: str) -> Issue:
    # A scanner error ("while scanning a quoted scalar") is best shown where the token began: an
    # unclosed quote is reported at end of stream, but the fix is on the line that opened it.
    use_context = isinstance(exc, yaml.scanner.ScannerError) and exc.context_mark is not None
    mark = exc.context_mark if use_context else (exc.problem_mark or exc.context_mark)
    message = f"invalid YAML: {exc.problem}"
    if exc.context:
        message = f"invalid YAML: {exc.context}: {exc.problem}"
    if use_context and exc.problem_mark is not None:
        message += f" (at line {exc.problem_mark.line + 1})"
    return Issue(message, source, mark.line + 1 if mark else None, mark.column + 1 if mark else None)


def _reader(text: str, source: str) -> _Loader:
    """The loader of ``text``; a character YAML does not allow (a control character) is a located error."""
    try:
        return _Loader(text)
    except yaml.reader.ReaderError as exc:
        before = text[: exc.position]
        line, column = before.count("\n") + 1, exc.position - (before.rfind("\n") + 1) + 1
        raise ManifestError.single(f"the file holds a character YAML does not allow (U+{exc.character:04X})",
                                   path=source, line=line, column=column,
                                   hint="remove it, or write it as an escape in a double-quoted string") from None


def load_documents(data: bytes, source: str) -> tuple[list[Document], list[Issue]]:
    """Parse every YAML document in ``data``.

    Returns the documents and the problems found on the way (duplicate keys, a syntax error that ends
    the stream early), so the caller can report them together with schema errors. Raises
    ManifestError when nothing usable can be read at all.
    """
    text = _decode(data, source)
    loader = _reader(text, source)
    builder = _Builder(source, loader)
    documents: list[Document] = []
    try:
        index = 0
        while loader.check_node():
            node = loader.get_node()
            loader.constructed_objects, loader.recursive_objects = {}, {}
            if node is None:
                continue
            doc = Document(data=None, index=index, line=node.start_mark.line + 1)
            try:
                doc.data = builder.build(node, (), doc)
            except _TooLarge as big:
                builder.issues.append(Issue(big.message, source, big.mark.line + 1, big.mark.column + 1,
                                            hint="write the values out instead of nesting aliases"))
                break
            documents.append(doc)
            index += 1
    except yaml.MarkedYAMLError as exc:
        builder.issues.append(_syntax_issue(exc, source))
    except yaml.YAMLError as exc:  # pragma: no cover - PyYAML marks nearly everything
        builder.issues.append(Issue(f"invalid YAML: {exc}", source))
    finally:
        loader.dispose()
    if not builder.issues and not any(d.data is not None for d in documents):
        raise ManifestError.single("the file holds no YAML document; expected a manifest", path=source,
                                   line=1, column=1)
    return documents, builder.issues
