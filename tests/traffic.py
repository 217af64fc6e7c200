"""Clients that keep a real `deploykit serve` busy with the official `openai` client, recording which
revision and generation answered each request (from the response headers), for the rollout tests."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import openai


@dataclass
class Load:
    """Clients sending short completions until stopped; each answer's generation (from its headers)."""

    url: str
    model: str = "smollm2"
    served: list[tuple[float, int, int]] = field(default_factory=list)  # (started, revision, generation)
    failures: list[str] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    threads: list[threading.Thread] = field(default_factory=list)

    def run(self, clients: int = 2) -> Load:
        for _ in range(clients):
            thread = threading.Thread(target=self._client, daemon=True)
            thread.start()
            self.threads.append(thread)
        return self

    def _client(self) -> None:
        client = openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=120)
        while not self.stop.is_set():
            started = time.monotonic()
            try:
                raw = client.completions.with_raw_response.create(model=self.model, prompt="Hello, my name is",
                                                                  max_tokens=2, temperature=0)
                raw.parse()
                self.served.append((started, int(raw.headers["x-deploykit-revision"]),
                                    int(raw.headers["x-deploykit-generation"])))
            except Exception as exc:  # noqa: BLE001 - counted: the test asserts there are none
                self.failures.append(repr(exc))

    def revisions_started_after(self, moment: float) -> list[int]:
        """The revisions of the answers to requests that started after ``moment`` (one started before may
        end later: a running request stays on its generation)."""
        return [r for started, r, _ in list(self.served) if started > moment]

    def join(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=120)
        assert not any(t.is_alive() for t in self.threads)
