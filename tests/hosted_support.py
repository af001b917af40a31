"""Stand-ins for the hosted APIs (which cannot be reached from here) and the example coding agent in its
hosted form, for the diagnose / price / prompt-builder tests.

The fake clients answer with responses shaped as the real ones record them (ids, usage objects with the
provider's own field names, tool calls), and compute the cache as the providers document it:

* ``FakeOpenAI``: automatic prefix caching.  A request's prompt is its tools and messages in order; the
  cached tokens are the longest prefix (at a block boundary) that an earlier request sent within the TTL,
  in 128-token steps, once the prompt has 1,024 tokens; ``prompt_tokens_details.cached_tokens``.
* ``FakeAnthropic``: explicit breakpoints.  Entries are written at each block carrying ``cache_control``
  (or at the end, with a top-level ``cache_control``); a request reads the longest live entry that is a
  prefix of it; ``cache_read_input_tokens``, ``cache_creation_input_tokens``, ``input_tokens`` after the
  last breakpoint.  A read refreshes the entry's TTL (5 minutes, or 1 hour when asked).

Tokens are 4 characters of each block's canonical JSON.  Time is a virtual clock: a call takes
0.2 s plus 0.1 ms per uncached token (a prefill), pauses advance it without sleeping.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from diagnose import Recorder, record_client
from workflows import PromptBuilder

MODEL_OPENAI = "gpt-5"
MODEL_ANTHROPIC = "claude-opus-5"


class Clock:
    def __init__(self, start_s: float = 1_800_000_000.0) -> None:
        self.now_s = start_s

    def __call__(self) -> float:
        return self.now_s

    def advance(self, seconds: float) -> None:
        self.now_s += seconds


def _canon(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))


def _strip(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _strip(v) for k, v in obj.items() if k not in ("cache_control", "prompt_cache_breakpoint")}
    if isinstance(obj, list):
        return [_strip(v) for v in obj]
    return obj


@dataclass
class _Piece:
    tokens: int
    chain: str  # identity of the prompt up to and including this piece
    breakpoint: str | None  # the TTL asked for at this piece ("5m", "1h"), if it carries cache_control


def _pieces(blocks: list[tuple[Any, Any]]) -> list[_Piece]:
    """(content, cache_control or None) in prompt order -> pieces with chained identities."""
    out, chain = [], ""
    for content, cc in blocks:
        text = _canon(_strip(content))
        chain = hashlib.sha256((chain + text).encode()).hexdigest()
        ttl = None if cc is None else str(cc.get("ttl", "5m"))
        out.append(_Piece(max(1, len(text) // 4), chain, ttl))
    return out


@dataclass
class _Cache:
    clock: Clock
    entries: dict[str, tuple[int, float, float]] = field(default_factory=dict)  # chain -> (tokens, expiry, ttl)

    def longest(self, pieces: list[_Piece]) -> int:
        """Index+1 of the longest live entry that prefixes these pieces (0: none); refreshes it."""
        best = 0
        for i, p in enumerate(pieces):
            e = self.entries.get(p.chain)
            if e is not None and e[1] >= self.clock.now_s:
                best = i + 1
        if best:
            tokens, _, ttl = self.entries[pieces[best - 1].chain]
            self.entries[pieces[best - 1].chain] = (tokens, self.clock.now_s + ttl, ttl)
        return best


def _reply(rng: random.Random, turn: int) -> tuple[str, str]:
    """A recorded-looking answer: some reasoning text and the tool it calls next."""
    tool = rng.choice(["bash", "read_file", "search", "run_tests"])
    return f"Turn {turn}: checking the failing test with {tool}. " + "x" * rng.randint(40, 200), tool


class FakeOpenAI:
    """An OpenAI Chat Completions stand-in with automatic prefix caching (see the module doc)."""

    def __init__(self, clock: Clock, *, ttl_s: float = 300.0, seed: int = 0) -> None:
        self.clock, self.ttl_s = clock, ttl_s
        self.cache = _Cache(clock)
        self.rng = random.Random(seed)
        self.calls = 0
        self.chat = SimpleNamespace(completions=SimpleNamespace(create=self._create))

    def _create(self, **kwargs: Any) -> Any:
        blocks = [(t, None) for t in kwargs.get("tools", [])] + [(m, None) for m in kwargs["messages"]]
        pieces = _pieces(blocks)
        total = sum(p.tokens for p in pieces)
        hit = self.cache.longest(pieces)
        cached = 0
        if total >= 1024 and hit:
            cached = (sum(p.tokens for p in pieces[:hit]) // 128) * 128
        cum = 0
        for p in pieces:  # every block boundary of this request becomes a prefix entry
            cum += p.tokens
            self.cache.entries[p.chain] = (cum, self.clock.now_s + self.ttl_s, self.ttl_s)
        self.clock.advance(0.2 + 1e-4 * (total - cached))
        self.calls += 1
        text, tool = _reply(self.rng, self.calls)
        out = len(text) // 4
        message = SimpleNamespace(role="assistant", content=text, tool_calls=[
            SimpleNamespace(id=f"call_{self.calls}", type="function",
                            function=SimpleNamespace(name=tool, arguments="{}"))])
        usage = SimpleNamespace(prompt_tokens=total, completion_tokens=out, total_tokens=total + out,
                                prompt_tokens_details=SimpleNamespace(cached_tokens=cached))
        return SimpleNamespace(id=f"chatcmpl-{self.calls}", model=kwargs.get("model", MODEL_OPENAI),
                               choices=[SimpleNamespace(index=0, message=message, finish_reason="tool_calls")],
                               usage=usage)


class FakeAnthropic:
    """An Anthropic Messages stand-in with explicit cache breakpoints (see the module doc)."""

    def __init__(self, clock: Clock, *, seed: int = 0) -> None:
        self.clock = clock
        self.cache = _Cache(clock)
        self.rng = random.Random(seed)
        self.calls = 0
        self.messages = SimpleNamespace(create=self._create)

    def _create(self, **kwargs: Any) -> Any:
        blocks: list[tuple[Any, Any]] = [(t, t.get("cache_control")) for t in kwargs.get("tools", [])]
        system = kwargs.get("system")
        if isinstance(system, str):
            blocks.append((system, None))
        for b in system if isinstance(system, list) else []:
            blocks.append((b, b.get("cache_control")))
        for m in kwargs["messages"]:
            content = m["content"] if isinstance(m["content"], list) else [{"type": "text", "text": m["content"]}]
            for b in content:
                blocks.append(({"role": m["role"], **b}, b.get("cache_control")))
        if kwargs.get("cache_control") and blocks:  # automatic caching: a breakpoint on the last block
            blocks[-1] = (blocks[-1][0], kwargs["cache_control"])
        pieces = _pieces(blocks)
        total = sum(p.tokens for p in pieces)
        hit = self.cache.longest(pieces) if total >= 1024 else 0
        read = sum(p.tokens for p in pieces[:hit])
        last_bp = max((i for i, p in enumerate(pieces) if p.breakpoint), default=-1)
        created = 0
        if total >= 1024 and last_bp >= hit:
            cum = 0
            for i, p in enumerate(pieces):
                cum += p.tokens
                if p.breakpoint and i >= hit:
                    ttl = 3600.0 if p.breakpoint == "1h" else 300.0
                    self.cache.entries[p.chain] = (cum, self.clock.now_s + ttl, ttl)
            created = sum(p.tokens for p in pieces[:last_bp + 1]) - read
        self.clock.advance(0.2 + 1e-4 * (total - read))
        self.calls += 1
        text, tool = _reply(self.rng, self.calls)
        usage = SimpleNamespace(input_tokens=total - read - created, cache_read_input_tokens=read,
                                cache_creation_input_tokens=created, output_tokens=len(text) // 4)
        content = [SimpleNamespace(type="text", text=text),
                   SimpleNamespace(type="tool_use", id=f"toolu_{self.calls}", name=tool, input={})]
        return SimpleNamespace(id=f"msg_{self.calls}", type="message", role="assistant", content=content,
                               model=kwargs.get("model", MODEL_ANTHROPIC), stop_reason="tool_use", usage=usage)


# ---- the example coding agent, hosted -----------------------------------------------------------------
def _tool(name: str, description: str, props: dict[str, str]) -> dict[str, Any]:
    return {"name": name, "description": description,
            "input_schema": {"type": "object", "properties": {k: {"type": "string", "description": v}
                                                               for k, v in props.items()},
                             "required": sorted(props)}}


TOOLS = [
    _tool("bash", "Run a shell command in the repository and return its output. " * 3, {"command": "the command"}),
    _tool("read_file", "Read a file of the repository, optionally a line range. " * 3, {"path": "file path"}),
    _tool("write_file", "Replace a file's contents with new text. " * 3, {"path": "file path", "text": "new text"}),
    _tool("search", "Search the repository for a regular expression. " * 3, {"pattern": "regex"}),
    _tool("run_tests", "Run the test suite, or one test, and report failures. " * 3, {"target": "test id"}),
    _tool("git_diff", "Show the working tree's diff against HEAD. " * 3, {"path": "optional path"}),
]
SYSTEM = ("You are a careful software engineer. You fix the failing test described by the user. Work in small "
          "steps: read the code, form a hypothesis, make the smallest change, run the tests. ") * 12
TASK = "test_parse fails with KeyError on empty input. " + "Traceback line ... " * 40


def openai_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"type": "function", "function": {"name": t["name"], "description": t["description"],
                                              "parameters": t["input_schema"]}} for t in tools]


def coding_agent(client: Any, clock: Clock, *, api: str = "openai-chat", turns: int = 10, seed: int = 0,
                 reorder_tools_at: int | None = None, shuffle_tools: bool = False,
                 builder: PromptBuilder | None = None, pause_s: tuple[float, float] = (0.2, 4.0),
                 automatic_cache: bool = True) -> None:
    """The example coding agent's loop against a hosted API: model call, tool (a pause), longer context.

    ``reorder_tools_at``: from that turn on the harness sends its tools in another order (a registry
    rebuilt mid-run); ``shuffle_tools``: a new random order every turn; ``builder``: requests built by a
    ``PromptBuilder`` instead of by hand."""
    rng = random.Random(seed)
    history: list[dict[str, Any]] = [{"role": "user", "content": TASK}]
    for turn in range(turns):
        tools = list(TOOLS)
        if shuffle_tools:
            rng.shuffle(tools)
        if reorder_tools_at is not None and turn >= reorder_tools_at:
            tools = tools[3:] + tools[:3]
        if api == "openai-chat":
            tools = openai_tools(tools)
        if builder is not None:
            kwargs = builder.build(history, tools=tools, next_tool="bash")
        elif api == "openai-chat":
            kwargs = {"model": MODEL_OPENAI, "tools": tools,
                      "messages": [{"role": "system", "content": SYSTEM}, *history]}
        else:
            kwargs = {"model": MODEL_ANTHROPIC, "max_tokens": 1024, "tools": tools, "system": SYSTEM,
                      "messages": history}
            if automatic_cache:
                kwargs["cache_control"] = {"type": "ephemeral"}
        if api != "openai-chat" and builder is not None:
            kwargs["max_tokens"] = 1024
        resp = client.chat.completions.create(**kwargs) if api == "openai-chat" else client.messages.create(**kwargs)
        text = resp.choices[0].message.content if api == "openai-chat" else resp.content[0].text
        history.append({"role": "assistant", "content": text})
        clock.advance(rng.uniform(*pause_s))  # the tool runs
        history.append({"role": "user", "content": f"tool output {turn}: " + "ok " * rng.randint(20, 120)})


def record_coding_agents(path: Any, *, runs: dict[str, dict[str, Any]], api: str = "openai-chat",
                         clock: Clock | None = None) -> Recorder:
    """Record one coding-agent program per entry of ``runs`` (program id -> ``coding_agent`` options)."""
    clock = clock or Clock()
    recorder = Recorder(path, clock=clock, otel=False)
    fake: Any = FakeOpenAI(clock) if api == "openai-chat" else FakeAnthropic(clock)  # one provider, one cache
    for i, (program_id, options) in enumerate(runs.items()):
        provider_client = record_client(fake, recorder, session_id=f"{program_id}/agent", program_id=program_id)
        coding_agent(provider_client, clock, api=api, seed=i, **options)
        clock.advance(30.0)
    recorder.close()
    return recorder
