"""What a node's host tier gives back: the share of evicted contexts' tokens that returning turns found
on the host, token-weighted with decay.

Why one estimator: a pin on a node with a host tier saves a copy back only for the part of a context the
host would have kept; for the rest it saves a re-prefill. A host tier smaller than what it is given keeps
little (the vLLM host connector, write-through with LRU drops, gave back 0.1% at half the device pool),
and a pin priced as a cheap copy back there is a pin not taken (the vLLM node's hintflow mode went from
1.00x to 0.60x stock's mean JCT once it priced pins by this share). The vLLM node's inference, the
embedded engine and the orchestrator's policy (through ``CacheState.host_hit_fraction``) read the same
figure from this class.
"""

from __future__ import annotations

__all__ = ["HOST_HIT_DECAY", "HostHitShare", "TokenShare"]

HOST_HIT_DECAY = 0.98
"""Weight of the past per returning turn whose context had left the device: about the last 50 turns."""


class TokenShare:
    """A token-weighted share with decay: ``got`` of ``needed`` tokens per observation, the past weighed by
    ``decay`` per observation; ``default`` before any is seen.  Undecayed totals for reports."""

    def __init__(self, decay: float, default: float) -> None:
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"decay must be in [0, 1), got {decay}")
        self.decay = decay
        self.default = default
        self._got = 0.0
        self._needed = 0.0
        self.num_observed = 0
        self.total_got_tokens = 0
        self.total_tokens = 0

    def _add(self, got: int, needed: int) -> None:
        self._got = self.decay * self._got + got
        self._needed = self.decay * self._needed + needed
        self.total_got_tokens += got
        self.total_tokens += needed
        self.num_observed += 1

    def fraction(self) -> float:
        return self._got / self._needed if self._needed > 0 else self.default

    def run_fraction(self) -> float:
        """The share over every observation, undecayed (what a replay's report gives for a whole run);
        ``default`` before any is seen."""
        return self.total_got_tokens / self.total_tokens if self.total_tokens > 0 else self.default


class HostHitShare(TokenShare):
    """Token-weighted share of evicted contexts that came back from the host tier (1 before any is seen:
    a host tier is taken to work until it is seen not to)."""

    def __init__(self, decay: float = HOST_HIT_DECAY) -> None:
        super().__init__(decay, default=1.0)

    def observe(self, history_tokens: int, device_hit_tokens: int, host_hit_tokens: int) -> None:
        """A returning turn was admitted: of its ``history_tokens`` (what its session computed before), the
        part not found on the device was, up to ``host_hit_tokens``, loaded from the host tier."""
        missing = history_tokens - min(max(device_hit_tokens, 0), history_tokens)
        if missing <= 0:
            return  # all on the device: says nothing about the host
        self._add(min(max(host_hit_tokens, 0), missing), missing)
