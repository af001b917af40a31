"""What vLLM's async scheduling changes for hintflow's scheduler: steps in flight, and the class to use.

With async scheduling vLLM schedules step N+1 before step N's output arrives
(``EngineCore.step_with_batch_queue``: up to ``VllmConfig.max_concurrent_batches`` steps out, 2 with async
scheduling on the V1 model runner), so "the step" is no longer the one just scheduled. Two of hintflow's
rules read it (:class:`StepsInFlight`):

- the deadlock rule (a step that schedules nothing while work waits unpins a program) must not fire while
  an earlier step still computes tokens: ``AsyncScheduler`` schedules nothing for a request whose last
  token is already in flight, and that step's output may finish requests and free their blocks;
- the reload cost (seconds per prefilled token) needs a step's compute time: the device runs steps in
  order, so a step computes from when it was scheduled or when the previous step's output arrived,
  whichever is later. With synchronous scheduling that is from when it was scheduled, as before.

And vLLM takes a ``--scheduler-cls`` as given whatever ``async_scheduling`` is
(``SchedulerConfig.get_scheduler_cls``), so a class that does not match the engine runs, at a cost that
:func:`log_async_mode` names at start-up.

No vLLM import: the scheduler hands in its ``SchedulerOutput`` objects (compared by identity) and flags.
"""

from __future__ import annotations

import logging
import math
from collections import deque

__all__ = ["StepsInFlight", "log_async_mode"]

log = logging.getLogger("vllm.hintflow")  # under vLLM's logger in the engine core: its handlers print


class StepsInFlight:
    """Scheduled steps whose output has not come back, in the order vLLM returns them (its batch queue is
    first in, first out)."""

    MAX_STEPS = 64
    """A bound, not a depth vLLM reaches (it keeps at most pipeline depth + 1 steps out): a step whose
    output never comes back (an engine error mid-step) must not hold its ``SchedulerOutput`` forever."""

    def __init__(self) -> None:
        self._steps: deque[tuple[object, float, int, int]] = deque(maxlen=self.MAX_STEPS)
        self._last_return_s = -math.inf

    def __len__(self) -> int:
        return len(self._steps)

    def scheduled(self, output: object, tokens: int, now_s: float, num_decodes: int = 0) -> None:
        """vLLM's scheduler produced ``output`` (``tokens`` scheduled, ``num_decodes`` of them one-token
        decodes) at ``now_s``."""
        self._steps.append((output, now_s, tokens, num_decodes))

    @property
    def computing(self) -> bool:
        """Whether a step that scheduled tokens is still out: progress is pending."""
        return any(tokens for _, _, tokens, _ in self._steps)

    def returned(self, output: object, now_s: float) -> tuple[int, float, int] | None:
        """``output``'s step came back at ``now_s``: its (tokens, seconds of compute, decodes), or None when
        it was not recorded here. Steps recorded before it are dropped (vLLM returns steps in order, so they
        will not come back)."""
        last, self._last_return_s = self._last_return_s, now_s
        for i, (out, scheduled_s, tokens, num_decodes) in enumerate(self._steps):
            if out is output:
                for _ in range(i + 1):
                    self._steps.popleft()
                return tokens, now_s - max(scheduled_s, last), num_decodes
        return None


def log_async_mode(name: str, class_async: bool, engine_async: bool | None) -> None:
    """Log which scheduler class runs in which mode; warn, saying the cost, when they do not match."""
    if engine_async and not class_async:
        log.warning(
            "hintflow: vLLM schedules asynchronously but %s extends the synchronous Scheduler: it cannot "
            "schedule a request's next token before the previous step's output arrives, so the overlap "
            "async scheduling buys is lost; use HintflowAsyncScheduler (or HintflowAutoScheduler)",
            name,
        )
    elif class_async and not engine_async:
        log.warning(
            "hintflow: %s on an engine that steps synchronously (async_scheduling is off; vLLM's CPU "
            "platform always turns it off): it works, but HintflowScheduler is the match",
            name,
        )
    else:
        log.info("hintflow: %s, vLLM async scheduling %s", name, "on" if engine_async else "off")
