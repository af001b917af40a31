"""hintflow's protocol: the hint vocabulary, the engine node's replies, and their gRPC wire form.

Both sides depend on this package and it depends on neither, so it imports nothing else of ours.

Exports resolve lazily (PEP 562): ``from hints import Pin`` works as usual, but importing the package
does not import the generated stubs. That is so ``python -m hints.codegen`` (which imports this package
first) can still regenerate stubs that are missing, stale, or made by a protobuf newer than the one
installed. Static checkers see the ``TYPE_CHECKING`` imports below.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hints import engine_pb2, engine_pb2_grpc
    from hints._client import IMPORT_ACK_KEY, EngineClient, GenerateChunk, GenerateResult
    from hints._convert import (
        DecodedBatch,
        HintDecodeError,
        ack_from_proto,
        ack_to_proto,
        batch_from_proto,
        batch_from_proto_lenient,
        batch_to_proto,
        cache_state_from_proto,
        cache_state_to_proto,
        hint_from_proto,
        hint_to_proto,
    )
    from hints._epoch import new_node_epoch, stale_batch_results
    from hints._models import (
        MAX_HORIZON_S,
        MAX_PIN_TTL_S,
        MAX_PROGRAM_AGE_S,
        CacheState,
        EvictionOrder,
        Expect,
        Hint,
        HintAck,
        HintBatch,
        HintModel,
        HintResult,
        NextUse,
        OptionalProgramId,
        Pin,
        Prefetch,
        Priority,
        Release,
        SessionId,
        SessionResidency,
        residency_reported,
    )
    from hints._move import ContextMove, ContextMoveError, move_context
    from hints._nodes import EngineSpec, parse_engine
    from hints._vllm_client import VllmClient, VllmError, VllmFailed, VllmRejected, VllmUnreachable

__all__ = [
    "IMPORT_ACK_KEY",
    "MAX_HORIZON_S",
    "MAX_PIN_TTL_S",
    "MAX_PROGRAM_AGE_S",
    "CacheState",
    "ContextMove",
    "ContextMoveError",
    "DecodedBatch",
    "EngineClient",
    "EngineSpec",
    "EvictionOrder",
    "Expect",
    "GenerateChunk",
    "GenerateResult",
    "Hint",
    "HintAck",
    "HintBatch",
    "HintDecodeError",
    "HintModel",
    "HintResult",
    "NextUse",
    "OptionalProgramId",
    "Pin",
    "Prefetch",
    "Priority",
    "Release",
    "SessionId",
    "SessionResidency",
    "VllmClient",
    "VllmError",
    "VllmFailed",
    "VllmRejected",
    "VllmUnreachable",
    "ack_from_proto",
    "ack_to_proto",
    "batch_from_proto",
    "batch_from_proto_lenient",
    "batch_to_proto",
    "cache_state_from_proto",
    "cache_state_to_proto",
    "engine_pb2",
    "engine_pb2_grpc",
    "hint_from_proto",
    "hint_to_proto",
    "move_context",
    "new_node_epoch",
    "parse_engine",
    "residency_reported",
    "stale_batch_results",
]

_MODULES = frozenset({"engine_pb2", "engine_pb2_grpc"})
_CLIENT = frozenset({"IMPORT_ACK_KEY", "EngineClient", "GenerateChunk", "GenerateResult"})
_MOVE = frozenset({"ContextMove", "ContextMoveError", "move_context"})
_NODES = frozenset({"EngineSpec", "parse_engine"})
_EPOCH = frozenset({"new_node_epoch", "stale_batch_results"})
_VLLM = frozenset({"VllmClient", "VllmError", "VllmFailed", "VllmRejected", "VllmUnreachable"})
_CONVERT = frozenset(
    {
        "DecodedBatch",
        "HintDecodeError",
        "ack_from_proto",
        "ack_to_proto",
        "batch_from_proto",
        "batch_from_proto_lenient",
        "batch_to_proto",
        "cache_state_from_proto",
        "cache_state_to_proto",
        "hint_from_proto",
        "hint_to_proto",
    }
)


def __getattr__(name: str) -> Any:
    """Import an export on first use and cache it in the module namespace."""
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if name in _MODULES:
        value = importlib.import_module(f"{__name__}.{name}")
    else:
        source = (
            "._client" if name in _CLIENT
            else "._move" if name in _MOVE
            else "._nodes" if name in _NODES
            else "._vllm_client" if name in _VLLM
            else "._convert" if name in _CONVERT
            else "._epoch" if name in _EPOCH
            else "._models"
        )  # fmt: skip
        value = getattr(importlib.import_module(source, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
