"""What ``spec.engine.name: llama.cpp`` can honour, checked before anything is planned or started.

llama.cpp serves a GGUF file as it is: its own tensor types, its own batching of ``engine.slots``, its own
KV cache of ``slots x context``, one process on one host. A manifest field that would change what deploykit's
transformers engine does but that llama-server cannot do (quantizing again, tensor parallelism, pipeline
stages, Ray replicas, another task, deploykit's batch loop) is refused here, at that field, never ignored.
Fields that only the transformers engine reads are refused when they differ from their defaults (a recorded
manifest names every default, so their presence alone cannot be the test).
No torch, no transformers.
"""

from __future__ import annotations

from typing import Any

LLAMA_CPP = "llama.cpp"


def llama_cpp_problem(spec: Any) -> tuple[str, str] | None:
    """(field under ``spec``, why) for the first field llama.cpp cannot honour; None: it can serve it."""
    if spec.engine.name != LLAMA_CPP:
        return None
    for check in (_model_problem, _placement_problem, _serving_problem):
        problem = check(spec)
        if problem:
            return problem
    return None


def _model_problem(spec: Any) -> tuple[str, str] | None:
    model = spec.model
    if model.task != "causal-lm":
        return "model.task", f"the llama.cpp engine serves causal-lm models only, not {model.task}"
    if model.quantization != "none":
        return ("model.quantization", f"quantization {model.quantization} is deploykit's own (transformers engine); "
                "llama.cpp serves the GGUF's tensor types as they are: remove it, or pick a GGUF quantized as you want")
    if model.dtype != type(model).model_fields["dtype"].default:  # (recorded manifests name the default)
        return ("model.dtype", "llama.cpp computes with the GGUF's own tensor types; dtype applies to the "
                "transformers engine only: remove it")
    if model.trust_remote_code or model.allow_pickle:
        field = "trust_remote_code" if model.trust_remote_code else "allow_pickle"
        return f"model.{field}", f"a GGUF file carries no code and no pickle: {field} does not apply to llama.cpp"
    return None


def _placement_problem(spec: Any) -> tuple[str, str] | None:
    placement = spec.placement
    if placement.tensor_parallel > 1:
        return ("placement.tensor_parallel", "tensor_parallel is the transformers engine's; llama.cpp splits layers "
                "across GPUs (--tensor-split from the plan): set it to 1")
    if placement.nodes > 1:
        return "placement.nodes", "llama.cpp runs on one host: set nodes to 1"
    if placement.kv_cache is not None:
        return ("placement.kv_cache", "llama.cpp's KV cache is spec.engine.slots x spec.engine.context; "
                "remove kv_cache")
    if spec.cluster is not None:
        return "cluster", "the llama.cpp engine runs on this host, not on a Ray cluster: remove spec.cluster"
    if spec.replicas > 1:
        return "replicas", "Ray replicas run the transformers engine only: set replicas to 1"
    if spec.offload.disk is not None:
        return ("offload.disk", "llama.cpp memory-maps the GGUF file itself; it has no disk tier: "
                "remove offload.disk")
    if spec.sharding != type(spec.sharding)():
        return "sharding", "llama.cpp reads the GGUF file in place, nothing is resharded: remove sharding"
    return None


def _serving_problem(spec: Any) -> tuple[str, str] | None:
    serving, engine = spec.serving, spec.engine
    if serving.batching != "padded":
        return ("serving.batching", "llama-server batches its slots itself (continuous batching); batching "
                "chooses deploykit's own loop: remove it")
    if serving.max_concurrent != type(serving).model_fields["max_concurrent"].default:
        return ("serving.max_concurrent", "with llama.cpp, the requests decoded together are its slots: "
                "set spec.engine.slots instead")
    if serving.context_length is not None and serving.context_length > engine.context:
        return ("serving.context_length", f"context_length {serving.context_length} is more than a llama.cpp "
                f"slot holds (spec.engine.context {engine.context}): raise engine.context or lower it")
    if serving.prefix_cache.enabled and serving.prefix_cache.max_bytes is not None:
        return ("serving.prefix_cache.max_bytes", "llama-server keeps its slots' own prompts to reuse (its prompt "
                "cache, within the slots' KV); max_bytes sizes the transformers engine's prefix cache: remove it")
    if serving.max_tokens >= engine.context:
        return ("serving.max_tokens", f"max_tokens {serving.max_tokens} leaves no room for a prompt in a slot of "
                f"{engine.context} tokens (spec.engine.context)")
    return None
