"""A ``ray.cluster_utils.Cluster`` of fake nodes for tests, and a client that keeps asking through a rollout."""

from __future__ import annotations

import threading
from typing import Any

import openai


def fake_cluster(request: Any, node: dict[str, Any], *, connect: bool = False) -> Any:
    """A head without CPUs and two worker nodes shaped ``node``, shut down when the module's tests end;
    ``connect``: this process joins it (for tests that drive Ray directly)."""
    import ray
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    c = Cluster(initialize_head=True, head_node_args={**node, "num_cpus": 0})

    def stop() -> None:
        from deploykit.cluster.ray_env import disconnect

        disconnect()  # stops Ray Serve's router loop of this process first (see there)
        c.shutdown()

    request.addfinalizer(stop)
    c.add_node(**node)
    c.add_node(**node)
    c.wait_for_nodes()
    if connect:
        from deploykit.cluster.ray_env import connect as join

        join(c.address)
    return c


class Asker:
    """One client completing ``prompt`` on ``model`` without pause until stopped; every failure is kept."""

    def __init__(self, url: str, model: str, prompt: str = "hello", max_tokens: int = 8) -> None:
        self.client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
        self.model, self.prompt, self.max_tokens = model, prompt, max_tokens
        self.stop, self.texts, self.failures = threading.Event(), [], []  # type: ignore[var-annotated]
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                self.texts.append(self.client.completions.create(
                    model=self.model, prompt=self.prompt, max_tokens=self.max_tokens,
                    temperature=0).choices[0].text)
            except Exception as exc:  # every failure counts
                self.failures.append(repr(exc))

    def __enter__(self) -> Asker:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(60)
