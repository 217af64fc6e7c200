"""A plain blue-green rollout is armed like a gated one: a rollback, a newer change or the server stopping
while its candidate is laid out or loads ends that rollout (before its weights load, or before the swap),
never the revision that serves; the candidate is recorded Failed and nothing of it is left loaded."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from chatmodel import build_chat_model
from helpers import wait_until
from servers import Server

from deploykit import Deployment
from deploykit.control.revisions.state import StateStore
from deploykit.errors import ApplyError
from deploykit.spec.manifest import load_manifests
from test_canary_library import AbortedWhileLoading  # aborts revision 2 once its plan is recorded


def manifest(model: Path, shard: str = "2GiB") -> str:
    return (f"apiVersion: deploykit/v1\nkind: ModelDeployment\nmetadata: {{name: chat}}\nspec:\n"
            f"  model: {{path: {model}, dtype: float32}}\n  placement: {{gpus: []}}\n"
            f"  sharding: {{max_shard_size: {shard}}}\n  rollout: {{strategy: blue-green}}\n")


def test_a_rollback_while_a_blue_green_candidate_is_laid_out_ends_it_before_its_weights_load(
        tmp_path: Path) -> None:
    model = build_chat_model(tmp_path / "model")
    path = tmp_path / "chat.yaml"
    path.write_text(manifest(model))
    store = AbortedWhileLoading(tmp_path / "state")
    store.aborted = []
    dep = Deployment.from_manifest(path, store=store)
    store.owner = dep
    try:
        path.write_text(manifest(model, shard="1MiB"))
        assert dep.reload() is False
        assert store.aborted == [True]
        last = store.history("chat")[-1]
        assert (last.revision, last.phase, last.reason) == (
            2, "Failed", "rollout aborted before its candidate loaded: rolled back by hand")
        assert dep.status()["revision"] == 1 and dep.generation == 1 and dep.pool.candidate is None
        assert dep.abort_rollout("nothing to abort") is False  # disarmed once it ended
    finally:
        dep.close()


def test_an_abort_after_the_candidate_loaded_ends_it_before_the_swap(tmp_path: Path) -> None:
    """The abort comes while the candidate's health check runs (its weights loaded): it is closed, never
    swapped in, and recorded Failed; the serving generation answers on."""
    model = build_chat_model(tmp_path / "model")
    path = tmp_path / "chat.yaml"
    path.write_text(manifest(model))
    dep = Deployment.from_manifest(path, store=StateStore(tmp_path / "state"))
    try:
        aborted: list[bool] = []

        def on_step(step: str) -> None:
            if step == "health-check":
                aborted.append(dep.abort_rollout("the server is stopping"))

        path.write_text(manifest(model, shard="1MiB"))
        with pytest.raises(ApplyError, match="rollout aborted before its promotion: the server is stopping"):
            dep.roll_to(load_manifests(path)[0], on_step=on_step)  # as the control API hands it over
        assert aborted == [True]
        last = dep.store.history("chat")[-1]
        assert (last.revision, last.phase) == (2, "Failed"), last
        assert dep.status()["revision"] == 1 and dep.generation == 1 and dep.pool.candidate is None
        assert dep.generate("hello", max_tokens=2).text is not None
    finally:
        dep.close()


def test_a_file_change_older_than_a_handed_over_change_does_not_end_it(tmp_path: Path) -> None:
    """A change handed over while the watched file says otherwise (a git source's drift: an API apply, a
    rollback) is ended by a newer change of the file only: the watcher reporting late a change the file
    already held when the handed-over one began supersedes nothing."""
    model = build_chat_model(tmp_path / "model")
    path, elsewhere = tmp_path / "chat.yaml", tmp_path / "elsewhere.yaml"
    path.write_text(manifest(model))
    dep = Deployment.from_manifest(path, store=StateStore(tmp_path / "state"))
    try:
        path.write_text(manifest(model, shard="1MiB"))  # written before the apply; its event comes late
        late = load_manifests(path)[0].digest
        elsewhere.write_text(manifest(model, shard="3MiB"))
        superseded: list[bool] = []

        def on_step(step: str) -> None:
            if step == "health-check":
                superseded.append(dep.supersede(load_manifests(path)[0]))

        dep.roll_to(load_manifests(elsewhere)[0], on_step=on_step, adopt=False)
        assert superseded == [False] and dep.status()["revision"] == 2

        def newer(step: str) -> None:
            if step == "health-check":
                path.write_text(manifest(model, shard="5MiB"))  # a change made while it rolls out
                superseded.append(dep.supersede(load_manifests(path)[0]))

        elsewhere.write_text(manifest(model, shard="4MiB"))
        with pytest.raises(ApplyError, match="superseded by a newer change"):
            dep.roll_to(load_manifests(elsewhere)[0], on_step=newer, adopt=False)
        assert superseded == [False, True] and dep.status()["revision"] == 2
        assert late != load_manifests(path)[0].digest
    finally:
        dep.close()


def test_an_abort_while_from_pretrained_loads_the_candidates_weights_ends_it_at_the_next_tensor(
        tmp_path: Path) -> None:
    """A rollback (or SIGTERM) that comes while transformers loads the candidate's weights, inside
    ``from_pretrained``, ends that load at the next tensor rather than at its end: the candidate is recorded
    Failed, the serving revision answers on, and transformers' progress hook is left as it was."""
    from transformers.utils import logging as hf_logging

    model = build_chat_model(tmp_path / "model")
    path = tmp_path / "chat.yaml"
    path.write_text(manifest(model))
    dep = Deployment.from_manifest(path, store=StateStore(tmp_path / "state"))
    loaded: list[int] = []
    aborted: list[bool] = []
    total: list[int] = []

    def watching(factory, args, kwargs):  # type: ignore[no-untyped-def]
        bar = factory(*args, **kwargs)
        if kwargs.get("desc") != "Loading weights":
            return bar
        total.append(len(args[0]))

        def tensors():  # type: ignore[no-untyped-def]
            for i, item in enumerate(bar):
                loaded.append(i)
                if i == 1:  # the first tensor is in: the rollout is rolled back now
                    aborted.append(dep.abort_rollout("rolled back by hand"))
                yield item
        return tensors()

    previous = hf_logging.set_tqdm_hook(watching)
    try:
        path.write_text(manifest(model, shard="1MiB"))
        assert dep.reload() is False
        assert aborted == [True] and loaded == [0, 1] and total[0] > 2  # it stopped at the tensor after the abort
        last = dep.store.history("chat")[-1]
        assert (last.revision, last.phase, last.reason) == (
            2, "Failed", "rollout aborted before its candidate loaded: rolled back by hand")
        assert dep.status()["revision"] == 1 and dep.generation == 1 and dep.pool.candidate is None
        assert dep.generate("hello", max_tokens=2).text is not None
    finally:
        assert hf_logging.set_tqdm_hook(previous) is watching
        dep.close()


SLOW_CANDIDATE = '''
import os, threading
from transformers.utils import logging as hf_logging
bars = []

def slow(factory, args, kwargs):  # every tensor of the second load (the candidate) takes 2 s: a slow disk
    bar = factory(*args, **kwargs)
    if kwargs.get("desc") != "Loading weights":
        return bar
    bars.append(bar)
    if len(bars) < 2:
        return bar

    def tensors():
        for item in bar:
            with open(os.environ["DEPLOYKIT_TEST_TENSORS"], "a") as f:
                f.write("tensor\\n")
            threading.Event().wait(2)
            yield item
    return tensors()

hf_logging.set_tqdm_hook(slow)
'''


def test_sigterm_while_a_real_server_loads_a_blue_green_candidate_ends_it_within_a_tensor(tmp_path: Path) -> None:
    """``deploykit serve`` stopped by SIGTERM while its candidate's 21 tensors load at 2 s each exits with 0
    within seconds (the load ends at the next tensor), not after the whole load, and the candidate is recorded
    Failed with why."""
    model = build_chat_model(tmp_path / "model")
    path = tmp_path / "chat.yaml"
    path.write_text(manifest(model))
    (tmp_path / "hooks").mkdir()
    (tmp_path / "hooks" / "sitecustomize.py").write_text(SLOW_CANDIDATE)
    tensors = tmp_path / "tensors"
    tensors.write_text("")
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path / "hooks"), os.environ.get("PYTHONPATH", "")]),
           "DEPLOYKIT_TEST_TENSORS": str(tensors)}
    with Server(path, tmp_path / "state", env=env) as server:
        path.write_text(manifest(model, shard="1MiB"))
        wait_until(lambda: tensors.read_text().count("tensor") >= 2, 60, "the candidate's weights load")
        assert server.process is not None
        started = time.monotonic()
        server.process.send_signal(signal.SIGTERM)
        assert server.stop() == 0, server.stderr
        assert time.monotonic() - started < 25, server.stderr  # the whole load: 42 s; a loaded CI needs room
    assert tensors.read_text().count("tensor") < 10
    last = StateStore(tmp_path / "state").history("chat")[-1]
    assert (last.revision, last.phase, last.reason) == (
        2, "Failed", "rollout aborted before its candidate loaded: the server is stopping")
