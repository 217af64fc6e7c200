"""Schema fuzzing of a real `deploykit serve`: schemathesis reads the server's own /openapi.json and sends
what the schema allows and what it does not (its coverage and fuzzing phases, seeded) to every route of
/v1 and /control/v1. No request may get a 5xx or a stream cut short, and the server's log must hold no
traceback: bad input is a 4xx that says why (a client that goes away is one log line, never a traceback).

Bounded to about a minute on two cores (``MAX_EXAMPLES`` per route); tests/fuzz_hooks.py points the
bodies at the served models in turn, so that generation and embeddings run too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from chatmodel import build_chat_model
from servers import Server
from test_serve import chat_manifest, embed_manifest, minilm_path

pytest.importorskip("schemathesis", reason="the test extra (schemathesis) is not installed")

TOKEN = "control-token-for-the-fuzz-run"
MAX_EXAMPLES = 600
SEED = 1
HOOKS = Path(__file__).parent / "fuzz_hooks.py"


def fuzz(url: str, report: Path) -> subprocess.CompletedProcess[str]:
    """schemathesis's own command (it keeps a cache in its working directory: the report's, not the repo)."""
    command = [sys.executable, "-m", "schemathesis.cli", "run", f"{url}/openapi.json",
               "--header", f"Authorization: Bearer {TOKEN}", "--checks", "not_a_server_error,streams_end_with_done",
               "--max-examples", str(MAX_EXAMPLES), "--seed", str(SEED), "--workers", "1", "--no-shrink",
               "--generation-database", "none", "--request-timeout", "60", "--no-color",
               "--report", "json", "--report-json-path", str(report)]
    return subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=report.parent,
                          env={**os.environ, "SCHEMATHESIS_HOOKS": str(HOOKS)})


@pytest.mark.fuzz
def test_schema_fuzzing_gets_no_5xx_no_cut_stream_and_no_traceback(tmp_path):
    (tmp_path / "manifests").mkdir()
    serving = "{max_tokens: 16, default_max_tokens: 8, max_input_items: 16}"
    (tmp_path / "manifests" / "chat.yaml").write_text(
        chat_manifest(build_chat_model(tmp_path / "chat"), serving=serving))
    (tmp_path / "manifests" / "minilm.yaml").write_text(embed_manifest(minilm_path()))
    report = tmp_path / "fuzz.json"
    with Server(tmp_path / "manifests", tmp_path / "state", "--control-token", TOKEN, "--openapi") as server:
        started = time.monotonic()
        result = fuzz(server.url, report)
        seconds = time.monotonic() - started
    run = json.loads(report.read_text())
    cases = run["test_cases"]
    print(f"schema fuzzing: {cases['generated']} requests in {seconds:.0f} s, {cases['with_failures']} failed")
    assert result.returncode == 0 and cases["with_failures"] == 0 and not run["errors"], result.stdout[-8000:]
    assert cases["generated"] >= 5 * MAX_EXAMPLES and run["operations"]["tested"] == run["operations"]["total"]
    assert "Traceback" not in server.stderr and "Exception in ASGI application" not in server.stderr, \
        server.stderr[-20000:]
