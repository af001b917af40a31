"""The real-vLLM harness's hint pusher (``replay._vllm_agents.HintPusher``) outlives a policy that raises.

No node is needed: the pusher's target is a free loopback port nobody serves, so its batches fail and are
counted as RPC errors; what is checked is the thread and the policy's error count.
"""

from __future__ import annotations

import time
from typing import Any

from orchestrator import ToolStarted, TurnStarted
from replay._vllm_agents import HintPusher
from tests.polling import free_port


class _Raises:
    name = "raises"

    def __init__(self) -> None:
        self.seen: list[Any] = []

    def on_event(self, ev: Any) -> list[Any]:
        self.seen.append(ev)
        raise RuntimeError("a policy bug")


def test_a_policy_that_raises_is_counted_and_the_pusher_goes_on() -> None:
    pusher = HintPusher(f"127.0.0.1:{free_port()}", "hintflow", tick_s=0.02)
    try:
        policy = _Raises()
        pusher.core.policy = policy  # type: ignore[assignment]
        pusher.event(TurnStarted("p", "s", 0.0, 10))
        pusher.event(ToolStarted("p", "s", "bash", 0.1, 12))  # a pause is open: ticks reach the policy
        deadline = time.monotonic() + 5.0
        while pusher.codes["policy-errors"] < 4 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert pusher._thread.is_alive()
        assert pusher.codes["policy-errors"] >= 4  # the events, then ticks: it keeps going
        assert pusher.core.num_policy_errors >= 4  # (counted by the core; the pusher reports it)
        assert any(isinstance(e, TurnStarted) for e in policy.seen)
        pusher.event(TurnStarted("p", "s2", 1.0, 10))  # a later event still reaches the policy
        deadline = time.monotonic() + 5.0
        while not any(getattr(e, "session_id", "") == "s2" for e in policy.seen) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert any(getattr(e, "session_id", "") == "s2" for e in policy.seen)
    finally:
        pusher.close()
