"""One request of one session's turn: its tokens, progress and accounting, and its place in the queue.

``Request.sort_key`` is the queue order the scheduler's module docstring describes (preempted first,
then pins, priority, program age, arrival).  Why apart from ``_scheduler``: the engine, its server,
metrics and the replay all hold requests without scheduling them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

from ._prefix_plan import PlanMemo
from ._queue_place import holds_pin, queue_place
from ._session import Session

__all__ = ["Request", "RequestState"]


class RequestState(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: str
    session: Session
    prompt: list[int]
    max_new_tokens: int
    arrival_s: float
    priority: int | None = None
    stop_token_ids: frozenset[int] = frozenset()
    on_event: Callable[[Request, list[int], bool], None] | None = None  # (req, new tokens, finished)
    output: list[int] = field(default_factory=list)
    num_computed: int = 0
    state: RequestState = RequestState.WAITING
    cold: bool = False
    preempted: bool = False
    overdue: bool = False  # waited past the scheduler's TTFT deadline
    # FCFS would have started it by now (``_fcfs_bound``): sorts as an overdue one, but unlike the
    # deadline makes no pin give way and passes the admission guard as any turn (the vLLM node's rule)
    fcfs_due: bool = False
    admit_reason: str | None = None  # why program admission last let this first turn through (not yet counted)
    num_preemptions: int = 0
    finish_reason: str = ""
    # accounting at first admission
    admitted: bool = False
    num_cached_tokens: int = 0
    num_host_hit_tokens: int = 0
    num_history_tokens: int = 0
    num_recomputed_tokens: int = 0  # history computed again, plus what a preemption lost and redid
    num_computed_at_preemption: int = 0
    # its session's pause fate and the prompt tokens found cached when it arrived (``Scheduler.add``; what
    # it then loses while it waits is ``queued``: _lost_context)
    arrival: tuple[str, int] | None = None
    is_first_turn: bool = False
    first_scheduled_s: float | None = None
    first_token_s: float | None = None
    finished_s: float | None = None
    _seq: int = 0
    # The last prefix plan's walk, reused while the request waits and nothing it read changed (the
    # scheduler re-plans every queued request at every step it looks at them).
    _plan_memo: PlanMemo = field(default_factory=PlanMemo, repr=False)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output if self.output else self.prompt

    def token_slice(self, start: int, end: int) -> list[int]:
        """``tokens[start:end]`` without building ``tokens`` (a decode step wants one token of a long context)."""
        n = len(self.prompt)
        if end <= n:
            return self.prompt[start:end]
        if start >= n:
            return self.output[start - n : end - n]
        return self.prompt[start:] + self.output[: end - n]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def queue_wait_s(self) -> float:
        return (self.first_scheduled_s or self.arrival_s) - self.arrival_s

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s

    def sort_key(self, aging_s: float | None = None) -> tuple[int, int, int, float, float, int]:
        if self.overdue or self.fcfs_due:  # after preempted requests, before everything else, by arrival
            return (0 if self.preempted else 1, -1, -1, self.arrival_s, self.arrival_s, self._seq)
        s = self.session
        prio = self.priority if self.priority is not None else s.priority_class
        start = s.program_start_s if s.program_start_s is not None else self.arrival_s
        band, start = queue_place(start, self.arrival_s, pinned=holds_pin(s.pin_deadline_s, s.pinned_blocks), aging_s=aging_s)
        return (0 if self.preempted else 1, band, prio, start, self.arrival_s, self._seq)
