"""The KV manager's state and its bookkeeping: the table of sessions, the eviction heaps, the queued
turns' contexts, and pin leases over device blocks.

Why apart from ``_kv_manager``: everything here reads or writes that state without moving a block
between tiers; ``HostTier`` (``_host_tier``) adds the copies and ``KVCacheManager`` the context
lifecycle (attach, run, park, free) on top.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from predictors import HostHitShare, UnpinnedSurvival

from ._block_pool import NONE_HASH, BlockPool, hash_block_tokens
from ._eviction import EvictionPolicy, HostLRUPolicy, SessionHeap, get_eviction_policy
from ._executor import Clock, CopyOp
from ._lost_context import after_grant, after_unpin
from ._pin_lease import PinLeases
from ._pin_order import deadlock_victims, program_start, yield_order
from ._session import Session, SessionState

__all__ = ["KVStats", "PinResult", "SessionTable"]


def _start(s: Session) -> float:
    return program_start(s.program_start_s, s.created_s)


def _seen(s: Session) -> float:
    return s.created_s


def _program(s: Session) -> str:
    return s.program_id


@dataclass
class PinResult:
    pinned_blocks: int
    requested_blocks: int
    deferred: bool = False  # the session is running or waiting: the pin applies when it parks

    @property
    def clamped(self) -> bool:
        return self.pinned_blocks < self.requested_blocks and not self.deferred


@dataclass
class KVStats:
    evicted_blocks: int = 0
    offloaded_blocks: int = 0
    reloaded_blocks: int = 0
    dropped_host_blocks: int = 0
    evicted_sessions: int = 0
    pin_expiries: int = 0
    pin_clamps: int = 0
    forced_unpins: int = 0
    yielded_pins: int = 0  # dropped so that an older program's waiting turn fits (see yield_pin_to)
    prefetched_blocks: int = 0
    skipped_prefetches: int = 0  # due while a queued turn waited for memory (see _prefetch)
    lost_by: dict[str, int] = field(default_factory=dict)  # recomputed history tokens by cause (_lost_context)


class SessionTable:
    """Pools, sessions and pins of one node (``KVCacheManager`` is the class to use)."""

    def __init__(
        self,
        num_device_blocks: int,
        num_host_blocks: int,
        block_size: int,
        clock: Clock,
        *,
        pin_budget_fraction: float = 0.5,
        eviction_policy: str = "hinted",
        retain_contexts: bool = True,
        host_write_through: bool = False,
        evict_queued: bool = False,
        host_lru: bool = False,
        host_hold_share: float = 0.0,
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.clock = clock
        self.device = BlockPool(num_device_blocks)
        self.host = BlockPool(num_host_blocks, enable_prefix_index=False)
        self.leases = PinLeases(num_device_blocks, pin_budget_fraction)
        self.policy = get_eviction_policy(eviction_policy)
        # False reproduces vLLM: a finished request's blocks go straight to the free queue (LRU).
        self.retain_contexts = retain_contexts
        # True models vLLM's host connectors (hintflow's and the native one): every turn's blocks are
        # copied to the host as they are computed, and the host drops least recently used chains first
        # whatever the hints say; False (ours) copies a block out only when the device evicts it.
        self.host_write_through = host_write_through and num_host_blocks > 0
        # True (``host_lru``) models how the vLLM node's connector drops what the device evicted: by when it
        # was saved or loaded, least recent first, whatever the hints say (``HostIndex``); write-through
        # does so too. False (ours) drops in the device's order (``policy``: the hinted one).
        lru = self.host_write_through or host_lru
        self._host_policy: EvictionPolicy | HostLRUPolicy = HostLRUPolicy() if lru else self.policy
        # True models vLLM's prefix cache: a queued turn holds no blocks, so its context stays in the
        # eviction order where its last turn left it (parked and queued contexts alike); False (ours)
        # evicts a queued turn's context only when no parked one is left (``allocate_device``).
        self.evict_queued = evict_queued
        # The vLLM node's queue hold on its host tier (``host_hold_share`` > 0; ``HintflowHostTier.hold_for_waiting``):
        # an arriving turn locks the tier's run of its context until it is admitted, so the saves of what the
        # device evicts meanwhile do not drop it, while all the locks together stay under that share of the
        # tier. Session -> its leading host blocks locked (``set_waiting``, ``_refresh``).
        self.host_hold_blocks = int(host_hold_share * num_host_blocks)
        self._host_locked: dict[Session, int] = {}
        self.num_host_locked_blocks = 0
        self.host_hits = HostHitShare()  # what the host tier gave back of evicted contexts (KVCacheManager.attach)
        self.unpinned_survival = UnpinnedSurvival()  # what the device kept of contexts no pin held (attach)
        self.sessions: dict[str, Session] = {}
        # program -> its sessions in creation order (a dict, not a set: releasing a program frees them in
        # an order that must not depend on string hashing, or replays differ between runs)
        self.programs: dict[str, dict[str, None]] = {}
        self.pending_copies: list[CopyOp] = []
        self.stats = KVStats()
        self._device_evictable: SessionHeap[Session] = SessionHeap()
        # Unpinned device blocks of parked and queued sessions: an upper bound on what evicting could free
        # (shared blocks free only with their last holder), so an allocation that cannot succeed fails at
        # once instead of evicting every parked context first (query, then mutate; ``allocate_device``).
        self.num_evictable_blocks = 0
        self._evictable: dict[Session, int] = {}
        self._host_holders: SessionHeap[Session] = SessionHeap()
        self._prefetch_due: list[tuple[float, int, str]] = []
        self._seq = itertools.count()
        # Only set_waiting makes a session WAITING, so every WAITING session is a key here: the queued
        # turns' contexts are found without a scan of every session this node ever held (a replay's
        # memory-bound steps looked for a waiting victim at every eviction).
        self._maybe_waiting: dict[Session, None] = {}
        self._creation_seq: dict[Session, int] = {}  # order of insertion into ``sessions``
        # Sessions a context move holds (an export or import stream is open): RUNNING with no request, and
        # kept off the host tier's eviction heap too, so none of their blocks goes while the stream runs.
        self.leased: set[Session] = set()
        self._session_seq = itertools.count()

    # ---- sessions ----------------------------------------------------------------------------
    def get_or_create(self, session_id: str, program_id: str) -> Session:
        s = self.sessions.get(session_id)
        if s is None:
            now = self.clock.now()
            s = Session(session_id, program_id or session_id, created_s=now, last_used_s=now)
            s._bs = self.block_size
            self.sessions[session_id] = s
            self._creation_seq[s] = next(self._session_seq)
            self.programs.setdefault(s.program_id, {})[session_id] = None
        return s

    def _refresh(self, s: Session) -> None:
        """Keep the two eviction heaps in step with one session's state (call after every change)."""
        unpinned = len(s.block_ids) - s.pinned_blocks if s.state is not SessionState.RUNNING else 0
        before = self._evictable.pop(s, 0)
        if unpinned > 0:
            self._evictable[s] = unpinned
        self.num_evictable_blocks += max(unpinned, 0) - before
        idle = s.state is SessionState.PARKED or (self.evict_queued and s.state is SessionState.WAITING)
        if idle and len(s.block_ids) > s.pinned_blocks:
            self._device_evictable.set(s, self.policy.ref_time(s))
        else:
            self._device_evictable.discard(s)
        locked = self._host_locked.get(s, 0)
        if locked:  # a queue hold lasts while the turn waits, over what is left of the run it locked
            keep = min(locked, len(s.host_block_ids)) if s.state is SessionState.WAITING else 0
            self.num_host_locked_blocks -= locked - keep
            if keep:
                self._host_locked[s] = locked = keep
            else:
                del self._host_locked[s]
                locked = 0
        if len(s.host_block_ids) + len(s.saved_host_ids) > locked and s not in self.leased:
            self._host_holders.set(s, self._host_policy.ref_time(s))
        else:
            self._host_holders.discard(s)

    def _rehash(self, s: Session) -> None:
        """Extend ``block_hashes`` over full blocks and publish them (first writer wins)."""
        bs = self.block_size
        parent = s.block_hashes[-1] if s.block_hashes else NONE_HASH
        for j in range(len(s.block_hashes), min(len(s.token_ids) // bs, len(s.block_ids))):
            toks = tuple(s.token_ids[j * bs : (j + 1) * bs])
            h = hash_block_tokens(parent, toks)
            self.device.register(s.block_ids[j], h, parent, toks)
            s.block_hashes.append(h)
            s.epoch += 1
            parent = h

    def set_waiting(self, s: Session, *, arriving: bool = False) -> None:
        """The session's turn is queued (``arriving``: a new turn, not one put back for memory)."""
        s.state = SessionState.WAITING
        if arriving and self.host_hold_blocks and s.host_block_ids and s not in self._host_locked:
            n = min(len(s.host_block_ids), self.host_hold_blocks - self.num_host_locked_blocks)
            if n > 0:
                self._host_locked[s] = n
                self.num_host_locked_blocks += n
        self._maybe_waiting[s] = None
        self._refresh(s)

    def _any_waiting(self) -> bool:
        """Whether any session in ``sessions`` is WAITING (prunes ``_maybe_waiting`` up to the first)."""
        stale = []
        found = False
        for s in self._maybe_waiting:
            if s.state is SessionState.WAITING and self.sessions.get(s.session_id) is s:
                found = True
                break
            stale.append(s)
        for s in stale:
            del self._maybe_waiting[s]  # (set_waiting puts it back when it waits again)
        return found

    def _waiting_victim(self, exclude: Session | None) -> Session | None:
        """Last resort before preempting a running request: the context of a queued turn."""
        # The largest order; among equals the session that came first in ``sessions``.
        def order(x: Session) -> tuple[int, float, int]:
            return (x.priority_class, _start(x), -self._creation_seq.get(x, 0))

        best: Session | None = None
        best_key: tuple[int, float, int] | None = None
        # (runs for every allocation that must evict: the cheap test first, since most queued turns of an
        # overloaded node hold nothing; then the state check; the key once per candidate)
        sessions = self.sessions
        for s in self._maybe_waiting:
            if len(s.block_ids) <= s.pinned_blocks or s is exclude:
                continue
            if s.state is not SessionState.WAITING or sessions.get(s.session_id) is not s:
                continue
            key = order(s)
            if best_key is None or key > best_key:
                best, best_key = s, key
        return best

    # ---- pins ----------------------------------------------------------------------------------
    @property
    def pin_budget_blocks(self) -> int:
        return self.leases.budget_blocks

    @property
    def num_pinned_blocks(self) -> int:
        return self.leases.num_pinned_blocks

    def set_pin(self, s: Session, ttl_s: float) -> PinResult:
        if ttl_s <= 0:
            self._drop_pin(s)
            s.pause_fate = after_unpin(s.pause_fate)
            return PinResult(0, 0)
        self.leases.grant(s, self.clock.now(), ttl_s)
        if s.state is not SessionState.PARKED:
            return PinResult(0, len(s.block_ids), deferred=True)
        result = self._grant_pin(s)
        self._refresh(s)
        return result

    def _grant_pin(self, s: Session) -> PinResult:
        want = len(s.block_ids)
        j = s.pinned_blocks
        hold = self.leases.hold
        while j < want and hold(s.block_ids[j]):
            j += 1
        s.pinned_blocks = j
        result = PinResult(j, want)
        if result.clamped:
            self.stats.pin_clamps += 1
        whole = len(s.block_ids) * self.block_size >= len(s.token_ids)  # nothing evicted since the turn ended
        s.pause_fate = after_grant(s.pause_fate, whole=whole, clamped=result.clamped, held=j > 0)
        return result

    def _unpin(self, s: Session) -> None:
        let_go = self.leases.let_go
        for bid in s.block_ids[: s.pinned_blocks]:
            let_go(bid)
        s.pinned_blocks = 0

    def consume_pin(self, s: Session) -> None:
        """The session's turn was admitted: its pin has done its job."""
        self._unpin(s)
        s.pin_deadline_s = None
        self._refresh(s)

    def force_unpin_latest(self) -> bool:
        """Deadlock rule: pinned memory blocks all progress, so the latest-started program lets go of every
        pin it holds (``_pin_order.deadlock_victims``, the vLLM node's rule too)."""
        victims = deadlock_victims(self._pinned_sessions(), start=_start, seen=_seen, program=_program)
        for s in victims:
            self._drop_pin(s)
            s.pause_fate = "forced"
        if not victims:
            return False
        self.stats.forced_unpins += 1
        return True

    def yield_pin_to(self, start_s: float) -> bool:
        """Pins yield to older programs: the youngest pinned session whose program started after
        ``start_s`` lets go (``_pin_order.yield_order``).  False when no pinned program is younger; the
        scheduler asks again until its turn fits."""
        order = yield_order(self._pinned_sessions(), start_s, start=_start, seen=_seen)
        if not order:
            return False
        self._drop_pin(order[0])
        order[0].pause_fate = "yielded"
        self.stats.yielded_pins += 1
        return True

    def _pinned_sessions(self) -> list[Session]:
        return [s for s in self.sessions.values() if s.pinned_blocks]

    def _drop_pin(self, s: Session) -> None:
        self._unpin(s)
        s.pin_deadline_s = None
        self._refresh(s)

    # ---- accounting ----------------------------------------------------------------------------
    def check_invariants(self) -> None:
        self.device.check_invariants()
        self.host.check_invariants()
        dev_refs = [0] * self.device.num_blocks
        host_refs = [0] * self.host.num_blocks
        pins: dict[int, int] = {}
        for s in self.sessions.values():
            for bid in s.block_ids:
                dev_refs[bid] += 1
            for hb in s.host_block_ids + s.saved_host_ids:
                host_refs[hb] += 1
            if len(s.saved_host_ids) > len(s.block_ids):
                raise AssertionError(f"{s.session_id}: write-through copies past its device blocks")
            for bid in s.block_ids[: s.pinned_blocks]:
                pins[bid] = pins.get(bid, 0) + 1
            if s.pinned_blocks > len(s.block_ids):
                raise AssertionError(f"{s.session_id}: pins past its blocks")
        for b in self.device.blocks:
            if b.ref_cnt != dev_refs[b.block_id]:
                raise AssertionError(f"device {b!r}: ref_cnt != {dev_refs[b.block_id]} session references")
        for b in self.host.blocks:
            if b.ref_cnt != host_refs[b.block_id]:
                raise AssertionError(f"host {b!r}: ref_cnt != {host_refs[b.block_id]} session references")
        self.leases.check(pins)
        locked = self._host_locked
        if sum(locked.values()) != self.num_host_locked_blocks or self.num_host_locked_blocks > self.host_hold_blocks:
            raise AssertionError(f"host blocks locked by queued turns: {self.num_host_locked_blocks} counted, "
                                 f"{sum(locked.values())} held, {self.host_hold_blocks} allowed")
        for s, n in locked.items():
            if s.state is not SessionState.WAITING or n > len(s.host_block_ids):
                raise AssertionError(f"{s.session_id}: {s.state.value}, locks {n} of {len(s.host_block_ids)} host blocks")
        evictable = sum(len(s.block_ids) - s.pinned_blocks for s in self.sessions.values()
                        if s.state is not SessionState.RUNNING)
        if evictable != self.num_evictable_blocks or sum(self._evictable.values()) != evictable:
            raise AssertionError(f"evictable blocks {self.num_evictable_blocks} != {evictable} held by "
                                 "parked and queued sessions")
