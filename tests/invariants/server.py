"""The serve tier: a real ``deploykit serve`` (no PATH: every deployment comes through its control API) on a
free port, under a host budget, driven by hypothesis through applies (good, broken, quantized, canary,
adapters), dry runs, rollbacks (plain and to a revision), deletes, a second deployment loaded on demand
(budget pressure), base / adapter / streamed requests and clients that disconnect, ``kill -9`` then a
restart (restore) and SIGTERM then a restart; the invariants are checked after every step over HTTP."""

from __future__ import annotations

import itertools
import json
import signal
import time
from pathlib import Path
from typing import Any

import httpx
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from servers import Server, get

from deploykit.control.revisions.state import StateStore

from .checks import Files, children, note, openai_error
from .config import open_ops
from .library import Answers, specs
from .world import NAME, PROMPT, TOKENS, Spec, World, expect

TOKEN = "invariants-control-token"
BUDGET = "cpu=1MB"  # two tiny chat models fit, a third does not
OTHER = "other"  # the second deployment: on-demand, it takes room from the first
APPLY_BOUND = 120.0
STOP_BOUND = 60.0
# the operations of this tier beyond the manifests' (config.KNOWN_OPEN may name them)
SERVER_OPS = frozenset({"dry_run", "rollback", "rollback_to", "delete", "other_request", "stream", "disconnect",
                        "kill9_restart", "sigterm_restart"})
_examples = itertools.count()


class _Serve(Server):
    """``deploykit serve`` that may hold no deployment (its /readyz then says not ready): up once /healthz answers,
    then given until the bound for what it restores to be ready."""

    def __enter__(self) -> _Serve:
        import subprocess

        self.process = subprocess.Popen(self.command, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        text=True)
        deadline = time.monotonic() + self.ready_timeout
        while time.monotonic() < deadline:
            assert self.process.poll() is None, f"deploykit serve exited: {self.process.communicate()[1]}"
            try:
                if get(f"{self.url}/healthz")[0] == 200:
                    if get(f"{self.url}/readyz", self.readyz_headers)[0] == 200 or not _held(self.env):
                        return self
            except OSError:
                pass
            time.sleep(0.1)
        return self  # what it restores is not ready in time: the invariants say why


def _held(env: dict[str, str]) -> bool:
    """The state store names a current deployment (a restart restores it)."""
    store = StateStore(Path(env["DEPLOYKIT_STATE"]))
    return any(store.current(n) is not None for n in store.names())


def _allowed(op: str) -> bool:
    return op not in open_ops()


class ServerMachine(RuleBasedStateMachine):
    world: World
    root: Path

    def __init__(self) -> None:
        super().__init__()
        self.dir = self.root / f"server-{next(_examples)}"
        self.dir.mkdir()
        self.state = self.dir / "state"
        self.files = Files([self.world.root], ignored=[self.root])
        self.answers = Answers(self.world)
        self.specs: dict[int, Spec] = {}
        self.server: Server | None = None
        self.other_applied = False
        self._start()
        self.serving: Spec | None = None
        self._apply(Spec())
        note(f"example directory {self.dir}")

    # ---- the server ---------------------------------------------------------------------------------

    def _start(self) -> None:
        self.server = _Serve(None, self.state, "--budget", BUDGET, "--control-token", TOKEN, "--drain-timeout", "10",
                             ready_timeout=APPLY_BOUND)
        self.server.__enter__()
        self.http = httpx.Client(base_url=self.server.url, timeout=APPLY_BOUND)
        self.auth = {"Authorization": f"Bearer {TOKEN}"}
        self.store = StateStore(self.state)

    def _control(self, route: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST a control call; its last event (result or error), within its bound (I6)."""
        started = time.monotonic()
        with self.http.stream("POST", f"/control/v1/{route}", json=body, headers=self.auth) as r:
            lines = [line for line in r.iter_lines() if line.strip()]
        took = time.monotonic() - started
        assert took < APPLY_BOUND, f"I6: {route} took {took:.1f}s"
        if r.status_code != 200:
            return json.loads(lines[0]) if lines else {"event": "error", "status": r.status_code}
        assert lines, f"{route}: an empty answer"
        return dict(json.loads(lines[-1]))

    def _apply_body(self, spec: Spec, name: str = NAME, dry_run: bool = False) -> dict[str, Any]:
        source = self.dir / f"{name}.yaml"  # the CLI sends the file's text and path; nothing reads it
        return {"manifest": self.world.manifest(spec, name), "source": str(source), "name": name, "dry_run": dry_run}

    def _status(self) -> dict[str, dict[str, Any]]:
        r = self.http.get("/status")
        assert r.status_code == 200, r.text
        out: dict[str, dict[str, Any]] = {}
        for s in r.json():
            assert s["name"] not in out, f"I1: two deployments named {s['name']} in /status"
            out[s["name"]] = s
        return out

    def _serving_revision(self) -> int | None:
        """The revision that answers the next request: the loaded generation's, or (unloaded on demand) the one
        its next request loads."""
        status = self._status().get(NAME, {})
        if status.get("serving_revision") is None and status.get("serving"):
            return status.get("revision")
        return status.get("serving_revision")

    def _learn(self, spec: Spec) -> None:
        """Revisions recorded since: an apply's hold ``spec``; a rollback's hold the manifest of the earlier
        revision with the same recorded text."""
        records = self.store.history(NAME)
        texts = {r.revision: r.manifest_text for r in records}
        for record in records:
            if record.revision not in self.specs:
                same = [self.specs[n] for n, t in texts.items() if t == record.manifest_text and n in self.specs]
                self.specs[record.revision] = same[0] if same else spec

    def _apply(self, spec: Spec) -> None:
        before = self._serving_revision()
        result = self._control("apply", self._apply_body(spec))
        note(f"apply -> {str(result)[:300]}")
        self._learn(spec)
        after = self._serving_revision()
        outcome = "ok" if self.serving is None and spec.servable() else expect(spec, self.serving or spec)
        unchanged = self.serving is not None and self.world.manifest(spec) == self.world.manifest(self.serving)
        if outcome == "fail" or unchanged:
            assert after == before, f"I3: a change that must fail changed what serves: {before} -> {after}: {result}"
            assert result.get("event") == "error" or unchanged, f"a change that must fail succeeded: {result}"
        elif outcome == "ok":
            assert result.get("event") == "result" and after is not None, f"a servable change failed: {result}"
        if after is not None:
            self.serving = self.specs[after]

    # ---- operations ---------------------------------------------------------------------------------

    @rule(spec=specs(strategies=("auto", "recreate", "blue-green", "canary"), on_demand=True))
    def apply(self, spec: Spec) -> None:
        self._apply(spec)

    @precondition(lambda self: _allowed("dry_run"))
    @rule(spec=specs(strategies=("auto", "blue-green")))
    def dry_run(self, spec: Spec) -> None:
        """A dry run changes nothing: no revision, nothing served differently."""
        before, recorded = self._serving_revision(), len(self.store.history(NAME))
        result = self._control("apply", self._apply_body(spec, dry_run=True))
        assert (self._serving_revision(), len(self.store.history(NAME))) == (before, recorded), (
            f"a dry run changed something: {result}")

    @precondition(lambda self: _allowed("rollback") and self.serving is not None)
    @rule()
    def rollback(self) -> None:
        result = self._control("rollback", {"name": NAME})
        note(f"rollback -> {str(result)[:300]}")
        self._after_change(result)

    @precondition(lambda self: _allowed("rollback_to") and self.serving is not None and len(self.specs) > 1)
    @rule(data=st.data())
    def rollback_to(self, data: st.DataObject) -> None:
        target = data.draw(st.sampled_from(sorted(self.specs)), label="to_revision")
        result = self._control("rollback", {"name": NAME, "to_revision": target})
        note(f"rollback to {target} -> {str(result)[:300]}")
        if result.get("event") == "result":  # it serves the target's manifest as a new revision
            new = self._serving_revision()
            assert new is not None and self.world.manifest(self.specs[new]) == self.world.manifest(self.specs[target]) \
                or not self.specs[target].servable(), f"a rollback to {target} serves revision {new}: {result}"
        self._after_change(result)

    def _after_change(self, result: dict[str, Any]) -> None:
        self._learn(self.serving or Spec())
        after = self._serving_revision()
        self.serving = self.specs[after] if after is not None else self.serving

    @precondition(lambda self: _allowed("delete") and self.serving is not None)
    @rule()
    def delete(self) -> None:
        result = self._control("delete", {"name": NAME})
        assert result.get("event") == "result", f"delete failed: {result}"
        assert NAME not in {m["id"] for m in self.http.get("/v1/models").json()["data"]}, "I1: deleted, still listed"
        self.serving = None

    @precondition(lambda self: _allowed("other_request"))
    @rule()
    def other_request(self) -> None:
        """A second deployment, on demand, asked for: under the budget it may unload the first."""
        if not self.other_applied:
            result = self._control("apply", self._apply_body(Spec(on_demand=True), name=OTHER))
            assert result.get("event") == "result", f"the second deployment was refused: {result}"
            self.other_applied = True
        status, text, _ = self._chat(OTHER)
        assert status == 200 and text == self.world.reference("base", None), f"{OTHER} answered {status} {text!r}"

    @precondition(lambda self: _allowed("disconnect") and self.serving is not None)
    @rule()
    def disconnect(self) -> None:
        """A client that goes away after its first chunk; the server must not mind."""
        body = {"model": NAME, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": TOKENS,
                "temperature": 0, "stream": True}
        with self.http.stream("POST", "/v1/chat/completions", json=body) as r:
            for _ in r.iter_lines():
                break

    @precondition(lambda self: _allowed("kill9_restart"))
    @rule()
    def kill9_restart(self) -> None:
        """``kill -9``, then ``deploykit serve`` again: it restores what was serving."""
        assert self.server is not None and self.server.process is not None
        self.server.process.send_signal(signal.SIGKILL)
        self.server.process.wait(STOP_BOUND)
        self.server.stop()
        self._restart()

    @precondition(lambda self: _allowed("sigterm_restart"))
    @rule()
    def sigterm_restart(self) -> None:
        """SIGTERM: stops within its bound with exit 0, its server.json removed and no child left (I6)."""
        assert self.server is not None and self.server.process is not None
        pid = self.server.process.pid
        started = time.monotonic()
        code = self.server.stop()
        took = time.monotonic() - started
        assert code == 0 and took < STOP_BOUND, f"I6: SIGTERM: exit {code} after {took:.1f}s\n{self.server.stderr[-2000:]}"
        assert not (self.state / "server.json").exists(), "I6: server.json left after a clean exit"
        assert children(pid) == [], f"I6: processes of the server left: {children(pid)}"
        self._restart()

    def _restart(self) -> None:
        self.http.close()
        self._start()
        current = self.store.current(NAME)
        if self.serving is not None and current is not None:
            self.serving = self.specs.get(current.revision, self.serving)

    # ---- requests -----------------------------------------------------------------------------------

    def _chat(self, model: str, stream: bool = False) -> tuple[int, str, dict[str, Any]]:
        """(status, text or error, headers and body) of a greedy chat to ``model``."""
        body = {"model": model, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": TOKENS,
                "temperature": 0, "stream": stream}
        if not stream:
            r = self.http.post("/v1/chat/completions", json=body)
            data = r.json()
            text = data["choices"][0]["message"]["content"] if r.status_code == 200 else ""
            return r.status_code, text, {"headers": r.headers, "body": data}
        with self.http.stream("POST", "/v1/chat/completions", json=body) as r:
            lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
            headers = r.headers
        if r.status_code != 200:
            return r.status_code, "", {"headers": headers, "body": json.loads(lines[0]) if lines else None}
        assert lines and lines[-1] == "[DONE]", f"a stream did not end with [DONE]: {lines[-3:]}"
        text = "".join(json.loads(x)["choices"][0]["delta"].get("content") or ""
                       for x in lines[:-1] if json.loads(x).get("choices"))
        return r.status_code, text, {"headers": headers, "body": None}

    # ---- invariants ---------------------------------------------------------------------------------

    @invariant()
    def what_status_says_serves_answers(self) -> None:
        statuses = self._status()
        assert set(statuses) <= {NAME, OTHER}, f"I1: unexpected deployments {sorted(statuses)}"
        if self.serving is None:
            assert NAME not in {m["id"] for m in self.http.get("/v1/models").json()["data"]}, f"I1: {NAME} deleted, listed"
            return
        assert NAME in statuses, f"I1: {NAME} serves (the model says), /status lacks it"
        if statuses[NAME]["loaded"] == "unloaded" and self.serving.adapters:
            # unloaded on demand, it lists its base only (docs/adapters.md); a request for an adapter loads it
            adapter = f"{NAME}:{self.serving.adapters[0][0]}"
            code, _, raw = self._chat(adapter)
            assert code == 200, f"I1: {adapter} of an unloaded deployment answered {code}: {raw['body']}"
        code, text, raw = self._chat(NAME, stream=bool(len(self.specs) % 2))  # first: on demand, it loads
        models = {m["id"]: m for m in self.http.get("/v1/models").json()["data"]}  # after: its adapters listed
        status = self._status()[NAME]
        revision = status["serving_revision"]
        current = self.store.current(NAME)
        if current is None or current.revision != revision:
            assert status["last_error"] and status["phase"] != "Ready", (
                f"I3: the store's current revision is {current and current.revision}, {revision} serves, status "
                f"says {status['phase']} ({status['last_error']!r})")
        if revision is None:
            return  # nothing serves, and status says why (checked above)
        spec = self.specs[revision]
        listed = sorted(m for m in models if m.startswith(f"{NAME}:"))
        in_status = sorted(f"{NAME}:{a['name']}" for a in status["adapters"])
        assert listed == in_status == sorted(f"{NAME}:{n}" for n, _ in spec.adapters), (
            f"I2: /v1/models lists {listed}, /status {in_status}, revision {revision} declares {spec.adapters}")
        for adapter in [None, *spec.adapters]:
            if adapter is not None and adapter[1] == "pissa":
                continue
            model = NAME if adapter is None else f"{NAME}:{adapter[0]}"
            if adapter is not None:
                code, text, raw = self._chat(model)
            assert code == 200, f"I1: {model} is listed and answered {code}: {raw['body']}"
            answered = int(raw["headers"]["x-deploykit-revision"])
            assert answered == revision, f"I2: /status says revision {revision} serves {model}, {answered} answered"
            self.answers.check(spec, adapter and adapter[1], text, f"revision {revision}'s {model}")

    @invariant()
    def listed_models_answer_or_say_why(self) -> None:
        """I1 for every listed model (the second deployment too), and I5: the budget's use is the bytes of
        what is loaded."""
        statuses = self._status()
        used = sum(s["budget"]["bytes"] for s in statuses.values() if s.get("budget") and s["loaded"] == "loaded")
        assert self.server is not None
        assert self.server.metric("deploykit_budget_used_bytes", tier="cpu") == used, (
            f"I5: the budget's use {self.server.metric('deploykit_budget_used_bytes', tier='cpu')} is not the "
            f"bytes of the loaded deployments ({used}: {[(n, s['loaded']) for n, s in statuses.items()]})")
        r = self.http.post("/v1/chat/completions", json={"model": "nobody", "messages": [{"role": "user", "content": PROMPT}]})
        assert r.status_code == 404 and openai_error(r.json()) is None, f"I1: {r.status_code} {r.text[:200]}"

    @invariant()
    def nothing_outside_is_touched(self) -> None:
        assert self.files.changed() == [], f"I7: files deploykit did not lay out changed: {self.files.changed()}"

    def teardown(self) -> None:
        if self.server is not None and self.server.process is not None:
            self.http.close()
            code = self.server.stop()
            assert code == 0, f"I6: the server exited {code} on SIGTERM: {self.server.stderr[-2000:]}"
