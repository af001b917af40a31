"""The scheduler classes vLLM loads with ``--scheduler-cls``: hintflow's rules over each of vLLM's schedulers.

The rules live once, in ``_hint_scheduler.HintSchedulerMixin``; here they go in front of vLLM's two
scheduler classes:

- ``HintflowScheduler`` over ``vllm.v1.core.sched.scheduler.Scheduler`` (synchronous scheduling: each
  step's output comes back before the next step is scheduled; vLLM's CPU build always runs so);
- ``HintflowAsyncScheduler`` over ``vllm.v1.core.sched.async_scheduler.AsyncScheduler`` (async scheduling,
  vLLM 0.32's default on CUDA: step N+1 is scheduled while step N runs).
- ``HintflowAutoScheduler`` builds whichever of the two matches the engine's final config.

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
from ._hint_scheduler import AGING_S, PIN_BUDGET, PRIORITY_SCALE, HintSchedulerMixin

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
        config = kwargs["vllm_config"] if "vllm_config" in kwargs else args[0]  # vLLM passes keywords
        chosen = HintflowAsyncScheduler if config.scheduler_config.async_scheduling else HintflowScheduler
        return chosen(*args, **kwargs)
