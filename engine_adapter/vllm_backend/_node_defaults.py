"""The vLLM node's measured queue and pin defaults: program FCFS's head start, and the three that depend on
its memory (with hintflow's host tier or without). Other settings keep their defaults where they are read.

Why one module: a default is measured where it is the default (each constant's docstring says how), and
four of them differ by memory point (the pin budget, program admission's longest hold, the FCFS bound's
slack, the queue hold). The scheduler reads them at start-up through :func:`node_defaults`; the real-vLLM harness records
them in its report and the replay's mirror of the node (``scripts/vllm_predict.py``) reads them from
there or from here, so each exists once. No vLLM import: the harness and the mirror run without vLLM.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = [
    "ADMIT_MAX_WAIT_S",
    "ADMIT_MAX_WAIT_S_WITH_HOST",
    "AGING_S",
    "FCFS_SLACK",
    "FCFS_SLACK_WITH_HOST",
    "HOLD_QUEUED",
    "HOLD_QUEUED_WITH_HOST",
    "PIN_BUDGET",
    "PIN_BUDGET_WITH_HOST",
    "NodeDefaults",
    "node_defaults",
    "pin_budget",
]

AGING_S = 1.0
"""Default bound on program FCFS's head start: an older program's returning turn outranks a new program's
first turn only if it arrived less than this much later. Strict program FCFS (inf) starved first turns
for 35 s at p99 under overload (docs/benchmarks.md). 1 s against 3 s, six pairs on two traces: p99 TTFT
9-32% lower in five, the same in one; mean JCT within 5% or 13-19% lower (docs/benchmarks.md)."""
FCFS_SLACK = 0.5
"""Default slack of the FCFS bound without a host tier (``HINTFLOW_FCFS_SLACK``, ``engine_adapter/_fcfs_bound.py``):
a first token at most 1.5 times FCFS's, in prefill tokens. In three paired device-only runs on the agent
benchmark's trace (2026-12-07, each beside a run without the bound and bracketed by stock's) it gave a lower
mean JCT in each (0.49x, 0.51x, 0.50x stock's against 0.53x, 0.56x, 0.53x), p90 0.54-0.58x against
0.58-0.59x, and p99 TTFT 0.93x, 0.97x, 1.07x against 1.02x, 0.98x, 1.08x (docs/benchmarks.md, "An FCFS
bound on the queue"). Slack 1 was mixed at both memory points, slack 0 cost a quarter of the hits."""
FCFS_SLACK_WITH_HOST = math.inf
"""Default slack of the FCFS bound with a host tier: off. Slack 0.5 there lost in both paired runs (mean JCT
0.75x and 0.70x stock+host's against 0.70x and 0.68x, p99 TTFT 1.30x and 1.32x against 1.22x and 1.14x);
slack 1 was mixed (p99 TTFT 1.12x and 1.17x against 1.37x and 1.16x, mean JCT 0.70x both against 0.73x and
0.62x). With the tier the tail is the cold band at the load peak, which waits as long whatever the bound
moves into it, and a due turn that took any program's pin did not shorten it either (docs/benchmarks.md,
"Pins at the load peak")."""
ADMIT_MAX_WAIT_S = 10.0
"""Default longest hold of program admission on a node without a host tier (``HINTFLOW_ADMIT_MAX_WAIT_S``):
a new program's first turn waits at most this long, queue time included, while the programs in flight fill
the pool. About what stock vLLM's request FCFS makes every turn wait at the load peak (its median TTFT
there: 10.4-11 s), so a first turn held this long waits no longer than stock would have kept it. Against
the aging bound (1 s, the default until this constant), two paired bracketed rounds on the agent
benchmark's trace, device-only, in both: mean JCT 5-7%, p90 JCT 4-6% and p99 TTFT 16-20% lower, hits 1-5
points higher (docs/benchmarks.md, "The admission hold, again"). With the host tier see
ADMIT_MAX_WAIT_S_WITH_HOST."""
ADMIT_MAX_WAIT_S_WITH_HOST = 0.0
"""Default longest hold with the host tier: none, a first turn is admitted at once (the guard still counts
it in flight). Until this constant the aging bound (1 s). With the tier the tail of first tokens is the
last programs' first turns, which waited out the hold at the load peak: against the 1 s hold, two paired
bracketed rounds on the agent benchmark's trace with a host tier of half the pool, p99 TTFT 1.08x and
0.88x stock's against 1.28x and 1.23x, mean JCT 0.69x and 0.64x against 0.67x and 0.77x
(docs/benchmarks.md, "Batch width, and a lease without blocks")."""
PIN_BUDGET = 0.9
"""Default share of the pool pins may hold on a node with no host tier. 0.5 held ~4 of ~30 live contexts
under overload; with the yield and deadlock rules returning pinned blocks whenever an older turn or any
progress needs them, more of the pool can bridge pauses. Against 0.7 (the default until
cbd7738), six paired rounds in two sittings on the agent benchmark's trace: mean JCT 3-14%, p90 JCT
5-15% and p99 TTFT 1-13% lower in every round (docs/benchmarks.md, "The pin budget"). The embedded
node keeps 0.5: in the replay 0.9 cost an overloaded multi-agent workload 8-18%."""
PIN_BUDGET_WITH_HOST = 0.5
"""Default share with hintflow's host tier: a context let go is copied back from the host, not re-prefilled,
so a pin saves less and the room serves waiting turns. Against 0.7, three paired rounds on the agent
benchmark's trace with a host tier of half the pool: mean JCT 1-10% and p99 TTFT 7-13% lower in every
round (docs/benchmarks.md, "The pin budget"). 0.25 with the queue hold puts the p99 TTFT at stock's (0.98x and
1.01x in two paired rounds) for 8 points of mean JCT (0.71x and 0.73x against 0.63x and 0.65x): an operator's
setting for the tail, not the default (docs/benchmarks.md, "A turn admitted on its first chunk")."""


HOLD_QUEUED = False
"""Default of the queue hold on a node without a host tier (``HINTFLOW_HOLD_QUEUED``, ``SessionBook.hold_queued``):
off. Device-only, few returning turns arrive to find an unpinned context still cached (49-53 of 555 held
one, and the pins left the budget little room for them), and the history lost while queued stayed where it
was (14-15% of the lost against 16-18%). Mean JCT was lower in both paired bracketed rounds on the agent
benchmark's trace (0.53x and 0.54x stock's against 0.58x and 0.61x), p99 TTFT once higher, once lower
(1.27x and 1.00x against 1.16x and 1.54x): a move the mechanism's own reading does not explain, within the
spread of that noisy day (docs/benchmarks.md, "A queued turn holds its context")."""
HOLD_QUEUED_WITH_HOST = True
"""Default of the queue hold with hintflow's host tier: on. There most of the history lost was lost while
its turn waited (55-61%: the tier's LRU dropped the host part of a waiting turn's context to save what the
device evicted meanwhile); holding the device part and the tier's run after it cut that to 25-32%, and in
three paired bracketed rounds on the agent benchmark's trace it lowered mean JCT (0.57x, 0.73x and 0.69x
stock+host's against 0.67x, 0.83x and 0.72x) and p99 TTFT (0.97x, 1.21x, 1.25x against 1.36x, 1.83x,
1.29x), p90 JCT in two of them (docs/benchmarks.md, "A queued turn holds its context")."""


@dataclass(frozen=True)
class NodeDefaults:
    """The defaults that depend on whether the node has hintflow's host tier (each measured there)."""

    pin_budget: float  # share of the pool pins may hold (HINTFLOW_PIN_BUDGET)
    admit_max_wait_s: float  # program admission's longest hold (HINTFLOW_ADMIT_MAX_WAIT_S)
    fcfs_slack: float  # the FCFS bound's slack, inf: off (HINTFLOW_FCFS_SLACK)
    hold_queued: bool  # a waiting turn holds its cached context until admission (HINTFLOW_HOLD_QUEUED)


DEVICE_ONLY = NodeDefaults(PIN_BUDGET, ADMIT_MAX_WAIT_S, FCFS_SLACK, HOLD_QUEUED)
WITH_HOST_TIER = NodeDefaults(PIN_BUDGET_WITH_HOST, ADMIT_MAX_WAIT_S_WITH_HOST, FCFS_SLACK_WITH_HOST, HOLD_QUEUED_WITH_HOST)


def node_defaults(host_tier: bool) -> NodeDefaults:
    """The defaults of a node with (``host_tier``) or without hintflow's host KV tier."""
    return WITH_HOST_TIER if host_tier else DEVICE_ONLY


def pin_budget(setting: str | None, *, host_tier: bool) -> float:
    """The node's pin budget: ``HINTFLOW_PIN_BUDGET`` when set, else the default for its memory
    (``node_defaults(host_tier).pin_budget``). ValueError naming the variable for a value that is not a
    share in [0, 1)."""
    if setting is None or not setting.strip():
        return node_defaults(host_tier).pin_budget
    try:
        value = float(setting)
    except ValueError:
        value = math.nan
    if not 0.0 <= value < 1.0:
        raise ValueError(f"HINTFLOW_PIN_BUDGET={setting!r}: expected a share of the pool in [0, 1)")
    return value
