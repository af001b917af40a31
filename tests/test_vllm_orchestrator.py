"""The orchestrator runs turns on a real vLLM node: ``HintRuntime`` with ``vllm+http://...?hints=...`` as its
only engine sends each turn to vLLM's OpenAI ``/v1/completions`` (token ids, streamed, ``session_id`` and
``vllm_xargs.program_id``), and its hints and cache-state stream to the node's hint service.

Against the real vLLM server of ``tests/test_vllm_backend.py`` (shared through :func:`shared_node`: tiny
model, 31 blocks of 128 tokens, ``--max-model-len 2048``, hintflow's scheduler, ``--enable-prompt-tokens-
details``) and the session's Temporal dev server (``temporal_env``): a coding agent on Temporal runs every
turn there and its later turns hit vLLM's prefix cache; hints reach the node (its ``hintflow_hints_total``);
a prompt vLLM refuses is the non-retryable ``InvalidPrompt``; a node whose HTTP server is unreachable is
the retryable ``EngineUnavailable``.

Skipped, saying why, only where no Python has vLLM (the import below skips with test_vllm_backend's reason).
"""

from __future__ import annotations

import asyncio
import socket
import time
import uuid
from typing import Any

import pytest
from test_vllm_backend import BS, Node, _prompt, shared_node  # skips this module too where vLLM is missing

from hints import Release
from tests.vllm_support import scrape_metrics


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory, pytestconfig: pytest.Config) -> Node:
    return shared_node(tmp_path_factory, pytestconfig)


def _spec(node: Node, http_base: str | None = None) -> str:
    return f"vllm+{http_base or node.base}?hints={node.hint_address}"


def _total(metrics: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float:
    want = set(labels.items())
    return sum(v for (n, lab), v in metrics.items() if n == name and want <= set(lab))


async def _started(runtime: Any, timeout_s: float = 15.0) -> None:
    """Start the runtime and wait until its router has the node's cache state."""
    from orchestrator import RouteRequest

    await runtime.start()
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            runtime.router.choose(RouteRequest("probe", "probe", 1), time.monotonic())
            return
        except Exception:
            assert time.monotonic() < deadline, "the router never saw the vLLM node's cache state"
            await asyncio.sleep(0.05)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_coding_agent_on_temporal_runs_every_turn_on_the_vllm_node(
    node: Node, temporal_env: Any
) -> None:
    from temporalio.worker import Worker

    from orchestrator import PauseModel, get_policy
    from workflows import HintflowPlugin, HintRuntime
    from workflows.examples import CodingAgent, CodingAgentInput

    spec = _spec(node)
    turns, output_tokens, tool_tokens, programs = 4, 8, 64, 2
    inp = CodingAgentInput(
        turns=turns, task_tokens=320, tool_output_tokens=tool_tokens, output_tokens=output_tokens,
        tool_mean_s=0.5, tool_sd_s=0.5, time_scale=0.2,
    )  # fmt: skip
    before, vllm_before = scrape_metrics(node.metrics_url), scrape_metrics(node.base + "/metrics")
    # The hintflow policy, re-prefill priced at 0.5 s (a bigger model's; the tiny one re-prefills in ms,
    # where no pin pays): it pins each context at its tool start, so Pin hints reach the node too.
    policy = get_policy(
        "hintflow",
        prefill_reload=lambda n: 0.5,
        pause_model=PauseModel(default_mean_s=0.15, min_samples=20),
        renew_ahead_s=0.25,
    )
    runtime = HintRuntime([spec], policy, watch_interval_s=0.2)
    ids = [f"vllm-agent-{i}-{uuid.uuid4().hex[:6]}" for i in range(programs)]
    t0 = time.monotonic()
    try:
        await _started(runtime)
        tq = f"tq-vllm-{uuid.uuid4().hex[:8]}"
        plugin = HintflowPlugin(runtime=runtime)
        async with Worker(temporal_env.client, task_queue=tq, workflows=[CodingAgent], plugins=[plugin]):
            handles = [
                await temporal_env.client.start_workflow(CodingAgent.run, inp, id=wid, task_queue=tq)
                for wid in ids
            ]
            reports = await asyncio.wait_for(asyncio.gather(*(h.result() for h in handles)), 90)
        for pub in runtime.publishers.values():
            await pub.flush(5.0)  # the program ends' Release
        wall_s = time.monotonic() - t0
    finally:
        await runtime.stop()
    after, vllm_after = scrape_metrics(node.metrics_url), scrape_metrics(node.base + "/metrics")

    first_prompt = 160 + 320
    for r in reports:
        assert len(r.turns) == turns, r
        for k, t in enumerate(r.turns):
            assert t.node == spec and t.ttft_s > 0
            # each turn's prompt is the last one + its output_tokens generated tokens + the tool's output
            assert t.prompt_tokens == first_prompt + k * (output_tokens + tool_tokens), r.turns
            if k:  # vLLM's prefix cache across turns: at least the full blocks the last turn computed
                assert t.cached_tokens >= (t.history_tokens // BS) * BS > 0, r.turns
    # every turn ran to max_new_tokens, on this node (vLLM's own counter; its stats may trail the response)
    want = _total(vllm_before, "vllm:generation_tokens_total") + programs * turns * output_tokens
    deadline = time.monotonic() + 5
    while _total(vllm_after, "vllm:generation_tokens_total") < want and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
        vllm_after = scrape_metrics(node.base + "/metrics")
    assert _total(vllm_after, "vllm:generation_tokens_total") == want

    hints = _total(after, "hintflow_hints_total") - _total(before, "hintflow_hints_total")
    releases = _total(after, "hintflow_hints_total", kind="release", code="OK") - _total(
        before, "hintflow_hints_total", kind="release", code="OK"
    )
    pins = _total(after, "hintflow_hints_total", kind="pin", code="OK") - _total(
        before, "hintflow_hints_total", kind="pin", code="OK"
    )
    sent_ok = sum(p.num_acked_ok for p in runtime.publishers.values())
    totals = runtime.totals()
    assert hints > 0 and sent_ok > 0, (hints, sent_ok)
    assert releases >= programs  # each program's end reached the node as a Release it knew the program of
    assert pins > 0 and totals.pins_placed > 0, (pins, totals)  # leases the vLLM node accepted
    assert node.state().pinned_blocks == 0  # the programs' Release let them go (later tests need the pool)
    kinds = {
        f"{dict(lab)['kind']}/{dict(lab)['code']}": v - before.get((n, lab), 0)
        for (n, lab), v in after.items()
        if n == "hintflow_hints_total" and v > before.get((n, lab), 0)
    }
    print(
        f"\n{programs} programs x {turns} turns on vLLM in {wall_s:.1f} s; hints at the node: {kinds}; "
        f"pins placed/held/expired {totals.pins_placed}/{totals.pins_held}/{totals.pins_expired}; "
        f"cached per turn: {[[t.cached_tokens for t in r.turns] for r in reports]}"
    )


async def test_runtime_generate_on_vllm_returns_the_embedded_result_and_maps_errors(node: Node) -> None:
    from workflows import EngineUnavailable, HintRuntime, InvalidPrompt, LLMInput

    spec = _spec(node)
    runtime = HintRuntime([spec], "vllm-default", watch_interval_s=0.2)
    prompt = _prompt(70, 3 * BS + 20)
    try:
        await _started(runtime)
        first = await runtime.generate("pgen", LLMInput("gen1", prompt, 6))
        assert len(first.token_ids) == 6 and first.node == spec and first.num_prompt_tokens == len(prompt)
        assert first.ttft_s > 0 and first.latency_s >= first.ttft_s and first.num_recomputed_tokens == 0
        again = await runtime.generate("pgen", LLMInput("gen1", prompt + first.token_ids, 6))
        assert again.num_cached_tokens == 3 * BS and again.num_prompt_tokens == len(prompt) + 6
        assert any(s.session_id == "gen1" for s in node.state().sessions)  # the session_id reached vLLM
        with pytest.raises(InvalidPrompt, match=r"maximum context length|too long|max_model_len"):
            await runtime.generate("pgen", LLMInput("gen2", _prompt(71, 2100), 4))
        with pytest.raises(InvalidPrompt, match="out of vocabulary"):
            await runtime.generate("pgen", LLMInput("gen2", [5, 6, 100_000], 4))
    finally:
        await runtime.stop()
        await asyncio.to_thread(node.hints, Release(program_id="pgen"))

    # The hint service answers but the OpenAI server does not: retryable, naming the node and the cause.
    dead = HintRuntime([_spec(node, f"http://127.0.0.1:{_closed_port()}")], watch_interval_s=0.2)
    try:
        await _started(dead)
        with pytest.raises(EngineUnavailable, match=r"no engine node reachable.*cannot reach"):
            await dead.generate("pdead", LLMInput("dead1", prompt, 2))
    finally:
        await dead.stop()
