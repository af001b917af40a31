"""Continuous batching with chunked prefill, program-level priority, and a cold-prefill budget.

Each step fills a token budget in this order::

    1. running decodes              one token each
    2. running warm prefills        chunks of what is left of their prompts
    3. waiting warm requests        admitted in queue order
    4. running cold prefills  \\     at most ``cold_prefill_budget_tokens`` together when 1-3 found work,
    5. waiting cold requests  /     the whole remaining budget when they did not (work-conserving)

A request is *cold* when more than ``warm_threshold_tokens`` of its prompt must be computed (a new
session, or a context that was evicted; with ``resumes_are_warm`` only a session's first turn here); a
warm resume has most of its prompt cached.  So a huge cold
prompt advances every step yet cannot stand in front of the resumes that need only a few hundred tokens:
the queue-behind-a-prefill-backlog failure of seed 000.

Queue order: preempted requests first, then sessions holding a pin (their memory is reserved for them),
then the lower priority value, then the older program (``Priority`` hints; without one, the request's
own arrival: plain FCFS), then arrival.  When a running request cannot get a block, the running request
that sorts last is preempted: its context is parked (evictable, unpinned) and it rejoins the queue front.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass

from ._executor import Clock, ScheduledBatch, ScheduledSeq, StepOutput
from ._fcfs_bound import FcfsBound
from ._kv_manager import KVCacheManager
from ._lost_context import split_lost
from ._program_admission import (
    ADMIT_HORIZON_S,
    InFlight,
    admit_verdict,
    working_set,
)
from ._queue_place import WARM_THRESHOLD_TOKENS, is_warm
from ._request import Request, RequestState
from ._session import SessionState

__all__ = ["Request", "RequestState", "Scheduler", "SchedulerConfig"]


class _Step:
    """The batch being built: remaining token budget, and what cold prefills may still take."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.cold_left = budget
        self.seqs: list[ScheduledSeq] = []
        self.scheduled: set[str] = set()
        self.in_flight: InFlight | None = None  # computed when a new program first asks to start

    def limit(self, want: int, cold: bool) -> int:
        return min(want, self.budget, self.cold_left) if cold else min(want, self.budget)

    def spend(self, n: int, cold: bool) -> None:
        self.budget -= n
        if cold:
            self.cold_left -= n


@dataclass
class SchedulerConfig:
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    cold_prefill_budget_tokens: int = 512
    warm_threshold_tokens: int = WARM_THRESHOLD_TOKENS
    # False: one admission pass in queue order, every waiting turn counted warm (vLLM's FCFS, where a
    # resume whose context survived waits behind cold prompts; the replay's stock rows and the mirrors of
    # nodes that lack the rule). True (ours): warm turns first (``_queue_place.is_warm``).
    warm_first: bool = True
    # Program-level FCFS gives an older program's turns precedence over a newer one's; with aging, that
    # head start is at most this many seconds, so a young program's first turns cannot wait behind every
    # older program's later turns.  None: strict program FCFS (Continuum's order).
    program_fcfs_aging_s: float | None = None
    # A request that has waited this long sorts ahead of pins and program order (oldest first), so the
    # turns program FCFS and pins put last still see a first token within about this bound.  None: off.
    ttft_deadline_s: float | None = None
    # A waiting turn sorts there too once its first token is due at 1 + slack times FCFS's, counted in the
    # prefill computed since it arrived (``_fcfs_bound``).  None: off.
    fcfs_slack: float | None = None
    # How deep each admission pass (warm, then cold) looks into the queue for a request of its kind: a
    # warm resume overtakes at most this many queued cold ones.  Why a bound: an overloaded node with
    # thousands queued otherwise re-plans every one of them at every step (a replay of the Mooncake
    # conversation trace on two nodes spent two thirds of its time there and slowed quadratically).
    admission_lookahead: int = 64
    # A waiting turn that memory cannot take makes the pins of younger programs let go (youngest first)
    # until it fits: a pin never keeps an older program's turn waiting.  Off: pins hold until they expire
    # or the deadlock rule drops them (Continuum's rule).
    yield_pins_to_older: bool = False
    # Program admission (``_program_admission``): a program new to the node starts only while the whole
    # contexts of the programs in flight here plus its prompt fit in this fraction of the device pool; it
    # waits otherwise (smaller requests behind it go), unless nothing else runs (work-conserving) or it
    # has waited ``admit_max_wait_s``.  None: off, a new program takes its blocks from the parked contexts.
    admit_fraction: float | None = None
    admit_max_wait_s: float | None = None
    admit_horizon_s: float = ADMIT_HORIZON_S
    # A turn of a session this node has served counts as warm even when it must recompute an evicted
    # tail: the cold cap is for new prompts, and a resume throttled behind them stalls a program mid-run.
    resumes_are_warm: bool = False
    # A waiting turn starts only while the pool could hold its whole prompt, not only the first chunk the
    # step's budget gives it (vLLM's ``scheduler_reserve_full_isl``, on by default since 0.32): with
    # chunked prefill, turns admitted on their first chunk preempt each other for the later ones (a
    # replay of a vLLM node at its 2,048-token budget preempted 159 times where vLLM preempted 3).
    admit_whole_prompt: bool = False


class Scheduler:
    def __init__(self, kv: KVCacheManager, clock: Clock, config: SchedulerConfig | None = None) -> None:
        self.kv = kv
        self.clock = clock
        self.config = config or SchedulerConfig()
        self.waiting: list[Request] = []  # sorted by sort_key
        self._waiting_keys: list[tuple[int, int, int, float, float, int]] = []
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.on_finish: Callable[[Request], None] | None = None
        self.num_preemptions = 0
        slack = self.config.fcfs_slack
        self.fcfs_bound = FcfsBound(math.inf if slack is None else slack)
        # program admission: checks that held a first turn back, and first turns it let in, by why
        # (``hintflow_admission_holds_total``, ``hintflow_admissions_total``)
        self.admit_stats = {"held": 0, "fit": 0, "idle": 0, "aged": 0}
        self._seq = itertools.count()
        self._resort = False

    # ---- queue ---------------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"duplicate request id {req.request_id!r}")
        req._seq = next(self._seq)
        self.requests[req.request_id] = req
        # what became of the context in the pause, and what of it is still here (the plan is the memo's:
        # the first admission pass reuses it while nothing changes)
        s = req.session
        req.arrival = (s.pause_fate, self.kv.plan_prefix(s, req.tokens, req._plan_memo).num_hit_tokens)
        if req.session.state is SessionState.PARKED:
            self.kv.set_waiting(req.session, arriving=True)
        if self.fcfs_bound.enabled:
            own = req.num_tokens - s.num_device_tokens - s.num_host_tokens
            self.fcfs_bound.arrived(req.request_id, self.prefill_backlog_tokens(), own)
        self._enqueue(req)

    def _enqueue(self, req: Request) -> None:
        req.state = RequestState.WAITING
        key = req.sort_key(self.config.program_fcfs_aging_s)
        i = bisect.bisect(self._waiting_keys, key)
        self._waiting_keys.insert(i, key)
        self.waiting.insert(i, req)

    def mark_priorities_changed(self) -> None:
        self._resort = True

    def _remove_waiting(self, req: Request) -> None:
        i = self.waiting.index(req)
        del self.waiting[i]
        del self._waiting_keys[i]

    def abort(self, request_id: str) -> bool:
        req = self.requests.get(request_id)
        if req is None or req.state is RequestState.FINISHED:
            return False
        if req.state is RequestState.WAITING:
            self._remove_waiting(req)
            self.fcfs_bound.forget(req.request_id)
            req._plan_memo.release()
        else:
            self.running.remove(req)
        self._finish(req, "abort")
        return True

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.kv.pending_copies)

    def prefill_backlog_tokens(self) -> int:
        """Prompt tokens still to compute: the queue a new cold request would wait behind."""
        total = 0
        for req in self.waiting:
            s = req.session
            total += max(0, req.num_tokens - s.num_device_tokens - s.num_host_tokens)
        for req in self.running:
            total += max(0, len(req.prompt) - req.num_computed)
        return total

    # ---- one step ------------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        self.kv.tick()
        self._mark_overdue()
        if self._resort:
            keyed = sorted(
                ((r.sort_key(self.config.program_fcfs_aging_s), r) for r in self.waiting),
                key=lambda kr: kr[0],
            )
            self._waiting_keys = [k for k, _ in keyed]
            self.waiting = [r for _, r in keyed]
            self._resort = False
        step = _Step(self.config.max_num_batched_tokens)
        for cold in (False, True):
            if cold:  # the cap holds only while warm work shares the step: work-conserving
                step.cold_left = self.config.cold_prefill_budget_tokens if step.seqs else step.budget
            order = sorted(
                self.running,
                key=lambda r: (
                    r.num_tokens - r.num_computed > 1,
                    r.sort_key(self.config.program_fcfs_aging_s),
                ),
            )
            for req in order:
                pending = req.num_tokens - req.num_computed
                if req.request_id in step.scheduled or req.state is not RequestState.RUNNING:
                    continue
                if pending > 1 and req.cold != cold:
                    continue
                chunk = step.limit(pending, cold and pending > 1)
                if chunk > 0:
                    self._run(step, req, chunk, cold and pending > 1)
            self._admit(step, cold)
        return ScheduledBatch(seqs=step.seqs, copies=self.kv.take_copies())

    def _mark_overdue(self) -> None:
        deadline = self.config.ttft_deadline_s
        if (deadline is None and not self.fcfs_bound.enabled) or not self.waiting:
            return
        now = self.clock.now()
        fresh = [r for r in self.waiting if not r.overdue and r.first_token_s is None]
        if self.fcfs_bound.enabled:
            due = set(self.fcfs_bound.due([r.request_id for r in fresh if not r.fcfs_due]))
            for req in fresh:
                if req.request_id in due:
                    req.fcfs_due = self._resort = True
        if deadline is not None:
            for req in fresh:
                if now - req.arrival_s >= deadline:
                    req.overdue = self._resort = True

    def _run(self, step: _Step, req: Request, chunk: int, cold: bool) -> bool:
        """Reserve blocks for ``chunk`` more tokens of a running request (preempting if it must)."""
        while not self.kv.ensure_slots(req.session, req.num_computed + chunk):
            victim = self._preemption_victim(exclude=step.scheduled)
            if victim is not None and victim is not req:
                self._preempt(victim)
            elif not self.kv.force_unpin_latest():
                self._preempt(req)
                return False
        toks = req.token_slice(req.num_computed, req.num_computed + chunk)
        sample = req.num_computed + chunk == req.num_tokens
        step.seqs.append(
            ScheduledSeq(
                req.request_id, toks, req.num_computed, list(req.session.block_ids), sample, len(req.prompt)
            )
        )
        step.scheduled.add(req.request_id)
        step.spend(chunk, cold)
        self.fcfs_bound.computed(min(chunk, len(req.prompt) - req.num_computed))  # prefill only
        if req.first_scheduled_s is None:
            req.first_scheduled_s = self.clock.now()
        return True

    def _admit(self, step: _Step, cold_pass: bool) -> None:
        i = 0
        waiting, running, max_num_seqs = self.waiting, self.running, self.config.max_num_seqs
        lookahead = self.config.admission_lookahead  # i counts the requests this pass skipped
        while i < len(waiting) and i < lookahead:
            if step.budget <= 0 or len(running) >= max_num_seqs:
                return
            req = waiting[i]
            s = req.session
            tokens = req.tokens
            memo = req._plan_memo
            # Most queued requests are looked at again with nothing changed: their memo answers at once.
            plan = memo.fresh_plan(s, tokens) or self.kv.plan_prefix(s, tokens, memo)
            # History as first seen: an attach whose slots then failed cut the session's tokens back to
            # the hit prefix, so a retry's plan sees less of it (and would count re-prefill as new).
            if not req.admitted:  # (after a preemption the plan includes this turn's own tokens)
                req.num_history_tokens = max(req.num_history_tokens, plan.num_history_tokens)
            uncached = len(tokens) - plan.num_hit_tokens
            cold = self.config.warm_first and not is_warm(
                len(tokens), plan.num_hit_tokens, self.config.warm_threshold_tokens
            )
            if cold and self.config.resumes_are_warm and (s.num_turns or req.admitted):
                cold = False  # a turn of a session this node served: a resume, whatever it recomputes
            if cold != cold_pass:
                i += 1
                continue
            chunk = step.limit(uncached, cold_pass)
            if chunk <= 0:
                return
            if self._defer_new_program(step, req, len(tokens)):
                i += 1
                continue
            # Under the cold cap a cold prompt reserves its whole length at admission: it advances a
            # capped chunk per step, and one that runs out of memory half-way preempts others (their
            # contexts are lost and recomputed: a memory-bound node thrashed on it, 102 preemptions
            # instead of 11 in a replay).  Without the cap, blocks come chunk by chunk, as in vLLM.
            whole = cold_pass and self.config.cold_prefill_budget_tokens < self.config.max_num_batched_tokens
            attached = self.kv.attach(s, tokens, plan)  # (sets the session's cached prefix first)
            reserve = max(len(s.token_ids) + chunk, len(tokens) if whole else 0)
            # (never on an idle step: a prompt the pool cannot hold whole still runs chunk by chunk)
            whole_fits = (
                not self.config.admit_whole_prompt
                or (not self.running and not step.seqs)
                or self.kv.can_allocate(-(-len(tokens) // self.kv.block_size) - len(s.block_ids))
            )
            if not attached or not whole_fits or not self.kv.ensure_slots(s, reserve):
                if s.state is SessionState.RUNNING:
                    self.kv.set_waiting(s)
                # Memory is full: the request keeps its place in the queue.  If nothing runs and nothing
                # was scheduled, only pins can be holding the pool: the deadlock rule lets the latest
                # program's pins go and the request tries again (work-conserving: never idle with work).
                # An overdue request outranks pins by definition (the TTFT deadline), so pins give way
                # to it at once rather than after the node has drained.
                if (req.overdue or (not self.running and not step.seqs)) and self.kv.force_unpin_latest():
                    continue
                if self.config.yield_pins_to_older and self.kv.yield_pin_to(
                    s.program_start_s if s.program_start_s is not None else s.created_s
                ):
                    continue
                return
            self._remove_waiting(req)
            self.fcfs_bound.forget(req.request_id)
            req._plan_memo.release()  # out of the queue: no more plans (and off the pool's watch lists)
            if not req.admitted and s.pinned_blocks == 0:  # what the device kept of a context no pin held
                self.kv.unpinned_survival.observe(req.num_history_tokens, plan.num_cached_tokens)
            self.kv.consume_pin(s)
            if req.admit_reason is not None:
                self.admit_stats[req.admit_reason] += 1
                req.admit_reason = None
            if not req.admitted:
                req.admitted = True
                req.num_cached_tokens = plan.num_cached_tokens
                req.num_host_hit_tokens = plan.num_host_tokens
                req.num_recomputed_tokens = max(0, req.num_history_tokens - plan.num_hit_tokens)
                fate, cached_then = req.arrival or ("unpinned", 0)
                lost_by = self.kv.stats.lost_by
                for cause, n in split_lost(req.num_history_tokens, plan.num_hit_tokens, fate, cached_then):
                    lost_by[cause] = lost_by.get(cause, 0) + n
            else:  # back after a preemption: what it had computed and lost since is computed again
                req.num_recomputed_tokens += max(0, req.num_computed_at_preemption - plan.num_hit_tokens)
            req.num_computed = len(s.token_ids)
            req.cold = cold_pass
            req.state = RequestState.RUNNING
            self.running.append(req)
            self._run(step, req, min(chunk, req.num_tokens - req.num_computed), cold_pass)

    def _defer_new_program(self, step: _Step, req: Request, num_tokens: int) -> bool:
        """Program admission: True while ``req`` starts a program new to this node that the programs in
        flight leave no room for.  A start it lets through counts in the step's in-flight set at once, so
        one step does not let in two programs that only fit alone."""
        fraction = self.config.admit_fraction
        s = req.session
        if fraction is None or s.program_start_s is None or s.num_turns or s.token_ids or req.overdue:
            return False
        now = self.clock.now()
        if step.in_flight is None:
            live = {r.session: r.num_tokens for r in (*self.running, *self.waiting)}
            step.in_flight = working_set(
                self.kv.sessions.values(), now, self.config.admit_horizon_s, self.kv.block_size, live
            )
        cur = step.in_flight
        if s.program_id in cur.started:
            return False
        need = -(-num_tokens // self.kv.block_size)
        why = admit_verdict(
            cur.num_blocks, need, self.kv.device.num_blocks + self.kv.host.num_blocks, fraction,
            idle=not self.running and not step.seqs,
            waited_s=now - req.arrival_s,
            max_wait_s=self.config.admit_max_wait_s,
        )  # fmt: skip
        if why is None:
            self.admit_stats["held"] += 1
            return True
        req.admit_reason = why  # counted once it is admitted (memory may still keep it waiting)
        step.in_flight = InFlight(cur.num_blocks + need, cur.started | {s.program_id})
        return False

    def _preemption_victim(self, exclude: set[str]) -> Request | None:
        candidates = [r for r in self.running if r.request_id not in exclude]
        return (
            max(candidates, key=lambda r: r.sort_key(self.config.program_fcfs_aging_s))
            if candidates
            else None
        )

    def _preempt(self, req: Request) -> None:
        """Back to the queue front; its computed KV stays as a parked, evictable context."""
        if req in self.running:
            self.running.remove(req)
        req.preempted = True
        req.num_computed_at_preemption = req.num_computed
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.kv.park(req.session, finished=False)
        self.kv.set_waiting(req.session)
        self._enqueue(req)

    # ---- after the step ------------------------------------------------------------------------
    def update(self, batch: ScheduledBatch, out: StepOutput) -> None:
        now = self.clock.now()
        for seq in batch.seqs:
            req = self.requests.get(seq.request_id)
            if req is None or req.state is not RequestState.RUNNING:
                continue
            self.kv.commit_tokens(req.session, seq.token_ids)
            req.num_computed += len(seq.token_ids)
            if not seq.sample:
                continue
            tok = out.sampled[seq.request_id]
            req.output.append(tok)
            if req.first_token_s is None:
                req.first_token_s = now
            done = len(req.output) >= req.max_new_tokens or tok in req.stop_token_ids
            if done:
                self.running.remove(req)
                self._finish(req, "stop" if tok in req.stop_token_ids else "length", emit=[tok])
            elif req.on_event is not None:
                req.on_event(req, [tok], False)

    def _finish(self, req: Request, reason: str, emit: list[int] | None = None) -> None:
        req.state = RequestState.FINISHED
        req.finish_reason = reason
        req.finished_s = self.clock.now()
        s = req.session
        s.num_turns += 1
        self.kv.park(s)
        del self.requests[req.request_id]
        if req.on_event is not None:
            req.on_event(req, emit or [], True)
        if self.on_finish is not None:
            self.on_finish(req)
