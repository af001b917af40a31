"""Workflow-side interceptors: tag every activity with its session and tool, and end the program.

Runs inside the workflow sandbox (imports only temporalio and the standard library):

* every activity or local activity the workflow starts gets headers ``hintflow-session`` (the current
  ``session(...)``, else the workflow id), ``hintflow-tool`` (inside ``tool(...)``) and
  ``hintflow-submitted-unix-s`` (when the client submitted the program, for program-level FCFS), so the
  worker-side interceptor knows what each activity is without reading its arguments;
* when the workflow finishes (completed, failed or cancelled, not continued-as-new), a local activity
  ``hintflow.program_end`` tells the runtime, which sends ``Release`` for the program.  A plain exception
  (not a ``FailureError``, nor a type the workflow or worker declared a workflow failure) fails only the
  workflow *task*, which Temporal retries with the program still running: it is re-raised untouched and
  ends nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

from temporalio import workflow
from temporalio.api.common.v1 import Payload
from temporalio.exceptions import FailureError, is_cancelled_exception
from temporalio.worker import (
    ExecuteWorkflowInput,
    StartActivityInput,
    StartLocalActivityInput,
    WorkflowInboundInterceptor,
    WorkflowOutboundInterceptor,
)

from workflows._api import (
    PROGRAM_END_ACTIVITY,
    SESSION_HEADER,
    SUBMITTED_HEADER,
    TOOL_HEADER,
    ProgramEndInput,
    current_session,
    current_tool,
)

__all__ = ["HintflowWorkflowInbound", "header_text", "text_header"]


def text_header(value: str) -> Payload:
    """Headers are raw UTF-8 so they read the same whatever data converter the user configured."""
    return Payload(metadata={"encoding": b"binary/plain"}, data=value.encode("utf-8"))


def header_text(headers: Mapping[str, Payload], key: str) -> str | None:
    p = headers.get(key)
    return p.data.decode("utf-8", errors="replace") if p is not None else None


def _end_status(exc: BaseException) -> str:
    """How ``exc`` leaving the workflow function ends the program: "cancelled", "failed", or "" when it
    fails only the workflow task (Temporal retries the task; the program is still running)."""
    if is_cancelled_exception(exc):
        return "cancelled"
    if isinstance(exc, FailureError):
        return "failed"
    # asyncio.TimeoutError and the failure_exception_types of the workflow or worker also fail the
    # workflow; the SDK's own check knows them (where this SDK version has it).
    is_failure = getattr(workflow, "is_failure_exception", None)
    if is_failure is not None:
        with contextlib.suppress(Exception):
            if is_failure(exc):
                return "failed"
    return ""


class HintflowWorkflowInbound(WorkflowInboundInterceptor):
    submitted: str | None = None

    def init(self, outbound: WorkflowOutboundInterceptor) -> None:
        super().init(_Outbound(outbound, self))

    async def execute_workflow(self, input: ExecuteWorkflowInput) -> Any:
        self.submitted = header_text(input.headers, SUBMITTED_HEADER)
        status = "completed"
        try:
            return await self.next.execute_workflow(input)
        except workflow.ContinueAsNewError:
            status = ""  # the program goes on in the next run
            raise
        except BaseException as exc:
            status = _end_status(exc)  # "" for a task failure: Temporal retries it, the program goes on
            raise
        finally:
            if status:
                await self._program_end(status)

    async def _program_end(self, status: str) -> None:
        inp = ProgramEndInput(workflow.info().workflow_id, status)
        try:
            # Shielded so a cancelled program still releases its contexts; leases expire anyway if not.
            await asyncio.shield(
                workflow.execute_local_activity(
                    PROGRAM_END_ACTIVITY, inp, start_to_close_timeout=timedelta(seconds=10)
                )
            )
        except Exception:
            workflow.logger.warning("hintflow: program-end notice failed; engine pins expire on their own")


class _Outbound(WorkflowOutboundInterceptor):
    def __init__(self, next: WorkflowOutboundInterceptor, inbound: HintflowWorkflowInbound) -> None:
        super().__init__(next)
        self._inbound = inbound

    def _headers(self, headers: Mapping[str, Payload]) -> dict[str, Payload]:
        out = dict(headers)
        out.setdefault(SESSION_HEADER, text_header(current_session()))
        tool = current_tool()
        if tool is not None:
            out.setdefault(TOOL_HEADER, text_header(tool))
        submitted = self._inbound.submitted
        if submitted is None:
            submitted = repr(workflow.info().start_time.timestamp())
        out.setdefault(SUBMITTED_HEADER, text_header(submitted))
        return out

    def start_activity(self, input: StartActivityInput) -> workflow.ActivityHandle[Any]:
        input.headers = self._headers(input.headers)
        return super().start_activity(input)

    def start_local_activity(self, input: StartLocalActivityInput) -> workflow.ActivityHandle[Any]:
        input.headers = self._headers(input.headers)
        return super().start_local_activity(input)
