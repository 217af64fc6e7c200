"""``GET /v1/models``: every deployment (id = ``metadata.name``), loaded in memory or not (``loaded``,
``state``): a request for an unloaded one loads it. The LoRA adapters a loaded deployment serves are listed
as ``<deployment>:<adapter>`` with ``parent``: the deployment. Deployments a served file declares that are still
loading for the first time are listed too (``state: loading``); a request to one waits for its load."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from ..errors import APIError
from .common import model_parts
from .protocol import ModelCard, ModelList

router = APIRouter()


def _cards(name: str, dep: Any) -> list[ModelCard]:
    """The deployment and the LoRA adapters its serving generation serves (each as ``<deployment>:<adapter>``),
    from one snapshot of it (``Deployment.state``)."""
    snap = dep.state()
    created = int(snap.created or 0)
    card = ModelCard(id=name, created=created, loaded=snap.loaded == "loaded", state=snap.loaded)
    return [card, *(ModelCard(id=f"{name}:{a.name}", created=created, parent=name) for a in snap.adapters or [])]


def _loading(registry: Any) -> list[ModelCard]:
    names: list[str] = getattr(registry, "loading_names", lambda: [])()
    return [ModelCard(id=n, created=0, loaded=False, state="loading") for n in names]


@router.get("/v1/models")
async def list_models(request: Request) -> ModelList:
    registry = request.app.state.registry
    loading = _loading(registry)  # first: a deployment is served before it stops loading
    items = registry.items()
    served = {name for name, _ in items}
    cards = [card for name, dep in items for card in _cards(name, dep)]
    return ModelList(data=cards + [c for c in loading if c.id not in served])


@router.get("/v1/models/{name}")
async def get_model(name: str, request: Request) -> ModelCard:
    registry = request.app.state.registry
    loading = {c.id: c for c in _loading(registry)}  # read first (see list_models)
    base, adapter = model_parts(name)
    if adapter is not None:
        card = next((c for c in _cards(base, dep)[1:] if c.id == name), None) if (dep := registry.get(base)) else None
        if card is None:
            raise APIError(404, f"the model {name!r} does not exist", param="model", code="model_not_found")
        return card
    dep = registry.get(name)
    if dep is None and name in loading:
        return loading[name]
    if dep is None:
        raise APIError(404, f"the model {name!r} does not exist", param="model", code="model_not_found")
    return _cards(name, dep)[0]
