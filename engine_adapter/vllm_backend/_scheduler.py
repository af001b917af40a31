"""The scheduler classes vLLM loads with ``--scheduler-cls``: hintflow's rules over each of vLLM's schedulers.

The rules live once, in ``_hint_scheduler.HintSchedulerMixin``; here they go in front of vLLM's two
scheduler classes:

- ``HintflowScheduler`` over ``vllm.v1.core.sched.scheduler.Scheduler`` (synchronous scheduling: each
  step's output comes back before the next step is scheduled; vLLM's CPU build always runs so);
- ``HintflowAsyncScheduler`` over ``vllm.v1.core.sched.async_scheduler.AsyncScheduler`` (async scheduling,
  vLLM 0.32's default on CUDA: step N+1 is scheduled while step N runs).
- ``HintflowAutoScheduler`` builds whichever of the two matches the engine's final config;
- ``TracedAutoScheduler`` (and its two classes): stock vLLM's scheduling, unchanged, with the step trace
  (``HINTFLOW_STEP_TRACE``), for a stock node that has no host connector to write it.

Why two classes and a chooser: vLLM 0.32 picks ``AsyncScheduler`` itself only without ``--scheduler-cls``
(``SchedulerConfig.get_scheduler_cls``); a given class is used as it is, whatever ``async_scheduling``
says, and vLLM only warns that a ``Scheduler`` subclass "will see degraded performance". A subclass of the
plain ``Scheduler`` under async scheduling cannot schedule a request's next token before the previous
step's output is back, so async scheduling is silently lost. ``AsyncScheduler`` overrides only
``__init__``, ``_update_after_schedule`` (output placeholders for the tokens in flight) and
``_update_request_with_output`` (consumes them; caches blocks up to the tokens whose KV is computed);
none of them is a method the mixin overrides, and the mixin goes first in the MRO, so each of its
``super()`` calls reaches ``AsyncScheduler``'s code where it has any and ``Scheduler``'s otherwise.
``_serve`` picks the class from the command line; ``_compat`` checks what these classes rely on.
"""

from __future__ import annotations

from typing import Any, ClassVar

from ._compat import check_vllm_names
from ._hint_scheduler import PRIORITY_SCALE, HintSchedulerMixin
from ._node_defaults import AGING_S, PIN_BUDGET
from ._step_trace import step_trace

# vLLM's scheduler classes are imported only once the check has passed: a vLLM that moved or renamed one
# fails here with the check's error naming what it lacks, not with a bare ImportError (the construction-
# time check in HintSchedulerMixin also warns about another version)
check_vllm_names()

from vllm.v1.core.sched.async_scheduler import AsyncScheduler  # type: ignore[import-not-found]  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # type: ignore[import-not-found]  # noqa: E402

__all__ = [
    "AGING_S",
    "PIN_BUDGET",
    "PRIORITY_SCALE",
    "HintflowAsyncScheduler",
    "HintflowAutoScheduler",
    "HintflowScheduler",
    "TracedAsyncScheduler",
    "TracedAutoScheduler",
    "TracedScheduler",
]


class HintflowScheduler(HintSchedulerMixin, Scheduler):  # type: ignore[misc]
    """hintflow's rules on vLLM's synchronous ``Scheduler`` (``--no-async-scheduling``, and every CPU run)."""

    hintflow_async: ClassVar[bool] = False


class HintflowAsyncScheduler(HintSchedulerMixin, AsyncScheduler):  # type: ignore[misc]
    """hintflow's rules on vLLM's ``AsyncScheduler`` (``--async-scheduling``, vLLM's default on CUDA)."""

    hintflow_async: ClassVar[bool] = True


class HintflowAutoScheduler:
    """``--scheduler-cls`` for when the command line does not say: an instance of ``HintflowAsyncScheduler``
    if vLLM's final config schedules asynchronously, else of ``HintflowScheduler``.

    Why decide in the engine core: vLLM settles ``async_scheduling`` while it builds its config (on by
    default, off for pooling models, some speculative decoding methods, executors without support and
    pipeline parallelism on the V1 model runner, and always off on CPU, whose platform hook has the last
    word) and builds the scheduler from that config, so only there is the answer certain. Python skips
    this class's ``__init__`` because ``__new__`` returns an instance of another class, fully built.
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        return _matching(HintflowScheduler, HintflowAsyncScheduler, args, kwargs)


def _matching(sync_cls: type, async_cls: type, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """An instance of whichever class matches the engine's final ``async_scheduling``."""
    config = kwargs["vllm_config"] if "vllm_config" in kwargs else args[0]  # vLLM passes keywords
    return (async_cls if config.scheduler_config.async_scheduling else sync_cls)(*args, **kwargs)


class _TraceSteps:
    """Stock vLLM's scheduling, unchanged, with each step written to the step trace (``_step_trace``), and
    the pool and queue with it (``StepTrace.pool_state``; with hintflow's host tier the connector records the
    step, from the same trace)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._trace = step_trace("vllm", async_scheduling=isinstance(self, AsyncScheduler))  # (header says which)
        if self._trace is not None:
            self._trace.pool_state = self._pool_state

    def _pool_state(self) -> list[int]:
        """Free blocks (cached ones included), no pins, waiting, running."""
        pool = self.kv_cache_manager.block_pool  # type: ignore[attr-defined]
        return [pool.get_num_free_blocks(), 0, len(self.waiting), len(self.running)]  # type: ignore[attr-defined]

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        out = super().schedule(*args, **kwargs)  # type: ignore[misc]
        if self._trace is not None:  # (a host connector records the same output too: it is written once)
            self._trace.record(out)
        return out


class TracedScheduler(_TraceSteps, Scheduler):  # type: ignore[misc]
    """Stock vLLM's ``Scheduler`` with the step trace and its pool and queue (``_serve.build_vllm_command``
    passes it to a stock node, with or without the host tier, only while ``HINTFLOW_STEP_TRACE`` is set)."""


class TracedAsyncScheduler(_TraceSteps, AsyncScheduler):  # type: ignore[misc]
    """Stock vLLM's ``AsyncScheduler`` with the step trace."""


class TracedAutoScheduler:
    """``--scheduler-cls`` of a traced stock node: the traced class that matches the engine's final config,
    as vLLM itself picks between its two without ``--scheduler-cls`` (see ``HintflowAutoScheduler``)."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        return _matching(TracedScheduler, TracedAsyncScheduler, args, kwargs)
