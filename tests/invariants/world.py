"""What every sequence of the model-based test draws from: two tiny real chat models, real PEFT adapters
trained on the first, copies broken in ways a user meets (a shard whose data is NaN, a missing shard, an
adapter whose config says another rank, an adapter asking for PiSSA initialisation), the manifests ``Spec``
renders, what a change of one to another must do (``expect``), and the reference answers (peft's own greedy
``generate``), computed once per distinct model content."""

from __future__ import annotations

import json
import shutil
import threading
from dataclasses import dataclass, replace
from pathlib import Path

from chatmodel import GOLDEN, build_chat_model
from lora import chat_ids, peft_reference, train_adapter

NAME = "chat"
PROMPT = "hi"
TOKENS = 8  # greedy tokens per request: enough to tell models apart, cheap on 2 cores
BASES = ("base", "base2", "nan", "missing")  # the last two cannot serve
ADAPTERS = ("pirate", "polite", "pirate2", "rank", "pissa")  # pirate2: pirate retrained (a changed adapter)
GOOD_ADAPTERS = ("pirate", "polite", "pirate2")
STRATEGIES = ("auto", "recreate", "blue-green", "canary")
# a canary's golden gate reads chatmodel.GOLDEN (~330 tokens, one per byte), scored by both generations: the
# same weights agree on every position, other random weights on almost none


@dataclass(frozen=True)
class Spec:
    """One manifest of the deployment ``chat``, as the generator varies it."""

    base: str = "base"
    quant: str = "none"  # none | int8
    strategy: str = "auto"
    adapters: tuple[tuple[str, str], ...] = ()  # (served name, adapter directory key), sorted by name
    max_tokens: int = 32
    shard: str = "2GiB"  # 2GiB: served from the model's own directory; 300KiB: laid out under shards/
    schema_broken: bool = False
    on_demand: bool = False  # lifecycle load: on-demand, keep_alive 1s (under a budget)
    speculative: bool = False  # spec.speculative: ngram drafts (greedy answers must not change)

    def ops(self) -> set[str]:
        """The operation names this manifest exercises (``config.KNOWN_OPEN`` leaves some out)."""
        out = {f"base_{self.base}", f"strategy_{self.strategy}", f"shard_{self.shard}"}
        out |= {f"adapter_{key}" for _, key in self.adapters}
        if self.quant != "none":
            out.add(f"quant_{self.quant}")
        if self.schema_broken:
            out.add("schema_broken")
        if self.on_demand:
            out.add("on_demand")
        if self.speculative:
            out.add("speculative")
        if self.adapters and self.strategy == "recreate":
            out.add("recreate_adapters")
        if self.base in ("nan", "missing"):
            out.add(f"{self.strategy}_{self.base}")  # e.g. recreate_nan: a recreate whose load fails
        return out

    def servable(self) -> bool:
        """Whether this manifest can serve at all (alone, whatever served before)."""
        return (not self.schema_broken and self.base in ("base", "base2")
                and all(key in GOOD_ADAPTERS for _, key in self.adapters)  # pissa, rank: refused at validate
                and not (self.adapters and self.quant != "none")
                and not (self.adapters and self.strategy == "canary"))  # adapters are never canaried

    def same_weights(self, other: Spec) -> bool:
        return self.base == other.base and self.quant == other.quant


def expect(new: Spec, serving: Spec) -> str:
    """What applying ``new`` over ``serving`` must do: "ok" (it serves), "fail" (refused or failed; what
    served still serves), or "either" (a choice deploykit may make either way; the invariants decide)."""
    if not new.servable():
        return "fail"
    if new.strategy == "canary" and not new.same_weights(serving):
        # the golden gate: other random weights disagree; quantized ones may or may not reach 0.9
        return "fail" if new.base != serving.base else "either"
    return "ok"


class World:
    """The files every sequence uses (built once; never changed by the test: I7 checks deploykit does not
    change them either) and their reference answers."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.models = {"base": build_chat_model(root / "base"), "base2": build_chat_model(root / "base2", seed=1)}
        self.models["nan"] = _nan_copy(self.models["base"], root / "nan")
        self.models["missing"] = _missing_copy(self.models["base"], root / "missing")
        base = self.models["base"]
        self.adapters = {
            "pirate": train_adapter(base, root / "pirate", text="user: hi\nassistant: arr matey arr matey arr"),
            "polite": train_adapter(base, root / "polite", text="user: hi\nassistant: good day sir, good day", seed=1),
            "pirate2": train_adapter(base, root / "pirate2", text="user: hi\nassistant: yo ho ho yo ho ho", seed=2)}
        self.adapters["rank"] = _config_copy(self.adapters["pirate"], root / "rank", r=8)
        self.adapters["pissa"] = _config_copy(self.adapters["pirate"], root / "pissa", init_lora_weights="pissa")
        self.golden = root / "golden.jsonl"
        self.golden.write_text("".join(json.dumps(c) + "\n" for c in GOLDEN))
        self._refs: dict[tuple[str, str | None], str] = {}
        self._lock = threading.Lock()

    def reference(self, base: str, adapter: str | None) -> str:
        """peft's greedy answer to PROMPT of ``base`` with the adapter ``adapter`` (a key; None: the base)."""
        with self._lock:
            key = (base, adapter)
            if key not in self._refs:
                model = self.models[base]
                self._refs[key] = peft_reference(model, self.adapters[adapter] if adapter else None,
                                                 chat_ids(model, PROMPT), TOKENS)
            return self._refs[key]

    def manifest(self, spec: Spec, name: str = NAME) -> str:
        """The manifest text of ``spec`` (deployment ``name``)."""
        model = "modle" if spec.schema_broken else "model"  # a typo: a schema error at its line
        text = (f"apiVersion: deploykit/v1\nkind: ModelDeployment\nmetadata: {{name: {name}}}\nspec:\n"
                f"  {model}: {{path: {self.models[spec.base]}, dtype: float32"
                + (f", quantization: {spec.quant}" if spec.quant != "none" else "") + "}\n"
                f"  placement: {{gpus: []}}\n  sharding: {{max_shard_size: {spec.shard}, path: shards}}\n"
                f"  serving: {{max_tokens: {spec.max_tokens}, max_concurrent: 8, prefix_cache: {{enabled: false}}}}\n")
        text += f"  rollout:\n    strategy: {spec.strategy}\n"
        if spec.strategy == "canary":
            text += ("    canary: {steps: [50, 100], step_seconds: 0.2s, min_requests: 0}\n"
                     f"    gates: {{golden: {self.golden}, min_top1_agreement: 0.9}}\n")
        if spec.on_demand:
            text += "  lifecycle: {load: on-demand, keep_alive: 1s}\n"
        if spec.speculative:
            text += "  speculative: {method: ngram, num_tokens: 4}\n"
        if spec.adapters:
            text += "  adapters:\n" + "".join(f"    - {{name: {n}, path: {self.adapters[k]}}}\n"
                                              for n, k in spec.adapters)
        return text


def with_adapters(spec: Spec, adapters: dict[str, str]) -> Spec:
    return replace(spec, adapters=tuple(sorted(adapters.items())))


def _nan_copy(good: Path, to: Path) -> Path:
    """``good`` with every weight NaN: its header and sizes are right (it plans, lays out and loads), its
    health check fails."""
    shutil.copytree(good, to)
    path = to / "model.safetensors"
    data = bytearray(path.read_bytes())
    header = 8 + int.from_bytes(data[:8], "little")
    data[header:] = b"\xff" * (len(data) - header)  # 0xffffffff: a float32 NaN
    path.write_bytes(bytes(data))
    return to


def _missing_copy(good: Path, to: Path) -> Path:
    shutil.copytree(good, to)
    (to / "model.safetensors").unlink()
    return to


def _config_copy(adapter: Path, to: Path, **changes: object) -> Path:
    shutil.copytree(adapter, to)
    config = json.loads((to / "adapter_config.json").read_text())
    config.update(changes)
    (to / "adapter_config.json").write_text(json.dumps(config))
    return to
