"""Decode-only stretches of a modeled node as one event: the same replay with far fewer events.

Why: most steps of an agent replay only decode (one new token for every running turn, nothing queued, no
tier copies); each costs a scheduler pass, an executor call and two events, and a replay's time grows with
their number.  While nothing else happens to the node, those steps are fully determined: the same turns
each decode one token, no block is allocated, no request finishes, and the cost model prices each from the
context lengths alone.  So when a step like that starts, the node plans the next ``m`` of them at once::

    step 0 (scheduled and executed as usual)  | bulk 1 | bulk 2 | ... | bulk m |  -> next step as usual
    t0                                        T0       T1       T2        Tm

and ``m`` stops before any turn would finish, before any turn needs a new block, and before the first step
that would start at or after a pin lease or a prefetch falls due (those act at a step's start).

Nothing is skipped, only deferred: each bulk step is applied (tokens committed and sampled exactly as the
modeled executor samples them, the pinned-memory integral and the per-step totals in the same order)
when the clock passes its end, or earlier than the window's end event whenever anything outside looks at
the node (``SimNode.engine`` syncs first).  Anything that may have changed the node (a submit, a hint that
sets a lease or a prefetch, an abort, an import) is checked at the same virtual time by a recheck event,
which ends the window with the step in flight if the next step would no longer be a bulk step; the node
then steps as usual.  ``tests/test_fast_forward.py`` checks that every policy's report is identical with
and without it.  Torch nodes never use it: their steps are measured, not priced.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine_adapter import ModeledExecutor, Request, RequestState, ScheduledBatch, StepOutput

if TYPE_CHECKING:
    from engine_adapter import EngineCore

__all__ = ["DecodeWindow", "apply_bulk_step", "plan_window", "window_cut"]


@dataclass(eq=False)
class DecodeWindow:
    """Step 0 (a real batch and its output) and bulk steps 1..m, with end times ``ends[s]``."""

    batch: ScheduledBatch
    out: StepOutput
    reqs: list[Request]
    ends: list[float]
    elapsed: list[float]
    gen: int
    applied: int = 0  # steps applied so far (0 .. len(ends))
    recheck_pending: bool = False

    @property
    def last(self) -> int:
        return len(self.ends) - 1


def _bulk_ok(core: EngineCore, reqs: list[Request]) -> bool:
    """Would the next schedule() be a decode of exactly ``reqs`` and nothing else?"""
    sched = core.scheduler
    return (
        not sched.waiting
        and not core.kv.pending_copies
        and len(sched.running) == len(reqs)
        and all(r.state is RequestState.RUNNING for r in reqs)
        and set(map(id, sched.running)) == set(map(id, reqs))
    )


def plan_window(core: EngineCore, batch: ScheduledBatch, out: StepOutput, now_s: float, gen: int
                ) -> DecodeWindow | None:
    """A window starting with the step just executed (``batch`` at ``now_s``), or None when the steps after it
    are not all plain decodes of the same turns (then the node steps as usual)."""
    ex = core.executor
    sched = core.scheduler
    if not isinstance(ex, ModeledExecutor) or batch.copies or core.observers or not batch.seqs:
        return None
    if sched.waiting or core.kv.pending_copies or len(batch.seqs) != len(sched.running):
        return None
    by_id = {r.request_id: r for r in sched.running}
    reqs = [by_id.get(seq.request_id) for seq in batch.seqs]
    bs = core.block_size
    m = 1 << 30
    for req, seq in zip(reqs, batch.seqs, strict=True):
        if (req is None or len(seq.token_ids) != 1 or not seq.sample or req.first_token_s is None
                or req.on_event is not None or req.stop_token_ids):
            return None
        c = seq.start_pos  # step 0 decodes position c; bulk step s decodes c + s
        if req.num_computed != c or req.num_tokens - c != 1:
            return None
        m = min(m, req.max_new_tokens - len(req.output) - 2)  # after step s it has output o + 1 + s; none ends
        m = min(m, len(req.session.block_ids) * bs - c - 1)  # step s needs c + s + 1 positions: no new block
    if m < 1:
        return None
    cm = ex.cost_model
    n = len(reqs)
    ctx = sum(seq.start_pos + 1 for seq in batch.seqs)
    deadline = core.kv.next_due_s()
    ends, elapsed = [now_s + out.elapsed_s], [out.elapsed_s]
    for _ in range(m):
        if ends[-1] >= deadline:  # the next step would start at or after a lease or prefetch falls due
            break
        ctx += n
        e = cm.decode_time(n, ctx)
        elapsed.append(e)
        ends.append(ends[-1] + e)
    if len(ends) == 1:
        return None
    return DecodeWindow(batch, out, [r for r in reqs if r is not None], ends, elapsed, gen)


def apply_bulk_step(core: EngineCore, win: DecodeWindow) -> None:
    """Bulk step ``win.applied`` (>= 1) as ``scheduler.update`` would apply its decode batch."""
    ex = core.executor
    assert isinstance(ex, ModeledExecutor)
    kv = core.kv
    for req in win.reqs:
        if req.state is not RequestState.RUNNING:  # aborted while the step ran: update skips it too
            continue
        kv.commit_tokens(req.session, [req.output[-1]])
        req.num_computed += 1
        req.output.append(ex.sample_at(req.request_id, req.num_computed))
    core._changed()


def window_cut(core: EngineCore, win: DecodeWindow, in_flight: int) -> int:
    """The last step the window may still run, given the node as it is now: the step in flight, or the last
    bulk step that would start before the node's next lease or prefetch falls due (the node's state only
    changes through what rechecks it, so one look decides every later step)."""
    if not _bulk_ok(core, win.reqs):
        return in_flight
    # bulk step s starts at ends[s - 1]: keep those that start before the deadline
    keep = bisect.bisect_left(win.ends, core.kv.next_due_s(), lo=in_flight, hi=win.last)
    return max(in_flight, keep)
