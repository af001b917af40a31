"""Moving a queued turn's context to a node with room: hintflow's rebalancing between nodes.

Why: with a host tier every keep-context design keeps every context, and what is left between them and the
oracle is queueing for device memory (``scripts/queue_anatomy.py``).  A turn queues on its session's node
while the running turns there hold the memory it needs, and sometimes the other node has the room right
then.  Re-prefilling the context there (a router move without this) costs compute every turn queued on that
node pays for; copying it costs a transfer over the interconnect, about a reload's price.  So, after each
step and policy tick::

    node A: waiting [t1 t2 ...]      t1 never admitted, passed over by A's scheduler, waited >= its transfer
    node B: waiting []               room = device - what B's running turns need to finish - pins - inbound
                                     room >= what t1 needs to finish  ->  move t1 to B

    A: abort t1 (not the turn's end), ExportContext     B: ImportContext now (blocks taken, pinned while
                                                            the copy is on the wire)
    after transfer_s: A lets go of its copy; t1 is submitted on B

A session the router sends to another node at turn start takes its context along the same way, when
``orchestrator.take_context_along`` says so (the destination has room for the turn now, and the copy beats
recomputing), the rule the live runtime follows too.  The
receiver takes its blocks before the copy starts, as an RDMA transfer's receiver does, so a move that finds
no room fails at once and the turn stays (or is resubmitted) where its context is; the source keeps its copy
until the transfer is over.  The turn keeps its ``ready_s``, so its TTFT and queue wait include the time it
queued on A and the transfer.  It counts as a migration, not a session move (those re-prefill).  Each step
is the live engine's own API (``abort``, ``export_context``, ``import_context``, ``Pin``, ``Priority``), the
path the live runtime takes (``workflows/_context_moves.py``), and whether a turn moves, where, and what each
destination was promised meanwhile is the core's ``orchestrator.MovePlanner`` there and here.

Rent-or-buy: a turn moves only after waiting on its node as long as its transfer takes, so a turn that its
own node admits within that time never pays for one, and only once that node's scheduler has passed it
over (both counted from when the turn reached the node, so a moved turn is not moved on before its new node
has looked at it: no ping-pong); and at most twice.  The link's rate is
``per_token_s`` (``hintflow replay --link-gb-per-s``; by default the cost model's host copy rate: a
GPU-direct RDMA NIC of 200-400 Gb/s moves KV about as fast as the PCIe path).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from engine_adapter import EngineError, Request, SessionState
from hints import Pin, Priority
from orchestrator import MAX_MOVES_PER_TURN, MovePlanner, NodeRoom, PlannedMove, QueuedTurn
from replay._nodes import SimNode
from replay._runs import SessionRun

if TYPE_CHECKING:
    from replay._sim import Simulation

__all__ = ["Migrator"]


class Migrator:
    """Finds queued turns that another node can run now and moves their contexts there."""

    lookahead = 4  # waiting turns looked at per node and check (the queue's head is what waits longest)
    max_moves_per_turn = MAX_MOVES_PER_TURN  # a turn that could not start after two moves waits where it is

    def __init__(self, sim: Simulation, per_token_s: float) -> None:
        if not (math.isfinite(per_token_s) and per_token_s >= 0.0):
            raise ValueError(f"migration per_token_s must be finite and >= 0, got {per_token_s}")
        self.sim, self.per_token_s = sim, per_token_s
        # The promises to moves in flight and the moves' counts (migrations: copies that arrived, their turn
        # submitted on the new node; failed: imports the receiver had no room for, the turn stayed with its
        # context), kept by the core's planner as the live runtime's are.
        self.planner = MovePlanner()

    def check(self) -> None:
        """Move what can move now (cheap when no node has a queue or every node has one).  Whether and where
        a turn moves is ``orchestrator.move_target``'s answer, the rule the live runtime follows too."""
        nodes = self.sim.nodes
        open_nodes = [n for n in nodes if not n.engine.scheduler.waiting]
        if not open_nodes or len(open_nodes) == len(nodes):
            return
        now = self.sim.now
        for src in nodes:
            waiting = src.engine.scheduler.waiting
            for req in list(waiting[: self.lookahead]):
                if req.admitted or req.output:  # admitted once (preempted since): its work is here
                    continue
                s = self.sim.live[req.session.session_id]
                turn = QueuedTurn(
                    session_id=s.key,
                    node=src.address,
                    # Counted from when it reached this node (a moved turn keeps its older arrival time).
                    waited_s=now - s.landed_s,
                    passed_over=src.last_schedule_s > s.landed_s,
                    context_tokens=req.session.num_device_tokens + req.session.num_host_tokens,
                    need_tokens=len(req.prompt) + req.max_new_tokens,
                    num_moves=s.num_moves,
                )
                target = self.planner.queued_target(turn, [self._node_room(n) for n in open_nodes], self.per_token_s)
                if target is not None:
                    self.move(src, self.sim.by_address[target], s, queued=req)

    def _node_room(self, node: SimNode) -> NodeRoom:
        """The node as it is now (the planner takes off what moves on their way there were promised)."""
        sched = node.engine.scheduler
        slots = sched.config.max_num_seqs - len(sched.running)
        return NodeRoom(node.address, len(sched.waiting), slots, self._room(node), node.block_size)

    def _blocks(self, node: SimNode, num_tokens: int) -> int:
        return -(-num_tokens // node.block_size)

    def _room(self, node: SimNode) -> int:
        """Blocks a moved turn can count on: the device less what the running turns need to finish (their
        whole prompt and output) and the pinned blocks."""
        kv = node.engine.kv
        held = sum(self._blocks(node, len(r.prompt) + r.max_new_tokens) for r in node.engine.scheduler.running)
        return kv.device.num_blocks - held - kv.num_pinned_blocks

    def take_along(self, src: SimNode, dst: SimNode, s: SessionRun) -> bool:
        """Whether the session, routed from ``src`` to ``dst`` at its turn's start, takes its parked context
        along (``orchestrator.take_context_along``; recomputing priced by the replay's learned prefill)."""
        held = src.engine.kv.sessions.get(s.key)
        if held is None or held.state is not SessionState.PARKED:
            return False
        num_tokens = held.num_device_tokens + held.num_host_tokens
        need_tokens = len(s.prompt) + s.session.turns[s.turn_index].output_tokens
        return self.planner.take_along(num_tokens, need_tokens, self._node_room(dst), self.per_token_s,
                                       self.sim.prefill.reload_s(num_tokens))

    def turn_blocks(self, node: SimNode, s: SessionRun) -> int:
        """Blocks the session's turn in flight needs to finish (its whole prompt and output)."""
        return self._blocks(node, len(s.prompt) + s.session.turns[s.turn_index].output_tokens)

    def move(self, src: SimNode, dst: SimNode, s: SessionRun, queued: Request | None = None) -> None:
        """Copy the session's context from ``src`` to ``dst`` and submit its turn there once it has arrived: a
        turn ``queued`` on ``src`` (aborted there first; it keeps its place in line: its arrival time and
        TTFT-deadline status go with it), or one about to start that the router sent to ``dst``.  The receiver
        takes its blocks first, as an RDMA transfer's receiver does, so a move that finds no room fails at
        once and the turn stays where its context is."""
        sim = self.sim
        arrival_s, overdue = sim.now, False
        if queued is not None:
            arrival_s, overdue = queued.arrival_s, queued.overdue
            src.engine.abort(queued.request_id)
            src.finished.remove(queued)  # an abort reports a finish; this one is not the turn's end
        s.num_moves += 1
        move = self.planner.begin("queued" if queued is not None else "routed", s.key, src.address, dst.address,
                                  self.turn_blocks(dst, s))
        blob = src.engine.export_context(s.key)
        try:
            dst.engine.import_context(blob)
        except EngineError:  # no room there after all: the turn goes on waiting where its context is
            self.planner.failed(move)
            self._submit(src, src, s, arrival_s, overdue)
            return
        transfer_s = len(blob.token_ids) * self.per_token_s
        # The blocks are written while the copy is on the wire: keep them from being evicted meanwhile (the
        # lease holds on past its end once the turn is queued, until admission consumes it).
        dst.engine.apply_hints([Pin(session_id=s.key, ttl_s=transfer_s, reason="migration in flight")])
        sim.at(sim.now + transfer_s, lambda: self._arrive(move, src, dst, s, len(blob.token_ids), arrival_s, overdue))
        sim.kick(src)

    def _arrive(self, move: PlannedMove, src: SimNode, dst: SimNode, s: SessionRun, num_tokens: int,
                arrival_s: float, overdue: bool) -> None:
        """The copy is complete: the turn is submitted on ``dst`` and the source lets go of its context."""
        self.planner.done(move, num_tokens, 0, num_tokens * self.per_token_s)  # (bytes: the report prices them)
        s.migrated_tokens = num_tokens
        self._submit(src, dst, s, arrival_s, overdue)
        src.engine.kv.free_session(src.engine.kv.sessions[s.key])

    def _submit(self, src: SimNode, target: SimNode, s: SessionRun, arrival_s: float, overdue: bool) -> None:
        """Submit the turn on ``target`` with the program's priority as the source holds it now (the age
        counted from the program's start, not from when the copy began) and its place in line."""
        held = src.engine.kv.sessions[s.key]
        age_s = max(0.0, self.sim.now - held.program_start_s) if held.program_start_s is not None else 0.0
        priority = Priority(session_id=s.key, program_id=held.program_id, program_age_s=age_s,
                            priority_class=held.priority_class)
        self.sim.router.started(target.address, self.sim.route_request(s, s.prompt))  # its home from now on
        self.sim.submit_turn(s, target)
        req = s.request
        assert req is not None
        if (req.arrival_s, req.overdue) != (arrival_s, overdue):
            req.arrival_s, req.overdue = arrival_s, overdue
            target.engine.scheduler.mark_priorities_changed()  # re-sorted by its key at the next step
        target.engine.apply_hints([priority])

