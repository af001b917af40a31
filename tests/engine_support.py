"""Checks shared by the engine tests that drive ``EngineCore`` directly (not a test module)."""

from __future__ import annotations

from engine_adapter._engine import EngineCore
from hints import Release


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
