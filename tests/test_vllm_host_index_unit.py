"""The vLLM host tier's book (no vLLM needed): slots, LRU eviction, locks, forget, and its config."""

from __future__ import annotations

import random

import pytest

from engine_adapter.vllm_backend._host_index import CONNECTOR_MODULE, HostIndex, host_tier_config


def test_reserve_match_and_lru_eviction() -> None:
    idx = HostIndex(3)
    slots = [idx.reserve(h) for h in ("a", "b", "c")]
    assert sorted(s for s in slots if s is not None) == [0, 1, 2]
    assert idx.match(["a", "b", "c", "d"], 0, 10) == slots
    assert idx.match(["a", "x", "c"], 0, 10) == slots[:1]  # a run stops at the first miss
    assert idx.match(["a", "b", "c"], 1, 1) == slots[1:2]  # from a start, at most max_blocks
    idx.touch("a")  # b is now the least recently used
    d = idx.reserve("d")
    assert d == slots[1] and "b" not in idx and "a" in idx
    assert idx.stats.num_evicted_blocks == 1 and idx.stats.num_saved_blocks == 4
    idx.check()


def test_locked_slots_are_not_evicted_and_a_full_locked_book_refuses() -> None:
    idx = HostIndex(2)
    a, b = idx.reserve("a"), idx.reserve("b")
    assert a is not None and b is not None
    idx.lock([a])
    assert idx.reserve("c") == b  # "a" is older but locked: "b" goes
    idx.lock([b])
    assert idx.reserve("d") is None and idx.stats.num_save_skipped_full == 1
    idx.unlock([a, b])
    assert idx.reserve("d") == a
    with pytest.raises(RuntimeError, match="unlocked more often"):
        idx.unlock([a])
    idx.check()


def test_demoted_blocks_are_evicted_first() -> None:
    idx = HostIndex(3)
    for h in "abc":
        idx.reserve(h)
    assert idx.demote(["c", "zz"]) == 1  # "c" was the most recently saved
    idx.reserve("d")
    assert "c" not in idx and {"a", "b", "d"} <= {h for h in "abd" if h in idx}
    idx.demote(["a"])
    idx.touch("a")  # another session reads it again: back to the end of the line
    idx.reserve("e")
    assert "a" in idx and "b" not in idx
    assert idx.stats.num_demoted_blocks == 2
    idx.check()


def test_saving_a_held_block_again_is_an_error() -> None:
    idx = HostIndex(2)
    idx.reserve("a")
    with pytest.raises(ValueError, match="already in the host tier"):
        idx.reserve("a")
    with pytest.raises(ValueError, match="at least one block slot"):
        HostIndex(0)


def test_random_operations_keep_every_slot_accounted_for() -> None:
    rng = random.Random(7)
    idx = HostIndex(16)
    locked: list[int] = []
    for _ in range(3000):
        op = rng.random()
        h = rng.randrange(40)
        if op < 0.5:
            if h not in idx:
                idx.reserve(h)
        elif op < 0.65:
            idx.demote([h])
        elif op < 0.8 and (slot := idx.slot_of(h)) is not None:
            idx.lock([slot])
            locked.append(slot)
        elif locked:
            idx.unlock([locked.pop(rng.randrange(len(locked)))])
        idx.check()
        assert idx.num_used_slots <= 16


def test_one_steps_saves_never_take_the_same_slot_twice() -> None:
    """A save planned this step keeps its slot locked until the step ships (``index_copy_`` with a repeated
    index is undefined on CUDA): before, six blocks saved into four slots in one step wrote slots 0 and 1
    twice and the book no longer held the chain's head."""
    idx = HostIndex(4)
    slots = [idx.reserve(f"h{i}", pending=True) for i in range(6)]
    assert sorted(s for s in slots[:4] if s is not None) == [0, 1, 2, 3]
    assert slots[4:] == [None, None] and idx.stats.num_save_skipped_full == 2
    assert "h0" in idx and "h4" not in idx
    idx.ship()  # the step's copies went to the worker: its slots may be evicted again
    assert idx.reserve("h4", pending=True) is not None and idx.num_used_slots == 4
    idx.ship()
    idx.check()


def test_a_pending_save_keeps_its_slot_through_a_demotion_in_the_same_step() -> None:
    idx = HostIndex(3)
    pending = [idx.reserve("a0", pending=True), idx.reserve("a1", pending=True)]
    assert idx.reserve("x", pending=True) is not None
    idx.demote(["a0", "a1"])  # a Release in the same step: first in line, but their copies are still due
    assert idx.reserve("b0", pending=True) is None
    assert [idx.slot_of("a0"), idx.slot_of("a1")] == pending
    idx.ship()
    assert idx.reserve("b0") == pending[1]  # from the next step on, demoted blocks go first (tail first)
    idx.check()


def test_a_chain_loses_its_tail_before_its_head() -> None:
    """A host run is matched from its first block: a chain that lost its head matches nothing."""
    idx = HostIndex(4)
    for h in ("other", "c0", "c1", "c2"):  # saved head to tail, as a prompt fills: c0 least recently
        idx.reserve(h)
    idx.touch_chain(["c0", "c1", "c2"])  # used again: c0 most recently, then c1, c2
    idx.reserve("n1")
    assert "other" not in idx
    idx.reserve("n2")
    assert "c2" not in idx and idx.match(["c0", "c1", "c2"], 0, 3) == [idx.slot_of("c0"), idx.slot_of("c1")]
    idx.reserve("n3")
    assert "c1" not in idx and "c0" in idx
    idx.check()


def test_loaded_blocks_go_first_in_line_tail_first_and_stay_until_a_save_needs_them() -> None:
    """A load puts the blocks back on the device: the host copies are spares, evicted before any block the
    device has lost, the chain's tail first; a slot still being read is not handed out."""
    idx = HostIndex(4)
    for h in ("lost", "c0", "c1", "c2"):
        idx.reserve(h)
    slots = [idx.slot_of(h) for h in ("c0", "c1", "c2")]
    assert None not in slots
    idx.lock(slots)  # a step plans the loads of c0..c2 (the connector locks them) ...
    assert idx.reserve("n0") == idx.slot_of("n0") and "lost" not in idx  # ... so a save takes another slot
    idx.release_loads(slots)  # ... and ships them
    assert idx.match(["c0", "c1", "c2"], 0, 3) == slots  # still matched until a save needs the room
    idx.reserve("n1")
    assert "c2" not in idx and "n0" in idx  # the spare tail went, not the older save
    idx.reserve("n2")
    assert "c1" not in idx and "c0" in idx
    idx.touch("c0")  # the device evicted c0 again while its copy was here: back in line, no copy
    idx.reserve("n3")
    assert "c0" in idx and "n0" not in idx
    assert idx.stats.num_demoted_blocks == 0  # (demotions count released programs' blocks only)
    idx.check()


def test_host_tier_config_names_the_connector() -> None:
    cfg = host_tier_config(4096)
    assert cfg["kv_connector_module_path"] == CONNECTOR_MODULE
    assert cfg["kv_connector_extra_config"] == {"host_capacity_tokens": 4096}
    with pytest.raises(ValueError, match="host_capacity_tokens must be positive"):
        host_tier_config(0)
    # when blocks go to the host: named, or left to the server (HINTFLOW_HOST_SAVE, else on eviction)
    assert host_tier_config(4096, "write-through")["kv_connector_extra_config"]["host_save"] == "write-through"
    with pytest.raises(ValueError, match="host_save must be one of evict, write-through; got 'sideways'"):
        host_tier_config(4096, "sideways")
