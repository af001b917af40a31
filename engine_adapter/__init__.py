"""The engine node: KV block pool, session contexts on two tiers, pin leases, hinted eviction, the
program-aware scheduler, executors (torch, modeled), the gRPC node, and the vLLM backend
(``engine_adapter.vllm_backend``).

This is the package's public face: code outside ``engine_adapter`` imports these names from here, never
from a private ``engine_adapter._module``. Names load on first use (PEP 562), so importing the package
imports neither torch nor grpc; static checkers see the ``TYPE_CHECKING`` imports below. The package
imports ``hints`` and ``predictors`` only (docs/architecture.md, "Which package may import which").
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine_adapter._bench import (
        run_bench,
    )
    from engine_adapter._block_pool import (
        BlockPool,
        KeyedFreeQueue,
        hash_block_tokens,
    )
    from engine_adapter._cache_replay import (
        replay_mooncake,
    )
    from engine_adapter._config import (
        ConfigError,
        EngineConfig,
        ModelSettings,
        SchedulerSettings,
        build_engine,
        load_engine_config,
    )
    from engine_adapter._context_blocks import (
        ContextHeader,
    )
    from engine_adapter._context_export import (
        ContextExport,
    )
    from engine_adapter._context_import import (
        ContextImport,
    )
    from engine_adapter._context_transfer import (
        ContextData,
    )
    from engine_adapter._cost_model import (
        CostModel,
        bundled_profiles,
        load_cost_model,
    )
    from engine_adapter._engine import (
        EngineCore,
    )
    from engine_adapter._engine_errors import (
        EngineError,
        InvalidArgument,
        ResourceExhausted,
    )
    from engine_adapter._eviction import (
        EVICTION_POLICIES,
    )
    from engine_adapter._executor import (
        CopyOp,
        Executor,
        KVLayout,
        ScheduledBatch,
        ScheduledSeq,
        StepOutput,
        VirtualClock,
    )
    from engine_adapter._kv_manager import (
        KVCacheManager,
        KVStats,
    )
    from engine_adapter._lost_context import (
        LOST_CAUSES,
    )
    from engine_adapter._metrics import (
        EngineMetrics,
    )
    from engine_adapter._modeled_executor import (
        ModeledExecutor,
    )
    from engine_adapter._profile import (
        fit_nonneg,
        profile_torch_executor,
    )
    from engine_adapter._request import (
        Request,
        RequestState,
    )
    from engine_adapter._scheduler import (
        SchedulerConfig,
    )
    from engine_adapter._server import (
        RunningNode,
        start_node,
    )
    from engine_adapter._session import (
        Session,
        SessionState,
    )
    from engine_adapter._torch_executor import (
        TorchExecutor,
        TorchModelConfig,
        make_torch_executor,
        retain_freed_memory,
    )

# name -> module that defines it; loaded on first use (see the docstring)
_LAZY: dict[str, str] = {
    "run_bench": "engine_adapter._bench",
    "BlockPool": "engine_adapter._block_pool",
    "KeyedFreeQueue": "engine_adapter._block_pool",
    "hash_block_tokens": "engine_adapter._block_pool",
    "replay_mooncake": "engine_adapter._cache_replay",
    "ConfigError": "engine_adapter._config",
    "EngineConfig": "engine_adapter._config",
    "ModelSettings": "engine_adapter._config",
    "SchedulerSettings": "engine_adapter._config",
    "build_engine": "engine_adapter._config",
    "load_engine_config": "engine_adapter._config",
    "ContextHeader": "engine_adapter._context_blocks",
    "ContextExport": "engine_adapter._context_export",
    "ContextImport": "engine_adapter._context_import",
    "ContextData": "engine_adapter._context_transfer",
    "CostModel": "engine_adapter._cost_model",
    "bundled_profiles": "engine_adapter._cost_model",
    "load_cost_model": "engine_adapter._cost_model",
    "EngineCore": "engine_adapter._engine",
    "EngineError": "engine_adapter._engine_errors",
    "InvalidArgument": "engine_adapter._engine_errors",
    "ResourceExhausted": "engine_adapter._engine_errors",
    "EVICTION_POLICIES": "engine_adapter._eviction",
    "CopyOp": "engine_adapter._executor",
    "Executor": "engine_adapter._executor",
    "KVLayout": "engine_adapter._executor",
    "ScheduledBatch": "engine_adapter._executor",
    "ScheduledSeq": "engine_adapter._executor",
    "StepOutput": "engine_adapter._executor",
    "VirtualClock": "engine_adapter._executor",
    "KVCacheManager": "engine_adapter._kv_manager",
    "KVStats": "engine_adapter._kv_manager",
    "LOST_CAUSES": "engine_adapter._lost_context",
    "EngineMetrics": "engine_adapter._metrics",
    "ModeledExecutor": "engine_adapter._modeled_executor",
    "fit_nonneg": "engine_adapter._profile",
    "profile_torch_executor": "engine_adapter._profile",
    "Request": "engine_adapter._request",
    "RequestState": "engine_adapter._request",
    "SchedulerConfig": "engine_adapter._scheduler",
    "RunningNode": "engine_adapter._server",
    "start_node": "engine_adapter._server",
    "Session": "engine_adapter._session",
    "SessionState": "engine_adapter._session",
    "TorchExecutor": "engine_adapter._torch_executor",
    "TorchModelConfig": "engine_adapter._torch_executor",
    "make_torch_executor": "engine_adapter._torch_executor",
    "retain_freed_memory": "engine_adapter._torch_executor",
}

__all__ = [
    "EVICTION_POLICIES",
    "LOST_CAUSES",
    "BlockPool",
    "ConfigError",
    "ContextData",
    "ContextExport",
    "ContextHeader",
    "ContextImport",
    "CopyOp",
    "CostModel",
    "EngineConfig",
    "EngineCore",
    "EngineError",
    "EngineMetrics",
    "Executor",
    "InvalidArgument",
    "KVCacheManager",
    "KVLayout",
    "KVStats",
    "KeyedFreeQueue",
    "ModelSettings",
    "ModeledExecutor",
    "Request",
    "RequestState",
    "ResourceExhausted",
    "RunningNode",
    "ScheduledBatch",
    "ScheduledSeq",
    "SchedulerConfig",
    "SchedulerSettings",
    "Session",
    "SessionState",
    "StepOutput",
    "TorchExecutor",
    "TorchModelConfig",
    "VirtualClock",
    "build_engine",
    "bundled_profiles",
    "fit_nonneg",
    "hash_block_tokens",
    "load_cost_model",
    "load_engine_config",
    "make_torch_executor",
    "profile_torch_executor",
    "replay_mooncake",
    "retain_freed_memory",
    "run_bench",
    "start_node",
]


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'engine_adapter' has no attribute {name!r}")
    # Not cached here: each look-up reads the defining module, so what a test patches there is what
    # every caller gets (the face adds no second copy of a name to keep in step).
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
