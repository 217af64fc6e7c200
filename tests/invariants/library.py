"""The in-process tier: a library ``Deployment`` of the manifest file ``chat.yaml``, driven by hypothesis'
``RuleBasedStateMachine`` through random manifest writes (good, schema-broken, load-broken, quantized, canary,
recreate / blue-green / auto, adapters added / changed / removed / broken), reloads, and close-then-restart;
the invariants (docs/testing.md) are checked after every step. A failure shrinks to the shortest sequence."""

from __future__ import annotations

import itertools
import time
from pathlib import Path
from typing import Any

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from deploykit import Deployment

from .checks import Files, deploykit_threads, leaked_threads, note
from .config import open_ops
from .world import ADAPTERS, BASES, NAME, PROMPT, TOKENS, Spec, World, expect

RELOAD_BOUND = 120.0  # seconds a reload may take (I6), canary steps and all, on 2 busy cores
CLOSE_BOUND = 60.0
_examples = itertools.count()


def specs(*, strategies: tuple[str, ...], on_demand: bool = False) -> st.SearchStrategy[Spec]:
    """Manifests, mostly servable (else little would serve), without the operations ``KNOWN_OPEN`` holds."""
    adapter_sets = st.dictionaries(st.sampled_from(["pirate", "polite"]), st.sampled_from(ADAPTERS), max_size=2)
    spec = st.builds(
        Spec,
        base=st.sampled_from(BASES[:2]) | st.sampled_from(BASES),  # good bases twice as often
        quant=st.sampled_from(["none", "none", "int8"]),
        strategy=st.sampled_from(strategies),
        adapters=adapter_sets.map(lambda d: tuple(sorted(d.items()))),
        max_tokens=st.sampled_from([32, 48]),
        shard=st.sampled_from(["2GiB", "300KiB"]),
        schema_broken=st.sampled_from([False, False, False, False, True]),
        on_demand=st.booleans() if on_demand else st.just(False),
        speculative=st.sampled_from([False, False, True]))
    left_out = open_ops()
    return spec.filter(lambda s: not (s.ops() & left_out))


class Answers:
    """Greedy answers of a deployment, checked against the references of what it says serves (I2, I4).
    A quantized base has no peft reference: its first answer is its reference, each later one must equal it."""

    def __init__(self, world: World) -> None:
        self.world = world
        self.observed: dict[tuple[str, str, str | None], str] = {}

    def check(self, spec: Spec, adapter: str | None, answer: str, where: str) -> None:
        key = (spec.base, spec.quant, adapter)
        if spec.quant == "none":
            expected = self.world.reference(spec.base, adapter)
        else:
            expected = self.observed.setdefault(key, answer)
        assert answer == expected, (f"I4: {where}: {spec.base} (quantization {spec.quant}) with adapter "
                                    f"{adapter} answered {answer!r}, its reference is {expected!r}")


def answer(dep: Deployment, adapter: str | None) -> tuple[int, str]:
    """(revision of the generation that answered, its greedy answer to PROMPT) with the adapter served as
    ``adapter`` (None: the base), as the API computes it."""
    from deploykit.engine.requests import GenerationRequest
    from deploykit.engine.text import TextStream, chat_prompt_ids

    gen = dep.pin(60)
    try:
        runtime: Any = gen.runtime
        ids = chat_prompt_ids(runtime.tokenizer, [{"role": "user", "content": PROMPT}])
        handle = runtime.engine.submit(GenerationRequest(prompt_ids=ids, max_new_tokens=TOKENS, adapter=adapter))
        text = TextStream(runtime.tokenizer, skip_ids=sorted(runtime.eos_ids))
        parts = [text.push(token) for token in handle]
        result = handle.result()
        assert result.finish_reason != "error", f"I1: the request with adapter {adapter} failed: {result.error}"
        parts.append(text.finish())
        return gen.revision, "".join(parts)
    finally:
        dep.unpin(gen)


class LibraryMachine(RuleBasedStateMachine):
    """One ``Deployment`` per example, in a directory of its own under the world's root."""

    world: World
    root: Path

    def __init__(self) -> None:
        super().__init__()
        self.dir = self.root / f"library-{next(_examples)}"
        self.dir.mkdir()
        self.path = self.dir / "chat.yaml"
        self.threads = deploykit_threads()
        self.files = Files([self.world.root], ignored=[self.root])
        self.answers = Answers(self.world)
        self.written = Spec()
        self.path.write_text(self.world.manifest(self.written))
        self.dep: Deployment | None = Deployment.from_manifest(self.path, state_dir=self.dir / "state")
        self.specs: dict[int, Spec] = {1: self.written}  # each recorded revision's manifest
        self.serving = self.written  # what the model says serves
        note(f"example directory {self.dir}")

    # ---- operations -----------------------------------------------------------------------------

    @rule(spec=specs(strategies=("auto", "recreate", "blue-green", "canary")))
    def write_and_reload(self, spec: Spec) -> None:
        """Write a manifest and reload it (what a save does): it serves, or fails leaving what served."""
        assert self.dep is not None
        before = self.dep.status()["revision"]
        self.path.write_text(self.world.manifest(spec))
        self.written = spec
        outcome = expect(spec, self.serving)
        started = time.monotonic()
        self.dep.reload()
        took = time.monotonic() - started
        assert took < RELOAD_BOUND, f"I6: a reload took {took:.1f}s (bound {RELOAD_BOUND}s)"
        self._learn_revisions()
        status = self.dep.status()
        unchanged = self.world.manifest(spec) == self.world.manifest(self.serving)
        if outcome == "fail" or unchanged:
            assert status["revision"] == before, (
                f"I3: a change that must fail ({outcome}) changed what serves: revision {before} -> "
                f"{status['revision']} ({status['last_error']})")
            if not unchanged:
                assert status["last_error"], f"I3: a failed change left no error in status: {status['phase']}"
        elif outcome == "ok":
            assert status["revision"] != before and status["last_error"] is None, (
                f"a servable change did not serve: revision {status['revision']}, error {status['last_error']}")
        self.serving = self.specs[status["revision"]]

    def _file_serves(self) -> bool:
        """The manifest file as written would serve (unchanged, or a change that must succeed)."""
        same = self.world.manifest(self.written) == self.world.manifest(self.serving)
        return same or expect(self.written, self.serving) == "ok"

    @precondition(lambda self: self._file_serves() or "restart_broken_file" not in open_ops())
    @rule()
    def close_and_restart(self) -> None:
        """Close (I6: within its bound, no deploykit thread left), then start again from the file as it is:
        the last promoted revision serves, then the file rolls out from it."""
        assert self.dep is not None
        started = time.monotonic()
        self.dep.close()
        self.dep = None
        took = time.monotonic() - started
        assert took < CLOSE_BOUND, f"I6: close took {took:.1f}s"
        assert leaked_threads(self.threads) == [], f"I6: threads left after close: {leaked_threads(self.threads)}"
        try:
            self.dep = Deployment.from_manifest(self.path, state_dir=self.dir / "state")
        except Exception as exc:  # noqa: BLE001 - a broken file with nothing recorded to fall back on
            raise AssertionError(f"a restart with a recorded Ready revision did not start: {exc!r}") from exc
        self.dep.wait_idle()
        self._learn_revisions()
        self.serving = self.specs[self.dep.status()["revision"]]

    # ---- invariants -----------------------------------------------------------------------------

    def _learn_revisions(self) -> None:
        """Revisions recorded since: each holds the manifest last written."""
        assert self.dep is not None
        for record in self.dep.store.history(NAME):
            self.specs.setdefault(record.revision, self.written)

    @invariant()
    def what_status_says_serves_answers(self) -> None:
        if self.dep is None:
            return
        status = self.dep.status()
        revision = status["revision"]
        assert revision in self.specs, f"I2: status says revision {revision} serves, none was recorded as such"
        spec = self.specs[revision]
        current = self.dep.store.current(NAME)
        # I3: the store's current revision is the serving one, or status carries why not and its phase says so
        if current is None or current.revision != revision:
            assert status["last_error"] and status["phase"] != "Ready", (
                f"I3: the store's current revision is {current and current.revision}, revision {revision} serves, "
                f"and status says {status['phase']} with error {status['last_error']!r}")
        if status["phase"] == "Ready":
            assert current is not None and current.phase == "Ready" and current.revision == revision
        served = sorted(a["name"] for a in status["adapters"] or [])
        assert served == sorted(n for n, _ in spec.adapters), (
            f"I2: status lists adapters {served}; revision {revision} declares {spec.adapters}")
        answered, text = answer(self.dep, None)
        assert answered == revision, f"I2: status says revision {revision}, revision {answered} answered"
        self.answers.check(spec, None, text, f"revision {revision}'s base")
        for served_name, key in spec.adapters:
            if key == "pissa":
                continue  # no reference: peft itself rewrites the base for it
            answered, text = answer(self.dep, served_name)
            assert answered == revision, f"I2: status says revision {revision}, revision {answered} answered"
            self.answers.check(spec, key, text, f"revision {revision}'s adapter {served_name}")

    @invariant()
    def nothing_outside_is_touched(self) -> None:
        assert self.files.changed() == [], f"I7: files deploykit did not lay out changed: {self.files.changed()}"

    def teardown(self) -> None:
        if self.dep is not None:
            self.dep.close()
            self.dep = None
        assert leaked_threads(self.threads) == [], f"I6: threads left after close: {leaked_threads(self.threads)}"
