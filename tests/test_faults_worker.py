"""Faults on the Temporal side, on real parts: a worker SIGKILLed mid-call and mid-tool, SIGTERM to
`hintflow worker`, a dead engine node in the log, and the heartbeats that make the first one recoverable.

Real parts throughout: the session's Temporal dev server (``temporal_env``), torch engine nodes on loopback
(``start_engine``), and `hintflow worker` as a subprocess where a worker is killed or signalled.  A killed
worker's programs must be resumed by another within a bound far below the activities' start-to-close
timeouts (5 minutes for ``llm``, 30 for ``tool``), and the node must be left whole: the dead worker's call
aborted, its pins lapsed on the node's clock, every block back once the programs end, a second
``Release`` harmless.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families
from temporalio import activity, workflow
from temporalio.api.enums.v1 import TimeoutType
from temporalio.client import WorkflowFailureError, WorkflowHandle
from temporalio.common import RetryPolicy
from temporalio.exceptions import ApplicationError
from temporalio.worker import Worker

from hintflow._run import STICKY_QUEUE_TIMEOUT
from hints import EngineClient, Priority, Release
from tests.polling import free_port, until
from workflows import MIN_HEARTBEAT_TIMEOUT, HintflowPlugin, HintPublisher, HintRuntime, llm, tool
from workflows.examples import CodingAgent, CodingAgentInput, HumanInLoopInput, ProgramReport

CLI = [sys.executable, "-m", "hintflow"]
CODING = "hintflow.examples.CodingAgent"
HUMAN = "hintflow.examples.HumanInLoop"
# With the cold-start pause model at a 0.5 s mean, a ~6k-token context is worth pinning at a tool's start
# (the runtime prices a re-prefill at 1e-4 s a token until it has measured the node), and the pin is
# renewed on ticks through the tool's first 2.3 s: the killed worker leaves a live pin behind.
POLICY = "hintflow:pause.default_mean_s=0.5"
RESUME_BOUND_S = 45.0
"""Kill to the last program's end: the 10 s heartbeat timeout, a retry and the rerun activity, far below
the 300 s / 1800 s the programs stalled for before activities had heartbeat timeouts."""


# ---- helpers ----------------------------------------------------------------------------------------
def _spawn_worker(args: list[str], log: Path) -> subprocess.Popen[str]:
    with log.open("w") as err:
        return subprocess.Popen(
            [*CLI, "worker", *args],
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )


async def _ready(p: subprocess.Popen[str], log: Path, timeout_s: float = 90.0) -> None:
    """Until the worker says it serves (its line on stdout); fails with its log if it exits first."""

    def read() -> str:
        assert p.stdout is not None
        for line in p.stdout:
            if "hintflow worker: task queue" in line:
                return line
        return ""

    line = await asyncio.wait_for(asyncio.to_thread(read), timeout_s)
    assert line, f"worker exited with {p.poll()} before serving:\n{log.read_text()[-3000:]}"


async def _stop(p: subprocess.Popen[str], sig: int, timeout_s: float = 60.0) -> str:
    """Send ``sig`` and wait for the exit; the rest of its stdout."""
    p.send_signal(sig)
    out, _ = await asyncio.to_thread(p.communicate, timeout=timeout_s)
    return out


def _kill(*procs: subprocess.Popen[str] | None) -> None:
    for p in procs:
        if p is not None and p.poll() is None:
            p.kill()
            p.wait()



async def _metric(address: str | None, name: str, **labels: str) -> float:
    """The sum of the node's ``/metrics`` samples called ``name`` with these labels."""
    assert address is not None, "the node serves no metrics"

    def scrape() -> str:
        with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as r:
            return str(r.read().decode())

    total = 0.0
    for family in text_string_to_metric_families(await asyncio.to_thread(scrape)):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total



def _children(pid: int) -> dict[int, str]:
    """Processes whose parent is ``pid``: their command lines."""
    out: dict[int, str] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            out[int(entry)] = cmd
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


async def _timer_started(handle: WorkflowHandle[Any, Any]) -> bool:
    """The workflow waits on a timer (HumanInLoop: for its person)."""
    async for e in handle.fetch_history_events():
        if e.HasField("timer_started_event_attributes"):
            return True
    return False


async def _heartbeat_retries(handle: WorkflowHandle[Any, Any]) -> list[str]:
    """Activity types of this workflow that ran again after an attempt's heartbeat timeout."""
    kinds: dict[int, str] = {}
    out: list[str] = []
    async for e in handle.fetch_history_events():
        if e.HasField("activity_task_scheduled_event_attributes"):
            kinds[e.event_id] = e.activity_task_scheduled_event_attributes.activity_type.name
        if e.HasField("activity_task_started_event_attributes"):
            a = e.activity_task_started_event_attributes
            if (
                a.attempt > 1
                and a.last_failure.timeout_failure_info.timeout_type == TimeoutType.TIMEOUT_TYPE_HEARTBEAT
            ):
                out.append(kinds[a.scheduled_event_id])
    return out


# ---- a worker dies ----------------------------------------------------------------------------------
async def test_programs_of_a_killed_worker_resume_on_another_and_the_node_is_left_whole(
    temporal_env: Any, start_engine: Any, tmp_path: Path
) -> None:
    node = await start_engine("node-faults", num_device_blocks=1024, model={"max_model_len": 8192})
    client = temporal_env.client
    tq = f"tq-faults-{uuid.uuid4().hex[:8]}"
    args = ["--temporal", client.service_client.config.target_host, "--engines", node.address]
    args += ["--task-queue", tq, "--policy", POLICY]
    first = _spawn_worker(args, tmp_path / "first.log")
    second: subprocess.Popen[str] | None = None
    try:
        await _ready(first, tmp_path / "first.log")
        # One program in a long model call (1,500 tokens, several seconds), one in a 3 s tool with its
        # context pinned, one waiting for a person: each is on the worker about to die.
        starts = [
            (CODING, CodingAgentInput(turns=1, output_tokens=1500), "mid-call"),
            (CODING, CodingAgentInput(turns=2, task_tokens=6000, tool_mean_s=3.0, tool_sd_s=0.0), "mid-tool"),
            (HUMAN, HumanInLoopInput(rounds=2, human_median_s=600.0, human_sigma=0.0), "waiting"),
        ]
        handles: list[WorkflowHandle[Any, ProgramReport]] = [
            await client.start_workflow(wf, inp, id=f"{name}-{tq}", task_queue=tq, result_type=ProgramReport)
            for wf, inp, name in starts
        ]
        mid_call, mid_tool, waiting = handles
        async with EngineClient(node.address) as c:

            async def in_place() -> bool:
                st = await c.get_cache_state(include_sessions=True)
                by = {s.session_id: s for s in st.sessions}
                call, paused = by.get(mid_call.id), by.get(mid_tool.id)
                return (
                    call is not None and call.state == "running"
                    and paused is not None and paused.pinned
                    and await _timer_started(waiting)
                )  # fmt: skip

            await until(in_place, 60, "a call running, a tool's context pinned, a person awaited")
            aborted0 = await _metric(
                node.metrics_address, "hintflow_request_success_total", finish_reason="abort"
            )
            lapsed0 = await _metric(node.metrics_address, "hintflow_pin_expiries_total")
            first.kill()
            first.wait()
            killed = time.monotonic()
            second = _spawn_worker(args, tmp_path / "second.log")
            # A workflow task now goes to the dead worker's sticky queue (it polled moments ago).
            await waiting.signal("approve")
            signalled = time.monotonic()

            # Nothing can resume before the 10 s heartbeat timeout: what the node lets go now, it lets go
            # on its own.  The call whose client vanished is aborted and the pins lapse on its clock.
            async def let_go() -> bool:
                st = await c.get_cache_state(include_sessions=True)
                return st.num_running == 0 and st.num_waiting == 0 and st.pinned_blocks == 0

            cleared = await until(let_go, 8, "the node ending the dead worker's call and its pins")
            assert cleared - killed < 5.0
            aborted = await _metric(
                node.metrics_address, "hintflow_request_success_total", finish_reason="abort"
            )
            assert aborted == aborted0 + 1, "the dead worker's call was not aborted (it ran to its end)"
            assert await _metric(node.metrics_address, "hintflow_pin_expiries_total") > lapsed0
            node.core.check_invariants()

            finished: dict[str, float] = {}

            async def result(h: WorkflowHandle[Any, ProgramReport]) -> ProgramReport:
                report = await h.result()
                finished[h.id] = time.monotonic()
                return report

            await _ready(second, tmp_path / "second.log")
            serving = time.monotonic()
            reports = await asyncio.wait_for(
                asyncio.gather(*(result(h) for h in handles)), RESUME_BOUND_S + 15
            )
            slowest = max(finished.values()) - killed
            assert slowest < RESUME_BOUND_S, {k: round(v - killed, 1) for k, v in finished.items()}
            assert [len(r.turns) for r in reports] == [1, 2, 2]
            # The signalled program's task left the dead worker's sticky queue after `hintflow worker`'s 5 s,
            # not the SDK's default 10 s (it can resume no earlier than the second worker serves).
            sticky_s = STICKY_QUEUE_TIMEOUT.total_seconds()
            assert finished[waiting.id] - max(signalled + sticky_s, serving) < 3.0, (
                signalled,
                serving,
                finished,
            )
            assert reports[2].turns[0].tool == "human"
            # Resumed by the heartbeat timeout, not by the start-to-close timeout or a lucky finish.
            assert await _heartbeat_retries(mid_call) == ["hintflow.llm"]
            assert await _heartbeat_retries(mid_tool) == ["hintflow.tool"]

            # The second worker released the programs when they ended: the pool is whole.
            async def released() -> bool:
                return not (await c.get_cache_state(include_sessions=True)).sessions

            await until(released, 10, "the programs' contexts released")
            whole = await c.get_cache_state()
            assert (whole.free_blocks, whole.pinned_blocks) == (whole.total_blocks, 0)
            assert (whole.num_running, whole.num_waiting) == (0, 0)
            # A second Release of each (a retried program-end activity, a late runtime) harms nothing: the
            # node no longer knows the programs and says so.
            for _ in range(2):
                ack = await c.push_hints([Release(program_id=h.id) for h in handles])
                assert [r.code for r in ack.results] == ["NOT_FOUND"] * 3, ack
            again = await c.get_cache_state()
            assert (again.free_blocks, again.pinned_blocks, again.num_running) == (again.total_blocks, 0, 0)
            node.core.check_invariants()

        out = await _stop(second, signal.SIGTERM)
        assert second.returncode == 0 and "hintflow worker: stopped" in out
        assert "Traceback" not in (tmp_path / "second.log").read_text()
    finally:
        _kill(first, second)


# ---- SIGTERM to `hintflow worker` -------------------------------------------------------------------
def _temporal_children(pid: int) -> dict[int, str]:
    return {k: v for k, v in _children(pid).items() if "temporal" in v}


async def test_sigterm_stops_the_worker_and_the_temporal_server_it_started(
    start_engine: Any, tmp_path: Path
) -> None:
    node = await start_engine("node-sigterm")
    log = tmp_path / "worker.log"
    p = _spawn_worker(["--engines", node.address, "--task-queue", "tq-sigterm"], log)
    try:
        await _ready(p, log)
        started = _temporal_children(p.pid)
        assert started, f"no Temporal dev server under the worker: {_children(p.pid)}"
        out = await _stop(p, signal.SIGTERM)
    finally:
        _kill(p)
    assert p.returncode == 0, (p.returncode, log.read_text()[-3000:])
    assert "hintflow worker: stopped" in out
    assert not [pid for pid in started if _alive(pid)], "the Temporal dev server outlived the worker"
    text = log.read_text()
    assert "Traceback" not in text and "PyGILState_Release" not in text


async def test_sigterm_while_the_worker_starts_stops_what_it_started(
    start_engine: Any, tmp_path: Path
) -> None:
    """SIGTERM's default action would end the process at once, with its dev server left running."""
    node = await start_engine("node-sigterm-early")
    log = tmp_path / "worker.log"
    p = _spawn_worker(["--engines", node.address, "--task-queue", "tq-sigterm-early"], log)
    started: dict[int, str] = {}
    try:

        async def server_starting() -> bool:
            started.update(_temporal_children(p.pid))
            assert p.poll() is None, log.read_text()[-3000:]
            return bool(started)

        await until(server_starting, 90, "the worker starting its Temporal dev server")
        out = await _stop(p, signal.SIGTERM)
    finally:
        _kill(p)
    assert p.returncode == 0, (p.returncode, log.read_text()[-3000:])
    assert "hintflow worker: stopped" in out and "task queue" not in out  # it never served
    assert not [pid for pid in started if _alive(pid)], "the Temporal dev server outlived the worker"
    assert "Traceback" not in log.read_text()


# ---- a dead engine node in the log ------------------------------------------------------------------
async def test_publisher_logs_a_dead_node_once_per_state_change(
    start_engine: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="workflows._publisher")
    port = free_port()
    address = f"127.0.0.1:{port}"
    pub = HintPublisher(address, registry=CollectorRegistry(), backoff_initial_s=0.01, backoff_max_s=0.05)

    def lines(level: int) -> list[str]:
        return [
            r.getMessage() for r in caplog.records if r.name == "workflows._publisher" and r.levelno == level
        ]

    try:
        pub.start()
        pub.publish([Priority(session_id="s", program_id="p", program_age_s=0.0)])

        async def many_failures() -> bool:
            return pub.num_failures >= 10

        await until(many_failures, 10, "ten failed pushes")
        assert len(lines(logging.WARNING)) == 1 and address in lines(logging.WARNING)[0]
        assert lines(logging.INFO) == []
        assert len(lines(logging.DEBUG)) >= 9  # every further attempt, below INFO
        node = await start_engine("node-log", port=port)
        assert await pub.flush(10)
        [back] = lines(logging.INFO)
        assert "back after" in back and address in back
        await node.stop(grace=0.1)  # up -> down again: a second warning
        pub.publish([Priority(session_id="s", program_id="p", program_age_s=0.0)])

        async def down_again() -> bool:
            return pub.health.down

        await until(down_again, 10, "the push to the stopped node failing")
        assert len(lines(logging.WARNING)) == 2
    finally:
        await pub.close()


async def test_a_dead_node_is_retried_with_backoff_and_logged_once_per_state_change(
    temporal_env: Any, start_engine: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    port = free_port()
    address = f"127.0.0.1:{port}"
    rt = HintRuntime([address], "hintflow")
    tq = f"tq-{uuid.uuid4()}"

    def runtime_lines(level: int) -> list[str]:
        return [
            r.getMessage() for r in caplog.records if r.name == "workflows._runtime" and r.levelno == level
        ]

    async with Worker(
        temporal_env.client, task_queue=tq, workflows=[CodingAgent], plugins=[HintflowPlugin(runtime=rt)]
    ):
        h = await temporal_env.client.start_workflow(
            CodingAgent.run,
            CodingAgentInput(turns=2, time_scale=0.01),
            id=f"wf-{uuid.uuid4()}",
            task_queue=tq,
        )

        async def third_attempt() -> bool:
            pending = (await h.describe()).raw_description.pending_activities
            return bool(pending) and pending[0].attempt >= 3

        await until(third_attempt, 20, "the model call's third attempt")
        health = rt.node_health[address]
        assert health.down and health.failures >= 3
        [down] = runtime_lines(logging.WARNING)
        assert address in down
        # The attempts' failures are benign to the SDK: no warning and traceback per attempt.
        assert not [r for r in caplog.records if "Completing activity as failed" in r.getMessage()]
        assert all(address not in m for m in runtime_lines(logging.INFO))
        node = await start_engine("node-late", port=port)
        report = await asyncio.wait_for(h.result(), 30)
        assert len(report.turns) == 2
        [back] = [m for m in runtime_lines(logging.INFO) if address in m]
        assert "back after" in back
        await node.stop(grace=0.1)

        async def down_again() -> bool:
            return health.down

        await until(down_again, 10, "the stopped node taken for down")
        assert len(runtime_lines(logging.WARNING)) == 2


# ---- heartbeats --------------------------------------------------------------------------------------
@activity.defn(name="faults.sync_tool")
def _sync_tool(seconds: float) -> int:
    """A plain function on a thread: it cannot heartbeat itself."""
    time.sleep(seconds)
    return activity.info().attempt


@activity.defn(name="faults.resumable_tool")
async def _resumable_tool(seconds: float) -> list[str]:
    """Heartbeats progress once, outlives a few interceptor heartbeats, fails; the retry reads the progress."""
    info = activity.info()
    if info.attempt == 1:
        activity.heartbeat("step-7")
        await asyncio.sleep(seconds)
        raise ApplicationError("transient", type="Transient")
    return [str(d) for d in info.heartbeat_details]


@workflow.defn(name="faults.HeartbeatProbe", sandboxed=False)
class _HeartbeatProbe:
    @workflow.run
    async def run(self, heartbeat_s: float) -> list[Any]:
        hb = timedelta(seconds=heartbeat_s)
        quick_retry = RetryPolicy(initial_interval=timedelta(milliseconds=100))
        # The sync tool outlives two heartbeat timeouts; the failing attempt outlives the SDK's 0.8-timeout
        # spacing of heartbeats, so one of the interceptor's reaches the server after the tool's own.
        attempt, details = await asyncio.gather(
            tool("sync", 2.25 * heartbeat_s, activity=_sync_tool, heartbeat_timeout=hb),
            tool(
                "resume",
                heartbeat_s,
                activity=_resumable_tool,
                heartbeat_timeout=hb,
                retry_policy=quick_retry,
            ),
        )
        return [attempt, details]


@workflow.defn(name="faults.BadHeartbeat", sandboxed=False)
class _BadHeartbeat:
    @workflow.run
    async def run(self, heartbeat_s: float) -> None:
        await llm("hello", heartbeat_timeout=timedelta(seconds=heartbeat_s))


async def test_the_plugin_heartbeats_for_activities_and_keeps_their_own_details(temporal_env: Any) -> None:
    tq = f"tq-{uuid.uuid4()}"
    shortest = MIN_HEARTBEAT_TIMEOUT.total_seconds()  # the least slack a heartbeat gets
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        async with Worker(
            temporal_env.client,
            task_queue=tq,
            workflows=[_HeartbeatProbe, _BadHeartbeat],
            activities=[_sync_tool, _resumable_tool],
            activity_executor=pool,
            plugins=[HintflowPlugin()],
        ):
            # Only the interceptor's heartbeats keep the sync tool's first attempt alive; the progress the
            # other tool heartbeated survives them into its retry.
            attempt, details = await asyncio.wait_for(
                temporal_env.client.execute_workflow(
                    _HeartbeatProbe.run, shortest, id=f"wf-{uuid.uuid4()}", task_queue=tq
                ),
                30,
            )
            assert attempt == 1
            assert details == ["step-7"]
            with pytest.raises(WorkflowFailureError) as err:
                await temporal_env.client.execute_workflow(
                    _BadHeartbeat.run, shortest / 4, id=f"wf-{uuid.uuid4()}", task_queue=tq
                )
    cause = err.value.cause
    assert isinstance(cause, ApplicationError) and cause.type == "InvalidInput" and cause.non_retryable
    assert f"heartbeat_timeout must be None or a timedelta of at least {shortest:g} s" in cause.message
