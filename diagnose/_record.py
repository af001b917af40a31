"""Recording a program's turns: the ``Recorder`` (JSONL lines plus OpenTelemetry spans) and the prompt
splitter shared by the client wrapper, the Temporal plugin and the prompt builder.

The recorder is told about turns and tools as they happen and writes each line once its facts are known:
a ``turn`` when the call returns, a ``pause`` when the session's next turn starts (the pause is the whole
time the context sat idle: the tool plus whatever scheduled the next call, as the hint runtime measures
it), a ``warning`` when the prompt builder reports one.  Prompt text is kept only when asked
(``keep_text=True``); otherwise a prompt leaves nothing but hashes and counts.

When ``opentelemetry-api`` is importable, every turn is also a ``chat {model}`` span and every pause an
``execute_tool {tool}`` span on the global tracer provider, with the GenAI attributes of ``_otel``; with
no provider configured those spans cost nothing.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import Mapping, Sequence
from typing import IO, Any

from diagnose._otel import pause_attributes, turn_attributes
from diagnose._records import (
    FORMAT,
    PauseRecord,
    Segment,
    TurnRecord,
    WarningRecord,
    estimate_tokens,
    jsonable,
    scale_segments,
    segment_hash,
)

__all__ = ["Recorder", "prompt_segments", "strip_cache_markers", "token_segments"]

logger = logging.getLogger(__name__)

# Markers that say where to cache, not what the prompt is: left out of the hashes, so moving a breakpoint
# is not mistaken for a changed block.
_CACHE_MARKERS = frozenset({"cache_control", "prompt_cache_breakpoint"})
_SYSTEM_ROLES = frozenset({"system", "developer"})


def strip_cache_markers(obj: Any) -> Any:
    """``obj`` as JSON data without ``cache_control`` / ``prompt_cache_breakpoint`` keys, at any depth."""
    obj = jsonable(obj)
    if isinstance(obj, dict):
        return {k: strip_cache_markers(v) for k, v in obj.items() if k not in _CACHE_MARKERS}
    if isinstance(obj, list):
        return [strip_cache_markers(v) for v in obj]
    return obj


def _segment(block: str, content: Any, role: str = "", items: tuple[str, ...] = ()) -> Segment:
    clean = strip_cache_markers(content)
    return Segment(block, segment_hash(clean), estimate_tokens(clean), role, items)


def prompt_segments(request: Mapping[str, Any]) -> tuple[Segment, ...]:
    """A request's prompt in the order providers read it: tools, system, then each message.

    Reads Anthropic Messages (``tools``, ``system``, ``messages``), OpenAI Chat (``tools``, ``messages``
    whose leading system/developer messages are the system block), OpenAI Responses (``tools``,
    ``instructions``, ``input``), the Agents SDK's model input (``tools``, ``system_instructions``,
    ``input``) and a plain completion (``prompt``).  The tools block is hashed as sent (its order counts,
    as it does for the provider's cache) and keeps each tool's own hash, so a reorder shows as one."""
    out: list[Segment] = []
    tools = request.get("tools")
    if tools:
        tools = list(jsonable(tools))
        items = tuple(segment_hash(strip_cache_markers(t)) for t in tools)
        out.append(_segment("tools", tools, items=items))
    system = request.get("system", request.get("instructions", request.get("system_instructions")))
    if system:
        out.append(_segment("system", system))
    messages = request.get("messages", request.get("input", request.get("prompt")))
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    leading = True
    for m in jsonable(messages) or []:
        role = str(m.get("role", m.get("type", ""))) if isinstance(m, dict) else ""
        if leading and role in _SYSTEM_ROLES:
            out.append(_segment("system", m, role))
            continue
        leading = False
        out.append(_segment("message", m, role))
    return tuple(out)


def token_segments(token_ids: Sequence[int], prefix_tokens: int = 0,
                   boundaries: Sequence[int] = ()) -> tuple[Segment, ...]:
    """A token-id prompt (hintflow's ``llm`` activity) as a fixed prefix, then history segments cut at
    ``boundaries`` (the session's earlier prompt lengths), each hashed with everything before it, as a
    KV cache's block hashes are.  Cut where the previous calls ended, a call that extends the previous
    prompt repeats its segments exactly, and a rewritten history shows as the first changed segment."""
    n = len(token_ids)
    cuts = sorted({c for c in (prefix_tokens, *boundaries) if 0 < c < n} | {n})
    out: list[Segment] = []
    parent, start = "", 0
    for end in cuts:
        block = "prefix" if start == 0 and end == prefix_tokens else "history"
        h = segment_hash(parent + json.dumps(list(token_ids[start:end])))
        out.append(Segment(block, h, end - start))
        parent, start = h, end
    return tuple(out)


def _tracer(provider: Any = None) -> Any:
    if provider is not None:
        return provider.get_tracer("hintflow.diagnose")
    try:
        from opentelemetry import trace
    except ImportError:  # the spans are optional: the JSONL file is the record
        return None
    return trace.get_tracer("hintflow.diagnose")


class Recorder:
    """Writes a run's turns, pauses and warnings to ``path`` (JSONL, appended) and as spans.

    Thread-safe; one recorder serves a whole worker.  ``path=None`` keeps records in memory only
    (``turns``, ``pauses``, ``warnings`` hold everything recorded either way)."""

    def __init__(self, path: str | os.PathLike[str] | None = None, *, keep_text: bool = False,
                 otel: bool = True, clock: Any = time.time, timer: Any = None,
                 tracer_provider: Any = None) -> None:
        """``clock`` dates the calls (seconds since the epoch); ``timer`` measures them (a monotonic
        clock; by default ``time.perf_counter``, or ``clock`` itself when a clock of one's own is given,
        as a simulation does).  Spans go to ``tracer_provider``, else OpenTelemetry's global one."""
        self.path = None if path is None else str(path)
        self.keep_text = keep_text
        self.clock = clock
        self.timer = timer if timer is not None else (time.perf_counter if clock is time.time else clock)
        self.turns: list[TurnRecord] = []
        self.pauses: list[PauseRecord] = []
        self.warnings: list[WarningRecord] = []
        self._tracer = _tracer(tracer_provider) if otel else None
        self._lock = threading.Lock()
        self._next_turn: dict[tuple[str, str], int] = {}
        self._last_end_s: dict[tuple[str, str], tuple[int, float]] = {}  # session -> (turn, end time)
        self._tool: dict[tuple[str, str], str] = {}  # session -> the tool running in its pause
        self._lengths: dict[tuple[str, str], list[int]] = {}  # session -> its earlier prompt lengths
        self._file: IO[str] | None = None
        if self.path is not None:
            self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 (closed by close())
            if os.path.getsize(self.path) == 0:
                self._write({"kind": "run", "format": FORMAT})

    # ---- what the callers report ------------------------------------------------------------------------
    def next_turn(self, program_id: str, session_id: str) -> int:
        """The index the session's next turn will get (0 for its first)."""
        with self._lock:
            return self._next_turn.get((program_id, session_id), 0)

    def prompt_lengths(self, program_id: str, session_id: str) -> list[int]:
        """The session's earlier prompt lengths (for ``token_segments``); the caller appends to it."""
        with self._lock:
            return self._lengths.setdefault((program_id, session_id), [])

    def tool(self, program_id: str, session_id: str, name: str) -> None:
        """A tool (or a person: ``"human"``) now holds the session; its pause is written at the next turn."""
        with self._lock:
            self._tool.setdefault((program_id, session_id), name)

    def turn(self, rec: TurnRecord) -> TurnRecord:
        """Record a finished call.  Its index is assigned here when the caller left it at -1; the pause since
        the session's previous turn is written first.  Segments are scaled to the reported input tokens."""
        key = (rec.program_id, rec.session_id)
        with self._lock:
            if rec.turn < 0:
                rec.turn = self._next_turn.get(key, 0)
            self._next_turn[key] = rec.turn + 1
            rec.segments = scale_segments(rec.segments, rec.input_tokens)
            if not self.keep_text:
                rec.prompt_text = None
            last = self._last_end_s.get(key)
            tool = self._tool.pop(key, "pause")
            if last is not None and rec.start_unix_s is not None:
                pause = PauseRecord(rec.program_id, rec.session_id, last[0], tool,
                                    max(0.0, rec.start_unix_s - last[1]))
                self.pauses.append(pause)
                self._write(pause.to_dict())
                self._span(f"execute_tool {tool}", last[1], rec.start_unix_s, pause_attributes(pause))
            if rec.start_unix_s is not None:
                self._last_end_s[key] = (rec.turn, rec.start_unix_s + (rec.latency_s or 0.0))
            self.turns.append(rec)
            self._write(rec.to_dict())
        end = None if rec.start_unix_s is None else rec.start_unix_s + (rec.latency_s or 0.0)
        self._span(f"chat {rec.model}".strip(), rec.start_unix_s, end, turn_attributes(rec))
        return rec

    def warn(self, program_id: str, session_id: str, turn: int, block: str, message: str) -> None:
        w = WarningRecord(program_id, session_id, turn, block, message)
        with self._lock:
            self.warnings.append(w)
            self._write(w.to_dict())

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None

    def __enter__(self) -> Recorder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- out --------------------------------------------------------------------------------------------
    def _write(self, obj: dict[str, Any]) -> None:
        if self._file is not None:
            self._file.write(json.dumps(obj, separators=(",", ":")) + "\n")
            self._file.flush()  # one line per event: a crashed run leaves every finished turn readable

    def _span(self, name: str, start_s: float | None, end_s: float | None, attrs: dict[str, Any]) -> None:
        if self._tracer is None or start_s is None:
            return
        try:
            from opentelemetry.trace import SpanKind  # (importable: there is a tracer)

            kind = SpanKind.CLIENT if name.startswith("chat") else SpanKind.INTERNAL
            span = self._tracer.start_span(name, kind=kind, start_time=int(start_s * 1e9), attributes=attrs)
            span.end(end_time=int((end_s if end_s is not None else start_s) * 1e9))
        except Exception:  # telemetry must never fail the caller's model call
            logger.debug("could not emit span %s", name, exc_info=True)
            with contextlib.suppress(Exception):
                self._tracer = None
