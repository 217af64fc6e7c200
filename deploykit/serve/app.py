"""``create_app``: the ASGI application of ``deploykit serve`` (the OpenAI-compatible API and the ops
endpoints), for uvicorn or for mounting in a user's own ASGI service:

    from deploykit import Deployment
    from deploykit.serve.app import Deployments, create_app

    dep = Deployment.from_manifest("manifests/chat.yaml", watch=True)
    app = create_app(Deployments([dep]), api_key="secret")     # uvicorn.run(app), or mount it

The app only queues and streams: model work runs on each generation's own threads.
"""

from __future__ import annotations

from collections.abc import Iterable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI
from starlette.types import Receive, Scope, Send

from ..control.live.status import not_ready
from . import ops
from . import sources as source_routes
from .auth import BODY_TIMEOUT, DEFAULT_MAX_BODY, Guard
from .errors import error_response, install_handlers
from .metrics import new_registry
from .openai import chat, completions, embeddings, models
from .openai.messages import route as messages
from .openai.messages.wire import AnthropicWire
from .openai.responses import route as responses
from .openai.common import Registry
from .openai.stream import SEND_TIMEOUT
from .served_by import ServedBy

if TYPE_CHECKING:
    from ..control.live.deployment import Deployment
    from ..control.sources.worker import Sources


class Deployments:
    """A fixed set of ``Deployment`` objects as a registry (for embedding the API)."""

    def __init__(self, deployments: Iterable[Deployment]) -> None:
        self._by_name = {d.name: d for d in deployments}

    def get(self, name: str) -> Deployment | None:
        return self._by_name.get(name)

    def loading_names(self) -> list[str]:
        return []

    def items(self) -> list[tuple[str, Deployment]]:
        return list(self._by_name.items())

    def when_served(self, name: str) -> Future[None]:
        done: Future[None] = Future()
        done.set_result(None)  # a fixed set: nothing loads later
        return done

    def why_not_served(self, name: str) -> str | None:
        return None

    def ready(self) -> tuple[bool, list[str]]:
        missing = not_ready([d.state() for d in self._by_name.values()])  # the supervisor's rule
        return not missing and bool(self._by_name), missing

    def statuses(self) -> list[dict[str, Any]]:
        return [d.status() for d in self._by_name.values()]


def create_app(registry: Registry, *, api_key: str | None = None, max_body: int = DEFAULT_MAX_BODY,
               control_token: str | None = None, openapi: bool = False,
               allowed_hosts: frozenset[str] | None = None, body_timeout: float = BODY_TIMEOUT,
               stream_send_timeout: float = SEND_TIMEOUT, sources: Sources | None = None) -> AnthropicWire:
    """The API over ``registry`` (a ``Supervisor`` or ``Deployments``). ``api_key``: required bearer key.
    ``control_token``: serve the control API (``/control/v1``, docs/control.md) behind this bearer token;
    the registry must then be a ``Supervisor``, whose policy (``control/admission.py``) every manifest it
    takes is admitted under. Without it, ``/control/...`` answers 401. ``openapi``: serve ``/openapi.json``
    (behind the API key, if any; off by default: it maps every route for whoever asks).
    ``allowed_hosts``/``body_timeout``: ``auth.Guard``'s.
    ``stream_send_timeout``: seconds a stream waits for its client to take a chunk (``openai.stream``).
    ``sources``: the git sources the server follows (``/sources``, their sync and webhook routes).
    Outermost, ``AnthropicWire`` gives ``/v1/messages`` Anthropic's key header and error shape."""
    from .. import __version__

    app = FastAPI(title="deploykit", version=__version__, docs_url=None, redoc_url=None,
                  openapi_url="/openapi.json" if openapi else None)
    app.state.registry = registry
    app.state.stream_send_timeout = stream_send_timeout
    app.state.sources = sources
    app.state.prometheus, app.state.metrics = new_registry(registry, sources)
    install_handlers(app)
    for module in (models, chat, completions, responses, messages, embeddings, ops, source_routes):
        app.include_router(module.router)
    if control_token:
        from . import control

        app.include_router(control.router)
        app.include_router(source_routes.control_router)
    return AnthropicWire(Guard(ServedBy(app), api_key=api_key, max_body=max_body, control_token=control_token,
                               allowed_hosts=allowed_hosts, body_timeout=body_timeout))


class WithoutControl:
    """The app on the network listener when the control API has a listener of its own
    (``--control-socket``): ``/control`` and ``/control/*`` answer 404 here, whatever the credential, as if
    the route did not exist; everything else is ``app``'s."""

    def __init__(self, app: AnthropicWire) -> None:
        self.app = app

    @property
    def stopping(self) -> bool:
        return self.app.stopping

    @stopping.setter
    def stopping(self, value: bool) -> None:  # set by the server on SIGTERM (auth.Guard's)
        self.app.stopping = value

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] == "http" and (path == "/control" or path.startswith("/control/")):
            await error_response(404, "no such route")(scope, receive, send)
            return
        await self.app(scope, receive, send)
