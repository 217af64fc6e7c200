"""The manifest's ``spec.rollout`` section: the strategy, the health check, and a canary's steps and
quality gates."""

from __future__ import annotations

from itertools import pairwise
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    Field,
    SerializerFunctionWrapHandler,
    field_validator,
    model_serializer,
    model_validator,
)
from pydantic_core import PydanticCustomError

from .values import Duration, Strict

DEFAULT_MIN_GOLDEN_TOKENS = 256  # reference tokens below which golden gates would decide on too little
MAX_MIN_REQUESTS = 1_000_000  # requests a canary step waits for
MAX_NLL_INCREASE = 100.0  # nats per token: far past any model worth comparing
MAX_TTFT_RATIO = 1000.0
MAX_MIN_GOLDEN_TOKENS = 10_000_000
TRAFFIC_GATES = ("max_error_rate", "max_ttft_p95", "max_error_rate_increase", "max_ttft_p95_ratio")


class HealthCheck(Strict):
    """A forward pass on a known input; the model serves only if it passes."""

    input: str = Field("Hello", description="Text run through the model before it serves.")
    timeout: Duration = Field(120.0, description="Longest the check may take.")


class Canary(Strict):
    """How a canary moves new requests to the new generation, step by step (docs/rollout.md)."""

    steps: list[Annotated[int, Field(ge=1, le=100, strict=True)]] = Field(
        default=[10, 50, 100], description="Percent of new requests sent to the new generation, one step after "
                                           "another: increasing, ending at 100 (the new generation alone).")
    step_seconds: Duration = Field(30.0, description="How long each step lasts at least: its traffic gates are "
                                                     "checked on the new generation's requests of that step.")
    min_requests: int = Field(
        10, ge=0, le=MAX_MIN_REQUESTS, strict=True,
        description="Requests the new generation must finish in each step before the step may pass: a step extends "
                    "until it has them (up to max_step_seconds), then fails. 0: a step passes on its time.")
    max_step_seconds: Duration | None = Field(None, description="Longest a step may extend waiting for "
                                                                "min_requests before the rollout fails (default: "
                                                                "10 times step_seconds).")

    @property
    def step_limit(self) -> float:
        """Seconds after which a step without its min_requests fails."""
        return self.max_step_seconds if self.max_step_seconds is not None else 10 * self.step_seconds

    @field_validator("steps")
    @classmethod
    def _increasing_to_100(cls, steps: list[int]) -> list[int]:
        if not steps or steps[-1] != 100:
            raise PydanticCustomError("canary_steps", "the last step must be 100 (the new generation takes "
                                                      "every request); got {steps}", {"steps": steps})
        if any(b <= a for a, b in pairwise(steps)):
            raise PydanticCustomError("canary_steps", "steps must increase strictly; got {steps}",
                                      {"steps": steps})
        return steps

    @model_validator(mode="after")
    def _limit_after_step(self) -> Canary:
        if self.max_step_seconds is not None and self.max_step_seconds < self.step_seconds:
            raise PydanticCustomError("canary_limit", "max_step_seconds ({m:g}s) must be at least step_seconds "
                                                      "({s:g}s)", {"m": self.max_step_seconds, "s": self.step_seconds,
                                                                   "at": "max_step_seconds"})
        return self


class Gates(Strict):
    """What a new generation must show before (golden) and while (traffic) it takes requests; a gate that
    fails ends the rollout and the serving generation keeps every request. Each gate is optional."""

    golden: Path | None = Field(None, description="JSON lines of reference cases, one per line: {\"messages\": "
                                                  "[...]} or {\"prompt\": \"...\"}, and \"completion\" (relative "
                                                  "to the manifest). Scored by both generations before any traffic.")
    max_nll_increase: float | None = Field(
        None, ge=0, le=MAX_NLL_INCREASE, strict=True,
        description="Most the mean per-token negative log-likelihood of the golden completions may rise, new "
                    "generation minus serving one, in nats. Needs golden.")
    min_top1_agreement: float | None = Field(
        None, ge=0, le=1, strict=True, description="Least share of golden completion positions where both generations' "
                                      "most likely next token agree. Needs golden.")
    max_error_rate: float | None = Field(
        None, ge=0, le=1, strict=True,
        description="Most share of the new generation's requests in a canary step that may fail (5xx). Needs "
                    "strategy canary.")
    max_ttft_p95: Duration | None = Field(
        None, description="Longest time to first token, 95th percentile, of the new generation's requests in "
                          "a canary step. Needs strategy canary.")
    max_error_rate_increase: float | None = Field(
        None, ge=0, le=1, strict=True,
        description="Most the new generation's error rate (share of 5xx) in a canary step may exceed the serving "
                    "generation's over the same window (0.02: two points more). Needs strategy canary.")
    max_ttft_p95_ratio: float | None = Field(
        None, gt=0, le=MAX_TTFT_RATIO, strict=True,
        description="Most the new generation's time to first token, 95th percentile, in a canary step may be, as a "
                    "multiple of the serving generation's over the same window (1.5: half as slow again). Needs "
                    "strategy canary.")
    min_golden_tokens: int | None = Field(
        None, ge=1, le=MAX_MIN_GOLDEN_TOKENS, strict=True,
        description="Least number of completion tokens the golden references must hold, counted with the serving "
                    "model's tokenizer, for the golden gates to decide on them; fewer is refused at apply (default "
                    f"{DEFAULT_MIN_GOLDEN_TOKENS}). Needs golden.")

    @model_validator(mode="after")
    def _golden_and_its_gates(self) -> Gates:
        scored = self.max_nll_increase is not None or self.min_top1_agreement is not None
        if scored and self.golden is None:
            at = "max_nll_increase" if self.max_nll_increase is not None else "min_top1_agreement"
            raise PydanticCustomError("gates_golden", "{at} compares the generations on golden references: add "
                                                      "golden (a JSON lines file)", {"at": at})
        if self.min_golden_tokens is not None and self.golden is None:
            raise PydanticCustomError("gates_golden", "min_golden_tokens counts the golden references' tokens: "
                                                      "add golden (a JSON lines file)", {"at": "min_golden_tokens"})
        if self.golden is not None and not scored:
            raise PydanticCustomError("gates_golden", "golden is scored only to check max_nll_increase or "
                                                      "min_top1_agreement: set one of them", {"at": "golden"})
        return self

    @property
    def traffic(self) -> bool:
        """Gates checked on each canary step's requests."""
        return any(getattr(self, f) is not None for f in TRAFFIC_GATES)

    @property
    def golden_tokens_needed(self) -> int:
        """``min_golden_tokens`` as set, else its default."""
        return self.min_golden_tokens if self.min_golden_tokens is not None else DEFAULT_MIN_GOLDEN_TOKENS

    @model_serializer(mode="wrap")
    def _omit_unset(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data: dict[str, Any] = handler(self)
        return {k: v for k, v in data.items() if v is not None}


class Rollout(Strict):
    """How a new revision replaces the running one."""

    strategy: Literal["auto", "blue-green", "recreate", "canary"] = Field(
        "auto", description="blue-green loads beside the old model; recreate unloads first; auto picks; canary "
                            "loads beside and moves new requests over by steps (canary), checking gates.")
    health_check: HealthCheck = Field(default_factory=HealthCheck,
                                      description="Run before a new model serves.")
    canary: Canary | None = Field(None, description="The steps of a canary (strategy canary; default steps "
                                                    "[10, 50, 100] of 30s).")
    gates: Gates | None = Field(None, description="Checks that end a rollout when the new generation is worse "
                                                  "(strategy canary or blue-green).")

    @model_validator(mode="after")
    def _strategy_honours(self) -> Rollout:
        if self.canary is not None and self.strategy != "canary":
            raise PydanticCustomError("rollout_canary", "canary steps need strategy canary (it is {s})",
                                      {"s": self.strategy, "at": "canary"})
        gates = self.gates
        if gates is None:
            return self
        if self.strategy in ("recreate", "auto"):
            raise PydanticCustomError(
                "rollout_gates", "gates compare the new generation with the serving one, which {s} may free "
                                 "before the new one loads; set strategy to canary or blue-green",
                {"s": self.strategy, "at": "gates"})
        if self.strategy == "blue-green" and gates.traffic:
            field = next(f for f in TRAFFIC_GATES if getattr(gates, f) is not None)
            raise PydanticCustomError(
                "rollout_gates", "{f} is checked on canary steps' traffic; blue-green moves every request at "
                                 "once: set strategy to canary", {"f": field, "at": f"gates.{field}"})
        return self

    @model_serializer(mode="wrap")
    def _omit_unset(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data: dict[str, Any] = handler(self)
        for key in ("canary", "gates"):  # manifests that never name them keep their digest
            if data.get(key) is None:
                data.pop(key, None)
        return data

    @property
    def steps(self) -> Canary:
        """The canary's steps as written, else the defaults."""
        return self.canary if self.canary is not None else Canary()
