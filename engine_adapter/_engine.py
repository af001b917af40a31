"""EngineCore: one node's scheduler, KV manager and executor behind one lock, plus hint enforcement.

Threads::

    gRPC handlers (event loop) --submit/apply_hints/cache_state--> [lock] state
    step thread:  [lock] schedule -> execute (no lock: tensors only) -> [lock] update

Only ``schedule`` and ``update`` touch scheduler and KV state; ``execute`` reads block tables it was
handed and the KV tensors, which nothing else writes while a step runs (import/export take the lock and
flush pending copies first).  Hints are applied at once, under the lock, so an acknowledgement means
the node's state already reflects the hint.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

from hints import (
    CacheState,
    HintDecodeError,
    HintModel,
    HintResult,
    SessionResidency,
    new_node_epoch,
    residency_reported,
)
from predictors import PrefillShare

from ._context_blocks import ContextHeader
from ._context_export import ContextExport, begin_export, drop_exported
from ._context_import import ContextImport, begin_import
from ._context_transfer import ContextData, export_context, import_context
from ._engine_errors import EngineError, FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from ._executor import Clock, Executor, MonotonicClock, ScheduledBatch, StepOutput, VirtualClock
from ._hint_enforcement import apply_hint
from ._kv_manager import KVCacheManager, SessionState
from ._scheduler import Request, Scheduler, SchedulerConfig
from ._session import Session

__all__ = [
    "ContextData",
    "ContextExport",
    "ContextHeader",
    "ContextImport",
    "EngineCore",
    "EngineError",
    "EngineObserver",
    "FailedPrecondition",
    "InvalidArgument",
    "NotFound",
    "ResourceExhausted",
]


class EngineObserver(Protocol):
    """What metrics (or a replay harness) hear from the engine; every method is called under the lock."""

    def on_request_finished(self, req: Request) -> None: ...
    def on_step(self, batch: ScheduledBatch, out: StepOutput) -> None: ...
    def on_hints(self, hints: Sequence[HintModel | HintDecodeError], results: Sequence[HintResult]) -> None: ...


class EngineCore:
    def __init__(
        self,
        executor: Executor,
        *,
        clock: Clock | None = None,
        scheduler_config: SchedulerConfig | None = None,
        pin_budget_fraction: float = 0.5,
        eviction_policy: str = "hinted",
        retain_contexts: bool = True,
        host_write_through: bool = False,
        evict_queued: bool = False,
        host_lru: bool = False,
        host_hold_share: float = 0.0,
        node_id: str = "",
        model_name: str = "hintflow-tiny",
        pace_modeled: bool = False,
    ) -> None:
        self.executor = executor
        self.clock: Clock = clock or MonotonicClock()
        self.node_id = node_id or f"node-{uuid.uuid4().hex[:8]}"
        self.node_epoch = new_node_epoch()  # this life of the node (hints for an earlier one are refused)
        self.model_name = model_name
        self.block_size = executor.layout.block_size
        self.kv = KVCacheManager(
            executor.num_device_blocks,
            executor.num_host_blocks,
            self.block_size,
            self.clock,
            pin_budget_fraction=pin_budget_fraction,
            eviction_policy=eviction_policy,
            retain_contexts=retain_contexts,
            host_write_through=host_write_through,
            evict_queued=evict_queued,
            host_lru=host_lru,
            host_hold_share=host_hold_share,
        )
        self.scheduler = Scheduler(self.kv, self.clock, scheduler_config)
        self.scheduler.on_finish = self._on_finish
        self.prefill_share = PrefillShare()  # of this node's step time (the measured pin price reads it)
        self.observers: list[EngineObserver] = []
        self.lock = threading.RLock()
        # Held by a step from schedule to update, and by whatever else writes KV (ImportContext): the forward
        # pass runs without ``lock`` (hints and submits go on), and an abort then parks its request's
        # blocks, which an import could otherwise take and write while the pass still writes them.
        # Order: ``executing`` before ``lock``.
        self.executing = threading.Lock()
        self._num_exclusive_waiting = 0  # threads waiting in exclusive(): the step loop lets them in first
        self.version = 0  # bumps on every state change: cache-state watchers send on change
        self.pace_modeled = pace_modeled  # serve a modeled executor in real time (sleep its step time)
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._ids = itertools.count()
        self.step_error: BaseException | None = None
        # Session -> (its turns, tokens sent) when an export of it last ran to its end: DropContext frees
        # it only while both still hold (weak: a session freed meanwhile takes its stamp with it).
        self.exported_contexts: weakref.WeakKeyDictionary[Session, tuple[int, int]] = (
            weakref.WeakKeyDictionary()
        )

    # ---- requests ------------------------------------------------------------------------------
    def submit(
        self,
        prompt: Sequence[int],
        max_new_tokens: int,
        *,
        session_id: str,
        program_id: str = "",
        request_id: str = "",
        priority: int | None = None,
        stop_token_ids: Sequence[int] = (),
        on_event: Callable[[Request, list[int], bool], None] | None = None,
    ) -> Request:
        prompt = list(prompt)
        self._validate(prompt, max_new_tokens, session_id, stop_token_ids)
        if len(request_id) > 256 or not request_id.isprintable():  # (echoed in every response)
            raise InvalidArgument(f"request_id must be at most 256 printable characters, got {request_id[:300]!r}")
        with self.lock:
            rid = request_id or f"req-{next(self._ids)}"
            if rid in self.scheduler.requests:
                raise InvalidArgument(f"request_id {rid!r} is already in flight")
            s = self.kv.get_or_create(session_id, program_id)
            if program_id and s.program_id != program_id:
                raise InvalidArgument(
                    f"session {session_id!r} belongs to program {s.program_id!r}, not {program_id!r}"
                )
            if s.released:
                raise FailedPrecondition(f"program {s.program_id!r} was released; start a new session")
            if s in self.kv.leased:  # (RUNNING with no request: say why)
                raise FailedPrecondition(
                    f"session {session_id!r} is being moved; send the turn when the move ends"
                )
            if s.state is not SessionState.PARKED:
                # One turn at a time per session: a context continues from the previous turn's end.
                raise FailedPrecondition(f"session {session_id!r} already has a request {s.state.value}")
            req = Request(
                rid, s, prompt, max_new_tokens, self.clock.now(), priority, frozenset(stop_token_ids), on_event
            )
            self.scheduler.add(req)
            self._changed()
        return req

    def _validate(self, prompt: list[int], max_new_tokens: int, session_id: str, stop: Sequence[int]) -> None:
        ex = self.executor
        if not session_id or len(session_id) > 256 or not session_id.isprintable():
            raise InvalidArgument(f"session_id must be 1-256 printable characters, got {session_id[:300]!r}")
        if not prompt:
            raise InvalidArgument("prompt_token_ids must not be empty")
        if max_new_tokens < 1:
            raise InvalidArgument(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if min(prompt) < 0 or max(prompt) >= ex.vocab_size:  # C-speed scan first: prompts are long
            bad = next(t for t in prompt if not 0 <= t < ex.vocab_size)
            raise InvalidArgument(f"prompt token id {bad} is outside the vocabulary [0, {ex.vocab_size})")
        if any(not 0 <= t < ex.vocab_size for t in stop):
            raise InvalidArgument(f"stop_token_ids must lie in [0, {ex.vocab_size})")
        total = len(prompt) + max_new_tokens
        if total > ex.max_model_len:
            raise InvalidArgument(
                f"prompt ({len(prompt)} tokens) + max_new_tokens ({max_new_tokens}) = {total} exceeds the "
                f"model's maximum length {ex.max_model_len}"
            )
        capacity = self.kv.device.num_blocks * self.block_size
        if total > capacity:
            raise InvalidArgument(f"{total} tokens can never fit this node's KV cache ({capacity} tokens)")

    def abort(self, request_id: str) -> bool:
        with self.lock:
            done = self.scheduler.abort(request_id)
            if done:
                self._changed()
            return done

    def _on_finish(self, req: Request) -> None:
        for o in self.observers:
            o.on_request_finished(req)

    # ---- hints (what each one does: _hint_enforcement) -----------------------------------------
    def apply_hints(self, hints: Sequence[HintModel | HintDecodeError]) -> list[HintResult]:
        results = []
        with self.lock:
            for i, h in enumerate(hints):
                try:
                    results.append(apply_hint(self, i, h))
                except EngineError as e:
                    results.append(HintResult(index=i, code=e.code, message=str(e)[:4000]))
            for o in self.observers:
                o.on_hints(hints, results)
            self._changed()
        return results

    def _session(self, session_id: str):  # type: ignore[no-untyped-def]
        s = self.kv.sessions.get(session_id)
        if s is None:
            raise NotFound(f"unknown session {session_id!r} on node {self.node_id}")
        return s

    # ---- stepping ------------------------------------------------------------------------------
    def step(self) -> StepOutput | None:
        """Run one scheduler step; None when there was nothing to do."""
        with self.executing:
            return self._step()

    def _step(self) -> StepOutput | None:
        with self.lock:
            batch = self.scheduler.schedule()
            if batch.is_empty():
                return None
        try:
            out = self.executor.execute(batch)
        except Exception as e:
            # The step's requests fail (their KV is half written), not the node.  Some, all or none of its
            # tier copies ran, and the KV manager counts them as done: the contexts they were for let go
            # of those blocks.  Then the caller hears of it (``_loop`` keeps serving).
            with self.lock:
                if batch.copies:
                    self.kv.discard_copies(batch.copies)
                self._fail_running(e)
                self._changed()
            raise
        if self.pace_modeled and self.executor.name == "modeled":
            time.sleep(out.elapsed_s)  # before update: tokens are stamped when the modeled step ends
        with self.lock:
            if isinstance(self.clock, VirtualClock):
                self.clock.advance(out.elapsed_s)
            self.scheduler.update(batch, out)
            self.observe_step(batch, out.elapsed_s)
            for o in self.observers:
                o.on_step(batch, out)
            self._changed()
        return out

    def observe_step(self, batch: ScheduledBatch, elapsed_s: float) -> None:
        """A step ran ``batch`` in ``elapsed_s``: what it says about this node's load (``prefill_share``).
        Decodes as the cost model counts them: one new token after a cached prefix."""
        num_decodes = sum(1 for q in batch.seqs if len(q.token_ids) == 1 and q.start_pos > 0)
        self.prefill_share.observe(batch.num_tokens - num_decodes, num_decodes, elapsed_s)

    def has_work(self) -> bool:
        with self.lock:
            return self.scheduler.has_work()

    def run_until_idle(self, max_steps: int = 1_000_000) -> int:
        n = 0
        while n < max_steps and self.step() is not None:
            n += 1
        return n

    def _changed(self) -> None:
        self.version += 1
        self._wake.set()

    def start(self) -> None:
        """Step in a background thread whenever there is work (serving)."""
        if self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name=f"hintflow-engine-{self.node_id}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        """Hold ``executing`` then ``lock``: no step runs meanwhile (context export and import).  The step
        loop, which takes ``executing`` again right after each step, waits while anyone is waiting here:
        a plain lock is not fair, and a busy node would otherwise starve an import for as long as it is busy."""
        with self.lock:
            self._num_exclusive_waiting += 1
        try:
            self.executing.acquire()
        finally:
            with self.lock:
                self._num_exclusive_waiting -= 1
        try:
            with self.lock:
                yield
        finally:
            self.executing.release()

    def _loop(self) -> None:
        while not self._stop.is_set():
            if self._num_exclusive_waiting:  # (read without the lock: a stale value costs one step's wait)
                time.sleep(0.0005)
                continue
            try:
                did = self.step()
            except Exception as e:  # keep serving: fail the step's requests, not the node
                self.step_error = e
                self._fail_running(e)
                did = None
            if did is None:
                with self.lock:
                    busy = self.scheduler.has_work()
                    self._wake.clear()
                # Idle: sleep until a request or hint arrives; wake now and then for pin expiries.
                self._wake.wait(timeout=0.001 if busy else 0.05)
                with self.lock:
                    if self.kv.tick():
                        self._changed()

    def _fail_running(self, err: BaseException) -> None:
        with self.lock:
            for req in list(self.scheduler.running):
                self.scheduler.abort(req.request_id)

    # ---- cache state ---------------------------------------------------------------------------
    def cache_state(self, include_sessions: bool = False) -> CacheState:
        with self.lock:
            kv = self.kv
            sessions = []
            if include_sessions:
                for s in kv.sessions.values():
                    if not residency_reported(len(s.block_ids), len(s.host_block_ids), s.state.value):
                        continue  # an evicted context, or a Priority's record: nothing here
                    sessions.append(
                        SessionResidency(
                            session_id=s.session_id,
                            program_id=s.program_id,
                            device_tokens=s.num_device_tokens,
                            host_tokens=s.num_host_tokens,
                            pinned=s.pinned_blocks > 0,
                            state=s.state.value,
                        )
                    )
            return CacheState(
                node_id=self.node_id,
                model_name=self.model_name,
                block_size=self.block_size,
                total_blocks=kv.device.num_blocks,
                free_blocks=kv.device.num_free_blocks,
                pinned_blocks=kv.num_pinned_blocks,
                host_total_blocks=kv.host.num_blocks,
                host_free_blocks=kv.host.num_free_blocks,
                num_waiting=self.scheduler.num_waiting,
                num_running=self.scheduler.num_running,
                prefill_backlog_tokens=self.scheduler.prefill_backlog_tokens(),
                sessions=sessions,
                node_time_s=self.clock.now(),
                version=self.version,
                # an executor that does not say (a third-party one) leaves the router's default
                host_reload_s_per_token=float(getattr(self.executor, "host_reload_s_per_token", 0.0)),
                host_hit_fraction=kv.host_hits.fraction() if kv.host.num_blocks else 0.0,
                node_epoch=self.node_epoch,
                prefill_share=min(1.0, self.prefill_share.fraction()),
                unpinned_survival=kv.unpinned_survival.fraction(),
            )

    # ---- moving contexts between nodes (_context_export, _context_import, _context_transfer) ---
    def begin_export(self, session_id: str, chunk_bytes: int | None = None) -> ContextExport:
        """Lease a parked session and read it out in chunks of at most ``chunk_bytes`` (None: one chunk)."""
        return begin_export(self, session_id, chunk_bytes)

    def begin_import(self, header: ContextHeader) -> ContextImport:
        """Check a context's header and reserve its blocks; write its chunks, then commit."""
        return begin_import(self, header)

    def drop_exported(self, session_id: str, num_tokens: int) -> tuple[bool, str]:
        """Free an exported session if no turn ran on it since (a move's second phase)."""
        return drop_exported(self, session_id, num_tokens)

    def export_context(self, session_id: str, release_after: bool = False) -> ContextData:
        return export_context(self, session_id, release_after)

    def import_context(self, blob: ContextData) -> tuple[int, int]:
        return import_context(self, blob)

    def check_invariants(self) -> None:
        with self.lock:
            self.kv.check_invariants()
            running_sessions = {r.session.session_id for r in self.scheduler.running}
            for s in self.kv.sessions.values():  # (a context move's lease is RUNNING with no request)
                busy = s.session_id in running_sessions or s in self.kv.leased
                if (s.state is SessionState.RUNNING) != busy:
                    raise AssertionError(f"session {s.session_id} state {s.state} disagrees with running set")
