"""Example agent programs, by the name ``hintflow run`` takes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from workflows.examples._common import ProgramReport, TurnReport, lognormal_params, sample_pause_s
from workflows.examples.coding_agent import CodingAgent, CodingAgentInput
from workflows.examples.human_in_loop import HumanInLoop, HumanInLoopInput
from workflows.examples.pipeline import Pipeline, PipelineInput

__all__ = [
    "EXAMPLES",
    "CodingAgent",
    "CodingAgentInput",
    "Example",
    "HumanInLoop",
    "HumanInLoopInput",
    "Pipeline",
    "PipelineInput",
    "ProgramReport",
    "TurnReport",
    "lognormal_params",
    "sample_pause_s",
]


@dataclass(frozen=True)
class Example:
    name: str
    workflow: type
    input_type: type
    description: str

    def make_input(self, **overrides: Any) -> Any:
        return self.input_type(**overrides)


EXAMPLES: dict[str, Example] = {
    e.name: e
    for e in [
        Example(
            "coding-agent", CodingAgent, CodingAgentInput, "SWE-style loop: model call, bash tool, 10 turns"
        ),
        Example("pipeline", Pipeline, PipelineInput, "planner -> workers -> reviewer with an AND or OR join"),
        Example("human-in-loop", HumanInLoop, HumanInLoopInput, "draft, wait minutes for a person, revise"),
    ]
}
ALL_WORKFLOWS = [e.workflow for e in EXAMPLES.values()]
