"""Grammar-constrained decoding for the transformers engine: a request's ``Constraint`` (a JSON schema)
compiled once per schema for one tokenizer, and one matcher per request row that masks that row's
logits and accepts each token chosen, so constrained and free requests share one batch.

The library is xgrammar, chosen by measurement on SmolLM2's 49152-token vocabulary (a 6-property
schema with a nested object, an array, an enum, a pattern and maxLength; ``bench/grammar_libraries.py``,
CPU time of one thread on 2 shared cores, docs/benchmarks.md): filling a row's mask, which runs for every
constrained row at every step, takes ~3 us per token with xgrammar 0.2.8 against ~12 us with llguidance
1.9.1; compiling the schema, once per schema and then cached (xgrammar's own compiler cache, bounded in
bytes, least recently used out), ~280 ms against ~1.5 ms. The price of the choice: a new schema's first
request waits ~0.3 s for its compilation (off the engine's thread, in the request's own preparation).
Both per-token costs are small beside a decode step (~50 ms here), so llguidance, which compiles without
a cache to manage, remains a fair alternative; the mask is applied with torch (``RowGrammar.mask``), not
with xgrammar's CPU helper, which took ~4 ms per row and token.

What xgrammar does not enforce is refused here, never served unfollowed: measured on xgrammar 0.2.8,
it accepts and then silently ignores ``oneOf`` (treated as anyOf), ``allOf``, ``not``, ``uniqueItems``,
``dependentRequired``, unknown ``format`` values and ``minLength``/``maxLength`` beside a ``pattern`` or
``format`` (put the length in the pattern: ``^[a-z]{1,8}$``), and mishandles ``patternProperties``,
``propertyNames``, ``contains``, ``maxProperties``, ``if``/``then`` and ``dependentSchemas``. So a schema
may use only the keywords in ``ENFORCED`` (each checked by tests/test_grammar.py: a valid instance is
accepted, a violating one refused) and the annotations in ``ANNOTATIONS``; anything else is a
``RequestError`` naming the keyword.

JSON is written compact with ``", "`` and ``": "`` separators (no free whitespace: a small model left
free to emit whitespace can loop on it until ``max_tokens``). This module must never be imported by
code that does not decode (xgrammar is imported on first use).
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator, Sequence
from typing import Any

from .text import RequestError
from .types import Constraint

COMPILER_CACHE_BYTES = 64 << 20  # compiled grammars kept (xgrammar's compiler cache, least recently used out)
SEPARATORS = (", ", ": ")
# Lengths and counts above this are refused: xgrammar takes seconds to compile maxLength 10**9, and no
# answer of a server whose requests are bounded by max_tokens comes near it.
MAX_BOUND = 100_000
_BOUNDS = ("minLength", "maxLength", "minItems", "maxItems")
# A pattern's counted repetitions ({m,n}: n, nested ones multiplied, one per other atom) above this are
# refused before xgrammar sees them: its compile time grows with their square (measured on a 259-token
# vocabulary: {0,1000} 0.18 s, {0,2000} 0.67 s, {0,20000} tens of seconds, on the request's thread).
MAX_PATTERN_COST = 1000
# The whole schema's compile cost (``schema_cost``): each pattern's cost, plus one per subschema, plus an
# object's properties squared over 64 (xgrammar's grammar for optional properties grows with their square:
# 256 took 0.06 s, 500 0.26 s, 1000 3.3 s). 200 patterns of cost 990 each took 7.8 s of CPU when only
# each pattern was bounded; this budget keeps a schema under about 0.3 s. xgrammar's compiler takes no
# deadline, so the estimate is the bound.
MAX_SCHEMA_COST = 4000
_COUNT = re.compile(r"\{(\d{1,9})(?:,(\d{0,9}))?\}")
_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+: ")  # xgrammar's "[18:56:13] /project/cpp/file.cc:123: "

# The keywords xgrammar enforces (tests/test_grammar.py proves each), and the formats it knows.
ENFORCED = frozenset({
    "type", "properties", "required", "additionalProperties", "items", "prefixItems", "enum", "const", "anyOf",
    "pattern", "minLength", "maxLength", "minItems", "maxItems", "minimum", "maximum", "exclusiveMinimum",
    "exclusiveMaximum", "multipleOf", "format", "$ref", "$defs", "definitions"})
FORMATS = frozenset({"date", "time", "date-time", "email", "uuid", "uri", "ipv4", "hostname"})
ANNOTATIONS = frozenset({"title", "description", "default", "examples", "$schema", "$id", "$comment",
                         "deprecated", "readOnly", "writeOnly"})
_SCHEMA_MAPS = ("properties", "$defs", "definitions")  # keyword -> {name: subschema}
_SCHEMA_LISTS = ("prefixItems", "anyOf")  # keyword -> [subschema]
_SCHEMA_ONE = ("items", "additionalProperties")  # keyword -> subschema (or a boolean)


def unenforced(schema: Any, path: str = "") -> tuple[str, str] | None:
    """The first keyword of ``schema`` that this engine cannot enforce, with where it is, or None."""
    for where, node in subschemas(schema, path or "#"):
        for key, value in node.items():
            if key in ANNOTATIONS:
                continue
            if key not in ENFORCED:
                return key, where
            if key == "format" and (not isinstance(value, str) or value not in FORMATS):
                return f"format: {value}", where
            if key == "pattern" and isinstance(value, str) and (feature := regex_unenforced(value)) is not None:
                return f"pattern: {feature}", where
        if "pattern" in node and "format" in node:  # xgrammar follows one of them
            return "pattern with format", where
        pattern = node.get("pattern")
        if isinstance(pattern, str) and (cost := pattern_cost(pattern)) > MAX_PATTERN_COST:
            return f"pattern repeating {cost} times (at most {MAX_PATTERN_COST})", where
        big = [k for k in _BOUNDS if isinstance(node.get(k), int | float) and node[k] > MAX_BOUND]
        if big:
            return f"{big[0]} above {MAX_BOUND}", where
        lengths = [k for k in ("minLength", "maxLength") if k in node]
        if lengths and ("pattern" in node or "format" in node):  # xgrammar then follows the pattern alone
            return f"{lengths[0]} with {'pattern' if 'pattern' in node else 'format'}", where
    return None


def schema_cost(schema: Any) -> int:
    """An estimate of what compiling ``schema`` costs (``MAX_SCHEMA_COST``): summed over its subschemas,
    stopping once past the budget."""
    total = 0
    for _, node in subschemas(schema, "#"):
        total += 1
        pattern = node.get("pattern")
        if isinstance(pattern, str):
            total += pattern_cost(pattern)
        properties = node.get("properties")
        if isinstance(properties, dict):
            total += len(properties) ** 2 // 64
        if total > MAX_SCHEMA_COST:
            break
    return total


def check_cost(schema: Any, param: str) -> None:
    """A RequestError (400 naming ``param``) when ``schema`` costs more than ``MAX_SCHEMA_COST`` to compile."""
    cost = schema_cost(schema)
    if cost > MAX_SCHEMA_COST:
        raise RequestError(f"{param}: the schema would take too long to compile (its patterns, subschemas and "
                           f"properties cost {cost}, at most {MAX_SCHEMA_COST}): use fewer or shorter patterns, "
                           "or fewer properties", param=param, code="schema_too_complex")


def pattern_cost(pattern: str) -> int:
    """How many atoms ``pattern`` can unroll to: each character, class or group counts once, times the
    counts of the ``{m,n}`` quantifiers on it and on every group around it (``*``, ``+``, ``?`` compile to
    loops and count once). A linear scan, never a regex over the whole pattern; stops counting once
    past ``MAX_PATTERN_COST``."""
    stack, atom, i = [0], 0, 0  # running cost of each open group; cost of the atom just read
    while i < len(pattern) and stack[0] <= MAX_PATTERN_COST:
        char = pattern[i]
        if char == "{" and (count := _COUNT.match(pattern, i)) is not None:
            low, high = count.groups()
            times = int(high) if high else int(low)
            stack[-1] += atom * (max(times, 1) - 1)
            i = count.end()
            continue
        if char == "(":
            stack.append(0)
            atom, i = 0, i + (3 if pattern.startswith("?:", i + 1) else 1)
            continue
        if char == ")" and len(stack) > 1:
            atom = max(stack.pop(), 1)
            stack[-1] += atom
        elif char == "[":
            atom = 1
            stack[-1] += 1
            i = _class_end(pattern, i)
            continue
        elif char not in "*+?|^$":
            atom = 1
            stack[-1] += 1
            i += 1 if char != "\\" else 2
            continue
        i += 1
    return sum(stack)


def _class_end(pattern: str, start: int) -> int:
    """The index after the ``]`` closing the class that opens at ``start``."""
    i = start + 1
    if i < len(pattern) and pattern[i] == "^":
        i += 1
    if i < len(pattern) and pattern[i] == "]":
        i += 1
    while i < len(pattern) and pattern[i] != "]":
        i += 2 if pattern[i] == "\\" else 1
    return i + 1
_LOOK_AROUND = {"?=": "look-ahead (?=", "?!": "negative look-ahead (?!", "?<=": "look-behind (?<=",
                "?<!": "negative look-behind (?<!", "?P=": "named back-reference"}


def regex_unenforced(pattern: str) -> str | None:
    """The first feature of ``pattern`` that a grammar cannot enforce (look-around, back-references: they
    are not regular; xgrammar accepts ``(?<=a)b`` and then lets a string run on unterminated), or None.
    A scan of the pattern's tokens rather than a regex parser: escapes and character classes are skipped
    whole, so ``\\(?=`` or ``[(?=]`` are literals, not look-arounds."""
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        if c == "\\":
            nxt = pattern[i + 1:i + 2]
            if nxt.isdigit() and nxt != "0":
                return f"back-reference to group {nxt}"
            if pattern.startswith("k<", i + 1):
                return "named back-reference"
            i += 2
        elif c == "[":  # a character class: up to its first unescaped "]" (ECMA-262, JSON Schema's regexes)
            i += 1
            while i < n and pattern[i] != "]":
                i += 2 if pattern[i] == "\\" else 1
            i += 1
        elif c == "(":
            for opener, feature in _LOOK_AROUND.items():
                if pattern.startswith(opener, i + 1):
                    return feature
            i += 1
        else:
            i += 1
    return None


def subschemas(node: Any, where: str) -> Iterator[tuple[str, dict[str, Any]]]:
    if not isinstance(node, dict):
        return
    yield where, node
    for key in _SCHEMA_MAPS:
        for name, sub in (node.get(key) or {}).items() if isinstance(node.get(key), dict) else ():
            yield from subschemas(sub, f"{where}/{key}/{name}")
    for key in _SCHEMA_LISTS:
        for i, sub in enumerate(node.get(key) or ()) if isinstance(node.get(key), list) else ():
            yield from subschemas(sub, f"{where}/{key}/{i}")
    for key in _SCHEMA_ONE:
        yield from subschemas(node.get(key), f"{where}/{key}")


class Grammars:
    """Compiles constraints for one tokenizer and hands out per-request matchers; safe from any thread.
    The tokenizer's xgrammar description is built on first use (~0.1 s), not when the model loads; masks
    are ``vocab_size`` wide (the model's logits), or the tokenizer's length when that is larger."""

    def __init__(self, tokenizer: Any, *, vocab_size: int = 0, stop_ids: Sequence[int]) -> None:
        self.tokenizer, self.vocab_size, self.stop_ids = tokenizer, vocab_size, sorted(stop_ids)
        self._lock = threading.Lock()
        self._compiler: Any = None

    def _compiler_now(self) -> Any:
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr

                self.vocab_size = max(self.vocab_size, len(self.tokenizer))
                info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                          stop_token_ids=self.stop_ids)
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_limit_bytes=COMPILER_CACHE_BYTES)
            return self._compiler

    def compile(self, constraint: Constraint) -> Any:
        """The compiled grammar of ``constraint`` (cached by schema), or a RequestError naming what in
        the schema cannot be enforced (``constraint.param`` is the request field it came from)."""
        schema = json.loads(constraint.schema)
        bad = unenforced(schema)
        if bad is not None:
            keyword, where = bad
            raise RequestError(f"{constraint.param}: the schema keyword {keyword!r} (at {where}) cannot be "
                               f"enforced by this model's engine; remove it", param=constraint.param,
                               code="unsupported_schema")
        check_cost(schema, constraint.param)
        try:
            return self._compiler_now().compile_json_schema(
                constraint.schema, any_whitespace=False, separators=SEPARATORS, strict_mode=constraint.strict)
        except Exception as exc:  # xgrammar's own refusal of a schema (contradictory bounds, bad $ref...)
            lines = str(exc).strip().splitlines()
            message = _LOG_PREFIX.sub("", lines[0]) if lines else type(exc).__name__
            raise RequestError(f"{constraint.param}: the schema cannot be compiled: {message}",
                               param=constraint.param, code="invalid_schema") from None

    def matcher(self, constraint: Constraint) -> RowGrammar:
        compiled = self.compile(constraint)  # sets vocab_size on first use
        return RowGrammar(compiled, self.vocab_size)


def torch_pad(allowed: Any, extra: int) -> Any:
    """``allowed`` followed by ``extra`` forbidden ids."""
    import torch

    return torch.cat([allowed, torch.zeros(extra, dtype=torch.bool, device=allowed.device)])


class RowGrammar:
    """One request row's matcher: ``mask`` rules out the tokens the grammar forbids next, ``accept``
    advances it by the token chosen; ``terminated`` once it accepted its end (the model's EOS)."""

    def __init__(self, compiled: Any, vocab_size: int) -> None:
        import torch
        import xgrammar as xgr

        self.matcher = xgr.GrammarMatcher(compiled)
        self.vocab_size = vocab_size
        # on the CPU, where xgrammar fills it (its own allocate_token_bitmask takes torch's default device)
        self.bitmask = torch.full(xgr.get_bitmask_shape(1, vocab_size), -1, dtype=xgr.bitmask_dtype, device="cpu")
        self._bits = torch.arange(32, dtype=torch.int32, device="cpu")

    def mask(self, logits: Any) -> Any:
        """``logits`` (one row) with every token the grammar forbids next at -inf (a new tensor); ids past
        the tokenizer's vocabulary (a padded embedding) are forbidden too.

        The bitmask is xgrammar's; it is unpacked here with two torch ops rather than with xgrammar's
        ``apply_token_bitmask_inplace``, whose CPU path took ~4 ms per row and token on SmolLM2's
        vocabulary against ~40 us for this (16 constrained rows paid 64 ms a step for it). The mask is
        unpacked on the CPU and moved to the logits' device (a GPU's, when the model is on one)."""
        self.matcher.fill_next_token_bitmask(self.bitmask)
        allowed = ((self.bitmask[0].unsqueeze(-1) >> self._bits) & 1).bool().flatten()[:self.vocab_size]
        allowed = allowed.to(logits.device)
        width = logits.shape[-1]
        if width > self.vocab_size:  # logits wider than the vocabulary: the extra ids are not tokens
            allowed = torch_pad(allowed, width - self.vocab_size)
        return logits.masked_fill(~allowed[:width], float("-inf"))

    def accept(self, token: int) -> None:
        if not self.matcher.accept_token(token):
            raise RuntimeError(f"the grammar refused token {token} that its own mask allowed")

    def allowed_prefix(self, tokens: list[int]) -> int:
        """How many of ``tokens``, from the first, the grammar accepts in turn from its state now (the state
        is left as it was: the matcher rolls back what it tried)."""
        n = 0
        for token in tokens:
            if self.matcher.is_terminated() or not self.matcher.accept_token(token):
                break
            n += 1
        if n:
            self.matcher.rollback(n)
        return n

    @property
    def terminated(self) -> bool:
        return bool(self.matcher.is_terminated())
