"""Recording: the client wrapper on OpenAI- and Anthropic-shaped clients (sync, async, streaming), the
JSONL it writes and reads back, the OpenTelemetry GenAI spans beside it (read back by ``diagnose``),
provider usage logs, and the errors a bad line gets.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from diagnose import (
    Recorder,
    TraceFormatError,
    diagnose_run,
    load_prices,
    load_run,
    normalize_usage,
    price_run,
    prompt_segments,
    record_client,
)
from tests.hosted_support import (
    SYSTEM,
    TOOLS,
    Clock,
    FakeOpenAI,
    coding_agent,
    record_coding_agents,
)


def test_the_wrapper_records_turns_pauses_and_usage_as_hashes_and_counts(tmp_path: Path) -> None:
    path = tmp_path / "run.jsonl"
    record_coding_agents(path, runs={"p": {"turns": 4}})
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert lines[0] == {"kind": "run", "format": "hintflow.turns/1"}
    turns = [x for x in lines if x["kind"] == "turn"]
    pauses = [x for x in lines if x["kind"] == "pause"]
    assert [t["turn"] for t in turns] == [0, 1, 2, 3] and len(pauses) == 3
    assert {p["tool"] for p in pauses} <= {"bash", "read_file", "search", "run_tests"}  # from the tool calls
    first = turns[0]
    assert [s["block"] for s in first["segments"]] == ["tools", "system", "message"]
    assert len(first["segments"][0]["items"]) == len(TOOLS)
    assert sum(s["num_tokens"] for s in first["segments"]) == first["input_tokens"]  # scaled to the report
    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert turns[1]["cached_tokens"] > 0
    text = path.read_text()
    assert "careful software engineer" not in text and "KeyError" not in text  # no prompt text unless asked


def test_prompt_text_is_kept_only_when_asked(tmp_path: Path) -> None:
    clock = Clock()
    rec = Recorder(tmp_path / "t.jsonl", keep_text=True, clock=clock, otel=False)
    client = record_client(FakeOpenAI(clock), rec, session_id="s")
    coding_agent(client, clock, turns=1)
    rec.close()
    assert "careful software engineer" in (tmp_path / "t.jsonl").read_text()


def test_anthropic_usage_counts_the_whole_prompt() -> None:
    u = normalize_usage({"input_tokens": 21, "cache_read_input_tokens": 188086, "cache_creation_input_tokens": 0,
                         "output_tokens": 393})
    assert (u.provider, u.input_tokens, u.cached_tokens, u.cache_write_tokens) == ("anthropic", 188107, 188086, 0)
    chat = normalize_usage({"prompt_tokens": 12033, "completion_tokens": 44,
                            "prompt_tokens_details": {"cached_tokens": 11904}})
    assert (chat.input_tokens, chat.cached_tokens, chat.output_tokens) == (12033, 11904, 44)
    responses = normalize_usage({"input_tokens": 12033, "input_tokens_details": {"cached_tokens": 11904,
                                                                                 "cache_write_tokens": 129},
                                 "output_tokens": 44})
    assert (responses.provider, responses.input_tokens, responses.cache_write_tokens) == ("openai", 12033, 129)


def test_an_anthropic_run_is_recorded_through_messages_create(tmp_path: Path) -> None:
    path = tmp_path / "a.jsonl"
    record_coding_agents(path, runs={"p": {"turns": 5}}, api="anthropic")
    run = load_run(path)
    assert [t.provider for t in run.turns] == ["anthropic"] * 5
    assert all(t.input_tokens == t.usage["input_tokens"] + t.usage["cache_read_input_tokens"]
               + t.usage["cache_creation_input_tokens"] for t in run.turns)
    assert run.turns[2].cached_tokens and run.turns[2].cached_tokens > 1000  # automatic caching read it


def test_prompt_segments_ignore_cache_markers_and_split_system_messages() -> None:
    plain = prompt_segments({"tools": TOOLS, "system": SYSTEM, "messages": [{"role": "user", "content": "q"}]})
    marked = prompt_segments({"tools": [*TOOLS[:-1], {**TOOLS[-1], "cache_control": {"type": "ephemeral"}}],
                              "system": [{"type": "text", "text": SYSTEM}],
                              "messages": [{"role": "user", "content": "q"}]})
    assert plain[0] == marked[0]  # moving a breakpoint is not a changed block
    chat = prompt_segments({"messages": [{"role": "developer", "content": "d"}, {"role": "user", "content": "q"}]})
    assert [s.block for s in chat] == ["system", "message"]
    responses = prompt_segments({"instructions": "be brief", "input": "q"})
    assert [(s.block, s.role) for s in responses] == [("system", ""), ("message", "user")]


class _AsyncChunks:
    def __init__(self, chunks: list[Any]) -> None:
        self.chunks = chunks

    def __aiter__(self) -> Any:
        return self._gen()

    async def _gen(self) -> Any:
        for c in self.chunks:
            yield c


def test_an_async_streaming_client_is_recorded_with_its_time_to_first_token(tmp_path: Path) -> None:
    clock = Clock()

    async def create(**kwargs: Any) -> Any:
        chunks = [SimpleNamespace(id="c1", choices=[], usage=None),
                  SimpleNamespace(id="c1", choices=[], usage=SimpleNamespace(
                      prompt_tokens=2000, completion_tokens=5,
                      prompt_tokens_details=SimpleNamespace(cached_tokens=1920)))]
        return _AsyncChunks(chunks)

    fake = SimpleNamespace(chat=SimpleNamespace(completions=SimpleNamespace(create=create)), api_key="x")
    rec = Recorder(None, clock=clock, otel=False)
    client = record_client(fake, rec, session_id="s", provider="vllm")
    assert client.api_key == "x"  # everything else passes through

    async def main() -> list[Any]:
        stream = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "q"}],
                                                      stream=True, stream_options={"include_usage": True})
        return [c async for c in stream]

    assert len(asyncio.run(main())) == 2
    [turn] = rec.turns
    assert (turn.provider, turn.input_tokens, turn.cached_tokens, turn.output_tokens) == ("vllm", 2000, 1920, 5)
    assert turn.ttft_s is not None and turn.response_id == "c1"


def test_spans_carry_the_genai_attributes_and_diagnose_reads_them_back(tmp_path: Path) -> None:
    sdk = pytest.importorskip("opentelemetry.sdk.trace", reason="needs opentelemetry-sdk (scripts/install.sh dev)")
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = sdk.TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    clock = Clock()
    rec = Recorder(tmp_path / "run.jsonl", clock=clock, tracer_provider=provider)
    client = record_client(FakeOpenAI(clock), rec, session_id="fix-1/agent", program_id="fix-1")
    coding_agent(client, clock, turns=4)
    rec.close()
    spans = exporter.get_finished_spans()
    chats = [s for s in spans if s.name == "chat gpt-5"]
    assert len(chats) == 4 and len([s for s in spans if s.name.startswith("execute_tool ")]) == 3
    attrs = chats[1].attributes or {}
    assert attrs["gen_ai.provider.name"] == "openai" and attrs["gen_ai.request.model"] == "gpt-5"
    assert attrs["gen_ai.conversation.id"] == "fix-1/agent"
    assert attrs["gen_ai.usage.cache_read.input_tokens"] == rec.turns[1].cached_tokens
    assert attrs["gen_ai.usage.input_tokens"] == rec.turns[1].input_tokens
    # As a backend would export them (the SDK's JSON, one span a line): the same run to diagnose.
    export = tmp_path / "spans.jsonl"
    export.write_text("".join(json.dumps(json.loads(s.to_json())) + "\n" for s in spans))
    from_spans, from_file = load_run(export), load_run(tmp_path / "run.jsonl")
    assert from_spans.source == "otel"
    assert [(t.turn, t.input_tokens, t.cached_tokens, t.tool) for t in from_spans.turns] == \
        [(t.turn, t.input_tokens, t.cached_tokens, t.tool) for t in from_file.turns]
    assert [s.hash for s in from_spans.turns[2].segments] == [s.hash for s in from_file.turns[2].segments]
    assert diagnose_run(from_spans).finding("early_blocks").status == "ok"


def test_otlp_json_from_another_instrumentation_is_read(tmp_path: Path) -> None:
    """Spans with the older attribute names and no hintflow attributes: turns and pauses from timing."""
    def span(i: int, start_s: float, cached: int) -> dict[str, Any]:
        attrs = {"gen_ai.operation.name": "chat", "gen_ai.system": "anthropic", "gen_ai.request.model": "claude-opus-5",
                 "gen_ai.usage.input_tokens": 40_000 + 1000 * i, "gen_ai.usage.output_tokens": 300,
                 "gen_ai.usage.cache_read_input_tokens": cached}
        return {"traceId": "t1", "spanId": f"s{i}", "name": "chat claude-opus-5",
                "startTimeUnixNano": str(int(start_s * 1e9)), "endTimeUnixNano": str(int((start_s + 2) * 1e9)),
                "attributes": [{"key": k, "value": {"stringValue": v} if isinstance(v, str) else {"intValue": str(v)}}
                               for k, v in attrs.items()]}
    line = {"resourceSpans": [{"scopeSpans": [{"spans": [span(0, 0.0, 0), span(1, 62.0, 39_000),
                                                        span(2, 1000.0, 0)]}]}]}
    path = tmp_path / "otlp.jsonl"
    path.write_text(json.dumps(line) + "\n")
    run = load_run(path)
    assert [(t.input_tokens, t.cached_tokens, t.provider) for t in run.turns] == [
        (40_000, 0, "anthropic"), (41_000, 39_000, "anthropic"), (42_000, 0, "anthropic")]
    assert [t.pause_s for t in run.turns] == [60.0, 936.0, None]
    diag = diagnose_run(run)
    assert diag.finding("reported_cache").numbers["num_cold_after_long_pause"] == 1


def test_a_provider_usage_log_is_diagnosed_and_priced(tmp_path: Path) -> None:
    rows = [
        {"timestamp": "2026-12-01T10:00:00Z", "session_id": "chat-1", "model": "claude-opus-5",
         "usage": {"input_tokens": 50, "cache_creation_input_tokens": 30_000, "cache_read_input_tokens": 0,
                   "output_tokens": 400}, "latency_s": 3.0},
        {"timestamp": "2026-12-01T10:12:00Z", "session_id": "chat-1", "model": "claude-opus-5",
         "usage": {"input_tokens": 60, "cache_creation_input_tokens": 30_500, "cache_read_input_tokens": 0,
                   "output_tokens": 300}, "latency_s": 3.1},
        {"timestamp": 1_796_119_924.0, "session_id": "chat-1", "model": "claude-opus-5",
         "usage": {"input_tokens": 70, "cache_creation_input_tokens": 400, "cache_read_input_tokens": 30_560,
                   "output_tokens": 200}, "latency_s": 1.0},
    ]
    path = tmp_path / "usage.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = load_run(path)
    assert run.source == "usage-log" and [t.input_tokens for t in run.turns] == [30_050, 30_560, 31_030]
    assert run.turns[0].pause_s == pytest.approx(717.0)  # 12 minutes after the start, less the call's 3 s
    diag = diagnose_run(run)
    cold = diag.finding("reported_cache")
    assert cold.numbers["num_cold_turns"] == 1 and cold.numbers["num_cold_after_long_pause"] == 1
    bill = price_run(run, load_prices(), "anthropic", "claude-opus-5")
    assert bill["turns"][1]["options_usd"]["1h"] < bill["turns"][1]["options_usd"]["5m"]


@pytest.mark.parametrize(("text", "problem"), [
    ('{"kind": "turn", "program_id": "p", "session_id": "s", "turn": 0, "segments": [], "colour": 1}',
     "turn record: unknown field 'colour'"),
    ('{"kind": "turn", "program_id": "p", "session_id": "s", "turn": 0, '
     '"segments": [{"block": "footer", "hash": "a", "num_tokens": 1}]}', "segments[0].block must be one of"),
    ('{"kind": "pause", "program_id": "p", "session_id": "s", "after_turn": 0, "tool": "bash", "pause_s": -1}',
     "field 'pause_s' must be a number of seconds >= 0"),
    ('{"kind": "turn", "program_id": "p", "session_id": "s", "turn": 0, "segments": []}\n{"usage": {}}',
     "expected a recorded turn like line 1"),
    ('{"kind": "turn", "program_id": "p"', "not valid JSON"),
])
def test_a_bad_line_names_file_line_and_field(tmp_path: Path, text: str, problem: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(text + "\n")
    with pytest.raises(TraceFormatError) as err:
        load_run(path)
    assert problem in str(err.value) and str(err.value).startswith(f"{path}:")
