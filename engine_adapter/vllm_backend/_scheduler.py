"""``HintflowScheduler``: vLLM's own scheduler, plus hintflow's pins, Release and program-level priority.

Loaded by vLLM in its engine-core process with
``--scheduler-cls engine_adapter.vllm_backend._scheduler.HintflowScheduler``. It only subclasses
``vllm.v1.core.sched.scheduler.Scheduler`` and calls the block pool's public methods; every scheduling
decision stays vLLM's. What it adds, and where:

- ``add_request``: the request joins its session (vLLM's ``Request.session_id``, set from the OpenAI
  request's ``session_id`` field, the ``X-Session-ID`` header or ``vllm_xargs.session_id``) and program
  (``vllm_xargs.program_id``, which vLLM hands through as ``sampling_params.extra_args``); under
  ``--scheduling-policy priority`` its ``priority`` becomes ``class * 10**12 + program start in ms``, so
  the older program goes first (Continuum's program-level FCFS) and the client's own priority, or a
  ``Priority`` hint's class, still dominates.
- ``_free_request_blocks`` (the step where vLLM returns a finished request's blocks): the session's book
  takes the blocks, holds the pinned prefix and frees the rest in vLLM's order.
- ``schedule``: expire leases first; afterwards mark the session's admitted turn (consuming its pin), and
  if the step scheduled nothing while work waits and pins hold blocks, unpin the latest program
  (deadlock rule; the next step can then admit).

All of it runs under ``self.hint_lock``, which the hint service (another thread) takes too.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import TYPE_CHECKING, Any

from vllm.v1.core.sched.request_queue import SchedulingPolicy  # type: ignore[import-not-found]
from vllm.v1.core.sched.scheduler import Scheduler  # type: ignore[import-not-found]

from ._sessions import SessionBook, VSession

if TYPE_CHECKING:
    from ._hint_service import HintServer

__all__ = ["PRIORITY_SCALE", "HintflowScheduler"]

log = logging.getLogger(__name__)

PRIORITY_SCALE = 10**12
"""Milliseconds of program age fit below this (31 years), so ``class * scale + ms`` orders by class first."""


class HintflowScheduler(Scheduler):  # type: ignore[misc]
    """See the module docstring. Env: HINTFLOW_HINT_PORT, HINTFLOW_PIN_BUDGET, HINTFLOW_NODE_ID."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.hint_lock = threading.RLock()
        pool = self.kv_cache_manager.block_pool
        self.pins_supported = len(self.kv_cache_config.kv_cache_groups) == 1 and pool.enable_caching
        budget = float(os.environ.get("HINTFLOW_PIN_BUDGET", "0.5"))
        self.book = SessionBook(pool, pool.num_gpu_blocks - 1, pin_budget_fraction=budget)  # -1: null block
        self._req_session: dict[str, VSession] = {}
        self._client_priority: dict[str, int] = {}
        self.node_id = os.environ.get("HINTFLOW_NODE_ID", "vllm")
        self.model_name = str(self.vllm_config.model_config.served_model_name)
        self._epoch_s = self.book.clock()
        self.hint_server: HintServer | None = None
        port = os.environ.get("HINTFLOW_HINT_PORT")
        if port:
            from ._hint_service import start_hint_server

            self.hint_server = start_hint_server(self, int(port), os.environ.get("HINTFLOW_HINT_HOST", "127.0.0.1"))
            log.info("hintflow hint service on port %d", self.hint_server.port)
        if not self.pins_supported:
            log.warning("hintflow: pins need prefix caching and one KV cache group; hints are only recorded")

    # ---- requests in -------------------------------------------------------------------------
    def add_request(self, request: Any) -> None:
        with self.hint_lock:
            sid = getattr(request, "session_id", None)
            if sid and request.request_id not in self.requests:
                extra = (request.sampling_params.extra_args or {}) if request.sampling_params else {}
                s = self.book.session(str(sid), str(extra.get("program_id") or ""))
                self.book.on_request_added(s, request.request_id)
                self._req_session[request.request_id] = s
                self._client_priority[request.request_id] = request.priority
                request.priority = self.priority_for(s, request.priority)
            super().add_request(request)

    def priority_for(self, s: VSession, client_priority: int) -> int:
        """vLLM priority (lower first): hinted class, else the client's; then the program's start."""
        if self.policy != SchedulingPolicy.PRIORITY:
            return client_priority
        major = s.priority_class if s.priority_class is not None else client_priority
        start = s.program_start_s if s.program_start_s is not None else s.first_seen_s
        ms = max(0, int((start - self._epoch_s + 86400.0) * 1000))  # + a day: hinted ages reach back
        return major * PRIORITY_SCALE + min(ms, PRIORITY_SCALE - 1)

    def reprioritize(self, s: VSession) -> int:
        """Re-key the session's queued requests after a Priority hint (the queue is a heap)."""
        if self.policy != SchedulingPolicy.PRIORITY:
            return 0
        moved = 0
        for queue in (self.waiting, self.kv_holding_waiting):
            reqs = [r for r in queue if r.request_id in s.live]
            if reqs:
                queue.remove_requests(reqs)
                for r in reqs:
                    r.priority = self.priority_for(s, self._client_priority.get(r.request_id, 0))
                    queue.add_request(r)
                moved += len(reqs)
        return moved

    # ---- the step --------------------------------------------------------------------------------
    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        with self.hint_lock:
            self.book.expire()
            out = super().schedule(*args, **kwargs)
            for new in out.scheduled_new_reqs:
                s = self._req_session.get(new.req_id)
                if s is not None:
                    self.book.on_admitted(s, new.req_id)
            starved = out.total_num_scheduled_tokens == 0 and (len(self.waiting) or len(self.running))
            if starved and self.book.num_pinned_blocks and self.book.force_unpin_latest():
                log.info("hintflow: pins blocked all progress; unpinned the latest program")
            return out

    def update_from_output(self, *args: Any, **kwargs: Any) -> Any:
        with self.hint_lock:
            return super().update_from_output(*args, **kwargs)

    def finish_requests(self, *args: Any, **kwargs: Any) -> Any:
        with self.hint_lock:
            return super().finish_requests(*args, **kwargs)

    def _free_request_blocks(self, request: Any) -> None:
        s = self._req_session.pop(request.request_id, None)
        self._client_priority.pop(request.request_id, None)
        if s is None or not self.pins_supported or not self._request_blocks_can_be_freed(request):
            if s is not None:
                self.book.on_request_finished(s, request.request_id, [])
            super()._free_request_blocks(request)
            return
        blocks = self.kv_cache_manager.pop_blocks_for_free(request)
        self.book.on_request_finished(s, request.request_id, blocks)

    def shutdown(self) -> None:
        if self.hint_server is not None:
            self.hint_server.stop()
            self.hint_server = None
        super().shutdown()

    # ---- for the hint service and tests -------------------------------------------------------------
    def prefill_backlog_tokens(self) -> int:
        """Prompt tokens still to compute, waiting and running (the router's queueing signal)."""
        total = 0
        for r in [*self.waiting, *self.running]:
            total += max(0, r.num_prompt_tokens - r.num_computed_tokens)
        return total
