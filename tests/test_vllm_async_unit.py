"""``_async_mode`` without vLLM: the steps the scheduler has out (what the deadlock rule and the reload cost
read under async scheduling), and the start-up line that says whether the class matches the engine."""

from __future__ import annotations

import logging

import pytest

from engine_adapter.vllm_backend._async_mode import StepsInFlight, log_async_mode


def test_one_step_at_a_time_measures_from_scheduling() -> None:
    steps, out = StepsInFlight(), object()
    assert not steps.computing
    steps.scheduled(out, 100, now_s=1.0)
    assert steps.computing and len(steps) == 1
    assert steps.returned(out, now_s=1.5) == (100, 0.5, 0)
    assert not steps.computing and len(steps) == 0


def test_two_steps_out_as_under_async_scheduling() -> None:
    """Step 2 is scheduled while step 1 runs and computes only once step 1's output is back."""
    steps = StepsInFlight()
    s1, s2, s3 = object(), object(), object()
    steps.scheduled(s1, 100, now_s=0.0)
    steps.scheduled(s2, 0, now_s=0.1)  # nothing schedulable: step 1 holds the requests' last tokens
    assert steps.computing  # step 1 is still out: a step that schedules nothing now is not a deadlock
    assert steps.returned(s1, now_s=0.5) == (100, 0.5, 0)
    assert not steps.computing  # only the empty step is out
    steps.scheduled(s3, 200, now_s=0.6)
    assert steps.returned(s2, now_s=0.7) == (0, pytest.approx(0.2), 0)  # from step 1's return, not from its scheduling
    assert steps.returned(s3, now_s=1.0) == (200, pytest.approx(0.3), 0)  # from step 2's return (0.7), after its scheduling


def test_an_unknown_output_changes_nothing_and_a_skipped_one_is_dropped() -> None:
    steps = StepsInFlight()
    s1, s2 = object(), object()
    steps.scheduled(s1, 10, now_s=0.0)
    steps.scheduled(s2, 20, now_s=0.0)
    assert steps.returned(object(), now_s=0.1) is None and len(steps) == 2
    assert steps.returned(s2, now_s=0.2) == (20, pytest.approx(0.1), 0)  # s1 never came back: dropped with it
    assert len(steps) == 0


def test_steps_that_never_come_back_are_bounded() -> None:
    steps = StepsInFlight()
    for _ in range(StepsInFlight.MAX_STEPS + 10):
        steps.scheduled(object(), 1, now_s=0.0)
    assert len(steps) == StepsInFlight.MAX_STEPS


@pytest.mark.parametrize(
    ("class_async", "engine_async", "level", "says"),
    [
        (False, True, logging.WARNING, "overlap async scheduling buys is lost"),
        (True, False, logging.WARNING, "HintflowScheduler is the match"),
        (True, True, logging.INFO, "async scheduling on"),
        (False, False, logging.INFO, "async scheduling off"),
        (False, None, logging.INFO, "async scheduling off"),  # not settled: vLLM treats it as off
    ],
)
def test_the_start_up_line_says_whether_the_class_matches(
    caplog: pytest.LogCaptureFixture, class_async: bool, engine_async: bool | None, level: int, says: str
) -> None:
    with caplog.at_level(logging.INFO, logger="vllm.hintflow"):
        log_async_mode("Cls", class_async, engine_async)
    assert [(r.levelno, says in r.getMessage()) for r in caplog.records] == [(level, True)]


def test_step_times_split_hintflow_vllm_and_model_and_start_again_after_each_line() -> None:
    from engine_adapter.vllm_backend._step_times import StepTimes

    t = StepTimes()
    assert t.line() == "step_ms=0.00/0.00/0.0"  # no step yet: zeros, not a division by zero
    t.scheduled(total_s=0.004, vllm_s=0.001)  # hintflow's rules took 3 ms around vLLM's 1 ms
    t.updated(total_s=0.0015, vllm_s=0.0005)  # and 1 ms more after the step
    t.scheduled(total_s=0.002, vllm_s=0.002)
    t.computed(0.030)
    t.computed(0.050)
    assert t.line() == "step_ms=2.00/1.75/40.0"
    assert t.line() == "step_ms=0.00/0.00/0.0"
    t.scheduled(total_s=0.001, vllm_s=0.002)  # clock jitter never makes hintflow's share negative
    assert t.line().startswith("step_ms=0.00/")
