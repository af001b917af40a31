"""Checks shared by the engine tests that drive ``EngineCore`` directly (not a test module)."""

from __future__ import annotations

from engine_adapter import EngineCore, SchedulerConfig
from hints import Release


def deadline_scheduler_config() -> SchedulerConfig:
    """Small steps, a cold-prefill cap, a 50 ms TTFT deadline and program-FCFS aging: the scheduler's
    reordering paths, for the integrity fuzzers (a fresh object each call: the config is mutable)."""
    return SchedulerConfig(
        max_num_batched_tokens=64,
        cold_prefill_budget_tokens=16,
        warm_threshold_tokens=8,
        ttft_deadline_s=0.05,
        program_fcfs_aging_s=1.0,
        admission_lookahead=2,
    )


def release_everything(core: EngineCore) -> None:
    """Release every program, free what is left, and check that every block came back."""
    core.apply_hints([Release(program_id=p) for p in sorted(core.kv.programs)])
    for s in list(core.kv.sessions.values()):
        core.kv.free_session(s)
    core.check_invariants()
    kv = core.kv
    assert kv.device.num_free_blocks == kv.device.num_blocks
    assert kv.host.num_free_blocks == kv.host.num_blocks
    assert kv.num_pinned_blocks == 0
