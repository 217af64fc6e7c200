"""``GET /v1/models``: every deployment (id = ``metadata.name``), loaded in memory or not (``loaded``,
``state``): a request for an unloaded one loads it. Deployments a served file declares that are still
loading for the first time are listed too (``state: loading``); a request to one waits for its load."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from ..errors import APIError
from .protocol import ModelCard, ModelList

router = APIRouter()


def _card(name: str, dep: Any) -> ModelCard:
    gen = dep.pool.current
    state = dep.state().loaded
    return ModelCard(id=name, created=int(gen.created) if gen else 0, loaded=state == "loaded", state=state)


def _loading(registry: Any) -> list[ModelCard]:
    names: list[str] = getattr(registry, "loading_names", lambda: [])()
    return [ModelCard(id=n, created=0, loaded=False, state="loading") for n in names]


@router.get("/v1/models")
async def list_models(request: Request) -> ModelList:
    registry = request.app.state.registry
    loading = _loading(registry)  # first: a deployment is served before it stops loading
    items = registry.items()
    served = {name for name, _ in items}
    return ModelList(data=[_card(name, dep) for name, dep in items] + [c for c in loading if c.id not in served])


@router.get("/v1/models/{name}")
async def get_model(name: str, request: Request) -> ModelCard:
    registry = request.app.state.registry
    loading = {c.id: c for c in _loading(registry)}  # read first (see list_models)
    dep = registry.get(name)
    if dep is None and name in loading:
        return loading[name]
    if dep is None:
        raise APIError(404, f"the model {name!r} does not exist", param="model", code="model_not_found")
    return _card(name, dep)
