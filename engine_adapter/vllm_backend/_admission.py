"""Queue rules of the vLLM scheduler subclass: TTFT deadline, pins yielding to older programs, program admission.

Why apart from ``_scheduler``: these decide *which waiting request may go next*, on top of vLLM's own
priority queue; the scheduler module wires hintflow into vLLM's step (sessions, pins, hint inference,
logging). A mixin over ``vllm.v1.core.sched.scheduler.Scheduler`` (it calls ``super()`` for vLLM's own
per-request check) without importing vLLM, so it reads as plain Python.

- ``_promote_overdue``: a request that has waited ``ttft_deadline_s``, or that FCFS would have started by
  now (``engine_adapter/_fcfs_bound.py``), goes ahead of every program;
- ``_sync_pinned_band``: a waiting turn whose session holds a pin goes ahead of unpinned ones of its class
  (its memory is reserved for it: serving it turns the pin into progress and frees it), and falls back
  when its pin is dropped while it waits; the embedded scheduler's queue order (``Request.sort_key``);
  then warm turns ahead of cold ones (``HINTFLOW_WARM_FIRST``, ``_warm``), re-judged each step too;
- ``_yield_pins_to_older``: pins of programs younger than a waiting turn this step could start let go until
  it fits (in queue order);
- program admission (``_handle_blocked_waiting_request``): a program's first turn waits while the contexts
  of the programs in flight fill the pool, unless the engine would idle or it has waited long enough
  (the rule is ``engine_adapter/_program_admission.py``'s, the embedded node's too).
"""

from __future__ import annotations

import math
import time
from typing import Any

from engine_adapter._fcfs_bound import FcfsBound
from engine_adapter._pin_order import yield_order
from engine_adapter._program_admission import ADMIT_HORIZON_S, admit_verdict

from ._sessions import VSession, session_start

__all__ = ["ADMIT_HORIZON_S", "CLASS_SCALE", "PRIORITY_SCALE", "QueueRules"]

PRIORITY_SCALE = 10**12
"""Milliseconds of program age fit below this (31 years): a request's vLLM priority is
``class * CLASS_SCALE + band * PRIORITY_SCALE + ms``, so it orders by class, then band, then program start."""
CLASS_SCALE = 3 * PRIORITY_SCALE
"""One priority class spans three bands: turns whose session holds a pin (band 0), warm turns (band 1),
then the rest (band 2): ``engine_adapter._queue_place``."""


class QueueRules:
    """Mixed into ``HintSchedulerMixin`` (which provides the attributes used here: ``book``, ``waiting``,
    ``running``, ``requests``, ``block_size``, ``kv_cache_manager``, ``policy``, the ``admit_*`` and
    ``ttft_deadline_s`` settings, ``_req_session``, ``_started``, ``_overdue``, ``_admit``)."""

    # attributes the scheduler sets (declared for type checkers)
    book: Any
    waiting: Any
    running: Any
    requests: dict[str, Any]
    block_size: int
    kv_cache_manager: Any
    policy: Any
    ttft_deadline_s: float
    fcfs_bound: FcfsBound
    admit_fraction: float
    admit_pool_blocks: int
    admit_max_wait_s: float
    admit_horizon_s: float
    admit_stats: dict[str, int]
    max_num_scheduled_tokens: int
    max_num_running_reqs: int
    yield_pins_to: str
    _admit_reason: dict[str, str]
    _req_session: dict[str, VSession]
    _started: set[str]
    _overdue: set[str]
    _admit: list[Any] | None
    _wall_epoch_s: float

    def _promote_overdue(self) -> None:
        """Requests that have waited ``HINTFLOW_TTFT_DEADLINE_S``, or that FCFS would have started by now
        (``HINTFLOW_FCFS_SLACK``, ``FcfsBound``), go ahead of every program, oldest first.

        Why: program FCFS and pins move waiting onto the youngest programs' turns; the deadline and the
        bound cap that tail (first token no later than the deadline, or than FCFS's start, plus service),
        while below them the program order and the kept contexts decide.
        """
        deadline = math.isfinite(self.ttft_deadline_s)
        if (
            not (deadline or self.fcfs_bound.enabled)
            or getattr(self.policy, "name", "") != "PRIORITY"
            or not self.waiting
        ):
            return
        now = time.time()
        waiting = [r for r in self.waiting if r.request_id not in self._overdue]
        due = set(self.fcfs_bound.due([r.request_id for r in waiting])) if self.fcfs_bound.enabled else set()
        late = [
            r for r in waiting
            if r.request_id in due or (deadline and now - r.arrival_time >= self.ttft_deadline_s)
        ]  # fmt: skip
        if not late:
            return
        self.waiting.remove_requests(late)
        for r in late:
            self._overdue.add(r.request_id)
            ms = max(0, int((r.arrival_time - self._wall_epoch_s + 86400.0) * 1000))
            r.priority = -PRIORITY_SCALE + min(ms, PRIORITY_SCALE - 1)  # below every class: first
            self.waiting.add_request(r)

    def _sync_pinned_band(self) -> None:
        """Re-key waiting requests whose band changed since they were keyed: their session gained or lost its
        pin, or their context was cached or evicted meanwhile (warm or cold, ``is_warm``)."""
        if getattr(self.policy, "name", "") != "PRIORITY" or not self.waiting:
            return
        moved = []
        for r in self.waiting:
            if r.request_id in self._overdue:
                continue
            want = self._requeue_priority(r)
            if want is not None and want != r.priority:
                moved.append((r, want))
        if not moved:
            return
        self.waiting.remove_requests([r for r, _ in moved])
        for r, want in moved:
            r.priority = want
            self.waiting.add_request(r)

    def _requeue_priority(self, request: Any) -> int | None:  # (the scheduler's; None: leave it as it is)
        raise NotImplementedError

    def _yield_pins_to_older(self) -> None:
        """Drop pins of programs younger than a waiting turn that memory cannot take (youngest first) until
        it fits, for the turns this step can start, in queue order (``yield_pins_to``: ``head`` looks at the
        queue's head alone, the rule before eaf0937).

        Why: a pin is a bet that its program comes back soon; it must not make an older program's turn
        that is already here wait (work conservation; program FCFS decides who is older). Not only the
        head: a pinned session's turn goes first (``_sync_pinned_band``) and fits in its own pin, while
        the unpinned turns behind it, which vLLM would start in the same step, found the pool held by
        pins and waited (the embedded node's scheduler asks every turn it tries, ``_scheduler``).
        """
        if not self.book.num_pinned_blocks or not self.waiting:
            return
        free = self.kv_cache_manager.block_pool.get_num_free_blocks()
        tokens_left = self.max_num_scheduled_tokens - len(self.running)  # (a decode token per running request)
        seats_left = self.max_num_running_reqs - len(self.running)
        for r in self.waiting:  # (a priority queue iterates in order)
            if tokens_left <= 0 or seats_left <= 0 or not self.book.num_pinned_blocks:
                return
            rs = self._req_session.get(r.request_id)
            if rs is None:
                return  # anonymous traffic does not outrank pins: that is what pins protect against
            done = max(len(rs.held) * self.block_size, r.num_computed_tokens)  # tokens it need not compute
            chunk = min(max(0, r.num_tokens - done), tokens_left)
            need = -(-(done + chunk) // self.block_size) + 1 - len(rs.held)
            if need > free:
                pinned = [x for x in self.book.sessions.values() if x.held and x is not rs]
                for x in yield_order(pinned, session_start(rs), start=session_start, seen=lambda v: v.first_seen_s):
                    free += self.book.drop_pin(x, yielded=True)
                    if need <= free:
                        break
            if need > free or self.yield_pins_to == "head":
                return  # vLLM's step stops at the first waiting turn it cannot place
            free -= need
            tokens_left -= chunk
            seats_left -= 1

    # ---- program admission ----------------------------------------------------------------------------
    def _is_new_program_turn(self, request: Any) -> bool:
        """A first turn of a program this engine has not yet run (the only requests admission may hold)."""
        s = self._req_session.get(request.request_id)
        return (
            s is not None
            and request.num_computed_tokens == 0
            and request.num_preemptions == 0
            and s.program_id not in self._started
        )

    def _admission_state(self) -> list[Any]:
        """[blocks the in-flight programs' contexts need, whether the engine would idle without new programs].

        In flight: programs with an admitted turn that are still known to the book. Each session counts
        its live requests' full length, else its pinned blocks, else (parked, unpinned, active within
        the horizon) its last turn's blocks: the context it will want back.
        """
        self._started &= set(self.book.programs)
        bs, now = self.block_size, self.book.clock()
        need = 0
        for pid in self._started:
            for sid in self.book.programs.get(pid, ()):
                s = self.book.sessions.get(sid)
                if s is None or s.released:
                    continue
                if s.live:
                    for rid in s.live:
                        r = self.requests.get(rid)
                        need += -(-r.num_tokens // bs) if r is not None else 0
                elif s.held:
                    need += len(s.held)
                elif now - s.last_active_s < self.admit_horizon_s:
                    need += len(s.snapshot)
        others = any(not self._is_new_program_turn(r) for r in self.waiting)
        return [need, not self.running and not others]

    def _handle_blocked_waiting_request(self, request: Any) -> bool:
        if not super()._handle_blocked_waiting_request(request):  # type: ignore[misc]  # vLLM's, via the MRO
            return False
        st = self._admit
        if st is None or not self._is_new_program_turn(request):
            return True
        blocks = -(-request.num_tokens // self.block_size)
        why = admit_verdict(
            st[0], blocks, self.admit_pool_blocks, self.admit_fraction,
            idle=st[1], waited_s=time.time() - request.arrival_time, max_wait_s=self.admit_max_wait_s,
        )  # fmt: skip
        if why is None:
            self.admit_stats["held"] += 1
            return False
        self._admit_reason[request.request_id] = why  # counted when vLLM schedules it
        st[0] += blocks
        st[1] = False
        return True
