"""The example agents' per-turn report counts recomputation wherever the turn ran."""

from __future__ import annotations

from workflows import LLMResult
from workflows.examples import ProgramReport


def test_history_not_found_counts_as_recomputed_even_where_the_node_never_saw_it() -> None:
    report = ProgramReport("p", "coding-agent")
    # A session moved to a node that never saw it (or a vLLM node): the node reports nothing recomputed.
    moved = report.add("s", 500, LLMResult(num_prompt_tokens=700, num_cached_tokens=128))
    assert moved.recomputed_tokens == 500 - 128
    # The node's own figure stands when it is the larger (it knows about host reloads and evictions).
    local = report.add("s", 500, LLMResult(num_prompt_tokens=700, num_cached_tokens=480, num_recomputed_tokens=30))
    assert local.recomputed_tokens == 30
    first = report.add("t", 0, LLMResult(num_prompt_tokens=300, num_cached_tokens=160))  # a shared prefix hit
    assert first.recomputed_tokens == 0
