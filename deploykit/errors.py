"""The exceptions deploykit raises.

One root, ``DeploykitError``, so a caller can catch everything deploykit means to raise. Library code
raises these and never prints or exits; only ``cli`` turns them into messages and exit codes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


class DeploykitError(Exception):
    """Root of every error deploykit raises on purpose."""


@dataclass(frozen=True)
class Issue:
    """One problem in a manifest, located as precisely as the source allows."""

    message: str
    path: str | None = None  # the file, as the user named it
    line: int | None = None  # 1-based
    column: int | None = None  # 1-based
    field: str | None = None  # dotted field path, e.g. "spec.sharding.max_shard_size"
    hint: str | None = None

    def __str__(self) -> str:
        where = ":".join(str(p) for p in (self.path, self.line, self.column) if p is not None)
        parts = [f"{where}:" if where else "", f"{self.field}:" if self.field else "", self.message]
        text = " ".join(p for p in parts if p)
        return f"{text} (hint: {self.hint})" if self.hint else text


class ManifestError(DeploykitError):
    """A manifest is not valid. Holds every issue found in the file, not only the first."""

    def __init__(self, issues: list[Issue]) -> None:
        if not issues:
            raise ValueError("ManifestError needs at least one issue")
        self.issues = list(issues)
        super().__init__("\n".join(str(i) for i in self.issues))

    @classmethod
    def single(cls, message: str, *, path: str | Path | None = None, line: int | None = None,
               column: int | None = None, field: str | None = None,
               hint: str | None = None) -> ManifestError:
        return cls([Issue(message, str(path) if path is not None else None, line, column, field, hint)])


class PlanInfeasible(DeploykitError):
    """The model does not fit the devices the manifest allows.

    ``shortfall`` maps a tier ("gpu", "cpu", "disk") or a device to the bytes missing there.
    ``field`` names the manifest field to change, when one is to blame.
    """

    def __init__(self, message: str, *, shortfall: dict[str, int] | None = None,
                 field: str | None = None) -> None:
        self.shortfall = dict(shortfall or {})
        self.field = field
        super().__init__(message)


class InventoryError(DeploykitError):
    """A device specification (``--devices``) is malformed or names devices that do not exist."""


class CheckpointError(DeploykitError):
    """A checkpoint on disk is missing, unreadable or inconsistent."""


class ApplyError(DeploykitError):
    """Applying a manifest failed; the previous deployment is left as it was."""
