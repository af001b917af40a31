"""Discrete-event replay: programs from a trace against real engine schedulers on virtual time.

One event heap drives everything: program arrivals, node step starts and ends (``_nodes.py``), tool pauses,
policy ``Tick``s (every ``tick_s`` while a tool runs), and ThunderAgent's controller.  The policy is fed
through the same control core as the live runtime's (``orchestrator.ControlCore``: pauses, ticks, pricing
from the nodes, addressing), so live and replay agree:

* a turn: route (``Router``), submit the whole context, then ``TurnStarted`` (so its ``Priority`` finds the
  session on its node);  when it finishes: ``TurnEnded``, then ``ToolStarted`` if the turn calls a tool;
* ``ToolEnded`` is reported when the next turn (or the program's end) starts: the pause a pin must cover is
  the whole time the context sits idle;
* Continuum's T comes from the queue wait of turns that recomputed tokens; ``PrefillReload`` is learned
  from the nodes' answers (``orchestrator._prefill.PrefillEstimator``, as live), with the cost model as its prior;
* hints go to the node holding the session (all nodes when unknown); ``Release`` goes to every node;
* with ``ReplayConfig.migrate`` (hintflow), a turn queued for memory moves to a node with room, and a
  session the router moves takes its context along (``_migration.py``); the checks run at step ends that
  freed room or on a node with a queue, and at ticks;
* memory is sampled every ``sample_interval_s`` of virtual time, and a modeled node runs a stretch of plain
  decode steps as one event (``_fast_forward.py``; the same results).

Determinism: the heap breaks time ties by insertion order and nothing reads the wall clock, so a trace,
a configuration and a seed give the same result every time on the modeled executor.  On torch nodes a
step lasts its measured wall time (``_nodes.py``), so times, and what depends on them, vary run to run.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from engine_adapter import Request, Session, VirtualClock
from hints import MAX_HORIZON_S, EvictionOrder, HintModel, NextUse, Pin, Prefetch
from orchestrator import (
    ControlCore,
    HintPolicy,
    PolicySpec,
    PrefillEstimator,
    Router,
    RouteRequest,
    ToolStarted,
)
from replay._migration import Migrator
from replay._nodes import NodeSpec, NodeTotals, SimNode, build_nodes
from replay._policies import ReplayConfig
from replay._prompts import PromptBuilder
from replay._runs import ProgramRun, SessionRun, TurnRecord

__all__ = ["SimResult", "Simulation"]


@dataclass
class SimResult:
    """Everything a report needs from one replay of one configuration."""

    config: ReplayConfig
    turns: list[TurnRecord]
    programs: list[ProgramRun]
    memory: list[tuple[float, str, int, int, int]]  # (t, node, device used, pinned, host used) tokens
    nodes: list[SimNode]  # the live nodes, for in-process callers; empty once shipped from a worker process
    wall_s: float
    makespan_s: float
    num_events: int
    extra: dict[str, Any] = field(default_factory=dict)
    node_totals: list[NodeTotals] = field(default_factory=list)  # what the report reads of each node


class Simulation:
    """One configuration over one list of programs; ``run()`` once."""

    def __init__(
        self,
        programs: Sequence[ProgramRun | Any],
        config: ReplayConfig,
        spec: NodeSpec,
        *,
        num_nodes: int = 2,
        seed: int = 0,
        tick_s: float = 0.05,
        watch_interval_s: float = 0.5,
        sample_interval_s: float = 1.0,
        progress: Callable[[int], None] | None = None,
    ) -> None:
        self.config, self.spec, self.tick_s = config, spec, tick_s
        self.clock = VirtualClock()
        self.nodes = build_nodes(num_nodes, spec, config, self.clock)
        self.by_address = {n.address: n for n in self.nodes}
        cm = spec.cost_model
        self.core = ControlCore(
            PolicySpec(config.hint_policy, config.policy_options), nodes=[n.address for n in self.nodes],
            node_of=self._node_of, prefill_prior=cm.prefill_reload_s,
            rewrite=self._true_next_use if config.true_next_use else None,
        )  # fmt: skip
        host_tier = config.host_tier and spec.num_host_tokens > 0  # (a tier of no bytes reloads nothing)
        for n in self.nodes:  # what each node's cache state would say, its host hits read at each decision
            self.core.node_seen(
                n.address, host_tier=host_tier, pool_tokens=float(spec.num_device_tokens),
                host_hit_fraction=n.engine.kv.host_hits.fraction, reload_s_per_token=cm.copy_per_block_s / cm.block_size,
                prefill_backlog_tokens=n.engine.scheduler.prefill_backlog_tokens,
                prefill_share=n.engine.prefill_share.fraction, unpinned_survival=n.engine.kv.unpinned_survival.fraction,
            )  # fmt: skip
        self.policy: HintPolicy = self.core.policy
        self.prefill: PrefillEstimator = self.core.prefill
        self.router = Router(
            cm.prefill_time,
            policy=config.routing,
            host_reload_s_per_token=cm.copy_per_block_s / cm.block_size,
        )
        self.watch_interval_s, self.sample_interval_s = watch_interval_s, sample_interval_s
        self.prompts = PromptBuilder(spec.vocab_size, seed)
        self.runs = [p if isinstance(p, ProgramRun) else ProgramRun.of(p) for p in programs]
        self.turns: list[TurnRecord] = []
        self.live: dict[str, SessionRun] = {}  # session key -> state, while its program runs
        self.memory: list[tuple[float, str, int, int, int]] = []
        self.progress = progress
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self._tick_pending = False
        self._routed_s = -1.0
        self._num_done = 0
        self._returns: dict[str, float] = {}  # session in a tool -> when the trace says it returns (bound)
        self._copy_s_per_token = cm.copy_per_block_s / cm.block_size
        self.controller: Any = None
        self.migrator: Migrator | None = None
        if config.migrate and num_nodes > 1:  # by default a link as fast as the host copy path (_migration.py)
            link = spec.link_s_per_token
            self.migrator = Migrator(self, cm.copy_per_block_s / cm.block_size if link is None else link)
        if config.thunderagent_controller:
            from replay._thunder import ThunderController

            self.controller = ThunderController(self)

    # ---- event queue ---------------------------------------------------------------------------------
    def at(self, t_s: float, action: Callable[[], None]) -> None:
        heapq.heappush(self._heap, (t_s, next(self._seq), action))

    @property
    def now(self) -> float:
        return self.clock.now()

    def run(self) -> SimResult:
        wall0 = time.perf_counter()
        for run in self.runs:
            self.at(run.program.arrival_s, functools.partial(self._arrive, run))
        if self.controller is not None:
            self.at(self.controller.period_s, self.controller.control)
        self.at(0.0, self._sample_tick)
        num_events = 0
        while self._heap and self._num_done < len(self.runs):
            t, _, action = heapq.heappop(self._heap)
            self.clock.advance_to(t)
            action()
            num_events += 1
        if self._num_done < len(self.runs):
            stuck = [r.program.program_id for r in self.runs if r.end_s is None][:5]
            raise RuntimeError(
                f"{self.config.name}: replay stalled at {self.now:.3f} s with programs "
                f"unfinished, e.g. {stuck}"
            )
        for node in self.nodes:
            node.account(self.now)
        self._sample()
        return SimResult(
            self.config,
            self.turns,
            self.runs,
            self.memory,
            self.nodes,
            time.perf_counter() - wall0,
            self.now,
            num_events,
            extra=self._extra(),
            node_totals=[n.totals() for n in self.nodes],
        )

    def _extra(self) -> dict[str, Any]:
        extra: dict[str, Any] = {}
        if self.core.num_policy_errors:  # (logged as they happened; a replay goes on, as a live worker does)
            extra["policy_errors"] = self.core.num_policy_errors
        if self.controller is not None:
            extra |= {"thunderagent_pauses": self.controller.num_pauses,
                      "thunderagent_restores": self.controller.num_restores}
        if self.migrator is not None:
            st = self.migrator.planner.stats
            bytes_per_token = self.spec.cost_model.kv_bytes_per_token  # None: the profile does not say
            extra |= {"migrations": st.num_moves,
                      "migrated_tokens": st.num_tokens,
                      "migrated_bytes": None if bytes_per_token is None else st.num_tokens * bytes_per_token,
                      "migration_transfer_s": st.move_s,
                      "failed_migrations": st.num_failed}
        return extra

    def _sample_tick(self) -> None:
        """Memory on a fixed grid of virtual time (not at whichever events happen: the same samples however
        many events a run has); it stops when nothing else is left, so a stalled replay still ends."""
        self._sample()
        if self._heap:
            self.at(self.now + self.sample_interval_s, self._sample_tick)

    def _sample(self) -> None:
        for n in self.nodes:
            kv, bs = n.engine.kv, n.block_size
            self.memory.append(
                (
                    self.now,
                    n.address,
                    (kv.device.num_blocks - kv.device.num_free_blocks) * bs,
                    kv.num_pinned_blocks * bs,
                    (kv.host.num_blocks - kv.host.num_free_blocks) * bs,
                )
            )

    # ---- policy and hints ----------------------------------------------------------------------------
    def _true_next_use(self, event: Any, hints: Sequence[HintModel]) -> list[HintModel]:
        """The ``bound`` row: a session in a tool pause is ranked by when the trace says it returns (Belady
        over sessions), in place of the policy's prediction; its pins know the return (``_true_pin``), and
        with a host tier its context is fetched back to arrive as the tool returns; the rest of the
        policy's hints stand."""
        in_tool = set(self.core.pauses)
        out: list[HintModel] = []
        for h in hints:
            if isinstance(h, Prefetch) and h.session_id in self._returns:
                continue  # the bound's own, below
            if isinstance(h, EvictionOrder):
                entries = [e for e in h.entries if e.session_id not in in_tool]
                if entries:
                    out.append(EvictionOrder(entries=entries))
            else:
                out.append(h)
        if isinstance(event, ToolStarted) and event.session_id in in_tool:
            s = self.live[event.session_id]
            pause_s = min(s.session.turns[s.turn_index].tool_duration_s, MAX_HORIZON_S)
            out.append(EvictionOrder(entries=[NextUse(session_id=s.key, next_use_s=pause_s)]))
            if self.spec.num_host_tokens > 0:  # back from host just as the tool returns, not on the critical path
                lead_s = event.context_tokens * self._copy_s_per_token + self.tick_s
                out.append(Prefetch(session_id=s.key, at_s=max(pause_s - lead_s, 0.0)))
        return [self._true_pin(h) if isinstance(h, Pin) else h for h in out]

    def _true_pin(self, pin: Pin) -> Pin:
        """A pin that knows the pause: held exactly until the session returns when the policy would have
        held it at least that long, none when the policy's pin would lapse before the return (it would
        only hold memory the session does not use in time) or when the session is never used again."""
        back_s = self._returns.get(pin.session_id)
        if back_s is None:
            s = self.live.get(pin.session_id)
            done = s is None or (s.turn_index >= s.session.num_turns - 1 and s.session.turns[s.turn_index].tool is None)
            return pin.model_copy(update={"ttl_s": 0.0}) if done and pin.ttl_s > 0.0 else pin
        remaining_s = max(back_s - self.now, 0.0)
        if pin.ttl_s <= 0.0 or pin.ttl_s < remaining_s:
            return pin.model_copy(update={"ttl_s": 0.0})
        return pin.model_copy(update={"ttl_s": remaining_s + self.tick_s})

    def _node_of(self, session_id: str) -> str | None:
        s = self.live.get(session_id)
        return s.node if s is not None and s.node else None

    def publish(self, hints: Sequence[HintModel]) -> None:
        """Send each hint to the node(s) it concerns, by the live runtime's rule (``ControlCore.address``)."""
        if not hints:
            return
        for a, batch in self.core.address(hints).items():
            node = self.by_address[a]
            node.engine.apply_hints(batch)
            node.account(self.now)
            node.kick(self.now, self.at, self._step_end)

    def _schedule_tick(self) -> None:
        if not self._tick_pending and self.core.num_paused and self.config.hint_policy != "vllm-default":
            self._tick_pending = True
            self.at(self.now + self.tick_s, self._tick)

    def _tick(self) -> None:
        self._tick_pending = False
        self.publish(self.core.tick(self.now))
        for n in self.nodes:
            n.engine.kv.tick()
            n.account(self.now)
            n.kick(self.now, self.at, self._step_end)
        if self.migrator is not None:
            self.migrator.check()
        self._schedule_tick()

    # ---- programs ------------------------------------------------------------------------------------
    def _arrive(self, run: ProgramRun) -> None:
        run.start(self.now)
        self.live.update((s.key, s) for s in run.sessions.values())
        self.core.program_started(run.program.program_id, self.now)
        for sid in run.program.roots:
            self.start_turn(run.sessions[sid])

    def start_turn(self, s: SessionRun, node: SimNode | None = None) -> None:
        """The session's next turn is ready now: close its pause, then queue (ThunderAgent) or submit."""
        if node is None:  # a restore from ThunderAgent's queue keeps the time the turn became ready
            self.publish(self.core.close_pause(s.key, self.now))
            s.ready_s = self.now
            if self.controller is not None and self.controller.hold(s):
                return
        turn = s.session.turns[s.turn_index]
        prompt = s.next_prompt(self.prompts.new_input(turn, f"{s.key}/{s.turn_index}"))
        moved_from = None
        if node is None:
            address, moved_from = self._route(s, prompt)
        else:  # a restore: ThunderAgent chose the node, and the router follows the session there
            address = node.address
            if len(self.nodes) > 1:  # (one node: nothing routed, as in _route)
                self.router.started(address, self.route_request(s, prompt))
        s.prompt, s.migrated_tokens, s.num_moves = prompt, 0, 0
        src = self.by_address[moved_from] if moved_from is not None else None
        dst = self.by_address[address]
        mig = self.migrator
        if src is not None and mig is not None and mig.take_along(src, dst, s):
            mig.move(src, dst, s)  # takes the context along
        else:
            if src is not None:  # the context stays behind: unpin it there (it is recomputed here)
                src.engine.apply_hints([Pin(session_id=s.key, ttl_s=0.0)])
            self.submit_turn(s, self.by_address[address])
        self.publish(self.core.turn_started(s.run.program.program_id, s.key, self.now, len(prompt)))

    def submit_turn(self, s: SessionRun, target: SimNode) -> None:
        """Submit the session's turn in flight (``s.prompt``) to ``target`` and start it stepping."""
        turn = s.session.turns[s.turn_index]
        s.node, s.landed_s = target.address, self.now
        s.request = target.engine.submit(
            s.prompt, max(1, turn.output_tokens), session_id=s.key, program_id=s.run.program.program_id,
            priority=self._remaining_work_ms(s.run) if self.config.clairvoyant else None,
        )
        self.kick(target)

    def kick(self, node: SimNode) -> None:
        """Start a step on ``node`` now if it is idle and has work."""
        node.kick(self.now, self.at, self._step_end)

    def _remaining_work_ms(self, run: ProgramRun) -> int:
        """The program's true remaining work from the trace, for the ``clairvoyant`` row: what is left of its
        sessions' turns (this one included) priced at batch one (new-input prefill and decode) plus their
        tool pauses, in milliseconds (an engine priority is an integer, lower first)."""
        cm = self.spec.cost_model
        total_s = 0.0
        for sr in run.sessions.values():
            for t in sr.session.turns[sr.turn_index:]:
                total_s += (cm.prefill_time(t.input_tokens) + t.output_tokens * cm.decode_time(1, 0)
                            + t.tool_duration_s)
        return round(1000 * total_s)

    def _route(self, s: SessionRun, prompt: list[int]) -> tuple[str, str | None]:
        """(node for the turn, the node the session leaves or None)."""
        if len(self.nodes) == 1:
            return self.nodes[0].address, None
        if self.now - self._routed_s >= self.watch_interval_s:  # the live watch stream's period
            for n in self.nodes:
                self.router.update(n.address, n.engine.cache_state(include_sessions=True), self.now)
            self._routed_s = self.now
        cached = None
        if self.config.routing == "llm-d":  # its precise prefix scorer indexes every node's KV events
            cached = {n.address: self._cached_prefix_tokens(n, s.key, prompt) for n in self.nodes}
        req = self.route_request(s, prompt, cached)
        decision = self.router.choose(req, self.now)
        self.router.started(decision.address, req)
        return decision.address, decision.moved_from

    @staticmethod
    def route_request(s: SessionRun, prompt: list[int], cached: dict[str, int] | None = None) -> RouteRequest:
        """The router's view of the session's turn in flight with ``prompt``."""
        turn = s.session.turns[s.turn_index]
        return RouteRequest(s.key, s.run.program.program_id, len(prompt), turn.shared_prefix,
                            turn.shared_prefix_tokens, cached_tokens=cached)

    @staticmethod
    def _cached_prefix_tokens(node: SimNode, session_id: str, prompt: list[int]) -> int:
        """Leading tokens of ``prompt`` that ``node``'s device prefix cache holds now (changes nothing)."""
        kv = node.engine.kv
        s = kv.sessions.get(session_id)
        if s is None:  # never there: only blocks other sessions computed can hit
            s = Session(session_id, session_id, created_s=0.0)
            s._bs = kv.block_size
        return kv.plan_prefix(s, prompt).num_cached_tokens

    def _step_end(self, node: SimNode) -> None:
        done, node.finished = node.finished, []
        for req in done:
            self._turn_finished(node, req)
        node.kick(self.now, self.at, self._step_end)
        # A turn can move when room frees (a turn ended) or when a node with a queue passed it over; a node
        # that only decodes changes neither (and its steps need not be looked at one by one).
        if self.migrator is not None and (done or node.engine.scheduler.waiting):
            self.migrator.check()

    def _turn_finished(self, node: SimNode, req: Request) -> None:
        s = self.live[req.session.session_id]
        turn = s.session.turns[s.turn_index]
        rec = TurnRecord.of(s, req, self.config.name)
        self.turns.append(rec)
        if len(self.nodes) > 1:
            self.router.finished(node.address, s.key)
        self.core.turn_done(rec.computed_tokens, (req.ttft_s or 0.0) - req.queue_wait_s, rec.queue_wait_s,
                            rec.recomputed_tokens)
        s.finish_turn(req.output[: turn.output_tokens] if self.config.resend_outputs else [])
        pid = s.run.program.program_id
        if turn.tool is not None and self.config.true_next_use:  # when the trace says it returns
            self._returns[s.key] = self.now + turn.tool_duration_s
        self.publish(self.core.turn_ended(pid, s.key, self.now, len(s.context)))
        if turn.tool is not None:
            self.publish(self.core.tool_started(pid, s.key, turn.tool, self.now, len(s.context)))
            self._schedule_tick()
            self.at(self.now + turn.tool_duration_s, lambda: self._after_tool(s))
            if self.controller is not None:
                self.controller.tool_started(s)
        else:
            self._after_tool(s)

    def _after_tool(self, s: SessionRun) -> None:
        turn = s.session.turns[s.turn_index]
        self._returns.pop(s.key, None)
        if turn.tool is not None:
            self.publish(self.core.tool_returned(s.run.program.program_id, s.key, turn.tool, self.now,
                                                 turn.tool_duration_s))
        s.turn_index += 1
        if s.turn_index < s.session.num_turns:
            self.start_turn(s)
        else:
            self._session_finished(s)

    def _session_finished(self, s: SessionRun) -> None:
        run = s.run
        self.publish(self.core.session_finished(s.key, self.now))  # the framework knows (KVFlow is told)
        for succ in run.finish_session(s.session.session_id, self.now):
            self.start_turn(run.sessions[succ])
        if run.all_done:
            self.publish(self.core.program_ended(run.program.program_id, self.now, run.num_turns_done))
            run.close()
            for other in run.sessions.values():
                self.live.pop(other.key, None)
            self._num_done += 1
            if self.controller is not None:
                self.controller.program_ended(run)
            if self.progress is not None:
                self.progress(1)
