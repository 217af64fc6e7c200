"""Errors as the OpenAI API shapes them: ``{"error": {"message", "type", "param", "code"}}`` with the
status a client expects. A malformed request never gets a 500 or a traceback; an unexpected failure
is a 500 whose message says so, logged here with its traceback for the operator.
"""

from __future__ import annotations

import logging
from collections.abc import MutableMapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger(__name__)

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "invalid_request_error", 405: "invalid_request_error", 408: "invalid_request_error",
          413: "invalid_request_error", 421: "invalid_request_error", 422: "invalid_request_error",
          429: "rate_limit_error", 431: "invalid_request_error", 503: "service_unavailable"}


class APIError(Exception):
    """Raised by a route; becomes an OpenAI-shaped error response."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}


class ClientGone(Exception):
    """The client closed its connection before its answer: nobody reads it. Logged as one line and
    counted (``deploykit_client_disconnects``), never a traceback."""

    def __init__(self, model: str) -> None:
        super().__init__(model)
        self.model = model


def error_body(status: int, message: str, *, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": _TYPES.get(status, "server_error"), "param": param,
                      "code": code}}


def error_response(status: int, message: str, *, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param=param, code=code), status_code=status,
                        headers=headers)


def _param(loc: tuple[Any, ...]) -> str | None:
    parts = [str(p) for p in loc if p != "body"]
    return ".".join(parts) or None


def _validation(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    first = exc.errors()[0] if exc.errors() else {"msg": "invalid request", "loc": ()}
    if first.get("type") == "json_invalid":
        return error_response(400, "the request body is not valid JSON", code="invalid_json")
    param = _param(tuple(first.get("loc", ())))
    message = str(first.get("msg", "invalid request"))
    ctx = first.get("ctx")
    refused = ctx.get("error") if isinstance(ctx, dict) else None
    if getattr(refused, "param", None):  # a refusal about one field, raised by a model-level check
        param, message = str(getattr(refused, "param")), str(refused)
    elif first.get("type") == "extra_forbidden":
        message = ("deploykit does not implement this field, and refuses fields it cannot honour rather than "
                   "answer a different question (docs/serving.md lists every field)")
    if len(exc.errors()) > 1:
        message += f" (and {len(exc.errors()) - 1} more problem(s))"
    return error_response(400, f"{param}: {message}" if param else message, param=param, code="invalid_value")


def _api(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    return error_response(exc.status, exc.message, param=exc.param, code=exc.code, headers=exc.headers)


def _http(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    message = "no such route" if exc.status_code == 404 else str(exc.detail)
    return error_response(exc.status_code, message, headers=getattr(exc, "headers", None))


def client_gone(scope: MutableMapping[str, Any], model: str, *, streamed: bool) -> None:
    """One log line and one count for a client that left before its answer ended."""
    app = scope.get("app")
    metrics = getattr(getattr(app, "state", None), "metrics", None)
    if metrics is not None:
        metrics.client_disconnects.labels(model).inc()
    what = "stream" if streamed else "answer"
    log.info("%s: the client closed its connection before its %s ended; the request was cancelled", model, what)


def _gone(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ClientGone)
    client_gone(request.scope, exc.model, streamed=False)
    # 499 (nginx's "client closed request"): nobody receives it, but an access log shows what happened
    return error_response(499, "the client closed the connection", code="client_closed_request")


def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    log.exception("%s %s failed", request.method, request.url.path)
    return error_response(500, f"internal error ({type(exc).__name__}); the server logged the details",
                          code="internal_error")


def install_handlers(app: FastAPI) -> None:
    app.add_exception_handler(RequestValidationError, _validation)
    app.add_exception_handler(APIError, _api)
    app.add_exception_handler(ClientGone, _gone)
    app.add_exception_handler(StarletteHTTPException, _http)
    app.add_exception_handler(Exception, _unexpected)
