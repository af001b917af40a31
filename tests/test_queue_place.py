"""Both engines place waiting turns alike (``engine_adapter._queue_place``): program FCFS with aging, and
pinned turns first.

One scene: program P (started at 0) comes back to a pinned context at t=20; program N's first turn arrived
at t=10; program Q (started at 1, not pinned) came back at t=12. With aging 3 s Q's place is 9, so: P
(pinned), Q, N. Without aging (strict program FCFS): P, Q, N too; with aging 1 s Q's place is 11: P, N, Q.
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import pytest

from engine_adapter._queue_place import holds_pin, queue_place
from engine_adapter._request import Request
from engine_adapter._session import Session
from engine_adapter.vllm_backend._hint_scheduler import HintSchedulerMixin
from engine_adapter.vllm_backend._sessions import VSession

SCENE = [  # (program, program start, arrival, pinned)
    ("P", 0.0, 20.0, True), ("N", 10.0, 10.0, False), ("Q", 1.0, 12.0, False),
]  # fmt: skip


def _embedded_order(aging_s: float) -> list[str]:
    reqs = []
    for i, (prog, start, arrival, pinned) in enumerate(SCENE):
        s = Session(f"{prog}-s", prog, created_s=start, program_start_s=start, pin_deadline_s=99.0 if pinned else None)
        s.pinned_blocks = 2 if pinned else 0
        r = Request(f"r{i}", s, [1, 2, 3], max_new_tokens=1, arrival_s=arrival)
        r._seq = i
        reqs.append(r)
    aging = None if math.isinf(aging_s) else aging_s
    return [r.session.program_id for r in sorted(reqs, key=lambda r: r.sort_key(aging))]


def _vllm_order(aging_s: float) -> list[str]:
    """``priority_for`` on a stand-in for the scheduler: the attributes it reads, no vLLM engine."""
    now = {"t": 0.0}
    host: Any = SimpleNamespace(
        _priority_policy=lambda: True, _req_start={}, book=SimpleNamespace(clock=lambda: now["t"]),
        aging_s=aging_s, pinned_first=True, _epoch_s=0.0,
    )  # fmt: skip
    keyed = []
    for i, (prog, start, arrival, pinned) in enumerate(SCENE):
        s = VSession(f"{prog}-s", prog, first_seen_s=start, last_active_s=arrival, program_start_s=start)
        s.pin_deadline_s = 99.0 if pinned else None
        s.held = [object(), object()] if pinned else []  # type: ignore[list-item]  # (only counted)
        now["t"] = arrival
        keyed.append((HintSchedulerMixin.priority_for(host, s, 0, f"r{i}"), prog))
    return [prog for _, prog in sorted(keyed)]


@pytest.mark.parametrize(("aging_s", "order"), [(3.0, ["P", "Q", "N"]), (math.inf, ["P", "Q", "N"]), (1.0, ["P", "N", "Q"])])
def test_both_engines_order_the_scene_alike(aging_s: float, order: list[str]) -> None:
    assert _embedded_order(aging_s) == order
    assert _vllm_order(aging_s) == order


def _old_and_young() -> tuple[Any, VSession, VSession]:
    """A stand-in for the vLLM scheduler (strict program FCFS, at t=5) and two sessions: an old program's
    (started at 0) and a young one's (started at 3), both back at t=4."""
    host: Any = SimpleNamespace(
        _priority_policy=lambda: True, _req_start={}, book=SimpleNamespace(clock=lambda: 5.0),
        aging_s=math.inf, pinned_first=True, _epoch_s=0.0,
    )  # fmt: skip
    old = VSession("old-s", "old", first_seen_s=0.0, last_active_s=4.0, program_start_s=0.0)
    young = VSession("young-s", "young", first_seen_s=3.0, last_active_s=4.0, program_start_s=3.0)
    return host, old, young


def test_a_lease_that_holds_no_blocks_is_not_the_pinned_band_on_either_engine() -> None:
    """A pin the budget clamped to nothing keeps no memory for its turn: the turn is placed as an unpinned
    one (``holds_pin``), behind warm turns, and an older program's cold one goes first as ever."""
    assert holds_pin(30.0, 3) and not holds_pin(30.0, 0) and not holds_pin(None, 3)
    host, old, young = _old_and_young()
    young.pin_deadline_s = 60.0  # leased, nothing held
    cold_old = HintSchedulerMixin.priority_for(host, old, 0, "r0")
    assert HintSchedulerMixin.priority_for(host, young, 0, "r1") > cold_old
    young.held = [object()]  # type: ignore[list-item]  # now it keeps a block: the pinned band
    assert HintSchedulerMixin.priority_for(host, young, 0, "r2") < cold_old
    # the embedded node's key alike
    es_old = Session("old-s", "old", created_s=0.0, program_start_s=0.0)
    es_young = Session("young-s", "young", created_s=3.0, program_start_s=3.0, pin_deadline_s=60.0)
    r_old = Request("r0", es_old, [1, 2, 3], max_new_tokens=1, arrival_s=4.0)
    r_young = Request("r1", es_young, [1, 2, 3], max_new_tokens=1, arrival_s=4.0)
    r_old._seq, r_young._seq = 0, 1
    assert r_young.sort_key() > r_old.sort_key()
    es_young.pinned_blocks = 1
    assert r_young.sort_key() < r_old.sort_key()


def test_the_place_itself() -> None:
    assert queue_place(0.0, 20.0, pinned=False) == (2, 0.0)  # strict program FCFS
    assert queue_place(0.0, 20.0, pinned=False, aging_s=3.0) == (2, 17.0)
    assert queue_place(0.0, 20.0, pinned=False, warm=True) == (1, 0.0)
    assert queue_place(0.0, 20.0, pinned=True, warm=True) == (0, 0.0)
    assert queue_place(0.0, 20.0, pinned=True, aging_s=3.0) == (0, 17.0)
    assert queue_place(5.0, 20.0, pinned=True, aging_s=math.inf) == (0, 5.0)


# ---- warm first ------------------------------------------------------------------------------------------


def test_a_turn_is_warm_while_little_of_its_prompt_is_left_to_compute() -> None:
    from engine_adapter._queue_place import WARM_THRESHOLD_TOKENS, is_warm

    assert is_warm(2000, 2000 - WARM_THRESHOLD_TOKENS)
    assert not is_warm(2000, 2000 - WARM_THRESHOLD_TOKENS - 1)
    assert is_warm(100, 0)  # a short prompt costs little whatever is cached


def test_the_vllm_nodes_cached_run_is_found_on_the_device_then_on_the_host() -> None:
    """``_warm.num_cached_tokens``: the device's prefix, then the host tier's run right after it, by
    bisection; the last prompt token never counts (vLLM always computes it)."""
    from engine_adapter.vllm_backend._warm import num_cached_tokens

    hashes = list(range(10))  # a prompt of 10 full blocks of 4 tokens, plus 2 tokens
    device = {0, 1, 2}.__contains__
    host = {3, 4, 5, 6}.__contains__
    assert num_cached_tokens(hashes, 42, 4, device) == 12
    assert num_cached_tokens(hashes, 42, 4, device, host) == 28
    assert num_cached_tokens(hashes, 42, 4, lambda h: False, host) == 0  # a host run must start at block 0
    assert num_cached_tokens(hashes, 40, 4, lambda h: True) == 36  # the last token's block is computed
    assert num_cached_tokens([], 3, 4, lambda h: True) == 0
    # a prompt whose every block is held: found in O(log n) probes, not one per block
    probes: list[int] = []
    assert num_cached_tokens(list(range(1024)), 4097, 4, lambda h: probes.append(h) is None) == 4096
    assert len(probes) <= 11


def test_the_vllm_node_puts_a_warm_turn_in_the_pinned_band() -> None:
    """A warm turn of a younger program goes ahead of an older program's cold one (``priority_for``)."""
    host, old, young = _old_and_young()
    cold_old = HintSchedulerMixin.priority_for(host, old, 0, "r0")
    assert HintSchedulerMixin.priority_for(host, young, 0, "r1") > cold_old
    assert HintSchedulerMixin.priority_for(host, young, 0, "r2", warm=True) < cold_old
