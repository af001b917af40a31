"""What a workflow author calls: ``llm``, ``tool``, ``session`` and ``pause``, plus the activity payloads.

These run inside Temporal's workflow sandbox, so this module imports only ``temporalio.workflow`` and the
standard library (no grpc, torch or engine code).  Each helper starts an activity; the worker-side
interceptor sees that activity start and finish and turns it into program events for the hint policy:

    llm(...)   -> activity "hintflow.llm"   -> TurnStarted / TurnEnded
    tool(...)  -> activity "hintflow.tool"  -> ToolStarted / ToolEnded   (or any activity of yours)
    pause(...) -> local activities around a wait (a human, a timer) -> ToolStarted / ToolEnded

The program is the workflow (``program_id`` = workflow id).  Sessions (one continuing KV context each)
default to the workflow id; a multi-agent workflow names them with ``with session("planner"): ...``,
which also tags any activity started inside it, so tools written by the user need no change.
"""

from __future__ import annotations

import contextvars
import math
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager, suppress
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ApplicationError

__all__ = [
    "DEFAULT_HEARTBEAT_TIMEOUT",
    "DEFAULT_LLM_RETRY",
    "LLM_ACTIVITY",
    "MIN_HEARTBEAT_TIMEOUT",
    "PAUSE_ENDED_ACTIVITY",
    "PAUSE_STARTED_ACTIVITY",
    "PROGRAM_END_ACTIVITY",
    "TOOL_ACTIVITY",
    "LLMInput",
    "LLMResult",
    "PauseInput",
    "ProgramEndInput",
    "ToolInput",
    "ToolResult",
    "current_session",
    "current_tool",
    "decode_text",
    "encode_text",
    "llm",
    "pause",
    "session",
    "tool",
]

LLM_ACTIVITY = "hintflow.llm"
TOOL_ACTIVITY = "hintflow.tool"
PAUSE_STARTED_ACTIVITY = "hintflow.pause_started"
PAUSE_ENDED_ACTIVITY = "hintflow.pause_ended"
PROGRAM_END_ACTIVITY = "hintflow.program_end"

# Header keys the workflow interceptor stamps on every activity it starts.
SESSION_HEADER = "hintflow-session"
TOOL_HEADER = "hintflow-tool"
SUBMITTED_HEADER = "hintflow-submitted-unix-s"

DEFAULT_LLM_RETRY = RetryPolicy(
    initial_interval=timedelta(seconds=0.5),
    backoff_coefficient=2.0,
    maximum_interval=timedelta(seconds=5),
    non_retryable_error_types=["InvalidPrompt"],
)
"""No node reachable is retried (with backoff, until the schedule-to-close timeout); a bad prompt is not."""

DEFAULT_HEARTBEAT_TIMEOUT = timedelta(seconds=10)
"""The heartbeat timeout ``llm()`` and ``tool()`` give their activities.

Why: a worker killed mid-activity reports nothing, so without a heartbeat timeout Temporal retries the
attempt only when its start-to-close timeout runs out (5 minutes for ``llm``, 30 for ``tool``) and the
program stalls that long.  With it, the attempt is retried about this long after the worker's last
heartbeat.  The worker side heartbeats for the activity (``HintflowPlugin``'s activity interceptor does, for
every activity with a heartbeat timeout), so activities need no code for it.  The SDK sends heartbeats at
most every 0.8 of the timeout, so a timeout much under 10 s leaves a loaded worker little slack."""

MIN_HEARTBEAT_TIMEOUT = timedelta(seconds=2)
"""The shortest heartbeat timeout accepted.  The SDK spaces heartbeats 0.8 of the timeout apart, so what is
left for a busy worker's event loop and the network is a fifth of it: 0.4 s here.  Shorter, and a healthy
attempt on a loaded worker would time out, and every such timeout reruns the activity."""


# ---- payloads (one dataclass per activity) -----------------------------------------------------------
@dataclass
class LLMInput:
    session_id: str
    prompt_token_ids: list[int]
    max_new_tokens: int = 16
    prefix_key: str = ""  # a prefix shared across sessions (e.g. a role's fixed system prompt)
    prefix_tokens: int = 0


@dataclass
class LLMResult:
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    node: str = ""
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # resident on the device: prefill skipped
    num_host_hit_tokens: int = 0  # reloaded from the host tier
    num_recomputed_tokens: int = 0  # computed before by this session, lost to eviction
    queue_wait_s: float = 0.0
    ttft_s: float = 0.0
    latency_s: float = 0.0


@dataclass
class ToolInput:
    session_id: str
    name: str
    duration_s: float = 0.0  # simulated run time
    output_tokens: int = 0  # tokens the tool returns (appended to the context by the caller)
    seed: int = 0
    vocab_size: int = 256


@dataclass
class ToolResult:
    name: str
    output_token_ids: list[int] = field(default_factory=list)
    duration_s: float = 0.0


@dataclass
class PauseInput:
    session_id: str
    name: str


@dataclass
class ProgramEndInput:
    program_id: str
    status: str = "completed"  # "completed" | "failed" | "cancelled"


# ---- tokens ------------------------------------------------------------------------------------------
def encode_text(text: str) -> list[int]:
    """Byte-level tokens (ids 0-255): every engine vocabulary of at least 256 ids accepts them."""
    return list(text.encode("utf-8"))


def decode_text(token_ids: Sequence[int]) -> str:
    return bytes(t for t in token_ids if 0 <= t < 256).decode("utf-8", errors="replace")


# ---- session and tool context ------------------------------------------------------------------------
_session: contextvars.ContextVar[str | None] = contextvars.ContextVar("hintflow_session", default=None)
_tool: contextvars.ContextVar[str | None] = contextvars.ContextVar("hintflow_tool", default=None)


def _reset(var: contextvars.ContextVar[str | None], token: contextvars.Token[str | None]) -> None:
    """Undo a ``set``; nothing to undo when the workflow's coroutine is being closed from outside its
    task (the SDK evicting the workflow closes it with GeneratorExit in another context, where the token
    is foreign and ``reset`` would raise ValueError on top of the exit)."""
    with suppress(ValueError):
        var.reset(token)


def current_session() -> str:
    """The session named by the innermost ``session(...)``, else the workflow id (one session per program)."""
    name = _session.get()
    return name if name is not None else workflow.info().workflow_id


def current_tool() -> str | None:
    return _tool.get()


@contextmanager
def session(name: str) -> Iterator[str]:
    """Run the block as session ``name``: a separate KV context, e.g. one agent role of a pipeline.

    The session id is ``<workflow id>/<name>`` so two programs never share one context by accident.
    """
    if not name or "/" in name:
        raise _bad_input(f"session name must be non-empty and contain no '/', got {name!r}")
    sid = f"{workflow.info().workflow_id}/{name}"
    token = _session.set(sid)
    try:
        yield sid
    finally:
        _reset(_session, token)


def _bad_input(message: str, kind: str = "InvalidInput") -> ApplicationError:
    """Bad arguments fail the workflow with a clear error (a plain exception would retry the task forever)."""
    return ApplicationError(message, type=kind, non_retryable=True)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_finite(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _check_heartbeat(caller: str, value: Any) -> timedelta | None:
    """``heartbeat_timeout`` is None (no heartbeat timeout) or a timedelta of at least
    ``MIN_HEARTBEAT_TIMEOUT``; anything else fails the workflow at once, naming the value."""
    if value is None or (isinstance(value, timedelta) and value >= MIN_HEARTBEAT_TIMEOUT):
        return value
    raise _bad_input(
        f"{caller}: heartbeat_timeout must be None or a timedelta of at least "
        f"{MIN_HEARTBEAT_TIMEOUT.total_seconds():g} s, got {value!r}"
    )


# ---- helpers -----------------------------------------------------------------------------------------
async def llm(
    prompt: str | Sequence[int],
    *,
    max_new_tokens: int = 16,
    prefix_key: str = "",
    prefix_tokens: int = 0,
    start_to_close_timeout: timedelta = timedelta(minutes=5),
    schedule_to_close_timeout: timedelta = timedelta(minutes=30),
    retry_policy: RetryPolicy = DEFAULT_LLM_RETRY,
    heartbeat_timeout: timedelta | None = DEFAULT_HEARTBEAT_TIMEOUT,
) -> LLMResult:
    """One model call on the current session with the full prompt (the node reuses what it still holds).

    A string prompt is sent as bytes; pass token ids to control the tokens exactly.  ``heartbeat_timeout``
    (``DEFAULT_HEARTBEAT_TIMEOUT``; None: none) is how soon a call whose worker died is retried elsewhere.
    """
    try:
        ids = encode_text(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
    except (TypeError, ValueError) as exc:
        raise _bad_input(f"llm() needs a string or token ids as its prompt: {exc}", "InvalidPrompt") from None
    if not ids:
        raise _bad_input("llm() needs a non-empty prompt", "InvalidPrompt")
    if not (_is_int(max_new_tokens) and max_new_tokens >= 1):
        raise _bad_input(f"llm(): max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    if not (_is_int(prefix_tokens) and 0 <= prefix_tokens <= len(ids)):
        raise _bad_input(
            f"llm(): prefix_tokens must be an integer in [0, {len(ids)}] (the prompt's length), "
            f"got {prefix_tokens!r}"
        )
    if prefix_tokens and not prefix_key:
        raise _bad_input(f"llm(): prefix_tokens={prefix_tokens} needs a prefix_key naming the shared prefix")
    heartbeat = _check_heartbeat("llm()", heartbeat_timeout)
    inp = LLMInput(current_session(), ids, max_new_tokens, prefix_key, prefix_tokens)
    return await workflow.execute_activity(
        LLM_ACTIVITY,
        inp,
        result_type=LLMResult,
        start_to_close_timeout=start_to_close_timeout,
        schedule_to_close_timeout=schedule_to_close_timeout,
        retry_policy=retry_policy,
        heartbeat_timeout=heartbeat,
    )


async def tool(
    name: str,
    *args: Any,
    activity: str | Callable[..., Any] | None = None,
    duration_s: float = 0.0,
    output_tokens: int = 0,
    seed: int | None = None,
    vocab_size: int = 256,
    start_to_close_timeout: timedelta = timedelta(minutes=30),
    heartbeat_timeout: timedelta | None = DEFAULT_HEARTBEAT_TIMEOUT,
    **activity_options: Any,
) -> Any:
    """Run tool ``name`` on the current session.

    With ``activity``, that activity (yours) runs with ``args`` and is tagged as tool ``name``.  Without it,
    the built-in simulated tool sleeps ``duration_s`` and returns ``output_tokens`` pseudo-random tokens
    (deterministic from ``seed``), which is what the example agents use.

    ``heartbeat_timeout`` (``DEFAULT_HEARTBEAT_TIMEOUT``; None: none) is how soon a tool whose worker died
    is retried elsewhere; a worker with ``HintflowPlugin`` heartbeats for the activity.  Your activity sent
    to another task queue (``task_queue=...``) gets no default: that queue's workers may lack the plugin,
    and then nothing would heartbeat and every attempt would time out.  Pass a timedelta to set one there.
    """
    if not name:
        raise _bad_input("tool() needs a name")
    heartbeat = _check_heartbeat(f"tool {name!r}", heartbeat_timeout)
    token = _tool.set(name)
    try:
        if activity is not None:
            queue = activity_options.get("task_queue")
            elsewhere = queue is not None and queue != workflow.info().task_queue
            # An identity test on purpose: only the untouched default is withheld from another queue.
            if elsewhere and heartbeat_timeout is DEFAULT_HEARTBEAT_TIMEOUT:
                heartbeat = None
            return await workflow.execute_activity(
                activity,  # type: ignore[call-overload]
                args=list(args),
                start_to_close_timeout=start_to_close_timeout,
                heartbeat_timeout=heartbeat,
                **activity_options,
            )
        if not (_is_finite(duration_s) and duration_s >= 0.0):
            raise _bad_input(f"tool {name!r}: duration_s must be a finite number >= 0, got {duration_s!r}")
        if not (_is_int(output_tokens) and output_tokens >= 0):
            raise _bad_input(f"tool {name!r}: output_tokens must be an integer >= 0, got {output_tokens!r}")
        if not (_is_int(vocab_size) and vocab_size >= 1):
            raise _bad_input(f"tool {name!r}: vocab_size must be an integer >= 1, got {vocab_size!r}")
        try:
            timeout = max(start_to_close_timeout, timedelta(seconds=duration_s + 60))
        except OverflowError:
            raise _bad_input(f"tool {name!r}: duration_s={duration_s!r} is too long") from None
        s = seed if seed is not None else workflow.random().randrange(2**31)
        inp = ToolInput(current_session(), name, duration_s, output_tokens, s, vocab_size)
        return await workflow.execute_activity(
            TOOL_ACTIVITY,
            inp,
            result_type=ToolResult,
            start_to_close_timeout=timeout,
            heartbeat_timeout=heartbeat,
            **activity_options,
        )
    finally:
        _reset(_tool, token)


@asynccontextmanager
async def pause(name: str = "human") -> AsyncIterator[None]:
    """Mark a wait that is not an activity (a person, a timer, a signal) as a pause of tool ``name``.

    ``async with pause("human"): await workflow.wait_condition(lambda: approved)`` tells the runtime the
    session is idle for a ``human``-shaped pause, so it can price pinning it like any tool.
    """
    inp = PauseInput(current_session(), name)
    opts: dict[str, Any] = {"start_to_close_timeout": timedelta(seconds=10)}
    await workflow.execute_local_activity(PAUSE_STARTED_ACTIVITY, inp, **opts)
    try:
        yield
    finally:
        await workflow.execute_local_activity(PAUSE_ENDED_ACTIVITY, inp, **opts)
