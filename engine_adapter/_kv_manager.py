"""Session contexts over two tiers of blocks, with pins as leases and eviction in the hinted order.

One session's context, as logical blocks of ``block_size`` tokens::

    token_ids:  t0 ........................................................ tN   (computed at last use)
    logical:    [ 0 ][ 1 ][ 2 ][ 3 ][ 4 ][ 5 ][ 6 ][ 7 ]
    device:     [d17][d3 ][d40][d8 ]                          block_ids      (resident prefix)
    host:                           [h2 ][h9 ]                host_block_ids (offloaded, next blocks)
    pinned:     [####][####]                                  the first pinned_blocks device blocks
                                              (blocks 6, 7 were dropped: their tokens recompute)

Eviction always takes a context's *last* resident block, so what stays is a prefix that a later prompt
can reuse.  A device block leaving goes to the host tier when one is configured (a real copy, queued as a
``CopyOp`` that the executor runs before the next forward pass), else it is dropped.  The session whose
blocks go first is chosen by the eviction policy (``_eviction.py``); pinned blocks and running or
waiting sessions are never chosen while a parked one is left.

Pins are leases: ``Pin(ttl_s)`` sets a deadline on this node's clock and covers the session's leading
device blocks up to the pin budget (``pin_budget_fraction`` of the pool, counted in distinct blocks, so
a shared prefix pinned twice costs once); a pin that does not fit is clamped and says so.  A lease that
nobody renews expires by itself; an admitted turn consumes its session's pin (the pause it bridged is
over), unless the orchestrator renews it at the next tool start.
"""

from __future__ import annotations

import heapq

from ._executor import CopyOp
from ._host_tier import HostTier
from ._prefix_plan import PlanMemo, PrefixPlan, plan_prefix
from ._session import Session, SessionState
from ._session_table import KVStats, PinResult

__all__ = ["KVCacheManager", "KVStats", "PinResult", "PlanMemo", "PrefixPlan", "Session", "SessionState"]


class KVCacheManager(HostTier):
    """Session contexts on a device pool and a host tier (state and pins: ``SessionTable``; copies
    between tiers: ``HostTier``; prefix plans: ``_prefix_plan``)."""

    max_empty_sessions = 10_000  # known sessions past which the oldest holding nothing go (get_or_create)
    _sweep_at: int | None = None

    # ---- sessions ----------------------------------------------------------------------------
    def get_or_create(self, session_id: str, program_id: str) -> Session:
        """The session, made if new.  A session whose context was evicted stays known, so its next turn
        counts what it recomputes; one that holds nothing and carries no hint is forgotten, oldest first,
        once more than ``max_empty_sessions`` are known (plain traffic, one session per request, would
        otherwise grow the table without bound).  A forgotten session that comes back counts as new."""
        s = super().get_or_create(session_id, program_id)
        limit = self.max_empty_sessions
        if len(self.sessions) > (self._sweep_at or limit):
            excess = len(self.sessions) - limit * 9 // 10
            for old in [x for x in self.sessions.values() if x is not s and self._forgettable(x)][:excess]:
                self.free_session(old)
            # the next sweep once a tenth more are known: amortized O(1) per session made
            self._sweep_at = max(limit, len(self.sessions) + limit // 10)
        return s

    def _forgettable(self, s: Session) -> bool:
        return (
            s.state is SessionState.PARKED
            and not s.block_ids
            and not s.host_block_ids
            and not s.saved_host_ids
            and s.program_start_s is None
            and s.pin_deadline_s is None
            and s.next_use_deadline_s is None
            and s.prefetch_at_s is None
            and s not in self.leased
        )

    # ---- prefix reuse (query, then mutate) -----------------------------------------------------
    def plan_prefix(self, s: Session, prompt: list[int], memo: PlanMemo | None = None) -> PrefixPlan:
        """What ``prompt`` can reuse of ``s``'s context and of the pool's prefix index (changes nothing).

        ``memo``: see ``_prefix_plan.plan_prefix`` (the plan it returns is the memo's own object: only a
        plan that is about to be attached may be written to).
        """
        return plan_prefix(self.device, self.block_size, s, prompt, memo)

    def attach(self, s: Session, prompt: list[int], plan: PrefixPlan) -> bool:
        """Make ``plan`` the session's context: reuse hits, reload host hits, let go of the rest.

        False, with nothing changed, when the device cannot take the host part back right now: the host
        copy is kept for a later try (dropping it would turn a reload into a recompute).
        """
        for bid, own in plan.device:
            if not own:
                self.device.ref(bid)  # before allocating: an allocation must not evict our prefix hits
        dev: list[int] = []
        if plan.host:
            # The plan reloads these host blocks: the offloads this allocation causes must not take them
            # for their copies (they would overwrite KV this session is about to read back); nor may they
            # evict this session's own device prefix (a queued context is evictable with evict_queued).
            self._host_holders.discard(s)
            self._device_evictable.discard(s)
            got = self.allocate_device(len(plan.host), exclude=s)
            if got is None:
                for bid, own in plan.device:
                    if not own:
                        self.device.unref(bid)
                self._refresh(s)
                return False
            dev = got
        # Pin counts follow block ids: let go here, re-grant on the new block list below while the lease
        # lasts.  The pin is consumed only when the turn is admitted (consume_pin): a turn that must wait
        # for memory keeps its context pinned, or the very load it waits behind would evict it.
        self._unpin(s)
        s.state = SessionState.RUNNING
        self._refresh(s)
        keep = {bid for bid, own in plan.device if own}
        for bid in s.block_ids:
            if bid not in keep:
                self.device.unref(bid)
        new_blocks = [bid for bid, _ in plan.device]
        cached = plan.num_cached_tokens
        reloaded_tokens = 0
        if dev:
            for hb, db in zip(plan.host, dev, strict=True):
                self.pending_copies.append(CopyOp("h2d", hb, db))
            new_blocks += dev
            reloaded_tokens = plan.num_host_tokens
            self.stats.reloaded_blocks += len(dev)
        reused = self._keep_saved(s, plan) if self.host_write_through else set()
        for hb in s.host_block_ids:
            if hb not in reused:
                self.host.unref(hb)  # reloaded (copy already queued) or no longer part of the context
        s.host_block_ids = []
        total = cached + reloaded_tokens
        if self.host.num_blocks:
            self.host_hits.observe(plan.num_history_tokens, cached, reloaded_tokens)
        s.token_ids = prompt[:total]
        s.block_ids = new_blocks
        s.epoch += 1
        valid = min(len(s.block_hashes), total // self.block_size, plan.num_history_tokens // self.block_size)
        s.block_hashes = s.block_hashes[:valid]
        self._rehash(s)
        if s.pin_deadline_s is not None:  # a lease that ends while the turn waits holds until admission
            self._grant_pin(s)
        self._refresh(s)
        plan.num_host_tokens = reloaded_tokens
        return True

    def _keep_saved(self, s: Session, plan: PrefixPlan) -> set[int]:
        """Write-through: the host copies that stay with the new context (of its leading own device blocks,
        then of the blocks reloaded right after them: the host keeps what it loads); the others let go.
        Returns the reloaded host blocks kept (``attach`` must not let go of them)."""
        s.last_used_s = s.host_used_s = self.clock.now()  # a load touches the chain (LRU)
        lead = 0
        for (bid, own), old in zip(plan.device, s.block_ids, strict=False):
            if not own or bid != old:
                break
            lead += 1
        saved = s.saved_host_ids
        kept = min(len(saved), lead)
        for hb in saved[kept:]:
            self.host.unref(hb)
        del saved[kept:]
        if not plan.host or kept != len(plan.device):
            return set()
        saved.extend(plan.host)
        return set(plan.host)

    def ensure_slots(self, s: Session, num_tokens: int) -> bool:
        """Give a running session enough device blocks for ``num_tokens`` positions (evicting others)."""
        need = -(-num_tokens // self.block_size) - len(s.block_ids)
        if need <= 0:
            return True
        got = self.allocate_device(need, exclude=s)
        if got is None:
            return False
        s.block_ids.extend(got)
        s.epoch += 1
        return True

    def commit_tokens(self, s: Session, token_ids: list[int]) -> None:
        """The executor computed KV for these tokens (appended at the end of the context)."""
        s.token_ids.extend(token_ids)
        s.epoch += 1
        if len(s.token_ids) > len(s.block_ids) * self.block_size:
            raise RuntimeError(f"session {s.session_id}: KV written past its block table")
        self._rehash(s)

    def park(self, s: Session, *, finished: bool = True) -> None:
        """The session's request finished (or, ``finished=False``, was preempted and is queued again): its
        context waits for the next turn.  A released program's session is forgotten only once its turn
        has finished: a preempted turn still runs again, on this very session."""
        now = self.clock.now()
        s.state = SessionState.PARKED
        s.last_used_s = now
        s.pause_fate = "unpinned"  # a new pause: its pin, if any, is granted below
        if s.next_use_deadline_s is not None and s.next_use_deadline_s <= now:
            s.next_use_deadline_s = None  # the predicted use happened
        keep = -(-len(s.token_ids) // self.block_size)
        if len(s.block_ids) > keep:  # reserved for tokens never computed (preempted, aborted): let go, or
            self._unpin(s)  # eviction would copy empty blocks to the host (pins re-granted below)
            while len(s.block_ids) > keep:
                self.device.unref(s.block_ids.pop())
            s.epoch += 1
        if s.pin_deadline_s is not None and s.pin_deadline_s <= now:
            # The lease lapsed while a turn was queued (``tick`` leaves those to admission) and that turn
            # ended without being admitted (an abort): it ends here, or nothing would ever end it.
            self._unpin(s)
            s.pin_deadline_s = None
            self.stats.pin_expiries += 1
        drop = s.released and finished
        if not drop:
            self.save_turn(s)  # (a write-through host tier only)
        if drop or not self.retain_contexts:
            self._drop_device(s, len(s.block_ids), spill=not drop)
            if drop:
                self.free_session(s)
                return
        elif s.pin_deadline_s is not None:
            self._grant_pin(s)
        self._refresh(s)

    # ---- allocation and eviction ---------------------------------------------------------------
    def can_allocate(self, n: int) -> bool:
        """Whether ``n`` device blocks could be had (free, or evictable from contexts nothing pins): an upper
        bound, as in :meth:`allocate_device` (a block two contexts share is counted twice)."""
        return self.device.num_free_blocks + self.num_evictable_blocks >= n

    def allocate_device(self, n: int, exclude: Session | None = None) -> list[int] | None:
        """``n`` free device blocks, evicting parked (then queued) contexts' blocks for them, or None.  None
        at once, with nothing evicted, when :meth:`can_allocate` says no; that count is an upper bound, so
        an allocation can still fail after evicting what it could."""
        if not self.can_allocate(n):
            return None
        now = self.clock.now()
        while self.device.num_free_blocks < n:
            victim = self._device_evictable.best(now)
            if victim is None:
                victim = self._waiting_victim(exclude)
            if victim is None:
                return None
            self._evict_one(victim)
        return self.device.allocate(n)

    def _drop_device(self, s: Session, n: int, *, spill: bool = False) -> None:
        """Let go of the last ``n`` device blocks and every host block behind them; ``spill``: a
        write-through host keeps its copies of them (the context stays reloadable from the host)."""
        self._unpin(s)
        keep = max(0, len(s.block_ids) - n)
        if spill and self.host_write_through:
            self._spill_saved(s, keep)
        else:
            self._drop_host(s, len(s.host_block_ids) + max(0, len(s.saved_host_ids) - keep))
        for _ in range(min(n, len(s.block_ids))):
            self.device.unref(s.block_ids.pop())
        del s.block_hashes[len(s.block_ids) :]
        s.epoch += 1
        self._refresh(s)

    def free_session(self, s: Session) -> None:
        """Forget a session and everything it holds (Release, or a finished released program)."""
        self._drop_device(s, len(s.block_ids))
        self._device_evictable.discard(s)
        self._host_holders.discard(s)
        if self.sessions.get(s.session_id) is s:  # (by identity: a new session may reuse the id)
            del self.sessions[s.session_id]
        self._creation_seq.pop(s, None)
        self._maybe_waiting.pop(s, None)
        owner = self.sessions.get(s.session_id)
        members = self.programs.get(s.program_id)
        if members is not None and (owner is None or owner.program_id != s.program_id):
            members.pop(s.session_id, None)
            if not members:
                del self.programs[s.program_id]

    def release_program(self, program_id: str) -> int:
        """Free every parked context of the program now; running ones are freed when they finish."""
        ids = list(self.programs.get(program_id, ()))
        for sid in ids:
            s = self.sessions[sid]
            s.released = True
            if s.state is SessionState.PARKED:
                self.free_session(s)
        return len(ids)

    def discard_copies(self, copies: list[CopyOp]) -> int:
        """A step failed and these copies may not have run.  Every context that would read a block they
        were to fill lets go of it and of what follows it (a reloaded device block also leaves the prefix
        index), so no later turn is served from an unwritten block; those tokens are recomputed.  Why not
        run the copies again: the failed forward pass may already have written into a freed source block.
        Returns how many sessions lost blocks."""
        reloaded = {op.dst for op in copies if op.kind == "h2d"}
        offloaded = {op.dst for op in copies if op.kind == "d2h"}
        for bid in reloaded:
            self.device.forget(bid)
        num_touched = 0
        for s in list(self.sessions.values()):
            cut = next((i for i, b in enumerate(s.block_ids) if b in reloaded), None)
            host_cut = next((i for i, b in enumerate(s.host_block_ids) if b in offloaded), None)
            saved_cut = next((i for i, b in enumerate(s.saved_host_ids) if b in offloaded), None)
            if saved_cut is not None:  # a write-through copy that may not have run, and all behind it
                self._drop_host(s, len(s.host_block_ids) + len(s.saved_host_ids) - saved_cut)
                host_cut = None
            if cut is not None:
                self._drop_device(s, len(s.block_ids) - cut)  # (and every host block behind them)
            elif host_cut is not None:
                self._drop_host(s, len(s.host_block_ids) - host_cut)
            elif saved_cut is None:
                continue
            num_touched += 1
        return num_touched

    # ---- hints that only move predictions ------------------------------------------------------
    def set_next_use(self, s: Session, next_use_s: float) -> None:
        s.next_use_deadline_s = self.clock.now() + next_use_s
        self._refresh(s)

    def set_prefetch(self, s: Session, at_s: float) -> None:
        s.prefetch_at_s = self.clock.now() + at_s
        heapq.heappush(self._prefetch_due, (s.prefetch_at_s, next(self._seq), s.session_id))
        self.set_next_use(s, at_s)

    # ---- time passes ---------------------------------------------------------------------------
    def next_due_s(self) -> float:
        """When the next pin lease or prefetch may fall due (``inf`` if none): until then ``tick`` changes
        nothing.  Heap tops, so a lease renewed or ended since can only make this early, never late."""
        prefetch_s = self._prefetch_due[0][0] if self._prefetch_due else float("inf")
        return min(self.leases.next_due_s(), prefetch_s)

    def tick(self) -> bool:
        """Expire pin leases and run due prefetches; cheap when nothing is due. True if anything changed."""
        now = self.clock.now()
        changed = False
        # (a session whose next turn is queued keeps its lease: the pin is consumed at admission instead)
        for s in self.leases.lapsed(now, self.sessions.get, lambda x: x.state is SessionState.WAITING):
            if s.pinned_blocks:
                s.pause_fate = "expired"
            self._unpin(s)
            s.pin_deadline_s = None
            self.stats.pin_expiries += 1
            self._refresh(s)
            changed = True
        while self._prefetch_due and self._prefetch_due[0][0] <= now:
            _, _, sid = heapq.heappop(self._prefetch_due)
            due = self.sessions.get(sid)
            if due is not None and due.state is SessionState.PARKED and due.host_block_ids:
                self._prefetch(due)
                changed = True
        return changed
