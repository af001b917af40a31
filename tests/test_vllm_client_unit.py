"""vLLM node names and the HTTP turn path without vLLM: ``parse_engine``, and ``VllmClient`` / ``HintRuntime``
against a fake OpenAI server on a loopback port that answers as vLLM 0.32 does (a streamed completion with
``token_ids`` and a final usage chunk; HTTP 400 for a bad request; a streamed error once the stream has
started). The same path against the real vLLM server: ``tests/test_vllm_orchestrator.py``.
"""

from __future__ import annotations

import json
import re
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from hints import CacheState, EngineSpec, VllmClient, VllmFailed, VllmRejected, VllmUnreachable, parse_engine


def test_parse_engine_names_embedded_and_vllm_nodes() -> None:
    emb = parse_engine("10.0.0.5:50051")
    assert emb == EngineSpec("10.0.0.5:50051") and not emb.is_vllm and emb.name == "10.0.0.5:50051"
    v = parse_engine("vllm+http://10.0.0.6:8000?hints=10.0.0.6:50061")
    assert v.is_vllm and v.http_base == "http://10.0.0.6:8000" and v.hint_address == "10.0.0.6:50061"
    assert v.name == "vllm+http://10.0.0.6:8000?hints=10.0.0.6:50061" and parse_engine(v.name) == v
    m = parse_engine("vllm+http://h:8000/?model=org/tiny&hints=h:9")
    assert m.model == "org/tiny" and m.name == "vllm+http://h:8000?hints=h:9&model=org/tiny"
    assert parse_engine(m.name) == m
    for bad, why in [
        ("localhost", "is not HOST:PORT"),
        ("vllm+http://h:8000", "needs its hint service"),
        ("vllm+http://h:8000?hints=h", "is not HOST:PORT"),
        ("vllm+http://h?hints=h:9", "is not HOST:PORT"),
        ("http://h:8000?hints=h:9", "unknown scheme 'http'"),
        ("vllm+http://h:8000/v1?hints=h:9", "no path"),
        ("vllm+http://h:8000?hints=h:9&ttl=3", "unknown parameter(s) ttl"),
        ("vllm+http://h:8000?hints=h:9&hints=h:10", "given twice"),
    ]:
        with pytest.raises(ValueError, match=re.escape(why)):
            parse_engine(bad)


class _Fake(BaseHTTPRequestHandler):
    """Answers by the prompt's first token: 1 ok, 2 HTTP 400, 3 streamed 400, 4 HTTP 500, 5 cut stream."""

    bodies: list[dict[str, Any]]

    def log_message(self, *args: Any) -> None:
        pass

    def _send(self, status: int, payload: bytes, ctype: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).bodies.append(body)
        first = body["prompt"][0]
        if first == 2:
            err = {"message": "This model's maximum context length is 2048 tokens", "code": 400}
            return self._send(400, json.dumps({"error": {**err, "type": "BadRequestError"}}).encode())
        if first == 4:
            return self._send(500, json.dumps({"error": {"message": "boom", "code": 500}}).encode())
        n = body["max_tokens"]
        events: list[dict[str, Any]] = []
        if first == 3:
            events.append({"error": {"message": "Token id 5000 is out of vocabulary", "code": 400}})
        else:
            events.append(
                {"id": "cmpl-x", "choices": [{"text": "a", "token_ids": [100], "prompt_token_ids": [1]}]}
            )
            events += [
                {"id": "cmpl-x", "choices": [{"text": "b", "token_ids": [100 + i]}]} for i in range(1, n)
            ]
            events[-1]["choices"][0]["finish_reason"] = "length"
            details = {"cached_tokens": 256}
            usage = {
                "prompt_tokens": len(body["prompt"]),
                "completion_tokens": n,
                "prompt_tokens_details": details,
            }
            events.append({"id": "cmpl-x", "choices": [], "usage": usage, "metrics": {"queue_time_ms": 12.5}})
        text = "".join(f"data: {json.dumps(e)}\n\n" for e in events)
        if first != 5:
            text += "data: [DONE]\n\n"
        self._send(200, text.encode(), "text/event-stream")


@pytest.fixture
def fake() -> Iterator[tuple[str, list[dict[str, Any]]]]:
    handler = type("Handler", (_Fake,), {"bodies": []})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", handler.bodies
    finally:
        server.shutdown()
        server.server_close()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_vllm_client_sends_the_turn_and_reads_tokens_cache_hits_and_errors(fake: Any) -> None:
    base, bodies = fake
    async with VllmClient(base, "tiny") as c:
        res = await c.generate([1, 7, 300], 4, "wf-1/planner", "wf-1")
        assert res.token_ids == [100, 101, 102, 103] and res.finish_reason == "length"
        assert res.num_prompt_tokens == 3 and res.num_cached_tokens == 256 and res.queue_wait_s == 0.0125
        assert res.ttft_s > 0 and res.request_id == "cmpl-x"
        body = bodies[-1]
        assert body["prompt"] == [1, 7, 300] and body["max_tokens"] == 4 and body["model"] == "tiny"
        assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
        assert body["session_id"] == "wf-1/planner" and body["vllm_xargs"] == {"program_id": "wf-1"}
        assert body["return_token_ids"] is True and body["ignore_eos"] is True
        with pytest.raises(VllmRejected, match="maximum context length") as bad:
            await c.generate([2, 7], 4, "s")
        assert bad.value.status == 400
        with pytest.raises(VllmRejected, match="out of vocabulary"):
            await c.generate([3, 7], 4, "s")
        with pytest.raises(VllmFailed, match="HTTP 500: boom"):
            await c.generate([4, 7], 4, "s")
        with pytest.raises(VllmUnreachable, match=r"before \[DONE\]"):
            await c.generate([5, 7], 4, "s")
    async with VllmClient(f"http://127.0.0.1:{_closed_port()}") as c:
        with pytest.raises(VllmUnreachable, match="cannot reach"):
            await c.generate([1], 1, "s")
    assert "model" not in VllmClient("http://h:1").request_body([1], 1, "s")


async def test_hint_runtime_runs_a_vllm_nodes_turn_over_http_and_maps_its_errors(fake: Any) -> None:
    from workflows import EngineUnavailable, HintRuntime, InvalidPrompt, LLMInput, turn_client

    base, _ = fake
    dead = f"vllm+http://127.0.0.1:{_closed_port()}?hints=127.0.0.1:1"
    spec = f"vllm+{base}?hints=127.0.0.1:1"
    rt = HintRuntime([spec, dead, spec])
    assert rt.engines == [spec, dead]
    state = CacheState(node_id="v", model_name="m", block_size=16, total_blocks=64, free_blocks=64,
                       pinned_blocks=0, host_total_blocks=0, host_free_blocks=0, num_waiting=0,
                       num_running=0, prefill_backlog_tokens=0)  # fmt: skip
    busy = state.model_copy(update={"num_waiting": 1, "prefill_backlog_tokens": 100_000})
    for name in rt.engines:  # what the nodes' WatchCacheState would say (the runtime is not started)
        rt.router.update(name, busy if name == spec else state, 0.0)
        rt.clients[name] = turn_client(name)
    try:
        # the dead node looks cheaper, so it is tried first: the turn fails over to the live one
        out = await rt.generate("p", LLMInput("s1", [1, 9, 9], 3))
        assert out.node == spec and out.token_ids == [100, 101, 102] and out.num_cached_tokens == 256
        assert dead not in rt.router._nodes  # dropped until its state stream answers again
        with pytest.raises(InvalidPrompt, match="refused the prompt: This model's maximum"):
            await rt.generate("p", LLMInput("s1", [2, 9], 3))
        with pytest.raises(EngineUnavailable, match="failed the call: HTTP 500"):
            await rt.generate("p", LLMInput("s1", [4, 9], 3))
        rt.router.remove(spec)
        rt.router.update(dead, state, 0.0)
        with pytest.raises(EngineUnavailable, match=r"no engine node reachable .* cannot reach"):
            await rt.generate("p", LLMInput("s2", [1], 1))
    finally:
        for c in rt.clients.values():
            await c.close()
