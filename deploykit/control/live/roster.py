"""What a supervisor holds, shared by the two ways it changes deployments (the files it follows,
``files``; the control API, ``api_changes``): what serves and what is loading (``ServedSet``), who owns
each name (``Owners``), one change of a name at a time (``Turns``), and ``create``, the one way a
``Deployment`` comes to exist. It never decides which change to make: its callers do.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from ...errors import DeploykitError
from ...threads import ThreadGroup
from .ownership import Owners
from .served import ServedSet
from .turns import Turns

if TYPE_CHECKING:
    from ..admission import Policy
    from ..budget.host import Host
    from ..revisions.state import StateStore
    from .deployment import Deployment


class Roster:
    """Thread-safe (each part behind its own lock)."""

    def __init__(self, *, store: StateStore, devices: str | None, host: Host, policy: Policy) -> None:
        self.store = store
        self.policy = policy  # what every manifest of these deployments is admitted under (``admission``)
        self.devices = devices
        self.host = host  # what every deployment loads under (a budget, or ``Host.unlimited``)
        self.served = ServedSet()  # what serves, what is loading, and why a declared name does not serve
        self.owners = Owners()
        self.turns = Turns()  # one change of a name at a time
        self.adds = ThreadGroup()  # deployments added after start (new files, a deleted name's heir)

    def get(self, name: str) -> Deployment | None:
        return self.served.get(name)

    def create(self, name: str, claim: Callable[[], bool], build: Callable[[], Deployment]) -> Deployment | None:
        """The one way a deployment comes to exist. The caller holds ``name``'s turn (``Turns``): ownership
        is claimed before anything loads (``claim``: False when another owner has it), nothing is built
        for a name that serves already, and what ``build`` made is held at once, so two live
        ``Deployment``s of one name cannot both exist. None when nothing was built."""
        try:
            if self.served.closing or not claim() or self.get(name) is not None:
                return None
            self.served.begin_loading([name])
            return self._hold(name, build())
        finally:
            self.served.end_loading(name)

    def _hold(self, name: str, dep: Deployment) -> Deployment:
        """Serve ``dep`` as ``name`` (before it stops loading: a reader always finds it in one of the two
        lists); one that finished loading while the supervisor closes is closed instead."""
        if not self.served.hold(name, dep):
            dep.close()
            raise DeploykitError(f"{name!r} loaded while the server was stopping, or another deployment of it "
                                 "serves; not served")
        return dep

    def show_conflict(self, name: str) -> None:
        """Show (or clear) the ownership conflict on ``name`` as its deployment's error."""
        dep = self.get(name)
        if dep is not None:
            dep.set_conflict(self.owners.conflict_of(name))

    def forget(self, name: str) -> None:
        """``name`` no longer holds room under the budget (deleted or pruned)."""
        self.host.forget(name)
