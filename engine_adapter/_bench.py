"""`hintflow engine bench`: scheduler overhead per step and hint throughput with many live sessions.

What is timed is hintflow's own work, never a model's: the node runs the modeled executor on a virtual
clock, and the executor's own time (batch validation, pricing) is measured separately and subtracted.

* ``step_overhead_ms``: mean wall time of ``schedule()`` + ``update()`` per step while ``num_running``
  requests decode, ``--sessions`` contexts are parked, and memory is under pressure (the pool holds about
  ``--pool-fraction`` of all contexts, so steps evict).
* ``hints_per_s``: hints applied per second by ``EngineCore.apply_hints``, decoding included (the node
  receives protobuf batches, validates each hint, applies it under the lock), in batches of
  ``--batch-size``; a mix of ``EvictionOrder`` (one entry), ``Pin`` and ``Priority`` over random sessions.
* ``next_use_entries_per_s``: the same for ``EvictionOrder`` batches of 100 entries each, the form an
  orchestrator sends when many predictions change at once.
"""

from __future__ import annotations

import random
import time
from typing import Any

from hints import EvictionOrder, HintBatch, NextUse, Pin, Priority, batch_from_proto_lenient, batch_to_proto

from ._cost_model import load_cost_model
from ._engine import EngineCore
from ._executor import ScheduledBatch, StepOutput, VirtualClock
from ._modeled_executor import ModeledExecutor
from ._scheduler import SchedulerConfig

__all__ = ["run_bench"]


class _TimedExecutor(ModeledExecutor):
    """Counts the executor's own wall time so the scheduler's can be isolated."""

    spent_s = 0.0

    def execute(self, batch: ScheduledBatch) -> StepOutput:
        t0 = time.perf_counter()
        out = super().execute(batch)
        self.spent_s += time.perf_counter() - t0
        return out


def run_bench(
    sessions: int = 10_000,
    context_tokens: int = 256,
    num_running: int = 64,
    steps: int = 500,
    num_hints: int = 50_000,
    batch_size: int = 64,
    pool_fraction: float = 0.6,
    cost_model: str = "h100-llama3-8b",
    seed: int = 0,
) -> dict[str, Any]:
    if sessions < num_running or sessions < 1:
        raise ValueError(f"--sessions ({sessions}) must be >= the running requests ({num_running}) and >= 1")
    rng = random.Random(seed)
    cm = load_cost_model(cost_model)
    bs = cm.block_size
    blocks_per_ctx = -(-(context_tokens + 64) // bs)
    num_blocks = max(int(sessions * blocks_per_ctx * pool_fraction), (num_running + 2) * blocks_per_ctx * 2)
    ex = _TimedExecutor(cm, num_device_blocks=num_blocks, vocab_size=32_000)
    clock = VirtualClock()
    core = EngineCore(
        ex, clock=clock, scheduler_config=SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=8192)
    )
    # Setup (not timed): every session computes one turn and parks.
    t_setup = time.perf_counter()
    ids = [f"s{i}" for i in range(sessions)]
    for i, sid in enumerate(ids):
        prompt = [rng.randrange(32_000) for _ in range(context_tokens)]
        core.submit(prompt, 1, session_id=sid, program_id=f"p{i}")
        if i % 256 == 255:
            core.run_until_idle()
    core.run_until_idle()
    setup_s = time.perf_counter() - t_setup

    # Steady state: num_running long decodes resume on top of 10k parked contexts.
    for sid in rng.sample(ids, num_running):
        s = core.kv.sessions[sid]
        core.submit(s.token_ids + [1, 2, 3], 10 * steps, session_id=sid)
    for _ in range(20):  # warm-up: admissions and their prefills
        core.step()
    ex.spent_s = 0.0
    n_steps = 0
    t0 = time.perf_counter()
    while n_steps < steps and core.step() is not None:
        n_steps += 1
    total_s = time.perf_counter() - t0
    step_overhead_ms = 1000.0 * (total_s - ex.spent_s) / max(n_steps, 1)

    # Hints: decode + validate + apply, in batches.
    live = list(core.kv.sessions)

    def mixed(i: int) -> Any:
        sid = live[rng.randrange(len(live))]
        k = i % 3
        if k == 0:
            return EvictionOrder(entries=[NextUse(session_id=sid, next_use_s=rng.uniform(0, 60))])
        if k == 1:
            return Pin(session_id=sid, ttl_s=rng.uniform(0.5, 5.0))
        return Priority(session_id=sid, program_age_s=rng.uniform(0, 600))

    batches = [
        batch_to_proto(HintBatch(batch_id=b, hints=[mixed(b * batch_size + j) for j in range(batch_size)]))
        for b in range(max(1, num_hints // batch_size))
    ]
    t0 = time.perf_counter()
    applied = 0
    for pb in batches:
        results = core.apply_hints(batch_from_proto_lenient(pb).hints)
        applied += len(results)
    hints_s = time.perf_counter() - t0

    order_batches = [
        batch_to_proto(
            HintBatch(
                batch_id=b,
                hints=[
                    EvictionOrder(
                        entries=[
                            NextUse(session_id=sid, next_use_s=rng.uniform(0, 60))
                            for sid in rng.sample(live, 100)
                        ]
                    )
                ],
            )
        )
        for b in range(max(1, num_hints // 100))
    ]
    t0 = time.perf_counter()
    entries = 0
    for pb in order_batches:
        core.apply_hints(batch_from_proto_lenient(pb).hints)
        entries += 100
    order_s = time.perf_counter() - t0
    core.check_invariants()
    return {
        "step_overhead_ms": round(step_overhead_ms, 4),
        "hints_per_s": round(applied / hints_s),
        "next_use_entries_per_s": round(entries / order_s),
        "sessions": len(core.kv.sessions),
        "running": core.scheduler.num_running,
        "steps_timed": n_steps,
        "pool_blocks": num_blocks,
        "evicted_blocks": core.kv.stats.evicted_blocks,
        "pinned_blocks": core.kv.num_pinned_blocks,
        "hint_batch_size": batch_size,
        "setup_s": round(setup_s, 2),
        "cost_model": cm.name,
    }
