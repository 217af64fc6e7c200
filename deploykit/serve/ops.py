"""Operations endpoints: ``/healthz`` (the process runs), ``/readyz`` (every deployment can serve),
``/status`` (one object per deployment) and ``/metrics`` (Prometheus text).

``/readyz`` needs no credential, so it says only ready or not; what is not ready (manifest paths, load
errors, engine logs) is said to the control token's holder alone (``auth.Guard`` marks such requests)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.concurrency import run_in_threadpool

router = APIRouter()


@router.get("/healthz")
async def healthz() -> dict[str, bool]:
    return {"ok": True}


@router.get("/readyz")
async def readyz(request: Request) -> JSONResponse:
    ok, missing = await run_in_threadpool(request.app.state.registry.ready)
    answer: dict[str, Any] = {"ready": ok}
    if request.scope.get("state", {}).get("control"):
        answer["not_ready"] = missing
    return JSONResponse(answer, status_code=200 if ok else 503)


@router.get("/status")
async def status(request: Request) -> Any:
    return await run_in_threadpool(request.app.state.registry.statuses)  # reads the state store


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    body = await run_in_threadpool(generate_latest, request.app.state.prometheus)
    return Response(body, media_type=CONTENT_TYPE_LATEST)
