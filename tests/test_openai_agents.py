"""Hints flow for workflows built with Temporal's OpenAI Agents integration (``temporalio.openai_agents``).

A real Temporal dev server, a real torch engine node on loopback, and an ``agents.Agent`` whose model is the
integration's scripted ``TestModel`` (no network): first a call of a tool made from a Temporal activity
(``activity_as_tool``), then a final answer.  The worker carries both ``OpenAIAgentsPlugin`` and
``HintflowPlugin``, in either order.

What must hold: the integration's ``invoke_model_activity`` calls are turns of the workflow's session (no
``session(...)`` needed), the tool activity between them is a tool pause named by its activity type, the
program ends; the policy's hints reach the node and are acked OK (the model calls did not run on our node,
but each turn's ``Priority`` names its program, so the node records the session, with no blocks, and the
session's later hints find it; the program's ``Release`` frees it); the sandbox passes through both
``agents`` and ``workflows`` whichever plugin wraps the other's workflow runner.
"""

from __future__ import annotations

import uuid
from datetime import timedelta
from typing import Any

import pytest

pytest.importorskip("agents", reason="needs temporalio[openai-agents] (the openai-agents SDK)")
pytest.importorskip("temporalio.openai_agents", reason="needs temporalio[openai-agents]")

from prometheus_client import CollectorRegistry
from temporalio.client import Client
from temporalio.openai_agents import ModelActivityParameters, OpenAIAgentsPlugin
from temporalio.openai_agents.testing import ResponseBuilders, TestModel, TestModelProvider
from temporalio.worker import Worker
from temporalio.worker.workflow_sandbox import SandboxedWorkflowRunner

from hints import EngineClient
from orchestrator import PauseModel, ProgramEnded, ToolEnded, ToolStarted, TurnEnded, TurnStarted
from tests.openai_agents_workflows import WeatherAgent, lookup_weather
from workflows import HintflowPlugin, HintRuntime

TOOL = "lookup_weather"  # the activity's type name, which is also the agent tool's name


def _openai_plugin() -> OpenAIAgentsPlugin:
    model = TestModel.returning_responses(
        [
            ResponseBuilders.tool_call('{"city": "Paris"}', TOOL),
            ResponseBuilders.output_message("It is sunny in Paris."),
        ]
    )
    return OpenAIAgentsPlugin(
        model_params=ModelActivityParameters(start_to_close_timeout=timedelta(seconds=10)),
        model_provider=TestModelProvider(model),
    )


def _samples(registry: CollectorRegistry, name: str, label: str) -> dict[str, float]:
    """Counter ``name`` summed by ``label`` (e.g. hints emitted by kind, hints acked by code)."""
    out: dict[str, float] = {}
    for metric in registry.collect():
        for s in metric.samples:
            if s.name == name:
                out[s.labels[label]] = out.get(s.labels[label], 0.0) + s.value
    return out


@pytest.mark.parametrize("order", ["openai-first", "hintflow-first"])
async def test_hints_flow_for_an_openai_agents_workflow(
    temporal_env: Any, start_engine: Any, monkeypatch: pytest.MonkeyPatch, order: str
) -> None:
    # The agents SDK would export traces to OpenAI's API; there is no key and no network here.
    monkeypatch.setenv("OPENAI_AGENTS_DISABLE_TRACING", "1")
    node = await start_engine("node-openai-agents")
    rt = HintRuntime([node.address], "hintflow", pause_model=PauseModel(default_mean_s=0.05, min_samples=20))
    openai_plugin, hintflow_plugin = _openai_plugin(), HintflowPlugin(runtime=rt)
    # OpenAIAgentsPlugin must be on the client (it sets the client's data converter); client plugins are
    # applied to the worker before the worker's own, so each order puts a different runner hook last.
    if order == "openai-first":
        client_plugins: list[Any] = [openai_plugin]
        worker_plugins: list[Any] = [hintflow_plugin]
    else:
        client_plugins, worker_plugins = [hintflow_plugin, openai_plugin], []
    client = Client(**{**temporal_env.client.config(), "plugins": client_plugins})

    tq = f"tq-{uuid.uuid4()}"
    wid = f"wf-{uuid.uuid4()}"
    worker = Worker(
        client, task_queue=tq, workflows=[WeatherAgent], activities=[lookup_weather], plugins=worker_plugins
    )
    runner = worker.config(active_config=True)["workflow_runner"]
    assert isinstance(runner, SandboxedWorkflowRunner), runner
    passthrough = runner.restrictions.passthrough_modules
    assert {"workflows", "agents", "openai"} <= passthrough, sorted(passthrough)
    async with worker:
        answer = await client.execute_workflow(
            WeatherAgent.run,
            "What is the weather in Paris?",
            id=wid,
            task_queue=tq,
            execution_timeout=timedelta(seconds=30),
        )
        assert answer == "It is sunny in Paris."
        pub = rt.publishers[node.address]
        assert await pub.flush(5)

    # The program as the runtime saw it: two turns of the workflow's session, the tool pause between them.
    seen = [(type(e).__name__, getattr(e, "session_id", None), getattr(e, "tool", None)) for e in rt.events]
    assert seen == [
        ("TurnStarted", wid, None),
        ("TurnEnded", wid, None),
        ("ToolStarted", wid, TOOL),
        ("ToolEnded", wid, TOOL),
        ("TurnStarted", wid, None),
        ("TurnEnded", wid, None),
        ("ProgramEnded", None, None),
    ], seen
    assert all(e.program_id == wid for e in rt.events)
    turns = [e for e in rt.events if isinstance(e, TurnStarted | TurnEnded)]
    assert all(e.context_tokens > 0 for e in turns)  # estimated from the size of the model activity's input
    [pause] = [e for e in rt.events if isinstance(e, ToolEnded)]
    assert pause.duration_s >= 0.04  # the tool sleeps 50 ms
    assert isinstance(rt.events[-1], ProgramEnded) and rt.events[-1].num_turns == 2
    assert [isinstance(e, ToolStarted) for e in rt.events].count(True) == 1
    assert rt.programs[wid].num_turns == 2 and rt.programs[wid].num_tools == 1
    assert rt.programs[wid].status == "completed"

    # The policy's hints: priority per turn, pin and eviction order at the tool start, release at the end.
    emitted = _samples(rt.registry, "hintflow_hints_emitted_total", "kind")
    assert emitted.get("priority") == 2, emitted
    assert emitted.get("pin", 0) >= 1 and emitted.get("eviction_order", 0) >= 1, emitted
    assert emitted.get("release") == 1, emitted
    # ...all reached the node and were acked.  The scripted model ran in the model activity, not on an engine:
    # the session holds no blocks there, but the turn's Priority (naming its program) recorded it, so the
    # session hints after it are acked OK (a pin of no blocks).
    acked = _samples(rt.registry, "hintflow_hints_sent_total", "code")
    # (A pin whose lease lapsed while queued is dropped, not sent: legal, though unlikely on loopback.)
    assert pub.num_sent == sum(acked.values()) > 0, (emitted, acked)
    assert pub.num_sent + pub.num_dropped == sum(emitted.values()), (emitted, acked, pub.num_dropped)
    assert pub.num_failures == 0
    assert set(acked) == {"OK"}, acked
    async with EngineClient(node.address) as c:  # the program's Release freed the record
        st = await c.get_cache_state(include_sessions=True)
    assert not [r for r in st.sessions if r.program_id == wid], st.sessions
