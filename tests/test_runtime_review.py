"""Regression tests for the Temporal runtime defects found in review (one block per defect):

A  a plain exception in workflow code is a task failure Temporal retries: the program has not ended;
B  a terminated program's returned tool stops counting as a pause after a grace period, and a program
   with no event for ``reap_after_s`` is reaped (Release, its state dropped, counted);
C  bad input (an infinite tool duration, a prefix longer than the prompt, a bad example field) fails the
   workflow at once with a non-retryable error instead of retrying;
D  ``hintflow run`` prints the innermost cause of a failed program;
E  ``hintflow run --json`` into a missing directory is a usage error before anything starts, and a
   failed write exits cleanly;
F  hints a user policy returns are validated again before they leave; bad ones are dropped and counted;
G  a failed model-call attempt is not a turn (no TurnEnded, not counted in num_turns);
H  late end events of an ended program re-create nothing; pins the publisher dropped leave no deadline.

The Temporal tests use the session's dev server (``temporal_env``) and a fresh task queue each.
"""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from temporalio.client import WorkflowExecutionStatus, WorkflowFailureError
from temporalio.exceptions import ActivityError, ApplicationError, RetryState
from temporalio.testing import ActivityEnvironment
from temporalio.worker import Worker

from hints import CacheState, EngineClient, HintAck, HintResult, Pin, Priority, Release
from orchestrator import PauseModel, ProgramEnded, ToolEnded, TurnEnded, TurnStarted
from tests.polling import free_port
from tests.review_workflows import (
    InfiniteTool,
    PrefixLongerThanPrompt,
    RaisesFailure,
    RaisesPlain,
    WaitsForever,
)
from workflows import HintflowActivities, HintflowPlugin, HintRuntime, InvalidPrompt, LLMInput
from workflows.examples import (
    CodingAgent,
    CodingAgentInput,
    HumanInLoopInput,
    Pipeline,
    PipelineInput,
)


class _Recorder:
    """Stands in for a node's HintPublisher: records what the runtime would send."""

    def __init__(self) -> None:
        self.batches: list[list[Any]] = []

    def publish(self, batch: Any) -> None:
        self.batches.append(list(batch))

    @property
    def hints(self) -> list[Any]:
        return [h for b in self.batches for h in b]


def _runtime(policy: Any = "hintflow", **kw: Any) -> tuple[HintRuntime, _Recorder]:
    """A runtime with a recording publisher and no background tasks (ticks and sweeps are called here)."""
    rt = HintRuntime(["127.0.0.1:1"], policy, **kw)
    rec = _Recorder()
    rt.publishers = {"127.0.0.1:1": rec}  # type: ignore[dict-item]
    rt._started = True
    return rt, rec


def _metric(rt: HintRuntime, name: str, **labels: str) -> float:
    return rt.registry.get_sample_value(name, labels) or 0.0


async def _start(env: Any, run: Any, arg: Any, tq: str) -> Any:
    return await env.client.start_workflow(run, arg, id=f"wf-{uuid.uuid4()}", task_queue=tq)


def _innermost(exc: BaseException) -> BaseException:
    while getattr(exc, "cause", None) is not None:
        exc = exc.cause  # type: ignore[attr-defined]
    return exc


# ---- A: a workflow task failure is not the program's end -------------------------------------------------
async def test_plain_exception_in_workflow_code_does_not_end_the_program(temporal_env: Any) -> None:
    rt = HintRuntime([f"127.0.0.1:{free_port()}"], "hintflow")
    tq = f"tq-{uuid.uuid4()}"
    workflows = [RaisesPlain, RaisesFailure, WaitsForever]
    async with Worker(temporal_env.client, task_queue=tq, workflows=workflows, plugins=[HintflowPlugin(runtime=rt)]):
        plain = await _start(temporal_env, RaisesPlain.run, 0, tq)
        failing = await _start(temporal_env, RaisesFailure.run, 0, tq)
        waiting = await _start(temporal_env, WaitsForever.run, 0, tq)
        with pytest.raises(WorkflowFailureError):
            await asyncio.wait_for(failing.result(), 20)
        # the plain exception's task is retried meanwhile (at once, then with backoff)
        for _ in range(100):
            desc = await plain.describe()
            if desc.raw_description.pending_workflow_task.attempt >= 2:
                break
            await asyncio.sleep(0.05)
        assert desc.raw_description.pending_workflow_task.attempt >= 2
        await waiting.cancel()
        for _ in range(100):
            if rt.programs.get(waiting.id, None) is not None and rt.programs[waiting.id].status != "running":
                break
            await asyncio.sleep(0.05)
        assert (await plain.describe()).status == WorkflowExecutionStatus.RUNNING
        await plain.terminate("test over")
    ended = [e.program_id for e in rt.events if isinstance(e, ProgramEnded)]
    assert plain.id not in ended, "a retried workflow task ended the program (Release while it runs)"
    assert plain.id not in rt.programs or rt.programs[plain.id].status == "running"
    # a real workflow failure and a cancellation still end the program, once each
    assert ended.count(failing.id) == 1 and rt.programs[failing.id].status == "failed"
    assert ended.count(waiting.id) == 1 and rt.programs[waiting.id].status == "cancelled"


# ---- B: grace period and reaping ------------------------------------------------------------------------
def test_a_returned_tool_ends_its_pause_after_the_grace_period() -> None:
    rt, _ = _runtime(tool_grace_s=0.5)
    rt.turn_started("p", "s", 400)
    rt.turn_ended("p", "s", 400)
    rt.tool_started("p", "s", "bash")
    rt.tool_ended("p", "s", "bash", 0.1)
    t = time.monotonic()
    rt.sweep(t + 0.2)  # within the grace period: the next turn may still come
    assert not [e for e in rt.events if isinstance(e, ToolEnded)]
    assert rt.policy._parked["s"].tool == "bash"  # type: ignore[attr-defined]
    rt.sweep(t + 0.6)
    [ended] = [e for e in rt.events if isinstance(e, ToolEnded)]
    assert ended.tool == "bash" and ended.duration_s < 0.5  # the tool's time, not the grace wait
    assert rt.policy._parked["s"].tool is None  # type: ignore[attr-defined]  # no renewals from now on
    rt.turn_started("p", "s", 464)  # a late next turn: the pause is not reported twice
    assert len([e for e in rt.events if isinstance(e, ToolEnded)]) == 1


@pytest.mark.parametrize("policy", ["hintflow", "vllm-default"])
def test_a_program_without_events_is_reaped(policy: str) -> None:
    rt, rec = _runtime(policy, reap_after_s=1.0)
    rt.program_submitted("p", time.time())
    rt.turn_started("p", "p/a", 100)
    rt.turn_ended("p", "p/a", 110)
    rt.tool_started("p", "p/a", "bash")
    rt.tool_ended("p", "p/a", "bash", 0.1)
    rt.turn_started("q", "q", 100)  # q: a model call still running on this worker
    t = time.monotonic()
    rt.sweep(t + 0.5)
    assert rt.programs["p"].status == "running" and "p/a" in rt.sessions
    rt.sweep(t + 2.0)
    assert rt.programs["p"].status == "reaped"
    assert "p/a" not in rt.sessions
    # Nothing released: this worker sees only its own activities, the program may run on another one.
    assert not [h for h in rec.hints if isinstance(h, Release)]
    assert _metric(rt, "hintflow_programs_reaped_total") == 1.0
    [ended] = [e for e in rt.events if isinstance(e, ProgramEnded)]
    assert ended.program_id == "p" and ended.num_turns == 0  # not a sample of program length
    assert "p" not in rt.policy._program_start_s  # type: ignore[attr-defined]
    assert not [s for s, x in rt.policy._parked.items() if x.program_id == "p"]  # type: ignore[attr-defined]
    assert rt.programs["q"].status == "running", "a program with an activity running is not reaped"
    rt.sweep(t + 10.0)
    assert _metric(rt, "hintflow_programs_reaped_total") == 1.0  # reaped once
    # it comes back after all: tracked afresh, its turns so far kept
    rt.turn_started("p", "p/a", 200)
    assert rt.programs["p"].status == "running" and "p/a" in rt.sessions
    assert rt.programs["p"].num_turns == 1


def test_a_declared_pause_is_reaped_only_after_reap_paused_after_s() -> None:
    """A person may take hours: an open ``pause()`` (no activity runs meanwhile) is not a sign of a gone program."""
    rt, _ = _runtime("hintflow", reap_after_s=1.0, reap_paused_after_s=5.0)
    rt.turn_started("p", "p", 100)
    rt.turn_ended("p", "p", 110)
    rt.tool_started("p", "p", "human", activity=False)
    t = time.monotonic()
    rt.sweep(t + 3.0)
    assert rt.programs["p"].status == "running"
    rt.sweep(t + 6.0)
    assert rt.programs["p"].status == "reaped"


def test_parallel_tools_of_one_session_are_one_pause() -> None:
    """Tool B starts while A runs: the pause lasts until both returned, however long B runs after A."""
    rt, _ = _runtime("hintflow", tool_grace_s=0.5)
    rt.turn_started("p", "p", 100)
    rt.turn_ended("p", "p", 110)
    rt.tool_started("p", "p", "A")
    rt.tool_started("p", "p", "B")
    rt.tool_ended("p", "p", "A", 0.1)
    rt.sweep(time.monotonic() + 10.0)  # long past A's grace: B still runs, so the pause is open
    assert rt.core.pauses["p"].tool == "A" and not [e for e in rt.events if isinstance(e, ToolEnded)]
    rt.tool_ended("p", "p", "B", 30.0)
    rt.turn_started("p", "p", 120)
    ended = [e for e in rt.events if isinstance(e, ToolEnded)]
    assert [e.tool for e in ended] == ["A"] and rt.programs["p"].num_tools == 2  # one pause, two tools


def test_a_failed_attempt_then_another_call_is_a_new_turn() -> None:
    """Only a retry of the call whose attempt failed continues its turn; a different call starts a new one."""
    rt, _ = _runtime("hintflow")
    rt.turn_started("p", "p", 100, call="run/1")
    rt.turn_failed("p", "p", call="run/1")
    rt.turn_started("p", "p", 100, call="run/1")  # the retry: the same turn
    rt.turn_ended("p", "p", 110)
    rt.turn_started("p", "p", 120, call="run/2")
    rt.turn_failed("p", "p", call="run/2")
    rt.turn_started("p", "p", 130, call="run/3")  # the workflow gave up on run/2 and made another call
    rt.turn_ended("p", "p", 140)
    kinds = [type(e).__name__ for e in rt.events if type(e).__name__ in ("TurnStarted", "TurnEnded")]
    assert kinds == ["TurnStarted", "TurnEnded", "TurnStarted", "TurnStarted", "TurnEnded"]
    assert rt.programs["p"].num_turns == 2


def test_reap_horizon_and_grace_must_be_positive() -> None:
    with pytest.raises(ValueError, match="reap_after_s"):
        HintRuntime(["127.0.0.1:1"], reap_after_s=0)
    with pytest.raises(ValueError, match="tool_grace_s"):
        HintRuntime(["127.0.0.1:1"], tool_grace_s=float("nan"))


async def test_a_terminated_program_is_forgotten_and_released(temporal_env: Any, start_engine: Any) -> None:
    node = await start_engine("node-terminate")
    rt = HintRuntime(
        [node.address], "hintflow", pause_model=PauseModel(default_mean_s=2.0, min_samples=20),
        tool_grace_s=0.3, reap_after_s=1.0,
    )  # fmt: skip
    tq = f"tq-{uuid.uuid4()}"
    async with Worker(temporal_env.client, task_queue=tq, workflows=[CodingAgent], plugins=[HintflowPlugin(runtime=rt)]):
        inp = CodingAgentInput(turns=3, tool_mean_s=1.5, tool_sd_s=0.01, tool_max_s=1.5)
        h = await temporal_env.client.start_workflow(CodingAgent.run, inp, id=f"wf-{uuid.uuid4()}", task_queue=tq)
        for _ in range(200):  # wait until its first tool runs
            if any(isinstance(e, ToolEnded) or type(e).__name__ == "ToolStarted" for e in rt.events):
                break
            await asyncio.sleep(0.05)
        await h.terminate("operator")
        for _ in range(100):  # the tool returns (~1.5 s), the grace (0.3 s) and the horizon (1 s) pass
            if rt.programs[h.id].status == "reaped":
                break
            await asyncio.sleep(0.1)
        assert rt.programs[h.id].status == "reaped"
        assert not [s for s in rt.sessions.values() if s.program_id == h.id]
        assert not [p for p in rt.policy._parked.values() if p.program_id == h.id]  # type: ignore[attr-defined]
        for _ in range(50):  # Temporal says the workflow is closed: only then is it released
            if _metric(rt, "hintflow_hints_emitted_total", kind="release") == 1.0:
                break
            await asyncio.sleep(0.1)
        assert _metric(rt, "hintflow_hints_emitted_total", kind="release") == 1.0
        assert _metric(rt, "hintflow_programs_reaped_total") == 1.0
        pins = _metric(rt, "hintflow_hints_emitted_total", kind="pin")
        orders = _metric(rt, "hintflow_hints_emitted_total", kind="eviction_order")
        await asyncio.sleep(1.0)
        assert _metric(rt, "hintflow_hints_emitted_total", kind="pin") == pins  # nothing renewed any more
        assert _metric(rt, "hintflow_hints_emitted_total", kind="eviction_order") == orders
    async with EngineClient(node.address) as c:
        state = await c.get_cache_state(include_sessions=True)
    assert not [s for s in state.sessions if s.program_id == h.id], "Release freed its contexts on the node"


async def test_a_reaped_program_still_running_elsewhere_is_not_released() -> None:
    """A reap sees only this worker: while Temporal says the workflow runs (or cannot say), nothing is freed."""

    class Desc:
        def __init__(self, status: Any) -> None:
            self.status = status

    class Client:
        def __init__(self, status: Any) -> None:
            self.status = status

        def get_workflow_handle(self, workflow_id: str) -> Any:
            client = self

            class Handle:
                async def describe(self) -> Desc:
                    if client.status is None:
                        raise RuntimeError("server unavailable")
                    return Desc(client.status)

            return Handle()

    from temporalio.client import WorkflowExecutionStatus

    for status, released in [(WorkflowExecutionStatus.RUNNING, 0), (None, 0),
                             (WorkflowExecutionStatus.TERMINATED, 1)]:
        rt, rec = _runtime("hintflow", reap_after_s=1.0)
        rt.temporal_client = Client(status)
        rt.turn_started("p", "p", 100)
        rt.turn_ended("p", "p", 110)
        rt.sweep(time.monotonic() + 2.0)
        await asyncio.sleep(0.05)  # the describe task
        assert rt.programs["p"].status == "reaped"
        assert len([h for h in rec.hints if isinstance(h, Release)]) == released, status


# ---- C: bad input fails at once, not retried ------------------------------------------------------------
@pytest.mark.parametrize(
    ("workflow", "arg", "expect"),
    [
        (InfiniteTool, 0, "duration_s must be a finite number"),
        (PrefixLongerThanPrompt, 0, "prefix_tokens must be an integer in [0, 5]"),
        (CodingAgent, CodingAgentInput(tool_mean_s=0.0), "tool_mean_s must be a finite number > 0"),
        (Pipeline, PipelineInput(output_tokens=0), "output_tokens must be an integer >= 1"),
    ],
)
async def test_bad_input_fails_the_workflow_at_once(temporal_env: Any, workflow: Any, arg: Any, expect: str) -> None:
    rt = HintRuntime([f"127.0.0.1:{free_port()}"], "hintflow")
    tq = f"tq-{uuid.uuid4()}"
    async with Worker(temporal_env.client, task_queue=tq, workflows=[workflow], plugins=[HintflowPlugin(runtime=rt)]):
        h = await temporal_env.client.start_workflow(workflow.run, arg, id=f"wf-{uuid.uuid4()}", task_queue=tq)
        with pytest.raises(WorkflowFailureError) as err:
            await asyncio.wait_for(h.result(), 20)
    cause = _innermost(err.value)
    assert isinstance(cause, ApplicationError) and cause.non_retryable and cause.type == "InvalidInput"
    assert expect in str(cause), str(cause)


async def test_a_bad_route_request_is_a_non_retryable_invalid_prompt() -> None:
    rt = HintRuntime(["127.0.0.1:1"], "hintflow")
    inp = LLMInput("s", [1, 2, 3, 4, 5], 2, "k", 50)  # prefix longer than the prompt, past llm()'s check
    with pytest.raises(InvalidPrompt, match="prefix_tokens"):
        await rt.generate("p", inp)
    with pytest.raises(ApplicationError) as err:
        await ActivityEnvironment().run(HintflowActivities(rt).llm, inp)
    assert err.value.non_retryable and err.value.type == "InvalidPrompt"


@pytest.mark.parametrize(
    ("inp", "expect"),
    [
        (CodingAgentInput(), None),
        (CodingAgentInput(turns="abc"), "turns must be an integer >= 1"),  # type: ignore[arg-type]
        (CodingAgentInput(turns=2.5), "turns must be an integer >= 1"),  # type: ignore[arg-type]
        (CodingAgentInput(tool_sd_s=float("nan")), "tool_sd_s must be a finite number >= 0"),
        (CodingAgentInput(task_tokens=-1), "task_tokens must be an integer >= 0"),
        (CodingAgentInput(system_prompt_tokens=0, task_tokens=0), "system_prompt_tokens + task_tokens"),
        (PipelineInput(), None),
        (PipelineInput(join="xor"), "join must be 'and' or 'or'"),
        (PipelineInput(time_scale=-1.0), "time_scale must be a finite number >= 0"),
        (HumanInLoopInput(), None),
        (HumanInLoopInput(human_median_s=0.0), "human_median_s must be a finite number > 0"),
        (HumanInLoopInput(prompt_tokens=0), "prompt_tokens must be an integer >= 1"),
    ],
)
def test_example_inputs_are_checked_field_by_field(inp: Any, expect: str | None) -> None:
    problems = inp.problems()
    if expect is None:
        assert problems == []
    else:
        assert any(expect in p for p in problems), problems


# ---- D, E: `hintflow run` failure text, --json, --set -------------------------------------------------
_REPORT: dict[str, Any] = {
    "example": "coding-agent", "num_programs": 0, "policy": "hintflow", "engines": [], "programs": [],
    "num_turns": 0, "jct_mean_s": 0.0, "jct_p90_s": 0.0, "ttft_p50_s": 0.0, "ttft_p90_s": 0.0,
    "across_turn_hit_rate": 0.0, "recomputed_tokens": 0, "pins_placed": 0, "pins_held": 0,
    "pins_expired": 0, "wall_s": 0.0,
}  # fmt: skip


class _FakeRun:
    """Stands in for hintflow._run.run_programs: records each config, returns a report or does ``behaviour``."""

    def __init__(self) -> None:
        self.configs: list[Any] = []
        self.behaviour: Callable[[Any], dict[str, Any]] | None = None

    async def __call__(self, cfg: Any, *args: Any, **kw: Any) -> dict[str, Any]:
        self.configs.append(cfg)
        return self.behaviour(cfg) if self.behaviour is not None else dict(_REPORT)


@pytest.fixture
def cli(monkeypatch: pytest.MonkeyPatch) -> tuple[CliRunner, _FakeRun]:
    """The `hintflow` group in-process, with `run_programs` faked and the hard exit made a SystemExit."""
    import hintflow._run
    import hintflow.cli

    def exit_(status: int) -> None:
        sys.exit(status)

    fake = _FakeRun()
    monkeypatch.setattr(hintflow._run, "run_programs", fake)
    monkeypatch.setattr(hintflow.cli, "_exit_after_temporal", exit_)
    return CliRunner(), fake


def test_run_prints_the_innermost_cause_of_a_failed_program(cli: tuple[CliRunner, _FakeRun]) -> None:
    from hintflow.cli import hintflow

    runner, fake = cli

    def fail(cfg: Any) -> dict[str, Any]:
        app = ApplicationError("node 127.0.0.1:5 refused the prompt: token 300 >= vocab 256", type="InvalidPrompt")
        act = ActivityError(
            "Activity task failed", scheduled_event_id=5, started_event_id=6, identity="w",
            activity_type="hintflow.llm", activity_id="1", retry_state=RetryState.NON_RETRYABLE_FAILURE,
        )  # fmt: skip
        act.__cause__ = app
        exc = WorkflowFailureError(cause=act)
        raise exc

    fake.behaviour = fail
    r = runner.invoke(hintflow, ["run", "coding-agent", "--programs", "1"])
    assert r.exit_code == 1, r.output
    assert "hintflow run: InvalidPrompt: node 127.0.0.1:5 refused the prompt: token 300 >= vocab 256\n" in r.output
    assert "Traceback" not in r.output


@pytest.mark.parametrize(
    ("args", "expect"),
    [
        (["--set", "tool_mean_s=0"], "tool_mean_s must be a finite number > 0"),
        (["--set", "turns=abc"], "turns='abc': expected an integer"),
        (["--set", "turns=2.5"], "turns='2.5': expected an integer"),
        (["--set", "tool_sd_s=inf"], "tool_sd_s='inf': expected a finite number"),
        (["--set", "turns=0"], "turns must be an integer >= 1"),
        (["--json", "/nonexistent-dir/out.json"], "'/nonexistent-dir' does not exist"),
    ],
)
def test_run_rejects_bad_values_before_starting(cli: tuple[CliRunner, _FakeRun], args: list[str], expect: str) -> None:
    from hintflow.cli import hintflow

    runner, fake = cli
    r = runner.invoke(hintflow, ["run", "coding-agent", *args])
    assert r.exit_code == 2, r.output
    assert expect in r.output, r.output
    assert fake.configs == [], "nothing may start before the usage error"


def test_run_coerces_set_values_to_the_field_types(cli: tuple[CliRunner, _FakeRun]) -> None:
    from hintflow.cli import hintflow

    runner, fake = cli
    r = runner.invoke(hintflow, ["run", "pipeline", "--set", "join=or", "--set", "tool_mean_s=2", "--set", "num_workers=4"])
    assert r.exit_code == 0, r.output
    overrides = fake.configs[0].overrides
    assert overrides == {"join": "or", "tool_mean_s": 2.0, "num_workers": 4}
    assert isinstance(overrides["tool_mean_s"], float)


def test_run_exits_cleanly_when_the_report_cannot_be_written(
    cli: tuple[CliRunner, _FakeRun], tmp_path: Path
) -> None:
    from hintflow.cli import hintflow

    runner, fake = cli
    out_dir = tmp_path / "gone"
    out_dir.mkdir()

    def vanish(cfg: Any) -> dict[str, Any]:
        out_dir.rmdir()  # the directory goes away while the programs run
        return dict(_REPORT)

    fake.behaviour = vanish
    r = runner.invoke(hintflow, ["run", "coding-agent", "--json", str(out_dir / "out.json")])
    assert r.exit_code == 1, r.output
    assert "could not write --json" in r.output
    assert isinstance(r.exception, SystemExit)  # through the exit helper, no traceback


def test_run_reports_a_node_s_refusal_by_its_message(tmp_path: Path) -> None:
    """End to end (own Temporal server and torch node): tokens out of the node's vocabulary fail the program
    with the node's reason, and that is what `hintflow run` prints."""
    args = ["run", "coding-agent", "--programs", "1", "--set", "turns=1", "--set", "vocab_size=100000"]
    r = subprocess.run([sys.executable, "-m", "hintflow", *args], capture_output=True, text=True, timeout=180)
    assert r.returncode == 1, r.stderr[-3000:]
    last = [line for line in r.stderr.splitlines() if line.startswith("hintflow run:")]
    assert last, r.stderr[-3000:]
    assert last[-1].startswith("hintflow run: InvalidPrompt: node 127.0.0.1:"), last[-1]
    assert "refused the prompt" in last[-1] and "outside the vocabulary" in last[-1], last[-1]


# ---- F: a user policy's hints are validated again -------------------------------------------------------
class _Sloppy:
    name = "sloppy"
    num_invalid_hints = 0

    def __init__(self, hints: list[Any]) -> None:
        self.hints = hints

    def on_event(self, event: Any) -> list[Any]:
        return list(self.hints) if isinstance(event, TurnStarted) else []


def test_hints_of_a_user_policy_are_validated_before_they_leave(caplog: pytest.LogCaptureFixture) -> None:
    good = Pin(session_id="s", ttl_s=1.0, reason="ok")
    bad = [
        Pin.model_construct(session_id="", ttl_s=5.0, reason=""),
        Priority.model_construct(session_id="s", program_id="p", program_age_s=-3.0, priority_class=0),
        {"kind": "pin", "session_id": "s", "ttl_s": 1.0},
    ]
    policy = _Sloppy([*bad, good])
    rt, rec = _runtime(policy)
    with caplog.at_level(logging.DEBUG, logger="orchestrator._control"):
        rt.turn_started("p", "s", 100)  # never raises into the (user's) activity
        rt.turn_ended("p", "s", 110)
        rt.turn_started("p", "s", 120)
    assert rec.hints == [good, good]
    assert policy.num_invalid_hints == 6
    assert _metric(rt, "hintflow_invalid_hints_total", kind="Pin") == 2.0
    assert _metric(rt, "hintflow_invalid_hints_total", kind="Priority") == 2.0
    assert _metric(rt, "hintflow_invalid_hints_total", kind="dict") == 2.0
    assert _metric(rt, "hintflow_hints_emitted_total", kind="pin") == 2.0  # only the valid ones
    assert ("", "") not in rt._pin_deadline_at_send
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "invalid" in r.getMessage()]
    assert len(warnings) == 3, [r.getMessage() for r in warnings]  # once per kind


def test_a_policy_returning_garbage_never_raises() -> None:
    class Garbage:
        name = "garbage"
        num_invalid_hints = 0

        def on_event(self, event: Any) -> Any:
            return 42 if isinstance(event, TurnStarted) else [None]

    rt, rec = _runtime(Garbage())
    rt.turn_started("p", "s", 10)
    rt.turn_ended("p", "s", 12)
    rt.tool_started("p", "s", "bash")
    rt.publish(rt.core.tick(time.monotonic()))
    assert rec.hints == [] and rt.core.num_policy_errors >= 1


def test_an_unpin_acked_by_a_new_life_leaves_a_pin_lost_with_the_old_one_expired() -> None:
    """The policy's unpin of a session whose pin went with a restarted node, acknowledged by the node's next
    life, must not make the resume count no pin at all: the pin was lost, not released."""
    addr = "127.0.0.1:1"
    rt, _ = _runtime()

    def life(epoch: int) -> None:
        state = CacheState(
            node_id="n", model_name="m", block_size=16, total_blocks=100, free_blocks=100, pinned_blocks=0,
            host_total_blocks=0, host_free_blocks=0, num_waiting=0, num_running=0, prefill_backlog_tokens=0,
            sessions=[], version=1, node_epoch=epoch,
        )  # fmt: skip
        rt.router.update(addr, state, now_s=time.monotonic())

    def ack(hint: Pin, epoch: int, pinned_blocks: int) -> None:
        rt._on_ack([hint], HintAck(batch_id=1, results=[HintResult(index=0, pinned_blocks=pinned_blocks)],
                                   node_epoch=epoch), node=addr)  # fmt: skip

    for sid, restart in (("lost", True), ("released", False)):
        rt.turn_started("p", sid, 100)
        rt.turn_ended("p", sid, 120)
        life(1)
        ack(Pin(session_id=sid, ttl_s=600.0), 1, 8)
        if restart:
            life(2)
        ack(Pin(session_id=sid, ttl_s=0.0), 2 if restart else 1, 0)
        rt.turn_started("p", sid, 130)
    assert rt.pin_outcomes["lost"] == ["none", "expired"]
    assert rt.pin_outcomes["released"] == ["none", "none"]  # an unpin of a live pin ends it: no pin held


# ---- G: a failed attempt is not a turn ------------------------------------------------------------------
def test_failed_attempts_are_not_turns() -> None:
    rt, _ = _runtime()
    for _ in range(3):
        rt.turn_started("p", "s", 100)
        rt.turn_failed("p", "s")
    rt.turn_started("p", "s", 100)
    rt.turn_ended("p", "s", 120)
    assert [type(e).__name__ for e in rt.events] == ["TurnStarted", "TurnEnded"]
    assert rt.programs["p"].num_turns == 1
    assert rt.pin_outcomes["s"] == ["none"]
    assert rt._running == {}  # every attempt's bookkeeping undone
    rt.program_ended("p")
    [ended] = [e for e in rt.events if isinstance(e, ProgramEnded)]
    assert ended.num_turns == 1


async def test_retried_model_calls_count_once_end_to_end(temporal_env: Any, start_engine: Any) -> None:
    port = free_port()
    rt = HintRuntime([f"127.0.0.1:{port}"], "hintflow", pause_model=PauseModel(default_mean_s=0.15, min_samples=20))
    tq = f"tq-{uuid.uuid4()}"
    async with Worker(temporal_env.client, task_queue=tq, workflows=[CodingAgent], plugins=[HintflowPlugin(runtime=rt)]):
        inp = CodingAgentInput(turns=2, time_scale=0.01)
        h = await temporal_env.client.start_workflow(CodingAgent.run, inp, id=f"wf-{uuid.uuid4()}", task_queue=tq)
        for _ in range(100):  # no node yet: the first model call fails and is retried
            pending = (await h.describe()).raw_description.pending_activities
            if pending and pending[0].attempt >= 3:
                break
            await asyncio.sleep(0.1)
        assert pending and pending[0].attempt >= 3
        await start_engine("node-late", port=port)
        report = await asyncio.wait_for(h.result(), 30)
    assert len(report.turns) == 2
    assert rt.programs[h.id].num_turns == 2
    mine = [e for e in rt.events if getattr(e, "program_id", None) == h.id]
    assert len([e for e in mine if isinstance(e, TurnStarted)]) == 2
    assert len([e for e in mine if isinstance(e, TurnEnded)]) == 2
    [ended] = [e for e in mine if isinstance(e, ProgramEnded)]
    assert ended.num_turns == 2


# ---- H: late events of an ended program; dropped pins ---------------------------------------------------
def test_late_end_events_of_an_ended_program_re_create_nothing() -> None:
    rt, _ = _runtime()
    rt.turn_started("p", "p/w1", 100)
    rt.turn_ended("p", "p/w1", 110)
    rt.tool_started("p", "p/w1", "bash")  # an OR join's branch, cancelled when the program ends
    rt.turn_started("p", "p/w2", 100)  # another branch's model call in flight
    rt.turn_started("p", "p/r", 100)
    rt.turn_ended("p", "p/r", 120)
    rt.program_ended("p")
    n = len(rt.events)
    rt.tool_ended("p", "p/w1", "bash", 1.0)
    rt.turn_ended("p", "p/w2", 130)
    assert rt.sessions == {}
    assert len(rt.events) == n
    assert rt.programs["p"].status == "completed"
    assert rt._running == {} and rt.core.pauses == {}
    # a new run under the same workflow id is a new program
    rt.turn_started("p", "p/w1", 50)
    assert rt.programs["p"].status == "running" and rt.programs["p"].num_turns == 0


def test_program_end_drops_its_pin_deadlines() -> None:
    rt, _ = _runtime()
    rt.turn_started("p", "p/a", 100)
    rt.publish([Pin(session_id="p/a", ttl_s=30.0, reason="r")])
    assert ("p/a", "r") in rt._pin_deadline_at_send
    rt.program_ended("p")
    assert rt._pin_deadline_at_send == {}


async def test_pins_the_publisher_drops_leave_no_deadline_behind() -> None:
    rt = HintRuntime([f"127.0.0.1:{free_port()}"], "hintflow")  # nobody listens: pushes fail, pins lapse
    await rt.start()
    try:
        rt.publish([Pin(session_id="s", ttl_s=0.05, reason="r")])
        assert ("s", "r") in rt._pin_deadline_at_send
        pub = next(iter(rt.publishers.values()))
        for _ in range(100):
            if pub.num_dropped:
                break
            await asyncio.sleep(0.05)
        assert pub.num_dropped == 1
        assert rt._pin_deadline_at_send == {}
    finally:
        await rt.stop(flush_timeout_s=0.1)

