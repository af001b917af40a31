"""The replay's registered configurations: one hint policy, one routing rule and one engine setup each.

Every configuration runs on the same simulator, the same engine scheduler and the same modeled executor;
what differs is only what the paper behind it changes.  Why each field exists:

* ``hint_policy`` / ``routing``: names in ``orchestrator.POLICIES`` / ``ROUTING_POLICIES``.
* ``retain_contexts``: False reproduces vLLM (a finished turn's blocks go to the LRU free queue, still
  prefix-hit-able until reused); pins and eviction orders need True, because with False a parked context
  owns no blocks to pin or order.
* ``eviction_policy``: "lru" ignores ``EvictionOrder`` hints; "hinted" follows them.
* ``host_tier``: offload evicted blocks to host memory (the replay's ``host_capacity_tokens``) instead of
  dropping them.  Only the designs that use one get it (KVFlow, Continuum's offload variant, hintflow).
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
* ``clairvoyant``: every turn is submitted with its program's true remaining work from the trace as its
  engine priority (shortest remaining program first).  No deployable policy knows that; the row shows what
  perfect knowledge of every program's future would buy with the same memory, which bounds what better
  prediction (and any queue order) could add to ``hintflow``.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["REPLAY_CONFIGS", "ReplayConfig", "get_replay_config", "parse_policy_list"]


@dataclass(frozen=True, slots=True)
class ReplayConfig:
    """One named configuration of the replay (see the module docstring for why each knob exists)."""

    name: str
    hint_policy: str
    routing: str
    retain_contexts: bool
    eviction_policy: str
    host_tier: bool
    cold_prefill_cap: bool = False
    infinite_kv: bool = False
    thunderagent_controller: bool = False
    ttft_deadline: bool = False  # the replay's --ttft-deadline applies (hintflow's engine option)
    clairvoyant: bool = False  # priority = the program's true remaining work (an analysis row, not a policy)
    description: str = ""


REPLAY_CONFIGS: dict[str, ReplayConfig] = {
    c.name: c
    for c in (
        ReplayConfig(
            "vllm-default", "vllm-default", "session", retain_contexts=False, eviction_policy="lru",
            host_tier=False,
            description="stock vLLM: request FCFS, finished blocks to the LRU free queue, session routing",
        ),
        ReplayConfig(
            "continuum", "continuum", "session", retain_contexts=True, eviction_policy="lru",
            host_tier=True,
            description="Continuum: cost-model TTL pins at tool start, program FCFS, offload variant",
        ),
        ReplayConfig(
            "kvflow", "kvflow", "session", retain_contexts=True, eviction_policy="hinted", host_tier=True,
            description="KVFlow: steps-to-execution eviction order (finished agents first), host offload",
        ),
        ReplayConfig(
            "thunderagent", "thunderagent", "session", retain_contexts=True, eviction_policy="lru",
            host_tier=False, thunderagent_controller=True,
            description="ThunderAgent: every 5 s pause acting programs when a node thrashes, "
                        "restore from a global queue onto any node",
        ),
        ReplayConfig(
            "llm-d", "vllm-default", "llm-d", retain_contexts=False, eviction_policy="lru", host_tier=False,
            description="vLLM engines behind llm-d precise prefix routing (2·prefix + kv util + queue)",
        ),
        ReplayConfig(
            "hintflow", "hintflow", "hintflow", retain_contexts=True, eviction_policy="hinted",
            host_tier=True, cold_prefill_cap=True, ttft_deadline=True,
            description="ours: pins, predicted-pause eviction order, priority, release, cost routing, host tier",
        ),
        ReplayConfig(
            "clairvoyant", "hintflow", "hintflow", retain_contexts=True, eviction_policy="hinted",
            host_tier=True, cold_prefill_cap=True, ttft_deadline=True, clairvoyant=True,
            description="analysis, not a policy: hintflow with every program's true remaining work from the "
                        "trace as its priority (shortest remaining program first), on the same memory",
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


def get_replay_config(name: str) -> ReplayConfig:
    """The configuration registered as ``name``; ValueError listing the known names otherwise."""
    config = REPLAY_CONFIGS.get(name)
    if config is None:
        raise ValueError(f"unknown replay policy {name!r}; known: {', '.join(REPLAY_CONFIGS)}")
    return config


def parse_policy_list(text: str | None) -> list[ReplayConfig]:
    """``P1,P2,...`` (or None/"all": every registered one) as configurations, duplicates dropped."""
    if text is None or text.strip() in ("", "all"):
        return list(REPLAY_CONFIGS.values())
    names = list(dict.fromkeys(p.strip() for p in text.split(",") if p.strip()))
    return [get_replay_config(n) for n in names]
