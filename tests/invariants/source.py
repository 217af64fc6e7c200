"""The git-source tier: a supervisor following a git repository (``deploykit serve --source``, composed as in
tests/test_git_source.py), driven through random pushes (a good change, a commit with a broken manifest, a
commit that changes nothing served, a force-push back to an older commit), syncs, drift through the control
API (an apply of another file, a rollback) and restarts. After every step, once the source has settled:

- G1 what serves is what the model says should: the store's current revision holds the expected content
  (its shard size), it answers (I1), and its greedy answer is the base's reference (I4); a commit that
  rewrites the source's file ends drift (as an auto-sync does), a commit that leaves it alone does not (a
  commit of an unchanged file is modelled, not a rewrite to the same manifest: the watcher's reaction to that
  is asynchronous, and the model could not say which of it and a drift came last);
- G2 a revision records the commit its content came from: the applied commit, or an earlier commit with the
  same manifest;
- G3 the source's phase says the truth: Degraded with the broken commit named while the newest commit is
  refused, else OutOfSync while drift serves (self_heal is off), else Synced.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from deploykit.control.revisions.loading import recorded_manifest
from deploykit.control.sources.status import SyncRecord
from deploykit.control.sources.worker import live_directory, source_root
from deploykit.spec.manifest import load_manifests
from gitrepos import Followed, commit_files, new_repo
from helpers import wait_until
from manifests import manifest_text

from .checks import deploykit_threads, leaked_threads, note
from .library import answer
from .world import World

NAME = "tiny"
SHARDS = ("200KiB", "100KiB", "300KiB")
SETTLE_BOUND = 120.0  # seconds a pushed commit may take to be fetched, checked and served (I6)
PHASE_BOUND = 15.0  # seconds the source's phase may take to say what is in place (a watcher's no-op reload)
_examples = itertools.count()


@dataclass(frozen=True)
class Pushed:
    commit: str
    shard: str | None  # what the commit's manifest asks for; None: the commit is refused (a broken manifest)


class SourceMachine(RuleBasedStateMachine):
    """One repository, state directory and follower per example."""

    world: World
    root: Path

    def __init__(self) -> None:
        super().__init__()
        self.dir = self.root / f"source-{next(_examples)}"
        self.repo = new_repo(self.dir / "upstream")
        self.model = self.world.models["base"]
        self.threads = deploykit_threads()
        self.source = (f"apiVersion: deploykit/v1\nkind: GitSource\nmetadata: {{name: models}}\nspec:\n"
                       f"  url: file://{self.repo}\n  ref: {{branch: main}}\n  path: hosts/a\n  interval: 1h\n"
                       "  timeout: 20s\n")
        self.history: list[Pushed] = []
        self.applied = self._push(SHARDS[0], "first")  # the commit whose text the source's file holds
        self.commit = self.applied.commit  # the commit the serving revision should record (without drift)
        self.refused: Pushed | None = None  # the newest commit, when it is refused
        self.drift: str | None = None  # the shard size an API apply or a rollback serves instead
        self.drift_revision: int | None = None
        self.f: Followed | None = Followed(self.dir / "state", self.source)
        note(f"source example directory {self.dir}")
        self._settle()

    # ---- operations -----------------------------------------------------------------------------

    def _push(self, shard: str | None, message: str) -> Pushed:
        text = (manifest_text(self.model, shard=shard) if shard is not None
                else manifest_text(self.model).replace("max_shard_size", "max_shard_sise"))
        pushed = Pushed(commit_files(self.repo, {"hosts/a/tiny.yaml": text}, message), shard)
        self.history.append(pushed)
        return pushed

    @rule(shard=st.sampled_from(SHARDS))
    def push(self, shard: str) -> None:
        """A commit of the manifest (the same content as served, or another shard size), synced now."""
        assert self.f is not None
        pushed = self._push(shard, f"shards of {shard}")
        self.refused = None
        self._file_holds(pushed)
        self.f.sync.sync_now()
        self._settle(head=pushed.commit)

    def _file_holds(self, commit: Pushed) -> None:
        """The source publishes ``commit``. Its text differs from the file's only with another shard size (a
        commit of the same manifest leaves the file alone, and any drift with it); then the watcher applies
        it, over any drift (as an auto-sync does): a new revision, with that commit."""
        if commit.shard != self.applied.shard:
            self.commit, self.drift, self.drift_revision = commit.commit, None, None
        self.applied = commit  # the source's applied commit (a revision made from the file later records it)

    @rule()
    def push_broken(self) -> None:
        """A commit whose manifest does not validate: refused whole, the last good commit serves."""
        assert self.f is not None
        self.refused = self._push(None, "a broken manifest")
        self.f.sync.sync_now()
        self._settle(head=self.refused.commit)

    @precondition(lambda self: len(self.history) > 1)
    @rule(data=st.data())
    def force_push_back(self, data: st.DataObject) -> None:
        """History rewritten: the branch reset to an earlier good commit, synced now."""
        assert self.f is not None
        good = [p for p in self.history[:-1] if p.shard is not None]
        target = data.draw(st.sampled_from(good), label="reset to")
        _git(self.repo, "reset", "--hard", target.commit)
        self.refused = None
        self._file_holds(target)
        self.f.sync.sync_now()
        self._settle(head=target.commit)

    @rule(shard=st.sampled_from(SHARDS))
    def api_apply(self, shard: str) -> None:
        """An apply of another file declaring the name (drift): it serves; the source shows OutOfSync."""
        assert self.f is not None
        elsewhere = self.dir / "elsewhere.yaml"
        elsewhere.write_text(manifest_text(self.model, shard=shard))
        outcome = self.f.supervisor.apply_manifest(load_manifests(elsewhere)[0])
        if outcome.status == "applied":  # (its shards and offload paths are elsewhere's: never the file's)
            self.drift, self.drift_revision = shard, outcome.revision
        self._settle()

    @precondition(lambda self: self.f is not None and len(self.f.store.history(NAME)) > 1)
    @rule()
    def rollback(self) -> None:
        """``deploykit rollback`` of the source's deployment: the revision before serves (drift)."""
        assert self.f is not None
        target, outcome = self.f.supervisor.rollback(NAME)
        served = recorded_manifest(target).manifest.spec.sharding.max_shard_size
        shard = next(s for s in SHARDS if _bytes(s) == served)
        file = live_directory(source_root(self.dir / "state", "models")) / "tiny.yaml"
        if target.manifest_digest == load_manifests(file)[0].digest:  # what the file says: in sync again
            self.drift, self.drift_revision, self.commit = None, None, target.git_commit
        else:
            self.drift, self.drift_revision = shard, outcome.revision
        self._settle()

    @rule()
    def restart(self) -> None:
        """The server stops (close) and starts again over the same state directory: it serves the source's
        files (an API apply's or a rollback's drift ends), then compares them with the remote."""
        assert self.f is not None
        self.f.close()
        self.f = None
        self.f = Followed(self.dir / "state", self.source)
        if self.drift is not None:  # a start serves what the source's files say: the drift is gone
            self.drift, self.drift_revision, self.commit = None, None, self.applied.commit
        self._settle(head=_git(self.repo, "rev-parse", "HEAD"))  # compared with the remote again

    # ---- the invariants -------------------------------------------------------------------------

    def _settle(self, head: str | None = None) -> None:
        """Wait (bounded, I6) until the source decided ``head`` (applied or refused it) and what it decided is
        in place."""
        assert self.f is not None
        f = self.f
        wait_until(lambda: (head is None or _decided(f.sync.record(), head))
                   and f.sync.status().phase.value != "Progressing" and self._serves_expected(), SETTLE_BOUND,
                   f"the source settled (head {head}, expected shards {self.drift or self.applied.shard})")

    def _serves_expected(self) -> bool:
        assert self.f is not None
        current = self.f.store.current(NAME)
        dep = self.f.supervisor.get(NAME)
        if current is None or dep is None or not dep.state().serving:
            return False
        want = _bytes(self.drift or self.applied.shard or SHARDS[0])
        return recorded_manifest(current).manifest.spec.sharding.max_shard_size == want

    @invariant()
    def what_serves_is_what_should(self) -> None:
        if self.f is None:
            return
        current = self.f.store.current(NAME)
        assert current is not None, "G1: nothing is current"
        want = self.drift or self.applied.shard
        got = recorded_manifest(current).manifest.spec.sharding.max_shard_size
        assert got == _bytes(want or SHARDS[0]), f"G1: revision {current.revision} serves shards of {got}, " \
                                                 f"expected {want}"
        dep = self.f.supervisor.get(NAME)
        assert dep is not None
        revision, text = answer(dep, None)
        assert revision == current.revision, f"I2: revision {revision} answered, {current.revision} is current"
        reference = self.world.reference("base", None)
        assert text == reference, f"I4: the base answered {text!r}, its reference is {reference!r}"

    @invariant()
    def revisions_record_their_commit(self) -> None:
        if self.f is None or self.drift is not None:
            return
        current = self.f.store.current(NAME)
        assert current is not None
        shards = {p.commit: p.shard for p in self.history}
        served = recorded_manifest(current).manifest.spec.sharding.max_shard_size
        # the commit it came from: the one the model expects, or an earlier one with the same manifest (a
        # rollback's revision stays current when the next commit brings that very manifest back)
        assert current.git_commit == self.commit or (
            current.git_commit in shards and _bytes(shards[current.git_commit]) == served), (
            f"G2: revision {current.revision} records commit {current.git_commit} "
            f"({shards.get(current.git_commit, 'not a pushed commit')}), its content is commit {self.commit}'s")

    @invariant()
    def the_phase_says_the_truth(self) -> None:
        if self.f is None:
            return
        f = self.f
        expected = ("Degraded" if self.refused is not None else "OutOfSync" if self.drift is not None else "Synced")
        why = (f"the newest commit {self.refused.commit} is refused" if self.refused is not None
               else f"drift serves shards of {self.drift}" if self.drift is not None else "the commit serves")
        seen: list[dict] = []

        def settled() -> bool:  # a status converges: a watcher's no-op reload may still show Progressing
            seen.append(f.sync.status().to_dict())
            return seen[-1]["phase"] == expected

        try:
            wait_until(settled, PHASE_BOUND, f"the source's phase {expected}")
        except AssertionError:
            raise AssertionError(f"G3: {why}, yet after {PHASE_BOUND:g}s: {seen[-1]}") from None
        if self.refused is not None:
            status = seen[-1]
            assert self.refused.commit[:7] in (status.get("last_error") or "") + str(status.get("error_commit")), \
                f"G3: the refused commit is not named: {status}"

    def teardown(self) -> None:
        if self.f is not None:
            self.f.close()
            self.f = None
        left = leaked_threads(self.threads)
        assert not left, f"I6: threads left after close: {left}"


def _decided(record: SyncRecord, head: str) -> bool:
    """The source fetched ``head`` and applied or refused it (a head equal to the applied commit counts once
    fetched: before, the record may still hold an older commit's refusal)."""
    return record.fetched_commit == head and head in (record.applied_commit, record.error_commit)


def _bytes(size: str | None) -> int:
    return int(size.removesuffix("KiB")) << 10 if size is not None else -1


def _git(repo: Path, *args: str) -> str:
    import subprocess

    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True,
                          timeout=60).stdout.strip()
