"""The migration planner: which context moves where, what each destination was promised, what moves did.

The rules (``move_target``, ``take_context_along``) say whether one turn's context should move given the
nodes' room.  Between the decision and the copy's end the destination has taken none of the turn's memory
yet, so a second decision in that window would count the same room twice.  The planner keeps those
promises (blocks and a sequence slot per move on its way), subtracts them from what a shell reports of a
node, and counts the moves' outcome.  Plain Python, no I/O and no clock: the replay
(``replay/_migration.py``, virtual time, in-process engines) and the live runtime
(``workflows/_context_moves.py``, gRPC streams) each describe the nodes as they see them in ``NodeRoom``s
and carry each move out their own way, between ``begin`` and ``done`` / ``failed``::

    rooms as the shell sees them ─► room() less promises ─► queued_target / take_along
    begin(move)  (promise dst the turn's blocks and a slot)  ─► the shell copies  ─► done(...) | failed(...)
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, replace

from orchestrator._rebalance import NodeRoom, QueuedTurn, move_target, take_context_along

__all__ = ["MovePlanner", "MoveStats", "PlannedMove"]


@dataclass
class MoveStats:
    """What the moves did, for reports (the replay's migration columns, ``hintflow run``'s moves line)."""

    num_moves: int = 0  # routed and queued, done: the context arrived and the turn went with it
    num_queued_moves: int = 0  # of which queued turns moved to a node with room
    num_failed: int = 0  # the destination had no room after all, or the copy broke
    num_skipped: int = 0  # routed moves not tried: recomputing was expected to be quicker, or no room
    num_tokens: int = 0
    num_bytes: int = 0
    move_s: float = 0.0  # summed over the moves done


@dataclass(frozen=True, slots=True)
class PlannedMove:
    """One move between ``begin`` and its end: ``need_blocks`` and one sequence slot promised on ``dst``."""

    move_id: int  # unique in its planner
    kind: str  # "queued" (a turn waiting on src) or "routed" (the router sent the session's turn to dst)
    session_id: str
    src: str
    dst: str
    need_blocks: int


class MovePlanner:
    """Promises and outcomes of context moves between nodes; the decisions are ``move_target`` and
    ``take_context_along`` on the nodes' room less what moves on their way there were promised."""

    window = 16  # recent moves the measured seconds-per-token is taken over

    def __init__(self) -> None:
        self.stats = MoveStats()
        self._blocks: dict[str, int] = {}  # destination -> blocks promised to moves on their way
        self._turns: dict[str, int] = {}  # destination -> moves on their way (each takes a sequence slot)
        self._recent: deque[tuple[int, float]] = deque(maxlen=self.window)  # (tokens, seconds) per move
        self._live: set[int] = set()  # the moves begun and not ended
        self._next_id = 0

    # ---- queries ----------------------------------------------------------------------------------------
    def room(self, node: NodeRoom) -> NodeRoom:
        """``node`` as its shell sees it, less the blocks and slots promised to moves on their way there."""
        blocks, turns = self._blocks.get(node.address, 0), self._turns.get(node.address, 0)
        if not blocks and not turns:
            return node
        return replace(node, free_slots=node.free_slots - turns, room_blocks=node.room_blocks - blocks)

    def promised_blocks(self, address: str) -> int:
        return self._blocks.get(address, 0)

    def promised_turns(self, address: str) -> int:
        return self._turns.get(address, 0)

    def queued_target(self, turn: QueuedTurn, nodes: Sequence[NodeRoom], s_per_token: float) -> str | None:
        """Where the queued ``turn`` should move now (``move_target`` on the promised-less rooms), or None."""
        return move_target(turn, [self.room(n) for n in nodes], s_per_token)

    def take_along(
        self, context_tokens: int, need_tokens: int, dst: NodeRoom, s_per_token: float | None, recompute_s: float
    ) -> bool:
        """Whether a session the router sent to ``dst`` takes its context along (``take_context_along`` on
        ``dst``'s promised-less room); a routed context that stays behind counts as skipped."""
        if take_context_along(context_tokens, need_tokens, self.room(dst), s_per_token, recompute_s):
            return True
        if context_tokens > 0:
            self.stats.num_skipped += 1
        return False

    def measured_s_per_token(self) -> float | None:
        """Seconds per token of the recent moves done (None before the first)."""
        if not self._recent:
            return None
        return sum(s for _, s in self._recent) / max(1, sum(n for n, _ in self._recent))

    # ---- a move's life ----------------------------------------------------------------------------------
    def begin(self, kind: str, session_id: str, src: str, dst: str, need_blocks: int) -> PlannedMove:
        """The shell starts the move now: ``dst`` is promised ``need_blocks`` and a slot until it ends."""
        if kind not in ("queued", "routed"):
            raise ValueError(f"move kind must be 'queued' or 'routed', got {kind!r}")
        if src == dst:
            raise ValueError(f"session {session_id!r}: a move needs two nodes, got {src!r} twice")
        if need_blocks < 0:
            raise ValueError(f"need_blocks must be >= 0, got {need_blocks}")
        self._blocks[dst] = self._blocks.get(dst, 0) + need_blocks
        self._turns[dst] = self._turns.get(dst, 0) + 1
        self._next_id += 1
        self._live.add(self._next_id)
        return PlannedMove(self._next_id, kind, session_id, src, dst, need_blocks)

    @property
    def num_in_flight(self) -> int:
        return len(self._live)

    def done(self, move: PlannedMove, num_tokens: int, num_bytes: int, move_s: float) -> None:
        """The copy arrived and the turn goes on at ``move.dst``: the promise ends, the move counts."""
        if not (math.isfinite(move_s) and move_s >= 0.0):
            raise ValueError(f"move_s must be finite and >= 0, got {move_s}")
        self._end(move)
        st = self.stats
        st.num_moves += 1
        st.num_queued_moves += move.kind == "queued"
        st.num_tokens += num_tokens
        st.num_bytes += num_bytes
        st.move_s += move_s
        self._recent.append((num_tokens, move_s))

    def failed(self, move: PlannedMove) -> None:
        """The move did not happen (the context is where it was): the promise ends."""
        self._end(move)
        self.stats.num_failed += 1

    def _end(self, move: PlannedMove) -> None:
        if move.move_id not in self._live:
            raise RuntimeError(f"move of {move.session_id!r} to {move.dst!r} ended twice or was never begun")
        self._live.remove(move.move_id)
        self._blocks[move.dst] -= move.need_blocks
        self._turns[move.dst] -= 1
