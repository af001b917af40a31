"""Inferred hints against a real vLLM server: a client that sends only ``program_id`` (and ``tool``,
``is_last_turn``) in ``extra_body.vllm_xargs`` gets its context pinned across a tool pause under a flood,
released on its last turn, and an orchestrator's hint silences the inference for that session.

One server (the session's ``infer`` one, ``tests/vllm_support.py``; 32 blocks of 128 tokens, priority policy, our scheduler). The re-prefill cost
is fixed with ``HINTFLOW_INFER_RELOAD_S_PER_TOKEN=0.1`` (a profile, as Continuum's fit), so the cold-start
rule (tools ~ Exp(1 s)) pins a 5-block context for ln(64) ~ 4 s; measured on this tiny model the reload
is so cheap that Continuum's rule would only pin once queueing delays are seen. Anonymous requests (no
session, no program) get vLLM's default treatment and are the control. Skipped, saying why, only where no
Python with vLLM exists (``vllm_python_or_skip`` in tests/vllm_support.py).
"""

from __future__ import annotations

import json
import random
import urllib.request
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from hints import (
    CacheState,
    HintAck,
    HintBatch,
    HintModel,
    Priority,
    ack_from_proto,
    batch_to_proto,
    cache_state_from_proto,
    engine_pb2,
    engine_pb2_grpc,
)
from tests.vllm_support import ServerSpec, free_port, session_server, vllm_python_or_skip, want_server

VLLM_PYTHON = vllm_python_or_skip()

BS = 128


def _prompt(seed: int, tokens: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 1000) for _ in range(tokens)]


class Node:
    def __init__(self, http_port: int, hint_port: int, model: str) -> None:
        self.base = f"http://127.0.0.1:{http_port}"
        self.model = model
        self.channel = grpc.insecure_channel(f"127.0.0.1:{hint_port}")
        self.stub = engine_pb2_grpc.EngineNodeStub(self.channel)

    def cached(self, prompt: list[int], program: str | None = None, **xargs: Any) -> int:
        """Complete with only ``vllm_xargs`` (no session_id); the prompt tokens vLLM found cached."""
        body: dict[str, Any] = {"model": self.model, "prompt": prompt, "max_tokens": 1, "temperature": 0}
        if program:
            body["vllm_xargs"] = {"program_id": program, **xargs}
        req = urllib.request.Request(
            f"{self.base}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=120) as r:
            usage = json.load(r)["usage"]
        return int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)

    def flood(self, n: int, tokens: int, seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(n):
            self.cached([rng.randrange(10, 1000) for _ in range(tokens)])

    def hints(self, *hints: HintModel) -> HintAck:
        batch = batch_to_proto(HintBatch(batch_id=1, hints=list(hints)))
        return ack_from_proto(next(iter(self.stub.PushHints(iter([batch]), timeout=30))))

    def state(self) -> CacheState:
        req = engine_pb2.WatchCacheStateRequest(include_sessions=True)
        return cache_state_from_proto(self.stub.GetCacheState(req, timeout=30))

    def pinned(self, session: str) -> bool:
        return any(s.session_id == session and s.pinned for s in self.state().sessions)


SERVER = want_server(ServerSpec(
    "infer", ["--dtype", "float32", "--enforce-eager", "--max-model-len", "2048", "--num-gpu-blocks-override", "32"],
    env={"HINTFLOW_INFER_RELOAD_S_PER_TOKEN": "0.1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"},  # (moves: one process)
    build_kw={"hint_port": free_port(), "pin_budget": 0.6, "infer_hints": True},
))  # fmt: skip


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory, pytestconfig: pytest.Config) -> Iterator[Node]:
    server = session_server("infer", tmp_path_factory, pytestconfig)
    n = Node(server.port, SERVER.build_kw["hint_port"], str(server.model))
    yield n
    n.channel.close()


def test_program_id_and_tool_alone_keep_the_context_across_a_flood(node: Node) -> None:
    a, b = _prompt(1, 5 * BS + 10), _prompt(2, 5 * BS + 10)
    assert node.cached(a, "pa", tool="edit") == 0
    node.cached(b)  # the control: no program, vLLM's own path
    assert node.pinned("pa")  # inferred: the session is the program, pinned at the turn's end
    node.flood(6, 8 * BS, seed=3)  # 48 blocks through a 31-block pool, within the ~4 s lease
    assert node.cached(b + [7]) == 0  # vanilla behaviour: gone
    assert node.cached(a + [7], "pa", tool="edit", is_last_turn=True) == 5 * BS  # kept by the inferred pin


def test_last_turn_releases_the_program(node: Node) -> None:
    c = _prompt(4, 5 * BS + 3)
    node.cached(c, "pc", tool="grep")
    assert node.pinned("pc")
    assert node.cached(c + [9], "pc", is_last_turn=True) == 5 * BS
    state = node.state()
    assert not any(s.session_id == "pc" for s in state.sessions)  # released and forgotten
    assert state.pinned_blocks == 0


def test_an_orchestrator_hint_silences_inference_for_its_session(node: Node) -> None:
    ack = node.hints(Priority(session_id="pd", program_id="pd", program_age_s=1.0))
    assert ack.results[0].ok  # not seen yet: recorded, and the orchestrator now speaks for it
    d = _prompt(6, 5 * BS + 3)
    node.cached(d, "pd", tool="edit")
    assert not node.pinned("pd")
    node.cached(_prompt(7, 5 * BS + 3), "pe", tool="edit")  # a program nobody hints: pinned
    assert node.pinned("pe")
    node.cached(d, "pd", is_last_turn=True)
    node.cached(_prompt(7, 5 * BS + 3), "pe", is_last_turn=True)
    assert node.state().pinned_blocks == 0
