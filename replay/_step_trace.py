"""A replayed node's steps in the vLLM node's step-trace format (``NodeSpec.step_trace_dir``).

Why: ``scripts/vllm_predict.py`` fits the replay to a real sitting's stock run and predicts the others, and
where it misses (with the short host tier its mirror of hintflow's node ran 8-12% fast on 2026-12-07) the
question is which stretch of the run it gets wrong. The real node writes one line per step
(``engine_adapter/vllm_backend/_step_trace.py``, ``HINTFLOW_STEP_TRACE``); a mirror that writes the same
lines, on virtual time, is read by the same reader (``scripts/vllm_steps.py``: per 10 s window the prefill
rate, the requests per step, the time in steps of decodes alone, the pool's free and pinned blocks, the
queue), so the two runs are compared window by window with one piece of code.

Each replayed configuration writes ``DIR/CONFIG/steps-I-node-I.jsonl``, one file per node, in the real
trace's format: a header, then ``[t_s, tokens, [[n, p], ...], num_decodes, decode_ctx_tokens, num_loads,
num_saves, num_free_blocks, num_pinned_blocks, num_waiting, num_running]`` per step, ``t_s`` the virtual
time the step was scheduled. Free counts the unpinned blocks of parked contexts (what the node may evict),
as the real trace counts vLLM's cached blocks. A traced node steps one step at a time (no decode windows,
``_fast_forward.py``): the same results, more events.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import IO, Any

from engine_adapter import EngineCore, ScheduledBatch

__all__ = ["SimStepTrace"]


class SimStepTrace:
    """Appends one line per step of one replayed node."""

    def __init__(self, directory: Path, config_name: str, node_index: int, node_id: str) -> None:
        where = directory / config_name
        where.mkdir(parents=True, exist_ok=True)
        self.path = where / f"steps-{node_index}-{node_id}.jsonl"
        self._file: IO[str] = self.path.open("w", buffering=1)  # line by line: no close to forget
        header = {"pid": 0, "node_id": node_id, "scheduler": f"replay:{config_name}", "async_scheduling": False,
                  "started_unix_s": 0.0}  # fmt: skip
        self._file.write(json.dumps(header) + "\n")

    def step(self, now_s: float, batch: ScheduledBatch, engine: EngineCore) -> None:
        self._file.write(json.dumps(step_line(now_s, batch, engine)) + "\n")



def step_line(now_s: float, batch: ScheduledBatch, engine: EngineCore) -> list[Any]:
    """One step as the real node's trace writes it (a decode: one new token after a computed context)."""
    prefills: list[list[int]] = []
    num_decodes = decode_ctx = 0
    for s in batch.seqs:
        if s.is_decode:
            num_decodes += 1
            decode_ctx += s.start_pos + 1
        else:
            prefills.append([len(s.token_ids), s.start_pos])
    loads = sum(1 for op in batch.copies if op.kind == "h2d")
    kv, sched = engine.kv, engine.scheduler
    return [round(now_s, 6), batch.num_tokens, prefills, num_decodes, decode_ctx, loads, len(batch.copies) - loads,
            kv.device.num_free_blocks + kv.num_evictable_blocks, kv.num_pinned_blocks, sched.num_waiting,
            sched.num_running]  # fmt: skip
