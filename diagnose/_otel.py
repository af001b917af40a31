"""OpenTelemetry's GenAI semantic conventions: a recorded turn as span attributes, and exported spans back.

The same run shows up in any OpenTelemetry backend (Grafana, Honeycomb, Datadog, ...) under the names
those backends already chart: one ``chat {model}`` span per model call with ``gen_ai.*`` attributes, and
one ``execute_tool {tool}`` span per pause.  What the conventions have no name for (the prompt's segment
hashes, the program, the engine's queue wait and node) goes under ``hintflow.*``.

Names as of the conventions checked 2026-12-02 (opentelemetry.io/docs/specs/semconv/gen-ai/, now
maintained in open-telemetry/semantic-conventions-genai): the cache counts are
``gen_ai.usage.cache_read.input_tokens`` and ``gen_ai.usage.cache_creation.input_tokens``;
``gen_ai.usage.input_tokens`` includes them.  Older instrumentations wrote
``gen_ai.usage.cache_read_input_tokens`` / ``..._creation_input_tokens``, ``gen_ai.system`` for the
provider and ``gen_ai.usage.prompt_tokens``; the reader takes those too.
"""

from __future__ import annotations

import datetime as dt
from collections import defaultdict
from collections.abc import Iterable, Mapping
from typing import Any

from diagnose._records import PauseRecord, Segment, TurnRecord

__all__ = ["ATTR", "pause_attributes", "spans_to_records", "turn_attributes"]

ATTR = {
    "operation": "gen_ai.operation.name",
    "provider": "gen_ai.provider.name",
    "system": "gen_ai.system",  # the provider's older name; written too, for backends not yet moved
    "model": "gen_ai.request.model",
    "response_id": "gen_ai.response.id",
    "conversation": "gen_ai.conversation.id",
    "input_tokens": "gen_ai.usage.input_tokens",
    "output_tokens": "gen_ai.usage.output_tokens",
    "cache_read": "gen_ai.usage.cache_read.input_tokens",
    "cache_creation": "gen_ai.usage.cache_creation.input_tokens",
    "tool_name": "gen_ai.tool.name",
    "program": "hintflow.program_id",
    "turn": "hintflow.turn",
    "segment_blocks": "hintflow.prompt.segment_blocks",
    "segment_hashes": "hintflow.prompt.segment_hashes",
    "segment_tokens": "hintflow.prompt.segment_tokens",
    "segment_roles": "hintflow.prompt.segment_roles",
    "tool_items": "hintflow.prompt.tool_hashes",
    "ttft": "hintflow.ttft_s",
    "queue_wait": "hintflow.queue_wait_s",
    "node": "hintflow.node",
    "after_turn": "hintflow.after_turn",
}
_ALIASES = {  # older spellings a backend may hold
    "cache_read": ("gen_ai.usage.cache_read_input_tokens",),
    "cache_creation": ("gen_ai.usage.cache_creation_input_tokens",),
    "input_tokens": ("gen_ai.usage.prompt_tokens",),
    "output_tokens": ("gen_ai.usage.completion_tokens",),
    "provider": ("gen_ai.system",),
}
_CHAT_OPERATIONS = frozenset({"chat", "text_completion", "generate_content"})


def turn_attributes(rec: TurnRecord) -> dict[str, Any]:
    """The span attributes of one recorded turn (None values left out: OpenTelemetry refuses them)."""
    a: dict[str, Any] = {
        ATTR["operation"]: "chat",
        ATTR["provider"]: rec.provider or "unknown",
        ATTR["system"]: rec.provider or "unknown",
        ATTR["model"]: rec.model,
        ATTR["conversation"]: rec.session_id,
        ATTR["program"]: rec.program_id,
        ATTR["turn"]: rec.turn,
        ATTR["segment_blocks"]: [s.block for s in rec.segments],
        ATTR["segment_hashes"]: [s.hash for s in rec.segments],
        ATTR["segment_tokens"]: [s.num_tokens for s in rec.segments],
        ATTR["segment_roles"]: [s.role for s in rec.segments],
    }
    tools = next((s for s in rec.segments if s.block == "tools"), None)
    if tools is not None and tools.items:
        a[ATTR["tool_items"]] = list(tools.items)
    optional = {"response_id": rec.response_id or None, "input_tokens": rec.input_tokens,
                "output_tokens": rec.output_tokens, "cache_read": rec.cached_tokens,
                "cache_creation": rec.cache_write_tokens, "ttft": rec.ttft_s,
                "queue_wait": rec.queue_wait_s, "node": rec.node or None}
    a.update({ATTR[k]: v for k, v in optional.items() if v is not None})
    return a


def pause_attributes(p: PauseRecord) -> dict[str, Any]:
    return {ATTR["operation"]: "execute_tool", ATTR["tool_name"]: p.tool, ATTR["conversation"]: p.session_id,
            ATTR["program"]: p.program_id, ATTR["after_turn"]: p.after_turn}


# ---- reading exported spans ---------------------------------------------------------------------------
def _otlp_value(v: Mapping[str, Any]) -> Any:
    """An OTLP/JSON AnyValue: {"stringValue": ...}, {"intValue": "12"}, {"arrayValue": {"values": [...]}}."""
    for key in ("stringValue", "boolValue", "doubleValue"):
        if key in v:
            return v[key]
    if "intValue" in v:
        return int(v["intValue"])
    if "arrayValue" in v:
        return [_otlp_value(x) for x in v["arrayValue"].get("values", [])]
    return None


def _time_s(value: Any) -> float | None:
    """Seconds since the epoch from OTLP nanoseconds (a string or int) or the SDK's ISO 8601 text."""
    if value is None:
        return None
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value) / 1e9
    text = str(value)
    if text.isdigit():
        return int(text) / 1e9
    return dt.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def flatten_spans(obj: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One line of an export as plain spans ``{name, start_s, end_s, trace_id, attributes}``.

    Takes an OTLP/JSON export line (``{"resourceSpans": [...]}``, what the collector's file exporter
    writes) or one span as the Python SDK's ``span.to_json()`` writes it."""
    out: list[dict[str, Any]] = []
    if "resourceSpans" in obj:
        for rs in obj.get("resourceSpans") or []:
            for ss in rs.get("scopeSpans") or rs.get("instrumentationLibrarySpans") or []:
                for span in ss.get("spans") or []:
                    attrs = {a["key"]: _otlp_value(a.get("value") or {}) for a in span.get("attributes") or []}
                    out.append({"name": span.get("name", ""), "trace_id": span.get("traceId", ""),
                                "start_s": _time_s(span.get("startTimeUnixNano")),
                                "end_s": _time_s(span.get("endTimeUnixNano")), "attributes": attrs})
        return out
    context = obj.get("context") or {}
    return [{"name": obj.get("name", ""), "trace_id": context.get("trace_id", ""),
             "start_s": _time_s(obj.get("start_time")), "end_s": _time_s(obj.get("end_time")),
             "attributes": dict(obj.get("attributes") or {})}]


def _get(attrs: Mapping[str, Any], name: str) -> Any:
    for key in (ATTR[name], *_ALIASES.get(name, ())):
        if key in attrs:
            return attrs[key]
    return None


def spans_to_records(spans: Iterable[Mapping[str, Any]]) -> tuple[list[TurnRecord], list[PauseRecord]]:
    """Turns from chat spans, pauses from tool spans (or from the gaps between a session's chat spans).

    A span without ``hintflow.*`` attributes (another instrumentation's) still gives a turn: its session is
    ``gen_ai.conversation.id`` or the trace id, and the pause before a turn is the gap since the session's
    previous call ended, named by a tool span inside that gap, else ``pause``."""
    chats: dict[tuple[str, str], list[Mapping[str, Any]]] = defaultdict(list)
    tools: dict[tuple[str, str], list[Mapping[str, Any]]] = defaultdict(list)
    for span in spans:
        attrs = span["attributes"]
        op = attrs.get(ATTR["operation"])
        session = str(_get(attrs, "conversation") or span.get("trace_id") or "session")
        program = str(attrs.get(ATTR["program"]) or span.get("trace_id") or session)
        if op == "execute_tool":
            tools[(program, session)].append(span)
        elif op in _CHAT_OPERATIONS or _get(attrs, "input_tokens") is not None:
            chats[(program, session)].append(span)
    turns: list[TurnRecord] = []
    pauses: list[PauseRecord] = []
    for (program, session), items in chats.items():
        items.sort(key=lambda s: (s["start_s"] or 0.0))
        for i, span in enumerate(items):
            turns.append(_span_turn(program, session, i, span))
            if i + 1 < len(items) and span["end_s"] is not None and items[i + 1]["start_s"] is not None:
                gap_s = max(0.0, items[i + 1]["start_s"] - span["end_s"])
                gap_start, gap_end = span["end_s"] - 1e-3, items[i + 1]["start_s"]
                inside = [t for t in tools.get((program, session), [])
                          if t["start_s"] is not None and gap_start <= t["start_s"] <= gap_end]
                name = str(inside[0]["attributes"].get(ATTR["tool_name"]) or "pause") if inside else "pause"
                pauses.append(PauseRecord(program, session, i, name, gap_s))
    return turns, pauses


def _span_turn(program: str, session: str, index: int, span: Mapping[str, Any]) -> TurnRecord:
    attrs = span["attributes"]
    hashes = list(attrs.get(ATTR["segment_hashes"]) or [])
    blocks = list(attrs.get(ATTR["segment_blocks"]) or ["message"] * len(hashes))
    counts = list(attrs.get(ATTR["segment_tokens"]) or [0] * len(hashes))
    roles = list(attrs.get(ATTR["segment_roles"]) or [""] * len(hashes))
    items = tuple(attrs.get(ATTR["tool_items"]) or ())
    segments = tuple(Segment(b, h, int(n), r, items if b == "tools" else ())
                     for b, h, n, r in zip(blocks, hashes, counts, roles, strict=False))
    start, end = span.get("start_s"), span.get("end_s")

    def num(name: str) -> int | None:
        v = _get(attrs, name)
        return int(v) if isinstance(v, int | float) and not isinstance(v, bool) else None

    ttft, queue = attrs.get(ATTR["ttft"]), attrs.get(ATTR["queue_wait"])
    return TurnRecord(
        program_id=program, session_id=session, turn=int(attrs.get(ATTR["turn"], index)),
        start_unix_s=start, latency_s=(end - start) if start is not None and end is not None else None,
        provider=str(_get(attrs, "provider") or ""), model=str(attrs.get(ATTR["model"]) or ""),
        segments=segments, input_tokens=num("input_tokens"), output_tokens=num("output_tokens"),
        cached_tokens=num("cache_read"), cache_write_tokens=num("cache_creation"),
        ttft_s=float(ttft) if isinstance(ttft, int | float) else None,
        queue_wait_s=float(queue) if isinstance(queue, int | float) else None,
        node=str(attrs.get(ATTR["node"]) or ""), response_id=str(attrs.get(ATTR["response_id"]) or ""),
    )
