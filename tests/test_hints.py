"""Tests for the ``hints`` protocol package: models, proto round trips, lenient decoding, stub freshness."""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import TypeAdapter, ValidationError

import hints
from hints import (
    MAX_HORIZON_S,
    MAX_PIN_TTL_S,
    MAX_PROGRAM_AGE_S,
    CacheState,
    EvictionOrder,
    Expect,
    Hint,
    HintAck,
    HintBatch,
    HintDecodeError,
    HintResult,
    NextUse,
    Pin,
    Prefetch,
    Priority,
    Release,
    SessionResidency,
    ack_from_proto,
    ack_to_proto,
    batch_from_proto,
    batch_from_proto_lenient,
    batch_to_proto,
    cache_state_from_proto,
    cache_state_to_proto,
    engine_pb2,
    hint_from_proto,
    hint_to_proto,
)

REPO_ROOT = Path(__file__).resolve().parent.parent

# --- strategies for valid values ----------------------------------------------------------------------

_id_chars = st.characters(exclude_categories=("Cc", "Cs"))
ids = st.text(_id_chars, min_size=1, max_size=256)
opt_ids = st.text(_id_chars, max_size=256)
texts = st.text(st.characters(exclude_categories=["Cs"]), max_size=200)
int32s = st.integers(-(2**31), 2**31 - 1)
count32 = st.integers(0, 2**31 - 1)
uint64s = st.integers(0, 2**64 - 1)


def finite(lo: float, hi: float | None = None) -> st.SearchStrategy[float]:
    return st.floats(min_value=lo, max_value=hi, allow_nan=False, allow_infinity=False)


priorities = st.builds(
    Priority, session_id=ids, program_id=opt_ids, program_age_s=finite(0.0, MAX_PROGRAM_AGE_S), priority_class=int32s
)
pins = st.builds(Pin, session_id=ids, ttl_s=finite(0.0, MAX_PIN_TTL_S), reason=texts)
next_uses = st.builds(NextUse, session_id=ids, next_use_s=finite(0.0, MAX_HORIZON_S))
eviction_orders = st.builds(
    EvictionOrder, entries=st.lists(next_uses, max_size=8, unique_by=lambda n: n.session_id)
)
prefetches = st.builds(Prefetch, session_id=ids, at_s=finite(0.0, MAX_HORIZON_S))
expects = st.builds(Expect, session_id=ids, output_tokens=st.integers(0, 10_000_000))
releases = st.builds(Release, program_id=ids)
any_hint: st.SearchStrategy[Any] = st.one_of(priorities, pins, eviction_orders, prefetches, expects, releases)
batches = st.builds(
    HintBatch, batch_id=uint64s, hints=st.lists(any_hint, max_size=6), sent_unix_s=finite(0.0)
)
results = st.builds(
    HintResult,
    index=count32,
    code=st.sampled_from(["OK", "NOT_FOUND", "INVALID_ARGUMENT", "RESOURCE_EXHAUSTED"]),
    message=texts,
    clamped=st.booleans(),
    pinned_blocks=count32,
    requested_blocks=count32,
)
acks = st.builds(HintAck, batch_id=uint64s, results=st.lists(results, max_size=6))
residencies = st.builds(
    SessionResidency,
    session_id=ids,
    program_id=opt_ids,
    device_tokens=count32,
    host_tokens=count32,
    pinned=st.booleans(),
    state=st.sampled_from(["running", "waiting", "parked"]),
)
labels = st.text(_id_chars, max_size=64)
cache_states = st.builds(
    CacheState,
    node_id=labels,
    model_name=labels,
    block_size=count32,
    total_blocks=count32,
    free_blocks=count32,
    pinned_blocks=count32,
    host_total_blocks=count32,
    host_free_blocks=count32,
    num_waiting=count32,
    num_running=count32,
    prefill_backlog_tokens=st.integers(0, 2**63 - 1),
    sessions=st.lists(residencies, max_size=5),
    node_time_s=finite(0.0),
    version=uint64s,
    prefill_share=st.floats(0.0, 1.0),
    unpinned_survival=st.floats(0.0, 1.0),
)


# --- round trips --------------------------------------------------------------------------------------


@given(any_hint)
def test_hint_round_trip(h: Hint) -> None:
    pb = hint_to_proto(h)
    assert pb.WhichOneof("kind") == h.kind
    wire = engine_pb2.Hint.FromString(pb.SerializeToString())
    assert hint_from_proto(wire) == h


@given(any_hint)
def test_hint_json_round_trip_uses_discriminator(h: Hint) -> None:
    adapter: TypeAdapter[Hint] = TypeAdapter(Hint)
    assert adapter.validate_json(adapter.dump_json(h)) == h


@given(batches)
def test_batch_round_trip(batch: HintBatch) -> None:
    wire = engine_pb2.HintBatch.FromString(batch_to_proto(batch).SerializeToString())
    assert batch_from_proto(wire) == batch
    lenient = batch_from_proto_lenient(wire)
    assert lenient.batch_id == batch.batch_id
    assert lenient.hints == batch.hints
    assert lenient.sent_unix_s == batch.sent_unix_s


@given(acks)
def test_ack_round_trip(ack: HintAck) -> None:
    wire = engine_pb2.HintAck.FromString(ack_to_proto(ack).SerializeToString())
    assert ack_from_proto(wire) == ack


@given(cache_states)
def test_cache_state_round_trip(state: CacheState) -> None:
    wire = engine_pb2.CacheState.FromString(cache_state_to_proto(state).SerializeToString())
    assert cache_state_from_proto(wire) == state


@pytest.mark.parametrize("field", ["prefill_share", "unpinned_survival"])
def test_cache_state_refuses_a_reading_outside_0_1_naming_it(field: str) -> None:
    """A node's measured-price reading is a share: a message carrying 1.5 is refused, naming the field (the
    watch that decodes it reconnects; the pin price never reads it)."""
    pb = engine_pb2.CacheState(node_id="n", model_name="m", block_size=16, **{field: 1.5})
    with pytest.raises(HintDecodeError, match=field):
        cache_state_from_proto(pb)


def _proto_fields(msg: Any) -> set[str]:
    return {f.name for f in msg.DESCRIPTOR.fields}


@pytest.mark.parametrize(
    ("model", "msg"),
    [
        (Priority, engine_pb2.Priority),
        (Pin, engine_pb2.Pin),
        (NextUse, engine_pb2.NextUse),
        (EvictionOrder, engine_pb2.EvictionOrder),
        (Prefetch, engine_pb2.Prefetch),
        (Expect, engine_pb2.Expect),
        (Release, engine_pb2.Release),
        (HintBatch, engine_pb2.HintBatch),
        (HintResult, engine_pb2.HintResult),
        (HintAck, engine_pb2.HintAck),
        (SessionResidency, engine_pb2.SessionResidency),
        (CacheState, engine_pb2.CacheState),
    ],
)
def test_model_fields_match_proto(model: Any, msg: Any) -> None:
    """Conversion is by field name, so the two sides must name the same fields."""
    assert set(model.model_fields) - {"kind"} == _proto_fields(msg)


def test_hint_kinds_match_oneof() -> None:
    oneof = {f.name for f in engine_pb2.Hint.DESCRIPTOR.oneofs_by_name["kind"].fields}
    kinds = {
        m.model_fields["kind"].default for m in (Priority, Pin, EvictionOrder, Prefetch, Expect, Release)
    }
    assert kinds == oneof


# --- validation ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "field", "shown"),
    [
        ({"session_id": "s", "ttl_s": -1.0}, "ttl_s", "-1.0"),
        ({"session_id": "s", "ttl_s": math.nan}, "ttl_s", "nan"),
        ({"session_id": "s", "ttl_s": math.inf}, "ttl_s", "inf"),
        ({"session_id": "s", "ttl_s": MAX_PIN_TTL_S + 1}, "ttl_s", "86401.0"),
        ({"session_id": "", "ttl_s": 1.0}, "session_id", "''"),
        ({"session_id": "a\x00b", "ttl_s": 1.0}, "session_id", "'a\\x00b'"),
        ({"session_id": "x" * 257, "ttl_s": 1.0}, "session_id", "xxxx"),
        ({"session_id": "s", "ttl_s": 1.0, "bogus": 1}, "bogus", "1"),
    ],
)
def test_pin_rejects_bad_values_naming_field(kwargs: dict[str, Any], field: str, shown: str) -> None:
    with pytest.raises(ValidationError) as info:
        Pin(**kwargs)
    text = str(info.value)
    assert field in text
    assert shown in text


@pytest.mark.parametrize(
    ("build", "field"),
    [
        (lambda: NextUse(session_id="s", next_use_s=math.inf), "next_use_s"),
        (lambda: NextUse(session_id="s", next_use_s=MAX_HORIZON_S * 2), "next_use_s"),
        (lambda: Prefetch(session_id="s", at_s=math.nan), "at_s"),
        (lambda: Priority(session_id="s", program_age_s=-0.5), "program_age_s"),
        (lambda: Priority(session_id="s", program_age_s=1e306), "program_age_s"),  # overflowed vLLM's int
        (lambda: Expect(session_id="s", output_tokens=-1), "output_tokens"),
        (lambda: Expect(session_id="s", output_tokens=10_000_001), "output_tokens"),
        (lambda: Release(program_id=""), "program_id"),
        (lambda: HintBatch(batch_id=-1, hints=[]), "batch_id"),
        (lambda: HintResult(index=0, pinned_blocks=-3), "pinned_blocks"),
        (lambda: SessionResidency(session_id="s", state="sleeping"), "state"),  # type: ignore[arg-type]
    ],
)
def test_other_models_reject_bad_values(build: Any, field: str) -> None:
    with pytest.raises(ValidationError, match=field):
        build()


def test_eviction_order_rejects_duplicate_sessions() -> None:
    with pytest.raises(ValidationError, match="duplicate session_id 'a'"):
        EvictionOrder(entries=[NextUse(session_id="a", next_use_s=1), NextUse(session_id="a", next_use_s=2)])


def test_models_are_frozen() -> None:
    pin = Pin(session_id="s", ttl_s=1.0)
    with pytest.raises(ValidationError):
        pin.ttl_s = 2.0  # type: ignore[misc]


def test_properties() -> None:
    assert HintResult(index=0).ok
    assert not HintResult(index=0, code="NOT_FOUND").ok
    base: dict[str, Any] = dict(
        node_id="n",
        model_name="m",
        block_size=16,
        pinned_blocks=0,
        host_total_blocks=0,
        host_free_blocks=0,
        num_waiting=0,
        num_running=0,
        prefill_backlog_tokens=0,
    )
    assert CacheState(total_blocks=100, free_blocks=25, **base).kv_utilization == pytest.approx(0.75)
    assert CacheState(total_blocks=0, free_blocks=0, **base).kv_utilization == 0.0


def test_decode_rejects_non_finite_double() -> None:
    pb = engine_pb2.Hint(prefetch=engine_pb2.Prefetch(session_id="s", at_s=math.inf))
    with pytest.raises(HintDecodeError) as info:
        hint_from_proto(pb)
    message = str(info.value)
    assert "at_s" in message and "inf" in message and "\n" not in message
    assert info.value.kind == "prefetch"
    assert isinstance(info.value.__cause__, ValidationError)


def test_decode_rejects_empty_oneof() -> None:
    with pytest.raises(HintDecodeError, match="oneof"):
        hint_from_proto(engine_pb2.Hint())


def test_decode_rejects_bad_cache_state() -> None:
    pb = engine_pb2.CacheState(node_id="n", free_blocks=-1, node_time_s=math.nan)
    with pytest.raises(HintDecodeError) as info:
        cache_state_from_proto(pb)
    assert "free_blocks" in str(info.value) and "node_time_s" in str(info.value)


# --- lenient batch decoding ---------------------------------------------------------------------------


def test_lenient_batch_keeps_good_hints_and_reports_bad_by_index() -> None:
    good_pin = Pin(session_id="a", ttl_s=30.0, reason="tool:bash")
    good_release = Release(program_id="p1")
    pb = engine_pb2.HintBatch(
        batch_id=7,
        sent_unix_s=math.nan,
        hints=[
            hint_to_proto(good_pin),
            engine_pb2.Hint(pin=engine_pb2.Pin(session_id="b", ttl_s=-5.0)),
            engine_pb2.Hint(),
            hint_to_proto(good_release),
            engine_pb2.Hint(
                eviction_order=engine_pb2.EvictionOrder(
                    entries=[
                        engine_pb2.NextUse(session_id="c", next_use_s=1.0),
                        engine_pb2.NextUse(session_id=""),
                    ]
                )
            ),
        ],
    )
    decoded = batch_from_proto_lenient(pb)
    assert decoded.batch_id == 7
    assert decoded.sent_unix_s == 0.0
    assert decoded.hints[0] == good_pin
    assert decoded.hints[3] == good_release
    bad = {i: h for i, h in enumerate(decoded.hints) if isinstance(h, HintDecodeError)}
    assert sorted(bad) == [1, 2, 4]
    assert all(err.index == i for i, err in bad.items())
    assert "ttl_s" in str(bad[1]) and "-5.0" in str(bad[1])
    assert "entries.1.session_id" in str(bad[4])

    with pytest.raises(HintDecodeError) as info:
        batch_from_proto(pb)
    assert info.value.index == 1
    assert "hints[1]" in str(info.value) and "hints[4]" in str(info.value)


# --- package surface ----------------------------------------------------------------------------------


def test_all_exports_resolve() -> None:
    for name in hints.__all__:
        assert getattr(hints, name) is not None
    assert hints.engine_pb2_grpc.EngineNodeStub is not None
    with pytest.raises(AttributeError):
        _ = hints.no_such_name  # type: ignore[attr-defined]


# --- generated stubs ----------------------------------------------------------------------------------


def _codegen(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run(
        [sys.executable, "-m", "hints.codegen", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def _copy_hints(tmp_path: Path) -> Path:
    shutil.copytree(REPO_ROOT / "hints", tmp_path / "hints", ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path


def test_committed_stubs_are_fresh() -> None:
    proc = _codegen(REPO_ROOT, "--check")
    assert proc.returncode == 0, proc.stderr


def test_check_fails_on_stale_stub(tmp_path: Path) -> None:
    root = _copy_hints(tmp_path)
    stub = root / "hints" / "engine_pb2.pyi"
    stub.write_text(stub.read_text() + "\nstale: int\n")
    proc = _codegen(root, "--check")
    assert proc.returncode == 1, proc.stderr
    assert "hints/engine_pb2.pyi" in proc.stderr
    assert "hints/engine_pb2.py," not in proc.stderr  # only the touched file is named


def test_regenerates_missing_stub(tmp_path: Path) -> None:
    root = _copy_hints(tmp_path)
    (root / "hints" / "engine_pb2.py").unlink()
    assert _codegen(root, "--check").returncode == 1
    proc = _codegen(root)
    assert proc.returncode == 0, proc.stderr
    assert (root / "hints" / "engine_pb2.py").read_bytes() == (
        REPO_ROOT / "hints" / "engine_pb2.py"
    ).read_bytes()
    assert _codegen(root, "--check").returncode == 0
