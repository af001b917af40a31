"""The host tier's book on the scheduler side: which prefix blocks sit in which host slot.

The vLLM host-tier connector (``_host_connector``) keeps a copy of finished turns' KV blocks in a
preallocated host buffer of ``num_slots`` blocks. Every decision about that buffer is made here, in
the scheduler process, and shipped to the worker as plain (device block, host slot) pairs, so the
worker never has to know a hash::

    block hash ──► slot ──► host buffer[:, slot]      (one row per layer on the worker)
    LRU order: least recently saved or loaded first; a slot a load of this step reads is locked

``reserve`` hands out a free slot or evicts the least recently used unlocked one; ``match`` finds the
run of consecutive blocks of a prompt that the host holds; ``lock``/``unlock`` keep a slot that a
planned load still has to read from being overwritten by a save planned in the same step. A save the
connector plans is reserved ``pending``: its slot stays locked until ``ship`` (the step's copies went to
the worker), so no later save of the same step can take that slot again (one step's saves are applied
by one ``index_copy_``, whose result is undefined on CUDA when an index repeats). ``touch_chain`` puts
a prompt's blocks back in line head last, so a chain loses its tail before its head (a host run that
lost its head matches nothing). ``release_loads`` puts the blocks a step loaded back to the device first in
line: the device holds them now. ``demote`` puts a released program's blocks first in line for
eviction, so they never push out a session that will resume.

No vLLM import: the book is tested on its own, and ``_serve`` builds the connector's config from here.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "CONNECTOR_MODULE",
    "HOLD_SHARE",
    "HOST_RELOAD_S_PER_TOKEN",
    "HOST_SAVE_MODES",
    "HostIndex",
    "HostIndexStats",
    "host_tier_config",
]

CONNECTOR_MODULE = "engine_adapter.vllm_backend._host_connector"

HOLD_SHARE = 0.5
"""The most of the tier's slots that waiting turns' queue holds may lock (``HintflowHostTier.hold_for_waiting``;
the replay's mirror of the node, ``SessionTable(host_hold_share=...)``)."""

HOST_SAVE_MODES = ("evict", "write-through")
"""When a block is copied to the host tier: when the device evicts it (the default), or as it fills."""

HOST_RELOAD_S_PER_TOKEN = 2e-6
"""Default cost of copying one token's KV back from the host tier, for pricing inferred pins when the
node has one (``HINTFLOW_HOST_RELOAD_S_PER_TOKEN``): an 8B model's 128 KiB per token over ~64 GB/s of
PCIe 5; a CPU build copies within memory, faster still. Either way a pin rarely pays for itself."""


def host_tier_config(host_capacity_tokens: int, host_save: str | None = None) -> dict[str, Any]:
    """The ``--kv-transfer-config`` value that enables this connector with a host buffer of N tokens,
    filled as ``host_save`` says (``HOST_SAVE_MODES``; None: the server's ``HINTFLOW_HOST_SAVE``, else
    ``evict``)."""
    if host_capacity_tokens < 1:
        raise ValueError(f"host_capacity_tokens must be positive, got {host_capacity_tokens}")
    extra: dict[str, Any] = {"host_capacity_tokens": int(host_capacity_tokens)}
    if host_save is not None:
        if host_save not in HOST_SAVE_MODES:
            raise ValueError(f"host_save must be one of {', '.join(HOST_SAVE_MODES)}; got {host_save!r}")
        extra["host_save"] = host_save
    return {
        "kv_connector": "HintflowHostTier",
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_both",
        "kv_connector_extra_config": extra,
    }


@dataclass
class HostIndexStats:
    num_saved_blocks: int = 0
    num_loaded_blocks: int = 0
    num_evicted_blocks: int = 0
    num_demoted_blocks: int = 0  # moved to the front of the LRU order (a released program's)
    num_save_skipped_full: int = 0  # a save found every slot locked
    num_device_evicted_blocks: int = 0  # cached blocks the device pool evicted (evict mode: save candidates)
    num_unsaved_evictions: int = 0  # of those, not saved: a last turn's or released program's, or no slot

    def line(self, num_used: int, num_slots: int) -> str:
        """One log line (every 10 s, scheduler side): what the tier saved, loaded and lost."""
        return (
            f"hintflow host tier: used={num_used}/{num_slots} saved={self.num_saved_blocks}"
            f" loaded={self.num_loaded_blocks} evicted={self.num_evicted_blocks} demoted={self.num_demoted_blocks}"
            f" skipped_full={self.num_save_skipped_full} device_evicted={self.num_device_evicted_blocks}"
            f" unsaved={self.num_unsaved_evictions}"
        )


class HostIndex:
    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"host tier needs at least one block slot, got num_slots={num_slots}")
        self.num_slots = num_slots
        self._slot_of: OrderedDict[Hashable, int] = OrderedDict()  # LRU first
        self._hash_of: dict[int, Hashable] = {}
        self._free: list[int] = list(range(num_slots - 1, -1, -1))
        self._locks: dict[int, int] = {}
        self._pending: list[int] = []  # slots of saves planned but not yet shipped (locked meanwhile)
        self.stats = HostIndexStats()

    # ---- queries ------------------------------------------------------------------------------------
    @property
    def num_used_slots(self) -> int:
        return len(self._slot_of)

    def __contains__(self, block_hash: Hashable) -> bool:
        return block_hash in self._slot_of

    def slot_of(self, block_hash: Hashable) -> int | None:
        return self._slot_of.get(block_hash)

    def slot_hash(self, slot: int) -> Hashable | None:
        """The block a slot holds (None: free)."""
        return self._hash_of.get(slot)

    def order(self) -> list[Hashable]:
        """The held blocks, first in line for eviction first."""
        return list(self._slot_of)

    def match(self, block_hashes: Sequence[Hashable], start: int, max_blocks: int) -> list[int]:
        """Slots of the consecutive blocks ``block_hashes[start:]`` the host holds (at most ``max_blocks``)."""
        slots: list[int] = []
        for h in block_hashes[start : start + max(0, max_blocks)]:
            slot = self._slot_of.get(h)
            if slot is None:
                break
            slots.append(slot)
        return slots

    # ---- mutations ----------------------------------------------------------------------------------
    def touch(self, block_hash: Hashable) -> None:
        if block_hash in self._slot_of:
            self._slot_of.move_to_end(block_hash)

    def lock(self, slots: Iterable[int]) -> None:
        for slot in slots:
            self._locks[slot] = self._locks.get(slot, 0) + 1
            h = self._hash_of.get(slot)
            if h is not None:
                self._slot_of.move_to_end(h)

    def unlock(self, slots: Iterable[int]) -> None:
        for slot in slots:
            n = self._locks.get(slot, 0) - 1
            if n < 0:
                raise RuntimeError(f"host slot {slot} unlocked more often than locked")
            if n:
                self._locks[slot] = n
            else:
                del self._locks[slot]

    def reserve(self, block_hash: Hashable, *, pending: bool = False) -> int | None:
        """A slot for ``block_hash`` (the caller copies the block into it), or None if all are locked.

        A hash the host already holds keeps its slot (no copy is needed: the caller checks ``in``
        first). Evicts the least recently used unlocked block when no slot is free. ``pending``: the copy
        is only planned; the slot stays locked until :meth:`ship`.
        """
        if block_hash in self._slot_of:
            raise ValueError("block is already in the host tier; touch it instead of saving it again")
        slot = self._free.pop() if self._free else self._evict_one()
        if slot is None:
            self.stats.num_save_skipped_full += 1
            return None
        self._slot_of[block_hash] = slot
        self._hash_of[slot] = block_hash
        self.stats.num_saved_blocks += 1
        if pending:
            self._locks[slot] = self._locks.get(slot, 0) + 1
            self._pending.append(slot)
        return slot

    def ship(self) -> None:
        """The planned saves went to the worker (in one step, before any later step's): their slots may be
        evicted again from now on."""
        pending, self._pending = self._pending, []
        self.unlock(pending)

    def touch_chain(self, block_hashes: Sequence[Hashable]) -> None:
        """Mark a prompt's blocks (in prompt order) used now, head most recently: eviction, least recently
        used first, then takes the chain's tail before its head."""
        for h in reversed(block_hashes):
            if h in self._slot_of:
                self._slot_of.move_to_end(h)

    def release_loads(self, slots: Sequence[int]) -> None:
        """The loads from these slots were shipped to the worker: unlock them and put them first in line
        for eviction, each load's chain tail first (``slots`` in load order, each chain head first).

        Why first: the device holds those blocks now, so the host copy is a spare that would otherwise
        take a slot from a context the device has lost (the tier holds what the device does not). The
        copy stays until a save needs the slot; when the device evicts the block again while the copy is
        still here, the save finds it (``in``) and touches it instead of copying it."""
        self.unlock(slots)
        self._to_front(self._hash_of[slot] for slot in slots if slot in self._hash_of)

    def demote(self, block_hashes: Iterable[Hashable]) -> int:
        """Put these blocks first in line for eviction (a released program's: no turn of it will read them;
        a block another session shares moves back to the end when that session saves or loads it)."""
        n = self._to_front(block_hashes)
        self.stats.num_demoted_blocks += n
        return n

    def _to_front(self, block_hashes: Iterable[Hashable]) -> int:
        """Move the held ones of these blocks to the front of the line, in order (the last ends up first);
        how many were held."""
        n = 0
        for h in block_hashes:
            if h in self._slot_of:
                self._slot_of.move_to_end(h, last=False)
                n += 1
        return n

    def _evict_one(self) -> int | None:
        for h, slot in self._slot_of.items():
            if slot not in self._locks:
                del self._slot_of[h]
                del self._hash_of[slot]
                self.stats.num_evicted_blocks += 1
                return slot
        return None

    def check(self) -> None:
        """Invariants (tests): every slot is free xor held by exactly one hash."""
        held = set(self._slot_of.values())
        assert len(held) == len(self._slot_of), "two hashes share a slot"
        assert not held & set(self._free), "a held slot is also free"
        assert len(held) + len(self._free) == self.num_slots, "a slot was lost"
        assert all(self._hash_of[s] == h for h, s in self._slot_of.items())
