"""A small HTTP embedding service that embeds a deploykit Deployment and keeps answering while its
manifest changes.

    python examples/service.py manifests/minilm.yaml --port 8080
    curl -s localhost:8080/embed -d '{"sentences": ["hello world", "good morning"]}'
    curl -s localhost:8080/info

Edit manifests/minilm.yaml (move the CPU/disk boundary, change the shard size) while requests run:
the watcher reloads the model beside the old one and swaps it in; every request is answered by a
complete generation, old or new. A broken edit changes nothing for callers; /info shows the error.
Standard library HTTP only; requires a model with a tokenizer (feature-extraction).
"""

from __future__ import annotations

import argparse
import json
import signal
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch

from deploykit import Deployment


def embed(dep: Deployment, sentences: list[str]) -> tuple[list[list[float]], int]:
    """Mean-pooled, normalised sentence embeddings, and the generation that computed them."""
    with dep.acquire_loaded() as loaded, torch.no_grad():
        generation = dep.generation
        batch = loaded.tokenizer(sentences, padding=True, truncation=True, return_tensors="pt")
        batch = {k: v.to(loaded.input_device) for k, v in batch.items()}
        hidden = loaded.model(**batch).last_hidden_state
        mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        vectors = torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1)
    return vectors.float().tolist(), generation


def make_handler(dep: Deployment) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def _reply(self, code: int, payload: dict) -> None:
            body = json.dumps(payload).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:  # noqa: N802
            if self.path == "/info":
                self._reply(200, dep.status())
            else:
                self._reply(404, {"error": "not found"})

        def do_POST(self) -> None:  # noqa: N802
            if self.path != "/embed":
                self._reply(404, {"error": "not found"})
                return
            try:
                request = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                sentences = request["sentences"]
                if not isinstance(sentences, list) or not all(isinstance(s, str) for s in sentences):
                    raise ValueError("'sentences' must be a list of strings")
            except (ValueError, KeyError) as exc:
                self._reply(400, {"error": f"bad request: {exc}"})
                return
            vectors, generation = embed(dep, sentences)
            self._reply(200, {"embeddings": vectors, "generation": generation})

        def log_message(self, format: str, *args: object) -> None:
            pass

    return Handler


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("manifest")
    parser.add_argument("--port", type=int, default=8080)
    args = parser.parse_args()
    dep = Deployment.from_manifest(args.manifest, watch=True)
    server = ThreadingHTTPServer(("127.0.0.1", args.port), make_handler(dep))
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    threading.Thread(target=server.serve_forever, daemon=True).start()
    print(f"serving {dep.name} generation {dep.generation} on http://127.0.0.1:{args.port}", flush=True)
    stop.wait()
    server.shutdown()
    dep.close()
    print("stopped", flush=True)


if __name__ == "__main__":
    main()
