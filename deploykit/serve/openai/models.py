"""``GET /v1/models``: the deployments that serve now (id = ``metadata.name``)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from ..errors import APIError
from .protocol import ModelCard, ModelList

router = APIRouter()


def _card(name: str, dep: Any) -> ModelCard:
    gen = dep.pool.current
    return ModelCard(id=name, created=int(gen.created) if gen else 0)


@router.get("/v1/models")
async def list_models(request: Request) -> ModelList:
    items = request.app.state.registry.items()
    return ModelList(data=[_card(name, dep) for name, dep in items if dep.pool.current is not None])


@router.get("/v1/models/{name}")
async def get_model(name: str, request: Request) -> ModelCard:
    dep = request.app.state.registry.get(name)
    if dep is None or dep.pool.current is None:
        raise APIError(404, f"the model {name!r} does not exist or is not serving", param="model",
                       code="model_not_found")
    return _card(name, dep)
