"""`hintflow demo`'s setup with node and policy variants, side by side in one sitting (one Temporal server).

Usage::

    python3 scripts/demo_variants.py LABEL=POLICY[,KEY=VALUE...] ...

Each variant runs the demo's 24 coding agents on two fresh torch nodes of 192 blocks, in the order given.
``POLICY`` is a hint policy (``vllm-default`` also gets vLLM-like nodes, as in the demo). ``KEY=VALUE``
sets ``pin_budget_fraction`` or any ``SchedulerConfig`` field of the nodes (``program_fcfs_aging_s``,
``ttft_deadline_s``, ``yield_pins_to_older``, ...).  Prints one line per variant as it ends; with
``--json FILE`` also writes every report.  Example, the pin budget::

    python3 scripts/demo_variants.py vllm=vllm-default hf=hintflow hf-pin35=hintflow,pin_budget_fraction=0.35
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

from hintflow import DemoConfig, local_temporal, run_mode


def _value(text: str) -> Any:
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered == "none":
        return None
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        return text


def parse(spec: str) -> tuple[str, str, dict[str, Any]]:
    """``LABEL=POLICY[,KEY=VALUE...]`` -> (label, policy, settings)."""
    label, sep, rest = spec.partition("=")
    if not sep or not label or not rest:
        raise SystemExit(f"bad variant {spec!r}: expected LABEL=POLICY[,KEY=VALUE...]")
    policy, *pairs = rest.split(",")
    settings = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise SystemExit(f"bad setting {pair!r} in {spec!r}: expected KEY=VALUE")
        settings[key] = _value(value)
    return label, policy, settings


async def run(variants: list[tuple[str, str, dict[str, Any]]], demo: dict[str, Any]) -> dict[str, Any]:
    cfg = DemoConfig(**demo)
    out: dict[str, Any] = {}
    async with local_temporal(None) as client:
        for label, policy, settings in variants:
            settings = dict(settings)
            budget: dict[str, float] = {}  # (unset: the demo's own)
            if "pin_budget_fraction" in settings:
                budget["pin_budget_fraction"] = float(settings.pop("pin_budget_fraction"))
            r = await run_mode(client, cfg, policy, name=label, scheduler_overrides=settings, **budget)
            out[label] = r
            print(
                f"{label:16s} JCT mean {r['jct_mean_s']:6.2f} p90 {r['jct_p90_s']:6.2f} s  "
                f"TTFT p50 {r['ttft_p50_s']:5.2f} p90 {r['ttft_p90_s']:5.2f} s  "
                f"hits {r['across_turn_hit_rate']:.1%}  competing requests {r['background_requests']} "
                f"(p50 {r['background_latency_p50_s']:.2f} p90 {r['background_latency_p90_s']:.2f} s)  "
                f"wall {r['wall_s']:.1f} s",
                flush=True,
            )
    return out


def main(argv: list[str]) -> None:
    json_path = None
    if "--json" in argv:
        i = argv.index("--json")
        json_path = argv[i + 1]
        argv = argv[:i] + argv[i + 2 :]
    demo: dict[str, Any] = {}  # --demo KEY=VALUE: a DemoConfig field (background_rate, background_clients, ...)
    while "--demo" in argv:
        i = argv.index("--demo")
        key, _, value = argv[i + 1].partition("=")
        demo[key] = _value(value)
        argv = argv[:i] + argv[i + 2 :]
    if not argv:
        raise SystemExit(__doc__)
    out = asyncio.run(run([parse(a) for a in argv], demo))
    if json_path is not None:
        with open(json_path, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1:])
