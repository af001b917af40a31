"""Programs followed live on graphs learned per workflow type: when is a session *between* turns used next?

A session in a tool pause is predicted by the pause model (E[T - t | T > t]).  A session parked between
turns with no pause of its own (a planner whose plan is out, a worker waiting on the other workers, a
reviewer waiting for its join) is predicted from the program graph of its workflow type, learned from
earlier runs of that type: the most probable path from the program's current step to a step that uses
the session, in seconds (:meth:`ProgramState.predict_next_use`).  A session whose steps cannot be reached
again in a graph learned from enough finished programs is dead for this run: its context is the first to
go (``MAX_HORIZON_S``), which is the signal an engine's recency order can never have.

Step kinds: ``llm:ROLE`` for a turn (``ROLE`` is the session's name inside its program, ``agent`` for a
program's single session) and ``tool:NAME`` for a pause.
"""

from __future__ import annotations

from dataclasses import dataclass

from hints import MAX_HORIZON_S
from orchestrator._graph import ProgramGraph, ProgramState
from predictors import PauseModel

__all__ = ["ProgramTracker", "role_of"]


def role_of(program_id: str, session_id: str) -> str:
    """``PROGRAM/planner`` -> ``planner``; the program's own session -> ``agent``."""
    prefix = program_id + "/"
    return session_id[len(prefix) :] if session_id.startswith(prefix) else "agent"


class _LearnedGraph(ProgramGraph):
    """A ProgramGraph that keeps ``most_likely_paths`` answers until the graph learns a transition.

    A Tick asks for the paths from the current step of every program with a session parked between turns,
    twice (``predict`` and ``ProgramState.predict_next_use``), and programs of one workflow share a few
    step kinds: recomputing Dijkstra each time was most of a multi-agent replay.  The paths depend only
    on the graph's nodes, edges and counts, which change only through ``observe_transition`` (the tracker
    owns its graphs), so the cache is dropped there.  Callers only read the answers.
    """

    def __init__(self, workflow_type: str) -> None:
        super().__init__(workflow_type)
        self._paths: dict[str, dict[str, list[str]]] = {}

    def observe_transition(self, src: str, dst: str, duration_s: float) -> None:
        self._paths.clear()
        super().observe_transition(src, dst, duration_s)

    def most_likely_paths(self, src: str) -> dict[str, list[str]]:
        paths = self._paths.get(src)
        if paths is None:
            paths = self._paths[src] = super().most_likely_paths(src)
        return paths


@dataclass
class _Live:
    workflow: str
    state: ProgramState


class ProgramTracker:
    """Graphs per workflow type (learned from every run) and the live state of each running program."""

    def __init__(self, pause_model: PauseModel, *, min_finished_for_dead: int = 3) -> None:
        self.pause_model = pause_model
        self.min_finished_for_dead = min_finished_for_dead
        self.graphs: dict[str, ProgramGraph] = {}
        self.num_finished: dict[str, int] = {}
        self._live: dict[str, _Live] = {}

    def _state(self, program_id: str, workflow: str) -> ProgramState:
        live = self._live.get(program_id)
        if live is None:
            wf = workflow or "unknown"
            graph = self.graphs.get(wf)
            if graph is None:
                graph = self.graphs[wf] = _LearnedGraph(wf)
            live = self._live[program_id] = _Live(wf, ProgramState(program_id, graph))
        return live.state

    def turn_started(self, program_id: str, session_id: str, now_s: float, workflow: str = "") -> None:
        role = role_of(program_id, session_id)
        self._state(program_id, workflow).start_step(f"llm:{role}", now_s, session_id=session_id)

    def turn_ended(self, program_id: str, session_id: str, now_s: float) -> None:
        live = self._live.get(program_id)
        if live is not None:
            live.state.end_turn(session_id, now_s)

    def tool_started(self, program_id: str, tool: str, now_s: float, workflow: str = "") -> None:
        self._state(program_id, workflow).start_step(f"tool:{tool}", now_s)

    def program_ended(self, program_id: str) -> None:
        live = self._live.pop(program_id, None)
        if live is not None:
            self.num_finished[live.workflow] = self.num_finished.get(live.workflow, 0) + 1

    def likely_next_tool(self, program_id: str, session_id: str) -> str | None:
        """The tool most likely to follow this session's turn, from the learned graph; None if unknown."""
        live = self._live.get(program_id)
        if live is None:
            return None
        nxt = live.state.graph.most_likely_next(f"llm:{role_of(program_id, session_id)}")
        return nxt[len("tool:") :] if nxt is not None and nxt.startswith("tool:") else None

    def predict(self, program_id: str, session_ids: list[str], now_s: float) -> dict[str, float]:
        """Seconds until each of ``session_ids`` (parked, of this program) is next used; dead ones get
        ``MAX_HORIZON_S``; sessions the graph cannot place are left out (the engine's recency decides)."""
        live = self._live.get(program_id)
        if live is None or not session_ids:
            return {}
        state = live.state
        preds = state.predict_next_use(self.pause_model, now_s)
        trusted = self.num_finished.get(live.workflow, 0) >= self.min_finished_for_dead
        reachable = (
            set(state.graph.most_likely_paths(state.current_step))
            if state.current_step is not None
            else set()
        )
        out: dict[str, float] = {}
        for sid in session_ids:
            steps = state.session_steps.get(sid, set())
            if trusted and state.current_step is not None and steps and not (steps & reachable):
                out[sid] = MAX_HORIZON_S
            elif (
                sid in preds
                and state.last_turn_end_s.get(sid) is not None
                and any(s in reachable for s in steps)
            ):
                out[sid] = preds[sid]
        return out
