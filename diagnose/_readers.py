"""Reading a run to diagnose or price, whatever wrote it: a recording, a replay trace, exported
OpenTelemetry spans, or a provider's request log.  Each becomes the same ``Run`` of ``TurnRecord``s.

The format is told from the first line, and every later line must be of the same kind.  A line that cannot
be used raises ``TraceFormatError`` naming the file, the line and the field (the command line prints it
and exits with status 2).  Replay traces are read by ``replay``'s own reader (imported only then: it
pulls in the engine's schedulers), so their validation and messages are the replay's.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import os
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from diagnose._otel import flatten_spans, spans_to_records
from diagnose._records import (
    BLOCKS,
    PauseRecord,
    Segment,
    TraceFormatError,
    TurnRecord,
    WarningRecord,
    segment_hash,
)
from diagnose._usage import normalize_usage

__all__ = ["Run", "load_run", "records_to_run"]


@dataclass
class Run:
    """Turns grouped by session in call order, with the pause after each turn filled in."""

    source: str  # "recorded", "replay", "otel", "usage-log", "generator"
    path: str
    turns: list[TurnRecord]
    warnings: list[WarningRecord] = field(default_factory=list)

    def sessions(self) -> dict[tuple[str, str], list[TurnRecord]]:
        out: dict[tuple[str, str], list[TurnRecord]] = defaultdict(list)
        for t in self.turns:
            out[t.key].append(t)
        for items in out.values():
            items.sort(key=lambda t: t.turn)
        return dict(out)


def records_to_run(source: str, path: str, turns: list[TurnRecord], pauses: list[PauseRecord],
                   warnings: list[WarningRecord] | None = None) -> Run:
    """Attach each pause to the turn it follows; turns are kept in session order."""
    by_key = {(t.program_id, t.session_id, t.turn): t for t in turns}
    for p in pauses:
        t = by_key.get((p.program_id, p.session_id, p.after_turn))
        if t is not None:
            t.tool, t.pause_s = p.tool, p.pause_s
    turns = sorted(turns, key=lambda t: (t.program_id, t.session_id, t.turn))
    return Run(source, path, turns, list(warnings or []))


# ---- field checks for recorded lines -------------------------------------------------------------------
def _is_count(v: Any) -> bool:
    return type(v) is int and v >= 0


def _is_seconds(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and v >= 0


def _is_name(v: Any) -> bool:
    return isinstance(v, str) and bool(v)


_TURN_FIELDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "program_id": (_is_name, "a non-empty string"),
    "session_id": (_is_name, "a non-empty string"),
    "turn": (_is_count, "an integer >= 0"),
    "start_unix_s": (_is_seconds, "a number of seconds >= 0"),
    "latency_s": (_is_seconds, "a number of seconds >= 0"),
    "provider": (lambda v: isinstance(v, str), "a string"),
    "model": (lambda v: isinstance(v, str), "a string"),
    "input_tokens": (_is_count, "an integer >= 0"),
    "output_tokens": (_is_count, "an integer >= 0"),
    "cached_tokens": (_is_count, "an integer >= 0"),
    "cache_write_tokens": (_is_count, "an integer >= 0"),
    "ttft_s": (_is_seconds, "a number of seconds >= 0"),
    "queue_wait_s": (_is_seconds, "a number of seconds >= 0"),
    "node": (lambda v: isinstance(v, str), "a string"),
    "response_id": (lambda v: isinstance(v, str), "a string"),
    "segments": (lambda v: isinstance(v, list), "a list of segments"),
    "usage": (lambda v: isinstance(v, dict), "an object"),
    "warnings": (lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v), "a list of strings"),
    "prompt_text": (lambda v: True, "anything"),
}
_REQUIRED = {
    "turn": ("program_id", "session_id", "turn", "segments"),
    "pause": ("program_id", "session_id", "after_turn", "tool", "pause_s"),
    "warning": ("program_id", "session_id", "turn", "block", "message"),
    "run": ("format",),
}
_PAUSE_FIELDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "program_id": (_is_name, "a non-empty string"), "session_id": (_is_name, "a non-empty string"),
    "after_turn": (_is_count, "an integer >= 0"), "tool": (_is_name, "a non-empty string"),
    "pause_s": (_is_seconds, "a number of seconds >= 0"),
}
_WARNING_FIELDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "program_id": (_is_name, "a non-empty string"), "session_id": (_is_name, "a non-empty string"),
    "turn": (_is_count, "an integer >= 0"), "block": (lambda v: isinstance(v, str), "a string"),
    "message": (lambda v: isinstance(v, str), "a string"),
}


def _check(obj: dict[str, Any], kind: str, fields: Mapping[str, tuple[Callable[[Any], bool], str]]) -> None:
    missing = [k for k in _REQUIRED[kind] if k not in obj]
    if missing:
        raise ValueError(f"{kind} record: missing field {missing[0]!r}")
    unknown = sorted(set(obj) - set(fields) - {"kind"})
    if unknown:
        raise ValueError(f"{kind} record: unknown field {unknown[0]!r}")
    for name, value in obj.items():
        if name in fields and not fields[name][0](value):
            raise ValueError(f"{kind} record: field {name!r} must be {fields[name][1]}, got {value!r}")


def _segment(raw: Any, i: int) -> Segment:
    if not isinstance(raw, dict):
        raise ValueError(f"turn record: segments[{i}] must be an object, got {raw!r}")
    unknown = sorted(set(raw) - {"block", "hash", "num_tokens", "role", "items"})
    if unknown:
        raise ValueError(f"turn record: segments[{i}]: unknown field {unknown[0]!r}")
    if raw.get("block") not in BLOCKS:
        raise ValueError(f"turn record: segments[{i}].block must be one of {list(BLOCKS)}, got {raw.get('block')!r}")
    if not _is_name(raw.get("hash")):
        raise ValueError(f"turn record: segments[{i}].hash must be a non-empty string, got {raw.get('hash')!r}")
    if not _is_count(raw.get("num_tokens")):
        raise ValueError(f"turn record: segments[{i}].num_tokens must be an integer >= 0, "
                         f"got {raw.get('num_tokens')!r}")
    items = raw.get("items", [])
    if not isinstance(items, list) or not all(isinstance(x, str) for x in items):
        raise ValueError(f"turn record: segments[{i}].items must be a list of strings")
    return Segment(raw["block"], raw["hash"], raw["num_tokens"], str(raw.get("role", "")), tuple(items))


def _recorded(obj: dict[str, Any], turns: list[TurnRecord], pauses: list[PauseRecord],
              warnings: list[WarningRecord]) -> None:
    kind = obj.get("kind")
    if kind == "turn":
        _check(obj, "turn", _TURN_FIELDS)
        fields = {k: v for k, v in obj.items() if k not in ("kind", "segments", "warnings")}
        segments = tuple(_segment(s, i) for i, s in enumerate(obj["segments"]))
        turns.append(TurnRecord(**fields, segments=segments, warnings=tuple(obj.get("warnings", ()))))
    elif kind == "pause":
        _check(obj, "pause", _PAUSE_FIELDS)
        pauses.append(PauseRecord(obj["program_id"], obj["session_id"], obj["after_turn"], obj["tool"],
                                  float(obj["pause_s"])))
    elif kind == "warning":
        _check(obj, "warning", _WARNING_FIELDS)
        warnings.append(WarningRecord(obj["program_id"], obj["session_id"], obj["turn"], obj["block"],
                                      obj["message"]))
    elif kind == "run":
        if not isinstance(obj.get("format"), str) or not obj["format"].startswith("hintflow.turns/"):
            raise ValueError(f"run record: field 'format' must be 'hintflow.turns/N', got {obj.get('format')!r}")
    else:
        raise ValueError(f"field 'kind' must be one of turn, pause, warning, run; got {kind!r}")


# ---- provider request logs ------------------------------------------------------------------------------
_USAGE_LOG_FIELDS = {"timestamp", "session_id", "program_id", "provider", "model", "usage", "latency_s",
                     "ttft_s", "request_id", "tool"}


def _timestamp_s(value: Any) -> float:
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    if isinstance(value, str):
        try:
            return dt.datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
        except ValueError:
            pass
    raise ValueError(f"field 'timestamp' must be Unix seconds or ISO 8601 text, got {value!r}")


def _usage_turns(rows: list[tuple[int, dict[str, Any]]], path: str) -> tuple[list[TurnRecord], list[PauseRecord]]:
    """One turn per usage record, grouped by session in timestamp order; pauses from the gaps."""
    by_session: dict[tuple[str, str], list[tuple[float, int, dict[str, Any]]]] = defaultdict(list)
    for lineno, r in rows:
        try:
            unknown = sorted(set(r) - _USAGE_LOG_FIELDS)
            if unknown:
                raise ValueError(f"usage record: unknown field {unknown[0]!r}")
            if not isinstance(r.get("usage"), dict):
                raise ValueError(f"usage record: field 'usage' must be an object, got {r.get('usage')!r}")
            if "timestamp" not in r:
                raise ValueError("usage record: missing field 'timestamp'")
            ts = _timestamp_s(r["timestamp"])
            for name in ("latency_s", "ttft_s"):
                if name in r and not _is_seconds(r[name]):
                    raise ValueError(f"usage record: field {name!r} must be a number of seconds >= 0, got {r[name]!r}")
            session = str(r.get("session_id") or "session")
        except ValueError as e:
            raise TraceFormatError(path, lineno, str(e)) from None
        by_session[(str(r.get("program_id") or session), session)].append((ts, lineno, r))
    turns: list[TurnRecord] = []
    pauses: list[PauseRecord] = []
    for (program, session), items in by_session.items():
        items.sort(key=lambda x: x[0])
        for i, (ts, _lineno, r) in enumerate(items):
            u = normalize_usage(r["usage"], str(r.get("provider", "")))
            turns.append(TurnRecord(program, session, i, start_unix_s=ts, latency_s=r.get("latency_s"),
                                    provider=u.provider, model=str(r.get("model", "")),
                                    input_tokens=u.input_tokens, output_tokens=u.output_tokens,
                                    cached_tokens=u.cached_tokens, cache_write_tokens=u.cache_write_tokens,
                                    usage=r["usage"], ttft_s=r.get("ttft_s"),
                                    response_id=str(r.get("request_id", ""))))
            if i + 1 < len(items):
                end = ts + float(r.get("latency_s") or 0.0)
                pauses.append(PauseRecord(program, session, i, str(r.get("tool") or "pause"),
                                          max(0.0, items[i + 1][0] - end)))
    return turns, pauses


# ---- replay traces ------------------------------------------------------------------------------------
def programs_to_run(programs: list[Any], source: str, path: str) -> Run:
    """``replay.Program``s as turns: a shared prefix, then one history segment per earlier input and
    output, so two calls of a session share exactly the context the trace says they carry."""
    turns: list[TurnRecord] = []
    for p in programs:
        for s in p.sessions:
            history: list[Segment] = []
            for i, t in enumerate(s.turns):
                own = f"{p.program_id}/{s.session_id}/{i}"
                if t.hash_ids:  # a trace's own block identity (Mooncake): one segment per block
                    n = len(t.hash_ids)
                    segments = tuple(Segment("history", f"id{h}", t.block_size if j < n - 1 else
                                             t.input_tokens - t.block_size * (n - 1), "")
                                     for j, h in enumerate(t.hash_ids))
                else:
                    new: list[Segment] = []
                    unique = t.input_tokens
                    if t.shared_prefix:
                        new.append(Segment("prefix", segment_hash(t.shared_prefix), t.shared_prefix_tokens))
                        unique -= t.shared_prefix_tokens
                    if unique:
                        new.append(Segment("history", segment_hash(own + "/in"), unique, "user"))
                    segments = (*history, *new)
                turns.append(TurnRecord(p.program_id, s.session_id, i, provider="", segments=segments,
                                        input_tokens=sum(x.num_tokens for x in segments),
                                        output_tokens=t.output_tokens, tool=t.tool,
                                        pause_s=t.tool_duration_s if t.tool else None))
                history = [*segments]
                if t.output_tokens:
                    history.append(Segment("history", segment_hash(own + "/out"), t.output_tokens, "assistant"))
    return Run(source, path, turns)


# ---- entry point ----------------------------------------------------------------------------------------
def _lines(path: str) -> Iterator[tuple[int, Any]]:
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                yield lineno, json.loads(line)
            except json.JSONDecodeError as e:
                raise TraceFormatError(path, lineno, f"not valid JSON ({e.msg} at column {e.colno})") from None


def _kind_of(obj: Any) -> str:
    if not isinstance(obj, dict):
        return "?"
    if "resourceSpans" in obj or ("attributes" in obj and "name" in obj and "context" in obj):
        return "otel"  # (a span's own "kind" is its SpanKind: test for spans first)
    if "kind" in obj:
        return "recorded"
    if "program_id" in obj and "sessions" in obj:
        return "replay"
    if "usage" in obj:
        return "usage-log"
    return "?"


_GENERATOR_NAMES = ("swe-agent", "multi-agent", "human-in-loop", "skewed")  # replay.GENERATORS, without importing it
_DESCRIBE = {"recorded": "a recorded turn", "replay": "a replay trace program", "otel": "an OpenTelemetry span",
             "usage-log": "a provider usage record"}


def load_run(path: str | os.PathLike[str], *, seed: int = 0) -> Run:
    """Read any of the four formats (see the module doc); ``TraceFormatError`` on a line it cannot use.

    A name that is not a file but one of the replay's generators (``human-in-loop``,
    ``swe-agent:num_turns=8-12``) is generated with ``seed``, as ``hintflow replay -w`` would."""
    path = str(path)
    if not os.path.exists(path) and path.partition(":")[0] in _GENERATOR_NAMES:
        import replay

        try:
            programs = replay.read_workload(path, seed=seed)
        except ValueError as e:
            raise TraceFormatError(path, 0, str(e)) from None
        return programs_to_run(programs, "generator", path)
    try:
        rows = list(_lines(path))
    except OSError as e:
        raise TraceFormatError(path, 0, f"cannot read: {e.strerror or e}") from None
    if not rows:
        raise TraceFormatError(path, 0, "empty: no records")
    kind = _kind_of(rows[0][1])
    if kind == "?":
        raise TraceFormatError(path, rows[0][0], "not a recorded run, replay trace, OpenTelemetry span export "
                               "or provider usage log (see docs/hosted-apis.md for the formats)")
    for lineno, obj in rows:
        if _kind_of(obj) != kind:
            raise TraceFormatError(path, lineno, f"expected {_DESCRIBE[kind]} like line {rows[0][0]}, "
                                   f"got {json.dumps(obj)[:80]}")
    if kind == "replay":
        import replay  # the replay's own reader and messages (it imports the engine: only here)

        try:
            return programs_to_run(replay.load_jsonl(path), "replay", path)
        except replay.TraceError as e:
            raise TraceFormatError(e.path, e.line, e.problem) from None
    if kind == "otel":
        spans = [s for _, obj in rows for s in flatten_spans(obj)]
        turns, pauses = spans_to_records(spans)
        if not turns:
            raise TraceFormatError(path, 0, "no GenAI chat spans (gen_ai.operation.name 'chat') in the export")
        return records_to_run("otel", path, turns, pauses)
    if kind == "usage-log":
        turns, pauses = _usage_turns(rows, path)
        return records_to_run("usage-log", path, turns, pauses)
    turns_out: list[TurnRecord] = []
    pauses_out: list[PauseRecord] = []
    warnings_out: list[WarningRecord] = []
    for lineno, obj in rows:
        try:
            _recorded(obj, turns_out, pauses_out, warnings_out)
        except (ValueError, TypeError) as e:
            raise TraceFormatError(path, lineno, str(e)) from None
    if not turns_out:
        raise TraceFormatError(path, 0, "no turn records")
    return records_to_run("recorded", path, turns_out, pauses_out, warnings_out)
