"""Where a vLLM node's step time goes: hintflow's rules, vLLM's own scheduler, the model.

hintflow's scheduler wraps vLLM's: before each ``schedule()`` it expires pins, runs the inference's sweep,
re-keys the waiting queue's bands and builds the admission state, and after it books the admitted turns;
``update_from_output`` adds the accounting. That work runs on the engine core's thread between model
steps, so it is time no step computes. :class:`StepTimes` keeps the three apart (wall clock, per step,
since the last 10 s log line) so an operator, or a benchmark that finds the node slower than its model,
can read what hintflow adds on top of vLLM: ``step_ms=`` hintflow / vLLM scheduler / model in the node's
``hintflow:`` log line.

No vLLM import: the scheduler hands in the durations.
"""

from __future__ import annotations

__all__ = ["StepTimes"]


class StepTimes:
    """Sums since the last :meth:`line`: seconds in hintflow's rules and in vLLM's scheduler per scheduled
    step, and seconds of model compute per step that came back (``StepsInFlight.returned``)."""

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self.num_scheduled = 0
        self.hintflow_s = 0.0
        self.vllm_s = 0.0
        self.num_computed = 0
        self.compute_s = 0.0

    def scheduled(self, total_s: float, vllm_s: float) -> None:
        """One ``schedule()`` call took ``total_s``, of which ``vllm_s`` in vLLM's own."""
        self.num_scheduled += 1
        self.updated(total_s, vllm_s)

    def updated(self, total_s: float, vllm_s: float) -> None:
        """One ``update_from_output()`` call: hintflow's part counts with the step's scheduling."""
        self.hintflow_s += max(0.0, total_s - vllm_s)
        self.vllm_s += vllm_s

    def computed(self, seconds: float) -> None:
        """A step's compute came back after ``seconds``."""
        self.num_computed += 1
        self.compute_s += seconds

    def line(self) -> str:
        """``step_ms=H/V/M``: per step, milliseconds in hintflow's rules, in vLLM's scheduler and in the
        model (each 0 without a step); then the sums start again."""
        n, m = max(self.num_scheduled, 1), max(self.num_computed, 1)
        text = f"step_ms={1e3 * self.hintflow_s / n:.2f}/{1e3 * self.vllm_s / n:.2f}/{1e3 * self.compute_s / m:.1f}"
        self._reset()
        return text
