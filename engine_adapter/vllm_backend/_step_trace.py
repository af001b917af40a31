"""One line per scheduled step of a vLLM node, to price a loaded node's steps (``HINTFLOW_STEP_TRACE=DIR``).

Why: the replay's cost model for this node (``cpu-vllm-tiny``) was measured on an idle server, one request
at a time (``scripts/vllm_cost_probe.py``), and ``scripts/vllm_predict.py`` scales it until the replayed
stock run's JCT matches the measured one. A JCT that matches does not make each step's price right: on the
agent benchmark's trace with a short host tier that fit under-priced the stock node's steps by 10-13% and
the hintflow node's by 18% (its steps of decodes alone by 38%), while a profile fitted to the stock node's
own traced steps priced both within 2% (docs/benchmarks.md, "The step's price, measured"). ``scripts/vllm_steps.py``
reads these files: each step's price under a profile, by kind of step and by 10 s window, and a profile
fitted to them.

What a line holds: ``[t_s, tokens, [[n, p], ...], num_decodes, decode_ctx_tokens, num_loads, num_saves]``,
with ``t_s`` the monotonic clock when the step was scheduled, ``tokens`` the step's scheduled tokens, one
``[n, p]`` per prefill chunk (``n`` new tokens after ``p`` already computed or cached), the decodes (one
token each after a computed context) with their total context, and the blocks the host tier copies in
the step, host to device and device to host (0 and 0 without one; traces before these two fields have
five), then the pool and the queue once the step is placed, ``num_free_blocks, num_pinned_blocks,
num_waiting, num_running``, from the node's scheduler (``StepTrace.pool_state``, hintflow's or the traced
stock one; free counts the cached blocks vLLM may evict, pinned is 0 on a stock node; traces before these
four have seven fields). Those four showed why a pinned third of the pool slows the node at a load peak
(docs/benchmarks.md, "Pins at the load peak"). A step's duration is the gap to the next line: vLLM
schedules the next step when this one's output is back (with async scheduling on the gaps overlap, and
the trace says so in its header). The first line is a header (``{"pid", "node_id", "scheduler",
"async_scheduling", "started_unix_s"}``).

Three hooks record the same ``SchedulerOutput``: hintflow's scheduler after ``schedule()``, the host
connector in ``build_connector_meta`` (stock vLLM with the tier), and ``_scheduler.TracedAutoScheduler``,
stock vLLM's scheduling unchanged, which ``build_vllm_command`` gives a stock node while the variable is
set (stock vLLM without the tier). One process writes one file and records each output once: the last one
is held and compared by identity (vLLM frees an output before it builds the next, so an ``id()`` is
reused: compared by ``id()``, ~3% of a loaded node's steps were dropped, their time and tokens merged into
the step before). A file that cannot be opened, or written (a full disk), is logged
and tracing stops: the node keeps serving (a raise here would stop vLLM's engine loop).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

__all__ = ["StepTrace", "step_line", "step_trace"]

log = logging.getLogger(__name__)


def step_line(output: Any, now_s: float, copies: Any = None) -> list[Any]:
    """The trace line of one ``SchedulerOutput`` (read before vLLM advances its requests: the data objects
    hold each request's computed tokens as of this step's start). ``copies``: the step's host-tier
    metadata (``saves`` and ``loads`` lists) where the connector hands it in before vLLM attaches it to the
    output; else the output's own ``kv_connector_metadata``, and none without a host tier."""
    scheduled: dict[str, int] = output.num_scheduled_tokens
    items = [(r.req_id, r.num_computed_tokens) for r in output.scheduled_new_reqs]
    cached = output.scheduled_cached_reqs
    items += list(zip(cached.req_ids, cached.num_computed_tokens, strict=False))
    prefills: list[list[int]] = []
    num_decodes = decode_ctx = 0
    for req_id, done in items:
        n = scheduled.get(req_id, 0)
        if n == 1 and done > 0:
            num_decodes += 1
            decode_ctx += done + 1
        elif n > 0:
            prefills.append([n, done])
    meta = copies if copies is not None else getattr(output, "kv_connector_metadata", None)
    loads, saves = len(getattr(meta, "loads", None) or ()), len(getattr(meta, "saves", None) or ())
    return [round(now_s, 6), int(output.total_num_scheduled_tokens), prefills, num_decodes, decode_ctx, loads, saves]


class StepTrace:
    """Appends one line per distinct scheduler output to ``path`` (line-buffered: a killed node loses none)."""

    def __init__(self, path: Path, header: dict[str, Any]) -> None:
        self.path = path
        self._file: IO[str] = path.open("w", buffering=1)
        self._file.write(json.dumps(header) + "\n")
        # The last output recorded, held: compared by identity, not by ``id()``, which CPython reuses for
        # the next step's output once this one is freed (that dropped ~3% of the steps of a loaded node)
        self._last: object | None = None
        self.num_steps = 0
        # the node's pool and queue at each step, appended to its line: [free, pinned, waiting, running]
        self.pool_state: Callable[[], Sequence[int]] | None = None

    def record(self, output: Any, copies: Any = None) -> None:
        if self._file.closed or output is self._last:
            return  # stopped, or the connector and the scheduler both saw this step
        self._last = output
        try:
            line = step_line(output, time.monotonic(), copies)
            if self.pool_state is not None:
                line += [int(x) for x in self.pool_state()]
            self._file.write(json.dumps(line) + "\n")
        except (OSError, AttributeError, TypeError, ValueError) as e:  # never into vLLM's engine loop
            log.warning("hintflow: the step trace %s stopped: %s", self.path, e)
            self.close()
            return
        self.num_steps += 1

    def close(self) -> None:
        with contextlib.suppress(OSError):  # (what it held is lost; the node goes on)
            self._file.close()


_TRACE: StepTrace | None = None
_TRIED = False


def step_trace(scheduler: str, node_id: str = "", async_scheduling: bool = False) -> StepTrace | None:
    """This process's trace when ``HINTFLOW_STEP_TRACE`` names a directory, else None; opened on first use."""
    global _TRACE, _TRIED
    if _TRIED:
        return _TRACE
    _TRIED = True
    where = os.environ.get("HINTFLOW_STEP_TRACE", "").strip()
    if not where:
        return None
    started = time.time()
    path = Path(where) / f"steps-{started:.3f}-{os.getpid()}.jsonl"
    header = {"pid": os.getpid(), "node_id": node_id, "scheduler": scheduler,
              "async_scheduling": async_scheduling, "started_unix_s": started}  # fmt: skip
    try:
        Path(where).mkdir(parents=True, exist_ok=True)
        _TRACE = StepTrace(path, header)
    except OSError as e:
        log.warning("hintflow: HINTFLOW_STEP_TRACE=%s: cannot write the step trace (%s); tracing off", where, e)
        return None
    log.info("hintflow: tracing every step to %s", path)
    return _TRACE
