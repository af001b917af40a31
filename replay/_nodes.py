"""Engine nodes on one virtual clock: each an unmodified ``EngineCore`` with a modeled or a torch executor.

Why one shared ``VirtualClock`` rather than a clock per node: every hint, submit and pin lease is stamped
by the node's own clock, and the simulator moves that clock to the time of each event before handling it,
so all nodes and the orchestrator read the same time and nothing ever runs "in the future".  The catch is
that ``EngineCore.step()`` advances a virtual clock by the step's modeled time itself, which would let one
node's step move every node's time.  So a step is run in two events, as the serving engine's thread does
(schedule, then execute without the lock while hints and submits keep arriving, then update):

    t          step start: ``scheduler.schedule()`` and ``executor.execute()``
    t+elapsed  step end:   ``scheduler.update()``: tokens committed, finished requests reported at t+elapsed

Between the two, hints and new requests reach the node at their own times, exactly as they would reach a
serving node mid-step.  The node is otherwise the real one: scheduler, KV manager, pins, eviction, host tier.

``elapsed`` is where the executors differ.  The modeled one prices the batch with the cost model and
computes nothing.  The torch one (``NodeSpec.executor == "torch"``) computes it: real prefill and decode
over the paged KV tensors, real host<->device block copies, greedy tokens from real logits; ``elapsed`` is
then the wall time of ``execute`` (``time.perf_counter`` around it), so the step lasts on the virtual clock
what it took on this machine.  Only the executor's work is on the clock: the scheduler's own Python time
is not, for either executor (a serving engine overlaps some of it; the modeled executor never saw it).
For the torch nodes each step is also priced by the cost model (``SimNode.modeled_step_s``), which checks
the model against the measured time of the very same batches.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from engine_adapter import (
    CostModel,
    EngineCore,
    Executor,
    KVStats,
    ModeledExecutor,
    Request,
    ScheduledBatch,
    SchedulerConfig,
    StepOutput,
    VirtualClock,
)
from engine_adapter.vllm_backend import HOLD_SHARE
from replay._fast_forward import DecodeWindow, apply_bulk_step, plan_window, window_cut
from replay._policies import ReplayConfig
from replay._step_trace import SimStepTrace

__all__ = ["NodeSpec", "NodeTotals", "SimNode", "build_nodes", "make_executor"]

Schedule = Callable[[float, Callable[[], None]], None]  # (at time, action): the simulator's event queue


@dataclass(frozen=True, slots=True)
class NodeSpec:
    """What every node of one replay shares: pool sizes (tokens), cost model, batch limits, executor."""

    num_device_tokens: int
    num_host_tokens: int
    cost_model: CostModel
    vocab_size: int = 512
    max_model_len: int = 1 << 20  # torch: also the length of the model's RoPE tables, so keep it tight
    max_num_seqs: int = 64
    cold_prefill_fraction: float = 0.25  # of the step budget, when the config caps cold prefills
    executor: str = "modeled"  # "modeled": steps priced by cost_model; "torch": computed and timed
    torch_device: str = "cpu"  # where torch nodes compute (cpu-tiny describes this machine's CPU)
    ttft_deadline_s: float | None = None  # for the configs that take it (ReplayConfig.ttft_deadline)
    fast_forward: bool = True  # modeled nodes apply plain decode stretches as one event (same results)
    link_s_per_token: float | None = None  # moving KV between nodes (ReplayConfig.migrate); None: host copy rate
    step_trace_dir: str | None = None  # each node writes its steps there, as a vLLM node does (_step_trace.py)


@dataclass(frozen=True)
class NodeTotals:
    """What a report reads of one node once its replay is over: plain values, so a result can cross a
    process boundary (``run_replay(jobs=N)``) without the engine it came from."""

    address: str
    kv_stats: KVStats
    num_preemptions: int
    pinned_token_s: float
    num_steps: int
    num_step_tokens: int
    step_s: float
    modeled_step_s: float
    # the measured pin price's readings over the whole run (the node's PrefillShare, UnpinnedSurvival)
    prefill_s: float = 0.0
    unpinned_kept_tokens: int = 0
    unpinned_tokens: int = 0


@dataclass(eq=False)
class SimNode:
    """One engine node and the bookkeeping the simulator needs around it (busy flag, pinned integral)."""

    address: str
    core: EngineCore  # read it as ``engine``, which first brings a fast-forwarded node up to the clock
    cost_model: CostModel
    busy: bool = False
    num_steps: int = 0
    num_blocked_polls: int = 0
    measured: bool = False  # torch: a step lasts its measured wall time, not the executor's own figure
    step_s: float = 0.0  # virtual time spent in steps (the sum of every step's elapsed)
    modeled_step_s: float = 0.0  # what the cost model prices the same steps at
    num_step_tokens: int = 0  # tokens the executor ran forward (prefill chunks and decodes)
    poll_s: float = 0.05
    pinned_token_s: float = 0.0  # integral of pinned tokens over virtual time
    last_schedule_s: float = -1.0  # when the scheduler last ran (a request queued before it was passed over)
    fast_forward: bool = True  # plain decode stretches as one event (modeled executor only; _fast_forward.py)
    num_bulk_steps: int = 0  # steps applied in bulk (a diagnostic: the same steps, fewer events)
    _last_account_s: float = 0.0
    _last_pinned_tokens: int = 0
    _elapsed: float = 0.0  # the step in flight's duration (torch: its measured wall time)
    finished: list[Request] = field(default_factory=list)
    _win: DecodeWindow | None = None
    _gen: int = 0
    _schedule: Schedule | None = None
    _on_step_end: Callable[[SimNode], None] | None = None
    trace: SimStepTrace | None = None  # its steps, in the vLLM node's step-trace format

    @property
    def engine(self) -> EngineCore:
        """The node's engine as of the current virtual time.  In a decode window the steps that have ended
        are applied first, and a recheck at this same time ends the window early if whatever the caller
        does next (a submit, a hint, an import) means the coming steps are no longer plain decodes."""
        win = self._win
        if win is not None:
            now = self.core.clock.now()
            self._sync(now)
            if not win.recheck_pending:
                win.recheck_pending = True
                assert self._schedule is not None
                self._schedule(now, self._recheck)
        return self.core

    def totals(self) -> NodeTotals:
        eng = self.engine
        kept = eng.kv.unpinned_survival
        stats = eng.kv.stats
        return NodeTotals(self.address, dataclasses.replace(stats, lost_by=dict(stats.lost_by)),
                          eng.scheduler.num_preemptions, self.pinned_token_s, self.num_steps,
                          self.num_step_tokens, self.step_s, self.modeled_step_s,
                          eng.prefill_share.total_prefill_s, kept.total_got_tokens, kept.total_tokens)

    @property
    def block_size(self) -> int:
        return self.core.block_size

    def account(self, now_s: float) -> None:
        """Integrate pinned memory up to ``now_s`` (called whenever pins may have changed)."""
        if self._win is not None:
            self._sync(now_s)
        self._account(now_s)

    def _account(self, now_s: float) -> None:
        self.pinned_token_s += self._last_pinned_tokens * max(0.0, now_s - self._last_account_s)
        self._last_account_s = now_s
        self._last_pinned_tokens = self.core.kv.num_pinned_blocks * self.block_size

    def kick(self, now_s: float, schedule: Schedule, on_step_end: Callable[[SimNode], None]) -> None:
        """Start a step now if the node is idle and has anything to do."""
        self._schedule, self._on_step_end = schedule, on_step_end
        if self.busy or not self.core.scheduler.has_work():
            return
        self.busy = True
        schedule(now_s, lambda: self._start(schedule, on_step_end))

    def _start(self, schedule: Schedule, on_step_end: Callable[[SimNode], None]) -> None:
        eng = self.core
        batch = eng.scheduler.schedule()
        now = self.last_schedule_s = eng.clock.now()
        self.account(now)
        if batch.is_empty():  # queued work that cannot be admitted yet (memory held by pins): poll,
            self.num_blocked_polls += 1  # as the serving loop does when idle with work waiting
            schedule(now + self.poll_s, lambda: self._start(schedule, on_step_end))
            return
        if self.trace is not None:
            self.trace.step(now, batch, eng)
        t0 = time.perf_counter()
        out = eng.executor.execute(batch)
        elapsed = self._elapsed = time.perf_counter() - t0 if self.measured else out.elapsed_s
        self.num_steps += 1
        self.num_step_tokens += batch.num_tokens
        self.step_s += elapsed
        self.modeled_step_s += self.cost_model.step_time(batch) if self.measured else out.elapsed_s
        if self.fast_forward and not self.measured:
            win = plan_window(eng, batch, out, now, self._gen + 1)
            if win is not None:
                self._gen, self._win = win.gen, win
                schedule(win.ends[-1], lambda: self._window_end(win.gen))
                return
        schedule(now + elapsed, lambda: self._end(batch, out, on_step_end))

    def _end(self, batch: ScheduledBatch, out: StepOutput, on_step_end: Callable[[SimNode], None]) -> None:
        eng = self.core
        eng.scheduler.update(batch, out)
        eng.observe_step(batch, self._elapsed)
        for o in eng.observers:
            o.on_step(batch, out)
        eng._changed()
        self._account(eng.clock.now())
        self.busy = False
        on_step_end(self)

    # ---- decode windows (_fast_forward.py) -------------------------------------------------------------
    def _sync(self, now_s: float) -> None:
        """Apply the window's steps that have ended by ``now_s``, each as a step's end would."""
        win = self._win
        assert win is not None
        eng = self.core
        while win.applied <= win.last and win.ends[win.applied] <= now_s:
            s, end_s = win.applied, win.ends[win.applied]
            if s == 0:  # the real first step: as _end, at its own end time
                eng.scheduler.update(win.batch, win.out)
                eng.observe_step(win.batch, win.out.elapsed_s)
                eng._changed()
            else:  # a bulk step: counted as _start counts a step, applied as update would apply it
                n, e = len(win.reqs), win.elapsed[s]
                self.num_steps += 1
                self.num_bulk_steps += 1
                self.num_step_tokens += n
                self.step_s += e
                self.modeled_step_s += e
                eng.prefill_share.observe(0, n, e)
                apply_bulk_step(eng, win)
            self._account(end_s)
            if s < win.last:  # the next step of the window is scheduled at this one's end
                self.last_schedule_s = end_s
            win.applied += 1

    def _recheck(self) -> None:
        """Something outside touched the node at this time: if the step after the one in flight would no
        longer be a plain decode of the same turns (or would start after a lease or prefetch falls due),
        the window ends with the step in flight."""
        win = self._win
        if win is None:
            return
        win.recheck_pending = False
        now = self.core.clock.now()
        self._sync(now)
        j = win.applied  # the step in flight (its end is still ahead)
        if j > win.last:
            return
        # A step that starts at this very time has not been scheduled yet in a step-by-step run (its start is
        # an event queued behind this one), so it too may still be cut.
        lo = j - 1 if j >= 1 and win.ends[j - 1] == now else j
        if lo == win.last:
            return
        cut = window_cut(self.core, win, lo)
        if cut < win.last:
            del win.ends[cut + 1:], win.elapsed[cut + 1:]
            self._gen += 1
            win.gen = self._gen
            assert self._schedule is not None
            self._schedule(win.ends[cut], lambda: self._window_end(win.gen))

    def _window_end(self, gen: int) -> None:
        win = self._win
        if win is None or win.gen != gen:  # cut short since: a later event ends it
            return
        self._sync(win.ends[-1])
        self._win = None
        self.busy = False
        assert self._on_step_end is not None
        self._on_step_end(self)


def build_nodes(num_nodes: int, spec: NodeSpec, config: ReplayConfig, clock: VirtualClock) -> list[SimNode]:
    """``num_nodes`` engines configured for ``config``, all on ``clock``; finished requests are collected
    per node (``SimNode.finished``) so the simulator handles them at the step's end time."""
    cm = spec.cost_model
    bs = cm.block_size
    budget = cm.max_batched_tokens
    cold = max(bs, int(budget * spec.cold_prefill_fraction)) if config.cold_prefill_cap else budget
    sched = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=spec.max_num_seqs,
                            cold_prefill_budget_tokens=cold,
                            ttft_deadline_s=spec.ttft_deadline_s if config.ttft_deadline else None,
                            yield_pins_to_older=config.yield_pins,
                            # every row admits as vLLM 0.32 does (``scheduler_reserve_full_isl``, on there
                            # by default): at a small step budget, turns admitted on their first chunk
                            # preempt each other for the later ones (docs/architecture.md)
                            admit_whole_prompt=True, warm_first=config.warm_first)
    sched = dataclasses.replace(sched, **dict(config.scheduler_options))  # a variant's own settings win
    num_host_blocks = math.ceil(spec.num_host_tokens / bs) if config.host_tier else 0
    num_device_blocks = math.ceil(spec.num_device_tokens / bs)
    nodes = []
    for i in range(num_nodes):
        executor = make_executor(spec, num_device_blocks, num_host_blocks, seed=i)
        engine = EngineCore(executor, clock=clock, scheduler_config=sched, eviction_policy=config.eviction_policy,
                            retain_contexts=config.retain_contexts, pin_budget_fraction=config.pin_budget,
                            host_write_through=config.host_write_through, evict_queued=config.evict_queued,
                            host_lru=config.host_lru,
                            host_hold_share=HOLD_SHARE if config.host_hold else 0.0,
                            node_id=f"node-{i}")
        traced = spec.step_trace_dir is not None
        node = SimNode(f"node-{i}", engine, cm, measured=spec.executor == "torch",
                       fast_forward=spec.fast_forward and not traced)  # a traced node writes every step
        if spec.step_trace_dir is not None:
            node.trace = SimStepTrace(Path(spec.step_trace_dir), config.name, i, node.address)

        def finish(req: Request, node: SimNode = node) -> None:
            node.finished.append(req)

        engine.scheduler.on_finish = finish
        nodes.append(node)
    return nodes


def make_executor(spec: NodeSpec, num_device_blocks: int, num_host_blocks: int, *, seed: int) -> Executor:
    """One node's executor: modeled (``seed`` varies its pseudo-random tokens per node) or torch.

    Every torch node holds the same model (weights seeded 0, as in ``cpu-tiny``'s profile) at the cost
    model's block size, so a KV block means the same on every node and in the profile.
    """
    cm = spec.cost_model
    if spec.executor == "modeled":
        return ModeledExecutor(cm, num_device_blocks, num_host_blocks, vocab_size=spec.vocab_size,
                               max_model_len=spec.max_model_len, seed=seed)
    if spec.executor != "torch":
        raise ValueError(f"unknown executor {spec.executor!r}; known: modeled, torch")
    from engine_adapter import TorchExecutor, TorchModelConfig, retain_freed_memory

    if spec.torch_device == "cpu":
        retain_freed_memory()  # the replay steps torch nodes on its main thread (see there)
    config = TorchModelConfig(vocab_size=spec.vocab_size, max_model_len=spec.max_model_len,
                              block_size=cm.block_size)
    return TorchExecutor(config, num_device_blocks, num_host_blocks, device=spec.torch_device)
