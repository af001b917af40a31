"""`hintflow demo`: coding-agent loops against a real engine node, with hints and without.

What runs, for real: an engine node (torch executor, gRPC on a loopback port) and, as its clients,
``programs`` agent loops (model call, then a tool pause sampled from a heavy-tailed distribution, then
the next call with the same, longer prefix) while a competing client floods the node with cold prompts.
The KV pool holds about a third of the live contexts.  It runs twice on a fresh node each time:

* ``vllm-default``: the node behaves like vLLM (a finished call's blocks go to an LRU free queue, no
  pins) and the client sends no hints;
* ``hintflow``: the node keeps contexts, and the client sends what the orchestrator will send: a
  ``Pin`` at each tool start (TTL: the tool's 90th percentile pause, a simple stand-in until the
  orchestrator's cost model drives it), ``Priority`` by program age, ``Release`` at program end.

This is the engine half of the demo; the Temporal-driven one (orchestrator, predictors, every policy)
replaces the stand-in client when those land.
"""

from __future__ import annotations

import asyncio
import math
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

__all__ = ["DemoConfig", "run_demo"]


@dataclass
class DemoConfig:
    programs: int = 12
    turns: int = 8
    first_prompt_tokens: int = 480
    tokens_per_turn: int = 64  # tool output appended each turn
    output_tokens: int = 8
    tool_mean_s: float = 0.35
    tool_sigma: float = 1.0  # lognormal shape: a heavy tail
    flood_clients: int = 2
    flood_prompt_tokens: int = 400
    arrival_gap_s: float = 0.15
    device_fraction: float = 0.33
    seed: int = 0


@dataclass
class ModeResult:
    jct_s: list[float] = field(default_factory=list)
    ttft_s: list[float] = field(default_factory=list)
    history_tokens: int = 0
    hit_tokens: int = 0
    recomputed_tokens: int = 0
    pins_placed: int = 0

    def summary(self) -> dict[str, float]:
        q = statistics.quantiles(self.ttft_s, n=10) if len(self.ttft_s) > 1 else [0.0] * 9
        return {
            "jct_mean_s": statistics.fmean(self.jct_s),
            "jct_p90_s": statistics.quantiles(self.jct_s, n=10)[8] if len(self.jct_s) > 1 else self.jct_s[0],
            "ttft_p50_s": statistics.median(self.ttft_s),
            "ttft_p90_s": q[8],
            "across_turn_hit_rate": self.hit_tokens / max(1, self.history_tokens),
            "recomputed_tokens": self.recomputed_tokens,
            "pins_placed": self.pins_placed,
        }


def _pause_s(rng: random.Random, cfg: DemoConfig) -> float:
    mu = math.log(cfg.tool_mean_s) - cfg.tool_sigma**2 / 2
    return min(rng.lognormvariate(mu, cfg.tool_sigma), 20 * cfg.tool_mean_s)


async def _run_mode(mode: str, cfg: DemoConfig) -> ModeResult:
    from engine_adapter._engine import EngineCore
    from engine_adapter._server import start_node
    from engine_adapter._torch_executor import make_torch_executor
    from hints import EngineClient, Pin, Priority, Release

    hinted = mode == "hintflow"
    max_ctx = cfg.first_prompt_tokens + cfg.turns * (cfg.tokens_per_turn + cfg.output_tokens)
    bs = 16
    blocks = max(int(cfg.programs * max_ctx / bs * cfg.device_fraction), 2 * -(-max_ctx // bs) + 8)
    ex = make_torch_executor(num_device_blocks=blocks, max_model_len=max_ctx + 64)
    core = EngineCore(
        ex,
        retain_contexts=hinted,
        eviction_policy="hinted" if hinted else "lru",
        pin_budget_fraction=0.6,
        node_id=f"demo-{mode}",
    )
    node = await start_node(core, metrics_port=-1)
    pause_samples = sorted(_pause_s(random.Random(cfg.seed + 1), cfg) for _ in range(2000))
    ttl_s = pause_samples[int(0.9 * len(pause_samples))]
    result = ModeResult()
    stop = asyncio.Event()

    async def program(i: int, client: EngineClient) -> None:
        prng = random.Random(cfg.seed * 1000 + i)
        await asyncio.sleep(i * cfg.arrival_gap_s)
        t0 = time.monotonic()
        sid = pid = f"agent-{i}"
        ctx = [prng.randrange(512) for _ in range(cfg.first_prompt_tokens)]
        for turn in range(cfg.turns):
            r = await client.generate(ctx, cfg.output_tokens, session_id=sid, program_id=pid)
            result.ttft_s.append(r.ttft_s)
            if turn > 0:
                hist = r.num_cached_tokens + r.num_host_hit_tokens + r.num_recomputed_tokens
                result.history_tokens += hist
                result.hit_tokens += r.num_cached_tokens + r.num_host_hit_tokens
                result.recomputed_tokens += r.num_recomputed_tokens
            ctx = ctx + r.token_ids
            if turn == cfg.turns - 1:
                break
            if hinted:
                await client.push_hints(
                    [
                        Pin(session_id=sid, ttl_s=ttl_s, reason="tool:bash"),
                        Priority(session_id=sid, program_age_s=time.monotonic() - t0),
                    ]
                )
                result.pins_placed += 1
            await asyncio.sleep(_pause_s(prng, cfg))
            ctx = ctx + [prng.randrange(512) for _ in range(cfg.tokens_per_turn)]
        if hinted:
            await client.push_hints([Release(program_id=pid)])
        result.jct_s.append(time.monotonic() - t0)

    async def flood(j: int, client: EngineClient) -> None:
        frng = random.Random(cfg.seed * 7 + j)
        n = 0
        while not stop.is_set():
            prompt = [frng.randrange(512) for _ in range(cfg.flood_prompt_tokens)]
            await client.generate(prompt, 1, session_id=f"flood-{j}-{n}", program_id=f"flood-{j}-{n}")
            if hinted:  # a plain client sends nothing; the orchestrator releases finished one-shot calls
                await client.push_hints([Release(program_id=f"flood-{j}-{n}")])
            n += 1

    try:
        async with EngineClient(node.address) as client:
            floods = [asyncio.create_task(flood(j, client)) for j in range(cfg.flood_clients)]
            await asyncio.gather(*(program(i, client) for i in range(cfg.programs)))
            stop.set()
            await asyncio.gather(*floods)
    finally:
        await node.stop()
    core.check_invariants()
    return result


def run_demo(cfg: DemoConfig | None = None) -> dict[str, Any]:
    cfg = cfg or DemoConfig()
    out: dict[str, Any] = {"config": cfg.__dict__, "policies": {}}
    for mode in ("vllm-default", "hintflow"):
        out["policies"][mode] = asyncio.run(_run_mode(mode, cfg)).summary()
    return out


def format_table(result: dict[str, Any]) -> str:
    pol = result["policies"]
    base = pol["vllm-default"]
    cols = [
        "jct_mean_s",
        "jct_p90_s",
        "ttft_p50_s",
        "ttft_p90_s",
        "across_turn_hit_rate",
        "recomputed_tokens",
    ]
    lines = [f"{'policy':<14}" + "".join(f"{c:>22}" for c in cols)]
    for name, row in pol.items():
        cells = []
        for c in cols:
            v = row[c]
            ratio = f" ({v / base[c]:.2f}x)" if base[c] and c != "across_turn_hit_rate" else ""
            cells.append(f"{v:>12.3f}{ratio:>10}" if isinstance(v, float) else f"{v:>12}{ratio:>10}")
        lines.append(f"{name:<14}" + "".join(cells))
    return "\n".join(lines)
