"""A change of ``spec.adapters`` alone, applied live on the serving generation.

When the only difference between the applied manifest and the serving revision is its list of LoRA
adapters, or the files of one of them (same checkpoint, every other field equal), nothing of the base is
loaded again: the change is recorded as a revision like any other (history, diff, rollback), planned (the
adapters' bytes), and the serving generation's adapters are brought in step (``engine.adapters.Adapters``):
every new adapter and every new version of a changed one (another path, scale or files) is loaded beside
what serves, and only once all of them loaded whole does one switch make the new set serve: new names take
requests, changed ones answer with their new version (requests in flight finish with the old one), removed
ones take no more (theirs finish with them; each is deleted when its last request ended). A load that fails
fails the change as a whole: what it loaded is deleted, and the base and every adapter serve exactly as
before. Nothing waits for requests, so a close or a newer change never waits behind one. The base serves
throughout; its generation does not change. Anything else is a rollout as before.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...errors import ApplyError, DeploykitError
from ...spec.adapters import AdapterFileError, adapter_fingerprint
from ...spec.manifest import LoadedManifest
from ..revisions.change import Change
from ..revisions.decision import checkpoint_part
from ..revisions.layouts import open_source
from ..revisions.loading import recorded_manifest, serving_of
from ..revisions.reconciler import ApplyOutcome, finish_gated, git_commit
from ..revisions.decision import Action
from ..revisions.state import StateStore
from .held import inventory_freed

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from ...engine.adapters import AdapterSource, Adapters, Staged
    from .pool import Generation

@dataclass(frozen=True)
class AdapterDiff:
    """What the serving generation's adapters must become."""

    new: tuple[AdapterSource, ...]  # not served yet
    gone: tuple[str, ...]  # no longer in the manifest
    changed: tuple[AdapterSource, ...]  # served with another path, scale or files

    def describe(self) -> str:
        parts = [f"+{s.name}" for s in self.new] + [f"-{n}" for n in self.gone] + [f"~{s.name}" for s in self.changed]
        return " ".join(parts) or "no adapter changed"


def live_adapter_diff(store: StateStore, gen: Generation | None, loaded: LoadedManifest) -> AdapterDiff | None:
    """The adapters to change when ``loaded`` differs from the revision ``gen`` serves in ``spec.adapters``
    (or their files) alone; None when it is not such a change (or nothing changed: the apply says so)."""
    adapters: Adapters | None = getattr(gen.runtime, "adapters", None) if gen is not None else None
    current = store.current(loaded.name) if adapters is not None else None
    if gen is None or adapters is None or current is None or current.revision != gen.revision:
        return None
    if not loaded.manifest.spec.adapters and not adapters.names():  # no adapters before or after
        return None
    try:
        fingerprint = open_source(loaded)[1]
    except (DeploykitError, ValueError):  # unreadable: the apply says why
        return None
    if current.manifest_digest == loaded.digest and current.checkpoint_fingerprint == fingerprint:
        return None
    recorded = recorded_manifest(current)
    if _without_adapters(recorded).digest != _without_adapters(loaded).digest:
        return None
    if checkpoint_part(fingerprint) != checkpoint_part(current.checkpoint_fingerprint):
        return None
    wanted = {s.name: replace(s, fingerprint=_fingerprint(s)) for s in serving_of(loaded).adapters}
    served = {s.name: s for s in adapters.sources()}
    return AdapterDiff(new=tuple(s for n, s in wanted.items() if n not in served),
                       gone=tuple(n for n in served if n not in wanted),
                       changed=tuple(s for n, s in wanted.items() if n in served and served[n] != s))


def _fingerprint(source: AdapterSource) -> str:
    """The files' fingerprint now, which the load then holds them to ("" when unreadable: the plan says why)."""
    try:
        return adapter_fingerprint(Path(source.path))
    except AdapterFileError:
        return ""


def apply_live(store: StateStore, gen: Generation, change: Change, diff: AdapterDiff) -> ApplyOutcome:
    """Record ``change`` as a revision and bring ``gen``'s adapters in step with it (see the module)."""
    loaded = change.loaded
    plan = change.plan(inventory_freed(change.inventory(), gen))  # the base as it serves, its adapters' bytes
    # new (planned with what it holds given back: the probe does not count it free); fails before recording
    with store.deployment_lock(loaded.name):
        return _record_and_act(store, gen, change, diff, plan)


def _record_and_act(store: StateStore, gen: Generation, change: Change, diff: AdapterDiff, plan: Any) -> ApplyOutcome:
    loaded = change.loaded
    current = store.current(loaded.name)
    assert current is not None and gen.runtime is not None
    source = Path(loaded.source).resolve()
    revision = store.begin_revision(name=loaded.name, manifest_path=str(source), manifest_text=loaded.text,
                                    manifest_digest=loaded.digest,
                                    checkpoint_fingerprint=open_source(loaded)[1],
                                    git_commit=loaded.commit or git_commit(source, loaded.digest))
    reason = f"only spec.adapters changed ({diff.describe()}): applied live on generation {gen.number}"
    store.record_event(loaded.name, "Decided", f"revision {revision}: {reason}")
    try:
        store.set_plan(loaded.name, revision, plan_json=json.dumps(plan.to_dict()), plan_digest=plan.digest,
                       shards_path=current.shards_path or "", checksums=current.checksums)
        _bring_in_step(getattr(gen.runtime, "adapters"), diff)
    except BaseException as exc:
        message = str(exc) if isinstance(exc, DeploykitError) else f"{type(exc).__name__}: {exc}"
        store.finish_revision(loaded.name, revision, ready=False, reason=message)
        raise
    gen.plan, gen.revision = plan, revision  # the generation now serves this revision
    _resize_kv(gen, plan)
    finish_gated(loaded, store, revision, ready=True, reason=f"adapters {diff.describe()}")
    return ApplyOutcome(loaded.name, "applied", revision, plan, (Action("adapters", reason),),
                        shards=Path(current.shards_path or ""))


def _resize_kv(gen: Generation, plan: Any) -> None:
    """The KV room the new plan leaves beside the base and its adapters' bytes, for requests admitted from now."""
    from .pool import kv_cache_budget

    engine = getattr(gen.runtime, "engine", None)
    resize = getattr(engine, "resize_kv_cache", None)
    if resize is not None and not resize(kv_cache_budget(plan)):
        log.info("%s: the paged KV cache keeps its size until the next generation", gen.number)


def _bring_in_step(adapters: Adapters, diff: AdapterDiff) -> None:
    """Load every new adapter and new version beside what serves, then switch them all at once; a failed
    load discards what was loaded, and nothing that serves changed."""
    staged: list[Staged] = []
    try:
        for source in (*diff.new, *diff.changed):
            try:
                staged.append(adapters.stage(source))
            except Exception as exc:
                raise ApplyError(f"adapter {source.name!r} ({source.path}) could not be loaded: {exc}; nothing "
                                 "that serves changed") from exc
    except BaseException:
        for one in staged:
            adapters.discard(one)
        raise
    adapters.commit(serve=staged, remove=diff.gone)


def _without_adapters(loaded: LoadedManifest) -> LoadedManifest:
    manifest = loaded.manifest
    bare = manifest.model_copy(update={"spec": manifest.spec.model_copy(update={"adapters": []})})
    return replace(loaded, manifest=bare)

