"""deploykit on the machine's own transformers, without the carried one: ``deploykit plan`` and ``deploykit
apply`` (load and health check, on the CPU) of a tiny model. deploykit's suite runs a newer transformers than
the GPU machine has; this says whether deploykit works on what the machine has. In the dry run the two are
the same environment."""

from __future__ import annotations

import subprocess
import sys

from .. import manifests, models
from ..context import Context
from ..record import Recorder


def run(ctx: Context, rec: Recorder) -> None:
    version = subprocess.run([sys.executable, "-c", "import transformers; print(transformers.__version__)"],
                             env=ctx.env(machine=True), capture_output=True, text=True, timeout=60)
    rec.metric("transformers", version.stdout.strip() or version.stderr.strip()[-300:])
    rec.note("transformers without the carried wheel", version.stdout.strip() or "import failed")
    source = ctx.work / "models" / "machine-tiny"
    models.build("smollm2-135m", source, tiny=True, device="cpu", dtype="float32")
    spec = manifests.Spec(name="machine-transformers", model=source, dtype="float32")
    path = manifests.write(spec, ctx.work / "manifests", shards=ctx.work / "shards")
    for verb in (("plan", str(path), "-o", "json"), ("apply", str(path), "-q")):
        done = ctx.deploykit(*verb, timeout=120, state=ctx.work / "state-machine", machine=True)
        rec.expect(f"deploykit {verb[0]} on transformers {version.stdout.strip()}", done.returncode == 0,
                   f"exit {done.returncode}" + (f": {done.stderr.strip()[-500:]}" if done.returncode else ""))
