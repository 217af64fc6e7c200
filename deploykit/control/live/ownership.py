"""Who may change a deployment: one owner per name, a watched manifest file or the control API.

``deploykit serve PATH`` follows its files and also takes deployments over its control API. Each name
has exactly one owner, kept in one map behind one lock:

- a name a watched file declares first is that file's: the API refuses to apply, roll back or delete it
  (naming the file), except that applying that very file means "reconcile it now";
- a name deployed through the API first stays the API's even if a watched file declares it later: that
  file is then *in conflict* on the name (an error on the name, naming the file) until `deploykit
  delete NAME` removes the API's deployment and hands the name to the file;
- a name two watched files declare is the first file's in path order at start (later, the file that
  declared it first keeps it): the other file is in conflict on it (an error on the name, naming both
  files) until one of them stops declaring it; a pruned owner hands the name to it;
- a removed file's name that another file declares without a conflict (a renamed manifest) is handed to
  that file, its deployment kept and reloaded from it (``hand_over``), never pruned.

Pure bookkeeping: it loads nothing and decides nothing about models.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Claim:
    """What ``claim_for_file`` found: the file may load the name (``ok``), or why not."""

    ok: bool
    conflict: str | None = None  # the API owns the name: the error to show on it


class Owners:
    """name -> owning file (or the API), and name -> a file in conflict with the API's ownership."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._owner: dict[str, Path | None] = {}  # None: the control API
        self._conflicts: dict[str, Path] = {}

    def file_of(self, name: str) -> Path | None:
        """The watched file that owns ``name``, if a file does."""
        with self._lock:
            return self._owner.get(name)

    def owned_by_api(self, name: str) -> bool:
        with self._lock:
            return name in self._owner and self._owner[name] is None

    def names_of(self, file: Path) -> list[str]:
        with self._lock:
            return [n for n, f in self._owner.items() if f == file]

    def claim_for_file(self, name: str, file: Path) -> Claim:
        """A file declares ``name``: it owns it unless the API or another file does already."""
        with self._lock:
            if name not in self._owner:
                self._owner[name] = file
                return Claim(True)
            owner = self._owner[name]
            if owner == file:
                return Claim(True)
            self._conflicts[name] = file
            return Claim(False, conflict_message(name, file, owner))

    def claim_for_api(self, name: str) -> None:
        with self._lock:
            self._owner.setdefault(name, None)

    def check_api_change(self, name: str, what: str, source: Path | None = None) -> bool:
        """May the API ``what`` (apply, roll back, delete) ``name``? True when ``source`` is the very file
        that owns it (reconcile that file now); raises when another file owns it; False otherwise."""
        from ...errors import DeploykitError

        owner = self.file_of(name)
        if owner is None:
            return False
        if source is not None and what == "apply" and Path(source).resolve() == owner:
            return True
        raise DeploykitError(f"{name!r} is owned by the watched file {owner}: change that file to {what} it "
                             "(this server follows it), not the control API")

    def hand_over(self, name: str, file: Path) -> None:
        """``name``'s owning file went away and ``file`` declares it: ``file`` owns it now (not in conflict)."""
        with self._lock:
            self._owner[name] = file
            if self._conflicts.get(name) == file:
                del self._conflicts[name]

    def release(self, name: str) -> Path | None:
        """Forget ``name``'s owner; return the file in conflict on it, which may now claim it."""
        with self._lock:
            self._owner.pop(name, None)
            return self._conflicts.pop(name, None)

    def drop_conflicts(self, file: Path, keep: set[str]) -> list[str]:
        """``file`` changed or went away: it no longer conflicts on names it does not declare (``keep``)."""
        with self._lock:
            gone = [n for n, f in self._conflicts.items() if f == file and n not in keep]
            for name in gone:
                del self._conflicts[name]
            return gone

    def conflict_of(self, name: str) -> str | None:
        with self._lock:
            file = self._conflicts.get(name)
            owner = self._owner.get(name)
        return conflict_message(name, file, owner) if file is not None else None


def conflict_message(name: str, file: Path, owner: Path | None = None) -> str:
    """Why ``file`` does not serve ``name``: the control API (``owner`` None) or another file owns it."""
    if owner is not None:
        return (f"{file} declares {name!r}, which {owner} declares too and serves (a name is its first file's, "
                f"in path order at start); remove {name!r} from one of the two files")
    return (f"{file} declares {name!r}, which was deployed through the control API and stays as it is; run "
            f"`deploykit delete {name}` to hand the name to that file")
