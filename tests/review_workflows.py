"""Workflows for tests/test_runtime_review.py, in their own module: the workflow sandbox re-imports the
module a workflow is defined in, and this one imports nothing but temporalio and workflows._api."""

from __future__ import annotations

import math

from temporalio import workflow
from temporalio.exceptions import ApplicationError

from workflows import llm, tool


@workflow.defn(sandboxed=True)
class RaisesPlain:
    """A bug in workflow code: a plain exception fails the workflow *task*, which Temporal retries."""

    @workflow.run
    async def run(self, x: int) -> str:
        raise ValueError("user bug in workflow code")


@workflow.defn(sandboxed=True)
class RaisesFailure:
    """A workflow failure (an ApplicationError): the program ends, failed."""

    @workflow.run
    async def run(self, x: int) -> str:
        raise ApplicationError("gave up", type="GaveUp", non_retryable=True)


@workflow.defn(sandboxed=True)
class WaitsForever:
    @workflow.run
    async def run(self, x: int) -> str:
        await workflow.wait_condition(lambda: False)
        return "unreachable"


@workflow.defn(sandboxed=True)
class InfiniteTool:
    @workflow.run
    async def run(self, x: int) -> str:
        await tool("bash", duration_s=math.inf)
        return "ok"


@workflow.defn(sandboxed=True)
class PrefixLongerThanPrompt:
    @workflow.run
    async def run(self, x: int) -> str:
        r = await llm("hello", max_new_tokens=2, prefix_key="k", prefix_tokens=50)
        return r.text
