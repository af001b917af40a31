"""``orchestrator.move_target``: the one rule, for the replay and the live runtime, of when a queued turn
moves with its context and where; and ``orchestrator.MovePlanner``, which both shells move contexts through."""

from __future__ import annotations

import pytest

from orchestrator import MAX_MOVES_PER_TURN, MovePlanner, NodeRoom, QueuedTurn, move_target

RATE = 1e-4  # seconds per token on the link: a 1,000-token context takes 0.1 s


def _turn(**kw: object) -> QueuedTurn:
    base: dict[str, object] = dict(
        session_id="s", node="a", waited_s=1.0, passed_over=True, context_tokens=1000, need_tokens=1100,
        num_moves=0,
    )
    return QueuedTurn(**(base | kw))  # type: ignore[arg-type]


def _room(address: str, room_blocks: int = 100, num_waiting: int = 0, free_slots: int = 4) -> NodeRoom:
    return NodeRoom(address, num_waiting, free_slots, room_blocks, block_size=16)


def test_a_turn_moves_to_the_open_node_with_the_most_room() -> None:
    nodes = [_room("b", 80), _room("c", 120), _room("d", 120)]
    assert move_target(_turn(), nodes, RATE) == "c"  # of equals, the first in the caller's order


@pytest.mark.parametrize(
    ("why", "turn", "nodes"),
    [
        ("nothing to take along", _turn(context_tokens=0), [_room("b")]),
        ("its node has not looked at it yet", _turn(passed_over=False), [_room("b")]),
        ("moved enough", _turn(num_moves=MAX_MOVES_PER_TURN), [_room("b")]),
        ("has not waited its transfer time", _turn(waited_s=0.05), [_room("b")]),
        ("the other node has a queue", _turn(), [_room("b", num_waiting=1)]),
        ("no sequence slot there", _turn(), [_room("b", free_slots=0)]),
        ("no room there (69 blocks needed)", _turn(), [_room("b", room_blocks=68)]),
        ("only its own node", _turn(), [_room("a")]),
    ],
)
def test_a_turn_stays(why: str, turn: QueuedTurn, nodes: list[NodeRoom]) -> None:
    assert move_target(turn, nodes, RATE) is None, why


def test_exactly_enough_room_and_exactly_its_transfer_time_is_enough() -> None:
    assert move_target(_turn(waited_s=0.1), [_room("b", room_blocks=69)], RATE) == "b"


@pytest.mark.parametrize("rate", [-1e-4, float("nan"), float("inf")])
def test_a_bad_link_rate_is_refused(rate: float) -> None:
    with pytest.raises(ValueError, match="transfer_s_per_token"):
        move_target(_turn(), [_room("b")], rate)


# ---- the planner: what moves on their way were promised, and what the moves did -------------------------
def test_a_promised_room_is_not_given_twice_and_comes_back_when_the_move_ends() -> None:
    planner = MovePlanner()
    b = _room("b", room_blocks=100, free_slots=2)
    assert planner.queued_target(_turn(session_id="s"), [b], RATE) == "b"
    first = planner.begin("queued", "s", "a", "b", 69)  # 1,100 tokens to finish: 69 blocks of 16
    # A second turn sees b less the first move's promise: 31 blocks, too few.
    assert planner.room(b) == NodeRoom("b", 0, 1, 31, 16)
    assert planner.queued_target(_turn(session_id="t"), [b], RATE) is None
    planner.failed(first)  # the receiver had no room after all: the promise ends, nothing moved
    assert planner.room(b) == b and planner.stats.num_failed == 1 and planner.stats.num_moves == 0
    assert planner.queued_target(_turn(session_id="t"), [b], RATE) == "b"
    second = planner.begin("queued", "t", "a", "b", 69)
    planner.done(second, num_tokens=1000, num_bytes=4096_000, move_s=0.2)
    assert planner.room(b) == b
    st = planner.stats
    assert (st.num_moves, st.num_queued_moves, st.num_tokens, st.num_bytes) == (1, 1, 1000, 4096_000)
    assert planner.measured_s_per_token() == pytest.approx(2e-4)
    with pytest.raises(RuntimeError, match="ended twice"):
        planner.done(second, 1000, 0, 0.2)  # a move ends once: no promise is given back twice


def test_a_routed_context_stays_behind_when_the_promised_room_is_gone() -> None:
    planner = MovePlanner()
    b = _room("b", room_blocks=100)
    assert planner.take_along(1000, 1100, b, None, 1.0)  # no move measured yet: tried on faith
    planner.begin("routed", "s", "a", "b", 69)
    assert not planner.take_along(1000, 1100, b, None, 1.0)
    assert planner.stats.num_skipped == 1


@pytest.mark.parametrize(
    ("args", "match"),
    [(("sideways", "s", "a", "b", 1), "kind"), (("queued", "s", "a", "a", 1), "two nodes"),
     (("queued", "s", "a", "b", -1), "need_blocks")],
)
def test_a_bad_move_is_refused(args: tuple[str, str, str, str, int], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        MovePlanner().begin(*args)
