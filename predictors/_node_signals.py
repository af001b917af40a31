"""Two things a node measures about itself that price a pin where it has no host tier: how much of its
step time goes to prefill, and how much of a context it does not pin is still there when its turn returns.

Why these two (the measured price, ``ContinuumTTL(prefill_share=...)``): a pin trades device memory for
prefill work.  The memory it holds is worth what memory buys an engine that has it, more sequences in
each decode step sharing one weight read; the work it saves is a re-prefill, engine time taken from every
turn queued behind it.  Which of the two is scarce is a property of the node's load: on the CPU vLLM node
running the agent benchmark (turns of 10-20 output tokens) prefill is about 80% of step time and a pin
that saves a re-prefill is what makes a turn faster; on the replay's multi-agent workload (long decodes on
an H100 cost model) prefill is about 30% of it, and the same pins slowed every turn by taking decode
batch slots.  And a context that is not pinned is not always lost: on multi-agent six in ten of its
tokens were still on the device when the turn came back, so a pin saves the re-prefill of the rest only.

Both engines feed the same two classes: the embedded engine from its executor's steps and its prefix
plans, the vLLM node from its scheduler outputs' timings and its prefix lookups.
"""

from __future__ import annotations

import math

from predictors._host_hit import HOST_HIT_DECAY, TokenShare

__all__ = ["PREFILL_SHARE_DECAY", "PrefillShare", "UnpinnedSurvival"]

PREFILL_SHARE_DECAY = 0.995
"""Weight of the past per engine step: about the last 200 steps (seconds on a busy node)."""


class PrefillShare:
    """The share of the engine's step time spent prefilling, decayed per step (0 before any step).

    A step's prefill time is its duration less what a step of decodes alone lasts lately (the mean of
    recent decode-only steps, which share one weight read however many sequences they hold); a step with
    no decodes is all prefill, one with no prefill all decode.  No cost model needed: the vLLM node has
    none, and the embedded engine's executor may be the real torch one."""

    def __init__(self, decay: float = PREFILL_SHARE_DECAY) -> None:
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"decay must be in [0, 1), got {decay}")
        self.decay = decay
        self._decode_step_s: float | None = None
        self._prefill_s = 0.0
        self._total_s = 0.0
        self.total_prefill_s = 0.0  # over the node's life, undecayed (reports)
        self.total_step_s = 0.0

    def observe(self, num_prefill_tokens: int, num_decodes: int, seconds: float) -> None:
        """One model step: ``num_prefill_tokens`` prompt tokens computed and ``num_decodes`` sequences
        decoded in ``seconds``."""
        if not (seconds > 0.0 and math.isfinite(seconds)) or (num_prefill_tokens <= 0 and num_decodes <= 0):
            return
        if num_prefill_tokens <= 0:
            d = self._decode_step_s
            self._decode_step_s = seconds if d is None else 0.9 * d + 0.1 * seconds
            prefill = 0.0
        elif num_decodes <= 0:
            prefill = seconds
        else:
            prefill = min(seconds, max(0.0, seconds - (self._decode_step_s or 0.0)))
        self._prefill_s = self.decay * self._prefill_s + prefill
        self._total_s = self.decay * self._total_s + seconds
        self.total_prefill_s += prefill
        self.total_step_s += seconds

    def fraction(self) -> float:
        return self._prefill_s / self._total_s if self._total_s > 0.0 else 0.0


class UnpinnedSurvival(TokenShare):
    """Token-weighted share of a returning turn's context found on the device when no pin held it, with
    decay (0 before any is seen: an unpinned context is taken as lost until one is seen to survive)."""

    def __init__(self, decay: float = HOST_HIT_DECAY) -> None:
        super().__init__(decay, default=0.0)

    def observe(self, history_tokens: int, device_hit_tokens: int) -> None:
        """A returning turn whose context no pin held was admitted: of its ``history_tokens`` (what its
        session had computed), ``device_hit_tokens`` were still on the device."""
        if history_tokens > 0:
            self._add(min(max(device_hit_tokens, 0), history_tokens), history_tokens)
