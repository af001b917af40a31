"""What one replay run is: workload, load, node sizes, cost model; the defaults; and the driver.

Memory pressure is the point of the comparison, so sizes default from the workload itself: the live
programs' contexts are estimated by Little's law (each program's context, averaged over its turns, held for
its unloaded lifetime: tool pauses plus its turns' prefill and decode on an idle node), and each node gets
device KV for ``device_fraction`` (a third) of its share of them, but at least 1.25 times the longest
request (which must fit), and host memory of half that device pool (``host_memory="short"``: memory is
short on both tiers) or for every context (``"all"``).  Queueing only lengthens lifetimes, so under load
the device holds less than that third, never more.

Two executors compute the nodes' steps (``NodeSpec.executor``):

* ``modeled`` (default): each step costs what the cost model says; replays are deterministic.
* ``torch``: each node runs the real tiny Llama-like ``TorchExecutor`` (random weights; real prefill,
  decode and host<->device copies over the same block counts), and a step lasts, on the virtual clock,
  the wall time it was measured to take.  The cost model is then only what the policies, the router
  and the sizing read (``cpu-tiny``, fitted on that model by ``hintflow engine profile``), and token
  counts default to a fifth of the modeled defaults (``TORCH_WORKLOAD_DEFAULTS``) so that the longest
  prompt stays near the 2,048 tokens the profile covered and a four-policy run takes a minute or two.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

from engine_adapter import CostModel, load_cost_model
from replay._nodes import NodeSpec
from replay._policies import ReplayConfig
from replay._readers import read_workload
from replay._sim import SimResult, Simulation
from replay._trace import Program

__all__ = ["EXECUTORS", "EXECUTOR_DEFAULTS", "TORCH_WORKLOAD_DEFAULTS", "WORKLOAD_DEFAULTS", "ReplaySetup",
           "estimate_live_context_tokens", "longest_request_tokens", "run_replay"]

WORKLOAD_DEFAULTS: dict[str, dict[str, float]] = {
    # swe-agent: memory pressure as issue 4 asks (device KV a third of the live contexts, at least 1.25x the
    # longest); vllm-default's across-turn hit rate is then about 25%, not Copilot's 55% (docs/benchmarks.md says why).
    # scale 0.25 (contexts of 2.5-10k tokens) keeps the 7-policy replay near a minute on 2 cores; the
    # engine's per-step Python cost grows with context length (see docs/benchmarks.md, replay figures).
    "swe-agent": {"num_programs": 100, "rate": 0.5, "scale": 0.25},
    "multi-agent": {"num_programs": 300, "rate": 0.5},
    "human-in-loop": {"num_programs": 200, "rate": 0.5},
    # skewed: meant for --nodes 4, swe-agent's scale; at 1/s memory is rarely short and every policy ties within 2%
    # (docs/benchmarks.md, four nodes under skew), so 2/s, where the long programs' nodes run out of room
    "skewed": {"num_programs": 400, "rate": 2.0, "scale": 0.25},
}
"""Per generator: programs and arrival rate (programs/s) when the command line does not say."""

TORCH_WORKLOAD_DEFAULTS: dict[str, dict[str, float]] = {
    # a fifth of the modeled scale: longest prompts of about 2k tokens (swe-agent 1,970, multi-agent 1,400,
    # human-in-loop 2,080 over the first 40 programs), the range cpu-tiny was profiled on
    "swe-agent": {"num_programs": 40, "scale": 0.05},
    "multi-agent": {"num_programs": 40, "scale": 0.2},
    "human-in-loop": {"num_programs": 40, "scale": 0.2},
    "skewed": {"num_programs": 40, "scale": 0.02},  # (its long programs reach about 97k tokens unscaled)
}
"""Per generator, with ``--executor torch``: these override ``WORKLOAD_DEFAULTS`` (the arrival rate stays)."""

EXECUTORS = ("modeled", "torch")
HOST_MEMORY = ("short", "all")
"""Host memory per node when not given in tokens: half the device pool (the default: memory is short on
both tiers, where hints have to earn their keep), or every context (where every keep-context design keeps
every context and they tie)."""

EXECUTOR_DEFAULTS: dict[str, dict[str, str | int]] = {
    "modeled": {"cost_model": "h100-llama3-8b", "block_size": 128},
    # the torch nodes run the model cpu-tiny was fitted on, at the block size it was fitted at
    "torch": {"cost_model": "cpu-tiny", "block_size": 16},
}
"""Per executor: the cost model and KV block size when neither the caller nor the command line says."""


@dataclass(frozen=True)
class ReplaySetup:
    """One replay's inputs; ``None`` takes the executor's and the workload's defaults (``with_defaults``),
    and node sizes from the programs (``resolve``)."""

    workload: str = "swe-agent"
    num_programs: int | None = None
    rate: float | None = None
    num_nodes: int = 2
    kv_capacity_tokens: int | None = None  # device KV per node
    host_capacity_tokens: int | None = None  # host memory per node (for the configs that use it)
    host_memory: str = "short"  # without host_capacity_tokens: "short" (half the device pool) or "all"
    cost_model: str | None = None  # None: EXECUTOR_DEFAULTS (h100-llama3-8b modeled, cpu-tiny torch)
    seed: int = 0
    scale: float | None = None  # None: the workload's default (1.0 unless WORKLOAD_DEFAULTS says)
    tick_s: float = 0.05
    device_fraction: float = 1 / 3
    block_size: int | None = None  # KV block (tokens); the cost model's copy cost is rescaled to it
    executor: str = "modeled"  # "modeled" or "torch" (see the module docstring)
    ttft_deadline_s: float | None = None  # hintflow's nodes: SchedulerConfig.ttft_deadline_s (off)
    torch_threads: int = 1  # torch intra-op threads while torch nodes run (cpu-tiny was fitted on 1)
    link_gb_per_s: float | None = None  # between nodes, for migrations (GB/s); None: the host copy rate
    step_trace_dir: str | None = None  # each node writes its steps there, as a vLLM node does (_step_trace.py)

    def __post_init__(self) -> None:
        if self.host_memory not in HOST_MEMORY:
            raise ValueError(f"host_memory must be one of {', '.join(HOST_MEMORY)}, got {self.host_memory!r}")
        if self.executor not in EXECUTORS:
            raise ValueError(f"executor must be one of {', '.join(EXECUTORS)}, got {self.executor!r}")
        if self.torch_threads < 1:
            raise ValueError(f"torch_threads must be >= 1, got {self.torch_threads}")
        if self.link_gb_per_s is not None and not (math.isfinite(self.link_gb_per_s) and self.link_gb_per_s > 0):
            raise ValueError(f"link_gb_per_s must be a positive number of GB/s, got {self.link_gb_per_s}")

    def link_s_per_token(self, cost_model: CostModel) -> float:
        """Seconds to move one token's KV between nodes: ``link_gb_per_s`` over the cost model's KV bytes per
        token, or by default the model's host copy rate (a GPU-direct RDMA NIC moves KV about as fast)."""
        if self.link_gb_per_s is None:
            return cost_model.copy_per_block_s / cost_model.block_size
        if cost_model.kv_bytes_per_token is None:
            raise ValueError(f"cost model {cost_model.name!r} gives no kv_bytes_per_token, so a link rate in "
                             "GB/s cannot price a migration; leave the link rate unset")
        return cost_model.kv_bytes_per_token / (self.link_gb_per_s * 1e9)

    def with_defaults(self) -> ReplaySetup:
        """This setup with every default it will run with written in (so a report shows them)."""
        d, e = self.defaults(), EXECUTOR_DEFAULTS[self.executor]
        num = self.num_programs if self.num_programs is not None else d.get("num_programs")
        return replace(
            self,
            num_programs=None if num is None else int(num),
            rate=self.rate if self.rate is not None else d.get("rate"),
            scale=self.scale if self.scale is not None else d.get("scale", 1.0),
            cost_model=self.cost_model if self.cost_model is not None else str(e["cost_model"]),
            block_size=self.block_size if self.block_size is not None else int(e["block_size"]),
        )

    def cost(self) -> CostModel:
        """The cost model at this replay's block size.

        Why not the profile's 16: the engine hashes and checks every block of every prompt at each
        admission, so a 40k-token context is 2,500 blocks at 16 and 625 at 64; the replay runs about 3x
        faster and hit rates move by under a block per turn (contexts are tens of thousands of tokens).
        A block copy moves ``block_size`` tokens, so its cost scales with it.
        """
        s = self.with_defaults()
        assert s.cost_model is not None and s.block_size is not None
        cm = load_cost_model(s.cost_model)
        if s.block_size == cm.block_size:
            return cm
        per_token = cm.copy_per_block_s / cm.block_size
        return cm.model_copy(update={"block_size": s.block_size,
                                     "copy_per_block_s": per_token * s.block_size})

    def defaults(self) -> dict[str, float]:
        """The workload's defaults for programs, rate and scale (the torch ones where they apply)."""
        kind = self.workload.partition(":")[0]
        d = dict(WORKLOAD_DEFAULTS.get(kind, {}))
        if self.executor == "torch":
            d.update(TORCH_WORKLOAD_DEFAULTS.get(kind, {}))
        return d

    def load_programs(self) -> list[Program]:
        s = self.with_defaults()
        return read_workload(s.workload, seed=s.seed, rate=s.rate, scale=s.scale if s.scale is not None else 1.0,
                             limit=s.num_programs)

    def resolve(self, programs: Sequence[Program], cost_model: CostModel) -> ReplaySetup:
        """This setup with node sizes filled in from the programs (see the module docstring)."""
        live = estimate_live_context_tokens(programs, cost_model)
        longest = longest_request_tokens(programs)
        per_node = live / self.num_nodes
        kv = self.kv_capacity_tokens
        if kv is None:
            kv = max(int(per_node * self.device_fraction), int(1.25 * longest))
        host = self.host_capacity_tokens
        if host is None and self.host_memory == "short":
            host = kv // 2
        elif host is None:  # all of them: Little's estimate ignores queueing, so take the generous peak
            host = max(_peak_held_tokens(programs, cost_model) // self.num_nodes, int(1.25 * longest))
        return replace(self, kv_capacity_tokens=kv, host_capacity_tokens=host)

    def node_spec(self, cost_model: CostModel, *, infinite_kv: bool, programs: Sequence[Program]) -> NodeSpec:
        assert self.kv_capacity_tokens is not None and self.host_capacity_tokens is not None
        device = self.kv_capacity_tokens
        if infinite_kv:
            device = _peak_held_tokens(programs, cost_model)
        link = self.link_s_per_token(cost_model)
        if self.executor == "modeled":
            return NodeSpec(device, self.host_capacity_tokens, cost_model, ttft_deadline_s=self.ttft_deadline_s,
                            link_s_per_token=link, step_trace_dir=self.step_trace_dir)
        # the torch model's RoPE tables are max_model_len long: cover the longest request, no more
        bs = cost_model.block_size
        max_len = -(-(longest_request_tokens(programs) + bs) // bs) * bs
        return NodeSpec(device, self.host_capacity_tokens, cost_model, max_model_len=max_len, executor="torch",
                        ttft_deadline_s=self.ttft_deadline_s, link_s_per_token=link, step_trace_dir=self.step_trace_dir)


def longest_request_tokens(programs: Sequence[Program]) -> int:
    """An upper bound on prompt + output of any call: the longest prompt plus the longest output."""
    return max(p.max_context_tokens + max(t.output_tokens for s in p.sessions for t in s.turns)
               for p in programs)


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
    object per token ever computed; ``hintflow replay`` warns if the oracle evicted anything (``oracle_note``)."""
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
    """Mean over the run of the context tokens of live programs, at no queueing.

    Little's law (arrival rate x time in system x mean context) over the window from the first arrival to
    the last program's unloaded end.  Over the arrival span alone it overstates whenever programs outlive
    that span: human-in-loop's 200 programs arrive within 6 minutes and live half an hour each, and the
    estimate came to 4.4x all their contexts together (a device no workload could fill).
    """
    if not programs:
        return 0.0
    start = min(p.arrival_s for p in programs)
    held = 0.0
    end = start
    for p in programs:
        lifetime_s = _unloaded_lifetime_s(p, cm)
        mean_ctx = sum(sum(s.context_tokens()) / s.num_turns for s in p.sessions)
        held += mean_ctx * lifetime_s
        end = max(end, p.arrival_s + lifetime_s)
    return held / (end - start) if end > start else float(sum(p.total_tokens for p in programs))


def run_replay(setup: ReplaySetup, configs: Sequence[ReplayConfig], *,
               programs: Sequence[Program] | None = None,
               progress: Callable[[str, int], Callable[[int], None]] | None = None,
               jobs: int = 1,
               ) -> tuple[ReplaySetup, list[SimResult]]:
    """Replay the workload under each configuration; returns the resolved setup and one result each.

    ``progress(config name, total programs)`` may return a callback the simulator calls once per finished
    program (the command line hangs a tqdm bar on it).  ``jobs`` > 1 replays up to that many
    configurations at once in worker processes (modeled executor only: on torch nodes a step lasts its
    measured wall time, which other processes would distort).  Each configuration's replay is
    deterministic on its own, so the results are the same as with ``jobs=1``, except ``wall_s`` and
    ``nodes`` (the live nodes stay in the worker; ``node_totals`` carries what a report needs); progress
    is then reported once per finished configuration.
    """
    if jobs < 1:
        raise ValueError(f"jobs must be >= 1, got {jobs}")
    if programs is None:
        setup = setup.with_defaults()
        progs = setup.load_programs()
    else:  # the caller's programs: keep its (perhaps unset) load knobs, fill the executor's defaults
        progs = list(programs)
        setup = replace(setup.with_defaults(), num_programs=len(progs), rate=setup.rate, scale=setup.scale)
    if not progs:
        raise ValueError(f"workload {setup.workload!r} has no programs")
    cm = setup.cost()
    setup = setup.resolve(progs, cm)
    tasks = [(progs, config, setup.node_spec(cm, infinite_kv=config.infinite_kv, programs=progs),
              setup.num_nodes, setup.seed, setup.tick_s) for config in configs]
    if jobs > 1 and len(tasks) > 1 and setup.executor == "modeled":
        return setup, _run_parallel(tasks, min(jobs, len(tasks)), progress, len(progs))
    results = []
    with _torch_threads(setup):
        for task in tasks:
            cb = progress(task[1].name, len(progs)) if progress is not None else None
            results.append(_replay_one(*task, progress=cb))
    return setup, results


def _replay_one(progs: Sequence[Program], config: ReplayConfig, spec: NodeSpec, num_nodes: int, seed: int,
                tick_s: float, progress: Callable[[int], None] | None = None) -> SimResult:
    result = Simulation(progs, config, spec, num_nodes=num_nodes, seed=seed, tick_s=tick_s,
                        progress=progress).run()
    if not config.admission_choice:
        return result
    guarded = replace(config, admission_choice=False, scheduler_options=(*_guard(), *config.scheduler_options))
    other = Simulation(progs, guarded, spec, num_nodes=num_nodes, seed=seed, tick_s=tick_s).run()
    if _mean_jct_s(other) < _mean_jct_s(result):  # the row keeps its own name and options
        return replace(other, config=config, extra={**other.extra, "admission": "guard"})
    return replace(result, extra={**result.extra, "admission": "none"})


def _guard() -> tuple[tuple[str, Any], ...]:
    """The vLLM node's program admission (its device-only default), the other choice of an ``admission_choice``
    row: a variant's own scheduler options come after it and win. Imported here, not at the top: the vLLM
    backend's package loads torch, which a replay without such a row need not wait for."""
    from engine_adapter.vllm_backend import ADMIT_MAX_WAIT_S  # (no vLLM import: the node's constants)

    return (("admit_fraction", 1.0), ("admit_max_wait_s", ADMIT_MAX_WAIT_S))


def _mean_jct_s(result: SimResult) -> float:
    return math.fsum(r.jct_s for r in result.programs) / max(1, len(result.programs))


def _replay_in_worker(task: tuple[Any, ...]) -> SimResult:
    return replace(_replay_one(*task), nodes=[])  # live engines hold locks: they do not pickle


def _run_parallel(tasks: list[tuple[Any, ...]], workers: int,
                  progress: Callable[[str, int], Callable[[int], None]] | None,
                  num_programs: int) -> list[SimResult]:
    """The tasks in ``workers`` spawned processes (spawn: safe beside threads, ~0.4 s of imports each);
    results in the tasks' order."""
    import concurrent.futures
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
        futures = {pool.submit(_replay_in_worker, task): i for i, task in enumerate(tasks)}
        results: list[SimResult | None] = [None] * len(tasks)
        for fut in concurrent.futures.as_completed(futures):
            i = futures[fut]
            results[i] = fut.result()
            if progress is not None:
                progress(tasks[i][1].name, num_programs)(num_programs)
    return [r for r in results if r is not None]


@contextlib.contextmanager
def _torch_threads(setup: ReplaySetup) -> Iterator[None]:
    """torch's intra-op threads set to ``setup.torch_threads`` while torch nodes run, then restored."""
    if setup.executor != "torch":
        yield
        return
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(setup.torch_threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)
