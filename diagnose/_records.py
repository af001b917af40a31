"""The recorded turn: what one model call of a program looked like, as hashes and counts, never text.

A recording is a JSONL file of records, each with a ``kind``:

* ``turn``: one model call of one session (prompt segments as hashes, token counts, the provider's usage
  fields, latency and, where the serving side says, TTFT, queue wait and node);
* ``pause``: the tool (or person) that held the session after a turn, and for how long;
* ``warning``: something the prompt builder noticed (an early block changed between turns);
* ``run``: an optional header (format version, who wrote it).

Pauses are separate records because a recorder learns a pause's length only when the next turn starts:
each line is written once, when its facts are known, so a crashed run leaves a readable file.  The schema
is in docs/trace-format.md ("Recorded runs").

A prompt is split into *segments* in the order the provider reads them (tools, system, then each message),
each hashed from its canonical JSON (sorted keys, no spaces), so two turns that sent the same bytes for a
block have the same hash.  Token counts per segment are estimates (4 characters a token) scaled to the
input tokens the provider reported, when it reported them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "BLOCKS",
    "FORMAT",
    "PauseRecord",
    "Segment",
    "TraceFormatError",
    "TurnRecord",
    "WarningRecord",
    "canonical_json",
    "common_prefix",
    "estimate_tokens",
    "jsonable",
    "scale_segments",
    "segment_hash",
]

FORMAT = "hintflow.turns/1"
# Where a segment sits in a prompt.  "history" and "prefix" are what a token-id prompt (hintflow's own
# llm activity, a replay trace) is split into when it has no message structure.
BLOCKS = ("tools", "system", "message", "prefix", "history")
EARLY_BLOCKS = frozenset({"tools", "system", "prefix"})
HASH_HEX_CHARS = 16  # 64 bits of sha256: collisions are negligible at the scale of one run's segments
CHARS_PER_TOKEN = 4.0  # the usual rule of thumb for English and JSON; only used where no tokenizer is known


class TraceFormatError(ValueError):
    """A line that cannot be used: names the file, the 1-based line and the field."""

    def __init__(self, path: str, line: int, problem: str) -> None:
        super().__init__(f"{path}:{line}: {problem}" if line else f"{path}: {problem}")
        self.path = path
        self.line = line
        self.problem = problem


def jsonable(obj: Any) -> Any:
    """``obj`` as plain JSON data: dataclasses, pydantic models and SDK objects become dicts.

    SDK request and response objects differ between versions; this reads whatever shape they have
    without importing the SDK (a pydantic model's ``model_dump``, a dataclass, a mapping, a sequence)."""
    if obj is None or isinstance(obj, str | bool | int):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else repr(obj)
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [jsonable(v) for v in obj]
    dump = getattr(obj, "model_dump", None)
    if callable(dump):
        try:
            return jsonable(dump(mode="json", exclude_none=True))
        except TypeError:
            return jsonable(dump())
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if hasattr(obj, "__dict__"):
        return {k: jsonable(v) for k, v in vars(obj).items() if not k.startswith("_")}
    return repr(obj)


def canonical_json(obj: Any) -> str:
    """Deterministic JSON: sorted keys, no whitespace, non-ASCII kept.  Equal content, equal text."""
    return json.dumps(jsonable(obj), sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def segment_hash(obj: Any) -> str:
    """The hash of one prompt segment: sha256 of its canonical JSON (a string is hashed as itself)."""
    text = obj if isinstance(obj, str) else canonical_json(obj)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:HASH_HEX_CHARS]


def estimate_tokens(obj: Any) -> int:
    """Tokens of a segment when no tokenizer is at hand: its canonical JSON's length / 4, at least 1."""
    text = obj if isinstance(obj, str) else canonical_json(obj)
    return max(1, round(len(text) / CHARS_PER_TOKEN))


@dataclass(frozen=True, slots=True)
class Segment:
    """One block of a prompt: ``block`` (tools, system, message, prefix, history), its ``hash``, its
    ``num_tokens`` (an estimate unless a tokenizer counted), a message's ``role``, and for ``tools`` the
    hash of each tool definition in the order sent (``items``), so a reorder can be told from an edit."""

    block: str
    hash: str
    num_tokens: int
    role: str = ""
    items: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"block": self.block, "hash": self.hash, "num_tokens": self.num_tokens}
        if self.role:
            d["role"] = self.role
        if self.items:
            d["items"] = list(self.items)
        return d

    @property
    def is_early(self) -> bool:
        """Tools, system and a fixed prefix: blocks that should not change between turns of a session."""
        return self.block in EARLY_BLOCKS


@dataclass(slots=True)
class TurnRecord:
    """One model call.  Counts are None where the source did not say (never guessed as 0).

    ``input_tokens`` is the whole prompt (cached tokens included, as OpenAI counts and the OpenTelemetry
    convention asks); ``cached_tokens`` what the provider or engine read from its cache;
    ``cache_write_tokens`` what it wrote (Anthropic's ``cache_creation_input_tokens``).  ``tool`` and
    ``pause_s`` are the pause after this call, filled in from the ``pause`` record that follows it.
    """

    program_id: str
    session_id: str
    turn: int
    start_unix_s: float | None = None
    latency_s: float | None = None
    provider: str = ""
    model: str = ""
    segments: tuple[Segment, ...] = ()
    input_tokens: int | None = None
    output_tokens: int | None = None
    cached_tokens: int | None = None
    cache_write_tokens: int | None = None
    usage: dict[str, Any] = field(default_factory=dict)
    ttft_s: float | None = None
    queue_wait_s: float | None = None
    node: str = ""
    response_id: str = ""
    tool: str | None = None
    pause_s: float | None = None
    warnings: tuple[str, ...] = ()
    prompt_text: Any = None  # only when the recorder was asked to keep text

    def to_dict(self) -> dict[str, Any]:
        """The ``turn`` line (without the pause, which has its own line); None fields are left out."""
        d: dict[str, Any] = {"kind": "turn", "program_id": self.program_id, "session_id": self.session_id,
                             "turn": self.turn}
        for name in ("start_unix_s", "latency_s", "provider", "model", "input_tokens", "output_tokens",
                     "cached_tokens", "cache_write_tokens", "ttft_s", "queue_wait_s", "node", "response_id"):
            value = getattr(self, name)
            if value not in (None, ""):
                d[name] = value
        d["segments"] = [s.to_dict() for s in self.segments]
        if self.usage:
            d["usage"] = self.usage
        if self.warnings:
            d["warnings"] = list(self.warnings)
        if self.prompt_text is not None:
            d["prompt_text"] = self.prompt_text
        return d

    @property
    def key(self) -> tuple[str, str]:
        return (self.program_id, self.session_id)

    @property
    def prompt_tokens(self) -> int:
        """The prompt's length: the reported input tokens, else the segments' estimates summed."""
        if self.input_tokens is not None:
            return self.input_tokens
        return sum(s.num_tokens for s in self.segments)

    @property
    def speed_s(self) -> float | None:
        """Time to first token where known, else the whole call's latency (what a non-streaming client sees)."""
        return self.ttft_s if self.ttft_s is not None else self.latency_s


@dataclass(frozen=True, slots=True)
class PauseRecord:
    """The pause after turn ``after_turn`` of a session: ``tool`` ran (or a person answered) for ``pause_s``."""

    program_id: str
    session_id: str
    after_turn: int
    tool: str
    pause_s: float

    def to_dict(self) -> dict[str, Any]:
        return {"kind": "pause", "program_id": self.program_id, "session_id": self.session_id,
                "after_turn": self.after_turn, "tool": self.tool, "pause_s": self.pause_s}


@dataclass(frozen=True, slots=True)
class WarningRecord:
    """What the prompt builder noticed at a turn (e.g. the tools block changed since the previous turn)."""

    program_id: str
    session_id: str
    turn: int
    block: str
    message: str

    def to_dict(self) -> dict[str, Any]:
        return {"kind": "warning", "program_id": self.program_id, "session_id": self.session_id,
                "turn": self.turn, "block": self.block, "message": self.message}


def scale_segments(segments: Sequence[Segment], total_tokens: int | None) -> tuple[Segment, ...]:
    """Segments whose estimated token counts are scaled to sum to ``total_tokens`` (the provider's count).

    The estimate (characters / 4) is off by a model-dependent factor; the provider's total is exact, so
    the split between blocks keeps the estimate's proportions and the sum takes the provider's figure."""
    estimated = sum(s.num_tokens for s in segments)
    if not segments or total_tokens is None or total_tokens <= 0 or estimated <= 0:
        return tuple(segments)
    out: list[Segment] = []
    cumulative, assigned = 0, 0
    for s in segments:  # cumulative rounding, so the parts sum exactly to the total
        cumulative += s.num_tokens
        target = round(cumulative * total_tokens / estimated)
        out.append(dataclasses.replace(s, num_tokens=max(0, target - assigned)))
        assigned = target
    return tuple(out)


def common_prefix(a: Iterable[Segment], b: Iterable[Segment]) -> int:
    """How many leading segments two prompts share (same block and hash)."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x.hash != y.hash or x.block != y.block:
            break
        n += 1
    return n
