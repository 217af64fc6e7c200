"""Time to first token and to the last one, through a Ray Serve replica (deploykit's replica engine,
streamed) against the same model in this process (deploykit's batching engine), on one random Llama.
Run: .venv/bin/python bench/replicas.py [--layers 8 --hidden 512 --tokens 64 --runs 3]

Both contenders run the same greedy request (the outputs are checked equal), alternated, ``--runs``
times each; the table shows medians. The replica runs on a fake worker node of
``ray.cluster_utils.Cluster`` on this machine (head with 0 CPUs), so the hop is a local socket.
"Whole" is when a caller would see the first token if the replica answered in one piece (as deploykit's
replicas did before they streamed): the time of the last token.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from pipeline import build  # noqa: E402  (bench/pipeline.py: the same random Llama)


def with_tokenizer(directory: Path) -> Path:
    """A byte-level tokenizer beside the weights: a replica serves only models that ship one."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    PreTrainedTokenizerFast(tokenizer_object=tokenizer).save_pretrained(directory)
    return directory


def timed(engine, prompt: list[int], tokens: int) -> tuple[list[int], float, float]:
    """(ids, seconds to the first token, seconds to the end) of one greedy request through ``engine``."""
    from deploykit.engine.batching import GenerationRequest

    first: list[float] = []
    start = time.perf_counter()
    handle = engine.submit(GenerationRequest(prompt, tokens),
                           lambda item: first.append(time.perf_counter()) if not first else None)
    result = handle.result(300)
    end = time.perf_counter()
    assert result.finish_reason in ("length", "stop"), result
    return result.token_ids, first[0] - start, end - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=32, help="prompt length in tokens")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()

    import ray
    import torch
    from ray import serve
    from ray.cluster_utils import Cluster
    from transformers import AutoModelForCausalLM

    from deploykit.cluster.replica_runtime import build_replica_runtime
    from deploykit.cluster.replicas import ReplicaOptions
    from deploykit.engine.batching import Engine
    from deploykit.engine.loader import LoadOptions
    from deploykit.engine.runtime import Limits
    from deploykit.engine.serving import ServingSpec
    from deploykit.placement.inventory import parse_devices
    from deploykit.placement.planner import plan
    from deploykit.placement.planning import load_structure
    from deploykit.spec.schema import Spec

    torch.set_num_threads(1)
    print("load average before:", Path("/proc/loadavg").read_text().strip())
    samples: dict[str, list[tuple[float, float]]] = {"in process": [], "replica, streamed": []}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = with_tokenizer(build(Path(tmp) / "model", args.layers, args.hidden))
        prompt = [(7 * i + 3) % 32000 for i in range(args.prompt)]
        local = Engine(AutoModelForCausalLM.from_pretrained(model_dir), None, max_batch_size=4)
        node = dict(num_cpus=2, object_store_memory=80 * 2**20, include_dashboard=False)
        cluster = Cluster(initialize_head=True, head_node_args={**node, "num_cpus": 0})
        runtime = None
        try:
            cluster.add_node(**node)
            cluster.wait_for_nodes()
            structure = load_structure(model_dir, task="causal-lm", dtype="float32")
            one_host = plan(structure, Spec.model_validate({"model": {"path": str(model_dir)}}),
                            parse_devices("cpu=4GiB"))
            serving = ServingSpec("bench", LoadOptions(task="causal-lm", dtype="float32"), Limits(max_concurrent=4))
            runtime = build_replica_runtime(one_host, model_dir, serving, address=cluster.address, replicas=1,
                                            options=ReplicaOptions(num_cpus=1, threads=1))
            reference, *_ = timed(local, prompt, args.tokens)
            for _ in range(args.runs):  # alternated, so both see the same machine
                for name, engine in (("in process", local), ("replica, streamed", runtime.engine)):
                    ids, ttft, total = timed(engine, prompt, args.tokens)
                    assert ids == reference, f"{name}: different tokens"
                    samples[name].append((ttft, total))
        finally:
            if runtime is not None:
                runtime.close()
                serve.shutdown()
            local.close(30)
            ray.shutdown()
            cluster.shutdown()
    print("load average after: ", Path("/proc/loadavg").read_text().strip())
    ms = lambda xs: f"{1000 * statistics.median(xs):.1f}"  # noqa: E731
    print(f"Llama {args.layers} layers, hidden {args.hidden}, fp32; prompt {args.prompt}, {args.tokens} greedy "
          f"tokens; median of {args.runs} runs, alternated")
    print(f"{'contender':<20} {'first token, ms':>16} {'last token, ms':>15} {'whole, first token ms':>22}")
    for name, rows in samples.items():
        whole = ms([t for _, t in rows]) if name != "in process" else "-"
        print(f"{name:<20} {ms([f for f, _ in rows]):>16} {ms([t for _, t in rows]):>15} {whole:>22}")


if __name__ == "__main__":
    main()
