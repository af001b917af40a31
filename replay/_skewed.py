"""A skewed multi-node workload: one hot shared prefix and a few programs whose contexts outgrow the rest.

What a platform owner sees when one agent product dominates a cluster: most programs start from the same
large system prompt (tool docs and repository map, key ``skewed/hot``), the rest from their own tenants'
smaller prompts, and a few runs keep going long after the others (a hard issue, a long refactor) while
their tool outputs are larger too, so their contexts grow to several times everyone else's.  Two things
unbalance the nodes then:

* prefix-affinity routing (llm-d's precise prefix scorer) sends the hot prefix's programs to the node
  that holds it, so one node takes most first turns;
* a node that holds one or two long programs has most of its device memory in them, and the short
  programs that session affinity keeps there queue behind them while other nodes have room.

Everything else is a SWE-agent loop (one session, shell pauses of the measured 0.9 s mean, 3.5 s
standard deviation, capped at 120 s).  Which programs are long and which prefix a program starts from
are drawn from the program stream, so the workload is a function of the seed, and more programs keep
the first ones.  Parameters and defaults: docs/trace-format.md.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import ClassVar

from replay._generators import IntRange, WorkloadGenerator, _draw, _loop, _prompt
from replay._trace import Session

__all__ = ["SkewedAgents"]


@dataclass(frozen=True)
class SkewedAgents(WorkloadGenerator):
    """SWE-agent loops under skew: a hot prefix most programs share, and a few long-running programs.

    A program starts from the hot prefix (``hot_prefix_tokens``, key ``skewed/hot``) with probability
    ``hot_fraction``, else from one of ``num_cold_prefixes`` tenants' prompts (``cold_prefix_tokens``,
    keys ``skewed/tenant-K``).  With probability ``long_fraction`` it is long-running: ``long_turns``
    turns of ``long_tool_output_tokens`` each instead of ``num_turns`` of ``tool_output_tokens``; at the
    defaults its final context is about 5x a short program's (82k tokens on average against a median of
    15k, before the replay's token scale).
    """

    name: ClassVar[str] = "skewed"
    num_programs: int = 400
    rate: float = 2.0
    hot_fraction: float = 0.8
    hot_prefix_tokens: int = 6000
    num_cold_prefixes: int = 4
    cold_prefix_tokens: int = 2000
    long_fraction: float = 0.1
    num_turns: IntRange = (6, 10)
    long_turns: IntRange = (20, 28)
    task_tokens: IntRange = (1000, 3000)
    tool_output_tokens: IntRange = (300, 1500)
    long_tool_output_tokens: IntRange = (2000, 4000)
    output_tokens: IntRange = (100, 400)
    tool_mean_s: float = 0.9
    tool_sd_s: float = 3.5
    tool_cap_s: float = 120.0

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("hot_fraction", "long_fraction"):
            if getattr(self, name) > 1:
                raise ValueError(f"{self.name}: {name} must be in [0, 1], got {getattr(self, name)!r}")
        if self.num_cold_prefixes < 1:
            raise ValueError(f"{self.name}: num_cold_prefixes must be >= 1, got {self.num_cold_prefixes}")

    def sessions(self, rng: random.Random) -> list[Session]:
        # Every draw happens for every program, in one order, so a parameter changes only what it names.
        hot = rng.random() < self.hot_fraction
        tenant = rng.randrange(self.num_cold_prefixes)
        long_running = rng.random() < self.long_fraction
        if hot:
            key, prefix_tokens = "skewed/hot", self.hot_prefix_tokens
        else:
            key, prefix_tokens = f"skewed/tenant-{tenant}", self.cold_prefix_tokens
        n = _draw(rng, self.long_turns if long_running else self.num_turns)
        appended = self.long_tool_output_tokens if long_running else self.tool_output_tokens
        first = _prompt(key, prefix_tokens, _draw(rng, self.task_tokens), _draw(rng, self.output_tokens))
        pause = (self.tool_mean_s, self.tool_sd_s, self.tool_cap_s)
        turns = _loop(rng, first, n, appended, self.output_tokens, "bash", pause)
        return [Session("agent", "long-agent" if long_running else "agent", turns)]
