"""One real `deploykit serve` of the tiny chat model (tests/chatmodel.py), for the tests of the APIs agents
and their SDKs talk to (/v1/chat/completions, /v1/responses, /v1/messages): each module starts one."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from chatmodel import build_chat_model
from servers import Server
from test_serve import chat_manifest

MODEL = "tiny-chat"


@contextmanager
def chat_server(tmp_path_factory: pytest.TempPathFactory, *args: str, context: int = 256) -> Iterator[Server]:
    """``deploykit serve`` of the tiny chat model as ``MODEL``; ``args``: more `serve` options; ``context``: its
    context length in tokens (one a byte)."""
    chat_model = build_chat_model(tmp_path_factory.mktemp("chat") / "model", context=context)
    root = tmp_path_factory.mktemp("serve")
    (root / "chat.yaml").write_text(chat_manifest(chat_model, name=MODEL))
    with Server(root / "chat.yaml", root / "state", *args) as s:
        yield s
