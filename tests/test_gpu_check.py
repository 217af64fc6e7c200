"""The GPU check (gpucheck/, docs/gpu.md) keeps working where no GPU is: its dry run runs every step that
needs no CUDA and writes the report; its runner stops a hung check with everything it started; the wheels it
carries are checked for requirements nobody brings."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # gpucheck is a folder of the repository, not part of the installed package

from gpucheck import models, wheels  # noqa: E402
from gpucheck.checks import CHECKS  # noqa: E402
from gpucheck.runner import _wait  # noqa: E402

BAD = {"fail", "error", "timeout"}


@pytest.mark.slow
def test_dry_run_runs_every_check_and_writes_the_report(tmp_path: Path) -> None:
    out = tmp_path / "out"
    start = time.monotonic()
    command = [sys.executable, "-m", "gpucheck", "--dry", "--out", str(out), "--work", str(tmp_path / "work"),
               "--wheels", str(tmp_path / "no-wheels")]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    seconds = time.monotonic() - start
    report = json.loads((out / "gpu-check.json").read_text())
    assert done.returncode == 0, (done.stdout[-2000:], report["summary"])
    assert report["mode"] == "dry" and report["machine"] == "no CUDA device (dry run)"
    assert list(report["summary"]) == [c.name for c in CHECKS]
    assert not {name for name, status in report["summary"].items() if status in BAD}
    assert report["summary"]["llamacpp"] == "skipped"
    # the parts that need no GPU ran: placement, answers, budget moves, quantized speed
    ran = {c["name"]: [s["name"] for s in c["steps"] if s["status"] == "pass"] for c in report["checks"]}
    assert "the plan uses GPU 0, the CPU and the disk" in ran["apply_tiers"]
    assert "logits equal accelerate's (relative error <= 1e-2)" in ran["apply_tiers"]
    assert "a request to the second evicts the first" in ran["budget"]
    assert any("concurrent answers equal generate's" in s for s in ran["serve_exact"])
    assert {"int8: finite logits", "int4: finite logits"} <= set(ran["quantized"])
    markdown = (out / "gpu-check.md").read_text()
    assert "| serve_exact:" in markdown and "mode: dry" in markdown
    assert (out / "gpu-check-logs.txt").stat().st_size > 0
    assert seconds < report["deadline_s"]


def test_a_check_past_its_limit_is_stopped_with_what_it_started(tmp_path: Path) -> None:
    pid_file = tmp_path / "grandchild.pid"
    script = ("import subprocess, sys, time; "
              "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
              f"open({str(pid_file)!r}, 'w').write(str(p.pid)); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", script], start_new_session=True)
    while not pid_file.exists() or not pid_file.read_text():
        time.sleep(0.05)
    start = time.monotonic()
    assert _wait(proc, 0.5) is True
    assert time.monotonic() - start < 15
    grandchild = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while _alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(grandchild)  # a server the check started goes with it
    assert proc.returncode == -signal.SIGTERM


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state not in ("Z", "X")  # a zombie has ended; only its exit status waits to be collected


def test_every_token_of_the_check_models_decodes_to_its_own_character() -> None:
    config = models.config_dict("smollm2-135m", tiny=False)
    vocab, special = models.vocabulary(config)
    assert sorted(vocab.values()) == list(range(config["vocab_size"]))
    assert special["<s>"] == config["bos_token_id"] and special["</s>"] == config["eos_token_id"]
    assert all(len(token) == 1 for token in vocab if token not in special)
    assert models.characters(300)[:3] == ["\n", " ", "!"]


def _wheel(directory: Path, name: str, version: str, requires: list[str]) -> Path:
    path = directory / f"{name}-{version}-py3-none-any.whl"
    meta = "\n".join([f"Name: {name}", f"Version: {version}", *(f"Requires-Dist: {r}" for r in requires)])
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{name}-{version}.dist-info/METADATA", meta)
    return path


def test_carried_wheels_need_nothing_that_is_neither_carried_nor_there(tmp_path: Path) -> None:
    carried = [_wheel(tmp_path, "fastapi", "1.0", ["starlette>=2", "anyio", "rich; extra == 'all'",
                                                   "tomli; python_version < '3.11'"]),
               _wheel(tmp_path, "starlette", "1.5", ["anyio"]), _wheel(tmp_path, "openai", "3.0", ["httpx2"])]
    problems = wheels.unmet(carried, device={"anyio"})
    assert problems == ["fastapi-1.0-py3-none-any.whl needs starlette>=2; 1.5 is carried",
                        "openai-3.0-py3-none-any.whl needs httpx2: neither carried nor on the GPU machine"]


def test_the_pinned_wheels_fit_together() -> None:
    pins = wheels.pins()
    assert len(pins) == len(wheels.read_list(wheels.HERE / "wheels.txt"))  # one version of each
    assert {"pydantic", "fastapi", "uvicorn", "watchdog", "gguf", "openai"} <= set(pins)
    device = {wheels.normalise(n) for n in wheels.read_list(wheels.HERE / "device-packages.txt")}
    newer = {"typing-extensions"} | wheels.OVERRIDES  # what the machine has, at a version deploykit cannot use
    assert set(pins) & device == newer  # everything else is carried because the machine lacks it
