"""The live runtime's context moves between nodes: the replay's ``hintflow`` migration, live.

Two moves, both streamed from node to node by ``hints.move_context`` (two-phase: the source lets go only
once the destination has committed the copy; docs/failures.md says what each failure leaves):

* **Routed**: the router sends a session's turn away from its home node (``HintFlowRouting`` does when
  home's queue makes even a cold start elsewhere cheaper).  The context goes along by
  ``orchestrator.take_context_along``, the rule the replay's migrator calls too: when the destination has
  room for the turn now (its last ``free_blocks`` less what moves on their way there were promised; a node
  the router has no state of is tried) and the copy is expected to be quicker than re-prefilling it
  there: tokens times the seconds per token the recent moves took (the first is tried on faith) against
  the runtime's measured ``PrefillReload``.
* **Queued**: a turn waits on its node, never admitted, while another node has room for it now.  The rule is
  ``orchestrator.move_target`` (rent-or-buy: only after waiting as long as its copy takes; at most twice),
  the same function the replay's migrator calls.  The turn's call is cancelled (the node aborts the
  waiting request, its context stays parked), the context moves, and the turn is sent to the new node.  A
  move that fails sends the turn back to its own node (where its context still is), at the end of the line.

Between vLLM nodes only routed moves run, over their hint services (``vllm_hints``; the node side is
``engine_adapter/vllm_backend/_context_moves.py``): a queued turn there is an HTTP call the runtime does not
cancel and re-send. A vLLM node that cannot read its KV (its model runs in other processes) refuses the
first move with FAILED_PRECONDITION; the runtime then stops asking it, and its sessions are recomputed
where they go, as before.

Moves are checked every ``check_s`` while a turn waits for its first token, from the router's view of the
nodes (their ``WatchCacheState`` streams).  What decides is the core's ``orchestrator.MovePlanner``, as in the
replay: a node's ``free_blocks`` less what the moves on their way there were promised is its room, and
every move begun there ends there, done or failed, on every path (a cancelled call too).  The time a turn spent before a move counts in its TTFT and queue wait.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Mapping

import grpc
from prometheus_client import CollectorRegistry, Counter

from hints import ContextMove, ContextMoveError, EngineClient, GenerateResult, VllmClient, move_context
from orchestrator import MovePlanner, MoveStats, NodeRoom, PlannedMove, QueuedTurn, Router
from workflows._publisher import node_client

__all__ = ["ContextMover"]

logger = logging.getLogger(__name__)

_UNBOUNDED_SLOTS = 1 << 20  # a node's CacheState does not say how many sequences it admits: room decides


class ContextMover:
    """Runs the moves the core's ``MovePlanner`` decides; one per runtime.  ``pin_ttl_s``: how long the
    destination keeps a copy pinned for the turn on its way (sent right after the commit)."""

    abort_wait_s = 1.0  # a cancelled waiting turn is aborted on its node within milliseconds; this at most

    def __init__(
        self,
        router: Router,
        clients: Mapping[str, EngineClient | VllmClient],
        registry: CollectorRegistry,
        *,
        pin_ttl_s: float = 10.0,
        check_s: float = 0.1,
        vllm_hints: Mapping[str, str] | None = None,
    ) -> None:
        for name, value in (("pin_ttl_s", pin_ttl_s), ("check_s", check_s)):
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"ContextMover: {name} must be finite and > 0, got {value!r}")
        self.router, self.clients = router, clients
        self.pin_ttl_s, self.check_s = pin_ttl_s, check_s
        self._vllm_hints = dict(vllm_hints or {})  # vLLM node -> its hint service (ExportContext, ImportContext)
        self._hint_clients: dict[str, EngineClient] = {}  # opened on a vLLM node's first move
        self._cannot_move: set[str] = set()  # vLLM nodes that refused: their KV is in other processes
        self.planner = MovePlanner()  # the promises to moves on their way, the moves' counts and rate
        self._m_moves = Counter(
            "hintflow_context_moves_total",
            "Contexts the runtime moved (or tried to) between nodes, by kind (routed, queued) and outcome "
            "(done, failed, skipped)",
            ["kind", "outcome"],
            registry=registry,
        )
        self._m_bytes = Counter("hintflow_context_moved_bytes_total", "KV bytes moved", registry=registry)
        self._m_seconds = Counter(
            "hintflow_context_move_seconds_total", "Time the moves done took, summed", registry=registry
        )

    @property
    def stats(self) -> MoveStats:
        return self.planner.stats

    def s_per_token(self, src: str) -> float:
        """Seconds per token of the recent moves; before the first, ``src``'s host reload rate."""
        measured = self.planner.measured_s_per_token()
        return measured if measured is not None else self.router.host_reload_s(src)

    # ---- routed moves ---------------------------------------------------------------------------------
    async def take_along(
        self, src: str, dst: str, session_id: str, need_tokens: int, recompute_s: Callable[[int], float]
    ) -> bool:
        """Move the session's context from its home ``src`` to ``dst``, where its turn (``need_tokens`` to
        finish: prompt and output) was routed, if both are embedded nodes and ``take_context_along`` says
        so; whether it moved (if not, the turn runs cold on ``dst``)."""
        num_tokens = self.router.session_tokens(src, session_id)
        if self._move_client(src) is None or self._move_client(dst) is None or not num_tokens:
            return False
        room = self._room(dst) or NodeRoom(dst, 0, _UNBOUNDED_SLOTS, _UNBOUNDED_SLOTS, 1)  # no state: tried
        measured = self.planner.measured_s_per_token()
        if not self.planner.take_along(num_tokens, need_tokens, room, measured, recompute_s(num_tokens)):
            self._m_moves.labels("routed", "skipped").inc()
            return False
        planned = self.planner.begin("routed", session_id, src, dst, self._need_blocks(dst, need_tokens))
        return await self._move(planned) is not None

    # ---- queued moves ---------------------------------------------------------------------------------
    async def run_turn(
        self,
        address: str,
        session_id: str,
        program_id: str,
        prompt: list[int],
        max_new_tokens: int,
        sent_to: Callable[[str], None],
    ) -> GenerateResult:
        """Run the turn on ``address``, moving it (with its context) to a node with room while it waits.
        ``sent_to(node)`` is called each time the turn is sent anew (after a move, or back after a failed
        one): errors raised from here are the call's on the node last named."""
        if not self._embedded(address) or len(self.clients) < 2:  # nowhere to move it
            return await self.clients[address].generate(prompt, max_new_tokens, session_id, program_id)
        t0 = time.monotonic()
        num_moves = 0
        while True:
            call = asyncio.ensure_future(self._generate(address, prompt, max_new_tokens, session_id, program_id))
            landed_s = time.monotonic()
            state = self.router.node_state(address)
            landed_version = state.version if state is not None else 0
            dst = None
            try:
                while dst is None:
                    done, _ = await asyncio.wait({call}, timeout=self.check_s)
                    if done:
                        res = call.result()
                        if num_moves:  # the turn's wait began at its first node
                            lost_s = landed_s - t0
                            res.ttft_s += lost_s
                            res.queue_wait_s += lost_s
                        return res
                    dst = self._queued_target(
                        address, session_id, prompt, max_new_tokens, landed_s, landed_version, num_moves
                    )
            except BaseException:  # the activity was cancelled, or the check failed: no call left behind
                call.cancel()
                raise
            call.cancel()  # the node aborts the waiting request; its context stays parked there
            await asyncio.wait({call})
            if not call.cancelled():  # it finished (or failed) before the cancel reached it
                return call.result()
            num_moves += 1
            self.router.finished(address, session_id)
            need = self._need_blocks(dst, len(prompt) + max_new_tokens)
            moved = await self._move(self.planner.begin("queued", session_id, address, dst, need))
            if moved is not None:
                address = dst
            # (else it goes back to its own node, where its context still is)
            sent_to(address)

    async def _generate(
        self, address: str, prompt: list[int], max_new_tokens: int, session_id: str, program_id: str
    ) -> GenerateResult:
        """The call on ``address``.  After a failed move, a node may not have ended the move's lease on the
        session yet (it lets go in the stream's ``finally``, an instant after the mover gave up) and refuses
        the turn, ``FAILED_PRECONDITION`` "being moved": retried for up to ``abort_wait_s``."""
        deadline_s = time.monotonic() + self.abort_wait_s
        while True:
            try:
                return await self.clients[address].generate(prompt, max_new_tokens, session_id, program_id)
            except grpc.aio.AioRpcError as exc:
                moving = exc.code() == grpc.StatusCode.FAILED_PRECONDITION and "being moved" in (exc.details() or "")
                if not moving or time.monotonic() >= deadline_s:
                    raise
            await asyncio.sleep(0.01)

    def _queued_target(
        self, address: str, session_id: str, prompt: list[int], max_new_tokens: int, landed_s: float,
        landed_version: int, num_moves: int,
    ) -> str | None:
        res = self.router.residency(address, session_id)
        state = self.router.node_state(address)
        if res is None or state is None or res.state != "waiting":
            return None
        turn = QueuedTurn(
            session_id=session_id,
            node=address,
            waited_s=time.monotonic() - landed_s,
            passed_over=state.version > landed_version,  # a state taken since it landed still shows it waiting
            context_tokens=res.device_tokens + res.host_tokens,
            need_tokens=len(prompt) + max_new_tokens,
            num_moves=num_moves,
        )
        rooms = [r for a in self.clients if a != address and self._embedded(a) and (r := self._room(a)) is not None]
        return self.planner.queued_target(turn, rooms, self.s_per_token(address))

    def _room(self, address: str) -> NodeRoom | None:
        """The node as its last cache state shows it (the planner takes off what moves were promised)."""
        st = self.router.node_state(address)
        if st is None:
            return None
        return NodeRoom(address, st.num_waiting, _UNBOUNDED_SLOTS, st.free_blocks, max(1, st.block_size))

    def _need_blocks(self, address: str, num_tokens: int) -> int:
        st = self.router.node_state(address)
        return -(-num_tokens // max(1, st.block_size if st is not None else 16))

    # ---- both -----------------------------------------------------------------------------------------
    def _embedded(self, *addresses: str) -> bool:
        return all(isinstance(self.clients.get(a), EngineClient) for a in addresses)

    def _move_client(self, address: str) -> EngineClient | None:
        """Who serves ``address``'s ExportContext / ImportContext: an embedded node's own client, a vLLM
        node's hint service; None where contexts cannot move."""
        client = self.clients.get(address)
        if isinstance(client, EngineClient):
            return client
        hints = self._vllm_hints.get(address)
        if hints is None or address in self._cannot_move:
            return None
        if address not in self._hint_clients:
            self._hint_clients[address] = node_client(hints)  # (the runtime's channel options)
        return self._hint_clients[address]

    def _note_refusal(self, exc: ContextMoveError, src: str, dst: str) -> None:
        """A vLLM node that cannot read or write its KV says so once; no move is tried there again."""
        node = src if exc.phase == "export" else dst
        if (
            exc.code == grpc.StatusCode.FAILED_PRECONDITION
            and node in self._vllm_hints
            and "other processes" in exc.message
            and node not in self._cannot_move
        ):
            self._cannot_move.add(node)
            logger.warning("vLLM node %s cannot move contexts (%s): its sessions are recomputed where they go",
                           node, exc.message)  # fmt: skip

    async def close(self) -> None:
        """Close the channels opened to vLLM nodes' hint services for moves."""
        clients, self._hint_clients = self._hint_clients, {}
        for c in clients.values():
            await c.close()

    async def _move(self, planned: PlannedMove) -> ContextMove | None:
        """Carry out ``planned`` (begun with the planner) and end it there, done or failed, on every path."""
        try:
            move = await self._stream(planned.kind, planned.src, planned.dst, planned.session_id)
        except BaseException:  # cancelled mid-move: the promise ends all the same
            self.planner.failed(planned)
            raise
        if move is None:
            self.planner.failed(planned)
            self._m_moves.labels(planned.kind, "failed").inc()
            return None
        self.planner.done(planned, move.num_tokens, move.num_bytes, move.elapsed_s)
        self._m_moves.labels(planned.kind, "done").inc()
        self._m_bytes.inc(move.num_bytes)
        self._m_seconds.inc(move.elapsed_s)
        return move

    async def _stream(self, kind: str, src: str, dst: str, session_id: str) -> ContextMove | None:
        """The context streamed from ``src`` to ``dst`` (``hints.move_context``), or None if it stayed."""
        src_client, dst_client = self._move_client(src), self._move_client(dst)
        if src_client is None or dst_client is None:
            return None
        deadline_s = time.monotonic() + self.abort_wait_s
        while True:
            try:
                move = await move_context(src_client, dst_client, session_id, pin_ttl_s=self.pin_ttl_s)
                break
            except ContextMoveError as exc:
                if exc.move is not None:  # committed at the destination; only the source's drop failed
                    move = exc.move
                    logger.info("session %s: moved %s -> %s, the source kept a copy (%s)", session_id, src,
                                dst, exc)
                    break
                if (
                    kind == "queued"
                    and exc.phase == "export"
                    and exc.code == grpc.StatusCode.FAILED_PRECONDITION
                    and time.monotonic() < deadline_s
                ):  # the cancelled request is not aborted on the node yet: its session is still waiting
                    await asyncio.sleep(0.01)
                    continue
                self._note_refusal(exc, src, dst)
                logger.info("session %s: context not moved %s -> %s (%s)", session_id, src, dst, exc)
                return None
        return move
