"""Reading workloads: our JSONL trace (and writing it), Mooncake request traces, TRIE agent traces.

Every reader returns the same ``Program`` objects, so a replay runs one code path whatever the source.  A
line that cannot be used raises ``TraceError`` naming the file, the line and the problem, never a bare
``KeyError`` from deep inside a replay.  ``read_workload`` is the one entry point a command line needs.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Callable, Iterable, Iterator
from typing import Any, cast

from replay._generator_registry import GENERATORS, generate
from replay._generators import with_poisson_arrivals
from replay._trace import JoinKind, Program, Session, TraceError, Turn

__all__ = ["MOONCAKE_BLOCK_SIZE", "dump_jsonl", "load_jsonl", "program_from_dict", "program_to_dict",
           "read_mooncake", "read_trie", "read_workload"]

MOONCAKE_BLOCK_SIZE = 512  # tokens per hash id in the FAST'25 traces (their README)

_TURN_KEYS = ("input_tokens", "output_tokens")
_TURN_OPTIONAL = ("tool", "tool_duration_s", "shared_prefix", "shared_prefix_tokens", "hash_ids",
                  "block_size")
_PLAIN_TURN = Turn(1, 0)  # optional keys equal to its values are not written
_FOREIGN_HINT = {"hash_ids": "mooncake:FILE", "timestamp": "mooncake:FILE", "num_turns": "trie:FILE"}


def _keys(obj: object, what: str, required: Iterable[str], optional: Iterable[str] | None) -> dict[str, Any]:
    """``obj`` as a dict with the ``required`` keys and no others than ``optional`` (any when None)."""
    if not isinstance(obj, dict):
        raise ValueError(f"{what} must be a JSON object, got {type(obj).__name__}")
    required = tuple(required)
    missing = [k for k in required if k not in obj]
    if missing:
        raise ValueError(f"{what}: missing {', '.join(repr(k) for k in missing)}")
    unknown = [] if optional is None else sorted(set(obj) - set(required) - set(optional))
    if unknown:
        raise ValueError(f"{what}: unknown keys {unknown}")
    return obj


def program_to_dict(program: Program) -> dict[str, Any]:
    """The JSON object of one trace line; prefix and hash keys at their defaults are left out."""
    sessions = []
    for s in program.sessions:
        turns = []
        for t in s.turns:
            d: dict[str, Any] = {"input_tokens": t.input_tokens, "output_tokens": t.output_tokens,
                                 "tool": t.tool, "tool_duration_s": t.tool_duration_s}
            for k in _TURN_OPTIONAL[2:]:
                if getattr(t, k) != getattr(_PLAIN_TURN, k):
                    d[k] = list(t.hash_ids) if k == "hash_ids" else getattr(t, k)
            turns.append(d)
        sessions.append({"session_id": s.session_id, "role": s.role, "after": list(s.after), "join": s.join,
                         "turns": turns})
    return {"program_id": program.program_id, "arrival_s": program.arrival_s, "workload": program.workload,
            "sessions": sessions}


def program_from_dict(obj: object) -> Program:
    """Parse one trace line's JSON object; a ValueError says which program, session, turn and field."""
    p = _keys(obj, "program", ("program_id", "arrival_s", "workload", "sessions"), ())
    where = f"program {p['program_id']!r}"
    if not isinstance(p["sessions"], list):
        raise ValueError(f"{where}: sessions must be a list")
    sessions = []
    for i, raw in enumerate(p["sessions"]):
        s = _keys(raw, f"{where}: session {i}", ("session_id", "role", "turns"), ("after", "join"))
        swhere = f"{where}: session {s['session_id']!r}"
        if not isinstance(s["turns"], list):
            raise ValueError(f"{swhere}: turns must be a list")
        turns = []
        for j, t in enumerate(s["turns"]):
            fields = _keys(t, f"{swhere}: turn {j}", _TURN_KEYS, _TURN_OPTIONAL)
            try:
                turns.append(Turn(**fields))
            except ValueError as e:
                raise ValueError(f"{swhere}: turn {j}: {e}") from None
        try:
            join = cast(JoinKind, s.get("join", "and"))
            sessions.append(Session(s["session_id"], s["role"], turns, s.get("after", ()), join))
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
    return Program(p["program_id"], p["arrival_s"], p["workload"], sessions)


def dump_jsonl(programs: Iterable[Program], path: str | os.PathLike[str]) -> None:
    """Write one program per line, in the order given."""
    with open(path, "w", encoding="utf-8") as f:
        for program in programs:
            f.write(json.dumps(program_to_dict(program)) + "\n")


def _lines(path: str | os.PathLike[str], limit: int | None) -> Iterator[tuple[int, Any]]:
    """(line number, parsed JSON) of each non-blank line, up to ``limit`` of them."""
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    count = 0
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if limit is not None and count >= limit:
                return
            if not line.strip():
                continue
            try:
                yield lineno, json.loads(line)
            except json.JSONDecodeError as e:
                raise TraceError(str(path), lineno, f"not valid JSON ({e.msg.removesuffix(' at')} at column {e.colno})") from None
            count += 1


def _read(path: str | os.PathLike[str], limit: int | None,
          parse: Callable[[int, Any], Program]) -> list[Program]:
    """Parse every line, then check what spans lines: unique program ids, one length per shared prefix."""
    programs: list[Program] = []
    seen: dict[str, int] = {}
    prefixes: dict[str, int] = {}
    for lineno, obj in _lines(path, limit):
        try:
            program = parse(lineno, obj)
        except ValueError as e:
            raise TraceError(str(path), lineno, str(e)) from None
        if program.program_id in seen:
            problem = f"program id {program.program_id!r} already used on line {seen[program.program_id]}"
            raise TraceError(str(path), lineno, problem)
        seen[program.program_id] = lineno
        for s in program.sessions:
            key, n = s.turns[0].shared_prefix, s.turns[0].shared_prefix_tokens
            if key and prefixes.setdefault(key, n) != n:
                problem = f"shared_prefix {key!r} has {n} tokens here but {prefixes[key]} on an earlier line"
                raise TraceError(str(path), lineno, problem)
        programs.append(program)
    return programs


def load_jsonl(path: str | os.PathLike[str], *, limit: int | None = None) -> list[Program]:
    """Read our trace format (first ``limit`` programs); ``dump_jsonl``'s output reads back equal."""

    def parse(_: int, obj: Any) -> Program:
        if isinstance(obj, dict) and "program_id" not in obj:
            for key, spec in _FOREIGN_HINT.items():
                if key in obj:
                    raise ValueError(f"not a hintflow trace line (it has {key!r}); read it as {spec}")
        return program_from_dict(obj)

    return _read(path, limit, parse)


def read_mooncake(
    path: str | os.PathLike[str], *, limit: int | None = None, block_size: int = MOONCAKE_BLOCK_SIZE
) -> list[Program]:
    """Mooncake requests, each a one-turn program: arrival = ``timestamp`` ms / 1000, prefix ids kept.

    The traces have no sessions or tool timing; requests that share leading ``hash_ids`` share that many
    ``block_size``-token prefix blocks, which is what cache-capacity and eviction replays need.
    """

    def parse(lineno: int, obj: Any) -> Program:
        r = _keys(obj, "request", ("timestamp", "input_length", "output_length", "hash_ids"), None)
        ts = r["timestamp"]
        if isinstance(ts, bool) or not isinstance(ts, int | float) or ts < 0:
            raise ValueError(f"timestamp must be a number of milliseconds >= 0, got {ts!r}")
        if not isinstance(r["hash_ids"], list):
            raise ValueError(f"hash_ids must be a list of integers, got {r['hash_ids']!r}")
        for key in ("input_length", "output_length"):  # (named as in the file, not as in our Turn)
            v = r[key]
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{key} must be an integer >= 0, got {v!r}")
        ids = tuple(r["hash_ids"])
        if ids and len(ids) != -(-r["input_length"] // block_size):
            raise ValueError(f"hash_ids has {len(ids)} entries, but input_length {r['input_length']} is "
                             f"{-(-r['input_length'] // block_size)} blocks of {block_size} tokens")
        turn = Turn(r["input_length"], r["output_length"], hash_ids=ids, block_size=block_size if ids else 0)
        return Program(f"mooncake-{lineno}", ts / 1000.0, "mooncake", [Session("request", "user", [turn])])

    return _read(path, limit, parse)


def read_trie(path: str | os.PathLike[str], *, limit: int | None = None, tool: str = "tool") -> list[Program]:
    """Applied Compute TRIE agent sessions, each a one-session program of ``num_turns + 1`` model calls.

    The lists have ``num_turns`` entries: call i (0-based) generates ``assistant_response_length[i]`` and
    then runs a tool for ``tool_call_latency[i]`` s whose ``tool_call_output_length[i]`` tokens are the
    next call's new input; the last call appends the last tool output and generates
    ``final_assistant_response_length``.  The first prompt is ``input_prompt_length`` tokens unique to the
    session (each starts from its own random prompt).  Lenient where unambiguous: ``num_turns`` may be
    omitted when the three lists agree, and ``final_assistant_response_length`` may be omitted when
    ``assistant_response_length`` has one extra entry.  The format has no arrival times: all arrive at 0
    unless ``read_workload`` is given a rate.
    """
    lists = ("assistant_response_length", "tool_call_output_length", "tool_call_latency")

    def parse(lineno: int, obj: Any) -> Program:
        optional = ("num_turns", "final_assistant_response_length")
        r = _keys(obj, "session", ("input_prompt_length", *lists), optional)
        for name in lists:
            if not isinstance(r[name], list):
                raise ValueError(f"{name} must be a list, got {r[name]!r}")
        responses, outputs, latencies = (list(r[name]) for name in lists)
        n = r.get("num_turns", len(outputs))
        if type(n) is not int or n < 0:
            raise ValueError(f"num_turns must be an integer >= 0, got {n!r}")
        final = r.get("final_assistant_response_length")
        if final is None and len(responses) == n + 1:
            final = responses.pop()
        if final is None:
            raise ValueError("missing 'final_assistant_response_length'")
        lengths = {name: len(v) for name, v in zip(lists, (responses, outputs, latencies), strict=True)}
        if any(v != n for v in lengths.values()):
            raise ValueError(f"each list must have num_turns = {n} entries, got {lengths}")
        # Checked under the file's own names (Turn's messages would name our fields instead).
        first = r["input_prompt_length"]
        if isinstance(first, bool) or not isinstance(first, int) or first < 1:
            raise ValueError(f"input_prompt_length must be an integer >= 1, got {first!r}")
        for key, v in [("final_assistant_response_length", final),
                       *((f"assistant_response_length[{i}]", v) for i, v in enumerate(responses)),
                       *((f"tool_call_output_length[{i}]", v) for i, v in enumerate(outputs))]:
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{key} must be an integer >= 0, got {v!r}")
        for i, v in enumerate(latencies):
            if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v < 0:
                raise ValueError(f"tool_call_latency[{i}] must be a number of seconds >= 0, got {v!r}")
        new_inputs = [r["input_prompt_length"], *outputs]
        turns = []
        for i, output in enumerate([*responses, final]):
            try:
                calls = i < n  # every call but the final one runs a tool
                pause_s = latencies[i] if calls else 0
                turns.append(Turn(new_inputs[i], output, tool if calls else None, pause_s))
            except ValueError as e:
                raise ValueError(f"turn {i}: {e}") from None
        return Program(f"trie-{lineno}", 0.0, "trie", [Session("agent", "agent", turns)])

    return _read(path, limit, parse)


def _generator_params(name: str, text: str) -> dict[str, Any]:
    """``key=value,...`` after a generator name, typed like the field defaults; ranges are ``lo-hi``."""
    flags = {"num_programs": "--programs", "rate": "--rate", "scale": "--scale"}  # the replay's own options
    defaults: dict[str, Any] = {f.name: f.default for f in dataclasses.fields(GENERATORS[name])
                                if f.name not in flags}
    params: dict[str, Any] = {}
    for item in filter(None, text.split(",")):
        key, eq, value = item.partition("=")
        key = key.strip()
        if key in flags:
            raise ValueError(f"{name}: set {key} with {flags[key]}, not in the workload")
        if not eq or key not in defaults:
            raise ValueError(f"{name}: expected key=value with key one of {sorted(defaults)}, got {item!r}")
        default = defaults[key]
        try:
            if isinstance(default, tuple):
                lo, _, hi = value.partition("-")
                params[key] = (int(lo), int(hi or lo))
            else:
                params[key] = type(default)(value)
        except ValueError:
            raise ValueError(f"{name}: bad value for {key}: {value!r}") from None
    return params


def read_workload(spec: str, *, seed: int, rate: float | None = None, scale: float = 1.0,
                  limit: int | None = None) -> list[Program]:
    """Programs from ``spec``, in arrival order.

    ``spec`` is ``hintflow:FILE`` (or any path ending ``.jsonl``: our format), ``mooncake:FILE``,
    ``trie:FILE``, or a generator name with optional overrides (``swe-agent``,
    ``multi-agent:num_workers=3-5``, ``human-in-loop``).  ``limit`` keeps the first programs of a file,
    or is the number of programs a generator makes; ``rate`` (programs/s) replaces arrival times with a
    Poisson process seeded by ``seed``; ``scale`` multiplies token counts.
    """
    kind, colon, arg = spec.partition(":")
    if kind in GENERATORS:
        params = _generator_params(kind, arg)
        return generate(kind, seed=seed, num_programs=limit, rate=rate, scale=scale, **params)
    readers: dict[str, Callable[..., list[Program]]] = {
        "hintflow": load_jsonl, "mooncake": read_mooncake, "trie": read_trie}
    if colon and kind in readers:
        programs = readers[kind](arg, limit=limit)
    elif spec.endswith(".jsonl"):
        programs = load_jsonl(spec, limit=limit)
    else:
        raise ValueError(f"unknown workload {spec!r}: expected hintflow:FILE, mooncake:FILE, trie:FILE, "
                         f"a .jsonl path or a generator ({', '.join(sorted(GENERATORS))})")
    programs = sorted(programs, key=lambda p: p.arrival_s)
    if rate is not None:
        programs = with_poisson_arrivals(programs, rate, seed)
    return [p.scaled(scale) for p in programs]
