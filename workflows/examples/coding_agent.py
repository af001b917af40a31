"""A SWE-style coding agent: model call, shell tool, model call with the longer context, 10+ turns."""

from __future__ import annotations

from dataclasses import dataclass

from temporalio import workflow

from workflows._api import current_session, llm, tool
from workflows.examples._common import (
    ProgramReport,
    check_input,
    fixed_prefix,
    input_problems,
    program_rng,
    sample_pause_s,
)

__all__ = ["CodingAgent", "CodingAgentInput"]


@dataclass
class CodingAgentInput:
    turns: int = 10
    system_prompt_tokens: int = 160  # shared by every program (same tokens)
    task_tokens: int = 320  # this program's issue text
    tool_output_tokens: int = 64  # appended after each tool call
    output_tokens: int = 8
    tool_mean_s: float = 0.9
    tool_sd_s: float = 3.5
    tool_max_s: float = 60.0
    time_scale: float = 1.0  # multiplies every sampled pause (tests and demos run the same shape faster)
    vocab_size: int = 256
    seed: int | None = None  # the program's own random draws; None: Temporal's per-run random
    # Uneven growth: this share of the programs (drawn per program) gets tool outputs heavy_factor times
    # longer, so their contexts grow several times faster than the others' and nodes fall out of balance.
    heavy_fraction: float = 0.0
    heavy_factor: int = 4

    def problems(self) -> list[str]:
        """Empty when the input is valid; else what is wrong with it, one line per field."""
        out = input_problems(
            self,
            at_least_one=("turns", "output_tokens", "vocab_size", "heavy_factor"),
            non_negative=("system_prompt_tokens", "task_tokens", "tool_output_tokens"),
            positive=("tool_mean_s",),
            non_negative_s=("tool_sd_s", "tool_max_s", "time_scale"),
        )
        if not out and not 0.0 <= self.heavy_fraction <= 1.0:
            out.append(f"heavy_fraction must be between 0 and 1, got {self.heavy_fraction!r}")
        if not out and self.system_prompt_tokens + self.task_tokens < 1:
            out.append("system_prompt_tokens + task_tokens must be >= 1 (the first prompt)")
        return out


@workflow.defn(name="hintflow.examples.CodingAgent")
class CodingAgent:
    @workflow.run
    async def run(self, inp: CodingAgentInput) -> ProgramReport:
        check_input(inp.problems())
        rng = program_rng(inp.seed)
        start = workflow.time()
        report = ProgramReport(workflow.info().workflow_id, "coding-agent")
        system = fixed_prefix("coding-agent:system", inp.system_prompt_tokens, inp.vocab_size)
        prompt = system + [rng.randrange(inp.vocab_size) for _ in range(inp.task_tokens)]
        history = 0
        # (drawn only when asked for: the same input replays the same random sequence as before the option)
        heavy = inp.heavy_fraction > 0 and rng.random() < inp.heavy_fraction
        tool_tokens = inp.tool_output_tokens * (inp.heavy_factor if heavy else 1)
        for turn in range(inp.turns):
            res = await llm(
                prompt,
                max_new_tokens=inp.output_tokens,
                prefix_key="coding-agent:system",
                prefix_tokens=len(system),
            )
            t = report.add(current_session(), history, res)
            prompt = prompt + res.token_ids
            history = len(prompt) - 1  # the last generated token's KV is written by the next turn
            if turn == inp.turns - 1:
                break
            pause_s = sample_pause_s(rng, inp.tool_mean_s, inp.tool_sd_s, inp.tool_max_s) * inp.time_scale
            out = await tool(
                "bash", duration_s=pause_s, output_tokens=tool_tokens, vocab_size=inp.vocab_size
            )
            t.tool, t.tool_s = "bash", out.duration_s
            prompt = prompt + out.output_token_ids
        report.jct_s = workflow.time() - start
        return report
