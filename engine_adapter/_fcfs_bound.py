"""No turn waits longer than first-come-first-served would have made it wait, counted in the node's own work.

Why: program FCFS, pins and warm-first move waiting onto the youngest programs' first turns, and the
TTFT tail is theirs (docs/benchmarks.md, "The TTFT tail"): stock vLLM's FCFS spreads the same peak over
every turn. A fixed deadline in seconds (``ttft_deadline_s``) bounds that tail only at one load; this bound
moves with the load. When a turn arrives, the prefill tokens queued ahead of it (the waiting turns' prompts
less what each finds cached, and what running turns have still to prefill) are what FCFS would compute
before it. Once the node has computed that many prefill tokens since the turn arrived, times ``1 + slack``,
FCFS would have started it: it is due, and goes ahead of every program (oldest due first). Below that the
program order and the kept contexts decide. Counted in tokens, not seconds, so no price is assumed.

The vLLM node keeps one per scheduler (``HINTFLOW_FCFS_SLACK``; inf: off).
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

    def arrived(self, request_id: str, num_tokens_ahead: int) -> None:
        """A turn joined the queue with ``num_tokens_ahead`` prefill tokens queued before it."""
        if self.enabled:
            self._due[request_id] = self.num_computed_tokens + (1.0 + self.slack) * max(0, num_tokens_ahead)

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
