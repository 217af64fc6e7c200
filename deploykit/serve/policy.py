"""What the control API may ask for: the operator's policy, set when ``deploykit serve`` starts.

The control token lets its holder change deployments; without a policy it would also let them run any
program (``spec.engine.binary``, which validation itself runs with ``--version``), import Python from any
directory (``spec.model.trust_remote_code``), join the server to any Ray cluster (``spec.cluster``, whose
driver unpickles what the cluster sends) and read or write any path the server can. ``ControlPolicy``
refuses those from the API unless ``deploykit serve`` was started allowing them (``--allow-engine-binary``,
``--allow-remote-code``, ``--allow-cluster``), and keeps the paths a manifest names inside the roots given
with ``--allow-path`` (any path when none is given).

It is checked on the parsed manifest before anything else runs (no host check, no plan, no ``--version``).
Files the server watches are the operator's own: a manifest posted as such a file, with exactly that
file's bytes, is not checked. This module never imports the web stack or torch.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import DeploykitError

if TYPE_CHECKING:
    from ..spec.manifest import LoadedManifest


class PolicyError(DeploykitError):
    """A manifest asks for what this server's policy refuses to the control API (HTTP 403)."""

    def __init__(self, field: str, message: str, located: str) -> None:
        super().__init__(located)
        self.field = field
        self.message = message


@dataclass(frozen=True)
class ControlPolicy:
    """What a manifest from the control API may name. The defaults refuse code execution and clusters."""

    path_roots: tuple[Path, ...] = ()  # resolved directories; empty: any path
    engine_binary: bool = False
    remote_code: bool = False
    cluster: bool = False

    @classmethod
    def of(cls, *, path_roots: tuple[str, ...] = (), engine_binary: bool = False, remote_code: bool = False,
           cluster: bool = False) -> ControlPolicy:
        return cls(tuple(Path(p).resolve() for p in path_roots), engine_binary, remote_code, cluster)

    def check(self, loaded: LoadedManifest) -> None:
        """Raise ``PolicyError`` naming the first field this policy refuses."""
        for field, message in self._refusals(loaded):
            raise PolicyError(field, message, loaded.located(field, message))

    def describe(self) -> str:
        allowed = [flag for flag, on in (("engine binaries", self.engine_binary), ("remote code", self.remote_code),
                                         ("clusters", self.cluster)) if on]
        paths = ("paths under " + ", ".join(str(p) for p in self.path_roots)) if self.path_roots else "any path"
        return f"control API: {paths}; " + (
            f"allowed: {', '.join(allowed)}" if allowed else "no engine binary, remote code or cluster")

    def _refusals(self, loaded: LoadedManifest) -> Iterator[tuple[str, str]]:
        spec = loaded.manifest.spec
        if spec.engine.binary is not None and not self.engine_binary:
            yield "spec.engine.binary", ("this server does not run programs named through the control API "
                                         "(start deploykit serve with --allow-engine-binary, or drop the field "
                                         "to use the server's own llama-server)")
        if spec.model.trust_remote_code and not self.remote_code:
            yield "spec.model.trust_remote_code", ("this server does not run a checkpoint's Python code for the "
                                                   "control API (start deploykit serve with --allow-remote-code)")
        if spec.cluster is not None and not self.cluster:
            yield "spec.cluster", ("this server does not join Ray clusters for the control API (start deploykit "
                                   "serve with --allow-cluster)")
        if self.path_roots:
            for field, path in _paths(loaded):
                resolved = loaded.resolve(path).resolve()
                if not any(resolved.is_relative_to(root) for root in self.path_roots):
                    roots = ", ".join(str(r) for r in self.path_roots)
                    yield field, (f"{str(resolved)!r} is outside the paths this server allows the control API "
                                  f"({roots}; deploykit serve --allow-path)")


def _paths(loaded: LoadedManifest) -> Iterator[tuple[str, Path]]:
    """Every path a manifest names, by field: read (model, golden file) or written (shards, offload)."""
    spec = loaded.manifest.spec
    yield "spec.model.path", spec.model.path
    if spec.sharding.path is not None:
        yield "spec.sharding.path", spec.sharding.path
    if spec.offload.disk is not None:
        yield "spec.offload.disk.path", spec.offload.disk.path
    gates = spec.rollout.gates
    if gates is not None and gates.golden is not None:
        yield "spec.rollout.gates.golden", gates.golden


def operator_owned(loaded: LoadedManifest, text: str, watched: list[Path]) -> bool:
    """Whether ``loaded`` is a watched file's manifest as the file holds it now (the operator's own)."""
    source = Path(loaded.source).resolve()
    if source not in {f.resolve() for f in watched}:
        return False
    try:
        return source.read_text(encoding="utf-8") == text  # as the CLI sends it (newlines translated)
    except OSError:
        return False
