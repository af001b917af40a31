"""``HintflowPlugin``: the one thing a team adds to its Temporal worker (and client) to get KV-aware serving.

    plugin = HintflowPlugin(engines=["10.0.0.5:50051"], policy="hintflow")
    client = await Client.connect("localhost:7233", plugins=[plugin])
    worker = Worker(client, task_queue="agents", workflows=[MyAgent])   # plugin applied via the client

What it bundles:

* activities ``hintflow.llm`` (route, then ``Generate`` on a node), ``hintflow.tool`` (a simulated tool),
  ``hintflow.pause_started/ended`` and ``hintflow.program_end`` (local, bookkeeping only);
* an activity interceptor that turns every activity into program events: model-call activities (ours, and
  ``temporalio.contrib.openai_agents``' ``invoke_model_activity``) are turns, every other activity is a tool
  pause (named by the ``tool(...)`` header, else by its activity type); and that heartbeats for every
  activity started with a heartbeat timeout (``llm`` and ``tool`` give one by default), so a worker that
  dies mid-activity has it retried elsewhere within that timeout, not after its start-to-close timeout;
* the workflow interceptor (``_workflow_interceptor``) that tags activities with session and tool and
  reports program end, and a client interceptor that stamps when a program was submitted;
* a sandbox passthrough for the ``workflows`` package (so the session context set by workflow code is the
  one the interceptor reads) and a ``run_context`` that starts and stops the ``HintRuntime`` with the worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import random
import time
from collections.abc import AsyncIterator, Iterable, Sequence
from typing import Any

from temporalio import activity, client, worker
from temporalio.exceptions import ApplicationError, ApplicationErrorCategory
from temporalio.plugin import SimplePlugin
from temporalio.worker import (
    ActivityInboundInterceptor,
    ActivityOutboundInterceptor,
    ExecuteActivityInput,
    WorkflowInboundInterceptor,
    WorkflowInterceptorClassInput,
)
from temporalio.worker.workflow_sandbox import SandboxedWorkflowRunner

from diagnose import Recorder
from workflows._api import (
    LLM_ACTIVITY,
    PAUSE_ENDED_ACTIVITY,
    PAUSE_STARTED_ACTIVITY,
    PROGRAM_END_ACTIVITY,
    SESSION_HEADER,
    SUBMITTED_HEADER,
    TOOL_ACTIVITY,
    TOOL_HEADER,
    LLMInput,
    LLMResult,
    PauseInput,
    ProgramEndInput,
    ToolInput,
    ToolResult,
)
from workflows._record_activity import record_activity
from workflows._runtime import EngineUnavailable, HintRuntime, InvalidPrompt
from workflows._workflow_interceptor import HintflowWorkflowInbound, header_text, text_header

__all__ = ["DEFAULT_MODEL_ACTIVITIES", "HintflowActivities", "HintflowInterceptor", "HintflowPlugin"]

DEFAULT_MODEL_ACTIVITIES = frozenset(
    {LLM_ACTIVITY, "invoke_model_activity", "invoke_model_activity_streaming"}
)
"""Activity types that are model calls (turns); ``invoke_model_activity*`` are openai_agents' own."""

_BOOKKEEPING = frozenset({PAUSE_STARTED_ACTIVITY, PAUSE_ENDED_ACTIVITY, PROGRAM_END_ACTIVITY})

HEARTBEAT_FRACTION = 1 / 3
"""The interceptor heartbeats every third of an activity's heartbeat timeout.  The SDK forwards at most one
heartbeat per 0.8 of the timeout to the server (and the first at once), so a tick well inside that window
means each forwarded heartbeat is a fresh one even when the worker's event loop runs late."""


class HintflowActivities:
    """The activities the plugin registers; bound to one runtime."""

    def __init__(self, runtime: HintRuntime) -> None:
        self.runtime = runtime
        self._pause_start_s: dict[tuple[str, str], float] = {}

    @activity.defn(name=LLM_ACTIVITY)
    async def llm(self, inp: LLMInput) -> LLMResult:
        program_id = activity.info().workflow_id or inp.session_id
        try:
            return await self.runtime.generate(program_id, inp)
        except EngineUnavailable as exc:
            # An outage is retried with backoff and logged by the runtime once per node state change;
            # BENIGN keeps the SDK from logging a warning with a traceback at every attempt.
            benign = ApplicationErrorCategory.BENIGN
            category = benign if exc.unreachable else ApplicationErrorCategory.UNSPECIFIED
            raise ApplicationError(str(exc), type="EngineUnavailable", category=category) from None
        except InvalidPrompt as exc:
            raise ApplicationError(str(exc), type="InvalidPrompt", non_retryable=True) from None

    @activity.defn(name=TOOL_ACTIVITY)
    async def tool(self, inp: ToolInput) -> ToolResult:
        """A simulated tool: sleeps its sampled duration, returns deterministic pseudo-random tokens."""
        if not inp.duration_s >= 0.0 or inp.output_tokens < 0 or inp.vocab_size < 1:
            raise ApplicationError(f"bad tool input {inp!r}", type="InvalidToolInput", non_retryable=True)
        t0 = time.monotonic()
        await asyncio.sleep(inp.duration_s)
        rng = random.Random(inp.seed)
        out = [rng.randrange(inp.vocab_size) for _ in range(inp.output_tokens)]
        return ToolResult(inp.name, out, time.monotonic() - t0)

    @activity.defn(name=PAUSE_STARTED_ACTIVITY)
    async def pause_started(self, inp: PauseInput) -> None:
        info = activity.info()
        self._pause_start_s[(inp.session_id, inp.name)] = time.monotonic()
        self.runtime.tool_started(
            info.workflow_id or "", inp.session_id, inp.name, info.workflow_type or "", activity=False
        )

    @activity.defn(name=PAUSE_ENDED_ACTIVITY)
    async def pause_ended(self, inp: PauseInput) -> None:
        program_id = activity.info().workflow_id or ""
        start = self._pause_start_s.pop((inp.session_id, inp.name), None)
        duration = time.monotonic() - start if start is not None else 0.0
        self.runtime.tool_ended(program_id, inp.session_id, inp.name, duration, activity=False)

    @activity.defn(name=PROGRAM_END_ACTIVITY)
    async def program_end(self, inp: ProgramEndInput) -> None:
        self.runtime.program_ended(inp.program_id, inp.status)

    def all(self) -> list[Any]:
        return [self.llm, self.tool, self.pause_started, self.pause_ended, self.program_end]


class _BookkeepingOnly:
    """Recording without a runtime: the workflow helpers' bookkeeping activities still need a worker to run
    on (``pause(...)`` and the program-end notice), and do nothing else."""

    @activity.defn(name=PAUSE_STARTED_ACTIVITY)
    async def pause_started(self, inp: PauseInput) -> None:
        return None

    @activity.defn(name=PAUSE_ENDED_ACTIVITY)
    async def pause_ended(self, inp: PauseInput) -> None:
        return None

    @activity.defn(name=PROGRAM_END_ACTIVITY)
    async def program_end(self, inp: ProgramEndInput) -> None:
        return None

    def all(self) -> list[Any]:
        return [self.pause_started, self.pause_ended, self.program_end]


class _HeartbeatDetails(ActivityOutboundInterceptor):
    """Passes the activity's own heartbeats on and keeps their details: the interceptor's heartbeats repeat
    them, so the details a retried attempt reads (``activity.info().heartbeat_details``) stay the ones the
    activity last gave, not an empty heartbeat of ours."""

    def __init__(self, next: ActivityOutboundInterceptor) -> None:
        super().__init__(next)
        self.details: tuple[Any, ...] = ()

    def heartbeat(self, *details: Any) -> None:
        self.details = details
        self.next.heartbeat(*details)


class _ActivityInbound(ActivityInboundInterceptor):
    """One per activity attempt (the SDK builds the chain for each): program events, recording, heartbeats."""

    def __init__(self, next: ActivityInboundInterceptor, owner: HintflowInterceptor) -> None:
        super().__init__(next)
        self._owner = owner
        self._heartbeats: _HeartbeatDetails | None = None

    def init(self, outbound: ActivityOutboundInterceptor) -> None:
        self._heartbeats = _HeartbeatDetails(outbound)
        super().init(self._heartbeats)

    async def execute_activity(self, input: ExecuteActivityInput) -> Any:
        info = activity.info()
        timeout = info.heartbeat_timeout
        if timeout is None or info.is_local or self._heartbeats is None:
            return await self._execute(input)
        # The last attempt's details until the activity heartbeats itself: an empty heartbeat would erase
        # what a third attempt resumes from.
        self._heartbeats.details = tuple(info.heartbeat_details)
        beat = asyncio.create_task(
            self._heartbeat(self._heartbeats, timeout.total_seconds() * HEARTBEAT_FRACTION),
            name=f"hintflow-heartbeat {info.activity_type} {info.activity_id}",
        )
        try:
            return await self._execute(input)
        finally:
            beat.cancel()
            # wait, not await: a cancellation of this activity while waiting must go on, not be swallowed
            await asyncio.wait([beat])

    @staticmethod
    async def _heartbeat(out: _HeartbeatDetails, period_s: float) -> None:
        """Heartbeat (through the outbound chain, on this event loop: the activity itself may be a sync
        function on an executor thread) until cancelled when the activity ends."""
        while True:
            out.next.heartbeat(*out.details)
            await asyncio.sleep(period_s)

    async def _execute(self, input: ExecuteActivityInput) -> Any:
        info = activity.info()
        recorder = self._owner.recorder
        if recorder is None or not info.workflow_id:
            return await self._observe(input)
        session_id = header_text(input.headers, SESSION_HEADER) or info.workflow_id
        kind = info.activity_type
        tool = None if kind in _BOOKKEEPING else header_text(input.headers, TOOL_HEADER) or kind
        is_model_call = kind in self._owner.model_activities
        return await record_activity(recorder, info.workflow_id, session_id, kind, input.args, tool,
                                     is_model_call, lambda: self._observe(input))

    async def _observe(self, input: ExecuteActivityInput) -> Any:
        """Program events for the hint runtime (when there is one), around the activity."""
        info = activity.info()
        rt = self._owner.runtime
        if rt is None or info.activity_type in _BOOKKEEPING or not info.workflow_id:
            return await self.next.execute_activity(input)
        program_id = info.workflow_id
        session_id = header_text(input.headers, SESSION_HEADER) or program_id
        submitted = header_text(input.headers, SUBMITTED_HEADER)
        if submitted is not None:
            with contextlib.suppress(ValueError):
                rt.program_submitted(program_id, float(submitted))
        if info.activity_type in self._owner.model_activities:
            arg = input.args[0] if input.args else None
            # Someone else's model call (openai_agents): estimate tokens from the size of its input.
            ctx = len(arg.prompt_token_ids) if isinstance(arg, LLMInput) else len(repr(arg)) // 4
            call = f"{info.workflow_run_id}/{info.activity_id}"  # the same for each retry of this call
            # hintflow's own model call routes in ``generate``: the turn's hints go to the node it picks.
            routed = info.activity_type == LLM_ACTIVITY and isinstance(arg, LLMInput)
            rt.turn_started(program_id, session_id, ctx, info.workflow_type or "", call, routed=routed)
            try:
                result = await self.next.execute_activity(input)
            except BaseException:
                # A failed attempt is not a turn (Temporal may retry it): no TurnEnded, no turn-end pin.
                rt.turn_failed(program_id, session_id, call)
                raise
            out_ctx: int | None = None
            if isinstance(result, LLMResult):
                out_ctx = result.num_prompt_tokens + len(result.token_ids)
            rt.turn_ended(program_id, session_id, out_ctx)
            return result
        tool = header_text(input.headers, TOOL_HEADER) or info.activity_type
        t0 = time.monotonic()
        rt.tool_started(program_id, session_id, tool, info.workflow_type or "")
        try:
            return await self.next.execute_activity(input)
        finally:
            rt.tool_ended(program_id, session_id, tool, time.monotonic() - t0)


class _ClientOutbound(client.OutboundInterceptor):
    async def start_workflow(self, input: client.StartWorkflowInput) -> client.WorkflowHandle[Any, Any]:
        headers = dict(input.headers)
        headers.setdefault(SUBMITTED_HEADER, text_header(repr(time.time())))
        input.headers = headers
        return await super().start_workflow(input)


class HintflowInterceptor(client.Interceptor, worker.Interceptor):
    """Worker side: activity events to the runtime; workflow side: headers and program end; client: submit time."""

    def __init__(
        self, runtime: HintRuntime | None, model_activities: Iterable[str] = DEFAULT_MODEL_ACTIVITIES,
        recorder: Recorder | None = None,
    ):
        self.runtime = runtime
        self.model_activities = frozenset(model_activities)
        self.recorder = recorder  # opt-in: every turn and pause to a diagnose.Recorder

    def intercept_client(self, next: client.OutboundInterceptor) -> client.OutboundInterceptor:
        return _ClientOutbound(next)

    def intercept_activity(self, next: ActivityInboundInterceptor) -> ActivityInboundInterceptor:
        return _ActivityInbound(next, self)

    def workflow_interceptor_class(
        self, input: WorkflowInterceptorClassInput
    ) -> type[WorkflowInboundInterceptor] | None:
        return HintflowWorkflowInbound


def _passthrough(runner: worker.WorkflowRunner | None) -> worker.WorkflowRunner:
    runner = runner if runner is not None else SandboxedWorkflowRunner()
    if isinstance(runner, SandboxedWorkflowRunner):
        restrictions = runner.restrictions.with_passthrough_modules("workflows")
        return dataclasses.replace(runner, restrictions=restrictions)
    return runner


class HintflowPlugin(SimplePlugin):
    """Add to ``Client.connect(plugins=[...])`` (client and workers) or to one ``Worker(plugins=[...])``.

    ``engines`` (host:port of engine nodes) builds a ``HintRuntime`` started and stopped with each worker;
    pass ``runtime`` to share one you manage.  Without either, the plugin still tags and observes (client
    side only, e.g. a process that just starts workflows).

    ``record_to`` (a path, or a ``diagnose.Recorder``) records every turn and pause of every program this
    worker runs, for ``hintflow diagnose`` and ``hintflow price``; it needs no engine (a workflow that
    calls a hosted model through the OpenAI Agents integration is recorded too).  Prompt text is kept only
    with ``record_text=True``.
    """

    def __init__(
        self,
        engines: Sequence[str] = (),
        policy: str = "hintflow",
        *,
        runtime: HintRuntime | None = None,
        model_activities: Iterable[str] = DEFAULT_MODEL_ACTIVITIES,
        record_to: str | os.PathLike[str] | Recorder | None = None,
        record_text: bool = False,
        **runtime_kw: Any,
    ) -> None:
        if runtime is None and engines:
            runtime = HintRuntime(engines, policy, **runtime_kw)
        self.runtime = runtime
        self.recorder = (record_to if isinstance(record_to, Recorder) or record_to is None
                         else Recorder(record_to, keep_text=record_text))
        interceptor = HintflowInterceptor(runtime, model_activities, self.recorder)
        activities = HintflowActivities(runtime).all() if runtime is not None else (
            _BookkeepingOnly().all() if self.recorder is not None else [])
        super().__init__(
            "hintflow.HintflowPlugin",
            interceptors=[interceptor],
            activities=lambda existing: [*(existing or []), *activities],
            workflow_runner=_passthrough,
            run_context=self._run_context if runtime is not None else None,
        )

    def configure_worker(self, config: Any) -> Any:
        """Also hand the runtime this worker's client: a reaped program is released only once Temporal
        says its workflow closed (``HintRuntime.reap``)."""
        if self.runtime is not None and self.runtime.temporal_client is None:
            self.runtime.temporal_client = config.get("client")
        return super().configure_worker(config)

    @contextlib.asynccontextmanager
    async def _run_context(self) -> AsyncIterator[None]:
        assert self.runtime is not None
        started_here = not self.runtime._started
        await self.runtime.start()
        try:
            yield
        finally:
            if started_here:
                await self.runtime.stop()
