"""``HintflowPlugin(record_to=...)``: a Temporal worker records every turn and pause of its programs for
``hintflow diagnose``, with no engine node at all, here for a workflow built with Temporal's OpenAI Agents
integration (its scripted ``TestModel``; no network).  Also the record of a ``hintflow.llm`` turn, which
carries the engine's own numbers (cached tokens, TTFT, queue wait, node).
"""

from __future__ import annotations

import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("agents", reason="needs temporalio[openai-agents] (the openai-agents SDK)")
pytest.importorskip("temporalio.openai_agents", reason="needs temporalio[openai-agents]")

from temporalio.client import Client
from temporalio.openai_agents import ModelActivityParameters, OpenAIAgentsPlugin
from temporalio.openai_agents.testing import ResponseBuilders, TestModel, TestModelProvider
from temporalio.worker import Worker

from diagnose import Recorder, diagnose_run, load_run
from tests.openai_agents_workflows import WeatherAgent, lookup_weather
from workflows import HintflowPlugin, LLMInput, LLMResult
from workflows._record_activity import turn_from_activity


async def test_the_plugin_records_an_openai_agents_workflow_without_an_engine(
    temporal_env: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("OPENAI_AGENTS_DISABLE_TRACING", "1")  # no key, no network
    model = TestModel.returning_responses([ResponseBuilders.tool_call('{"city": "Paris"}', "lookup_weather"),
                                           ResponseBuilders.output_message("It is sunny in Paris.")])
    openai_plugin = OpenAIAgentsPlugin(
        model_params=ModelActivityParameters(start_to_close_timeout=timedelta(seconds=10)),
        model_provider=TestModelProvider(model))
    path = tmp_path / "run.jsonl"
    recording = HintflowPlugin(record_to=path)  # no engines: record only
    client = Client(**{**temporal_env.client.config(), "plugins": [openai_plugin]})
    tq, wid = f"tq-{uuid.uuid4()}", f"wf-{uuid.uuid4()}"
    async with Worker(client, task_queue=tq, workflows=[WeatherAgent], activities=[lookup_weather],
                      plugins=[recording]):
        answer = await client.execute_workflow(WeatherAgent.run, "What is the weather in Paris?", id=wid,
                                               task_queue=tq, execution_timeout=timedelta(seconds=30))
    assert answer == "It is sunny in Paris."
    assert recording.recorder is not None
    recording.recorder.close()
    run = load_run(path)
    assert [(t.program_id, t.session_id, t.turn) for t in run.turns] == [(wid, wid, 0), (wid, wid, 1)]
    first, second = run.turns
    assert first.tool == "lookup_weather" and first.pause_s is not None and first.pause_s >= 0.04
    assert [s.block for s in first.segments][:2] == ["tools", "system"]  # the agent's tools and instructions
    assert second.segments[:2] == first.segments[:2]  # the same early blocks on the second call
    assert first.provider == "openai" and first.input_tokens is not None
    assert diagnose_run(run).finding("early_blocks").status == "ok"


def test_a_hintflow_llm_turn_records_the_engine_numbers() -> None:
    ids = list(range(300))
    inp = LLMInput("s", ids, max_new_tokens=4, prefix_key="sys", prefix_tokens=100)
    res = LLMResult(token_ids=[1, 2, 3, 4], node="10.0.0.5:50051", num_prompt_tokens=300, num_cached_tokens=180,
                    num_host_hit_tokens=20, ttft_s=0.05, queue_wait_s=0.01)
    lengths: list[int] = []
    rec = turn_from_activity("p", "s", inp, res, 1000.0, 0.2, lengths)
    assert (rec.input_tokens, rec.cached_tokens, rec.output_tokens) == (300, 200, 4)
    assert (rec.ttft_s, rec.queue_wait_s, rec.node, rec.provider) == (0.05, 0.01, "10.0.0.5:50051", "hintflow")
    assert [(s.block, s.num_tokens) for s in rec.segments] == [("prefix", 100), ("history", 200)]
    longer = turn_from_activity("p", "s", LLMInput("s", [*ids, 7, 8], prefix_tokens=100), res, 1001.0, 0.2, lengths)
    assert longer.segments[:2] == rec.segments  # cut where the previous call ended: repeated exactly
    assert [s.num_tokens for s in longer.segments] == [100, 200, 2] and lengths == [300, 302]
    rewritten = turn_from_activity("p", "s", LLMInput("s", [*ids[:250], 9, *ids[251:], 7, 8, 5], prefix_tokens=100),
                                   res, 1002.0, 0.2, lengths)
    assert rewritten.segments[0] == rec.segments[0] and rewritten.segments[1] != rec.segments[1]
    recorder = Recorder(None, otel=False)
    recorder.turn(rec)
    assert recorder.turns[0].turn == 0


async def test_the_example_coding_agent_on_an_engine_node_is_recorded_with_the_engines_numbers(
    temporal_env: Any, start_engine: Any, tmp_path: Path
) -> None:
    from orchestrator import PauseModel
    from workflows import HintRuntime
    from workflows.examples import CodingAgent, CodingAgentInput

    node = await start_engine("node-record")
    runtime = HintRuntime([node.address], "hintflow", pause_model=PauseModel(default_mean_s=0.05, min_samples=20))
    path = tmp_path / "coding.jsonl"
    plugin = HintflowPlugin(runtime=runtime, record_to=path)
    tq, wid = f"tq-{uuid.uuid4()}", f"wf-{uuid.uuid4()}"
    inp = CodingAgentInput(turns=4, task_tokens=200, tool_output_tokens=32, time_scale=0.02, tool_max_s=1.0)
    async with Worker(temporal_env.client, task_queue=tq, workflows=[CodingAgent], plugins=[plugin]):
        await temporal_env.client.execute_workflow(CodingAgent.run, inp, id=wid, task_queue=tq,
                                                   execution_timeout=timedelta(seconds=120))
    assert plugin.recorder is not None
    plugin.recorder.close()
    run = load_run(path)
    assert [t.turn for t in run.turns] == [0, 1, 2, 3]
    assert all(t.provider == "hintflow" and t.node == node.address and t.ttft_s is not None for t in run.turns)
    assert [t.tool for t in run.turns[:3]] == ["bash"] * 3 and all(t.pause_s is not None for t in run.turns[:3])
    assert all((t.cached_tokens or 0) > 0 for t in run.turns[1:])  # the engine kept the context across pauses
    diag = diagnose_run(run)
    assert diag.finding("early_blocks").status == "ok"
    assert diag.finding("prefix_reuse").numbers["repeated_fraction"] > 0.8
