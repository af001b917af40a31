"""hintflow on an unmodified vLLM: scheduler subclasses (``--scheduler-cls``, one over each of vLLM's
schedulers, synchronous and async) that enforce hintflow hints, the ``PushHints`` gRPC service served
from inside vLLM's engine-core process, engine-side hint inference, a host KV tier (a vLLM KV
connector), and a ``CacheState`` sidecar for a stock vLLM. See docs/vllm-backend.md.

This is the package's public face; code outside ``engine_adapter`` imports these names from here. Names
load on first use (PEP 562) and nothing here imports vLLM at module import time except ``_scheduler``
(which vLLM itself loads by its dotted path), so the package imports and type-checks where vLLM is
absent.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine_adapter.vllm_backend._compat import (
        TESTED_VLLM_VERSION,
        check_vllm_python,
        missing_internals,
    )
    from engine_adapter.vllm_backend._host_index import (
        HOLD_SHARE,
        HOST_RELOAD_S_PER_TOKEN,
        host_tier_config,
    )
    from engine_adapter.vllm_backend._kv_events import (
        KvResidency,
        kv_events_config,
    )
    from engine_adapter.vllm_backend._kv_sidecar import (
        serve_sidecar,
    )
    from engine_adapter.vllm_backend._kv_subscriber import (
        KvEventSubscriber,
    )
    from engine_adapter.vllm_backend._node_defaults import (
        ADMIT_MAX_WAIT_S,
        ADMIT_MAX_WAIT_S_WITH_HOST,
        AGING_S,
        FCFS_SLACK,
        FCFS_SLACK_WITH_HOST,
        HOLD_QUEUED,
        HOLD_QUEUED_WITH_HOST,
        PIN_BUDGET,
        PIN_BUDGET_WITH_HOST,
        NodeDefaults,
        node_defaults,
    )
    from engine_adapter.vllm_backend._serve import (
        ASYNC_SCHEDULER_CLS,
        AUTO_SCHEDULER_CLS,
        NODE_SETTINGS,
        REPO,
        SCHEDULER_CLS,
        TRACED_STOCK_SCHEDULER_CLS,
        build_vllm_command,
        find_vllm_python,
        serve_vllm,
        start_vllm,
        stop_vllm,
        wait_healthy,
    )
    from engine_adapter.vllm_backend._tiny_model import (
        make_tiny_model,
    )

# name -> module that defines it; loaded on first use (see the docstring)
_LAZY: dict[str, str] = {
    "TESTED_VLLM_VERSION": "engine_adapter.vllm_backend._compat",
    "check_vllm_python": "engine_adapter.vllm_backend._compat",
    "missing_internals": "engine_adapter.vllm_backend._compat",
    "ADMIT_MAX_WAIT_S": "engine_adapter.vllm_backend._node_defaults",
    "ADMIT_MAX_WAIT_S_WITH_HOST": "engine_adapter.vllm_backend._node_defaults",
    "AGING_S": "engine_adapter.vllm_backend._node_defaults",
    "FCFS_SLACK": "engine_adapter.vllm_backend._node_defaults",
    "FCFS_SLACK_WITH_HOST": "engine_adapter.vllm_backend._node_defaults",
    "HOLD_QUEUED": "engine_adapter.vllm_backend._node_defaults",
    "HOLD_QUEUED_WITH_HOST": "engine_adapter.vllm_backend._node_defaults",
    "PIN_BUDGET": "engine_adapter.vllm_backend._node_defaults",
    "PIN_BUDGET_WITH_HOST": "engine_adapter.vllm_backend._node_defaults",
    "NodeDefaults": "engine_adapter.vllm_backend._node_defaults",
    "node_defaults": "engine_adapter.vllm_backend._node_defaults",
    "HOST_RELOAD_S_PER_TOKEN": "engine_adapter.vllm_backend._host_index",
    "HOLD_SHARE": "engine_adapter.vllm_backend._host_index",
    "host_tier_config": "engine_adapter.vllm_backend._host_index",
    "KvResidency": "engine_adapter.vllm_backend._kv_events",
    "kv_events_config": "engine_adapter.vllm_backend._kv_events",
    "serve_sidecar": "engine_adapter.vllm_backend._kv_sidecar",
    "KvEventSubscriber": "engine_adapter.vllm_backend._kv_subscriber",
    "ASYNC_SCHEDULER_CLS": "engine_adapter.vllm_backend._serve",
    "AUTO_SCHEDULER_CLS": "engine_adapter.vllm_backend._serve",
    "NODE_SETTINGS": "engine_adapter.vllm_backend._serve",
    "REPO": "engine_adapter.vllm_backend._serve",
    "SCHEDULER_CLS": "engine_adapter.vllm_backend._serve",
    "TRACED_STOCK_SCHEDULER_CLS": "engine_adapter.vllm_backend._serve",
    "build_vllm_command": "engine_adapter.vllm_backend._serve",
    "find_vllm_python": "engine_adapter.vllm_backend._serve",
    "serve_vllm": "engine_adapter.vllm_backend._serve",
    "start_vllm": "engine_adapter.vllm_backend._serve",
    "stop_vllm": "engine_adapter.vllm_backend._serve",
    "wait_healthy": "engine_adapter.vllm_backend._serve",
    "make_tiny_model": "engine_adapter.vllm_backend._tiny_model",
}

__all__ = [
    "ADMIT_MAX_WAIT_S",
    "ADMIT_MAX_WAIT_S_WITH_HOST",
    "AGING_S",
    "ASYNC_SCHEDULER_CLS",
    "AUTO_SCHEDULER_CLS",
    "FCFS_SLACK",
    "FCFS_SLACK_WITH_HOST",
    "HOLD_QUEUED",
    "HOLD_QUEUED_WITH_HOST",
    "HOLD_SHARE",
    "HOST_RELOAD_S_PER_TOKEN",
    "NODE_SETTINGS",
    "PIN_BUDGET",
    "PIN_BUDGET_WITH_HOST",
    "REPO",
    "SCHEDULER_CLS",
    "TESTED_VLLM_VERSION",
    "TRACED_STOCK_SCHEDULER_CLS",
    "KvEventSubscriber",
    "KvResidency",
    "NodeDefaults",
    "build_vllm_command",
    "check_vllm_python",
    "find_vllm_python",
    "host_tier_config",
    "kv_events_config",
    "make_tiny_model",
    "missing_internals",
    "node_defaults",
    "serve_sidecar",
    "serve_vllm",
    "start_vllm",
    "stop_vllm",
    "wait_healthy",
]


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'engine_adapter.vllm_backend' has no attribute {name!r}")
    # Not cached here: each look-up reads the defining module, so what a test patches there is what
    # every caller gets (the face adds no second copy of a name to keep in step).
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
