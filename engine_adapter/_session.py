"""One session's KV context as the KV manager keeps it: its tokens, block ids on both tiers, and its hints.

Why apart from ``_kv_manager``: the scheduler, the prefix planner and the engine all read a ``Session``;
only the KV manager changes its blocks (see its module docstring for the picture of one context).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

__all__ = ["Session", "SessionState"]


class SessionState(Enum):
    PARKED = "parked"
    WAITING = "waiting"
    RUNNING = "running"


@dataclass(eq=False)
class Session:
    session_id: str
    program_id: str
    created_s: float
    token_ids: list[int] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    host_block_ids: list[int] = field(default_factory=list)
    # A write-through host tier's copies of the leading device blocks (``block_ids[:len(...)]``), saved as
    # turns end; empty unless the node's host tier is write-through (see ``_host_tier``).
    saved_host_ids: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # chained hash of each full logical block
    state: SessionState = SessionState.PARKED
    last_used_s: float = 0.0
    # When the host tier last saved a block of this context or loaded its chain: the clock of a host tier
    # that drops least recently saved or loaded chains first, as the vLLM node's connector does
    # (``SessionTable(host_lru=True)``; ``HostLRUPolicy``)
    host_used_s: float = 0.0
    next_use_deadline_s: float | None = None
    pin_deadline_s: float | None = None
    pinned_blocks: int = 0
    pin_seq: int = 0
    prefetch_at_s: float | None = None
    priority_class: int = 0
    program_start_s: float | None = None  # from a Priority hint: program-level FCFS
    expected_output_tokens: int | None = None
    num_turns: int = 0
    released: bool = False
    pause_fate: str = "unpinned"  # what became of its context since its last turn (_lost_context.PAUSE_FATES)
    # Bumped by the KV manager on every change to token_ids, block_ids, block_hashes or host_block_ids:
    # a PlanMemo's plan over them is stale once it moves.
    epoch: int = 0

    def __hash__(self) -> int:
        return id(self)

    @property
    def num_device_tokens(self) -> int:
        return min(len(self.token_ids), len(self.block_ids) * self._bs)

    @property
    def num_host_tokens(self) -> int:
        end = min(len(self.token_ids), (len(self.block_ids) + len(self.host_block_ids)) * self._bs)
        return max(0, end - self.num_device_tokens)

    _bs: int = 16
