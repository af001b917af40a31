"""A recording wrapper around an OpenAI- or Anthropic-shaped client, duck-typed (no SDK import).

    client = record_client(anthropic.Anthropic(), recorder, session_id="fix-1")
    client.messages.create(model=..., system=..., tools=..., messages=...)   # recorded, then returned

Wrapped endpoints: ``messages.create`` (Anthropic), ``chat.completions.create``, ``responses.create`` and
``completions.create`` (OpenAI, and OpenAI-compatible servers such as vLLM: pass ``provider="vllm"``).
Everything else passes through untouched.  Sync and async clients both work (an awaitable result is
awaited inside the wrapper), and so do streams: the first chunk gives the time to first token and the
usage in the stream (OpenAI's ``stream_options={"include_usage": True}``, Anthropic's message events) is
recorded when the stream is exhausted.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

from diagnose._record import Recorder, prompt_segments
from diagnose._records import TurnRecord, jsonable
from diagnose._usage import Usage, jsonable_usage

__all__ = ["called_tool", "record_client"]

_ENDPOINTS = {
    ("messages", "create"): "anthropic",
    ("chat", "completions", "create"): "openai",
    ("responses", "create"): "openai",
    ("completions", "create"): "openai",
}
_PREFIXES = {path[:i] for path in _ENDPOINTS for i in range(1, len(path))}


def record_client(client: Any, recorder: Recorder, *, session_id: str, program_id: str | None = None,
                  provider: str | None = None) -> Any:
    """``client`` with its model-call endpoints recorded as turns of ``session_id`` (of ``program_id``,
    default the session).  ``provider`` overrides the one told from the endpoint (``"vllm"``, ...)."""
    return _Proxy(client, (), _Context(recorder, program_id or session_id, session_id, provider))


class _Context:
    def __init__(self, recorder: Recorder, program_id: str, session_id: str, provider: str | None) -> None:
        self.recorder = recorder
        self.program_id = program_id
        self.session_id = session_id
        self.provider = provider


def called_tool(response: Any) -> str:
    """The first tool a response asks for: Anthropic ``tool_use`` blocks, OpenAI Chat ``tool_calls``,
    Responses ``function_call`` items; "" when it asks for none."""
    data = jsonable(response)
    if not isinstance(data, dict):
        return ""
    for block in data.get("content") or []:  # Anthropic
        if isinstance(block, dict) and block.get("type") == "tool_use":
            return str(block.get("name", ""))
    for choice in data.get("choices") or []:  # Chat Completions
        message = choice.get("message") if isinstance(choice, dict) else None
        for call in (message or {}).get("tool_calls") or []:
            fn = call.get("function") if isinstance(call, dict) else None
            if isinstance(fn, dict) and fn.get("name"):
                return str(fn["name"])
    for item in data.get("output") or []:  # Responses
        if isinstance(item, dict) and item.get("type") == "function_call":
            return str(item.get("name", ""))
    return ""


class _Proxy:
    """Follows attribute access down to a known endpoint; anything else is the client's own attribute."""

    def __init__(self, target: Any, path: tuple[str, ...], ctx: _Context) -> None:
        self._target, self._path, self._ctx = target, path, ctx

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._target, name)
        path = (*self._path, name)
        if path in _ENDPOINTS:
            return _Endpoint(value, _ENDPOINTS[path], self._ctx)
        if path in _PREFIXES:
            return _Proxy(value, path, self._ctx)
        return value


class _Endpoint:
    def __init__(self, create: Any, provider: str, ctx: _Context) -> None:
        self._create, self._provider, self._ctx = create, ctx.provider or provider, ctx

    def __call__(self, **kwargs: Any) -> Any:
        start_s = self._ctx.recorder.clock()
        t0 = self._ctx.recorder.timer()
        result = self._create(**kwargs)
        if inspect.isawaitable(result):
            return self._finish_async(result, kwargs, start_s, t0)
        return self._finish(result, kwargs, start_s, t0)

    async def _finish_async(self, awaitable: Any, kwargs: dict[str, Any], start_s: float, t0: float) -> Any:
        return self._finish(await awaitable, kwargs, start_s, t0)

    def _finish(self, result: Any, kwargs: dict[str, Any], start_s: float, t0: float) -> Any:
        if kwargs.get("stream") and (hasattr(result, "__iter__") or hasattr(result, "__aiter__")):
            return _Stream(result, self, kwargs, start_s, t0)
        self._record(kwargs, getattr(result, "usage", None), getattr(result, "id", ""), start_s,
                     self._ctx.recorder.timer() - t0, None)
        tool = called_tool(result)
        if tool:  # the pause that follows is this tool's (the harness may still name it otherwise)
            self._ctx.recorder.tool(self._ctx.program_id, self._ctx.session_id, tool)
        return result

    def _record(self, kwargs: Mapping[str, Any], usage: Any, response_id: Any, start_s: float,
                latency_s: float, ttft_s: float | None) -> None:
        ctx = self._ctx
        raw, u = jsonable_usage(usage, self._provider) or ({}, Usage(self._provider, None, None, None, None))
        ctx.recorder.turn(TurnRecord(
            program_id=ctx.program_id, session_id=ctx.session_id, turn=-1, start_unix_s=start_s,
            latency_s=latency_s, provider=self._provider, model=str(kwargs.get("model", "")),
            segments=prompt_segments(kwargs), input_tokens=u.input_tokens, output_tokens=u.output_tokens,
            cached_tokens=u.cached_tokens, cache_write_tokens=u.cache_write_tokens,
            usage=raw, ttft_s=ttft_s,
            response_id=response_id if isinstance(response_id, str) else "",
            prompt_text=jsonable(kwargs) if ctx.recorder.keep_text else None,
        ))


class _Stream:
    """Passes a stream's chunks through; notes the first chunk's time and the usage the stream carries."""

    def __init__(self, stream: Any, endpoint: _Endpoint, kwargs: dict[str, Any], start_s: float, t0: float) -> None:
        self._stream, self._endpoint, self._kwargs = stream, endpoint, kwargs
        self._start_s, self._t0 = start_s, t0
        self._ttft_s: float | None = None
        self._usage: dict[str, Any] = {}
        self._id = ""
        self._done = False

    def _see(self, chunk: Any) -> None:
        if self._ttft_s is None:
            self._ttft_s = self._endpoint._ctx.recorder.timer() - self._t0
        data = jsonable(chunk)
        if not isinstance(data, dict):
            return
        message = data.get("message") if isinstance(data.get("message"), dict) else None
        for usage in ((message or {}).get("usage"), data.get("usage")):  # Anthropic's start/delta, OpenAI's last
            if isinstance(usage, dict):
                self._usage.update({k: v for k, v in usage.items() if v is not None})
        self._id = self._id or str((message or data).get("id") or "")

    def _end(self) -> None:
        if not self._done:
            self._done = True
            self._endpoint._record(self._kwargs, self._usage or None, self._id, self._start_s,
                                   self._endpoint._ctx.recorder.timer() - self._t0, self._ttft_s)

    def __iter__(self) -> Any:
        for chunk in self._stream:
            self._see(chunk)
            yield chunk
        self._end()

    async def __aiter__(self) -> Any:
        async for chunk in self._stream:
            self._see(chunk)
            yield chunk
        self._end()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)
