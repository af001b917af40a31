"""Workflows and activities for tests/test_workflows.py, in their own module: the workflow sandbox re-imports
the module a workflow is defined in, and this one imports nothing but temporalio and workflows._api."""

from __future__ import annotations

import asyncio
from datetime import timedelta

from temporalio import activity, workflow

from workflows import llm, session, tool


@activity.defn
async def grep_repo(pattern: str) -> str:
    await asyncio.sleep(0.01)
    return f"no match for {pattern}"


@workflow.defn(sandboxed=True)
class UserAgent:
    @workflow.run
    async def run(self, prompt: str) -> str:
        with session("coder"):
            first = await llm(prompt, max_new_tokens=4)
            await workflow.execute_activity(grep_repo, "TODO", start_to_close_timeout=timedelta(seconds=10))
            await tool("search", "FIXME", activity=grep_repo)
            second = await llm(prompt + first.text + "ok", max_new_tokens=4)
        return second.text


@workflow.defn(sandboxed=True)
class RawPrompt:
    @workflow.run
    async def run(self, ids: list[int]) -> list[int]:
        res = await llm(ids, max_new_tokens=2)
        return res.token_ids
