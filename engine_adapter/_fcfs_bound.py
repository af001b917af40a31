"""No turn waits longer than first-come-first-served would have made it wait, counted in the node's own work.

Why: program FCFS, pins and warm-first move waiting onto the youngest programs' first turns, and the
TTFT tail is theirs (docs/benchmarks.md, "The TTFT tail"): stock vLLM's FCFS spreads the same peak over
every turn. A fixed deadline in seconds (``ttft_deadline_s``) bounds that tail only at one load; this bound
moves with the load. When a turn arrives, the prefill tokens queued ahead of it (the waiting turns' prompts
less what each finds cached, and what running turns have still to prefill) are what FCFS would compute
before it, and its own uncached prompt after: FCFS's time to its first token, in tokens. The turn may take
``1 + slack`` times that: once the node has computed, since the turn arrived, the work ahead plus ``slack``
times the work ahead and its own, it is due and goes ahead of every program (oldest due first). Below that
the program order and the kept contexts decide. Counted in tokens, not seconds, so no price is assumed.
Its own work counts so that a turn arriving at an empty queue still lets a pinned or higher-priority turn
arriving just after it go first (with the work ahead alone it was due at once, and the queue was FCFS).

Each scheduler keeps one: the vLLM node's (``HINTFLOW_FCFS_SLACK``; 0.5 by default without a host tier, off
with one) and the embedded node's (``SchedulerConfig.fcfs_slack``; None: off). Measured on the real CPU vLLM
node (docs/benchmarks.md, "An FCFS bound on the queue"): device-only, slack 0.5 lowered the mean JCT 5-8%
and the p99 TTFT 1-9% in three paired runs; with the short host tier it lost both (mean +3-6%, p99 TTFT
+7-16%, two pairs); slack 1 was mixed at both. In the replay on a GPU's prices it costs 0-20% of mean JCT,
so the replay's ``hintflow`` row runs without it.
"""

from __future__ import annotations

import math

__all__ = ["FcfsBound"]


class FcfsBound:
    """The prefill tokens computed so far, and the count at which each waiting turn falls due."""

    def __init__(self, slack: float) -> None:
        if not slack >= 0.0:  # (NaN too)
            raise ValueError(f"the FCFS bound's slack must be >= 0 (inf: off), got {slack!r}")
        self.slack = slack
        self.num_computed_tokens = 0  # prefill tokens computed since the node started
        self._due: dict[str, float] = {}  # request id -> num_computed_tokens at which it falls due
        self.num_due = 0  # turns that fell due (each counted once)

    @property
    def enabled(self) -> bool:
        return math.isfinite(self.slack)

    def arrived(self, request_id: str, num_tokens_ahead: int, num_own_tokens: int) -> None:
        """A turn joined the queue with ``num_tokens_ahead`` prefill tokens queued before it and
        ``num_own_tokens`` of its own prompt to compute."""
        if self.enabled:
            ahead, own = max(0, num_tokens_ahead), max(0, num_own_tokens)
            self._due[request_id] = self.num_computed_tokens + ahead + self.slack * (ahead + own)

    def computed(self, num_prefill_tokens: int) -> None:
        """A step computed ``num_prefill_tokens`` of prompt (decode tokens not counted)."""
        self.num_computed_tokens += max(0, num_prefill_tokens)

    def due(self, request_ids: list[str]) -> list[str]:
        """Those of ``request_ids`` (waiting) that fell due; each is reported once, then forgotten."""
        out = [r for r in request_ids if (d := self._due.get(r)) is not None and self.num_computed_tokens >= d]
        for r in out:
            del self._due[r]
        self.num_due += len(out)
        return out

    def forget(self, request_id: str) -> None:
        """The turn started or went away."""
        self._due.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._due)
