"""hintflow's rules on vLLM's scheduler, as a mixin: pins, Release, program-level priority, admission.

``_scheduler`` applies it to both of vLLM's schedulers (``HintflowScheduler`` over ``Scheduler``,
``HintflowAsyncScheduler`` over ``AsyncScheduler``), so the rules exist once. It only overrides
scheduler methods and calls the block pool's public methods; every scheduling decision stays vLLM's.
What it adds, and where:

- ``add_request``: the request joins its session (vLLM's ``Request.session_id``, set from the OpenAI
  request's ``session_id`` field, the ``X-Session-ID`` header or ``vllm_xargs.session_id``) and program
  (``vllm_xargs.program_id``, which vLLM hands through as ``sampling_params.extra_args``); under
  ``--scheduling-policy priority`` its ``priority`` becomes ``class * 10**12 + program start in ms``, so
  the older program goes first (Continuum's program-level FCFS) and the client's own priority, or a
  ``Priority`` hint's class, still dominates.
- ``_free_request_blocks`` (where vLLM returns a request's blocks: when it finishes, and when vLLM
  preempts it): for a finished request the session's book takes the blocks, holds the pinned prefix and
  frees the rest in vLLM's order (under vLLM's deferred block free, ``defer_block_free``, vLLM frees them
  later and the book only holds the pinned prefix). A preempted request's turn goes on: its blocks go
  back to vLLM as usual and only its session's "admitted" mark is taken back until vLLM resumes it.
- ``schedule``: expire leases first; afterwards mark the session's admitted turn (consuming its pin) and
  resumed requests as admitted again, and if the step scheduled nothing while work waits, pins hold
  blocks and no earlier step is still computing (``_async_mode``: async scheduling keeps steps out),
  unpin the latest program (deadlock rule; the next step can then admit).
- ``reset_prefix_cache`` (vLLM's cache reset, e.g. ``pause_generation(clear_cache=True)``): every pin is
  dropped first, under the lock, so the reset can succeed.
- inferred hints (``_infer.HintInference``, ``HINTFLOW_INFER_HINTS``, default on): requests that carry
  only ``vllm_xargs.program_id`` (``tool``, ``is_last_turn``) get Continuum-style pins and releases from
  measured pauses; a request without ``session_id`` uses its ``program_id`` as the session.
- work conservation: before each step, pins of programs younger than the head of the queue are dropped
  (youngest first) until that head fits, so a pin never keeps an older program's turn out of the pool.
- program admission (``_handle_blocked_waiting_request``, vLLM's per-request "may this waiting request
  be scheduled in this step" check): the first turn of a program the engine has not yet run is admitted
  only while the contexts of the programs already in flight, plus its prompt, fit in the pool; it is
  admitted anyway when the engine would otherwise idle (nothing running, nothing else admissible) or once
  it has waited ``HINTFLOW_ADMIT_MAX_WAIT_S``. Held-back requests stay in vLLM's waiting queue and the
  requests behind them are scheduled as usual (vLLM's own skip path).
- bounded program FCFS: an older program's turn gets at most ``HINTFLOW_PRIORITY_AGING_S`` of head start
  over a newer arrival, so first turns age instead of starving.
- per-request accounting (``_accounting.RequestAccounting``, exported by ``_metrics``): each request's
  prompt is split into cache hits, across-turn history, recomputed and within-turn tokens when ``schedule``
  first schedules it; its first token is noted after ``update_from_output``; ``_free_request_blocks``
  keeps the tokens a finished request computed as its session's history for the next turn.
- session and program ids must be ones the protocol can carry (``hints._models.SessionId``, at most 256
  characters, no control characters): a request with another id is left to vLLM, as one without a
  session is (logged once), so it can never break ``GetCacheState`` for the node.

All of it runs under ``self.hint_lock``, which the hint service (another thread) takes too. Every vLLM
internal used here (and in the modules it drives) is listed in ``_compat.REQUIRED`` and checked when the
scheduler is constructed: a vLLM that lacks one fails at start-up, naming it.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import TypeAdapter, ValidationError

from engine_adapter._engine_errors import FailedPrecondition
from engine_adapter._fcfs_bound import FcfsBound
from engine_adapter._queue_place import WARM_THRESHOLD_TOKENS, holds_pin, is_warm, queue_place
from hints import OptionalProgramId, SessionId, new_node_epoch
from predictors import HostHitShare, PrefillShare, UnpinnedSurvival

from ._accounting import RequestAccounting
from ._admission import ADMIT_HORIZON_S, CLASS_SCALE, PRIORITY_SCALE, QueueRules
from ._async_mode import StepsInFlight, log_async_mode
from ._compat import check_vllm_internals
from ._context_moves import KvLayout, kv_layout
from ._host_index import HOST_RELOAD_S_PER_TOKEN
from ._infer import HintInference, env_float, env_on, infer_enabled
from ._node_defaults import AGING_S, node_defaults, pin_budget
from ._sessions import SessionBook, VSession
from ._step_times import StepTimes
from ._step_trace import step_trace
from ._warm import num_cached_tokens

if TYPE_CHECKING:
    from ._hint_service import HintServer

    # Checked as what it ends up in, a subclass of vLLM's Scheduler (Any where mypy runs: no vLLM there);
    # at run time a plain mixin, so this module imports no vLLM.
    _VllmScheduler = Any
else:
    _VllmScheduler = object

__all__ = ["HOST_RELOAD_S_PER_TOKEN", "PRIORITY_SCALE", "HintSchedulerMixin"]

log = logging.getLogger("vllm.hintflow")  # under vLLM's logger: its handlers print INFO

_SESSION_ID: TypeAdapter[str] = TypeAdapter(SessionId)
_PROGRAM_ID: TypeAdapter[str] = TypeAdapter(OptionalProgramId)

def _pinned(pinned_first: bool, s: VSession) -> bool:
    """Whether the session's queued turns take the pinned band (``HINTFLOW_PINNED_FIRST`` and a live pin
    that holds blocks, ``holds_pin``)."""
    return pinned_first and not s.queue_hold and holds_pin(s.pin_deadline_s, len(s.held))


class HintSchedulerMixin(QueueRules, _VllmScheduler):
    """Goes before vLLM's scheduler class in the bases (``_scheduler``); see the module docstring.

    Env (defaults that depend on the host tier: ``_node_defaults``): HINTFLOW_HINT_PORT, HINTFLOW_PIN_BUDGET
    (unset: PIN_BUDGET, or PIN_BUDGET_WITH_HOST with the host tier), HINTFLOW_NODE_ID, HINTFLOW_INFER_HINTS (1),
    HINTFLOW_INFER_DEFER_S (60: seconds an explicit hint silences inference), HINTFLOW_INFER_MEMORY_SHARE
    (1: inferred pins priced by the share of the pool they hold; 0: Continuum's cost),
    HINTFLOW_INFER_RELOAD_S_PER_TOKEN (unset: measured), HINTFLOW_INFER_RENEW (1), HINTFLOW_INFER_SILENT_S (30),
    HINTFLOW_PRIORITY_AGING_S (see AGING_S: the most head start an older program's turn gets; inf: strict
    program FCFS), HINTFLOW_ADMIT_GUARD (1), HINTFLOW_ADMIT_FRACTION (1.0: share of the pool the in-flight
    contexts may fill before new programs wait), HINTFLOW_ADMIT_MAX_WAIT_S (ADMIT_MAX_WAIT_S; with the host
    tier ADMIT_MAX_WAIT_S_WITH_HOST: a held first turn starts once it has waited this long, queue time included),
    HINTFLOW_ADMIT_HORIZON_S (5: a parked, unpinned program counts as in flight this long after its turn),
    HINTFLOW_YIELD_PINS (1: pins of younger programs yield to a waiting turn the step could start that memory
    cannot take, in queue order; head: to the queue's head alone; 0: off), HINTFLOW_TTFT_DEADLINE_S
    (inf: a request waiting this long goes first), HINTFLOW_FCFS_SLACK (FCFS_SLACK, 0.5; with the host tier
    FCFS_SLACK_WITH_HOST, inf: off; a request goes first once
    its first token is due at 1 + slack times FCFS's, counted in prefill tokens: ``_fcfs_bound``),
    HINTFLOW_PINNED_FIRST (1: a waiting turn whose session
    holds a pin goes ahead of unpinned ones of its class, as on the embedded node), HINTFLOW_PIN_GRACE_S
    (0.5: a session the orchestrator pinned in the last HINTFLOW_INFER_DEFER_S is held this long at each
    turn's end, until its next Pin decision arrives; 0: off), HINTFLOW_HOLD_QUEUED (HOLD_QUEUED, off; with the
    host tier HOLD_QUEUED_WITH_HOST, on: a turn that arrives to find its unpinned context still cached holds it
    until admission, ``SessionBook.hold_queued``, and the host tier's run after it, ``hold_for_waiting``)."""

    hintflow_async: ClassVar[bool] = False  # whether the vLLM base is AsyncScheduler (set in _scheduler)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # Before vLLM builds anything: a vLLM without the internals this class relies on fails here, naming
        # them, instead of with an AttributeError mid-step or a hook that is silently never called (_compat).
        check_vllm_internals()
        super().__init__(*args, **kwargs)
        engine_async = self.vllm_config.scheduler_config.async_scheduling
        log_async_mode(type(self).__name__, self.hintflow_async, engine_async)
        self.hint_lock = threading.RLock()
        pool = self.kv_cache_manager.block_pool
        self.pins_supported = len(self.kv_cache_config.kv_cache_groups) == 1 and pool.enable_caching
        # hintflow's host KV tier (_host_connector), when vLLM runs it (see below for what it changes)
        self.host_tier: Any = self.connector if hasattr(self.connector, "step_loaded_tokens") else None
        defaults = node_defaults(self.host_tier is not None)  # the three that depend on the tier (_node_defaults)
        budget = pin_budget(os.environ.get("HINTFLOW_PIN_BUDGET"), host_tier=self.host_tier is not None)
        self.book = SessionBook(pool, pool.num_gpu_blocks - 1, pin_budget_fraction=budget)  # -1: null block
        self._req_session: dict[str, VSession] = {}
        self.accounting = RequestAccounting()  # per-request hintflow_* series (_accounting, _metrics)
        self._client_priority: dict[str, int] = {}
        self._req_start: dict[str, float] = {}  # request -> when it arrived (book clock), for its aging
        # request -> (its session's pause_fate, prompt tokens cached) when it arrived: what it lost while it
        # queued is told from what the pause lost (RequestAccounting.lost_by)
        self._arrival: dict[str, tuple[str, int]] = {}
        self._warned: set[str] = set()  # log-once keys (bad ids, a failed priority mapping)
        self.node_id = os.environ.get("HINTFLOW_NODE_ID", "vllm")
        self.node_epoch = new_node_epoch()  # this life of the node (hints for an earlier one are refused)
        self.model_name = str(self.vllm_config.model_config.served_model_name)
        self._epoch_s = self.book.clock()
        self._wall_epoch_s = time.time()  # requests' arrival_time is wall time
        # With the host tier the accounting splits its hits, a program's last turn is not copied to the
        # host (no later turn reads it), pins are priced by the copy back from the host, the pin budget is
        # the host tier's, and new programs are not held back for device room (what does not fit waits on
        # the host, not for a re-prefill).
        if self.host_tier is not None:
            self.host_tier.save_filter = _worth_saving
            self.host_tier.session_key = self._session_key
            self.book.on_forget = self.host_tier.end_session
        # One figure for a copy back from the host, used by this node's own pin rule and reported in its
        # CacheState for the router and the orchestrator's pins (0: no host tier)
        self.host_reload_s_per_token = (
            env_float("HINTFLOW_HOST_RELOAD_S_PER_TOKEN", HOST_RELOAD_S_PER_TOKEN)
            if self.host_tier is not None else 0.0
        )
        # What the host tier gives back of evicted contexts: prices this node's inferred pins and, through
        # CacheState, the orchestrator's
        self.host_hits = HostHitShare()
        # The measured pin price's two readings (predictors._node_signals), reported in CacheState too
        self.prefill_share = PrefillShare()
        self.unpinned_survival = UnpinnedSurvival()
        self.infer: HintInference | None = None
        if infer_enabled():
            reload = env_float("HINTFLOW_INFER_RELOAD_S_PER_TOKEN", math.nan)  # nan (unset): measured
            self.infer = HintInference(
                self.book,
                backlog_tokens=self.prefill_backlog_tokens,
                defer_s=env_float("HINTFLOW_INFER_DEFER_S", 60.0),
                reload_s_per_token=None if math.isnan(reload) else reload,
                silent_min_s=env_float("HINTFLOW_INFER_SILENT_S", 30.0),
                host_reload_s_per_token=self.host_reload_s_per_token or None,  # None: no host tier
                pool_tokens=(lambda: float(self.book.num_blocks * self.block_size))
                if env_on("HINTFLOW_INFER_MEMORY_SHARE", "1") else None,
                host_hits=self.host_hits,
                prefill_share=self.prefill_share.fraction, unpinned_survival=self.unpinned_survival.fraction,
                measured_price=env_on("HINTFLOW_INFER_MEASURED_PRICE", "1"),
                renew=env_on("HINTFLOW_INFER_RENEW", "1"),
            )
        self.steps = StepsInFlight()  # scheduled, output not back yet: 1 at most unless async scheduling
        self.step_times = StepTimes()  # what hintflow's rules add to each step (the 10 s log line)
        self.step_trace = step_trace("hintflow", self.node_id, bool(engine_async))  # HINTFLOW_STEP_TRACE
        if self.step_trace is not None:
            self.step_trace.pool_state = self._pool_state
        self._next_log_s = 0.0
        # Program FCFS gives an older program's turn at most this head start over a newer arrival, so
        # new programs' first turns cannot starve under overload (inf: strict program FCFS).
        self.aging_s = env_float("HINTFLOW_PRIORITY_AGING_S", AGING_S)
        self.admit_guard = env_on("HINTFLOW_ADMIT_GUARD", "1")
        self.admit_fraction = env_float("HINTFLOW_ADMIT_FRACTION", 1.0)
        # the pool the in-flight contexts must fit: the device's, and the host tier's (what the device
        # evicts is kept there)
        self.admit_pool_blocks = self.book.num_blocks + (self.host_tier.num_slots if self.host_tier is not None else 0)
        # the longest hold ("auto" was a setting until it proved to be the aging bound: docs/vllm-backend.md)
        self.admit_max_wait_s = env_float("HINTFLOW_ADMIT_MAX_WAIT_S", defaults.admit_max_wait_s)
        self.admit_horizon_s = env_float("HINTFLOW_ADMIT_HORIZON_S", ADMIT_HORIZON_S)
        yield_setting = os.environ.get("HINTFLOW_YIELD_PINS", "1").strip().lower()
        self.yield_pins = env_on("HINTFLOW_YIELD_PINS", "1")
        self.yield_pins_to = "head" if yield_setting == "head" else "queue"
        self.ttft_deadline_s = env_float("HINTFLOW_TTFT_DEADLINE_S", math.inf)
        try:
            self.fcfs_bound = FcfsBound(env_float("HINTFLOW_FCFS_SLACK", defaults.fcfs_slack))
        except ValueError as e:  # a negative or NaN slack: say which setting, at the node's start
            raise ValueError(f"HINTFLOW_FCFS_SLACK: {e}") from None
        self.pinned_first = env_on("HINTFLOW_PINNED_FIRST", "1")
        # warm first: a waiting turn that has at most this many prompt tokens left to compute goes ahead of
        # cold ones of its class (_warm: its context survived the pause; served now, it is not lost)
        self.warm_first = env_on("HINTFLOW_WARM_FIRST", "1")
        self.warm_threshold_tokens = env_float("HINTFLOW_WARM_THRESHOLD_TOKENS", WARM_THRESHOLD_TOKENS)
        self.pin_grace_s = env_float("HINTFLOW_PIN_GRACE_S", 0.5)
        # a turn that arrives to find its unpinned context cached holds it while it waits (_sessions)
        self.hold_queued = env_on("HINTFLOW_HOLD_QUEUED", "1" if defaults.hold_queued else "0")
        self.pin_grace_window_s = env_float("HINTFLOW_INFER_DEFER_S", 60.0)  # "recently pinned": as inference's
        self.grace_holds = 0
        self._overdue: set[str] = set()  # waiting requests already moved to the front (deadline passed)
        self._started: set[str] = set()  # programs with an admitted turn (in flight until forgotten)
        self._admit: list[Any] | None = None  # [in-flight blocks, engine would idle] for this step
        self.admit_stats = {"held": 0, "fit": 0, "idle": 0, "aged": 0}
        # request id -> why admission last let it through; counted once vLLM schedules it (memory may
        # still keep it waiting, and each step would otherwise count it again)
        self._admit_reason: dict[str, str] = {}
        # context moves (_context_moves): session -> (the context an export sent, its tokens), for the drop
        self.exported: dict[str, tuple[Any, int]] = {}
        self._context_layout: KvLayout | None = None
        self.hint_server: HintServer | None = None
        port = os.environ.get("HINTFLOW_HINT_PORT")
        if port:
            from ._hint_service import start_hint_server

            self.hint_server = start_hint_server(self, int(port), os.environ.get("HINTFLOW_HINT_HOST", "127.0.0.1"))
            log.info("hintflow hint service on port %d", self.hint_server.port)
        self.metrics_server: Any = None  # /metrics without a hint service (with one, it serves them)
        metrics_port = int(os.environ.get("HINTFLOW_METRICS_PORT", "-1") or "-1")
        if self.hint_server is None and metrics_port >= 0:
            from ._metrics import start_metrics_server

            mhost = os.environ.get("HINTFLOW_METRICS_HOST", "127.0.0.1")
            self.metrics_server = start_metrics_server(self, metrics_port, mhost)
            log.info("hintflow metrics on http://%s:%d/metrics", mhost, self.metrics_server.port)
        if not self.pins_supported:
            log.warning("hintflow: pins need prefix caching and one KV cache group; hints are only recorded")

    # ---- requests in -------------------------------------------------------------------------
    def add_request(self, request: Any) -> None:
        with self.hint_lock:
            extra = (request.sampling_params.extra_args or {}) if request.sampling_params else {}
            program = str(extra.get("program_id") or "")
            sid = str(getattr(request, "session_id", None) or program)
            new = request.request_id not in self.requests
            # the prompt's cached prefix as it arrives, looked up once for the accounting and the FCFS bound
            cached = self._cached_tokens(request) if new and (sid or self.fcfs_bound.enabled) else 0
            if sid and new and self._valid_ids(sid, program):
                s = self.book.session(sid, program)
                self.book.on_request_added(s, request.request_id)
                if self.infer is not None:
                    self.infer.on_request(s, extra)
                self._req_session[request.request_id] = s
                self._client_priority[request.request_id] = request.priority
                self._arrival[request.request_id] = (s.pause_fate, cached)
                if self.hold_queued and cached:
                    self._hold_while_queued(s, request)
                request.priority = self._safe_priority(s, request.priority, request.request_id, request)
            if self.fcfs_bound.enabled and new:
                own = request.num_tokens - cached
                self.fcfs_bound.arrived(request.request_id, self._prefill_ahead(), own)
            super().add_request(request)

    def _hold_while_queued(self, s: VSession, request: Any) -> None:
        """``HINTFLOW_HOLD_QUEUED``: an arriving turn holds what it finds cached until it is admitted, its
        device part (``SessionBook.hold_queued``) and the host tier's run after it (``hold_for_waiting``)."""
        self.book.hold_queued(s)
        if self.host_tier is None:
            return
        pool, bs = self.kv_cache_manager.block_pool, self.block_size
        device = num_cached_tokens(
            request.block_hashes, request.num_tokens, bs, lambda h: pool.get_cached_block(h, [0]) is not None
        )
        usable = min(len(request.block_hashes), max(0, request.num_tokens - 1) // bs)
        self.host_tier.hold_for_waiting(request.request_id, request.block_hashes, device // bs, usable - device // bs)

    def _valid_ids(self, session_id: str, program_id: str) -> bool:
        """Whether the protocol can carry these ids (``SessionResidency`` in every ``CacheState``); a request
        with other ids is left to vLLM, as one without a session is."""
        try:
            _SESSION_ID.validate_python(session_id)
            _PROGRAM_ID.validate_python(program_id)
        except ValidationError as e:
            self._warn_once(
                "ids",
                "hintflow: a request's session_id/program_id cannot be reported over the hint protocol (%s); "
                "such requests get vLLM's own treatment (logged once)",
                str(e).splitlines()[-1].strip()[:200],
            )
            return False
        return True

    def _warn_once(self, key: str, msg: str, *args: Any, **kwargs: Any) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(msg, *args, **kwargs)

    def _safe_priority(
        self, s: VSession, client_priority: int, request_id: str | None = None, request: Any = None
    ) -> int:
        """``priority_for``, never raising: it runs inside vLLM's engine loop (``add_request``), where an
        exception is fatal to the engine, and reads hint-derived state. ``request``: the waiting request
        itself, whose warmth counts (None: not)."""
        try:
            # band 0 whatever its warmth: a pinned turn's warmth is not looked up
            warm = request is not None and not _pinned(self.pinned_first, s) and self.is_warm(request)
            return self.priority_for(s, client_priority, request_id, warm=warm)
        except Exception:  # a hint must never stop the engine: the client's order stands
            self._warn_once("priority", "hintflow: priority mapping failed; client priority kept", exc_info=True)
            return client_priority

    def is_warm(self, request: Any) -> bool:
        """Whether a waiting request is warm (``HINTFLOW_WARM_FIRST``): at most the threshold of its prompt
        left to compute, counting the device's cached prefix and the host tier's run after it (``_warm``)."""
        if not self.warm_first or request.num_computed_tokens or not self.pins_supported:
            return False  # (a waiting request with computed tokens has started: its place is not re-judged)
        return is_warm(request.num_tokens, self._cached_tokens(request), int(self.warm_threshold_tokens))

    def _cached_tokens(self, request: Any) -> int:
        """Prompt tokens a waiting request would find cached, on the device or the host tier (``_warm``)."""
        if not self.pins_supported:
            return 0
        pool = self.kv_cache_manager.block_pool
        index = self.host_tier.index if self.host_tier is not None else None
        return num_cached_tokens(
            request.block_hashes, request.num_tokens, self.block_size,
            lambda h: pool.get_cached_block(h, [0]) is not None,
            index.__contains__ if index is not None else None,
        )  # fmt: skip

    def _prefill_ahead(self) -> int:
        """Prefill tokens FCFS would compute before a request arriving now (``_fcfs_bound``): each waiting
        request's prompt less what it finds cached (or, once started, less what it computed), and what the
        running ones have still to prefill."""
        ahead = 0
        for r in self.waiting:
            done = r.num_computed_tokens or self._cached_tokens(r)
            ahead += max(0, r.num_tokens - done)
        for r in self.running:
            ahead += max(0, r.num_prompt_tokens - r.num_computed_tokens)
        return ahead

    def priority_for(
        self, s: VSession, client_priority: int, request_id: str | None = None, *, warm: bool = False
    ) -> int:
        """vLLM priority (lower first): hinted class, else the client's; then the band (``queue_place``: the
        session holds a pin, ``HINTFLOW_PINNED_FIRST``; else the turn is ``warm``, ``is_warm``; else cold);
        then the program's start, aged as of the request's arrival (so re-keying a queued request later does
        not age it again)."""
        if not self._priority_policy():
            return client_priority
        major = s.priority_class if s.priority_class is not None else client_priority
        start = s.program_start_s if s.program_start_s is not None else s.first_seen_s
        arrived = self._req_start.get(request_id, self.book.clock()) if request_id is not None else self.book.clock()
        if request_id is not None:
            self._req_start.setdefault(request_id, arrived)
        band, start = queue_place(start, arrived, pinned=_pinned(self.pinned_first, s), warm=warm, aging_s=self.aging_s)
        # Clamped as a float before int(): under strict FCFS (aging inf) a hinted age reaches back without
        # bound, and int() of a huge float is a huge int (or OverflowError near the float's limit).
        ms = (start - self._epoch_s + 86400.0) * 1000.0  # + a day: hinted ages reach back
        ms = min(ms, float(PRIORITY_SCALE - 1)) if ms >= 0.0 else 0.0  # NaN: 0
        return int(major) * CLASS_SCALE + band * PRIORITY_SCALE + int(ms)

    def _requeue_priority(self, request: Any) -> int | None:
        s = self._req_session.get(request.request_id)
        if s is None:
            return None
        return self._safe_priority(s, self._client_priority.get(request.request_id, 0), request.request_id, request)

    def _priority_policy(self) -> bool:
        # by name, as vLLM's SchedulingPolicy.PRIORITY (_compat checks it), so this module imports no vLLM
        return getattr(self.policy, "name", "") == "PRIORITY"

    def reprioritize(self, s: VSession) -> int:
        """Re-key the session's queued requests after a Priority hint (the queue is a heap)."""
        if not self._priority_policy():
            return 0
        moved = 0
        for queue in (self.waiting, self.kv_holding_waiting):
            reqs = [r for r in queue if r.request_id in s.live]
            if reqs:
                queue.remove_requests(reqs)
                for r in reqs:
                    r.priority = self._safe_priority(s, self._client_priority.get(r.request_id, 0), r.request_id, r)
                    queue.add_request(r)
                moved += len(reqs)
        return moved

    # ---- context moves (_context_moves) -----------------------------------------------------------
    def context_layout(self) -> KvLayout:
        """This process's KV tensors by layer (FailedPrecondition where the model runs in other processes)."""
        if self._context_layout is None:
            if not self.pins_supported:
                raise FailedPrecondition("context moves need prefix caching and one KV cache group")
            self._context_layout = kv_layout(self.vllm_config, self.kv_cache_config.num_blocks)
        return self._context_layout

    @property
    def vocab_size(self) -> int:
        return int(self.vllm_config.model_config.get_vocab_size())

    def hash_blocks(self, token_ids: Sequence[int]) -> list[Any]:
        """The prefix-cache hashes this node's requests compute for the full blocks of ``token_ids``."""
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import hash_block_tokens

        fn = get_hash_fn_by_name(self.vllm_config.cache_config.prefix_caching_hash_algo)
        bs, out, parent = self.hash_block_size, [], None
        for i in range(len(token_ids) // bs):
            parent = hash_block_tokens(fn, parent, token_ids[i * bs : (i + 1) * bs], None)
            out.append(parent)
        return out

    # ---- the step --------------------------------------------------------------------------------
    def expire_pins(self) -> bool:
        """Let leases that ran out go, or renew the inferred ones still worth it (``HintInference.renewal_s``).
        Under ``hint_lock``: each step, and at each metrics scrape (an idle engine does not step)."""
        renew = self.infer.renewal_s if self.infer is not None and self.infer.renew else None
        return self.book.expire(renew)

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        with self.hint_lock:
            start_s = time.perf_counter()
            self.expire_pins()
            if self.infer is not None:
                self.infer.sweep()
            self._promote_overdue()
            if self.yield_pins:
                self._yield_pins_to_older()
            self._sync_pinned_band()
            self._admit = self._admission_state() if self.admit_guard and self.waiting else None
            vllm_start_s = time.perf_counter()
            try:
                out = super().schedule(*args, **kwargs)
            finally:
                self._admit = None
            vllm_s = time.perf_counter() - vllm_start_s
            if self.step_trace is not None:
                self.step_trace.record(out)
            for new in out.scheduled_new_reqs:
                self.fcfs_bound.forget(new.req_id)
                if self.host_tier is not None:
                    self.host_tier.release_hold(new.req_id)
                s = self._req_session.get(new.req_id)
                req = self.requests.get(new.req_id)
                if req is not None:  # hits: the prefix lookup, before this step's tokens are added
                    host = self.host_tier.step_loaded_tokens.get(new.req_id, 0) if self.host_tier else 0
                    history = self.accounting.on_scheduled(
                        req, new.num_computed_tokens, s, host, self._arrival.pop(new.req_id, None)
                    )
                    if history and self.host_tier is not None:
                        self.host_hits.observe(history, new.num_computed_tokens - host, host)
                    if history and s is not None and (not s.held or s.queue_hold):  # kept with no pin
                        self.unpinned_survival.observe(history, new.num_computed_tokens - host)
                if s is None:
                    continue
                if req is not None and req.num_preemptions:  # resumed (the V2 model runner lists it as new)
                    s.admitted.add(new.req_id)
                    continue
                self._started.add(s.program_id)
                why = self._admit_reason.pop(new.req_id, None)
                if why is not None:
                    self.admit_stats[why] += 1
                kept = bool(s.held) and not s.queue_hold  # (a queue hold kept it only once the turn was back)
                wait_s = time.time() - req.arrival_time if req is not None else None
                self.book.on_admitted(s, new.req_id)
                if self.infer is not None and wait_s is not None:
                    self.infer.on_admitted(s, wait_s, kept)
            for rid in out.scheduled_cached_reqs.resumed_req_ids:  # preempted earlier, running again
                s = self._req_session.get(rid)
                if s is not None:
                    s.admitted.add(rid)
            # An earlier step still computing is progress (async scheduling): its output may free blocks.
            computing = self.steps.computing
            num_decodes = sum(1 for n in out.num_scheduled_tokens.values() if n == 1)
            self.fcfs_bound.computed(out.total_num_scheduled_tokens - num_decodes)
            self.steps.scheduled(out, out.total_num_scheduled_tokens, self.book.clock(), num_decodes)
            self.step_times.scheduled(time.perf_counter() - start_s, vllm_s)
            self._log_stats()
            starved = out.total_num_scheduled_tokens == 0 and (len(self.waiting) or len(self.running))
            if starved and not computing and self.book.num_pinned_blocks and self.book.force_unpin_latest():
                log.info("hintflow: pins blocked all progress; unpinned the latest program")
            return out

    def _pool_state(self) -> list[int]:
        """The step trace's pool and queue: free blocks (cached ones included), pinned blocks, waiting, running."""
        free = self.kv_cache_manager.block_pool.get_num_free_blocks()
        return [free, self.book.num_pinned_blocks, len(self.waiting), len(self.running)]

    def _log_stats(self) -> None:
        """Every 10 s: what the pins did (for benchmarks and operators; vLLM's log has the rest)."""
        now = self.book.clock()
        if now < self._next_log_s:
            return
        self._next_log_s = now + 10.0
        st, inf = self.book.stats, self.infer
        extra = ""
        if inf is not None:
            extra = (
                f" inferred_pins={inf.inferred_pins} renewals={inf.inferred_renewals}"
                f" inferred_releases={inf.inferred_releases}"
                f" T={inf.priced_queue_delay_s:.2f}s eta={inf.rule.eta:.2f} reload={inf.s_per_token * 1e6:.0f}us/tok"
            )
            if self.host_tier is not None:
                extra += f" host_hit={inf.host_hit_fraction():.2f} host_hit_run={self.host_hits.run_fraction():.2f}"
        # the measured pin price's readings (what the node reports as CacheState.prefill_share and
        # unpinned_survival: decayed, recent turns), and what the device kept unpinned over the whole run (the
        # replay's report gives that one, unpinned_kept_rate)
        extra += (f" prefill_share={self.prefill_share.fraction():.2f} unpinned_kept={self.unpinned_survival.fraction():.2f}"
                  f" unpinned_kept_run={self.unpinned_survival.run_fraction():.2f}")
        if self.fcfs_bound.enabled:  # turns the FCFS bound moved to the front
            extra += f" fcfs_due={self.fcfs_bound.num_due}"
        if self.hold_queued:  # turns that held their context while queued
            extra += f" queue_holds={st.queue_holds}"
            if self.host_tier is not None:
                extra += f" host_held={self.host_tier.num_held_slots}"
        # the recomputed tokens' shares by why the context was not there (RequestAccounting.lost_by)
        extra += f" lost={self.accounting.lost_shares()}"
        a = self.admit_stats
        log.info(
            "hintflow: pinned_blocks=%d sessions=%d expiries=%d clamps=%d forced_unpins=%d yielded=%d grace=%d%s"
            " admit: in_flight=%d held_steps=%d fit=%d idle=%d aged=%d %s",
            self.book.num_pinned_blocks, len(self.book.sessions), st.pin_expiries, st.pin_clamps,
            st.forced_unpins, st.yielded_pins, self.grace_holds, extra, len(self._started), a["held"], a["fit"],
            a["idle"], a["aged"], self.step_times.line(),
        )  # fmt: skip

    def update_from_output(self, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        with self.hint_lock:
            start_s = time.perf_counter()
            step = self.steps.returned(scheduler_output, self.book.clock())
            if step is not None:
                tokens, seconds, num_decodes = step
                self.step_times.computed(seconds)
                self.prefill_share.observe(tokens - num_decodes, num_decodes, seconds)
                if self.infer is not None:
                    self.infer.observe_step(tokens, seconds)
            vllm_start_s = time.perf_counter()
            out = super().update_from_output(scheduler_output, *args, **kwargs)
            vllm_s = time.perf_counter() - vllm_start_s
            self.accounting.after_step()
            self.step_times.updated(time.perf_counter() - start_s, vllm_s)
            return out

    def finish_requests(self, *args: Any, **kwargs: Any) -> Any:
        with self.hint_lock:
            return super().finish_requests(*args, **kwargs)

    def _free_request_blocks(self, request: Any) -> None:
        if not request.is_finished():
            # A preemption: vLLM's _preempt_request frees the blocks through this hook too, then puts the
            # request back in the waiting queue. The turn goes on, so its session, client priority,
            # accounting and the inference stay as they are; the blocks go back to vLLM as usual, and the
            # session counts as waiting until vLLM resumes the request (schedule()).
            s = self._req_session.get(request.request_id)
            if s is not None:
                s.admitted.discard(request.request_id)
            super()._free_request_blocks(request)
            return
        s = self._req_session.pop(request.request_id, None)
        self._client_priority.pop(request.request_id, None)
        self._req_start.pop(request.request_id, None)
        self._arrival.pop(request.request_id, None)
        if self.host_tier is not None:
            self.host_tier.release_hold(request.request_id)
        self._overdue.discard(request.request_id)
        self.fcfs_bound.forget(request.request_id)
        self._admit_reason.pop(request.request_id, None)  # (aborted before vLLM scheduled it)
        self.accounting.on_finished(request, s)
        if s is None or not self.pins_supported:
            if s is not None:
                self.book.on_request_finished(s, request.request_id, [])
            super()._free_request_blocks(request)
            return
        if self.infer is not None:
            self.infer.on_turn_end(s, request.num_tokens)
        self._grace_hold(s)
        if self._request_blocks_can_be_freed(request):
            blocks = self.kv_cache_manager.pop_blocks_for_free(request)
            self.book.on_request_finished(s, request.request_id, blocks)
        else:
            # vLLM's deferred block free (defer_block_free: a step still in flight may write these blocks;
            # async scheduling with a KV consumer connector, e.g. the host tier): vLLM keeps its references
            # until that step is back. The book takes the snapshot from them first and holds a pinned
            # prefix with references of its own, so a pin (now or later) still finds the turn's context.
            blocks = list(self.kv_cache_manager.get_blocks(request.request_id).blocks[0])
            self.book.on_request_finished(s, request.request_id, blocks, owned=False)
            super()._free_request_blocks(request)
        if self.infer is not None:
            self.infer.after_turn_end(s)

    def _grace_hold(self, s: VSession) -> None:
        """A session the orchestrator pins is held at its turn's end until the orchestrator's next decision
        arrives (a Pin, or ``ttl_s=0``), for at most ``HINTFLOW_PIN_GRACE_S``.

        Why: vLLM frees a finished request's blocks at once, and under memory pressure the next step reuses
        them; the orchestrator learns of the turn's end only after the client does, so its pin reaches the
        node tens of milliseconds (a busy worker: hundreds) after the blocks went back to the free queue.
        Engine-side inference pins at the turn's end itself and needs no grace. A session that never got
        a Pin (an orchestrator that only orders eviction, as KVFlow) is left alone."""
        if (
            self.pin_grace_s > 0.0
            and s.pin_hinted_s is not None
            and s.pin_deadline_s is None
            and not s.released
            and self.book.clock() - s.pin_hinted_s < self.pin_grace_window_s
        ):
            self.book.set_pin(s, self.pin_grace_s)
            self.grace_holds += 1

    def reset_prefix_cache(self, *args: Any, **kwargs: Any) -> Any:
        """vLLM's cache reset (``pause_generation(clear_cache=True)``, weight updates) needs every block
        free: pins (the book's references) are dropped first, under the lock the hint service takes."""
        with self.hint_lock:
            dropped = self.book.drop_all_pins()
            if dropped:
                log.info("hintflow: prefix cache reset; dropped %d pinned blocks", dropped)
            return super().reset_prefix_cache(*args, **kwargs)

    def _session_key(self, request: Any) -> str | None:
        s = self._req_session.get(request.request_id)
        return s.session_id if s is not None else None

    def shutdown(self) -> None:
        if self.hint_server is not None:
            self.hint_server.stop()
            self.hint_server = None
        if self.metrics_server is not None:
            self.metrics_server.stop()
            self.metrics_server = None
        super().shutdown()

    # ---- for the hint service and tests -------------------------------------------------------------
    def prefill_backlog_tokens(self) -> int:
        """Prompt tokens still to compute, waiting and running (the router's queueing signal)."""
        total = 0
        for r in [*self.waiting, *self.running]:
            total += max(0, r.num_prompt_tokens - r.num_computed_tokens)
        return total


def _worth_saving(request: Any) -> bool:
    """The host tier's save filter: a turn its client flagged ``is_last_turn`` has no next turn to serve."""
    extra = (request.sampling_params.extra_args or {}) if request.sampling_params else {}
    return not extra.get("is_last_turn")
