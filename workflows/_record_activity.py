"""The plugin's opt-in recording (``HintflowPlugin(record_to=PATH)``): each activity the worker runs
becomes what ``diagnose`` reads, written by a ``diagnose.Recorder``.

* A model-call activity is a turn.  hintflow's own ``hintflow.llm`` gives a token-id prompt (a fixed
  prefix, then history cut where the session's earlier calls ended) and the engine's numbers: prompt
  and cached tokens (host-tier hits included), TTFT, queue wait, node.  The OpenAI Agents
  integration's ``invoke_model_activity`` gives the request (tools, instructions, input: hashed block by
  block) and the response's usage.
* Any other activity is the tool that holds the session; a ``pause("human")`` wait names its pause too.
  The pause itself is written when the session's next turn starts.

Kept apart from ``_plugin`` so the activity interceptor only gains one call.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from diagnose import Recorder, TurnRecord, jsonable_usage, prompt_segments, token_segments
from workflows._api import PAUSE_STARTED_ACTIVITY, LLMInput, LLMResult, PauseInput

__all__ = ["record_activity", "turn_from_activity"]


def turn_from_activity(program_id: str, session_id: str, arg: Any, result: Any, start_s: float,
                       latency_s: float, earlier_lengths: list[int] | None = None) -> TurnRecord:
    """A turn record from a model activity's input and result (hintflow's, or openai_agents').
    ``earlier_lengths``: the session's earlier prompt lengths, where a token-id prompt is cut (and to
    which this prompt's length is added)."""
    rec = TurnRecord(program_id, session_id, -1, start_unix_s=start_s, latency_s=latency_s)
    if isinstance(arg, LLMInput):
        rec.provider = "hintflow"
        lengths = earlier_lengths if earlier_lengths is not None else []
        rec.segments = token_segments(arg.prompt_token_ids, arg.prefix_tokens, lengths)
        lengths.append(len(arg.prompt_token_ids))
        if isinstance(result, LLMResult):
            rec.input_tokens = result.num_prompt_tokens or len(arg.prompt_token_ids)
            rec.output_tokens = len(result.token_ids)
            rec.cached_tokens = result.num_cached_tokens + result.num_host_hit_tokens
            rec.ttft_s, rec.queue_wait_s, rec.node = result.ttft_s, result.queue_wait_s, result.node
        return rec
    request = arg if isinstance(arg, dict) else {}
    rec.provider = "openai"
    rec.model = str(request.get("model_name") or "")
    rec.segments = prompt_segments(request)
    usage = jsonable_usage(getattr(result, "usage", None), "openai")
    if usage is not None:
        raw, u = usage
        rec.usage = raw
        rec.input_tokens, rec.output_tokens = u.input_tokens, u.output_tokens
        rec.cached_tokens, rec.cache_write_tokens = u.cached_tokens, u.cache_write_tokens
    rec.response_id = str(getattr(result, "response_id", "") or "")
    return rec


async def record_activity(recorder: Recorder, program_id: str, session_id: str, activity_type: str,
                          args: Sequence[Any], tool: str | None, is_model_call: bool,
                          run: Callable[[], Awaitable[Any]]) -> Any:
    """Run the activity (``run``) and record what it was.  A failed model call records nothing: Temporal
    retries it, and its retry is the turn."""
    arg = args[0] if args else None
    if activity_type == PAUSE_STARTED_ACTIVITY and isinstance(arg, PauseInput):
        recorder.tool(program_id, arg.session_id or session_id, arg.name)
        return await run()
    if not is_model_call:
        if tool is not None:
            recorder.tool(program_id, session_id, tool)
        return await run()
    start_s, t0 = time.time(), time.perf_counter()
    result = await run()
    lengths = recorder.prompt_lengths(program_id, session_id)
    recorder.turn(turn_from_activity(program_id, session_id, arg, result, start_s, time.perf_counter() - t0,
                                     lengths))
    return result
