"""A multi-agent pipeline: planner -> N workers (each: model, tool, model) -> reviewer, AND or OR join.

Each role has a fixed system prompt shared by every program (a hot prefix for the router), and each agent
is its own session.  ``join="and"``: the reviewer waits for every worker (KVFlow's AND node); ``"or"``:
it starts on the first worker's result and the others are cancelled (an OR node).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from temporalio import workflow

from workflows._api import current_session, llm, session, tool
from workflows.examples._common import (
    ProgramReport,
    check_input,
    fixed_prefix,
    input_problems,
    program_rng,
    sample_pause_s,
)

__all__ = ["Pipeline", "PipelineInput"]


@dataclass
class PipelineInput:
    num_workers: int = 3
    join: str = "and"  # "and" | "or"
    system_prompt_tokens: int = 128
    task_tokens: int = 96
    tool_output_tokens: int = 48
    output_tokens: int = 8
    tool_mean_s: float = 0.9
    tool_sd_s: float = 3.5
    tool_max_s: float = 60.0
    time_scale: float = 1.0
    vocab_size: int = 256
    seed: int | None = None  # the program's own random draws; None: Temporal's per-run random

    def problems(self) -> list[str]:
        """Empty when the input is valid; else what is wrong with it, one line per field."""
        out = [] if self.join in ("and", "or") else [f"join must be 'and' or 'or', got {self.join!r}"]
        out += input_problems(
            self,
            at_least_one=("num_workers", "output_tokens", "vocab_size"),
            non_negative=("system_prompt_tokens", "task_tokens", "tool_output_tokens"),
            positive=("tool_mean_s",),
            non_negative_s=("tool_sd_s", "tool_max_s", "time_scale"),
        )
        if not out and self.system_prompt_tokens + self.task_tokens < 1:
            out.append("system_prompt_tokens + task_tokens must be >= 1 (the planner's prompt)")
        return out


@workflow.defn(name="hintflow.examples.Pipeline")
class Pipeline:
    @workflow.run
    async def run(self, inp: PipelineInput) -> ProgramReport:
        check_input(inp.problems())
        rng = program_rng(inp.seed)
        start = workflow.time()
        report = ProgramReport(workflow.info().workflow_id, f"pipeline-{inp.join}")
        task = [rng.randrange(inp.vocab_size) for _ in range(inp.task_tokens)]

        async def call(role: str, prompt: list[int]) -> list[int]:
            system_len = inp.system_prompt_tokens
            res = await llm(
                prompt, max_new_tokens=inp.output_tokens, prefix_key=f"role:{role}", prefix_tokens=system_len
            )
            report.add(current_session(), 0, res)
            return prompt + res.token_ids

        def system(role: str) -> list[int]:
            return fixed_prefix(f"pipeline:{role}", inp.system_prompt_tokens, inp.vocab_size)

        with session("planner"):
            plan = await call("planner", system("planner") + task)

        async def worker(i: int) -> list[int]:
            with session(f"worker-{i}"):
                ctx = await call("worker", system("worker") + plan[-inp.task_tokens :])
                pause_s = sample_pause_s(rng, inp.tool_mean_s, inp.tool_sd_s, inp.tool_max_s) * inp.time_scale
                out = await tool(
                    "bash",
                    duration_s=pause_s,
                    output_tokens=inp.tool_output_tokens,
                    vocab_size=inp.vocab_size,
                )
                return await call("worker", ctx + out.output_token_ids)

        tasks = [asyncio.ensure_future(worker(i)) for i in range(inp.num_workers)]
        if inp.join == "and":
            results = list(await asyncio.gather(*tasks))
        else:
            done, pending = await workflow.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for t in pending:
                t.cancel()
            # Collect the cancelled workers' outcomes: unread, each would log "Task exception was never
            # retrieved" when collected (a cancellation is no error of the program's).
            await asyncio.gather(*pending, return_exceptions=True)
            results = [next(iter(done)).result()]
        with session("reviewer"):
            review = system("reviewer") + [tok for r in results for tok in r[-inp.output_tokens :]]
            await call("reviewer", review)
        report.jct_s = workflow.time() - start
        return report
