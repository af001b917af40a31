"""Per-request accounting on a real vLLM: the engine core's ``hintflow_*`` prompt-token series agree with
the cache hits vLLM itself reports, across turns that keep their prefix and after a flood that evicts it.

On the shared server of ``tests/test_vllm_backend.py`` (through :func:`shared_node`): 31 usable blocks of
128 tokens, one request at a time, inferred hints off, so an unhinted session gets vLLM's default
treatment (no pin). Every figure is a difference of two scrapes around this test's own requests; the hits
vLLM reports (``usage.prompt_tokens_details.cached_tokens``) are the reference for what the series must
say. Skipped, saying why, only where no Python has vLLM (the import below skips with that module's reason).
"""

from __future__ import annotations

import pytest
from test_vllm_backend import BS, Node, _prompt, shared_node  # skips this module too where vLLM is missing

from hints import Release
from tests.vllm_support import scrape_metrics

Scrape = dict[tuple[str, tuple[tuple[str, str], ...]], float]


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory, pytestconfig: pytest.Config) -> Node:
    return shared_node(tmp_path_factory, pytestconfig)


def _turn(node: Node, prompt: list[int], session: str, output_tokens: int = 1) -> int:
    """One turn of ``session`` (its own program); the prompt tokens vLLM found cached."""
    kw = {"max_tokens": output_tokens, "ignore_eos": True}
    usage = node.complete(prompt, session, f"p{session}", **kw)["usage"]
    assert usage["prompt_tokens"] == len(prompt)
    return int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


class Delta:
    """What the series counted between two scrapes."""

    def __init__(self, before: Scrape, after: Scrape) -> None:
        self.before, self.after = before, after

    def __call__(self, name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return self.after.get(key, 0.0) - self.before.get(key, 0.0)

    def split(self) -> tuple[float, float, float, float]:
        """(across-turn prompt, across-turn hits, recomputed, within-turn hits) tokens."""
        return (
            self("hintflow_across_turn_prompt_tokens_total"),
            self("hintflow_across_turn_hit_tokens_total"),
            self("hintflow_recomputed_tokens_total"),
            self("hintflow_within_turn_hit_tokens_total"),
        )


def test_across_turn_hits_then_recomputed_tokens_after_a_flood(node: Node) -> None:
    m0 = scrape_metrics(node.metrics_url)
    t1 = _prompt(90, 5 * BS + 10)
    hit1 = _turn(node, t1, "acc", output_tokens=4)
    t2 = t1 + _prompt(91, 2 * BS)  # the agent resends its inputs (not the model's output) and a tool result
    hit2 = _turn(node, t2, "acc")
    m1 = scrape_metrics(node.metrics_url)
    d = Delta(m0, m1)
    assert hit1 == 0 and hit2 == 5 * BS  # vLLM: turn 2 found turn 1's five full blocks
    # Turn 1 had no history. Turn 2's history is its common prefix with the 653 tokens turn 1 computed
    # (650 inputs, 3 of its 4 outputs): the 650 inputs. Their five full blocks hit; the 10 tokens of the
    # partial block (vLLM caches full blocks only) are recomputed.
    assert d.split() == (len(t1), hit2, len(t1) - hit2, 0)
    assert d("hintflow_prompt_tokens_total", source="device_hit") == hit2
    assert d("hintflow_prompt_tokens_total", source="computed") == len(t1) + len(t2) - hit2
    assert d("hintflow_prompt_tokens_total", source="host_hit") == 0
    assert d("hintflow_queue_wait_seconds_count") == 2
    assert d("hintflow_time_to_first_token_seconds_count") == 2
    assert d("hintflow_time_to_first_token_seconds_sum") > 0

    # Another session starting with turn 1's prefix (a shared system prompt): within-turn hits only.
    shared = t1[: 5 * BS] + _prompt(92, BS)
    hit_shared = _turn(node, shared, "acc-b")
    m2 = scrape_metrics(node.metrics_url)
    assert hit_shared == 5 * BS
    assert Delta(m1, m2).split() == (0, 0, 0, hit_shared)

    # A flood of unrelated requests (48 blocks through the 31-block pool) evicts the paused context: no
    # pin, so vLLM's default LRU treatment. The returning turn's whole history is recomputed.
    node.flood(6, 8 * BS, seed=93)
    t3 = t2 + _prompt(94, BS)
    hit3 = _turn(node, t3, "acc")
    m3 = scrape_metrics(node.metrics_url)
    d = Delta(m2, m3)
    assert hit3 == 0
    across, across_hit, recomputed, within = d.split()
    assert (across, across_hit, recomputed) == (len(t2), 0, len(t2)) and recomputed > 0
    assert within == 0  # the flood's random prompts share nothing
    flood_tokens = 6 * 8 * BS
    prompt_tokens = d("hintflow_prompt_tokens_total", source="device_hit") + d(
        "hintflow_prompt_tokens_total", source="computed"
    )
    assert prompt_tokens == flood_tokens + len(t3)
    assert d("hintflow_time_to_first_token_seconds_count") == 7
    node.hints(Release(program_id="pacc"), Release(program_id="pacc-b"))
