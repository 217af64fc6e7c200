"""Connecting to Ray: the one place that calls ``ray.init``."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from ..errors import DeploykitError


class ClusterError(DeploykitError):
    """Ray is missing, unreachable, or refused what deploykit asked of it."""


def require_ray() -> Any:
    """The ``ray`` module (never connecting on its own: ``_no_auto_connect``), or a ClusterError saying
    how to install it."""
    os.environ["RAY_ENABLE_AUTO_CONNECT"] = "0"  # read by ray at its import: processes started from here too
    try:
        import ray
    except ImportError:
        raise ClusterError("spec.cluster needs Ray: pip install 'deploykit[ray]'") from None
    _no_auto_connect(ray)
    return ray


def _no_auto_connect(ray: Any) -> None:
    """Ray joins a cluster on the first API call of a process that is not connected (its auto-init hook),
    from whatever thread makes it, to whatever cluster it finds (or a new local one it starts). deploykit
    connects on purpose (``connect``) and leaves on purpose (``disconnect``): a Ray call after that (a
    Serve handle's router thread, a load still running) must fail, never join a cluster again. The hook
    reads RAY_ENABLE_AUTO_CONNECT once, at ray's import, so an already imported ray is switched here."""
    hook = getattr(getattr(ray, "_private", None), "auto_init_hook", None)
    if hook is not None and hasattr(hook, "enable_auto_connect"):
        hook.enable_auto_connect = False


def worker_env() -> dict[str, str]:
    """What stage and replica workers need from this process: workers inherit the raylet's environment,
    not ours, so deploykit's import path and the offline/quiet switches travel in ``runtime_env``."""
    package_root = str(Path(__file__).resolve().parents[2])
    paths = [package_root] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = {"PYTHONPATH": os.pathsep.join(dict.fromkeys(paths))}
    for key in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "TRANSFORMERS_VERBOSITY", "HF_HOME",
                "DEPLOYKIT_CACHE"):
        if key in os.environ:
            env[key] = os.environ[key]
    return env


def connect(address: str, *, num_cpus: float | None = None) -> Any:
    """Connect this process to the Ray cluster at ``address`` (``auto``, ``local``, ``HOST:PORT`` or
    ``ray://HOST:PORT``); a process already connected keeps its connection. ``local`` starts a private
    single-node Ray (no dashboard). Returns the ray module."""
    ray = require_ray()
    if ray.is_initialized():
        return ray
    kwargs: dict[str, Any] = {"runtime_env": {"env_vars": worker_env()}, "log_to_driver": False,
                              "include_dashboard": False}
    try:
        if address == "local":
            ray.init(num_cpus=num_cpus, **kwargs)
        else:
            kwargs.pop("include_dashboard")  # only meaningful when this call starts Ray
            ray.init(address=address, **kwargs)
    except Exception as exc:  # ConnectionError, RuntimeError, ValueError from Ray
        raise ClusterError(f"cannot connect to the Ray cluster at {address!r}: {exc}") from None
    return ray


def disconnect() -> None:
    """Leave the Ray cluster if this process joined it: the driver's threads stop now, not while the
    interpreter shuts down (where one of them writing to stderr once aborted the process)."""
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        _stop_serve_router_loop()
        ray.shutdown()


def _stop_serve_router_loop() -> None:
    """Stop the event loop Ray Serve runs its handles' routers on in this process, before leaving Ray.

    Ray Serve (2.60) starts that loop once per process (``SingletonThreadRouter``) with a long-poll client
    of the controller cached forever; neither stops with ``serve.shutdown()`` or ``ray.shutdown()``. A
    task of that loop touching Ray after ``ray.shutdown()`` ends the whole process ("The core worker has
    already been shutdown ... The process will exit", seen at the end of a test module). Ray has no public
    call for this, so it is done here, where deploykit owns its Ray calls; a later handle starts a new
    loop. Best effort: a Ray without these names has nothing of this to stop."""
    router = sys.modules.get("ray.serve._private.router")
    single = getattr(router, "SingletonThreadRouter", None)
    if single is None:
        return
    with single._asyncio_loop_creation_lock:
        loop, single._asyncio_loop = single._asyncio_loop, None
        monitor = getattr(single, "_event_loop_monitor", None)
        single._event_loop_monitor = None
    if loop is not None and loop.is_running():
        if monitor is not None:
            loop.call_soon_threadsafe(monitor.stop)
        loop.call_soon_threadsafe(loop.stop)
    shared = getattr(router, "SharedRouterLongPollClient", None)
    cached = getattr(getattr(shared, "get_or_create", None), "cache_clear", None)
    if cached is not None:
        cached()


def python_version_note() -> str:
    return f"python {sys.version_info.major}.{sys.version_info.minor}"
