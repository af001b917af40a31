"""The replay's registered configurations: one hint policy, one routing rule and one engine setup each.

Every configuration runs on the same simulator, the same engine scheduler and the same modeled executor;
what differs is only what the paper behind it changes.  Every row's nodes admit a waiting turn only while
the pool could hold its whole prompt, as vLLM 0.32 does (``SchedulerConfig.admit_whole_prompt``; a variant's
``scheduler.admit_whole_prompt=false`` gives the first-chunk rule back).  Why each field exists:

* ``hint_policy`` / ``routing``: names in ``orchestrator.POLICIES`` / ``ROUTING_POLICIES``.
* ``retain_contexts``: False reproduces vLLM (a finished turn's blocks go to the LRU free queue, still
  prefix-hit-able until reused); pins and eviction orders need True, because with False a parked context
  owns no blocks to pin or order.
* ``eviction_policy``: "lru" ignores ``EvictionOrder`` hints; "hinted" follows them.
* ``host_tier``: offload evicted blocks to host memory (the replay's ``host_capacity_tokens``) instead of
  dropping them.  Only the designs that use one get it (KVFlow, Continuum's offload variant, hintflow).
* ``host_write_through``: the host tier is filled as vLLM's host connectors fill theirs (every turn's
  blocks copied out as it ends, least recently used chains dropped first) instead of on eviction in the
  hinted order (``engine_adapter/_host_tier.py``). On for ``vllm-offload`` (stock vLLM with its own
  ``--kv-offloading-size``, whose connector stores every block as it is computed); off for the designs that
  offload on eviction; ``scripts/vllm_predict.py`` sets it for the real node's ``+host`` modes when their
  connector ran write-through.  ``vllm-offload`` retains contexts (``retain_contexts``) because vLLM's
  prefix cache keeps a finished request's blocks until they are reused, and only a retained context can
  be reloaded from the host tier once the device has reused its blocks: the replay's row without
  retention gains nothing from the tier.
* ``host_lru``: a host tier filled on eviction drops least recently saved or loaded contexts first, whatever
  the hints say (by the newest save into the tier, not the session's last turn: ``HostLRUPolicy``), as the
  vLLM node's connector does (``vllm_backend/_host_index.py``; released programs'
  blocks go first there, as released contexts leave the replay's tier at once); off, it drops in the
  device's order (the hinted one where ``eviction_policy`` is). Only ``scripts/vllm_predict.py``'s mirrors set
  it: kvflow's hinted host order replayed its real node's short-host sitting (wh10) at 32% across-turn hits
  and 0.90x stock's mean JCT, against 17% and 1.07x measured; dropping least recently used first, 22% and
  1.00x (docs/benchmarks.md). Hintflow's own modes run their node with the LRU order on both tiers.
* ``host_hold``: an arriving turn locks the host tier's run of its context until it is admitted (at most
  ``HOLD_SHARE`` of the tier in all), as the vLLM node's queue hold does (``HINTFLOW_HOLD_QUEUED``,
  ``HintflowHostTier.hold_for_waiting``); only ``scripts/vllm_predict.py``'s mirrors of a holding node set it.
  Without it, in the mirror of a node whose tier drops least recently saved first (``host_lru``), the host
  part of a waiting turn's context goes before what the device evicts meanwhile, as on the node without
  its hold.
* ``warm_first``: the node admits warm turns (at most ``WARM_THRESHOLD_TOKENS`` of prompt left to compute)
  in a pass before cold ones (``SchedulerConfig.warm_first``), as hintflow's engines do. vLLM admits in one
  pass in queue order and stops at the first turn memory cannot take, and so do the systems built on it
  (Continuum) or on SGLang's FCFS default (KVFlow, ThunderAgent): off on every baseline row, on for
  hintflow's (and the analysis rows built on it). Measured with the mirror of stock vLLM with a short host
  tier on trace B: the warm pass alone made it replay at 54% across-turn hits against 16% measured (8%
  without it).
* ``evict_queued``: a queued turn's retained context is evicted as a parked one, in the same order (vLLM's
  prefix cache, and SGLang's radix cache until the turn is scheduled: a waiting request holds no blocks);
  off, the node keeps queued turns' contexts while a parked one is left, as hintflow's engines do. On for
  the baseline rows that retain contexts.
* ``resend_outputs``: a turn's output goes back into its session's next prompt, as an agent's reply does
  (on for every registered row). The vLLM benchmark's client (``replay/_vllm_agents.py``) sends each
  turn's trace tokens only, so its next prompt extends the last prompt, not prompt and output; the
  replay's mirrors of its nodes (``scripts/vllm_predict.py``) run with it off. On trace B the outputs
  (about 20 tokens a turn) made the mirrors' prompts 4% longer than the real ones, 20 tokens a turn more
  with every turn.
* ``cold_prefill_cap``: the hintflow engine's cap on cold prefills while warm work shares a step; vLLM
  (and the systems built on it) have no such cap, so the baselines run with the whole step budget.
  ``hintflow`` runs with it, as the engine ships.  Measured both ways: on the replay's workloads, which
  have no cold background traffic, the cap costs up to 1.7 s of p90 JCT (default replay 20.82/31.60 s
  mean/p90 with it, 20.87/29.94 s without); in ``hintflow demo``, where cold 200-token prompts compete
  with the agents' warm resumes, it is what protects them (hintflow 0.59x vllm-like JCT with it, 0.73x
  without, ``HINTFLOW_SCHEDULER__COLD_PREFILL_BUDGET_TOKENS=2048 hintflow demo``).
* ``infinite_kv``: the oracle's device pool holds every context ever computed: nothing is evicted.
* ``thunderagent_controller``: ThunderAgent's pause/restore loop (``replay/_thunder.py``).
* ``ttft_deadline``: the replay's ``--ttft-deadline`` (``SchedulerConfig.ttft_deadline_s``) applies to its
  nodes; an option of hintflow's engine, off unless asked for.
* ``migrate``: a turn queued for device memory while another node has room for it moves there with its
  context (copied at the host copy rate, ``replay/_migration.py``), and a session the router moves takes
  its context along instead of recomputing it.  hintflow's rebalancing; no baseline's paper moves KV
  between nodes (ThunderAgent restores a paused program onto any node by recomputing it).
* ``yield_pins``: a turn that memory cannot take makes the pins of younger programs let go, youngest
  first, until it fits (``SchedulerConfig.yield_pins_to_older``; the vLLM backend's rule, on there by
  default).  hintflow's rows only: Continuum's pins hold until they expire or its deadlock rule drops them.
  Measured on seed 0, no host tier: swe-agent 33.32/58.91 -> 31.65/52.69 s mean/p90 JCT, multi-agent
  109.68/185.48 -> 94.02/146.60 s.
* ``true_next_use``: every tool pause is known from the trace: a paused session is ranked for eviction by
  when it returns, not by the policy's prediction (Belady's rule over sessions); a pin the policy would
  hold past the return lapses at the return, one that would lapse before it is not held at all (it would
  only keep memory the session does not use in time), and with a host tier the context is fetched back
  to arrive as the tool returns.  Its pins take the policy's TTL with Continuum's queueing term counted
  (``policy.queue_delay``) as the longest pause worth holding for: a pin that knows the return is never
  held in vain, and with the shorter re-prefill-only TTL hintflow's default uses it beat hintflow on
  fewer seeds.  The ``bound`` row, the finite-memory reference beside the
  infinite-memory ``oracle``.  It is a reference, not a proof: no online row should beat it, and
  ``hintflow replay`` says so when one does on a run.  Before its pins knew the pause (Belady's order
  alone) hintflow beat it on five of eight device-only swe-agent seeds; with them, on none (seed 1:
  21.93 -> 19.91 s mean JCT, 36.28 -> 29.93 s p90).  (With ``clairvoyant`` priority as well, shortest
  remaining program first, its mean JCT fell 1% and its p90 rose 44% on the device-only swe-agent
  replay, seed 0, so ``bound`` keeps program FCFS.)
* ``admission_choice``: the row is replayed twice, without program admission and with the vLLM node's
  guard (``SchedulerConfig.admit_fraction`` 1.0, held at most ``ADMIT_MAX_WAIT_S``), and the run with the
  lower mean JCT is kept (``replay/_setup.py``): the ``bound``'s admission choice. Why: the guard is the
  better choice on some runs and the worse on others, so a bound without it was no bound where it pays.
  Without it, ``hintflow`` with the guard beat ``bound`` on three of eight device-only swe-agent seeds (2,
  3, 4: 0.93x, 0.97x, 0.98x its mean JCT), and ``bound`` with it was lower on seven (by up to 17%); on multi-agent
  the guard cost ``bound`` 12-28% (seeds 0-2), so neither choice alone bounds both workloads
  (docs/benchmarks.md, "The bound's admission choice").
* ``clairvoyant``: every turn is submitted with its program's true remaining work from the trace as its
  engine priority (shortest remaining program first).  No deployable policy knows that; the row shows what
  perfect knowledge of every program's future would buy with the same memory, which bounds what better
  prediction (and any queue order) could add to ``hintflow``.
"""

from __future__ import annotations

import dataclasses
import re
import typing
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from orchestrator import POLICY_OPTIONS, Option, parse_options

__all__ = [
    "REPLAY_CONFIGS",
    "SCHEDULER_OPTIONS",
    "ReplayConfig",
    "get_replay_config",
    "parse_policy_list",
    "parse_variant",
    "variant_keys",
]


@dataclass(frozen=True, slots=True)
class ReplayConfig:
    """One named configuration of the replay (see the module docstring for why each knob exists)."""

    name: str
    hint_policy: str
    routing: str
    retain_contexts: bool
    eviction_policy: str
    host_tier: bool
    host_write_through: bool = False  # the host tier as vLLM's connectors fill it (see the docstring)
    host_lru: bool = False  # the host tier drops as the vLLM node's connector does (see the docstring)
    host_hold: bool = False  # a queued turn locks its run on the host tier (see the docstring)
    warm_first: bool = True  # warm turns admitted in a pass before cold ones (see the docstring)
    evict_queued: bool = False  # a queued turn's context evicted as a parked one (see the docstring)
    resend_outputs: bool = True  # a turn's output is part of its session's next prompt (see the docstring)
    cold_prefill_cap: bool = False
    infinite_kv: bool = False
    thunderagent_controller: bool = False
    ttft_deadline: bool = False  # the replay's --ttft-deadline applies (hintflow's engine option)
    clairvoyant: bool = False  # priority = the program's true remaining work (an analysis row, not a policy)
    migrate: bool = False  # move a queued turn's context to a node with room (``_migration.py``)
    true_next_use: bool = False  # paused sessions ranked by their true return from the trace (``bound``)
    admission_choice: bool = False  # replayed with and without program admission, the better run kept
    yield_pins: bool = False  # pins of younger programs let go for an older program's waiting turn
    pin_budget: float = 0.5  # share of each node's device pool pins may hold (the engine's default)
    description: str = ""
    # A variant's (``--variant``) options: the hint policy's (``orchestrator.POLICY_OPTIONS``) and the
    # nodes' ``SchedulerConfig`` fields, each as (key, value) pairs in the order given.
    policy_options: tuple[tuple[str, Any], ...] = ()
    scheduler_options: tuple[tuple[str, Any], ...] = ()


REPLAY_CONFIGS: dict[str, ReplayConfig] = {
    c.name: c
    for c in (
        ReplayConfig(
            "vllm-default", "vllm-default", "session", retain_contexts=False, eviction_policy="lru",
            host_tier=False, warm_first=False,
            description="stock vLLM: request FCFS, finished blocks to the LRU free queue, session routing",
        ),
        ReplayConfig(
            "vllm-offload", "vllm-default", "session", retain_contexts=True, eviction_policy="lru",
            host_tier=True, host_write_through=True, warm_first=False, evict_queued=True,
            description="stock vLLM with its own CPU offload (--kv-offloading-size): request FCFS, finished "
                        "contexts kept in the prefix cache and evicted LRU, every block saved to host as "
                        "computed, the host dropping LRU",
        ),
        ReplayConfig(
            "continuum", "continuum", "session", retain_contexts=True, eviction_policy="lru",
            host_tier=True, warm_first=False, evict_queued=True,
            description="Continuum: cost-model TTL pins at tool start, program FCFS, offload variant",
        ),
        ReplayConfig(
            "kvflow", "kvflow", "session", retain_contexts=True, eviction_policy="hinted", host_tier=True,
            warm_first=False, evict_queued=True,
            description="KVFlow: steps-to-execution eviction order (finished agents first), host offload",
        ),
        ReplayConfig(
            "thunderagent", "thunderagent", "session", retain_contexts=True, eviction_policy="lru",
            host_tier=False, thunderagent_controller=True, warm_first=False, evict_queued=True,
            description="ThunderAgent: every 5 s pause acting programs when a node thrashes, "
                        "restore from a global queue onto any node",
        ),
        ReplayConfig(
            "llm-d", "vllm-default", "llm-d", retain_contexts=False, eviction_policy="lru", host_tier=False,
            warm_first=False,
            description="vLLM engines behind llm-d precise prefix routing (2·prefix + kv util + queue)",
        ),
        ReplayConfig(
            "hintflow", "hintflow", "hintflow", retain_contexts=True, eviction_policy="hinted",
            host_tier=True, cold_prefill_cap=True, ttft_deadline=True, migrate=True, yield_pins=True,
            description="ours: pins, predicted-pause eviction order, priority, release, cost routing, host tier, "
                        "queued turns' contexts moved to a node with room",
        ),
        ReplayConfig(
            "clairvoyant", "hintflow", "hintflow", retain_contexts=True, eviction_policy="hinted",
            host_tier=True, cold_prefill_cap=True, ttft_deadline=True, clairvoyant=True, migrate=True,
            yield_pins=True,
            description="analysis, not a policy: hintflow with every program's true remaining work from the "
                        "trace as its priority (shortest remaining program first), on the same memory",
        ),
        ReplayConfig(
            "bound", "hintflow", "hintflow", retain_contexts=True, eviction_policy="hinted",
            host_tier=True, cold_prefill_cap=True, ttft_deadline=True, migrate=True, true_next_use=True,
            yield_pins=True, admission_choice=True,
            policy_options=(("queue_delay", True), ("measured_price", False)),
            description="analysis, not a policy: hintflow on the same memory, with every tool pause known "
                        "from the trace (the paused context needed furthest ahead is evicted first: Belady "
                        "over sessions; pins held exactly to the return or not at all; reloads timed to it; "
                        "with or without program admission, whichever gives the lower mean JCT)",
        ),
        ReplayConfig(
            "oracle", "hintflow", "session", retain_contexts=True, eviction_policy="hinted",
            host_tier=False, cold_prefill_cap=True, infinite_kv=True,
            description="physical bound: device KV large enough that no context is ever evicted, and "
                        "sessions stay on their node (a move would recompute the context elsewhere)",
        ),
    )
}
"""Registered replay configurations by name, in the order reports list them."""


def get_replay_config(name: str, variants: Sequence[ReplayConfig] = ()) -> ReplayConfig:
    """The configuration registered (or defined by ``--variant``) as ``name``; ValueError listing the known
    names otherwise."""
    config = REPLAY_CONFIGS.get(name) or next((v for v in variants if v.name == name), None)
    if config is None:
        known = [*REPLAY_CONFIGS, *(v.name for v in variants)]
        raise ValueError(f"unknown replay policy {name!r}; known: {', '.join(known)}")
    return config


def parse_policy_list(text: str | None, variants: Sequence[ReplayConfig] = ()) -> list[ReplayConfig]:
    """``P1,P2,...`` (or None/"all": every registered one, then the variants) as configurations,
    duplicates dropped."""
    if text is None or text.strip() in ("", "all"):
        return [*REPLAY_CONFIGS.values(), *variants]
    names = list(dict.fromkeys(p.strip() for p in text.split(",") if p.strip()))
    if not names:
        known = [*REPLAY_CONFIGS, *(v.name for v in variants)]
        raise ValueError(f"no policy given in {text!r}; known: {', '.join(known)}")
    return [get_replay_config(n, variants) for n in names]


# ---- variants: a registered configuration with some knobs turned -------------------------------------
def _scheduler_options() -> dict[str, Option]:
    """Each field of the served node's ``SchedulerSettings`` (which mirrors ``SchedulerConfig``, a test holds
    them equal) with its type and lower bound: one place says what a scheduler setting accepts."""
    from annotated_types import Ge, Gt

    from engine_adapter import SchedulerSettings

    out: dict[str, Option] = {}
    for name, f in SchedulerSettings.model_fields.items():
        kinds = typing.get_args(f.annotation) or (f.annotation,)
        bound = next((m for m in f.metadata if isinstance(m, Ge | Gt)), None)
        out[name] = Option(
            next(k for k in kinds if k is not type(None)), f"SchedulerConfig.{name}",
            minimum=None if bound is None else float(typing.cast(float, bound.ge if isinstance(bound, Ge) else bound.gt)),
            min_open=isinstance(bound, Gt), nullable=type(None) in kinds,
        )
    return out


SCHEDULER_OPTIONS: dict[str, Option] = _scheduler_options()
"""The nodes' ``SchedulerConfig`` fields a variant may set (``scheduler.KEY``)."""


def _config_options() -> dict[str, Option]:
    from engine_adapter import EVICTION_POLICIES
    from orchestrator import POLICIES, ROUTING_POLICIES

    out = {
        "hint_policy": Option(str, "hint policy", choices=tuple(POLICIES)),
        "routing": Option(str, "routing rule", choices=tuple(ROUTING_POLICIES)),
        "eviction_policy": Option(str, "engine eviction policy", choices=tuple(EVICTION_POLICIES)),
    }
    for f in dataclasses.fields(ReplayConfig):
        if f.type in ("bool", bool):
            out[f.name] = Option(bool, "see ReplayConfig")
    out["pin_budget"] = Option(float, "share of the device pool pins may hold, in [0, 1)", minimum=0.0)
    return out


def variant_keys() -> dict[str, Option]:
    """Every key ``--variant`` takes: configuration fields, ``policy.KEY`` and ``scheduler.KEY``."""
    return {
        **_config_options(),
        **{f"policy.{k}": o for k, o in POLICY_OPTIONS.items()},
        **{f"scheduler.{k}": o for k, o in SCHEDULER_OPTIONS.items()},
    }


_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+-]{0,39}")


def parse_variant(text: str, earlier: Sequence[ReplayConfig] = ()) -> ReplayConfig:
    """``NAME=BASE:KEY=VALUE,...``: the registered configuration BASE (or an earlier variant) with the given
    knobs, reported as NAME.  ValueError naming what is wrong (a bad name, an unknown base or key with
    the known ones, a value of the wrong type)."""
    where = f"--variant {text!r}"
    name, sep, rest = text.partition("=")
    name = name.strip()
    if not sep or not _NAME.fullmatch(name):
        raise ValueError(f"{where}: expected NAME=BASE:KEY=VALUE,... with NAME of letters, digits, '_.+-' "
                         "(at most 40)")
    if name in REPLAY_CONFIGS or any(v.name == name for v in earlier):
        raise ValueError(f"{where}: the name {name!r} is already taken")
    base_name, _, opts = rest.partition(":")
    try:
        base = get_replay_config(base_name.strip(), earlier)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    changes: dict[str, Any] = {}
    policy_opts, sched_opts = dict(base.policy_options), dict(base.scheduler_options)
    for key, value in parse_options(opts, variant_keys(), where):
        if key.startswith("policy."):
            policy_opts[key.removeprefix("policy.")] = value
        elif key.startswith("scheduler."):
            sched_opts[key.removeprefix("scheduler.")] = value
        else:
            changes[key] = value
    if changes.get("pin_budget", 0.0) >= 1.0:
        raise ValueError(f"{where}: pin_budget must be below 1 (a share of the pool), got {changes['pin_budget']}")
    if not (changes or policy_opts != dict(base.policy_options) or sched_opts != dict(base.scheduler_options)):
        raise ValueError(f"{where}: no options given (KEY=VALUE after {base.name}:)")
    summary = opts.strip().replace(",", ", ")
    return dataclasses.replace(
        base, name=name, description=f"{base.name} with {summary}", **changes,
        policy_options=tuple(policy_opts.items()), scheduler_options=tuple(sched_opts.items()),
    )
