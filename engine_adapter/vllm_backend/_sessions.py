"""Sessions, pins as leases, and Release, over vLLM's own KV blocks (no vLLM import: blocks are duck-typed).

vLLM frees a finished request's blocks at once: hashed ones go to the tail of the free queue (evicted
LRU-first), so under memory pressure an agent's context is gone before its tool returns. This book keeps
the semantics of ``engine_adapter._kv_manager`` on vLLM's structures:

- a *session* is vLLM's own ``Request.session_id`` (the OpenAI ``session_id`` field); its program is the
  ``program_id`` in ``vllm_xargs`` (else the session id);
- a pin *holds a reference* on the leading hashed blocks of the session's last finished request, so the
  block pool cannot hand them out (``ref_cnt > 0`` keeps them out of the free queue) while prefix lookups
  still hit them; unpinning frees them the way vLLM would, tail first;
- a pin that arrives after the request finished re-acquires the blocks that are still cached
  (``BlockPool.touch``, vLLM's own prefix-hit path), up to the first one that was evicted;
- pins are leases on this process's monotonic clock, bounded by a budget of distinct blocks (a shared
  prefix pinned twice costs once), consumed when the session's next request is admitted, kept past expiry
  while that next request waits, dropped latest-program-first when they block all progress (deadlock);
- a *queue hold* (``hold_queued``, ``HINTFLOW_HOLD_QUEUED``): a turn that arrives to find its context still
  cached but unpinned holds it while it waits, as a lease that lapsed at once (so it lasts exactly until
  admission), under the same budget, yield and deadlock rules as a pin; it is not the orchestrator's pin
  (it takes no queue band and is not reported as pinned). vLLM's prefix cache keeps no blocks for a waiting
  request, so a returning turn queued behind others lost its context to their allocations; the embedded
  node never evicts a queued turn's context while a parked one is left.

Callers hold the scheduler's lock; nothing here is thread-safe on its own.
"""

from __future__ import annotations

import time
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from engine_adapter._kv_manager import PinResult  # the embedded engine's answer to a pin, shared
from engine_adapter._lost_context import after_grant, after_unpin
from engine_adapter._pin_lease import PinLeases
from engine_adapter._pin_order import deadlock_victims, program_start

from ._free_queue import Block, place_by_next_use

__all__ = ["PinResult", "SessionBook", "VSession", "session_start"]

IDLE_FORGET_S = 3600.0
"""A session with no request, pin or hint for this long is forgotten (its blocks are vLLM's again)."""


@dataclass(eq=False)
class VSession:
    session_id: str
    program_id: str
    first_seen_s: float
    last_active_s: float
    live: set[str] = field(default_factory=set)  # request ids not finished
    admitted: set[str] = field(default_factory=set)  # of those, the ones vLLM has scheduled
    snapshot: list[tuple[Block, Any]] = field(default_factory=list)  # (block, its hash) of the last turn
    held: list[Block] = field(default_factory=list)  # blocks this book holds a reference on (the pin)
    pin_deadline_s: float | None = None
    pin_seq: int = 0
    next_use_deadline_s: float | None = None
    program_start_s: float | None = None
    priority_class: int | None = None
    expected_output_tokens: int | None = None
    released: bool = False
    pin_hinted_s: float | None = None  # when the orchestrator last sent this session a Pin (grace_hold)
    context: array[int] = field(default_factory=lambda: array("q"))  # tokens the last turn computed
    pause_fate: str = "unpinned"  # what became of its context since its last turn (_lost_context.PAUSE_FATES)
    queue_hold: bool = False  # what it holds is a queue hold (SessionBook.hold_queued), not a pin

    @property
    def waiting(self) -> bool:
        """A request of this session is queued but not yet admitted (its pin must not expire now)."""
        return bool(self.live - self.admitted)

    @property
    def state(self) -> str:
        if self.admitted & self.live:
            return "running"
        return "waiting" if self.live else "parked"

    def resident_blocks(self) -> int:
        """Leading blocks of the last turn still cached (held, or free but not yet evicted)."""
        n = 0
        for block, h in self.snapshot:
            if block.block_hash != h:
                break
            n += 1
        return max(n, len(self.held))


def session_start(s: VSession) -> float:
    """The session's place in program FCFS (``_pin_order.program_start``)."""
    return program_start(s.program_start_s, s.first_seen_s)


def _seen(s: VSession) -> float:
    return s.first_seen_s


def _program(s: VSession) -> str:
    return s.program_id


@dataclass
class BookStats:
    pin_expiries: int = 0
    pin_clamps: int = 0
    forced_unpins: int = 0
    released_sessions: int = 0
    yielded_pins: int = 0
    pin_renewals: int = 0
    queue_holds: int = 0  # turns that held their cached context while queued (hold_queued)


class SessionBook:
    """See the module docstring. ``pool`` is vLLM's ``BlockPool`` (``touch``, ``free_blocks``)."""

    def __init__(
        self,
        pool: Any,
        num_blocks: int,
        *,
        pin_budget_fraction: float = 0.5,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.pool = pool
        self.num_blocks = num_blocks
        self.leases = PinLeases(num_blocks, pin_budget_fraction)
        self.clock = clock
        self.sessions: dict[str, VSession] = {}
        self.programs: dict[str, set[str]] = {}
        self.stats = BookStats()
        self._next_sweep_s = 0.0
        # called as a session is forgotten, with whether it was released (the host tier demotes its blocks)
        self.on_forget: Callable[[str, bool], Any] | None = None

    @property
    def num_pinned_blocks(self) -> int:
        return self.leases.num_pinned_blocks

    @property
    def pin_budget_blocks(self) -> int:
        return self.leases.budget_blocks

    # ---- sessions and requests ---------------------------------------------------------------------
    def session(self, session_id: str, program_id: str = "") -> VSession:
        s = self.sessions.get(session_id)
        now = self.clock()
        if s is None:
            s = VSession(session_id, program_id or session_id, first_seen_s=now, last_active_s=now)
            self.sessions[session_id] = s
            self.programs.setdefault(s.program_id, set()).add(session_id)
        s.last_active_s = now
        return s

    def on_request_added(self, s: VSession, request_id: str) -> None:
        s.live.add(request_id)
        s.released = False  # a program that comes back after Release starts afresh

    def on_admitted(self, s: VSession, request_id: str) -> None:
        """The session's next turn runs: the pause its pin bridged is over, so the pin is consumed.

        Its blocks were prefix hits of the admitted request, so they stay referenced by it.
        """
        s.admitted.add(request_id)
        s.pin_deadline_s = None
        self._unpin(s)

    def on_request_finished(
        self, s: VSession, request_id: str, blocks: Sequence[Block], *, owned: bool = True
    ) -> None:
        """Take over the finished request's blocks: hold the pinned prefix, free the rest as vLLM would.

        ``owned=False``: vLLM keeps the request's own references and frees them later (its deferred block
        free, while a step still in flight may write them); the book then only takes the snapshot and
        holds the pinned prefix with references of its own, freeing nothing.

        No blocks at all: the request never had any (aborted before admission, or after a preemption had
        returned them). Its turn computed nothing, so the session's last context and its pin stay as they
        were: a pin kept while this request waited runs on to its deadline, and one that arrived meanwhile
        applies to that context now.
        """
        s.live.discard(request_id)
        s.admitted.discard(request_id)
        s.last_active_s = self.clock()
        if s.next_use_deadline_s is not None and s.next_use_deadline_s <= s.last_active_s:
            s.next_use_deadline_s = None  # the predicted use happened
        if not blocks:
            self._keep_last_context(s)
            return
        prefix: list[Block] = []
        for b in blocks:
            if b.is_null or b.block_hash is None:
                break
            prefix.append(b)
        s.snapshot = [(b, b.block_hash) for b in prefix]
        self._unpin(s)  # an old hold (two turns in flight at once): the new turn's blocks replace it
        keep = 0
        s.pause_fate = "unpinned"
        if not s.released and s.pin_deadline_s is not None and s.pin_deadline_s > self.clock():
            keep = self._grant(s, prefix, already_referenced=owned).pinned_blocks
        if owned:
            rest = list(blocks[keep:])
            self.pool.free_blocks(reversed(rest))  # tail first, exactly vLLM's own order
        if s.next_use_deadline_s is not None and not s.released:
            self.place_by_next_use([s])
        if s.released and not s.live:
            self._forget(s)

    def _keep_last_context(self, s: VSession) -> None:
        """A request of ``s`` ended without blocks: its pin and last context stay (``on_request_finished``)."""
        if s.released:
            if not s.live:
                self._forget(s)
            return
        if s.pin_deadline_s is None:
            return
        # expire() popped the lease's entry while this request waited (a waiting session's lease is kept):
        # queue it again, or the pin would outlive its deadline
        self.leases.reschedule(s)
        if not s.live and s.pin_deadline_s > self.clock():
            self._grant(s, [b for b, _ in s.snapshot], already_referenced=False, hashes=s.snapshot)

    # ---- pins ----------------------------------------------------------------------------------
    def set_pin(self, s: VSession, ttl_s: float) -> PinResult:
        if ttl_s <= 0:
            s.pin_deadline_s = None
            self._unpin(s)
            s.pause_fate = after_unpin(s.pause_fate)
            return PinResult(0, 0)
        self.leases.grant(s, self.clock(), ttl_s)
        if s.live:
            return PinResult(0, len(s.snapshot), deferred=True)  # applies when the running turn ends
        return self._grant(s, [b for b, _ in s.snapshot], already_referenced=False, hashes=s.snapshot)

    def hold_queued(self, s: VSession) -> int:
        """The session's turn arrived and waits, its last context cached but not pinned: hold that context
        until the turn is admitted (module docstring). A live lease that holds nothing (clamped to nothing)
        is kept as it is; else the hold's lease lapses at once and lasts only while the turn waits. The
        pause's fate stands (the pause is over). Returns the blocks held."""
        if s.held or s.released or not s.snapshot or not s.waiting:
            return 0
        if s.pin_deadline_s is None:
            self.leases.grant(s, self.clock(), 0.0)
        self._grant(s, [b for b, _ in s.snapshot], already_referenced=False, hashes=s.snapshot, pin=False)
        if s.held:
            s.queue_hold = True
            self.stats.queue_holds += 1
        return len(s.held)

    def _grant(
        self,
        s: VSession,
        prefix: Sequence[Block],
        *,
        already_referenced: bool,
        hashes: Sequence[tuple[Block, Any]] | None = None,
        pin: bool = True,
    ) -> PinResult:
        """Hold up to the pin budget of ``prefix``; re-acquire (touch) blocks the book does not yet own.
        ``pin=False``: a queue hold, no pin decision (not a clamp, and the pause's fate stands)."""
        held_ids = {b.block_id for b in s.held}
        whole = True
        for idx, b in enumerate(prefix):
            if hashes is not None and b.block_hash != hashes[idx][1]:
                whole = False
                break  # evicted (and maybe reused) since the turn ended: the prefix stops here
            if b.block_id in held_ids:
                continue
            if not self.leases.hold(b.block_id):
                break
            if not already_referenced:
                self.pool.touch([b])  # vLLM's prefix-hit path: out of the free queue, ref_cnt + 1
            s.held.append(b)
        grant = PinResult(len(s.held), len(prefix))
        if pin:
            if grant.clamped:
                self.stats.pin_clamps += 1
            s.pause_fate = after_grant(s.pause_fate, whole=whole, clamped=grant.clamped, held=bool(s.held))
        return grant

    def _unpin(self, s: VSession) -> None:
        s.queue_hold = False
        if not s.held:
            return
        for b in s.held:
            self.leases.let_go(b.block_id)
        held, s.held = s.held, []
        self.pool.free_blocks(reversed(held))

    def drop_pin(self, s: VSession, *, yielded: bool = False) -> int:
        """Give up the session's pin now (its blocks become free, evictable); the number it held.

        ``yielded``: dropped so that an older program's waiting turn fits (counted in ``yielded_pins``);
        other callers (an explicit hint taking over from an inferred pin) are not yields."""
        n = sum(1 for b in s.held if self.leases.pins_on(b.block_id) == 1)
        s.pin_deadline_s = None
        self._unpin(s)
        s.pause_fate = "yielded" if yielded else after_unpin(s.pause_fate)
        if yielded:
            self.stats.yielded_pins += 1
        return n

    def drop_all_pins(self) -> int:
        """Every session lets go of its pin, deferred ones included (vLLM resets its prefix cache); the
        number of blocks the book held."""
        n = self.num_pinned_blocks
        for s in self.sessions.values():
            s.pin_deadline_s = None
            self._unpin(s)
        return n

    def force_unpin_latest(self) -> bool:
        """Deadlock rule: pins block all progress, so the latest-started program lets go of every pin it
        holds (``engine_adapter._pin_order.deadlock_victims``, the embedded node's rule too)."""
        victims = deadlock_victims(
            [s for s in self.sessions.values() if s.held], start=session_start, seen=_seen, program=_program
        )
        for s in victims:
            s.pin_deadline_s = None
            self._unpin(s)
            s.pause_fate = "forced"
        if not victims:
            return False
        self.stats.forced_unpins += 1
        return True

    def expire(self, renew: Callable[[VSession], float] | None = None) -> bool:
        """Drop leases that ran out (unless the session's next turn is queued); cheap when none is due.

        ``renew(s)``: a further lease in seconds for a session whose lease ran out while it still holds
        blocks (0: let it go), decided on the pause so far (``HintInference.renewal_s``); the held blocks
        stay held, and the lapse is not counted as an expiry."""
        now = self.clock()
        changed = False
        for s in self.leases.lapsed(now, self.sessions.get, lambda x: x.waiting):
            ttl_s = renew(s) if renew is not None and s.held and not s.live and not s.released else 0.0
            if ttl_s > 0.0:
                self.leases.grant(s, now, ttl_s)  # (pushed after now: this loop does not meet it again)
                self.stats.pin_renewals += 1
                continue
            s.pin_deadline_s = None
            self.stats.pin_expiries += 1  # every lease that ran out, held blocks or not (as the embedded node)
            if s.held:
                self._unpin(s)
                s.pause_fate = "expired"
                changed = True
        if now >= self._next_sweep_s:
            self._next_sweep_s = now + 60.0
            for s in list(self.sessions.values()):
                idle = not s.live and not s.held and now - s.last_active_s > IDLE_FORGET_S
                if idle:
                    self._forget(s)
        return changed

    # ---- Release -------------------------------------------------------------------------------
    def release_program(self, program_id: str) -> int:
        """Free the program's pinned contexts now; sessions with a turn in flight free it at its end."""
        ids = list(self.programs.get(program_id, ()))
        for sid in ids:
            s = self.sessions[sid]
            s.released = True
            s.pin_deadline_s = None
            self._unpin(s)
            self._evict_snapshot_first(s)
            if not s.live:
                self._forget(s)
        self.stats.released_sessions += len(ids)
        return len(ids)

    def _evict_snapshot_first(self, s: VSession) -> None:
        """A released context is never needed again: its free blocks are the first vLLM reuses."""
        place_by_next_use(self.pool.free_block_queue, [(float("inf"), s.snapshot)])
        s.snapshot = []

    # ---- context moves (_context_moves) ------------------------------------------------------------
    def adopt_context(self, s: VSession, blocks: Sequence[Block], context: array[int]) -> None:
        """An imported context becomes the session's last turn (its blocks hashed, in the prefix cache)."""
        s.pin_deadline_s = None
        self._unpin(s)
        s.snapshot = [(b, b.block_hash) for b in blocks]
        s.context = context
        s.released = False
        s.last_active_s = self.clock()

    def drop_context(self, s: VSession) -> None:
        """The session's context moved away: free it as a Release would (unpinned, reused first)."""
        s.pin_deadline_s = None
        self._unpin(s)
        self._evict_snapshot_first(s)
        s.context = array("q")
        if not s.live:
            self._forget(s)

    # ---- EvictionOrder -------------------------------------------------------------------------------
    def place_by_next_use(self, sessions: Sequence[VSession]) -> int:
        """Reorder the free queue for these hinted sessions (``_free_queue.place_by_next_use``)."""
        now = self.clock()
        hinted = [
            (x.next_use_deadline_s - now, x.snapshot) for x in sessions if x.next_use_deadline_s is not None
        ]
        return place_by_next_use(self.pool.free_block_queue, hinted)

    def _forget(self, s: VSession) -> None:
        self._unpin(s)
        self.sessions.pop(s.session_id, None)
        if self.on_forget is not None:
            self.on_forget(s.session_id, s.released)
        members = self.programs.get(s.program_id)
        if members is not None:
            members.discard(s.session_id)
            if not members:
                del self.programs[s.program_id]

    def check_invariants(self) -> None:
        counts: dict[int, int] = {}
        for s in self.sessions.values():
            for b in s.held:
                counts[b.block_id] = counts.get(b.block_id, 0) + 1
                if b.ref_cnt < 1:
                    raise AssertionError(f"{s.session_id}: holds block {b.block_id} with ref_cnt {b.ref_cnt}")
        self.leases.check(counts)
