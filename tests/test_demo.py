"""The engine-level demo runs end to end on real nodes, and hints keep contexts across tool pauses."""

from __future__ import annotations

from hintflow._demo import DemoConfig, format_table, run_demo


def test_demo_hints_keep_more_context_than_vllm_default() -> None:
    cfg = DemoConfig(programs=5, turns=4, tool_mean_s=0.2, arrival_gap_s=0.05)
    result = run_demo(cfg)
    base, ours = result["policies"]["vllm-default"], result["policies"]["hintflow"]
    assert ours["pins_placed"] == cfg.programs * (cfg.turns - 1) and base["pins_placed"] == 0
    assert ours["across_turn_hit_rate"] > base["across_turn_hit_rate"] + 0.2
    assert ours["recomputed_tokens"] < base["recomputed_tokens"]
    assert "hintflow" in format_table(result)
