"""The sampling fields every request to llama-server carries, whoever sends it (the API's relay, the
library's ``Deployment.chat``): the OpenAI API's defaults made explicit, and a seed llama.cpp can take.

llama-server fills a field it is not sent with its own default (temperature 0.8, top_k 40, top_p 0.95,
min_p 0.05); an OpenAI client that sends no temperature expects 1 and no truncation. So both are always
sent: ``temperature`` and ``top_p`` as the request has them (1 when unset), ``top_k`` 0 and ``min_p`` 0
(off: llama.cpp's "use the whole vocabulary"). The other samplers llama-server applies are off by its own
defaults already (typical-p, repeat penalty, DRY, XTC, mirostat, top-n-sigma). A greedy request
(``temperature`` 0) is sent ``top_k`` 1 instead: its answer is the most likely token either way, and its
logprobs are llama.cpp's from the whole distribution either way (both checked against llama-server), but
without truncation llama.cpp runs its samplers over the whole vocabulary for every token (about 5% more of
its CPU time per token for SmolLM2's 49152 tokens, measured).

llama.cpp's seed is a uint32 whose largest value (0xFFFFFFFF) means "random"; deploykit's is a signed
64-bit value. A seed outside 0 to 2^32 - 2 is refused (``RequestError`` naming ``seed``), never wrapped, so
one seed always means one sampling.
"""

from __future__ import annotations

from ..text import RequestError

SEED_MAX = 2**32 - 2
TOP_K_OFF = 0
TOP_K_GREEDY = 1  # temperature 0: the argmax, with one candidate left for llama.cpp's samplers
MIN_P_OFF = 0.0


def sampling_fields(*, temperature: float, top_p: float, seed: int | None) -> dict[str, float | int]:
    """The sampling fields of an upstream body."""
    fields: dict[str, float | int] = {"temperature": temperature, "top_p": top_p,
                                      "top_k": TOP_K_GREEDY if temperature == 0 else TOP_K_OFF, "min_p": MIN_P_OFF}
    if seed is not None:
        if not 0 <= seed <= SEED_MAX:
            raise RequestError(f"seed {seed} is outside what the llama.cpp engine takes (0 to {SEED_MAX})",
                               param="seed", code="invalid_seed")
        fields["seed"] = seed
    return fields
