"""Speculative decoding in the padded loop (``spec.speculative``): drafts of each decoding row's next tokens,
and which of them the model's own choices accept.

Drafting, at most ``num_tokens`` tokens: method ngram (prompt lookup), the tokens that followed the last
occurrence of the row's trailing ``ngram_max`` .. ``ngram_min`` tokens (longest first) in its prompt and output
so far; method draft, the tokens a draft model chooses greedily after them (``drafting.py``, its own KV cache
per row). Under a grammar the draft stops before the first token the grammar forbids (its matcher tries
them, then rolls back).

Verification: one forward of every row's last token and its drafts. Where the model's forwards can be mixed
(``mixed.py``) it is packed: a row with ``k`` drafts adds ``k + 1`` positions, a row without adds one, and a
prompt's chunk being read can share the forward (``forwards.Forwards.mixed``); elsewhere every row is widened
to ``K + 1`` positions (``K`` the longest draft; a row with fewer fills the rest, which its causal mask keeps
out of its real positions: ``forwards.Forwards.verify``). Each position's logits are then chosen from exactly as a decode step would (``choose``:
penalties, bias, grammar, temperature / top_p with the row's own generator, logprobs), one position after
another; the draft is accepted while the chosen token equals it. For greedy rows that is the answer without
speculation, token for token. For a sampled row the draft is a point mass q = 1 on token x: sampling y from the
row's processed distribution p and accepting iff y == x accepts x with probability p(x), and on a rejection
gives y != x with probability p(y) / (1 - p(x)): the standard rejection rule, and every emitted token follows p.
The row's generator draws once per emitted token, as without speculation, so a seeded request gives the same
tokens with and without it. The cache keeps the accepted positions only (``kvcache.keep_verified``).

With a draft model, drafting also stops while it costs more than it saves (``Speculator.pays``): a drafted
token costs a forward of the draft for its row, an accepted one saves that row's share of a step of the
model (the step's time over its rows, times the acceptance so far); checked at every step from the running
means of both times, and tried again every ``MAX_PAUSE`` steps to measure anew.

On only where it pays: each request's draft length backs off (``Pace``: halved when nothing was accepted, then
drafting pauses for 1, 2, 4 .. 64 steps; doubled back while all is accepted), and the batch's verification
forward holds at most ``VERIFY_POSITIONS`` positions, so under batch load drafts shrink, then stop. For the
batch as a whole (either method), drafting pauses while verification steps give fewer tokens per second than
decode steps do (``Speculator.verified``: the tokens a verification step emitted per row, times a decode
step's time over its own, a running mean under 1): for 4, 8, 16 .. 64 steps, then one step drafts to measure
anew (its gain alone: one that pays ends the holds), and a batch that empties forgets them. A lone row is
left to its own pace: one step whose drafts all failed would hold a row whose drafts mostly pay. Many rows whose drafts mostly fail (open-ended chat under load) pay for the wider forward without
getting tokens back; one row copying its prompt gets several per forward.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from ..spec.speculative import verification_room
from .drafting import DraftModel
from .requests import RequestHandle
from .types import Speculation

MAX_PAUSE = 64  # steps a request that keeps failing waits at most before it drafts again
FIRST_HOLD = 4  # steps the batch's first hold lasts (a verification step that did not pay costs a few decode steps)


def ngram_draft(seq: Sequence[int], k: int, lo: int, hi: int) -> list[int]:
    """Up to ``k`` tokens that followed the last earlier occurrence of ``seq``'s trailing ``n`` tokens, for
    ``n`` from ``hi`` down to ``lo`` (the longest match that occurred first wins); [] when none did."""
    if k < 1 or len(seq) <= lo:
        return []
    t = torch.tensor(seq, dtype=torch.long)
    for n in range(min(hi, len(seq) - 1), lo - 1, -1):
        windows = t[:-1].unfold(0, n, 1)  # every window followed by at least one token, the tail's own excluded
        hits = (windows == t[-n:]).all(1).nonzero()
        if len(hits):
            start = int(hits[-1]) + n
            return [int(x) for x in seq[start:start + k]]
    return []


@dataclass
class Pace:
    """How many tokens one request drafts now: halved when none was accepted (at 0, drafting pauses for
    ``pause`` steps, doubled each time up to ``MAX_PAUSE``, then starts again at 1), doubled when all were."""

    limit: int
    wait: int = 0
    pause: int = 1

    def allowed(self) -> int:
        if self.wait > 0:
            self.wait -= 1
            return 0
        return self.limit

    def after(self, drafted: int, accepted: int, most: int) -> None:
        if drafted == 0:
            return
        if accepted == drafted:
            self.limit, self.pause = min(most, self.limit * 2), 1
        elif accepted == 0:
            self.limit //= 2
            if self.limit == 0:
                self.limit, self.wait, self.pause = 1, self.pause, min(MAX_PAUSE, self.pause * 2)
        else:
            self.limit = min(most, accepted + 1)


@dataclass
class Counters:
    """Speculation of one engine since it started (read by any thread: the metrics and status)."""

    drafted: int = 0  # tokens proposed and verified
    accepted: int = 0  # of those, emitted
    steps: int = 0  # verification forwards
    emitted: int = 0  # tokens those forwards produced (accepted drafts and one chosen token per row)
    with_chunk: int = 0  # of the forwards, those that read a prompt's chunk beside the rows (mixed.py)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)


class Speculator:
    """The drafts of a batch's rows and their acceptance (one per padded loop, used on its thread)."""

    def __init__(self, settings: Speculation, draft_model: DraftModel | None = None) -> None:
        self.settings = settings
        self.draft_model = draft_model  # method draft; None: ngram
        self.counters = Counters()
        self._paces: dict[str, Pace] = {}
        self.step_seconds: float | None = None  # a step of the model's forward (decode or verify), a running mean
        self._idle = 0  # steps since the draft model last drafted
        self._decode_seconds: float | None = None  # a plain decode step, a running mean
        self.gain: float | None = None  # verification's tokens per second over decoding's, a running mean
        self._hold = 0  # steps the batch drafts nothing for now (verification did not pay)
        self._pause = FIRST_HOLD  # the next hold's length: doubled while verification does not pay, up to MAX_PAUSE
        self._probing = False  # the next verification follows a hold: its gain stands alone

    def drafts(self, rows: list[RequestHandle]) -> list[list[int]]:
        """Each row's draft (maybe empty) for the next step, within the batch's ``VERIFY_POSITIONS``."""
        s = self.settings
        self.keep(rows)
        most = verification_room(s.num_tokens, len(rows)) - 1
        if self._hold > 0:
            self._hold -= 1
            return [[] for _ in rows]
        if most < 1 or not self.pays(len(rows)):
            return [[] for _ in rows]
        return [self._draft(h, most) for h in rows]

    def keep(self, rows: list[RequestHandle]) -> None:
        """Forget what rows no longer in ``rows`` left: their pace and their draft caches (the loop calls this
        as rows leave, so that a draft model's KV goes with its row, not at the next step that drafts)."""
        live = {h.id for h in rows}
        if not live:  # the batch emptied: its holds and gain were the rows' that left, not the next ones'
            self.gain, self._hold, self._pause, self._probing = None, 0, FIRST_HOLD, False
        if any(k not in live for k in self._paces):
            self._paces = {k: v for k, v in self._paces.items() if k in live}
        if self.draft_model is not None:
            self.draft_model.keep(live)

    def timed(self, seconds: float) -> None:
        """A decode or verification step of the model took ``seconds``."""
        self.step_seconds = seconds if self.step_seconds is None else 0.8 * self.step_seconds + 0.2 * seconds

    def decoded(self, seconds: float) -> None:
        """A plain decode step (no drafts) took ``seconds``: one token per row."""
        self.timed(seconds)
        self._decode_seconds = seconds if self._decode_seconds is None else 0.8 * self._decode_seconds + 0.2 * seconds

    def verified(self, seconds: float, rows: int, emitted: int) -> None:
        """A verification step of ``rows`` rows took ``seconds`` and emitted ``emitted`` tokens: the batch holds
        its drafts for the next ``_pause`` steps (doubling it) while that pays less than decoding. The step
        after a hold is judged on its own gain (one that pays ends the holds)."""
        self.timed(seconds)
        if self._decode_seconds is None or seconds <= 0 or rows < 2:  # one row: its own pace backs off (Pace)
            return
        gain = emitted / rows * self._decode_seconds / seconds
        # the step after a hold measures anew: the mean before it is what the hold already answered
        self.gain = gain if self.gain is None or self._probing else 0.5 * self.gain + 0.5 * gain
        self._probing = False
        if self.gain < 1.0 and self.settings.hold:
            self._hold, self._pause, self._probing = self._pause, min(MAX_PAUSE, self._pause * 2), True
        else:
            self._pause = FIRST_HOLD

    def pays(self, rows: int) -> bool:
        """Whether the draft model drafts this step for ``rows`` rows: while a drafted token (a forward of the
        draft for one row) costs less than what it saves on average (its row's share of a step, times the
        acceptance so far); always for ngram, and once every ``MAX_PAUSE`` steps to measure anew."""
        draft = self.draft_model
        if draft is None or draft.token_seconds is None or self.step_seconds is None:
            return True
        with self.counters.lock:
            rate = self.counters.accepted / self.counters.drafted if self.counters.drafted else 1.0
        if rate * self.step_seconds / rows > draft.token_seconds or self._idle >= MAX_PAUSE:
            self._idle = 0
            return True
        self._idle += 1
        return False

    def _draft(self, h: RequestHandle, most: int) -> list[int]:
        pace = self._paces.setdefault(h.id, Pace(self.settings.num_tokens))
        room = h.request.max_new_tokens - len(h.tokens) - 1  # the step chooses one more token after the drafts
        k = min(most, room, pace.allowed())
        if h.done or k < 1:
            return []
        seq = list(h.request.prompt_ids) + h.tokens
        if self.draft_model is not None:
            draft = self.draft_model.draft(h.id, seq, k)
        else:
            draft = ngram_draft(seq, k, self.settings.ngram_min, self.settings.ngram_max)
        if draft and h.grammar is not None:
            draft = draft[:h.grammar.allowed_prefix(draft)]
        return draft

    def accept(self, h: RequestHandle, draft: list[int], logits: torch.Tensor,
               choose: Callable[[RequestHandle, torch.Tensor], int | None]) -> int:
        """Choose ``h``'s tokens from its verified positions (``logits``: ``[len(draft) + 1, vocab]``) while the
        chosen token equals the draft; ``choose`` pushes one token (None once the row ended). Returns how many
        of the row's new positions its cache keeps (its last token's, then each accepted draft's)."""
        pushed = accepted = 0
        for j in range(len(draft) + 1):
            token = None if h.done else choose(h, logits[j])
            if token is None:  # cancelled, or failed
                break
            pushed += 1
            if j == len(draft) or token != draft[j]:
                break
            accepted += 1
            if h.done:  # the accepted token ended it (EOS, a stop string, max_tokens)
                break
        self._count(h, len(draft), accepted, pushed)
        return max(1, pushed)

    def _count(self, h: RequestHandle, drafted: int, accepted: int, emitted: int) -> None:
        pace = self._paces.get(h.id)
        if pace is not None:
            pace.after(drafted, accepted, self.settings.num_tokens)
        with self.counters.lock:
            self.counters.drafted += drafted
            self.counters.accepted += accepted
            self.counters.emitted += emitted

    def stepped(self, with_chunk: bool = False) -> None:
        with self.counters.lock:
            self.counters.steps += 1
            self.counters.with_chunk += with_chunk

    def stats(self) -> dict[str, int]:
        c = self.counters
        with c.lock:
            return {"speculative_drafted": c.drafted, "speculative_accepted": c.accepted,
                    "speculative_steps": c.steps, "speculative_emitted": c.emitted,
                    "speculative_steps_with_chunk": c.with_chunk}
