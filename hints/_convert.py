"""Conversion between the pydantic models (``hints._models``) and their protobuf wire form.

Field names are identical on both sides, so conversion is by name: a model's ``model_dump()`` feeds the
message constructor, and a message's fields feed ``model_validate``. That keeps this module small and makes
drift loud: a field added to the .proto but not the model fails decoding (``extra="forbid"``), and one added
to the model but not the .proto fails encoding (protobuf rejects unknown constructor keywords).

Decoding always validates, because proto3 accepts anything its types can hold: NaN and inf in a ``double``,
negative ``int32`` counts, an empty ``oneof``. Failures surface as :class:`HintDecodeError` with a one-line
message naming the field and the bad value, ready to go into a ``HintResult.message``.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple, TypeVar

from google.protobuf.message import Message
from pydantic import BaseModel, ValidationError

from hints import engine_pb2
from hints._models import (
    CacheState,
    EvictionOrder,
    Expect,
    Hint,
    HintAck,
    HintBatch,
    HintModel,
    Pin,
    Prefetch,
    Priority,
    Release,
)

_M = TypeVar("_M", bound=Message)
_B = TypeVar("_B", bound=BaseModel)

_HINT_KINDS: dict[str, tuple[type[HintModel], type[Message]]] = {
    "priority": (Priority, engine_pb2.Priority),
    "pin": (Pin, engine_pb2.Pin),
    "eviction_order": (EvictionOrder, engine_pb2.EvictionOrder),
    "prefetch": (Prefetch, engine_pb2.Prefetch),
    "expect": (Expect, engine_pb2.Expect),
    "release": (Release, engine_pb2.Release),
}
"""Hint ``kind`` -> (model, message); the keys are the field names of the ``Hint.kind`` oneof."""

_MAX_INPUT_REPR = 80


class HintDecodeError(ValueError):
    """A protobuf message that does not decode to a valid model.

    ``index`` is the position of the hint in its batch when known, ``kind`` the hint kind when known, so
    a node can answer INVALID_ARGUMENT for that one hint and still apply the rest of the batch.
    """

    def __init__(self, message: str, *, kind: str | None = None, index: int | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.index = index


class DecodedBatch(NamedTuple):
    """A leniently decoded :class:`HintBatch`: each hint is a model, or the error that stopped it."""

    batch_id: int
    hints: list[Hint | HintDecodeError]
    sent_unix_s: float
    node_epoch: int = 0  # the node life the batch is meant for (0: any)


def _one_line(err: ValidationError) -> str:
    """Pydantic's errors as ``field: message (got value)``, joined on one line for logs and acks."""
    parts = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "<message>"
        got = repr(e.get("input"))
        if len(got) > _MAX_INPUT_REPR:
            got = got[: _MAX_INPUT_REPR - 3] + "..."
        parts.append(f"{loc}: {e['msg']} (got {got})")
    return "; ".join(parts)


def _fields(pb: Message) -> dict[str, Any]:
    """All fields of a message as plain Python values (sub-messages as dicts), defaults included."""
    out: dict[str, Any] = {}
    for field in pb.DESCRIPTOR.fields:
        value = getattr(pb, field.name)
        if isinstance(value, Message):
            out[field.name] = _fields(value)
        elif field.message_type is not None:
            out[field.name] = [_fields(item) for item in value]
        elif isinstance(value, str | bytes | bool | int | float):
            out[field.name] = value
        else:
            out[field.name] = list(value)
    return out


def _to_pb(model: BaseModel, cls: type[_M]) -> _M:
    """Build message ``cls`` from a model's fields (minus the ``kind`` tag; nested models as dicts)."""
    return cls(**model.model_dump(exclude={"kind"}))


def _from_pb(pb: Message, cls: type[_B], what: str) -> _B:
    """Validate a message's fields as model ``cls``; a failure becomes a one-line HintDecodeError."""
    try:
        return cls.model_validate(_fields(pb))
    except ValidationError as exc:
        raise HintDecodeError(f"invalid {what}: {_one_line(exc)}") from exc


# --- hints -------------------------------------------------------------------------------------------


def hint_to_proto(h: Hint) -> engine_pb2.Hint:
    """One hint model as the ``Hint`` oneof message."""
    _, pb_cls = _HINT_KINDS[h.kind]
    pb = engine_pb2.Hint()
    getattr(pb, h.kind).CopyFrom(_to_pb(h, pb_cls))
    return pb


def hint_from_proto(pb: engine_pb2.Hint) -> Hint:
    """Decode and validate one ``Hint`` message; raises :class:`HintDecodeError` naming the problem."""
    kind = pb.WhichOneof("kind")
    if kind is None:
        raise HintDecodeError(
            "empty hint: no field of the 'kind' oneof is set (or a kind this version does not know)"
        )
    model_cls, _ = _HINT_KINDS[kind]
    try:
        return model_cls.model_validate(_fields(getattr(pb, kind)))
    except ValidationError as exc:
        raise HintDecodeError(f"invalid {kind} hint: {_one_line(exc)}", kind=kind) from exc


# --- batches -----------------------------------------------------------------------------------------


def batch_to_proto(batch: HintBatch) -> engine_pb2.HintBatch:
    """A batch model as its message."""
    return engine_pb2.HintBatch(
        batch_id=batch.batch_id,
        hints=[hint_to_proto(h) for h in batch.hints],
        sent_unix_s=batch.sent_unix_s,
        node_epoch=batch.node_epoch,
    )


def batch_from_proto_lenient(pb: engine_pb2.HintBatch) -> DecodedBatch:
    """Decode a batch hint by hint, keeping each failure in place of its hint.

    A server rejects one bad hint with its own ``HintResult`` and applies the rest, rather than dropping
    the batch. Each error carries its ``index``. A non-finite or negative ``sent_unix_s`` (used only for a
    latency metric) reads as 0.0, "not given", rather than failing the batch.
    """
    hints: list[Hint | HintDecodeError] = []
    for index, hint_pb in enumerate(pb.hints):
        try:
            hints.append(hint_from_proto(hint_pb))
        except HintDecodeError as exc:
            exc.index = index
            hints.append(exc)
    sent = pb.sent_unix_s
    sent_unix_s = sent if math.isfinite(sent) and sent >= 0.0 else 0.0
    return DecodedBatch(batch_id=pb.batch_id, hints=hints, sent_unix_s=sent_unix_s, node_epoch=pb.node_epoch)


def batch_from_proto(pb: engine_pb2.HintBatch) -> HintBatch:
    """Decode a whole batch strictly: any bad hint fails it, with every bad hint named by index."""
    decoded = batch_from_proto_lenient(pb)
    errors = [h for h in decoded.hints if isinstance(h, HintDecodeError)]
    if errors:
        listed = "; ".join(f"hints[{e.index}]: {e}" for e in errors)
        raise HintDecodeError(
            f"{len(errors)} invalid hint(s) in batch {pb.batch_id}: {listed}", index=errors[0].index
        )
    good = [h for h in decoded.hints if not isinstance(h, HintDecodeError)]
    try:
        return HintBatch(batch_id=pb.batch_id, hints=good, sent_unix_s=pb.sent_unix_s, node_epoch=pb.node_epoch)
    except ValidationError as exc:
        raise HintDecodeError(f"invalid HintBatch: {_one_line(exc)}") from exc


# --- replies -----------------------------------------------------------------------------------------


def ack_to_proto(ack: HintAck) -> engine_pb2.HintAck:
    """An ack model as its message."""
    return _to_pb(ack, engine_pb2.HintAck)


def ack_from_proto(pb: engine_pb2.HintAck) -> HintAck:
    """Decode and validate a ``HintAck``; raises :class:`HintDecodeError`."""
    return _from_pb(pb, HintAck, "HintAck")


def cache_state_to_proto(state: CacheState) -> engine_pb2.CacheState:
    """A cache-state model as its message."""
    return _to_pb(state, engine_pb2.CacheState)


def cache_state_from_proto(pb: engine_pb2.CacheState) -> CacheState:
    """Decode and validate a ``CacheState``; raises :class:`HintDecodeError`."""
    return _from_pb(pb, CacheState, "CacheState")
