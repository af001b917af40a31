"""What one replay run is: workload, load, node sizes, cost model; the defaults; and the driver.

Memory pressure is the point of the comparison, so sizes default from the workload itself: the live
programs' contexts are estimated by Little's law (each program's context, averaged over its turns, held for
its unloaded lifetime: tool pauses plus its turns' prefill and decode on an idle node), and each node gets
device KV for ``device_fraction`` (a third) of its share of them and host memory for all of them.  Queueing
only lengthens lifetimes, so under load the device holds less than that third, never more.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from engine_adapter._cost_model import CostModel, load_cost_model
from replay._nodes import NodeSpec
from replay._policies import ReplayConfig
from replay._readers import read_workload
from replay._sim import SimResult, Simulation
from replay._trace import Program

__all__ = ["WORKLOAD_DEFAULTS", "ReplaySetup", "estimate_live_context_tokens", "run_replay"]

WORKLOAD_DEFAULTS: dict[str, dict[str, float]] = {
    # swe-agent: calibrated so that vllm-default's across-turn hit rate is near Copilot's 55% (README).
    # scale 0.25 (contexts of 2.5-10k tokens) keeps the 7-policy replay near a minute on 2 cores; the
    # engine's per-step Python cost grows with context length (see README, replay figures).
    "swe-agent": {"num_programs": 100, "rate": 0.5, "scale": 0.25},
    "multi-agent": {"num_programs": 300, "rate": 0.5},
    "human-in-loop": {"num_programs": 200, "rate": 0.5},
}
"""Per generator: programs and arrival rate (programs/s) when the command line does not say."""


@dataclass(frozen=True)
class ReplaySetup:
    """One replay's inputs; ``None`` sizes and loads take the workload's defaults (``resolve``)."""

    workload: str = "swe-agent"
    num_programs: int | None = None
    rate: float | None = None
    num_nodes: int = 2
    kv_capacity_tokens: int | None = None  # device KV per node
    host_capacity_tokens: int | None = None  # host memory per node (for the configs that use it)
    cost_model: str = "h100-llama3-8b"
    seed: int = 0
    scale: float | None = None  # None: the workload's default (1.0 unless WORKLOAD_DEFAULTS says)
    tick_s: float = 0.05
    device_fraction: float = 1 / 3
    block_size: int = 128  # KV block (tokens); the cost model's copy cost is rescaled to it

    def cost(self) -> CostModel:
        """The cost model at this replay's block size.

        Why not the profile's 16: the engine hashes and checks every block of every prompt at each
        admission, so a 40k-token context is 2,500 blocks at 16 and 625 at 64; the replay runs about 3x
        faster and hit rates move by under a block per turn (contexts are tens of thousands of tokens).
        A block copy moves ``block_size`` tokens, so its cost scales with it.
        """
        cm = load_cost_model(self.cost_model)
        if self.block_size == cm.block_size:
            return cm
        per_token = cm.copy_per_block_s / cm.block_size
        return cm.model_copy(update={"block_size": self.block_size,
                                     "copy_per_block_s": per_token * self.block_size})

    def defaults(self) -> dict[str, float]:
        return WORKLOAD_DEFAULTS.get(self.workload.partition(":")[0], {})

    def load_programs(self) -> list[Program]:
        d = self.defaults()
        num = self.num_programs if self.num_programs is not None else d.get("num_programs")
        rate = self.rate if self.rate is not None else d.get("rate")
        scale = self.scale if self.scale is not None else d.get("scale", 1.0)
        return read_workload(self.workload, seed=self.seed, rate=rate, scale=scale,
                             limit=None if num is None else int(num))

    def resolve(self, programs: Sequence[Program], cost_model: CostModel) -> ReplaySetup:
        """This setup with node sizes filled in from the programs (see the module docstring)."""
        live = estimate_live_context_tokens(programs, cost_model)
        longest = max(p.max_context_tokens + max(t.output_tokens for s in p.sessions for t in s.turns)
                      for p in programs)
        per_node = live / self.num_nodes
        kv = self.kv_capacity_tokens
        if kv is None:
            kv = max(int(per_node * self.device_fraction), int(1.25 * longest))
        host = self.host_capacity_tokens
        if host is None:  # all of them: Little's estimate ignores queueing, so take the generous peak
            host = max(_peak_held_tokens(programs, cost_model) // self.num_nodes, int(1.25 * longest))
        return replace(self, kv_capacity_tokens=kv, host_capacity_tokens=host)

    def node_spec(self, cost_model: CostModel, *, infinite_kv: bool, programs: Sequence[Program]) -> NodeSpec:
        assert self.kv_capacity_tokens is not None and self.host_capacity_tokens is not None
        device = self.kv_capacity_tokens
        if infinite_kv:
            device = _peak_held_tokens(programs, cost_model)
        return NodeSpec(device, self.host_capacity_tokens, cost_model)


def _unloaded_lifetime_s(program: Program, cm: CostModel) -> float:
    """Critical path of the program on an idle node: pauses plus each turn's prefill and decode."""
    finish: dict[str, float] = {}
    for sid in program.topological_order():
        s = program.session(sid)
        deps = [finish[d] for d in s.after]
        t = (max(deps) if s.join == "and" else min(deps)) if deps else 0.0
        ctx = 0
        for turn in s.turns:
            t += cm.prefill_time(turn.input_tokens, ctx)
            ctx += turn.input_tokens
            t += turn.output_tokens * cm.decode_time(1, ctx) + turn.tool_duration_s
            ctx += turn.output_tokens
        finish[sid] = t
    return max(finish.values())


def _peak_held_tokens(programs: Sequence[Program], cm: CostModel) -> int:
    """Device tokens for the oracle: the peak over time of every overlapping program's whole final context,
    each held for 4x its unloaded lifetime plus a minute (queueing slack).  Exact infinity would cost a block
    object per token ever computed; the report checks that the oracle really evicted nothing."""
    edges: list[tuple[float, int]] = []
    for p in programs:
        tokens = p.total_tokens + 16 * cm.block_size * p.num_sessions
        edges += [(p.arrival_s, tokens), (p.arrival_s + 4 * _unloaded_lifetime_s(p, cm) + 60.0, -tokens)]
    peak = held = 0
    for _, delta in sorted(edges):
        held += delta
        peak = max(peak, held)
    return peak


def estimate_live_context_tokens(programs: Sequence[Program], cm: CostModel) -> float:
    """Little's law: mean over time of the context tokens of running programs, at no queueing."""
    if not programs:
        return 0.0
    span = max(p.arrival_s for p in programs) - min(p.arrival_s for p in programs)
    held = 0.0
    for p in programs:
        mean_ctx = sum(sum(s.context_tokens()) / s.num_turns for s in p.sessions)
        held += mean_ctx * _unloaded_lifetime_s(p, cm)
    return held / span if span > 0 else float(sum(p.total_tokens for p in programs))


def run_replay(setup: ReplaySetup, configs: Sequence[ReplayConfig], *,
               programs: Sequence[Program] | None = None,
               progress: Callable[[str, int], Callable[[int], None]] | None = None
               ) -> tuple[ReplaySetup, list[SimResult]]:
    """Replay the workload under each configuration; returns the resolved setup and one result each.

    ``progress(config name, total programs)`` may return a callback the simulator calls once per finished
    program (the command line hangs a tqdm bar on it).
    """
    progs = list(programs) if programs is not None else setup.load_programs()
    if not progs:
        raise ValueError(f"workload {setup.workload!r} has no programs")
    cm = setup.cost()
    setup = setup.resolve(progs, cm)
    results = []
    for config in configs:
        spec = setup.node_spec(cm, infinite_kv=config.infinite_kv, programs=progs)
        cb = progress(config.name, len(progs)) if progress is not None else None
        sim = Simulation(progs, config, spec, num_nodes=setup.num_nodes, seed=setup.seed, tick_s=setup.tick_s,
                         progress=cb)
        results.append(sim.run())
    return setup, results
