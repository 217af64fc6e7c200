"""Per-token latency of a 2-stage Ray pipeline against one process, on the same tiny Llama, and what
Ray costs to start. Run: .venv/bin/python bench/pipeline.py [--layers 8 --hidden 512 --tokens 32]

Every variant decodes the same prompt greedily (and the outputs are checked equal); per-token latency
is the median over decode steps after the prefill. The Ray cluster is ``ray.cluster_utils.Cluster`` with
two worker nodes on this machine (head with 0 CPUs), so "between stages" is a local socket, not a
network: a real cluster adds its network round trip per stage per token.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from common import print_measures


def build(directory: Path, layers: int, hidden: int) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=hidden, intermediate_size=hidden * 4, num_hidden_layers=layers,
                         num_attention_heads=max(1, hidden // 64), num_key_value_heads=max(1, hidden // 256),
                         vocab_size=32000, max_position_embeddings=512)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(directory, safe_serialization=True)
    return directory


def timed_greedy(step, release, prompt: list[int], tokens: int) -> tuple[list[int], float, list[float]]:
    """(tokens, prefill seconds, per-decode-step seconds) through ``step(group, ids, mask, pos)``."""
    import torch

    ids, mask = torch.tensor([prompt]), torch.ones(1, len(prompt), dtype=torch.long)
    pos = (mask.cumsum(1) - 1)
    out, steps, prefill = [], [], 0.0
    try:
        for i in range(tokens):
            t0 = time.perf_counter()
            logits = step("bench", ids, mask, pos)
            dt = time.perf_counter() - t0
            if i == 0:
                prefill = dt
            else:
                steps.append(dt)
            nxt = int(logits[0].argmax())
            out.append(nxt)
            ids = torch.tensor([[nxt]])
            mask = torch.cat([mask, torch.ones(1, 1, dtype=torch.long)], 1)
            pos = mask.sum(1, keepdim=True) - 1
    finally:
        release("bench")
    return out, prefill, steps


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=32, help="prompt length in tokens")
    args = parser.parse_args()

    import torch

    torch.set_num_threads(1)
    from deploykit.cluster.pipeline import LocalPipeline, RayPipeline, split_layers
    from deploykit.cluster.stage import Stage, StageSpec

    rows: list[tuple[str, str]] = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build(Path(tmp) / "model", args.layers, args.hidden)
        prompt = [(7 * i + 3) % 32000 for i in range(args.prompt)]
        single = Stage(StageSpec(0, 1, 0, args.layers, str(model_dir)))  # the whole model, one process
        ref, prefill1, steps1 = timed_greedy(single.forward, single.release, prompt, args.tokens)
        specs = [StageSpec(i, 2, a, b, str(model_dir)) for i, (a, b) in enumerate(split_layers(args.layers, 2))]
        local = LocalPipeline(specs)
        got, prefill_l, steps_l = timed_greedy(local.step, local.release, prompt, args.tokens)
        assert got == ref, "in-process stages differ from the single process"

        import ray
        from ray.cluster_utils import Cluster

        node = dict(num_cpus=1, object_store_memory=80 * 2**20, include_dashboard=False)
        t0 = time.perf_counter()
        cluster = Cluster(initialize_head=True, head_node_args={**node, "num_cpus": 0})
        try:
            cluster.add_node(**node)
            cluster.add_node(**node)
            cluster.wait_for_nodes()
            from deploykit.cluster.ray_env import connect

            connect(cluster.address)
            t_cluster = time.perf_counter() - t0
            t1 = time.perf_counter()
            pipe = RayPipeline.start(specs, num_cpus=0.5)
            t_stages = time.perf_counter() - t1
            got, prefill_r, steps_r = timed_greedy(pipe.step, pipe.release, prompt, args.tokens)
            assert got == ref, "the Ray pipeline differs from the single process"
            pipe.close()
        finally:
            ray.shutdown()
            cluster.shutdown()

    params = sum(p.numel() for p in single.model.parameters())
    ms = lambda xs: f"{1000 * statistics.median(xs):.1f}"  # noqa: E731
    rows += [("model", f"Llama {args.layers} layers, hidden {args.hidden}, {params / 1e6:.1f}M params, fp32"),
             ("prompt / new tokens", f"{args.prompt} / {args.tokens} (greedy, outputs equal in all three)"),
             ("single process, ms/token (median)", ms(steps1)),
             ("2 stages in one process, ms/token", ms(steps_l)),
             ("2 stages on 2 Ray nodes, ms/token", ms(steps_r)),
             ("  Ray pipeline overhead per token, ms", f"{1000 * (statistics.median(steps_r) - statistics.median(steps1)):.1f}"),
             ("prefill: single / Ray pipeline, ms", f"{1000 * prefill1:.1f} / {1000 * prefill_r:.1f}"),
             ("Ray start: head + 2 worker nodes, s", f"{t_cluster:.1f}"),
             ("Ray start: 2 stage actors built, s", f"{t_stages:.1f}")]
    print_measures(rows)


if __name__ == "__main__":
    main()
