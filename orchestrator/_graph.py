"""Program graphs: which step comes next, how far away each agent's next turn is, and in how many seconds.

Two views of a program, for two published mechanisms:

* :class:`ProgramGraph` is learned from runs of one workflow type: nodes are step kinds ("llm:planner",
  "tool:bash", "human", "agent:reviewer"), an edge a -> b counts how often b followed a and keeps samples
  of how long a lasted when b followed (so "bash that ends in an error" and "bash that succeeds" can
  differ).  It is a first-order Markov chain (CacheScout) and may have cycles (llm -> tool -> llm).
* :func:`steps_to_execution` is KVFlow's rule on an agent step *DAG*: running agents 0, an AND-join
  max(preds) + 1, an OR-join min(preds) + 1; a shared prefix takes the minimum over its users.

:class:`ProgramState` follows one live program on its :class:`ProgramGraph` and turns both into the
seconds until each session is next used (the rule is in :meth:`ProgramState.predict_next_use`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence, Set
from itertools import pairwise
from typing import Literal

import networkx as nx

from predictors import EmpiricalDistribution, PauseModel

__all__ = [
    "JoinKind",
    "ProgramGraph",
    "ProgramState",
    "pause_tool",
    "shared_prefix_steps",
    "steps_to_execution",
]

JoinKind = Literal["and", "or"]


def pause_tool(step: str) -> str | None:
    """The pause-model key of a step that is a pause ("tool:bash" -> "bash", "human" -> "human"), else None."""
    if step.startswith("tool:"):
        return step[len("tool:") :]
    return "human" if step == "human" else None


class ProgramGraph:
    """First-order Markov graph of step kinds for one workflow type, learned from observed transitions."""

    def __init__(self, workflow_type: str, *, duration_capacity: int = 500) -> None:
        self.workflow_type = workflow_type
        self.graph: nx.DiGraph = nx.DiGraph()
        self._duration_capacity = duration_capacity

    def _ensure_node(self, step: str) -> None:
        if step not in self.graph:
            self.graph.add_node(step, durations=EmpiricalDistribution(capacity=self._duration_capacity))

    def observe_transition(self, src: str, dst: str, duration_s: float) -> None:
        """``dst`` started after ``src`` had run for ``duration_s``."""
        self._ensure_node(src)
        self._ensure_node(dst)
        if not self.graph.has_edge(src, dst):
            self.graph.add_edge(
                src, dst, count=0, durations=EmpiricalDistribution(capacity=self._duration_capacity)
            )
        edge = self.graph.edges[src, dst]
        edge["durations"].observe(duration_s)  # validates before anything is counted
        edge["count"] += 1
        self.graph.nodes[src]["durations"].observe(duration_s)
        # Every edge out of src changes probability; keep -log P on the edges so path searches read an
        # attribute instead of summing src's out-edges at every edge they relax (most of a multi-agent
        # replay's time when it was a weight function).
        total = sum(d["count"] for _, _, d in self.graph.out_edges(src, data=True))
        for _, _, d in self.graph.out_edges(src, data=True):
            d["neg_log_p"] = -math.log(d["count"] / total)

    def num_transitions(self, src: str, dst: str) -> int:
        return int(self.graph.edges[src, dst]["count"]) if self.graph.has_edge(src, dst) else 0

    def next_step_probabilities(self, step: str) -> dict[str, float]:
        """P(next = b | current = step) = count(step -> b) / count(step -> anything); {} if never left."""
        if step not in self.graph:
            return {}
        counts = {dst: data["count"] for _, dst, data in self.graph.out_edges(step, data=True)}
        total = sum(counts.values())
        return {dst: c / total for dst, c in counts.items()} if total else {}

    def most_likely_next(self, step: str) -> str | None:
        """The most frequent successor; ties go to the smaller name so replays are deterministic."""
        probs = self.next_step_probabilities(step)
        return min(probs, key=lambda d: (-probs[d], d)) if probs else None

    def mean_duration_s(self, src: str, dst: str) -> float:
        """Mean time ``src`` lasted when ``dst`` followed."""
        return self.graph.edges[src, dst]["durations"].mean

    def step_durations(self, step: str) -> EmpiricalDistribution | None:
        """How long ``step`` lasts, pooled over its successors; None if it was never seen to end."""
        if step not in self.graph:
            return None
        dist: EmpiricalDistribution = self.graph.nodes[step]["durations"]
        return dist if dist.num_samples else None

    def most_likely_paths(self, src: str) -> dict[str, list[str]]:
        """For every step reachable from ``src`` in >= 1 transition, the most probable path to it.

        Most probable = least sum of -log P over its edges (Dijkstra).  At least one hop, so a step's
        path to itself is the likeliest cycle back, which is what "when is this agent next used" needs.
        """
        best: dict[str, tuple[float, list[str]]] = {}
        for first, p in self.next_step_probabilities(src).items():
            costs, paths = nx.single_source_dijkstra(self.graph, first, weight="neg_log_p")
            for dst, cost in costs.items():
                total = cost - math.log(p)
                if dst not in best or total < best[dst][0]:
                    best[dst] = (total, [src, *paths[dst]])
        return {dst: path for dst, (_, path) in best.items()}


def steps_to_execution(
    graph: nx.DiGraph,
    running: Set[str],
    join: Mapping[str, JoinKind] | None = None,
    *,
    finished: Set[str] = frozenset(),
) -> dict[str, float]:
    """KVFlow's steps-to-execution of every agent in an agent step DAG.

    * a running agent: 0;
    * a finished agent (``finished``): inf, it will not run again in this DAG; as a predecessor it counts
      as 0, like a running one (its output is ready), so it never delays a join;
    * an agent with no predecessors that is neither running nor finished is a source waiting to start:
      1, the same as an agent right behind a running one (it can run at the next step);
    * otherwise 1 + max over predecessors for an AND-join (the default; it waits for all of them) or
      1 + min for an OR-join (``join[node] == "or"``; the first one to finish starts it).

    Raises ValueError naming a node on a cycle, or for names not in the graph or a bad join kind.
    """
    join = join or {}
    bad = {n: k for n, k in join.items() if k not in ("and", "or")}
    if bad:
        raise ValueError(f"join kinds must be 'and' or 'or', got {bad}")
    unknown = (set(running) | set(finished) | set(join)) - set(graph.nodes)
    if unknown:
        raise ValueError(f"not in the graph: {sorted(unknown)}")
    if set(running) & set(finished):
        raise ValueError(f"both running and finished: {sorted(set(running) & set(finished))}")
    try:
        order = list(nx.topological_sort(graph))
    except nx.NetworkXUnfeasible:
        cycle = nx.find_cycle(graph)
        path = " -> ".join(str(u) for u, *_ in cycle) + f" -> {cycle[0][0]}"
        raise ValueError(f"steps_to_execution needs a DAG; {cycle[0][0]!r} lies on a cycle: {path}") from None
    values: dict[str, float] = {}
    for node in order:
        if node in running:
            values[node] = 0.0
        elif node in finished:
            values[node] = math.inf
        else:
            preds = [0.0 if p in finished else values[p] for p in graph.predecessors(node)]
            if not preds:
                values[node] = 1.0
            else:
                values[node] = 1.0 + (max(preds) if join.get(node, "and") == "and" else min(preds))
    return values


def shared_prefix_steps(values: Mapping[str, float], users: Mapping[str, Sequence[str]]) -> dict[str, float]:
    """A prefix shared by several agents is needed as soon as the first of them is: the minimum (inf if unused)."""
    out: dict[str, float] = {}
    for prefix_id, agents in users.items():
        missing = [a for a in agents if a not in values]
        if missing:
            raise ValueError(f"prefix {prefix_id!r}: no steps-to-execution for {missing}")
        out[prefix_id] = min((values[a] for a in agents), default=math.inf)
    return out


class ProgramState:
    """Live state of one program instance on its graph: the current step and each session's last turn.

    Sessions are bound to the step kinds that use them when a step starts with a ``session_id``; moving
    to a new step (or :meth:`end_turn`) ends the running turn.  With ``learn`` (default) every step
    change is also recorded in the graph, so live programs keep teaching it.
    """

    def __init__(self, program_id: str, graph: ProgramGraph, *, learn: bool = True) -> None:
        self.program_id = program_id
        self.graph = graph
        self.learn = learn
        self.current_step: str | None = None
        self.step_started_s: float = 0.0
        self.running_session: str | None = None
        self.last_turn_end_s: dict[str, float] = {}
        self.session_steps: dict[str, set[str]] = {}

    def start_step(self, step: str, now_s: float, *, session_id: str | None = None) -> None:
        if self.current_step is not None and self.learn:
            self.graph.observe_transition(self.current_step, step, max(now_s - self.step_started_s, 0.0))
        if self.running_session is not None:
            self.end_turn(self.running_session, now_s)
        self.current_step, self.step_started_s = step, now_s
        if session_id is not None:
            self.session_steps.setdefault(session_id, set()).add(step)
            self.running_session = session_id

    def end_turn(self, session_id: str, now_s: float) -> None:
        self.last_turn_end_s[session_id] = now_s
        if self.running_session == session_id:
            self.running_session = None

    def current_remaining_s(self, pause_model: PauseModel, now_s: float) -> float:
        """Predicted seconds left in the current step: the pause model's E[T - t | T > t] for a tool or a
        person, the graph's own step durations otherwise (0 when the step has never been seen to end)."""
        if self.current_step is None:
            return 0.0
        elapsed_s = max(now_s - self.step_started_s, 0.0)
        tool = pause_tool(self.current_step)
        if tool is not None:
            return pause_model.expected_remaining(tool, elapsed_s)
        dist = self.graph.step_durations(self.current_step)
        return dist.conditional_remaining(elapsed_s) if dist is not None else 0.0

    def predict_next_use(self, pause_model: PauseModel, now_s: float) -> dict[str, float]:
        """Seconds from ``now_s`` until each known session is next used.

        * the session whose turn is running: 0;
        * otherwise, along the most probable path current -> ... -> a step bound to the session (at least
          one hop, see :meth:`ProgramGraph.most_likely_paths`): the current step's predicted remaining
          time (:meth:`current_remaining_s`) plus the mean duration of each intermediate step on that path
          (edge a -> b's samples: how long a lasted when b followed); the minimum over the session's steps.
          The hop count is the path's steps-to-execution, so the ordering agrees with KVFlow's while the
          value is in seconds and carries the heavy-tailed remaining pause;
        * no path (or no current step): ``now - last turn end``, the recency rule the engine applies to an
          unhinted context, so a session we cannot predict ranks as if we had sent nothing.
        """
        paths = self.graph.most_likely_paths(self.current_step) if self.current_step is not None else {}
        remaining_s = self.current_remaining_s(pause_model, now_s) if paths else 0.0
        out: dict[str, float] = {}
        for session_id, steps in self.session_steps.items():
            if session_id == self.running_session:
                out[session_id] = 0.0
                continue
            best = math.inf
            for step in steps:
                path = paths.get(step)
                if path is not None:
                    mid = sum(self.graph.mean_duration_s(a, b) for a, b in pairwise(path[1:]))
                    best = min(best, remaining_s + mid)
            if math.isfinite(best):
                out[session_id] = best
            elif session_id in self.last_turn_end_s:
                out[session_id] = max(now_s - self.last_turn_end_s[session_id], 0.0)
        return out
