"""The one admission gate: ``admit(loaded, policy)`` decides whether a manifest may become live here.

Every manifest that is about to become live passes through it, whatever brought it (docs/control.md, "The
admission gate"): a watched file (its first load and every reload), an API apply, a dry run, a diff, a
rollback (to the revision before, or ``--to-revision``), a restore at start, a load on demand and a live
adapter change. A check that runs on one path and not on another is the defect this module exists to
prevent: Kubernetes runs admission on every create and update, so a rollback is just another checked update.

The policy is the operator's, set when ``deploykit serve`` starts: ``spec.engine.binary`` (a program to run,
which validation itself runs with ``--version``), ``spec.model.trust_remote_code`` (Python from the
checkpoint) and ``spec.cluster`` (a Ray cluster, whose driver unpickles what the cluster sends) are refused
unless it allows them, and every path a manifest names (each ``Path`` field of the schema, adapters and
the engine binary included) must lie inside the roots given with ``--allow-path``, symbolic links resolved
(a link inside a root that points outside is refused). A path is judged before anything reads it, and the
answer never tells whether it exists. A library user (``Deployment`` without a server) is the operator:
``Policy.unrestricted()``.

Pure apart from resolving links; never imports torch or the web stack.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from ..errors import DeploykitError

if TYPE_CHECKING:
    from ..spec.manifest import LoadedManifest


class PolicyError(DeploykitError):
    """A manifest asks for what this server's policy refuses (HTTP 403 on the control API); its text is
    located (``FILE:LINE:COL: FIELD: message``)."""

    def __init__(self, field: str, message: str, located: str) -> None:
        super().__init__(located)
        self.field = field
        self.message = message


@dataclass(frozen=True)
class Policy:
    """What a manifest may name on this server. The defaults refuse code execution and clusters and allow
    any path; ``unrestricted()`` allows everything (a library user, the operator itself)."""

    path_roots: tuple[Path, ...] = ()  # resolved directories; empty: any path
    engine_binary: bool = False
    remote_code: bool = False
    cluster: bool = False
    given_roots: tuple[Path, ...] = ()  # the roots as given (absolute, normalised, links not resolved)

    @classmethod
    def of(cls, *, path_roots: tuple[str, ...] = (), engine_binary: bool = False, remote_code: bool = False,
           cluster: bool = False) -> Policy:
        given = tuple(Path(os.path.abspath(p)) for p in path_roots)
        return cls(tuple(Path(p).resolve() for p in path_roots), engine_binary, remote_code, cluster, given)

    @classmethod
    def unrestricted(cls) -> Policy:
        return cls(engine_binary=True, remote_code=True, cluster=True)

    def describe(self) -> str:
        allowed = [flag for flag, on in (("engine binaries", self.engine_binary), ("remote code", self.remote_code),
                                         ("clusters", self.cluster)) if on]
        paths = ("paths under " + ", ".join(str(p) for p in self.path_roots)) if self.path_roots else "any path"
        return f"admission: {paths}; " + (
            f"allowed: {', '.join(allowed)}" if allowed else "no engine binary, remote code or cluster")

    def check(self, loaded: LoadedManifest) -> None:
        """``admit(loaded, self)``."""
        admit(loaded, self)


def admit(loaded: LoadedManifest, policy: Policy) -> None:
    """Raise ``PolicyError`` at the first field of ``loaded`` that ``policy`` refuses; return when it may
    become live. Runs before anything else looks at the manifest (no host check, no plan, no file read)."""
    for field, message in refusals(loaded, policy):
        raise PolicyError(field, message, loaded.located(field, message))


def refusals(loaded: LoadedManifest, policy: Policy) -> Iterator[tuple[str, str]]:
    """Every (field, why) ``policy`` refuses in ``loaded``, in the schema's order."""
    spec = loaded.manifest.spec
    if spec.engine.binary is not None and not policy.engine_binary:
        yield "spec.engine.binary", ("this server does not run programs a manifest names (start deploykit serve "
                                     "with --allow-engine-binary, or drop the field to use the server's own "
                                     "llama-server)")
    if spec.model.trust_remote_code and not policy.remote_code:
        yield "spec.model.trust_remote_code", ("this server does not run a checkpoint's Python code (start "
                                               "deploykit serve with --allow-remote-code)")
    if spec.cluster is not None and not policy.cluster:
        yield "spec.cluster", "this server does not join Ray clusters (start deploykit serve with --allow-cluster)"
    if policy.path_roots:
        roots = ", ".join(str(r) for r in policy.path_roots)
        for field, path in manifest_paths(loaded):
            shown = Path(os.path.normpath(loaded.resolve(path)))
            if not _inside(shown, policy):
                yield field, (f"{str(shown)!r} is not inside the paths this server allows ({roots}; deploykit "
                              "serve --allow-path; links are followed)")


def _inside(path: Path, policy: Policy) -> bool:
    """``path`` (absolute, normalised) lies inside a root as written, and still does with every link
    resolved. Nothing is read for a path outside as written; a link loop is outside."""
    if not any(path.is_relative_to(root) for root in policy.given_roots + policy.path_roots):
        return False
    try:
        resolved = path.resolve()
    except (OSError, RuntimeError):
        return False
    return any(resolved.is_relative_to(root) for root in policy.path_roots)


def manifest_paths(loaded: LoadedManifest) -> Iterator[tuple[str, Path]]:
    """Every path the manifest names, by field (``spec.adapters.0.path``): every ``Path`` value of the schema,
    found by walking the validated model, so a path field added later is covered without a list to keep."""
    yield from _walk(loaded.manifest.spec, "spec")


def _walk(value: Any, field: str) -> Iterator[tuple[str, Path]]:
    if isinstance(value, Path):
        yield field, value
    elif isinstance(value, BaseModel):
        for name in type(value).model_fields:
            yield from _walk(getattr(value, name), f"{field}.{name}")
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from _walk(item, f"{field}.{i}")
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _walk(item, f"{field}.{key}")
