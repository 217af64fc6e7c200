"""``GET /v1/models``: every deployment (id = ``metadata.name``), loaded in memory or not (``loaded``,
``state``): a request for an unloaded one loads it."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from ..errors import APIError
from .protocol import ModelCard, ModelList

router = APIRouter()


def _card(name: str, dep: Any) -> ModelCard:
    gen = dep.pool.current
    state = dep.status()["loaded"]
    return ModelCard(id=name, created=int(gen.created) if gen else 0, loaded=state == "loaded", state=state)


@router.get("/v1/models")
async def list_models(request: Request) -> ModelList:
    items = request.app.state.registry.items()
    return ModelList(data=[_card(name, dep) for name, dep in items])


@router.get("/v1/models/{name}")
async def get_model(name: str, request: Request) -> ModelCard:
    dep = request.app.state.registry.get(name)
    if dep is None:
        raise APIError(404, f"the model {name!r} does not exist", param="model", code="model_not_found")
    return _card(name, dep)
