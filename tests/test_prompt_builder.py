"""``PromptBuilder`` keeps a session's prefix stable: a 10-turn coding agent whose harness hands it the tool
list in a new random order each turn, against the stand-in providers (``tests/hosted_support.py``); the
cached fraction comes from the recorded responses, without the builder and with it.  Also: breakpoints
and TTLs per provider, deterministic bytes, and the change warnings in the log and in the recording.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from diagnose import Recorder, TTLAdvisor, diagnose_run, load_run, record_client
from tests.hosted_support import (
    MODEL_ANTHROPIC,
    MODEL_OPENAI,
    SYSTEM,
    TOOLS,
    Clock,
    FakeAnthropic,
    FakeOpenAI,
    coding_agent,
    openai_tools,
)
from workflows import PromptBuilder


def _cached_fraction(path: Path) -> float:
    """Cached tokens over prompt tokens of turns 1-9, as the provider reported them."""
    turns = [t for t in load_run(path).turns if t.turn > 0]
    return sum(t.cached_tokens or 0 for t in turns) / sum(t.prompt_tokens for t in turns)


def _run(tmp_path: Path, api: str, *, use_builder: bool) -> tuple[float, Recorder]:
    clock = Clock()
    path = tmp_path / f"{api}-{'builder' if use_builder else 'plain'}.jsonl"
    recorder = Recorder(path, clock=clock, otel=False)
    fake = FakeOpenAI(clock) if api == "openai-chat" else FakeAnthropic(clock)
    client = record_client(fake, recorder, session_id="agent", program_id="fix-1")
    builder = None
    if use_builder:
        builder = PromptBuilder(system=SYSTEM, api=api,  # type: ignore[arg-type]
                                model=MODEL_OPENAI if api == "openai-chat" else MODEL_ANTHROPIC,
                                recorder=recorder, program_id="fix-1", session_id="agent")
    coding_agent(client, clock, api=api, turns=10, seed=7, shuffle_tools=True, builder=builder)
    recorder.close()
    return _cached_fraction(path), recorder


@pytest.mark.parametrize("api", ["openai-chat", "anthropic"])
def test_the_builder_keeps_the_prefix_stable_when_tools_come_in_random_order(tmp_path: Path, api: str) -> None:
    before, _ = _run(tmp_path, api, use_builder=False)
    after, built = _run(tmp_path, api, use_builder=True)
    print(f"{api}: cached fraction of turns 1-9 without the builder {before:.1%}, with it {after:.1%}")
    assert before < 0.2  # the tools come first: a new order each turn and nothing after them is reused
    assert after > 0.8
    assert built.warnings == []  # the builder sorted the tools: no early block changed
    diag_plain = diagnose_run(load_run(tmp_path / f"{api}-plain.jsonl"))
    assert diag_plain.finding("early_blocks").numbers["num_early_block_changes"] >= 8
    diag_built = diagnose_run(load_run(tmp_path / f"{api}-builder.jsonl"))
    assert diag_built.finding("early_blocks").verdict.startswith("stable prefix")


def test_serialisation_is_deterministic_whatever_order_the_harness_builds_its_dicts() -> None:
    tool_a = {"name": "a", "input_schema": {"type": "object", "properties": {"x": {"type": "string"}}}}
    tool_a_reordered = {"input_schema": {"properties": {"x": {"type": "string"}}, "type": "object"}, "name": "a"}
    tool_b = {"description": "b", "name": "b"}
    one = PromptBuilder(tools=[tool_b, tool_a], system="S").build([{"role": "user", "content": "q"}])
    two = PromptBuilder(tools=[tool_a_reordered, tool_b], system="S").build([{"content": "q", "role": "user"}])
    assert json.dumps(one) == json.dumps(two)  # the same bytes, as an SDK's encoder would write them
    assert [t["name"] for t in one["tools"]] == ["a", "b"]


def test_anthropic_breakpoints_and_the_advised_ttl() -> None:
    advisor = TTLAdvisor("anthropic", "claude-opus-5")
    for _ in range(50):
        advisor.observe("human", 3000.0)  # people take 50 minutes to answer: ten renewals of a 5m entry
        advisor.observe("bash", 2.0)  # the shell answers in seconds
    assert advisor.choose(20_000, 0, "bash").name == "5m"
    assert advisor.choose(20_000, 0, "human").name == "1h"
    # A shell pause still going at 4m45s: with reads at 0.1x a write, keeping it warm pays even on the
    # recency guess (as long again); where a read costs half a write (gpt-4o), it does not.
    assert advisor.should_renew("5m", 20_000, 285.0, "bash") is True
    gpt4o = TTLAdvisor("openai", "gpt-4o")
    for _ in range(50):
        gpt4o.observe("bash", 2.0)
    assert gpt4o.should_renew("5m", 20_000, 285.0, "bash") is False
    builder = PromptBuilder(tools=TOOLS, system=SYSTEM, model=MODEL_ANTHROPIC, ttl="auto", advisor=advisor)
    history: list[dict[str, object]] = [{"role": "user", "content": "fix it"}]
    request = builder.build(history, next_tool="human")
    one_hour = {"type": "ephemeral", "ttl": "1h"}
    assert request["tools"][-1]["cache_control"] == one_hour
    assert request["system"][-1]["cache_control"] == one_hour
    assert request["messages"][-1]["content"][-1]["cache_control"] == one_hour
    marks = json.dumps(request).count('"cache_control"')
    assert marks <= 4  # Anthropic's limit
    # a long stretch of tool calls: the previous user turn gets its own breakpoint (20-block lookback)
    for i in range(12):
        history += [{"role": "assistant", "content": f"call {i}"}, {"role": "user", "content": f"result {i}"}]
    request = builder.build(history, next_tool="bash")
    assert json.dumps(request).count('"cache_control"') == 4


def test_openai_requests_carry_the_cache_key_retention_and_gpt_5_6_breakpoints() -> None:
    older = PromptBuilder(tools=openai_tools(TOOLS), system=SYSTEM, api="openai-chat", model="gpt-5",
                          ttl="24h", advisor=TTLAdvisor("openai", "gpt-5"), session_id="agent-3")
    req = older.build([{"role": "user", "content": "q"}])
    assert req["prompt_cache_key"] == "agent-3" and req["prompt_cache_retention"] == "24h"
    assert req["messages"][0] == {"role": "system", "content": SYSTEM}
    assert "prompt_cache_breakpoint" not in json.dumps(req)
    newer = PromptBuilder(tools=openai_tools(TOOLS), system=SYSTEM, api="openai-responses", model="gpt-5.6-terra",
                          ttl="30m", advisor=TTLAdvisor("openai", "gpt-5.6-terra"), session_id="agent-3")
    req = newer.build([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
                       {"role": "user", "content": "q2"}])
    assert req["prompt_cache_options"] == {"ttl": "30m"} and "prompt_cache_retention" not in req
    marked = [m for m in req["input"] if "prompt_cache_breakpoint" in json.dumps(m)]
    assert [m["role"] for m in marked] == ["developer", "user"]  # the system block and the newest message
    assert marked[1]["content"][-1] == {"type": "input_text", "text": "q2",
                                        "prompt_cache_breakpoint": {"mode": "explicit"}}
    settings = newer.agents_model_settings()
    assert settings == {"extra_args": {"prompt_cache_key": "agent-3", "prompt_cache_options": {"ttl": "30m"}}}
    assert [t["function"]["name"] for t in PromptBuilder.order_tools(list(reversed(openai_tools(TOOLS))))] == sorted(
        t["name"] for t in TOOLS)


def test_a_changed_early_block_is_warned_in_the_log_and_in_the_recording(tmp_path: Path,
                                                                          caplog: pytest.LogCaptureFixture) -> None:
    recorder = Recorder(tmp_path / "w.jsonl", otel=False)
    builder = PromptBuilder(tools=TOOLS, system=SYSTEM, recorder=recorder, program_id="p", session_id="s")
    history = [{"role": "user", "content": "q"}]
    builder.build(history)
    with caplog.at_level(logging.WARNING):
        builder.build(history, system=SYSTEM + " Today is 2026-12-02 10:41.")  # a timestamp in the system prompt
        builder.build([{"role": "user", "content": "q, reworded"}], system=SYSTEM + " Today is 2026-12-02 10:41.")
    assert any("system block changed at turn 1" in r.message for r in caplog.records)
    assert any("history message 0 changed" in r.message for r in caplog.records)
    recorder.close()
    lines = [json.loads(x) for x in (tmp_path / "w.jsonl").read_text().splitlines()]
    warnings = [x for x in lines if x["kind"] == "warning"]
    assert [(w["turn"], w["block"]) for w in warnings] == [(1, "system"), (2, "message")]
