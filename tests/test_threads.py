"""Every thread deploykit starts has an owner that joins it: after a supervisor that served, reloaded,
applied through its API, loaded on demand and deleted is closed, no deploykit thread is left."""

from __future__ import annotations

import threading

from deploykit.control.budget import Budget
from deploykit.control.budget.host import Host
from deploykit.control.revisions.state import StateStore
from deploykit.control.live.supervisor import Supervisor
from deploykit.spec.manifest import load_manifests
from deploykit.units import parse_size
from chatmodel import build_chat_model
from helpers import wait_until
from manifests import manifest_text, replace_like_an_editor, write_manifest


def deploykit_threads() -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("deploykit"))


def test_no_thread_is_left_after_a_supervisor_closes(model, tmp_path):
    before = deploykit_threads()
    directory = tmp_path / "served"
    directory.mkdir()
    path = write_manifest(directory, model, name="tiny")
    host = Host(Budget({"cpu": parse_size("4GiB")}, source="test"))
    supervisor = Supervisor(directory, store=StateStore(tmp_path / "state"), debounce=0.1, host=host)
    try:
        supervisor.start()
        dep = supervisor.get("tiny")
        assert dep is not None
        replace_like_an_editor(path, manifest_text(model, name="tiny", shard="100KiB"))  # a reload
        wait_until(lambda: dep.generation == 2, 90, "the reload swapped")
        api = tmp_path / "api.yaml"
        api.write_text(manifest_text(model, name="other"))
        supervisor.apply_manifest(load_manifests(api)[0])  # through the API
        with dep.acquire_loaded():
            pass
        supervisor.delete("other")
        big = build_chat_model(tmp_path / "big", hidden=256, layers=8, intermediate=1024)
        write_manifest(directory, big, name="late", shard="1MiB")  # its load is under way when the supervisor closes
        wait_until(lambda: "late" in supervisor.loading_names(), 30, "the late deployment loads")
    finally:
        supervisor.close()
    assert deploykit_threads() == before


def os_threads() -> set[str]:
    """The ids of this process's OS threads (Python's and the native ones, OpenMP's included)."""
    import os

    return set(os.listdir("/proc/self/task"))


def test_a_change_leaves_no_openmp_threads_behind():
    """A load or reshard runs parallel torch work on a deployment's change thread; the OpenMP team that
    work starts must end with the change, or the engine thread's every parallel region slows 2-3x
    (deploykit.threads.release_openmp_threads). Threads are compared by id: other tests' threads may
    come and go meanwhile."""
    import torch

    from deploykit.control.live.worker import ChangeWorker

    torch.set_num_threads(2)
    worker = ChangeWorker("openmp")
    try:
        worker.call(lambda: None)  # the change thread itself
        started: list[set[str]] = []

        def parallel_work() -> None:
            before = os_threads()
            torch.randn(1 << 20).mul_(2).sum()  # parallel: starts a team of 2
            started.append(os_threads() - before)

        worker.call(parallel_work)
        assert started[0], "the parallel operation started no thread: nothing is tested"
        wait_until(lambda: not (started[0] & os_threads()), timeout=10, what="the change's OpenMP threads ended")
    finally:
        worker.stop()


def test_release_openmp_threads_ends_the_callers_team():
    import torch

    from deploykit.threads import release_openmp_threads

    torch.set_num_threads(2)
    started: list[set[str]] = []
    done = threading.Event()

    def work() -> None:
        before = os_threads()
        torch.randn(1 << 20).mul_(2).sum()
        started.append(os_threads() - before)
        release_openmp_threads()
        done.set()

    thread = threading.Thread(target=work)
    thread.start()
    assert done.wait(30)
    assert started[0]  # the parallel operation did start a team
    wait_until(lambda: not (started[0] & os_threads()), timeout=10, what="the team ended")
    thread.join()


def test_an_idle_engine_hands_back_its_openmp_threads(tiny_model):
    """Two generations (two deployments, or a canary) each run an engine thread; an idle one's OpenMP team
    would keep GNU OpenMP from spinning for the busy one. Once its request ends, the engine's team ends."""
    import torch
    from transformers import AutoModelForCausalLM

    from deploykit.engine.batching import Engine, GenerationRequest

    torch.set_num_threads(2)
    model = AutoModelForCausalLM.from_pretrained(tiny_model("llama"), dtype=torch.float32).eval()
    engine = Engine(model, None)
    try:
        before = os_threads()
        seen: set[str] = set()

        def listen(event: object) -> None:  # called on the engine thread, its team alive
            seen.update(os_threads() - before)

        result = engine.submit(GenerationRequest(prompt_ids=list(range(3, 200)), max_new_tokens=4),
                               listener=listen).result(timeout=60)
        assert len(result.token_ids) == 4
        assert seen, "the engine started no OpenMP thread: nothing is tested"
        wait_until(lambda: not (seen & os_threads()), timeout=10, what="the idle engine's OpenMP threads ended")
    finally:
        engine.close(timeout=30)


def test_an_embedding_request_hands_back_its_openmp_threads():
    """The embedding runtime's worker thread lives as long as its generation: after each request it hands
    back the OpenMP team the forward started. Shown against ``embed`` alone, which keeps it."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    from deploykit.engine.embeddings import Pooling, embed
    from deploykit.engine.runtime import _embed_apart
    from test_serve import minilm_path

    torch.set_num_threads(2)
    model, tokenizer = AutoModel.from_pretrained(minilm_path()).eval(), AutoTokenizer.from_pretrained(minilm_path())
    texts = [f"sentence number {i} about cats and dogs and the weather" for i in range(32)]

    def left_behind(fn) -> set[str]:  # type: ignore[no-untyped-def]
        new: list[set[str]] = []
        ran, stop = threading.Event(), threading.Event()

        def work() -> None:
            before = os_threads()
            fn(model, tokenizer, texts, pooling=Pooling("mean", True), max_length=128)
            new.append(os_threads() - before)
            ran.set()
            stop.wait(30)  # alive, as the runtime's worker

        thread = threading.Thread(target=work)
        thread.start()
        try:
            assert ran.wait(60)
            wait_until(lambda: not (new[0] & os_threads()), timeout=5, what="the team ended")
            return set()
        except AssertionError:
            return new[0] & os_threads()
        finally:
            stop.set()
            thread.join()

    assert left_behind(embed), "embed alone started no OpenMP thread: nothing is tested"
    assert left_behind(_embed_apart) == set()
