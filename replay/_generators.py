"""Synthetic agent workloads: one frozen dataclass of documented parameters per kind, deterministic per seed.

Each generator draws program arrivals as a Poisson process at ``rate`` programs per second and the
programs themselves from a second random stream, so changing the rate keeps the programs, and asking for
more programs keeps the first ones.  ``scale`` multiplies token counts only (see ``Program.scaled``) so the
torch executor on a CPU can run the same shapes; pauses keep their real lengths.  Parameters and defaults
are listed in docs/trace-format.md; the generators by name are ``replay._generator_registry.GENERATORS``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import random
from dataclasses import dataclass
from typing import Any, ClassVar

from replay._trace import JoinKind, Program, Session, Turn

__all__ = ["HumanInLoop", "IntRange", "MultiAgent", "SweAgent", "WorkloadGenerator", "capped_lognormal_moments",
           "lognormal_params", "poisson_arrivals", "with_poisson_arrivals"]

IntRange = tuple[int, int]  # inclusive, drawn uniformly


def _phi(z: float) -> float:
    return 0.5 * math.erfc(-z / math.sqrt(2.0))


def capped_lognormal_moments(mu: float, sigma: float, cap_s: float) -> tuple[float, float]:
    """Mean and standard deviation of ``min(X, cap_s)`` for ``X ~ LogNormal(mu, sigma)``, in closed form."""
    lc = math.log(cap_s)
    p_cap = 1.0 - _phi((lc - mu) / sigma)
    m1 = math.exp(mu + sigma**2 / 2) * _phi((lc - mu - sigma**2) / sigma) + cap_s * p_cap
    m2 = math.exp(2 * mu + 2 * sigma**2) * _phi((lc - mu - 2 * sigma**2) / sigma) + cap_s**2 * p_cap
    return m1, math.sqrt(max(m2 - m1 * m1, 0.0))


def _bisect(f: Any, lo: float, hi: float, iterations: int = 100) -> float:
    """The root of an increasing ``f`` on [lo, hi]."""
    for _ in range(iterations):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if f(mid) < 0 else (lo, mid)
    return (lo + hi) / 2


@functools.lru_cache(maxsize=64)
def lognormal_params(mean_s: float, sd_s: float, cap_s: float = math.inf) -> tuple[float, float]:
    """(mu, sigma) of the lognormal whose samples, capped at ``cap_s``, have this mean and standard deviation.

    Uncapped it is the textbook inversion sigma^2 = ln(1 + (sd/mean)^2), mu = ln(mean) - sigma^2/2.  A cap
    cuts the heavy tail's share of the variance (a third of it at mean 0.9 s, sd 3.5 s, cap 120 s), so with
    one the closed-form capped moments are solved for instead: mu by bisection for the mean at each sigma,
    and sigma by bisection for the standard deviation.
    """
    if not (mean_s > 0 and sd_s > 0 and cap_s > mean_s):
        raise ValueError(f"need mean_s > 0, sd_s > 0 and cap_s > mean_s, got {mean_s}, {sd_s}, {cap_s}")
    sigma2 = math.log1p((sd_s / mean_s) ** 2)
    if math.isinf(cap_s):
        return math.log(mean_s) - sigma2 / 2, math.sqrt(sigma2)

    def mu_for(sigma: float) -> float:
        lo, hi = math.log(mean_s) - sigma**2 / 2 - 1, math.log(cap_s) + 10 * sigma
        return _bisect(lambda mu: capped_lognormal_moments(mu, sigma, cap_s)[0] - mean_s, lo, hi)

    def sd_gap(sigma: float) -> float:
        return capped_lognormal_moments(mu_for(sigma), sigma, cap_s)[1] - sd_s

    max_sigma = 6.0
    if sd_gap(max_sigma) < 0:
        raise ValueError(f"no lognormal capped at {cap_s} s has mean {mean_s} s and sd {sd_s} s")
    sigma = _bisect(sd_gap, 1e-6, max_sigma, iterations=60)
    return mu_for(sigma), sigma


def _pause(rng: random.Random, mean_s: float, sd_s: float, cap_s: float) -> float:
    mu, sigma = lognormal_params(mean_s, sd_s, cap_s)
    return min(cap_s, rng.lognormvariate(mu, sigma))


def _draw(rng: random.Random, bounds: IntRange) -> int:
    return rng.randint(bounds[0], bounds[1])


def _prompt(key: str, prefix_tokens: int, new_tokens: int, output_tokens: int) -> Turn:
    """A session's first turn: the shared prefix ``key`` (none when it has 0 tokens), then new tokens."""
    key = key if prefix_tokens else ""
    return Turn(prefix_tokens + new_tokens, output_tokens, shared_prefix=key,
                shared_prefix_tokens=prefix_tokens)


def _loop(rng: random.Random, first: Turn, n: int, appended: IntRange, out: IntRange, tool: str,
          pause: tuple[float, float, float]) -> list[Turn]:
    """An agent loop of ``n`` turns from ``first``: every turn but the last calls ``tool`` for a pause drawn
    from (mean_s, sd_s, cap_s), and the tool's output (``appended`` tokens) is the next turn's input."""
    turns = [first] + [Turn(_draw(rng, appended), _draw(rng, out)) for _ in range(n - 1)]
    return [
        dataclasses.replace(t, tool=tool, tool_duration_s=_pause(rng, *pause)) if i < n - 1 else t
        for i, t in enumerate(turns)
    ]


def poisson_arrivals(num_programs: int, rate: float, rng: random.Random) -> list[float]:
    """Arrival times (s) of a Poisson process at ``rate`` per second: exponential gaps, the first from 0."""
    if not (math.isfinite(rate) and rate > 0):
        raise ValueError(f"rate must be a finite number of programs per second > 0, got {rate!r}")
    times: list[float] = []
    t = 0.0
    for _ in range(num_programs):
        t += rng.expovariate(rate)
        times.append(t)
    return times


def with_poisson_arrivals(programs: list[Program], rate: float, seed: int) -> list[Program]:
    """The programs in their arrival order with new Poisson arrival times at ``rate`` (seeded)."""
    ordered = sorted(programs, key=lambda p: p.arrival_s)
    times = poisson_arrivals(len(ordered), rate, random.Random(f"arrivals/{seed}"))
    return [dataclasses.replace(p, arrival_s=t) for p, t in zip(ordered, times, strict=True)]


@dataclass(frozen=True)
class WorkloadGenerator:
    """Shared knobs: how many programs, and their Poisson arrival rate (programs per second)."""

    name: ClassVar[str] = ""
    num_programs: int = 100
    rate: float = 0.2

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, tuple) and not (len(value) == 2 and 1 <= value[0] <= value[1]):
                raise ValueError(f"{self.name}: {f.name} must be a range (lo, hi), 1 <= lo <= hi, "
                                 f"got {value}")
            if isinstance(value, int | float) and not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{self.name}: {f.name} must be finite and >= 0, got {value!r}")
        if self.rate <= 0:
            raise ValueError(f"{self.name}: rate must be > 0 programs per second, got {self.rate!r}")

    def sessions(self, rng: random.Random) -> list[Session]:
        """One program's sessions; subclasses draw them from ``rng``."""
        raise NotImplementedError

    def generate(self, *, seed: int, scale: float = 1.0) -> list[Program]:
        """The programs, each a function of ``seed`` and its index; arrivals from their own stream."""
        arrival_rng = random.Random(f"{self.name}/{seed}/arrivals")
        arrivals = poisson_arrivals(self.num_programs, self.rate, arrival_rng)
        rng = random.Random(f"{self.name}/{seed}/programs")
        return [
            Program(f"{self.name}-{i}", t, self.name, self.sessions(rng)).scaled(scale)
            for i, t in enumerate(arrivals)
        ]


@dataclass(frozen=True)
class SweAgent(WorkloadGenerator):
    """A SWE-agent coding loop: one session; each turn's shell command output is the next turn's input.

    The first prompt is a system prompt every program shares (key ``swe-agent/system``) plus the issue;
    contexts grow to 20-40k tokens over about 11 turns.  Shell pauses are lognormal, capped, fitted so
    the capped pauses have the measured mean 0.9 s and standard deviation 3.5 s (median 0.18 s).
    """

    name: ClassVar[str] = "swe-agent"
    num_programs: int = 100
    rate: float = 0.2
    num_turns: IntRange = (8, 14)
    system_prompt_tokens: int = 2000
    issue_tokens: IntRange = (1000, 4000)
    tool_output_tokens: IntRange = (300, 4000)
    output_tokens: IntRange = (100, 400)
    tool_mean_s: float = 0.9
    tool_sd_s: float = 3.5
    tool_cap_s: float = 120.0

    def sessions(self, rng: random.Random) -> list[Session]:
        n = _draw(rng, self.num_turns)
        first = _prompt("swe-agent/system", self.system_prompt_tokens,
                        _draw(rng, self.issue_tokens), _draw(rng, self.output_tokens))
        pause = (self.tool_mean_s, self.tool_sd_s, self.tool_cap_s)
        turns = _loop(rng, first, n, self.tool_output_tokens, self.output_tokens, "bash", pause)
        return [Session("agent", "swe-agent", turns)]


@dataclass(frozen=True)
class MultiAgent(WorkloadGenerator):
    """A KVFlow-style pipeline: planner, then parallel workers, then a reviewer that joins them.

    Each role has a fixed system prompt shared by every agent of that role in every program (keys
    ``multi-agent/planner``, ``/worker``, ``/reviewer``).  Workers start when the planner finishes; the
    reviewer waits for all workers (AND join) or, in ``or_join_fraction`` of the programs, for the first
    one (OR join: take the first answer).  A worker's new input is its subtask; the reviewer's is the
    workers' final outputs (all of them for AND, the longest one for OR).
    """

    name: ClassVar[str] = "multi-agent"
    num_programs: int = 50
    rate: float = 0.1
    num_workers: IntRange = (2, 4)
    or_join_fraction: float = 0.25
    planner_prefix_tokens: int = 1500
    worker_prefix_tokens: int = 1200
    reviewer_prefix_tokens: int = 1000
    task_tokens: IntRange = (500, 2000)
    plan_tokens: IntRange = (200, 600)
    subtask_tokens: IntRange = (100, 400)
    worker_turns: IntRange = (2, 4)
    tool_output_tokens: IntRange = (200, 2000)
    output_tokens: IntRange = (100, 400)
    review_tokens: IntRange = (200, 800)
    tool_mean_s: float = 1.5
    tool_sd_s: float = 3.0
    tool_cap_s: float = 60.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.or_join_fraction > 1:
            raise ValueError(f"{self.name}: or_join_fraction must be in [0, 1], "
                             f"got {self.or_join_fraction!r}")

    def sessions(self, rng: random.Random) -> list[Session]:
        planner = _prompt("multi-agent/planner", self.planner_prefix_tokens,
                          _draw(rng, self.task_tokens), _draw(rng, self.plan_tokens))
        sessions = [Session("planner", "planner", [planner])]
        pause = (self.tool_mean_s, self.tool_sd_s, self.tool_cap_s)
        for w in range(_draw(rng, self.num_workers)):
            n = _draw(rng, self.worker_turns)
            first = _prompt("multi-agent/worker", self.worker_prefix_tokens,
                            _draw(rng, self.subtask_tokens), _draw(rng, self.output_tokens))
            turns = _loop(rng, first, n, self.tool_output_tokens, self.output_tokens, "python", pause)
            sessions.append(Session(f"worker-{w}", "worker", turns, after=["planner"]))
        finals = [s.turns[-1].output_tokens for s in sessions[1:]]
        join: JoinKind = "or" if rng.random() < self.or_join_fraction else "and"
        review = _prompt("multi-agent/reviewer", self.reviewer_prefix_tokens,
                         sum(finals) if join == "and" else max(finals), _draw(rng, self.review_tokens))
        workers = [s.session_id for s in sessions[1:]]
        sessions.append(Session("reviewer", "reviewer", [review], after=workers, join=join))
        return sessions


@dataclass(frozen=True)
class HumanInLoop(WorkloadGenerator):
    """An assistant that waits for a person after each answer: pauses of minutes between turns.

    Human pauses are lognormal, capped at an hour, mean 300 s and standard deviation 450 s (median 150 s);
    a shared system prompt (key ``human-in-loop/system``) starts every program.
    """

    name: ClassVar[str] = "human-in-loop"
    num_programs: int = 50
    rate: float = 0.05
    num_turns: IntRange = (4, 10)
    system_prompt_tokens: int = 1500
    first_message_tokens: IntRange = (200, 2000)
    human_message_tokens: IntRange = (20, 400)
    output_tokens: IntRange = (200, 800)
    human_mean_s: float = 300.0
    human_sd_s: float = 450.0
    human_cap_s: float = 3600.0

    def sessions(self, rng: random.Random) -> list[Session]:
        n = _draw(rng, self.num_turns)
        first = _prompt("human-in-loop/system", self.system_prompt_tokens,
                        _draw(rng, self.first_message_tokens), _draw(rng, self.output_tokens))
        pause = (self.human_mean_s, self.human_sd_s, self.human_cap_s)
        turns = _loop(rng, first, n, self.human_message_tokens, self.output_tokens, "human", pause)
        return [Session("agent", "assistant", turns)]
