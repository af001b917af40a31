"""A human-in-the-loop agent: draft, wait minutes for a person, revise; the wait is a ``human`` pause.

A signal ``approve`` ends the wait early; otherwise the simulated person answers after a sampled time
(lognormal, median ``human_median_s``), so ``hintflow run human-in-loop`` needs nobody at the keyboard.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from functools import partial

from temporalio import workflow

from workflows._api import current_session, llm, pause
from workflows.examples._common import ProgramReport, check_input, input_problems, program_rng

__all__ = ["HumanInLoop", "HumanInLoopInput"]


@dataclass
class HumanInLoopInput:
    rounds: int = 3
    prompt_tokens: int = 320
    feedback_tokens: int = 32
    output_tokens: int = 16
    human_median_s: float = 120.0
    human_sigma: float = 0.8
    time_scale: float = 1.0
    vocab_size: int = 256
    seed: int | None = None  # the program's own random draws; None: Temporal's per-run random

    def problems(self) -> list[str]:
        """Empty when the input is valid; else what is wrong with it, one line per field."""
        return input_problems(
            self,
            at_least_one=("rounds", "prompt_tokens", "output_tokens", "vocab_size"),
            non_negative=("feedback_tokens",),
            positive=("human_median_s",),
            non_negative_s=("human_sigma", "time_scale"),
        )


@workflow.defn(name="hintflow.examples.HumanInLoop")
class HumanInLoop:
    def __init__(self) -> None:
        self._approvals = 0

    @workflow.signal
    def approve(self) -> None:
        self._approvals += 1

    def _approved_since(self, seen: int) -> bool:
        return self._approvals > seen

    @workflow.run
    async def run(self, inp: HumanInLoopInput) -> ProgramReport:
        check_input(inp.problems())
        rng = program_rng(inp.seed)
        start = workflow.time()
        report = ProgramReport(workflow.info().workflow_id, "human-in-loop")
        prompt = [rng.randrange(inp.vocab_size) for _ in range(inp.prompt_tokens)]
        history = 0
        for r in range(inp.rounds):
            res = await llm(prompt, max_new_tokens=inp.output_tokens)
            t = report.add(current_session(), history, res)
            prompt = prompt + res.token_ids
            history = len(prompt) - 1
            if r == inp.rounds - 1:
                break
            wait_s = rng.lognormvariate(math.log(inp.human_median_s), inp.human_sigma) * inp.time_scale
            seen = self._approvals
            t0 = workflow.time()
            async with pause("human"):
                with contextlib.suppress(TimeoutError):  # timeout: the simulated person answered
                    await workflow.wait_condition(partial(self._approved_since, seen), timeout=wait_s)
            t.tool, t.tool_s = "human", workflow.time() - t0
            prompt = prompt + [rng.randrange(inp.vocab_size) for _ in range(inp.feedback_tokens)]
        report.jct_s = workflow.time() - start
        return report
