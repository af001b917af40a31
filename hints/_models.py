"""Pydantic models of the hint vocabulary and of the engine's replies (see docs/architecture.md, "Hint vocabulary").

These are what both sides program against; the protobuf messages in ``engine_pb2`` are only the wire form
(``hints._convert`` maps between the two). Validation lives here, once, so that a hint is checked the same
way whether it was built by a policy in-process or decoded from the wire by an engine node.

Bounds exist for reasons, not taste:

- every time is a finite, non-negative duration measured at sending (NaN and inf arrive happily through a
  proto3 ``double``, and a node must never turn them into a deadline);
- pins are leases, so their length is capped (:data:`MAX_PIN_TTL_S`): a buggy or crashed orchestrator can
  hold memory for at most a day;
- integers are bounded to the width of their protobuf field, so a valid model always encodes;
- strings reject control characters and lone surrogates (protobuf cannot encode the latter, and the
  former turn up in logs and metric labels).
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StringConstraints, field_validator

MAX_PIN_TTL_S: float = 86400.0
"""Longest pin lease a hint may ask for (one day); 0 unpins."""

MAX_HORIZON_S: float = 7 * 86400.0
"""Furthest ahead a predicted next use or prefetch may lie (one week): past that a prediction is noise."""

MAX_PROGRAM_AGE_S: float = 10 * 365 * 86400.0
"""Oldest program a ``Priority`` may describe (ten years): past that an age is a bug, and it would overflow
an engine's integer priority."""

MAX_OUTPUT_TOKENS: int = 10_000_000
"""Largest expected output length an ``Expect`` hint may carry."""

MAX_ID_LEN: int = 256
"""Longest session or program id, in characters."""

_INT32_MAX = 2**31 - 1
_INT64_MAX = 2**63 - 1
_UINT64_MAX = 2**64 - 1


# Unicode category Cs (lone surrogates) is exactly U+D800-U+DFFF and Cc (control characters) exactly
# U+0000-U+001F and U+007F-U+009F: one regex search instead of a category lookup per character (ids are
# validated on every hint and every cache-state entry, millions of times in a long replay).
_SURROGATE = re.compile("[\ud800-\udfff]")
_CONTROL_OR_SURROGATE = re.compile("[\x00-\x1f\x7f-\x9f\ud800-\udfff]")


def _encodable(value: str) -> str:
    """Reject lone surrogates: protobuf raises on encode, far from where the bad string was made."""
    if (m := _SURROGATE.search(value)) is not None:
        raise ValueError(f"must be valid Unicode, found a lone surrogate {m.group()!r} at position {m.start()}")
    return value


def _printable_id(value: str) -> str:
    """Reject control characters (and lone surrogates) in ids, which end up in logs and metric labels."""
    if (m := _CONTROL_OR_SURROGATE.search(value)) is not None:
        raise ValueError(f"must not contain control characters, found {m.group()!r} at position {m.start()}")
    return value


SessionId = Annotated[
    str, StringConstraints(min_length=1, max_length=MAX_ID_LEN), AfterValidator(_printable_id)
]
"""A session id: one continuing KV context (``program_id`` + ``agent_id`` upstream)."""

ProgramId = SessionId
"""A program id: one agent run (one workflow execution)."""

OptionalProgramId = Annotated[str, StringConstraints(max_length=MAX_ID_LEN), AfterValidator(_printable_id)]
"""A program id that may be empty, where the sender may not know the program."""

Text = Annotated[str, StringConstraints(max_length=4096), AfterValidator(_encodable)]
"""Free text (reasons, error messages): bounded, and encodable by protobuf."""

Label = Annotated[str, StringConstraints(max_length=1024), AfterValidator(_printable_id)]
"""A short name that may be empty (node id, model name): no control characters."""

Seconds = Annotated[float, Field(ge=0.0, allow_inf_nan=False)]
"""A finite, non-negative duration in seconds."""

HorizonSeconds = Annotated[float, Field(ge=0.0, le=MAX_HORIZON_S, allow_inf_nan=False)]
"""A finite duration from now into the predicted future, at most :data:`MAX_HORIZON_S`."""

Int32 = Annotated[int, Field(ge=-(2**31), le=_INT32_MAX)]
Count32 = Annotated[int, Field(ge=0, le=_INT32_MAX)]
"""A non-negative count that fits the ``int32`` field it is sent in."""


class _Frozen(BaseModel):
    """Immutable and strict about unknown fields: a typo in a hint must fail, not be dropped silently."""

    model_config = ConfigDict(frozen=True, extra="forbid")


# --- hints (orchestrator -> engine) ---------------------------------------------------------------


class Priority(_Frozen):
    """Program-level FCFS: an older program goes first; lower ``priority_class`` goes first (vLLM)."""

    kind: Literal["priority"] = "priority"
    session_id: SessionId
    program_id: OptionalProgramId = ""
    program_age_s: Annotated[float, Field(ge=0.0, le=MAX_PROGRAM_AGE_S, allow_inf_nan=False)]
    priority_class: Int32 = 0


class Pin(_Frozen):
    """Keep this session's context resident until receipt + ``ttl_s`` on the node's clock; 0 unpins."""

    kind: Literal["pin"] = "pin"
    session_id: SessionId
    ttl_s: Annotated[float, Field(ge=0.0, le=MAX_PIN_TTL_S, allow_inf_nan=False)]
    reason: Text = ""


class NextUse(_Frozen):
    """One entry of an :class:`EvictionOrder`: predicted seconds until the session is needed again."""

    session_id: SessionId
    next_use_s: HorizonSeconds


class EvictionOrder(_Frozen):
    """Predicted next uses; the node evicts unpinned contexts with the largest ``next_use_s`` first.

    Incremental: only sessions whose prediction changed need be listed. A session listed twice would be
    ambiguous, so that is rejected.
    """

    kind: Literal["eviction_order"] = "eviction_order"
    entries: list[NextUse]

    @field_validator("entries")
    @classmethod
    def _unique_sessions(cls, entries: list[NextUse]) -> list[NextUse]:
        seen: set[str] = set()
        for i, entry in enumerate(entries):
            if entry.session_id in seen:
                raise ValueError(f"duplicate session_id {entry.session_id!r} at entries[{i}]")
            seen.add(entry.session_id)
        return entries


class Prefetch(_Frozen):
    """Bring an offloaded context back to the device ``at_s`` seconds from now (before it is needed)."""

    kind: Literal["prefetch"] = "prefetch"
    session_id: SessionId
    at_s: HorizonSeconds


class Expect(_Frozen):
    """Expected output length of the session's next call, for admission and memory reservation."""

    kind: Literal["expect"] = "expect"
    session_id: SessionId
    output_tokens: Annotated[int, Field(ge=0, le=MAX_OUTPUT_TOKENS)]


class Release(_Frozen):
    """The program is done: free all its contexts at once."""

    kind: Literal["release"] = "release"
    program_id: ProgramId


HintModel = Priority | Pin | EvictionOrder | Prefetch | Expect | Release
"""The hint classes, as a plain union (for ``isinstance`` and ``type[...]``)."""

Hint = Annotated[HintModel, Field(discriminator="kind")]
"""Any one hint; ``kind`` equals the name of its field in the protobuf ``Hint.kind`` oneof."""


class HintBatch(_Frozen):
    """Hints sent together; the node answers each batch with one :class:`HintAck`."""

    batch_id: Annotated[int, Field(ge=0, le=_UINT64_MAX)]
    hints: list[Hint]
    sent_unix_s: Seconds = 0.0
    """Sender's wall clock, used only for the delivery-latency metric (0: not given)."""
    node_epoch: Annotated[int, Field(ge=0, le=_UINT64_MAX)] = 0
    """The node life these hints are meant for (``CacheState.node_epoch``); 0: any. A node of another
    epoch (restarted since) applies none of them (:func:`stale_batch_results`)."""


# --- replies (engine -> orchestrator) ---------------------------------------------------------------


class HintResult(_Frozen):
    """What the node did with the hint at ``index`` of its batch; ``code`` is a gRPC status code name."""

    index: Count32
    code: Annotated[str, StringConstraints(min_length=1, max_length=64, pattern=r"^[A-Z][A-Z_]*$")] = "OK"
    message: Text = ""
    clamped: bool = False
    pinned_blocks: Count32 = 0
    requested_blocks: Count32 = 0
    deferred: bool = False
    """A pin on a session whose turn is running: it holds the turn's blocks once the turn ends."""

    @property
    def ok(self) -> bool:
        """True when the node applied the hint (possibly clamped)."""
        return self.code == "OK"

    @property
    def holds(self) -> bool:
        """A pin that holds blocks now, or will once its session's running turn ends; an OK pin on a
        session that holds nothing (its context already gone) holds nothing."""
        return self.ok and (self.pinned_blocks > 0 or self.deferred)


class HintAck(_Frozen):
    """The node's answer to one :class:`HintBatch`."""

    batch_id: Annotated[int, Field(ge=0, le=_UINT64_MAX)]
    results: list[HintResult]
    node_epoch: Annotated[int, Field(ge=0, le=_UINT64_MAX)] = 0  # the answering node's (0: not said)


class SessionResidency(_Frozen):
    """Where one session's KV lives on the node, in tokens per tier."""

    session_id: SessionId
    program_id: OptionalProgramId = ""
    device_tokens: Count32 = 0
    host_tokens: Count32 = 0
    pinned: bool = False
    state: Literal["running", "waiting", "parked"]


def residency_reported(device_tokens: int, host_tokens: int, state: str) -> bool:
    """Whether a node lists a session in its ``CacheState``: one that holds nothing there and is not
    running or queued is left out (a router reads a missing session as an empty one), so the state a
    node streams many times a second stays the size of what it holds, not of every session it served."""
    return bool(device_tokens or host_tokens) or state != "parked"


class CacheState(_Frozen):
    """A node's KV-cache and queue state, streamed on change and periodically; read by the router."""

    node_id: Label
    model_name: Label
    block_size: Count32
    total_blocks: Count32
    free_blocks: Count32
    pinned_blocks: Count32
    host_total_blocks: Count32
    host_free_blocks: Count32
    num_waiting: Count32
    num_running: Count32
    prefill_backlog_tokens: Annotated[int, Field(ge=0, le=_INT64_MAX)]
    sessions: list[SessionResidency] = Field(default_factory=list)
    node_time_s: Seconds = 0.0
    version: Annotated[int, Field(ge=0, le=_UINT64_MAX)] = 0
    # a host-tier reload's cost per token on this node (0: no host tier, or not known yet); the router
    # and the pin rule price a context on host by it
    host_reload_s_per_token: Seconds = 0.0
    # the share of evicted contexts' tokens that the host tier gave back lately (predictors.HostHitShare);
    # 0 without a host tier: pins on it are priced as a copy back for this share, a re-prefill for the rest
    host_hit_fraction: Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)] = 0.0
    # this node process's life (a random nonzero id drawn at start; 0: a node that does not say): a new
    # epoch is a restart, an empty node
    node_epoch: Annotated[int, Field(ge=0, le=_UINT64_MAX)] = 0
    # the measured pin price's readings (predictors.PrefillShare, UnpinnedSurvival; 0: not known): the
    # share of step time spent prefilling, and of an unpinned context still on the device at its return
    prefill_share: Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)] = 0.0
    unpinned_survival: Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)] = 0.0

    @property
    def kv_utilization(self) -> float:
        """Fraction of device blocks in use, 1 - free/total; 0 for a node that reports no blocks."""
        if self.total_blocks == 0:
            return 0.0
        return 1.0 - self.free_blocks / self.total_blocks
