"""LoRA adapters under load: 16 concurrent chats half on an adapter against 16 base chats, side by side on one
`deploykit serve`, and the time from writing a manifest with a new adapter to that adapter's first answer.

    python bench/adapters.py [--model CHECKPOINT_DIR] [--clients 16] [--tokens 64] [--rank 16] [--rounds 3]

Without --model it builds the tests' tiny chat model (a check that the script runs, not a measure). The
adapters are made with peft (random, non-zero B so that they change the answers) at --rank on q/k/v/o.
Rounds alternate base-only and mixed batches, so that both see the same machine; the figure is the ratio of
their median tokens/s. Both send the same prompts every round, so from the second round on each row may start
from what the prefix cache kept of its prompt (the base's under the base, an adapter's under that adapter).
The load average before and after is printed with the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))


def make_adapter(model: Path, out: Path, *, rank: int, seed: int) -> Path:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                        init_lora_weights=False, task_type="CAUSAL_LM")
    get_peft_model(base, config).save_pretrained(out)
    return out


def manifest(model: Path, adapters: dict[str, Path], clients: int) -> str:
    text = (f"apiVersion: deploykit/v1\nkind: ModelDeployment\nmetadata: {{name: bench}}\nspec:\n"
            f"  model: {{path: {model}, dtype: float32}}\n  placement: {{gpus: []}}\n"
            f"  serving: {{max_tokens: 1024, max_concurrent: {clients}}}\n")
    if adapters:
        text += "  adapters:\n" + "".join(f"    - {{name: {n}, path: {p}}}\n" for n, p in adapters.items())
    return text


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def models(url: str) -> set[str]:
    with urllib.request.urlopen(f"{url}/v1/models", timeout=30) as r:
        return {m["id"] for m in json.loads(r.read())["data"]}


def wait_ready(url: str, process: subprocess.Popen[bytes], timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit("deploykit serve exited")
        try:
            with urllib.request.urlopen(f"{url}/readyz", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise SystemExit("deploykit serve was not ready")


def no_end(model: Path) -> dict[str, int]:
    """A logit_bias that keeps every chat writing to its max_tokens: the model's end tokens (config's and
    generation_config's ``eos_token_id``) biased out. Otherwise an adapter that ends its answers sooner than the
    base (these random ones do: 16 of 48 tokens on SmolLM2) leaves its rows idle while the base's finish, and the
    mixed batch's tokens/s falls for answers that are shorter, not for steps that are slower."""
    ids: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        path = model / name
        found = json.loads(path.read_text()).get("eos_token_id") if path.exists() else None
        ids.update(found if isinstance(found, list) else [found] if found is not None else [])
    return {str(i): -100 for i in sorted(ids)}


def batch(client: object, chosen: list[str], tokens: int, bias: dict[str, int]) -> tuple[int, float]:
    """All ``chosen`` models' chats at once: (completion tokens, wall seconds)."""
    done: list[int] = []
    start = threading.Barrier(len(chosen) + 1)

    def one(i: int, model: str) -> None:
        start.wait()
        answer = client.chat.completions.create(  # type: ignore[attr-defined]
            model=model, messages=[{"role": "user", "content": f"Tell me story number {i}."}], max_tokens=tokens,
            temperature=0, logit_bias=bias)
        done.append(answer.usage.completion_tokens)

    threads = [threading.Thread(target=one, args=(i, m)) for i, m in enumerate(chosen)]
    for t in threads:
        t.start()
    start.wait()
    began = time.perf_counter()
    for t in threads:
        t.join()
    return sum(done), time.perf_counter() - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    import openai

    load_before = os.getloadavg()
    work = Path(tempfile.mkdtemp(prefix="deploykit-bench-adapters-"))
    model = args.model.resolve() if args.model is not None else None  # the manifest lives elsewhere
    if model is None:
        from chatmodel import build_chat_model

        model = build_chat_model(work / "tiny-chat")
    one = make_adapter(model, work / "one", rank=args.rank, seed=1)
    two = make_adapter(model, work / "two", rank=args.rank, seed=2)
    (work / "m").mkdir()
    path = work / "m" / "bench.yaml"
    path.write_text(manifest(model, {"one": one}, args.clients))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "DEPLOYKIT_STATE": str(work / "state"), "PYTHONPATH": str(ROOT)}
    process = subprocess.Popen([sys.executable, "-m", "deploykit.cli", "serve", str(work / "m"), "--port", str(port),
                                "--debounce", "0.1"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               start_new_session=True)
    try:
        wait_ready(url, process)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600)
        base = ["bench"] * args.clients
        mixed = ["bench:one" if i % 2 else "bench" for i in range(args.clients)]
        bias = no_end(model)
        batch(client, base[:2], 4, bias)  # warm
        rates: dict[str, list[float]] = {"base": [], "mixed": []}
        for _ in range(args.rounds):
            for name, chosen in (("base", base), ("mixed", mixed)):
                tokens, seconds = batch(client, chosen, args.tokens, bias)
                rates[name].append(tokens / seconds)
        began = time.perf_counter()
        tmp = path.with_name(".bench.yaml.swp")
        tmp.write_text(manifest(model, {"one": one, "two": two}, args.clients))
        os.replace(tmp, path)
        while "bench:two" not in models(url):
            time.sleep(0.02)
        listed = time.perf_counter() - began
        client.chat.completions.create(model="bench:two", messages=[{"role": "user", "content": "hi"}], max_tokens=1)
        answered = time.perf_counter() - began
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(60)
    base_rate, mixed_rate = statistics.median(rates["base"]), statistics.median(rates["mixed"])
    rows = [("model", str(model)), ("clients x tokens", f"{args.clients} x {args.tokens}"),
            ("adapter rank (q,k,v,o)", str(args.rank)),
            ("base chats tok/s (median)", f"{base_rate:.1f}  {[round(r, 1) for r in rates['base']]}"),
            ("half on an adapter tok/s (median)", f"{mixed_rate:.1f}  {[round(r, 1) for r in rates['mixed']]}"),
            ("mixed / base", f"{mixed_rate / base_rate:.2f}x"),
            ("add an adapter live: listed after", f"{listed:.2f} s"),
            ("add an adapter live: first answer after", f"{answered:.2f} s"),
            ("load average 1/5/15 min before / after", f"{_load(load_before)} / {_load(os.getloadavg())}")]
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")


def _load(avg: tuple[float, float, float]) -> str:
    return " ".join(f"{x:.1f}" for x in avg)


if __name__ == "__main__":
    main()
