"""The names deploykit's values take, in one place: str Enums (they print, serialise and compare as
strings) and the dtype tables. The manifest's schema spells the same values as Literals, for its JSON
Schema; a test keeps the two equal.
"""

from __future__ import annotations

from enum import Enum


class _Name(str, Enum):
    """A str Enum that prints and formats as its value (``StrEnum`` from Python 3.11), so a member can go
    wherever the plain string went: f-strings, messages, the state store."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)


class Task(_Name):
    CAUSAL_LM = "causal-lm"
    SEQ2SEQ_LM = "seq2seq-lm"
    FEATURE_EXTRACTION = "feature-extraction"


class Phase(_Name):
    PENDING = "Pending"
    PROGRESSING = "Progressing"
    READY = "Ready"
    FAILED = "Failed"
    DEGRADED = "Degraded"  # a generation is held but cannot answer (its llama.cpp engine failed and is retried)
    CLOSED = "Closed"


class Strategy(_Name):
    AUTO = "auto"
    BLUE_GREEN = "blue-green"
    RECREATE = "recreate"
    CANARY = "canary"


class Load(_Name):
    """When ``deploykit serve`` loads a deployment (``spec.lifecycle.load``)."""

    EAGER = "eager"
    ON_DEMAND = "on-demand"


class DType(_Name):
    """What a manifest's ``model.dtype`` and ``reshard --dtype`` may ask for (torch's names)."""

    FLOAT32 = "float32"
    FLOAT16 = "float16"
    BFLOAT16 = "bfloat16"


class Quantization(str, Enum):
    """What a manifest's ``model.quantization`` may ask for: weight-only quantization of the linear layers
    of the transformer blocks (docs/quantization.md)."""

    NONE = "none"
    INT8 = "int8"
    INT4 = "int4"


# safetensors' dtype names: their byte sizes, which are floating point, and torch's name for each.
DTYPE_SIZES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8,
}
FLOAT_DTYPES = {"F16", "BF16", "F32", "F64"}
TORCH_NAMES = {
    "BOOL": "bool", "U8": "uint8", "I8": "int8", "I16": "int16", "U16": "uint16", "I32": "int32",
    "U32": "uint32", "I64": "int64", "U64": "uint64", "F16": "float16", "BF16": "bfloat16", "F32": "float32",
    "F64": "float64", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
}
FROM_TORCH = {torch_name: name for name, torch_name in TORCH_NAMES.items()}
