"""`deploykit golden NAME --prompts FILE`: record golden references from what NAME serves now.

Each line of FILE is ``{"prompt": "..."}`` or ``{"messages": [...]}``; each is sent to the running server
greedily (temperature 0) and written out with its answer as ``"completion"``: a golden file for
``spec.rollout.gates.golden`` (docs/rollout.md), on standard output. What it records is the serving model's
own answers, so gates built on them check that a new revision still answers as today's model does (a
regression check), not that the answers are good: it says so on standard error (``NOTICE``).
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import click

from ..errors import DeploykitError
from .console import STATE_OPTION, handle_errors
from .remote import SERVER_OPTION, connect, given_cacert, opener_for


def _prompts(path: Path) -> list[dict[str, Any]]:
    items = []
    for number, raw in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            item = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise DeploykitError(f"{path}:{number}: not JSON ({exc.msg})") from None
        if not isinstance(item, dict) or ("prompt" in item) == ("messages" in item):
            raise DeploykitError(f"{path}:{number}: give exactly one of \"prompt\" and \"messages\"")
        items.append({k: item[k] for k in ("prompt", "messages") if k in item})
    if not items:
        raise DeploykitError(f"{path} holds no prompts")
    return items


def _ask(url: str, api_key: str | None, name: str, item: dict[str, Any], max_tokens: int,
         cacert: str | None) -> str:
    chat = "messages" in item
    body = {"model": name, **item, "max_tokens": max_tokens, "temperature": 0}
    request = urllib.request.Request(f"{url}/v1/{'chat/completions' if chat else 'completions'}",
                                     data=json.dumps(body).encode(), method="POST",
                                     headers={"content-type": "application/json",
                                              **({"authorization": f"Bearer {api_key}"} if api_key else {})})
    opener = opener_for(url, cacert)
    try:
        with opener.open(request, timeout=300) as response:
            answer = json.loads(response.read())
    except urllib.error.HTTPError as exc:
        raise DeploykitError(f"the server answered {exc.code}: {exc.read().decode(errors='replace')}") from None
    choice = answer["choices"][0]
    return str(choice["message"]["content"] if chat else choice["text"])


@click.command()
@click.argument("name")
@click.option("--prompts", "prompts_file", required=True, type=click.Path(exists=True, dir_okay=False,
                                                                          path_type=Path),
              help='JSON lines: {"prompt": "..."} or {"messages": [...]} per line.')
@click.option("--max-tokens", default=64, show_default=True, help="Longest completion recorded.")
@click.option("--api-key", envvar="DEPLOYKIT_API_KEY", default=None, help="The server's API key, if it has one.")
@SERVER_OPTION
@STATE_OPTION
@handle_errors
def golden(name: str, prompts_file: Path, max_tokens: int, api_key: str | None, server: str | None,
           state_dir: str | None) -> None:
    """Print golden references (JSON lines) for NAME: each prompt with what the serving generation answers,
    greedily.

    These are the serving model's own greedy answers: golden gates built on them check that a new revision
    still answers as today's model does (a regression check against it), not that the answers are right or
    good. For a quality check, write the completions yourself. Golden gates need at least 256 completion
    tokens by default (spec.rollout.gates.min_golden_tokens): give enough prompts and --max-tokens."""
    remote = None if server else connect(None, state_dir)  # the /v1 API needs no control token
    url = server or (remote.api_url if remote is not None else None)
    if url is None:
        raise DeploykitError("no deploykit server is running: start `deploykit serve`, or pass --server URL")
    url = url.rstrip("/")
    cacert = given_cacert() or (remote.cacert if remote is not None else None)
    key = api_key or os.environ.get("DEPLOYKIT_API_KEY")
    items = _prompts(prompts_file)
    for item in items:
        completion = _ask(url, key, name, item, max_tokens, cacert)
        if not completion:
            raise DeploykitError(f"the model answered {item} with nothing: a golden case needs a completion")
        click.echo(json.dumps({**item, "completion": completion}, ensure_ascii=False))
    click.echo(NOTICE.format(cases=len(items), name=name), err=True)


NOTICE = ("recorded {cases} golden references: {name}'s own greedy answers as it serves now. Gates on them check "
          "that a new revision still answers as this model does (a regression check against it), not that the "
          "answers are good.")
