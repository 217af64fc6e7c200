"""A llama.cpp plan's bytes per device are the bytes llama.cpp itself puts there under the plan's flags.

``llama_cpp_bytes`` is llama.cpp's own placement rule, written here from its source (``llama_model::
load_tensors`` in ``src/llama-model.cpp``, ``create_tensor`` and the buffer-type overrides): the input
embeddings on the CPU; ``n_layer + 1`` slots (the layers, then the output head) of which ``--n-gpu-layers``
offloads the *last*; ``--tensor-split`` as cumulative fractions over the offloaded slots, slot ``i`` to the
first device whose fraction exceeds ``i / offloaded`` (``std::upper_bound``); ``--override-tensor`` patterns
searched in the tensor's name, the first match wins; a tied-embedding GGUF's head is ``token_embd.weight``
again, loaded as an output tensor, and a second copy only where that buffer does not hold it already
(``TENSOR_DUPLICATED``); each layer's KV cache on its layer's slot device; the logits of a micro-batch in the compute buffer of the
device that runs the head (``llama_context``'s worst-case reserve). Applied to the flags of plans of
several GGUFs (SmolLM2's, tied and uniform; small ones written here, tied or not, whose layers differ in size
as a mixed quantization's do) on several simulated machines, it must give every device the plan's bytes.
No GPU is needed: both sides are arithmetic on the same GGUF tensor table.
"""

from __future__ import annotations

import bisect
import re
from pathlib import Path

import pytest

from deploykit.engine.llamacpp.flags import placement_flags
from deploykit.model.gguf_blocks import gguf_blocks
from deploykit.placement.planning import plan_manifest
from deploykit.spec.manifest import load_manifests
from helpers import smollm2_file
from llamacpp import manifest

np = pytest.importorskip("numpy")
gguf = pytest.importorskip("gguf", reason="the gguf package writes and reads the test's GGUF files")

SLOTS, CONTEXT = 2, 512  # tests/llamacpp.py's manifest
MICRO_BATCH = min(512, SLOTS * CONTEXT)  # engine.batch_size's default, at most the context
RESERVE = 2048 * 2**20  # placement.reserve's default: a simulated GPU's budget is its memory less this


def write_gguf(path: Path, *, tied: bool, big_layers: tuple[int, ...], layers: int = 8, hidden: int = 64,
               heads: int = 4, kv_heads: int = 2, ff: int = 128, vocab: int = 512) -> Path:
    """A llama GGUF whose ``big_layers`` hold ``ffn_down`` in F32, the others in F16 (as Q4_K_M gives some
    layers Q6_K tensors); without ``output.weight`` when ``tied``. Every tensor's bytes are a multiple of
    the file's 32-byte alignment, so the table's sizes equal the reader's."""
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    for add, value in ((w.add_context_length, 512), (w.add_embedding_length, hidden), (w.add_block_count, layers),
                       (w.add_feed_forward_length, ff), (w.add_head_count, heads), (w.add_head_count_kv, kv_heads),
                       (w.add_rope_dimension_count, hidden // heads), (w.add_vocab_size, vocab)):
        add(value)  # type: ignore[operator]
    w.add_layer_norm_rms_eps(1e-5)

    def tensor(name: str, *shape: int, dtype: object = np.float16) -> None:
        w.add_tensor(name, (rng.standard_normal(shape) * 0.05).astype(dtype if len(shape) > 1 else np.float32))

    head_dim = hidden // heads
    tensor("token_embd.weight", vocab, hidden)
    for i in range(layers):
        for name, shape in (("attn_norm", (hidden,)), ("attn_q", (heads * head_dim, hidden)),
                            ("attn_k", (kv_heads * head_dim, hidden)), ("attn_v", (kv_heads * head_dim, hidden)),
                            ("attn_output", (hidden, heads * head_dim)), ("ffn_norm", (hidden,)),
                            ("ffn_gate", (ff, hidden)), ("ffn_up", (ff, hidden))):
            tensor(f"blk.{i}.{name}.weight", *shape)
        tensor(f"blk.{i}.ffn_down.weight", hidden, ff, dtype=np.float32 if i in big_layers else np.float16)
    tensor("output_norm.weight", hidden)
    if not tied:
        tensor("output.weight", vocab, hidden)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _flag(args: list[str], name: str, default: str) -> str:
    return args[args.index(name) + 1] if name in args else default


def _device(name: str) -> int | str:
    return "cpu" if name == "CPU" else int(name.removeprefix("CUDA"))


def llama_cpp_bytes(gguf_file: Path, args: list[str]) -> dict[int | str, int]:
    """Bytes per device ("cpu" or a CUDA index) that llama.cpp holds for ``gguf_file`` under ``args``."""
    reader = gguf.GGUFReader(gguf_file)
    fields = reader.fields
    n_layer = int(fields["llama.block_count"].parts[-1][0])
    heads, kv_heads = int(fields["llama.attention.head_count"].parts[-1][0]), int(fields["llama.attention.head_count_kv"].parts[-1][0])
    width = int(fields["llama.embedding_length"].parts[-1][0])
    kv_per_layer = 2 * (width // heads) * kv_heads * 2 * SLOTS * CONTEXT  # K and V, f16, every slot's context
    devices = [_device(d) for d in _flag(args, "--device", "").split(",") if d]
    ngl = int(_flag(args, "--n-gpu-layers", "0"))
    weights = [float(x) for x in _flag(args, "--tensor-split", "").split(",") if x] or [1.0] * len(devices)
    overrides = [(re.compile(p), _device(d)) for p, d in
                 (o.rsplit("=", 1) for o in _flag(args, "--override-tensor", "").split(",") if o)]
    cumulative = [sum(weights[:i + 1]) / sum(weights) for i in range(len(weights))]
    start, offloaded = max(n_layer + 1 - ngl, 0), min(ngl, n_layer + 1)

    def slot(il: int) -> int | str:
        if not devices or il < start or il - start >= offloaded:
            return "cpu"
        return devices[min(bisect.bisect_right(cumulative, (il - start) / offloaded), len(devices) - 1)]

    def placed(name: str, default: int | str) -> int | str:
        return next((d for pattern, d in overrides if pattern.search(name)), default)

    held: dict[int | str, int] = {}
    where: dict[str, int | str] = {}
    for t in reader.tensors:
        layer = re.match(r"blk\.(\d+)\.", t.name)
        default = "cpu" if t.name.startswith("token_embd.") else slot(int(layer.group(1)) if layer else n_layer)
        where[t.name] = device = placed(t.name, default)
        held[device] = held.get(device, 0) + int(t.n_bytes)
    embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
    head = where.get("output.weight")
    if head is None:  # tied: token_embd.weight again, as the output layer's tensor
        head = placed("token_embd.weight", slot(n_layer))
        if head != where["token_embd.weight"]:
            held[head] = held.get(head, 0) + int(embd.n_bytes)
    # the compute buffer of the device that runs the head holds the logits of a whole micro-batch
    held[head] = held.get(head, 0) + MICRO_BATCH * int(embd.shape[1]) * 4
    for il in range(n_layer):
        held[slot(il)] = held.get(slot(il), 0) + kv_per_layer
    return {d: b for d, b in held.items() if b}


def _plan(tmp_path: Path, gguf_file: Path, devices: str):  # type: ignore[no-untyped-def]
    path = tmp_path / f"{gguf_file.stem}.yaml"
    path.write_text(manifest(gguf_file, extra="  placement: {gpus: all}\n"))
    [loaded] = load_manifests(path)
    return plan_manifest(loaded, devices=devices)


def _machines(total: int, first: int) -> list[str]:
    """Simulated machines for a model of ``total`` bytes whose first block (the embeddings, with the logits
    where the head is tied) takes ``first``: all on 4 GPUs; 2 GPUs with a CPU tail; one GPU of a third with
    the rest on the CPU; unequal GPUs with a CPU tail. GPU 0 holds the first block beside its share."""
    rest = total - first
    half, third, fifth = (RESERVE + rest // n for n in (2, 3, 5))
    return ["4x24GiB", f"1x{third + first}B,1x{third}B,cpu=8GiB", f"1x{third + first}B,cpu=8GiB",
            f"1x{half + first}B,1x{fifth}B,cpu=8GiB"]


@pytest.mark.parametrize("kind", ["smollm2", "untied-mixed", "tied-mixed"])
def test_the_plans_bytes_per_device_are_llama_cpps(tmp_path, kind):
    gguf_file = smollm2_file() if kind == "smollm2" else \
        write_gguf(tmp_path / f"{kind}.gguf", tied=kind.startswith("tied"), big_layers=(0, 1, 2))
    on_cpu = _plan(tmp_path, gguf_file, "cpu=8GiB")
    first = gguf_blocks(gguf_file, kv_tokens=SLOTS * CONTEXT, batch_tokens=MICRO_BATCH).blocks[0].weight_bytes
    cpu_layers_seen = 0
    for machine in _machines(on_cpu.total_bytes, first):
        plan = _plan(tmp_path, gguf_file, machine)
        flags = placement_flags(plan.device_map)
        planned = {d.device: d.bytes for d in plan.devices if d.bytes}
        assert llama_cpp_bytes(gguf_file, flags.as_args()) == planned, (machine, flags.as_args(), plan.device_map)
        cpu_layers_seen += flags.cpu_layers
    assert cpu_layers_seen > 0  # the machines made the plans leave layers on the CPU


def test_a_tied_head_is_the_pinned_embeddings_own_tensor_with_no_copy(tmp_path):
    """Without the pin of token_embd, llama.cpp would hold the embeddings on the CPU and a tied GGUF's head
    (token_embd.weight loaded as an output tensor) on the last GPU: a second copy the plan does not have."""
    gguf_file = write_gguf(tmp_path / "tied.gguf", tied=True, big_layers=())
    plan = _plan(tmp_path, gguf_file, "2x24GiB")
    args = placement_flags(plan.device_map).as_args()
    embd = next(int(t.n_bytes) for t in gguf.GGUFReader(gguf_file).tensors if t.name == "token_embd.weight")
    assert sum(llama_cpp_bytes(gguf_file, args).values()) == plan.total_bytes  # one token_embd, on GPU 0
    unpinned = llama_cpp_bytes(gguf_file, args[:args.index("--override-tensor")])
    assert sum(unpinned.values()) == plan.total_bytes + embd and unpinned["cpu"] == embd
