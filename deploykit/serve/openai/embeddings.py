"""``POST /v1/embeddings``: vectors from a feature-extraction deployment, pooled as its checkpoint says."""

from __future__ import annotations

import asyncio
import base64
import struct
from typing import Any

from fastapi import APIRouter, Request

from ..errors import APIError
from ..served_by import mark
from .common import find, lease
from .protocol import EmbeddingRequest

router = APIRouter()


def _encode(vector: list[float], fmt: str) -> list[float] | str:
    if fmt == "base64":  # what the openai client asks for by default: little-endian float32
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
    return vector


def _texts(body: EmbeddingRequest, runtime: Any) -> list[str]:
    """The inputs as text: at least one, at most the model's limit, token ids in its vocabulary."""
    items = body.texts()
    if not items:
        raise APIError(400, "input must not be empty", param="input")
    if len(items) > runtime.limits.max_input_items:
        raise APIError(400, f"{len(items)} inputs in one request; this model takes at most "
                       f"{runtime.limits.max_input_items} (spec.serving.max_input_items)", param="input")
    vocab = len(runtime.tokenizer)
    bad = next((t for i in items if not isinstance(i, str) for t in i if not 0 <= t < vocab), None)
    if bad is not None:
        raise APIError(400, f"token id {bad} is not in this model's vocabulary (0 to {vocab - 1})", param="input",
                       code="invalid_token_id")
    texts = [i if isinstance(i, str) else str(runtime.tokenizer.decode(i)) for i in items]
    if any(not text for text in texts):
        raise APIError(400, "input must not contain empty strings", param="input")
    return texts


@router.post("/v1/embeddings", response_model=None)
async def embeddings(body: EmbeddingRequest, request: Request) -> Any:
    state = request.app.state
    dep = await find(state.registry, body.model)
    held = await lease(dep, "embedding")
    mark(request, held.gen)
    try:
        gen = held.gen
        runtime: Any = gen.runtime
        items = _texts(body, runtime)
        if body.dimensions is not None:
            raise APIError(400, "dimensions is not supported: this model's vectors have a fixed size",
                           param="dimensions", code="unsupported")
        vectors, tokens = await asyncio.wrap_future(runtime.submit(items))
        state.metrics.embedding_inputs.labels(dep.name, str(gen.number)).inc(len(items))
        state.metrics.prompt_tokens.labels(dep.name, str(gen.number)).inc(tokens)
    finally:
        held.release()
    return {"object": "list", "model": dep.name,
            "data": [{"object": "embedding", "index": i, "embedding": _encode(v, body.encoding_format)}
                     for i, v in enumerate(vectors)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
