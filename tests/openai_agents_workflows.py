"""A workflow built with Temporal's OpenAI Agents integration, for tests/test_openai_agents.py.

In its own module because the workflow sandbox re-imports the module a workflow is defined in; this one
imports nothing but temporalio and the ``agents`` SDK (which ``OpenAIAgentsPlugin`` passes through).
"""

from __future__ import annotations

import asyncio
from datetime import timedelta

from temporalio import activity, workflow

with workflow.unsafe.imports_passed_through():
    from agents import Agent, Runner
    from temporalio.openai_agents.workflow import activity_as_tool

TOOL_SLEEP_S = 0.05


@activity.defn
async def lookup_weather(city: str) -> str:
    """The weather in a city (a tool that takes a little while)."""
    await asyncio.sleep(TOOL_SLEEP_S)
    return f"sunny in {city}"


@workflow.defn(sandboxed=True)
class WeatherAgent:
    @workflow.run
    async def run(self, question: str) -> str:
        agent: Agent[None] = Agent(
            name="weather",
            instructions="Answer with the weather; use the tool.",
            tools=[activity_as_tool(lookup_weather, start_to_close_timeout=timedelta(seconds=10))],
        )
        result = await Runner.run(agent, input=question)
        return str(result.final_output)
