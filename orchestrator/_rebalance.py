"""When a turn queued on one node should move, with its context, to another node that has room now.

A turn queues on its session's node while the running turns there hold the memory it needs, and sometimes
another node has the room right then.  Recomputing the context there costs compute every turn queued on
that node pays for; copying it costs a transfer, about a host reload's price.  The rule, rent-or-buy::

    turn t queued on A, never admitted, A's scheduler has passed it over, waited >= its transfer time
    node B: nothing waiting, a free sequence slot, room >= what t needs to finish   ->  move t to B

A session the router sends away from its home at a turn's start takes its context along by
``take_context_along``: when the destination can take the turn now and the copy is expected quicker than
recomputing the context there.

A queued turn moves only after waiting on its node as long as its transfer takes, so one that its own node admits
within that time never pays for a copy; the wait is counted from when the turn reached its node, so a moved
turn is not moved on before its new node has looked at it (no ping-pong); and at most twice.  Of the nodes
that fit, the one with the most room (the first of equals, in the caller's order).

Plain Python, no I/O: the replay (``replay/_migration.py``, virtual clock, in-process engines) and the
live runtime (``workflows/_context_moves.py``, gRPC) each describe what they see in these value objects
and carry out the answer their own way.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["MAX_MOVES_PER_TURN", "NodeRoom", "QueuedTurn", "move_target", "take_context_along"]

MAX_MOVES_PER_TURN = 2
"""A turn that could not start after two moves waits where it is."""


@dataclass(frozen=True, slots=True)
class NodeRoom:
    """What a move needs to know of a candidate node now."""

    address: str
    num_waiting: int  # turns waiting to be admitted there
    free_slots: int  # sequences it can still admit (less the moves already on their way there)
    room_blocks: int  # device blocks a moved turn can count on (less pins and moves on their way)
    block_size: int


@dataclass(frozen=True, slots=True)
class QueuedTurn:
    """A turn waiting on ``node`` that has never been admitted there."""

    session_id: str
    node: str
    waited_s: float  # since it reached this node
    passed_over: bool  # the node's scheduler has looked at its queue since the turn arrived
    context_tokens: int  # its context on that node (what a move copies)
    need_tokens: int  # prompt + output: what it needs to finish
    num_moves: int  # moves this turn has made already


def move_target(turn: QueuedTurn, nodes: Sequence[NodeRoom], transfer_s_per_token: float) -> str | None:
    """The node ``turn`` should move to now, or None to let it wait where it is."""
    if not (math.isfinite(transfer_s_per_token) and transfer_s_per_token >= 0.0):
        raise ValueError(f"transfer_s_per_token must be finite and >= 0, got {transfer_s_per_token}")
    if not turn.context_tokens or not turn.passed_over or turn.num_moves >= MAX_MOVES_PER_TURN:
        return None  # nothing to take along (a first turn waits where the router sent it), or seen enough
    if turn.waited_s < turn.context_tokens * transfer_s_per_token:
        return None  # its own node may still admit it before a copy would have arrived

    def need_blocks(n: NodeRoom) -> int:
        return -(-turn.need_tokens // n.block_size)

    fitting = [
        n for n in nodes
        if n.address != turn.node and not n.num_waiting and n.free_slots > 0 and n.room_blocks >= need_blocks(n)
    ]
    if not fitting:
        return None
    return max(fitting, key=lambda n: n.room_blocks).address  # (ties: the first in the caller's order)


def take_context_along(
    context_tokens: int, need_tokens: int, dst: NodeRoom, transfer_s_per_token: float | None, recompute_s: float
) -> bool:
    """Whether a session the router sent away from its home takes its context along to ``dst``: there is a
    context to copy, ``dst`` can take the turn now (a free sequence slot, room for what the turn needs to
    finish), and the copy is expected to be quicker than recomputing it there (``transfer_s_per_token``
    None: no move measured yet, the first is tried on faith)."""
    if context_tokens <= 0 or dst.free_slots <= 0 or dst.room_blocks < -(-need_tokens // dst.block_size):
        return False
    return transfer_s_per_token is None or context_tokens * transfer_s_per_token < recompute_s
