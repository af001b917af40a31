"""Does the replay predict the real vLLM node? Calibrate on stock vLLM, then predict every other mode.

    python scripts/vllm_predict.py REAL.json [--json OUT]
    python scripts/vllm_predict.py REAL.json --turns MODE [--fit OUT]   # one mode, turn by turn
    python scripts/vllm_predict.py REAL.json --try 'NAME=MODE:env.HINTFLOW_PIN_BUDGET=0.2'   # a setting not run

REAL.json is a ``hintflow replay --backend vllm --json`` report with a ``vanilla`` row (same trace, same
pool, one sitting); ``MODE+host`` rows are predicted on a node with the report's host tier and compared
with ``vanilla+host`` (the stock scheduler with the same tier), which the report must have too; their
nodes' host tier saves as the real connector did (``--host-save``: on eviction, or write-through with
LRU drops). Step 1 fits the replay's cost model to this sitting: the ``cpu-vllm-tiny`` profile (the
step's shape as ``scripts/vllm_cost_probe.py`` measured it on an idle stock server: prefill with
attention's quadratic term, decode by streams and context, vLLM's 2,048-token step budget; every replay
node admits as vLLM does) with its
prefill and its decode parts each scaled on a grid (then refined around its best point) so that the replayed ``vllm-default`` matches the
measured ``vanilla`` (mean and p90 JCT, TTFT p50): this shared VM's speed moves by 2.5x between
sittings, and a loaded node is not an idle one; and,
where a hintflow mode's node reported it (``node_prefill_share``), so that the replayed mirror of that mode
spends the same share of its step time prefilling: several splits of a step between prefill and decode fit
the stock run's latencies alike, and the pin price (``measured_price``) depends on the split.
Step 2 replays, with that cost model, one node configured as each real mode's node (``MIRRORS``) and
prints each mode's ratio to stock vLLM, measured against predicted (mean and p90 JCT; the p99 TTFT beside
them, shown, not scored), whether the ranking agrees, and, for a mode whose report row has the node's
``lost=`` reading (``node_lost_by``), where its recomputed history went by cause beside the mirror's
(``engine_adapter/_lost_context.py``). It
replays ``--spread`` times (5 by default), with every step price of the profile scaled 1% apart around it
(0.98x to 1.02x), and predicts each ratio as the median, with the range: a mirror of hintflow's node is
chaotic (which turn waits and which context survives turns on small differences in time), so one replay's
ratio is one draw: on sd2's step-fitted profile, scaling every price by 0.97-1.03x moved hintflow's
predicted ratio between 0.51x and 0.56x, stock's JCT smoothly.

Each hintflow node runs the node's admission guard (``scheduler.admit_*``, the same rule), and
a variant's node settings in ``NODE_ENV`` are mirrored as scheduler keys; a variant of any other setting
is left out. What the mirrors leave out (the replay has no such mechanism): the node's engine-side
inference (``hintflow-infer``) is mirrored by the orchestrator's ``hintflow`` policy with memory share,
which prices and renews pins alike (the node renews an inferred pin that runs out in its pause since
``HINTFLOW_INFER_RENEW``; before, the mirror's renewals kept contexts the node let go) but measures T
differently; and the gap before a pushed hint reaches the node,
which the node's turn-end grace (``HINTFLOW_PIN_GRACE_S``) closes.

``--profile P.json`` replays with a given profile instead of step 1's fit: one that ``scripts/vllm_steps.py``
fitted to the sitting's traced steps (``HINTFLOW_STEP_TRACE``) prices each step as the node ran it, where
step 1 only matches the stock run's latencies.

``--turns MODE`` replays one mode's mirror (fitted afresh, or with the profile an earlier ``--json OUT`` of
the same report kept, ``--fit OUT``: a minute instead of several) and joins it turn by turn with the real
run's first round of that mode (``mirror_turns.py``): the history each found by send time and by pause,
the TTFT tail of first and returning turns, and the slowest turns on each side.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mirror_turns import format_turns, pair_turns

from engine_adapter.vllm_backend import AGING_S, PIN_BUDGET, node_defaults
from replay import (
    MODE_ENV,
    ReplaySetup,
    get_replay_config,
    parse_variant,
    parse_vllm_variant,
    report_json,
    run_replay,
)


def _node(aging_s: float) -> str:
    return (
        f"pin_budget={PIN_BUDGET},scheduler.program_fcfs_aging_s={aging_s},yield_pins=true,"
        "cold_prefill_cap=false,migrate=false"
    )


NODE = _node(AGING_S)
"""Every hintflow vLLM node with the vLLM node's defaults: its pin budget, program FCFS with its aging bound
of head start at most, pins yielding to older programs' turns, no cold-prefill cap (vLLM has none), one
node."""
def _vllm_node(warm_first: bool = False, hold_queued: bool = False) -> str:
    """What every vLLM node does, stock or hintflow's, unlike the embedded one: a queued turn's unpinned
    context stays in the LRU free queue (``evict_queued``); and, unless the node runs hintflow's warm-first
    rule (``HINTFLOW_WARM_FIRST``, on since it was added), turns go in queue order, a resume whose context
    survived behind cold prompts (``scheduler.warm_first``). The embedded node's defaults (hintflow's
    replay rows; the baseline rows are registered with both, ``replay/_policies.py``) do both the other
    way: mirrored with them, stock vLLM with a host tier of half the pool replayed at 47-54% hits against
    11-16% measured. Set on every mirror, so a mirror does not depend on the registered rows' defaults.
    ``hold_queued``: the node ran its queue hold (``HINTFLOW_HOLD_QUEUED``: a waiting turn keeps its cached
    context), mirrored as the embedded node's rule (``evict_queued=false``: a queued turn's context goes only
    when no parked one is left) and the host tier's lock (``host_hold``: the run of it on the tier stays there
    until admission).
    And the benchmark's client sends each turn's trace tokens only, not the turn's output
    (``resend_outputs``). The node's host tier (``+host``) drops least recently saved or loaded blocks first,
    whatever the hints say (``host_lru``): kvflow's hinted host order replayed wh10 at 32% hits against 17%
    measured."""
    evict, hold = str(not hold_queued).lower(), str(hold_queued).lower()
    return (f"scheduler.warm_first={str(warm_first).lower()},evict_queued={evict},host_hold={hold},"
            "resend_outputs=false,host_lru=true")


INFER_RENEW = "policy.renew_ahead_s=0.05"
"""The node's inference renews a pin at the instant its lease lapses (``SessionBook.expire``); the replay's
policy re-decides at its ticks (every 0.05 s), so without renewing a tick ahead each renewal left a gap of up
to a tick in which the mirror's node evicted the context (the pushed baselines' pusher ticks as the replay
does, so their mirrors keep the gap)."""
MIRRORS = {
    "vanilla": f"node.vanilla=vllm-default:{_vllm_node()}",
    "hintflow-infer": f"node.hintflow-infer=hintflow:{NODE},policy.memory_share=true,eviction_policy=lru,{INFER_RENEW}",
    "hintflow-infer-pid": f"node.hintflow-infer-pid=hintflow:{NODE},policy.memory_share=true,eviction_policy=lru,{INFER_RENEW}",
    "hintflow-orchestrator": f"node.hintflow-orchestrator=hintflow:{NODE}",
    "continuum": f"node.continuum=continuum:{NODE}",
    "kvflow": f"node.kvflow=kvflow:{_node(0)}",  # KVFlow's mode: request FCFS
    "thunderagent": f"node.thunderagent=thunderagent:{NODE}",  # with its controller, as the harness runs it
}
HOST = {"evict": "host_tier=true", "write-through": "host_tier=true,host_write_through=true"}
"""A ``+host`` mode's node, by how the real run's host connector saved blocks (``--host-save``; the stock
scheduler's ``vanilla+host`` runs the same connector): when the device evicts them (the connector's
default since 2026-12-03; the replay's own tier does the same), or write-through as they fill, least
recently used chains dropped first (the sittings before)."""
"""Each real mode as the replay's configuration of one embedded node that runs the same rules."""
KEYS = ("jct_mean_s", "jct_p90_s", "ttft_p50_s")
RATIO_KEYS = ("jct_mean_s", "jct_p90_s", "ttft_p99_s")
"""What each mode's row compares with stock: mean and p90 JCT (scored), and the TTFT tail (shown)."""
STEP_PRICES = ("prefill_a_s", "prefill_b_s_per_token", "prefill_c_s_per_token2", "decode_base_s", "decode_per_seq_s",
               "decode_per_ctx_token_s", "copy_per_block_s")  # fmt: skip
# The measured profile's prefill and decode parts each scaled to the sitting: wide enough for the VM's
# speeds seen so far (it ran the benchmark trace 2.5x faster on 2026-12-03's evening than that afternoon)
PREFILL_STEP, DECODE_STEP = 1.25, 1.4
PREFILL_SCALE = [PREFILL_STEP**i for i in range(-6, 10)]  # 0.26x .. 7.5x
DECODE_SCALE = [0.5, 0.7, 1.0, 1.4, 2.0, 2.8]
REFINE_LEVELS = 2
"""After the grid, the best point is refined this many times on a grid of half the step around it: hintflow's
mirror moves with the split of a step between prefill and decode far more than stock's run does (s25, fitted
at prefill x0.512 and decode x1 by the grid, prefill share 0.58 against the node's 0.64: 0.63x stock against
0.52x measured; at x0.57 and x0.75, which fits stock as closely and the share to 0.65: 0.54x)."""


def _setup(real: dict[str, Any], cost_model: str, *, host: bool = False, trace: Path | None = None) -> ReplaySetup:
    """One node as the real one; ``host``: with the real run's host tier (its ``MODE+host`` modes); ``trace``:
    its steps written there, a directory per mode (``--step-trace``)."""
    cfg = real["config"]
    return ReplaySetup(workload=cfg["workload"], num_programs=cfg.get("num_programs"), rate=cfg.get("rate"),
                       scale=cfg.get("scale"), seed=cfg.get("seed", 0), num_nodes=1, cost_model=cost_model,
                       kv_capacity_tokens=cfg["kv_capacity_tokens"],
                       host_capacity_tokens=(cfg.get("host_capacity_tokens") or 0) if host else 0,
                       step_trace_dir=None if trace is None else str(trace))  # fmt: skip


def _admission(max_wait_s: str) -> str:
    """The vLLM node's admission guard (on by default; with a host tier since the commit after a902ceb): a new program
    waits while the programs in flight fill the pool, at most ``max_wait_s`` (``HINTFLOW_ADMIT_MAX_WAIT_S``: the
    aging bound until ``ADMIT_MAX_WAIT_S`` became hintflow's device-only hold; from 04a0853 until it was taken out,
    ``auto``, whose hold was that bound whenever it held)."""
    return f"scheduler.admit_fraction=1.0,scheduler.admit_max_wait_s={max_wait_s}"


def _hold_queued(real: dict[str, Any], host: bool) -> bool:
    """Whether a real report's hintflow nodes ran the queue hold at this memory point (reports before it: no)."""
    return bool(real["config"].get("hold_queued_host" if host else "hold_queued", False))


def _admit_wait(real: dict[str, Any], host: bool) -> float | None:
    """The admission hold a real report's hintflow nodes ran at this memory point (None: not recorded)."""
    return real["config"].get("admit_max_wait_s_host" if host else "admit_max_wait_s")


def _mirror(
    mode: str, host_save: str = "evict", pin_budget: float | None = None, host_guard: bool = True,
    admit_wait_s: float | None = None, warm_first: bool = True, hold_queued: bool = False,
) -> str:
    """The replay spec of a real mode; ``BASE+host`` is BASE's node with a host tier (named apart).
    ``pin_budget``: the one the real run gave every node (its report's ``config.pin_budget``; None: the
    node's own default, by host tier). ``host_guard``: whether the node ran its admission guard with a
    host tier (off in reports before the commit after a902ceb). ``admit_wait_s``: the longest admission
    hold of a hintflow node (its report's ``config.admit_max_wait_s``, or ``admit_max_wait_s_host`` for a
    node with the host tier; None, reports before it was recorded: the aging bound, as the baselines'
    nodes keep it). ``warm_first``: whether
    hintflow's nodes ran the warm-first rule (its report's ``config.warm_first``; reports before: not);
    ``hold_queued``: whether they ran the queue hold at this memory point (``config.hold_queued`` or
    ``hold_queued_host``; reports before: not)."""
    host = mode.endswith("+host")
    budget = pin_budget if pin_budget is not None else node_defaults(host).pin_budget
    base = mode.removesuffix("+host")
    spec = MIRRORS[base].replace(f"pin_budget={PIN_BUDGET}", f"pin_budget={budget}")
    stock = base == "vanilla"
    if not stock:
        node_warm = warm_first and MODE_ENV.get(base, {}).get("HINTFLOW_WARM_FIRST", "1") != "0"  # baselines: off
        node_hold = hold_queued and MODE_ENV.get(base, {}).get("HINTFLOW_HOLD_QUEUED", "1") != "0"
        spec += "," + _vllm_node(node_warm, node_hold)
        if host_guard or not host:  # a hintflow node: its admission guard
            aging = spec.partition("scheduler.program_fcfs_aging_s=")[2].partition(",")[0]
            own = base not in MODE_ENV and admit_wait_s is not None  # hintflow's own modes
            spec += "," + _admission(str(admit_wait_s) if own else aging)
    if not host:
        return spec
    spec = spec.replace(f"node.{base}=", f"node.{mode}=", 1) + f",{HOST[host_save]}"
    # Stock vLLM keeps a finished request's blocks in its prefix cache until they are reused, and the
    # connector saves what that reuse evicts: in the replay, a retained context evicted in LRU order.
    return spec + ",retain_contexts=true" if stock else spec


NODE_ENV = ("HINTFLOW_ADMIT_GUARD", "HINTFLOW_ADMIT_MAX_WAIT_S", "HINTFLOW_ADMIT_FRACTION",
            "HINTFLOW_TTFT_DEADLINE_S", "HINTFLOW_PRIORITY_AGING_S", "HINTFLOW_PIN_BUDGET", "HINTFLOW_WARM_FIRST",
            "HINTFLOW_WARM_THRESHOLD_TOKENS", "HINTFLOW_FCFS_SLACK", "HINTFLOW_YIELD_PINS", "HINTFLOW_HOLD_QUEUED")
"""The node settings (``--variant NAME=MODE:env.KEY=V``) the replay's node has an equivalent of."""


def _unmirrored(env: dict[str, str]) -> list[str]:
    """A variant's node settings the replay's node has no equivalent of: keys outside ``NODE_ENV``, and
    ``HINTFLOW_YIELD_PINS=head`` (pins yield to the queue's head only; the replay's node yields for every
    turn it tries, as the vLLM node's default does)."""
    out = sorted(set(env) - set(NODE_ENV))
    if env.get("HINTFLOW_YIELD_PINS", "").strip().lower() == "head":
        out.append("HINTFLOW_YIELD_PINS=head")
    return out


def _off(value: str) -> bool:
    """A node switch's value that turns it off (as the node reads it: ``_infer.env_on``)."""
    return value.strip().lower() in ("0", "false", "no", "off")


def _node_env(keys: dict[str, str], env: dict[str, str]) -> None:
    """A variant's node settings, as the mirror's scheduler keys (see ``NODE_ENV``)."""
    if "HINTFLOW_PIN_BUDGET" in env:
        keys["pin_budget"] = env["HINTFLOW_PIN_BUDGET"]
    aging = env.get("HINTFLOW_PRIORITY_AGING_S")
    if aging is not None:
        keys["scheduler.program_fcfs_aging_s"] = aging
    guard = env.get("HINTFLOW_ADMIT_GUARD")
    if guard is not None:
        for k in [k for k in keys if k.startswith("scheduler.admit_")]:
            del keys[k]
        if guard.lower() in ("1", "true", "yes", "on"):
            keys.update(item.partition("=")[::2] for item in _admission(keys["scheduler.program_fcfs_aging_s"]).split(","))
    wait = env.get("HINTFLOW_ADMIT_MAX_WAIT_S", "auto")  # (auto in reports before its removal: the aging bound)
    if wait.lower() != "auto" and "scheduler.admit_fraction" in keys:
        keys["scheduler.admit_max_wait_s"] = wait
    if "HINTFLOW_ADMIT_FRACTION" in env and "scheduler.admit_fraction" in keys:
        keys["scheduler.admit_fraction"] = env["HINTFLOW_ADMIT_FRACTION"]
    if "HINTFLOW_WARM_FIRST" in env:
        keys["scheduler.warm_first"] = str(not _off(env["HINTFLOW_WARM_FIRST"])).lower()
    if "HINTFLOW_WARM_THRESHOLD_TOKENS" in env:
        keys["scheduler.warm_threshold_tokens"] = str(int(float(env["HINTFLOW_WARM_THRESHOLD_TOKENS"])))
    deadline = env.get("HINTFLOW_TTFT_DEADLINE_S")
    if deadline is not None and math.isfinite(float(deadline)):
        keys["scheduler.ttft_deadline_s"] = deadline
    hold = env.get("HINTFLOW_HOLD_QUEUED")
    if hold is not None:
        keys["evict_queued"] = str(_off(hold)).lower()
        keys["host_hold"] = str(not _off(hold)).lower()
    if _off(env.get("HINTFLOW_YIELD_PINS", "1")):
        keys["yield_pins"] = "false"  # (``head`` is not mirrored: ``_unmirrored``)
    slack = env.get("HINTFLOW_FCFS_SLACK")
    if slack is not None:
        keys.pop("scheduler.fcfs_slack", None)
        if math.isfinite(float(slack)):
            keys["scheduler.fcfs_slack"] = slack


def _variant_mirror(
    name: str, variant: dict[str, Any], host_save: str, pin_budget: float | None, host_guard: bool = True,
    admit_wait_s: float | None = None, warm_first: bool = True, bound: str = "", hold_queued: bool = False,
) -> str:
    """A ``--variant`` of a real mode (its report's ``config.variants``): the mode's mirror, named apart,
    with the variant's policy options and node settings (``NODE_ENV``) on top of the mirror's own."""
    if variant["mode"].removesuffix("+host") == "vanilla":
        raise SystemExit(f"variant {name}: its mode {variant['mode']} pushes no policy to mirror")
    spec = _mirror(variant["mode"], host_save, pin_budget, host_guard, admit_wait_s, warm_first, hold_queued) + bound
    base, _, opts = spec.partition("=")[2].partition(":")
    keys = dict(item.split("=", 1) for item in opts.split(","))
    keys.update((f"policy.{k}", str(v).lower()) for k, v in variant["policy_options"].items())
    _node_env(keys, variant.get("env") or {})
    return f"node.{name}={base}:" + ",".join(f"{k}={v}" for k, v in keys.items())


def _reference(mode: str) -> str:
    """The stock row a mode is compared with: the stock scheduler with the same memory."""
    return "vanilla+host" if mode.endswith("+host") else "vanilla"


def _profile(prefill_scale: float, decode_scale: float, out: Path) -> str:
    """``cpu-vllm-tiny`` (measured by ``scripts/vllm_cost_probe.py``: the step's shape, attention's quadratic
    term included) with its prefill and its decode coefficients each scaled."""
    base = json.loads((Path(__file__).parents[1] / "engine_adapter/profiles/cpu-vllm-tiny.json").read_text())
    for key in ("prefill_a_s", "prefill_b_s_per_token", "prefill_c_s_per_token2"):
        base[key] *= prefill_scale
    for key in ("decode_base_s", "decode_per_seq_s", "decode_per_ctx_token_s"):
        base[key] *= decode_scale
    base.update(name="fitted", fit=None, source=f"scripts/vllm_predict.py: cpu-vllm-tiny scaled to a stock vLLM run "
                f"(prefill x{prefill_scale:.3g}, decode x{decode_scale:.3g})")  # fmt: skip
    out.write_text(json.dumps(base))
    return str(out)


def _scaled_profile(path: str, factor: float, out: Path) -> str:
    """The profile at ``path`` with every step price (prefill, decode, copy) times ``factor``."""
    profile = json.loads(Path(path).read_text())
    for key in STEP_PRICES:
        profile[key] *= factor
    out.write_text(json.dumps(profile))
    return str(out)


def spread_factors(n: int) -> list[float]:
    """``n`` scales of the step prices, 1% apart and centred on 1 (``n`` odd: 1 itself is one of them)."""
    if n < 1 or n % 2 == 0:
        raise ValueError(f"--spread {n}: expected an odd number of replays (1, 3, 5, ...)")
    return [1.0 + 0.01 * (i - n // 2) for i in range(n)]


def ratio_spread(runs: list[dict[str, dict[str, float]]], mode: str, ref: str, key: str) -> tuple[float, float, float]:
    """``mode``'s ratio to ``ref`` on ``key`` in each replay of ``runs``: (median, lowest, highest)."""
    ratios = sorted(run[mode][key] / run[ref][key] for run in runs)
    mid = len(ratios) // 2
    median = ratios[mid] if len(ratios) % 2 else (ratios[mid - 1] + ratios[mid]) / 2
    return median, ratios[0], ratios[-1]


def _replay(setup: ReplaySetup, specs: list[str]) -> dict[str, dict[str, float]]:
    configs: list[Any] = []
    for spec in specs:
        configs.append(parse_variant(spec, configs) if "=" in spec else get_replay_config(spec))
    resolved, results = run_replay(setup, configs, jobs=2)
    return report_json(resolved, results)["policies"]  # type: ignore[no-any-return]


def search_scales(error: Callable[[float, float], float]) -> tuple[float, float]:
    """The (prefill, decode) scale with the least ``error``: the best of the grid, then refined
    ``REFINE_LEVELS`` times among its neighbours at half the step before."""
    point = min(itertools.product(PREFILL_SCALE, DECODE_SCALE), key=lambda bd: error(*bd))
    for level in range(1, REFINE_LEVELS + 1):
        fb, fd = PREFILL_STEP ** (0.5**level), DECODE_STEP ** (0.5**level)
        b0, d0 = point
        point = min(itertools.product((b0 / fb, b0, b0 * fb), (d0 / fd, d0, d0 * fd)), key=lambda bd: error(*bd))
    return point


def calibrate(
    real: dict[str, Any], tmp: Path, *, host: bool = False, host_save: str = "evict", host_guard: bool = True
) -> tuple[str, dict[str, float], float]:
    """The grid point whose replayed stock row is nearest the measured one (log error): ``vanilla``, or with
    ``host`` ``vanilla+host`` on a node with the report's host tier.

    Why apart: on the CPU build a vLLM server with a KV connector computed prompt tokens about 1.6x faster
    than one without (vLLM's own log: 5,600 against 9,000 prompt tokens/s on the same trace, with 0.1%
    external hits), so one cost model does not fit both."""
    ref = "vanilla+host" if host else "vanilla"
    target = real["policies"][ref]
    budget = real["config"].get("pin_budget")
    # the node's prefill share, where a hintflow mode of this memory point reported it: it tells apart the
    # splits of a step between prefill and decode that fit the stock run's latencies alike
    shares = [(m, row["node_prefill_share"]) for m, row in real["policies"].items()
              if m.endswith("+host") == host and m.removesuffix("+host") in MIRRORS and row.get("node_prefill_share")]
    share_mode, share = shares[0] if shares else (None, None)
    specs = [_mirror(ref, host_save, budget)] + (
        [_mirror(share_mode, host_save, budget, host_guard,
                 _admit_wait(real, host),
                 real["config"].get("warm_first", False), _hold_queued(real, host))] if share_mode else []
    )
    tried: dict[tuple[float, float], tuple[float, str, dict[str, float]]] = {}

    def fit(b: float, d: float) -> tuple[float, str, dict[str, float]]:
        if (b, d) not in tried:
            path = _profile(b, d, tmp / f"p{int(host)}-{len(tried)}.json")
            rows = list(_replay(_setup(real, path, host=host), specs).values())
            err = sum(math.log(rows[0][k] / target[k]) ** 2 for k in KEYS)
            if share is not None and rows[1]["prefill_share"] > 0:
                err += math.log(rows[1]["prefill_share"] / share) ** 2
            tried[b, d] = (err, path, rows[0])
        return tried[b, d]

    best = fit(*search_scales(lambda b, d: fit(b, d)[0]))
    if share_mode is not None:
        print(f"fitting {ref} also to {share_mode}'s prefill share of step time, {share:.2f}")
    return best[1], best[2], math.sqrt(best[0] / (len(KEYS) + (share is not None)))


def _spec(real: dict[str, Any], mode: str, variants: dict[str, Any], host_save: str, host_guard: bool,
          device_pin_budget: float) -> str:  # fmt: skip
    """The replay spec of a real mode's mirror, with the report's node settings (a variant's on top)."""
    host = mode.endswith("+host")
    budget = real["config"].get("pin_budget")
    if budget is None and not host:
        budget = device_pin_budget
    wait = _admit_wait(real, host)
    warm = real["config"].get("warm_first", False)  # (reports before the rule: its nodes had none)
    hold = _hold_queued(real, host)
    # (reports before the bound's default: none; before its own default with the tier, fcfs_slack was both)
    slack = real["config"].get("fcfs_slack_host" if host and "fcfs_slack_host" in real["config"] else "fcfs_slack")
    base = variants[mode]["mode"] if mode in variants else mode
    own = base.removesuffix("+host") not in MODE_ENV and base.removesuffix("+host") != "vanilla"
    bound = f",scheduler.fcfs_slack={slack}" if own and slack is not None and math.isfinite(slack) else ""
    if mode in variants:
        return _variant_mirror(mode, variants[mode], host_save, budget, host_guard, wait, warm, bound, hold)
    return _mirror(mode, host_save, budget, host_guard, wait, warm, hold) + bound


def _turns(real: dict[str, Any], mode: str, variants: dict[str, Any], a: argparse.Namespace, host_guard: bool) -> None:
    """``--turns MODE``: its mirror, replayed once, beside the real run turn by turn."""
    host, ref = mode.endswith("+host"), _reference(mode)
    with tempfile.TemporaryDirectory() as tmp:
        if a.profile is not None:
            path = str(a.profile)
        elif a.fit is not None:
            profiles = json.loads(a.fit.read_text()).get("profiles", {})
            if ref not in profiles:
                raise SystemExit(f"--fit {a.fit}: no profile fitted to {ref} (it has: {', '.join(profiles) or 'none'})")
            path = str(Path(tmp) / "fit.json")
            Path(path).write_text(json.dumps(profiles[ref]))
        else:
            path = calibrate(real, Path(tmp), host=host, host_save=a.host_save, host_guard=host_guard)[0]
        spec = _spec(real, mode, variants, a.host_save, host_guard, a.device_pin_budget)
        _, results = run_replay(_setup(real, path, host=host), [parse_variant(spec, [])], jobs=1)
    pairs = pair_turns(real["programs"][mode], results[0].turns)
    print(f"{mode}: the real run's first round ({len(pairs)} turns) beside its mirror\n")
    print(format_turns(pairs))


def _tries(texts: list[str], real: dict[str, Any], modes: list[str]) -> dict[str, dict[str, Any]]:
    """``--try`` variants: mirrored node settings of a mode this sitting ran, each as a report's variant."""
    out: dict[str, dict[str, Any]] = {}
    earlier: list[Any] = []
    for text in texts:
        try:
            v = parse_vllm_variant(text, earlier)
        except ValueError as e:
            raise SystemExit(str(e).replace("--variant", "--try", 1)) from None
        earlier.append(v)
        env = dict(v.env)
        unmirrored = _unmirrored(env)
        if unmirrored or v.policy_options:
            what = ", ".join([*unmirrored, *(f"policy.{k}" for k, _ in v.policy_options)])
            raise SystemExit(f"--try {text!r}: the mirror has no equivalent of {what} (it mirrors env. {', '.join(NODE_ENV)})")
        if v.name in real["policies"]:
            raise SystemExit(f"--try {text!r}: {v.name!r} is a mode the sitting ran; name the variant apart")
        if v.mode not in modes or v.mode.removesuffix("+host") not in MIRRORS:
            raise SystemExit(f"--try {text!r}: its mode {v.mode!r} is not a mirrored mode of this report "
                             f"(those: {', '.join(m for m in modes if m.removesuffix('+host') in MIRRORS and m != _reference(m))})")
        out[v.name] = {"mode": v.mode, "policy_options": {}, "env": env}
    return out


def lost_table(meas: dict[str, dict[str, Any]], pred: dict[str, dict[str, Any]], modes: list[str]) -> list[str]:
    """Rows of where each mode's recomputed history went, node against mirror, in shares by cause (the
    node's last ``lost=`` log reading, ``node_lost_by``, in reports since it was added; the mirror's
    ``lost_by`` tokens): which rule loses the contexts the mirror keeps, or the other way round."""
    rows = []
    for m in modes:
        node, mirror = meas[m].get("node_lost_by"), pred.get(m, {}).get("lost_by")
        if node is None or not mirror:
            continue
        total = sum(mirror.values())
        causes = sorted(set(node) | set(mirror), key=lambda c: -max(node.get(c, 0.0), mirror.get(c, 0) / total))
        rows.append(f"{m}: " + ", ".join(f"{c} {node.get(c, 0.0):.2f} / {mirror.get(c, 0) / total:.2f}" for c in causes))
    return rows


def _print_lost(meas: dict[str, dict[str, Any]], pred: dict[str, dict[str, Any]], modes: list[str]) -> None:
    rows = lost_table(meas, pred, modes)
    if rows:
        print("where the recomputed history went, share by cause, node / mirror (engine_adapter/_lost_context.py):")
        print("\n".join(rows))


def _print_tried(
    tried: dict[str, dict[str, Any]], runs: dict[str, list[dict[str, dict[str, float]]]],
    pred: dict[str, dict[str, float]], ranges: bool,
) -> dict[str, Any]:  # fmt: skip
    """The ``--try`` rows, predicted only (the node never ran them), beside their mode's prediction."""
    if not tried:
        return {}
    print("\nnot run on the node (--try), predicted only:\n\n| variant | of mode | predicted × stock: mean, p90 JCT, "
          "TTFT p99 (median, range) | the mode's, predicted | hits predicted |\n|---|---|---|---|---|")
    rows = {}
    for name, v in tried.items():
        mode, ref = v["mode"], _reference(v["mode"])
        got = [ratio_spread(runs[name], name, ref, k) for k in RATIO_KEYS]
        own = [ratio_spread(runs[mode], mode, ref, k)[0] for k in RATIO_KEYS]
        span = " (" + ", ".join(f"{lo:.2f}-{hi:.2f}" for _, lo, hi in got) + ")" if ranges else ""
        print(f"| {name} | {mode} | {', '.join(f'{med:.2f}' for med, _, _ in got)}{span} | "
              f"{', '.join(f'{x:.2f}' for x in own)} | {pred[name]['across_turn_hit_rate']:.0%} |")
        rows[name] = {"mode": mode, "env": v["env"], "predicted": [med for med, _, _ in got],
                      "predicted_range": [[lo, hi] for _, lo, hi in got], "mode_predicted": own}
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("real", type=Path)
    ap.add_argument("--json", dest="json_out", type=Path)
    ap.add_argument("--host-save", choices=sorted(HOST), default="evict",
                    help="how the real run's host connector saved blocks (HINTFLOW_HOST_SAVE) [evict]")
    ap.add_argument("--node-prefill-share", action="append", default=[], metavar="MODE=SHARE",
                    help="a hintflow mode's prefill share of step time, as its node logged it (prefill_share=); "
                         "reports since 2026-12-04 carry it (node_prefill_share)")
    ap.add_argument("--device-pin-budget", type=float, default=PIN_BUDGET,
                    help="the node's pin budget without a host tier when the report ran, unless its config names "
                         f"one: 0.7 for reports before cbd7738 [{PIN_BUDGET}]")
    ap.add_argument("--host-guard", choices=("on", "off"), default="on",
                    help="whether the +host modes' nodes ran the admission guard: off for reports before the "
                         "commit after a902ceb [on]")
    ap.add_argument("--profile", type=Path,
                    help="replay with this cost profile instead of fitting one to the stock run (a profile "
                         "scripts/vllm_steps.py --write-profile fitted to the sitting's traced steps)")
    ap.add_argument("--spread", type=int, default=5,
                    help="replays of the prediction, every step price scaled 1%% apart around the profile's; the "
                         "ratio is their median (odd; 1: one replay) [5]")
    ap.add_argument("--try", dest="tries", action="append", default=[], metavar="NAME=MODE:env.KEY=V,...",
                    help="also predict a node setting the sitting did not run, as the harness's --variant names it "
                         f"(keys: env. with {', '.join(NODE_ENV)}); repeatable")
    ap.add_argument("--step-trace", type=Path, metavar="DIR",
                    help="each mirror writes its steps to DIR/node.MODE/ in the vLLM node's step-trace format, for "
                         "scripts/vllm_steps.py beside the sitting's own trace (the replay at the profile's prices)")
    ap.add_argument("--turns", metavar="MODE", help="compare one mode turn by turn with its mirror")
    ap.add_argument("--fit", type=Path, metavar="OUT",
                    help="with --turns: the fitted profiles of an earlier run on this report (its --json OUT)")
    a = ap.parse_args()
    host_guard = a.host_guard == "on"
    real = json.loads(a.real.read_text())
    for item in a.node_prefill_share:  # by hand, from the node's 10 s log line (reports before 2026-12-04)
        mode, _, value = item.partition("=")
        if mode not in real["policies"] or not value:
            raise SystemExit(f"--node-prefill-share {item!r}: expected MODE=SHARE with a mode of {a.real}")
        real["policies"][mode]["node_prefill_share"] = float(value)
    variants = {name: v for name, v in real["config"].get("variants", {}).items()
                if not _unmirrored(v.get("env") or {})}
    for name in sorted(set(real["config"].get("variants", {})) - set(variants)):
        print(f"{name}: a variant of node settings the replay has no equivalent of (env.*), not mirrored")
    modes = [m for m in real["policies"] if m.removesuffix("+host") in MIRRORS or m in variants]
    if not any(m in modes for m in ("vanilla", "vanilla+host")):
        raise SystemExit(f"{a.real}: no vanilla or vanilla+host row to calibrate on")
    modes = [m for m in modes if _reference(m) in modes]  # a ratio needs its stock row from the same run
    tried = _tries(a.tries, real, modes)
    variants.update(tried)
    if a.turns is not None:
        if a.turns not in modes:
            raise SystemExit(f"--turns {a.turns}: not a mirrored mode of {a.real} (those: {', '.join(modes)})")
        _turns(real, a.turns, variants, a, host_guard)
        return
    pred: dict[str, dict[str, float]] = {}
    runs: dict[str, list[dict[str, dict[str, float]]]] = {}  # each mode: its group's replays, one per factor
    factors = spread_factors(a.spread)
    fits: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for host in (False, True):
            group = [m for m in [*modes, *tried] if m.endswith("+host") == host]
            if not group:
                continue
            if a.profile is not None:  # (fitted to the sitting's steps, or any other)
                path = str(a.profile)
                fits[_reference(group[0])] = json.loads(a.profile.read_text())
                print(f"{_reference(group[0])}: replayed with {a.profile} as it is")
            else:
                path, fit, rms = calibrate(real, Path(tmp), host=host, host_save=a.host_save, host_guard=host_guard)
                profile = json.loads(Path(path).read_text())
                fits[_reference(group[0])] = profile
                print(f"fitted to {_reference(group[0])}: {profile['source'].partition('(')[2].rstrip(')')}; prefill "
                      f"b {profile['prefill_b_s_per_token']:.3g} s/token, c {profile['prefill_c_s_per_token2']:.3g} "
                      f"s/token², decode step {profile['decode_base_s']:.3g} s (replayed {fit['jct_mean_s']:.1f} / "
                      f"{fit['jct_p90_s']:.1f} s JCT mean / p90, TTFT p50 {fit['ttft_p50_s']:.2f} s; rms log error {rms:.3f})")
            specs = [_spec(real, m, variants, a.host_save, host_guard, a.device_pin_budget) for m in group]
            names = [s.partition("=")[0] if "=" in s else s for s in specs]
            replays = []
            for i, factor in enumerate(factors):
                scaled = path if factor == 1.0 else _scaled_profile(path, factor, Path(tmp) / f"s{int(host)}-{i}.json")
                got = _replay(_setup(real, scaled, host=host, trace=a.step_trace if factor == 1.0 else None), specs)
                replays.append({m: got[n] for m, n in zip(group, names, strict=True)})
                if factor == 1.0:
                    pred.update(replays[-1])
            runs.update(dict.fromkeys(group, replays))  # a ratio's two rows come from one group's replays
    meas = real["policies"]
    print("| mode | measured mean / p90 JCT | predicted | × stock | predicted × stock (median, range) | error (mean, p90) | "
          "TTFT p99 × stock, measured / predicted | hits measured / predicted |\n|---|---|---|---|---|---|---|---|")
    rows = {}
    for m in modes:
        ref = _reference(m)
        # a sitting with stock bracketing each run (--bracket): each run's ratio to its neighbours, which a
        # machine drifting during the sitting moves far less than the ratio of the medians
        paired = real.get("ratios", {}).get(m, {}) if real.get("sequence") else {}
        r_meas = [paired[k]["median"] if k in paired else meas[m][k] / meas[ref][k] for k in RATIO_KEYS]
        spread = [ratio_spread(runs[m], m, ref, k) for k in RATIO_KEYS]
        r_pred = [med for med, _, _ in spread]
        err = [p / r - 1 for p, r in zip(r_pred, r_meas, strict=True)]
        # the first-token tail is reported, not fitted or scored: a p99 over a few hundred turns is the sixth
        # slowest, one draw of the order in which the peak's queue clears
        rows[m] = {"measured": r_meas[:2], "predicted": r_pred[:2], "predicted_range": [[lo, hi] for _, lo, hi in spread[:2]],
                   "error": err[:2], "predicted_jct_s": [pred[m]["jct_mean_s"], pred[m]["jct_p90_s"]],
                   "ttft_p99": {"measured": r_meas[2], "predicted": r_pred[2], "predicted_range": list(spread[2][1:])}}
        ranges = "" if len(factors) == 1 else " (" + ", ".join(f"{lo:.2f}-{hi:.2f}" for _, lo, hi in spread[:2]) + ")"
        tail = f"{r_meas[2]:.2f} / {r_pred[2]:.2f}" + ("" if len(factors) == 1 else f" ({spread[2][1]:.2f}-{spread[2][2]:.2f})")
        print(f"| {m} | {meas[m]['jct_mean_s']:.1f} / {meas[m]['jct_p90_s']:.1f} s | "
              f"{pred[m]['jct_mean_s']:.1f} / {pred[m]['jct_p90_s']:.1f} s | {r_meas[0]:.2f}, {r_meas[1]:.2f} | "
              f"{r_pred[0]:.2f}, {r_pred[1]:.2f}{ranges} | {err[0]:+.0%}, {err[1]:+.0%} | {tail} | "
              f"{meas[m]['across_turn_hit_rate']:.0%} / {pred[m]['across_turn_hit_rate']:.0%} |")
    _print_lost(meas, pred, modes)
    tried_rows = _print_tried(tried, runs, pred, len(factors) > 1)
    order_meas = sorted(modes, key=lambda m: (m.endswith("+host"), meas[m]["jct_mean_s"]))
    order_pred = sorted(modes, key=lambda m: (m.endswith("+host"), pred[m]["jct_mean_s"]))
    print(f"ranking by mean JCT, measured: {', '.join(order_meas)}\n"
          f"ranking by mean JCT, predicted: {', '.join(order_pred)} ({'same' if order_meas == order_pred else 'differs'})")
    if a.json_out:
        a.json_out.write_text(json.dumps({"profiles": fits, "rows": rows, "ranking_measured": order_meas,
                                          "ranking_predicted": order_pred, "tried": tried_rows}, indent=1))


if __name__ == "__main__":
    main()
