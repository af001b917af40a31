"""Program admission: a program's first turn waits while the programs already in flight fill the pool.

A node short of memory that starts a new program makes room by evicting the parked contexts of programs
it is already serving; each of those re-prefills what it lost on its next turn, and the programs it let
in grow into each other's memory turn after turn.  Measured in ``hintflow demo`` (two torch nodes of 192
blocks, contexts of 1,000-2,200 tokens): three to four programs a node shared the pool, each turn
re-prefilled a tail about 130 tokens longer than the last, and the programs that arrived last waited 60 s
for memory.  So a program new to the node starts only while the in-flight programs' contexts plus its
prompt fit in ``fraction`` of the pool (device and host tier: a context the device evicts to the host
is kept, not lost), unless the engine would otherwise idle (work conservation) or it
has waited ``max_wait_s`` (on the vLLM node ``ADMIT_MAX_WAIT_S``, 10 s, without a host tier; the aging
bound with one).

How long the hold is: a first turn waits in the queue too, behind pinned turns and (up to the aging
bound) older programs' ones, and the guard sees it only when the queue reaches it. With a 1 s hold the
real vLLM node (trace B, every mode) held first turns only in the first 10-20 s of a run; after that every
first turn it admitted had already waited longer than the hold. A 10 s hold, about the wait stock's request
FCFS gives every turn at the load peak, binds through the peak: mean JCT 5-7% and p99 TTFT 16-20% lower
than the 1 s hold's, device-only (docs/benchmarks.md, "The admission hold, again"). A hold that followed the
wait of returning turns that lost their context (``auto``, c61d9a8 to 651a2f6) was the 1 s floor whenever
it held anything, so it came out (docs/benchmarks.md, "How long the admission guard holds a new program").

Both engines ask :func:`admit_verdict`; each counts its in-flight programs from its own session book
(:func:`working_set` for the embedded node, ``vllm_backend/_admission.py`` for vLLM) by the same rule:
a program is in flight while one of its sessions that has started here is running, queued, pinned, or was
used within ``horizon_s`` (its tool is probably still running; it will want its context back), and it
counts that session's whole context (a live turn's whole request), not what is still resident. Only a
program's first turn on a node is held: a new session of a program the node has started and not seen
released (a sub-agent, a session moved here) goes on as any other turn. Until the commit after ed41196 the
embedded node held such a session when none of its program's sessions was in flight; on multi-agent (seed
0, device-only, the guard at 10 s) it let 834 sessions through as new programs for 300 programs, and the
vLLM node's rule brought the guarded mean JCT from 102.72 to 98.15 s (docs/benchmarks.md, "What a hold buys").

Why the host tier counts: with every context fitting on the host, a guard against the device pool alone
held new programs for nothing (1.01x against 0.94x stock's mean JCT with the guard off, real vLLM node);
with a host tier of half the device pool, device and host counted gave 0.70x against 0.76x off
(docs/benchmarks.md, "The admission guard with the host tier").

What it trades: batching.  Where a step costs about its tokens (a CPU) a re-prefilled context costs as
much as the concurrency it bought, and this rule wins; where more sequences in a step are nearly free (a
GPU decoding) it can cost throughput (docs/benchmarks.md has both).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from ._session import Session, SessionState

__all__ = [
    "ADMIT_HORIZON_S",
    "AdmitReason",
    "InFlight",
    "admit_verdict",
    "working_set",
]

ADMIT_HORIZON_S = 5.0
"""A parked program whose context is not pinned still counts as in flight for this long after its turn."""

AdmitReason = str  # "fit" | "idle" | "aged"


def admit_verdict(
    in_flight_blocks: int,
    num_blocks: int,
    pool_blocks: int,
    fraction: float,
    *,
    idle: bool,
    waited_s: float,
    max_wait_s: float | None,
) -> AdmitReason | None:
    """Why a new program's first turn of ``num_blocks`` may start now, or None: it waits."""
    if in_flight_blocks + num_blocks <= fraction * pool_blocks:
        return "fit"
    if idle:
        return "idle"  # work conservation: never leave the engine idle while a program waits
    if max_wait_s is not None and waited_s >= max_wait_s:
        return "aged"
    return None


@dataclass(frozen=True)
class InFlight:
    num_blocks: int  # the in-flight programs' contexts
    started: frozenset[str]  # every program with a session started here and not released, in flight or not


def working_set(
    sessions: Iterable[Session], now: float, horizon_s: float, block_size: int, live: Mapping[Session, int]
) -> InFlight:
    """The device blocks the embedded node's in-flight programs' whole contexts take, and the programs it has
    started; ``live``:
    each running or queued turn's full length (its context once the turn is done), as vLLM's rule counts.
    ``started``: the programs this node has started and not seen released, in flight or not; a new session
    of one of them (a sub-agent, a session the router moved here) is not a new program, as on the vLLM node
    (``vllm_backend/_admission.py``, ``_started``)."""
    num_blocks = 0
    started: set[str] = set()
    for s in sessions:
        if s.program_start_s is None or s.released:
            continue  # not a hinted program's session (a plain request), or its program ended
        if not s.token_ids and s.state is not SessionState.RUNNING:
            continue  # a first turn still queued (or a Priority's record): not started here yet
        started.add(s.program_id)
        if s.state is SessionState.PARKED and s.pin_deadline_s is None and now - s.last_used_s >= horizon_s:
            continue
        num_blocks += -(-max(len(s.token_ids), live.get(s, 0)) // block_size)
    return InFlight(num_blocks, frozenset(started))
