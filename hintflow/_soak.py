"""``hintflow soak``: example programs keep arriving on a local Temporal and engine nodes while a chaos
loop SIGKILLs and restarts nodes and workers; at the end, did every program finish, and is every pool whole.

This module holds the run: its config, the program mix and their arrivals, the drain, and ``run_soak`` (the
entry point of the ``soak`` command).

Pieces: Temporal (a dev server started here, or ``--temporal``); N torch engine nodes and W ``hintflow
worker`` processes on loopback (``_soak_fleet.Fleet``); this process submits programs at a Poisson rate and
waits for their results (a Temporal client only: it runs no workflow); the chaos loop (``_soak_chaos.Chaos``).
After the arrival window the chaos stops, killed members are back, every program gets ``drain_timeout_s`` to
finish, and every node ``POOL_SETTLE_S`` to hold nothing (the programs' ``Release``, then any pin a dead
worker left lapses on the node's clock).  What is counted comes from where it is real (``_soak_report``):
programs from their results, retries from each workflow's history, failovers from the workers' logs,
migrations from the workers' ``/metrics``, pools from each node's ``GetCacheState``.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import signal
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hintflow._soak_chaos import Chaos
from hintflow._soak_fleet import Fleet, Member, watch_workers
from hintflow._soak_report import POOL_SETTLE_S, build_report, format_report, settle_pools

__all__ = ["POOL_SETTLE_S", "SoakConfig", "format_report", "run_soak"]

_SIGNAL_STATUS = {"SIGINT": 130, "SIGTERM": 143}


@dataclass
class SoakConfig:
    minutes: float
    num_nodes: int = 3
    num_workers: int = 2
    rate_per_s: float = 1.0
    seed: int = 0
    chaos_interval_s: float = 20.0  # mean; 0: no chaos
    # 64 blocks of 16 tokens: the longest program (a 6-turn coding agent, ~860 tokens) fills most of a node,
    # so a few live programs press on memory; the host tier takes what is evicted
    num_device_blocks: int = 64
    num_host_blocks: int = 64
    policy: str = "hintflow"
    drain_timeout_s: float = 300.0
    temporal: str | None = None
    task_queue: str | None = None  # default soak-<random>: names the workers' queue and the nodes' ids
    log_dir: str | None = None  # default a new temporary folder


def _next_program(rng: random.Random) -> tuple[str, Any]:
    """An example program and its input: half coding agents, some pipelines, some people in the loop;
    pauses scaled so a program takes seconds, not minutes."""
    from workflows.examples import CodingAgentInput, HumanInLoopInput, PipelineInput

    r = rng.random()
    if r < 0.5:
        return "coding-agent", CodingAgentInput(turns=rng.randint(3, 6), time_scale=0.5, tool_max_s=20.0)
    if r < 0.8:
        join = rng.choice(["and", "or"])
        return "pipeline", PipelineInput(
            num_workers=rng.randint(2, 3), join=join, time_scale=0.5, tool_max_s=20.0
        )
    return "human-in-loop", HumanInLoopInput(rounds=rng.randint(2, 3), human_median_s=4.0, human_sigma=0.5)


@dataclass
class Program:
    workflow_id: str
    example: str
    started_s: float
    handle: Any  # temporalio.client.WorkflowHandle
    finished_s: float | None = None
    failure: str | None = None  # the workflow's failure, innermost cause first

    @property
    def done(self) -> bool:
        return self.finished_s is not None or self.failure is not None


@dataclass
class Soak:
    """One run's state; read by the interrupt path, so kept outside the task that runs it."""

    cfg: SoakConfig
    emit: Callable[[str], None]
    task_queue: str
    log_dir: Path
    programs: list[Program] = field(default_factory=list)
    t0: float = 0.0
    signal_name: str | None = None
    cancellable: bool = (
        False  # False while a Temporal dev server starts: cancelled half-started, it is left running
    )

    def say(self, text: str) -> None:
        self.emit(f"{time.monotonic() - self.t0:8.1f} s  {text}" if self.t0 else text)


async def run_soak(cfg: SoakConfig, emit: Callable[[str], None]) -> tuple[int, dict[str, Any] | None]:
    """(exit status, report): 0 when every program finished and every pool is whole, 1 otherwise; on
    SIGINT/SIGTERM 130/143 and no report.  Every process started here is stopped before it returns."""
    task_queue = cfg.task_queue or f"soak-{uuid.uuid4().hex[:8]}"
    log_dir = Path(cfg.log_dir) if cfg.log_dir else Path(tempfile.mkdtemp(prefix="hintflow-soak-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    soak = Soak(cfg, emit, task_queue, log_dir)
    me = asyncio.current_task()
    assert me is not None
    loop = asyncio.get_running_loop()

    def on_signal(sig: signal.Signals) -> None:
        if soak.signal_name is None:  # a second signal changes nothing: the clean-up is bounded
            soak.signal_name = sig.name
            if soak.cancellable:
                me.cancel()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig)
    try:
        report = await _run(soak)
    except asyncio.CancelledError:
        if soak.signal_name is None:
            raise
        done = sum(p.finished_s is not None for p in soak.programs)
        emit(
            f"hintflow soak: interrupted ({soak.signal_name}): {len(soak.programs)} programs started, {done} "
            f"finished; every process it started is stopped; logs in {log_dir}"
        )
        return _SIGNAL_STATUS.get(soak.signal_name, 1), None
    return (0 if report["ok"] else 1), report


async def _run(soak: Soak) -> dict[str, Any]:
    from hintflow._run import local_temporal

    cfg = soak.cfg
    async with local_temporal(cfg.temporal) as client:
        soak.cancellable = True
        if soak.signal_name is not None:  # it came while the dev server started
            raise asyncio.CancelledError
        fleet = Fleet(soak.log_dir)
        background: list[asyncio.Task[Any]] = []
        waits: list[asyncio.Task[None]] = []
        chaos: Chaos | None = None
        try:
            temporal = client.service_client.config.target_host
            soak.emit(
                f"hintflow soak: Temporal {temporal}, {cfg.num_nodes} nodes, {cfg.num_workers} workers on task "
                f"queue {soak.task_queue}; logs in {soak.log_dir}"
            )
            nodes = [
                Member("node", f"node-{i}", _node_args(cfg, f"{soak.task_queue}-node-{i}"))
                for i in range(cfg.num_nodes)
            ]
            await asyncio.gather(*(fleet.start(n) for n in nodes))
            engines = ",".join(n.address for n in nodes)
            workers = [
                Member("worker", f"worker-{i}", _worker_args(cfg, temporal, engines, soak.task_queue))
                for i in range(cfg.num_workers)
            ]
            await asyncio.gather(*(fleet.start(w) for w in workers))
            soak.t0 = time.monotonic()
            soak.emit(f"serving: nodes {engines}; programs arrive for {cfg.minutes:g} min")
            until_s = soak.t0 + cfg.minutes * 60.0
            chaos = Chaos(fleet, random.Random(f"{cfg.seed}:chaos"), cfg.chaos_interval_s, soak.emit, soak.t0)
            background += [
                asyncio.create_task(chaos.run(until_s)),
                asyncio.create_task(watch_workers(fleet)),
                asyncio.create_task(_progress(soak, fleet, until_s)),
            ]
            await _arrivals(soak, client, until_s, waits)
            await background[0]  # the chaos loop ends with the window
            soak.say("arrivals and chaos over; waiting for the restarts under way")
            await chaos.settle()
            soak.say(f"draining: {sum(not p.done for p in soak.programs)} programs still running")
            drained = await _drain(waits, cfg.drain_timeout_s)
            soak.say("drained" if drained else f"drain timed out after {cfg.drain_timeout_s:g} s")
            pools = await settle_pools(fleet.of_kind("node"), POOL_SETTLE_S)
            return await build_report(soak, fleet, chaos, pools)
        finally:
            soak.cancellable = False  # the clean-up runs to its end
            for t in [*background, *waits]:
                t.cancel()
            if chaos is not None:
                await chaos.cancel()
            await asyncio.gather(*background, *waits, return_exceptions=True)
            await fleet.stop_all()
            if cfg.temporal:  # a shared server: leave it no program that nobody serves any more
                await _terminate_unfinished(soak.programs)


def _node_args(cfg: SoakConfig, node_id: str) -> list[str]:
    return [
        "engine", "serve", "--executor", "torch", "--node-id", node_id, "--metrics-port", "-1",
        "--num-device-blocks", str(cfg.num_device_blocks), "--num-host-blocks", str(cfg.num_host_blocks),
    ]  # fmt: skip


def _worker_args(cfg: SoakConfig, temporal: str, engines: str, task_queue: str) -> list[str]:
    return ["worker", "--temporal", temporal, "--engines", engines, "--task-queue", task_queue,
            "--policy", cfg.policy]  # fmt: skip


# ---- programs ----------------------------------------------------------------------------------------
async def _arrivals(soak: Soak, client: Any, until_s: float, waits: list[asyncio.Task[None]]) -> None:
    """Start programs at Poisson times (seeded) until ``until_s``; a task per program waits for its end."""
    from workflows.examples import EXAMPLES, ProgramReport

    rng = random.Random(f"{soak.cfg.seed}:arrivals")
    at = time.monotonic()
    while at < until_s:
        await asyncio.sleep(max(0.0, at - time.monotonic()))
        example, inp = _next_program(rng)
        wid = f"{soak.task_queue}-{len(soak.programs):05d}-{example}"
        handle = await client.start_workflow(
            EXAMPLES[example].workflow.run,  # type: ignore[attr-defined]
            inp,
            id=wid,
            task_queue=soak.task_queue,
            result_type=ProgramReport,
        )
        program = Program(wid, example, time.monotonic(), handle)
        soak.programs.append(program)
        waits.append(asyncio.create_task(_wait_for(program)))
        at += rng.expovariate(soak.cfg.rate_per_s)


async def _wait_for(program: Program) -> None:
    from temporalio.client import WorkflowFailureError

    from hintflow.cli import _failure_text

    while True:
        try:
            await program.handle.result()
        except WorkflowFailureError as exc:
            program.failure = _failure_text(exc)
            return
        except asyncio.CancelledError:
            raise
        except Exception:  # the result's long poll broke (a busy server): ask again
            await asyncio.sleep(1.0)
            continue
        program.finished_s = time.monotonic()
        return


async def _drain(waits: list[asyncio.Task[None]], timeout_s: float) -> bool:
    if not waits:
        return True
    _, pending = await asyncio.wait(waits, timeout=timeout_s)
    return not pending


async def _progress(soak: Soak, fleet: Fleet, until_s: float) -> None:
    """A line now and then: how far the run is (about ten lines over the window, every 10-60 s)."""
    every_s = min(60.0, max(10.0, (until_s - soak.t0) / 10))
    while True:
        await asyncio.sleep(every_s)
        done = sum(p.finished_s is not None for p in soak.programs)
        failed = sum(p.failure is not None for p in soak.programs)
        soak.say(
            f"programs started {len(soak.programs)}, finished {done}, failed {failed}; serving: "
            f"{len(fleet.ready('node'))}/{soak.cfg.num_nodes} nodes, "
            f"{len(fleet.ready('worker'))}/{soak.cfg.num_workers} workers"
        )


async def _terminate_unfinished(programs: list[Program]) -> None:
    async def terminate(p: Program) -> None:
        # (one already closed, or a server gone: nothing left to stop)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(p.handle.terminate(reason="hintflow soak ended"), 5.0)

    await asyncio.gather(*(terminate(p) for p in programs if not p.done))
