"""The git sources of ``deploykit serve --source``: their status (``GET /control/v1/sources``, and
``/sources`` beside ``/status``), a sync now (``POST /control/v1/sources/NAME/sync``, the control token's),
and the push webhook (``POST /hooks/sources/NAME``), which needs no token but the source's webhook secret:
GitHub's ``X-Hub-Signature-256`` (HMAC-SHA256 of the body) or GitLab's ``X-Gitlab-Token``. A missing
signature is 401, a wrong one 403; a right one asks the source's thread to sync and answers 202 at once.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from ..files import read_regular_file
from .errors import error_response

if TYPE_CHECKING:
    from ..control.sources.worker import SourceSync, Sources

control_router = APIRouter(prefix="/control/v1")
router = APIRouter()
WEBHOOK_PREFIX = "/hooks/"
MAX_SECRET_FILE = 64 << 10


def _sources(request: Request) -> Sources | None:
    return getattr(request.app.state, "sources", None)


def _source(request: Request, name: str) -> SourceSync | None:
    sources = _sources(request)
    return sources.get(name) if sources is not None else None


async def _statuses(request: Request) -> list[dict[str, Any]]:
    sources = _sources(request)
    return await run_in_threadpool(sources.statuses) if sources is not None else []


@router.get("/sources")
async def sources_status(request: Request) -> Any:
    return await _statuses(request)


@control_router.get("/sources")
async def control_sources(request: Request) -> Any:
    return await _statuses(request)


@control_router.post("/sources/{name}/sync")
async def sync(request: Request, name: str) -> Any:
    source = _source(request, name)
    if source is None:
        return error_response(404, f"no git source named {name!r}", code="not_found")
    source.sync_now()
    return JSONResponse({"source": name, "sync": "requested"}, status_code=202)


@router.post(WEBHOOK_PREFIX + "sources/{name}")
async def webhook(request: Request, name: str) -> Any:
    source = _source(request, name)
    hook = source.source.spec.webhook if source is not None else None
    if source is None or hook is None:
        return error_response(404, f"no git source named {name!r} with a webhook", code="not_found")
    try:
        secret = read_regular_file(hook.secret_file, MAX_SECRET_FILE).strip()
    except OSError:
        return error_response(503, "the webhook secret cannot be read", code="webhook_unavailable")
    if not secret:  # an empty key: anyone could sign with it
        return error_response(503, "the webhook secret file is empty", code="webhook_unavailable")
    status = _check(secret, await request.body(), request.headers.get("x-hub-signature-256"),
                    request.headers.get("x-gitlab-token"))
    if status is not None:
        return error_response(status, "missing webhook signature" if status == 401 else "wrong webhook signature",
                              code="invalid_signature")
    source.sync_now()
    return JSONResponse({"source": name, "sync": "requested"}, status_code=202)


def _check(secret: bytes, body: bytes, github: str | None, gitlab: str | None) -> int | None:
    """None when a signature is right; 401 when none is given, 403 when it is wrong."""
    if github is not None:
        want = "sha256=" + hmac.new(secret, body, hashlib.sha256).hexdigest()
        return None if hmac.compare_digest(want.encode(), github.encode()) else 403
    if gitlab is not None:
        return None if hmac.compare_digest(secret, gitlab.encode()) else 403
    return 401
