"""``PromptBuilder``: requests whose early blocks stay byte-stable across turns, with cache breakpoints.

A provider's prompt cache is a prefix match on the request as serialised: tools, then system, then the
messages.  One tool list in another order, one timestamp in the system prompt, one re-serialised dict,
and every token after it is written (and billed) again.  The builder

* orders stable content first: tools (sorted by name), system, then the history as given;
* serialises deterministically: every tool schema and message goes through canonical JSON (sorted keys),
  so the bytes do not depend on how the harness built its dicts;
* places breakpoints: Anthropic ``cache_control`` on the tools, the system prompt, the newest message and
  the previous turn's newest message (a breakpoint looks back at most 20 blocks), with the TTL a
  ``TTLAdvisor`` picks from the pause predictor (or a fixed one); OpenAI ``prompt_cache_key`` per session,
  the retention option of the model's generation (``prompt_cache_retention`` before GPT-5.6,
  ``prompt_cache_options`` from it) and, on GPT-5.6 and later, ``prompt_cache_breakpoint`` blocks;
* warns, in the log and in the recording, when an early block (tools, system) or an already-sent message
  changes between turns: that is a cold prefill the application chose.

It returns the keyword arguments of ``messages.create`` (Anthropic), ``chat.completions.create`` or
``responses.create`` (OpenAI); the request itself is the caller's (or ``diagnose.record_client``'s).  With
the OpenAI Agents SDK, ``agents_model_settings()`` gives ``ModelSettings`` arguments and ``order_tools``
sorts an agent's tools.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from typing import Any, Literal

from diagnose import Recorder, TTLAdvisor, canonical_json, segment_hash, strip_cache_markers

__all__ = ["PromptBuilder"]

logger = logging.getLogger(__name__)

Api = Literal["anthropic", "openai-chat", "openai-responses"]
ANTHROPIC_MAX_BREAKPOINTS = 4
_EXPLICIT = {"mode": "explicit"}


def _canonical(obj: Any) -> Any:
    """``obj`` rebuilt from its canonical JSON: dicts in sorted key order, so any JSON encoder that keeps
    insertion order (every SDK does) writes the same bytes for the same content."""
    return json.loads(canonical_json(obj))


def _tool_name(tool: Any) -> str:
    if isinstance(tool, dict):
        fn = tool.get("function")
        return str(tool.get("name") or (fn.get("name") if isinstance(fn, dict) else "") or "")
    return str(getattr(tool, "name", ""))


def _blocks(content: Any, text_type: str) -> list[dict[str, Any]]:
    """Message content as a list of blocks (a string becomes one text block), so a breakpoint can sit on
    its last block and the message's form never changes between turns."""
    if isinstance(content, str):
        return [{"type": text_type, "text": content}]
    return [dict(b) for b in content] if isinstance(content, list) else [{"type": text_type, "text": str(content)}]


class PromptBuilder:
    """One session's request builder.  ``ttl`` is an option name (``5m``, ``1h``, ``30m``, ``24h``),
    ``"auto"`` (ask ``advisor``, a ``diagnose.TTLAdvisor``), or None: the provider's default (no TTL field
    sent).  ``recorder`` receives the warnings."""

    def __init__(self, *, tools: Sequence[Any] = (), system: str | list[Any] = "", api: Api = "anthropic",
                 model: str = "", ttl: str | None = None, advisor: TTLAdvisor | None = None,
                 recorder: Recorder | None = None, program_id: str = "", session_id: str = "session",
                 cache_key: str | None = None, explicit_breakpoints: bool | None = None,
                 count_tokens: Callable[[Any], int] | None = None) -> None:
        if ttl == "auto" and advisor is None:
            raise ValueError("ttl='auto' needs an advisor (diagnose.TTLAdvisor)")
        self.tools, self.system, self.api, self.model = list(tools), system, api, model
        self.ttl, self.advisor, self.recorder = ttl, advisor, recorder
        self.program_id, self.session_id = program_id or session_id, session_id
        self.cache_key = cache_key or (f"{program_id}/{session_id}" if program_id else session_id)
        self.explicit_breakpoints = (model.startswith("gpt-5.6") or model.startswith("gpt-6")
                                     if explicit_breakpoints is None else explicit_breakpoints)
        self.count_tokens = count_tokens or (lambda obj: max(1, len(canonical_json(obj)) // 4))
        self.turn = 0
        self.warnings: list[str] = []
        self._early: dict[str, str] = {}  # block -> hash sent last turn
        self._sent: list[str] = []  # hashes of the messages sent last turn
        self._last_prompt_tokens = 0

    # ---- the request ---------------------------------------------------------------------------------------
    def build(self, history: Sequence[Any], *, tools: Sequence[Any] | None = None, system: Any = None,
              next_tool: str | None = None) -> dict[str, Any]:
        """The request for this turn.  ``tools``/``system`` replace the builder's (in any order: tools are
        sorted); ``next_tool`` is the pause expected after this call, for the TTL advice."""
        tool_list = sorted((_canonical(t) for t in (self.tools if tools is None else tools)), key=_tool_name)
        system_value = _canonical(self.system if system is None else system)
        messages = [_canonical(m) for m in history]
        previous_len = len(self._sent)  # where the previous request ended (its entry is what we hope to read)
        self._check(tool_list, system_value, messages)
        option = self._option(tool_list, system_value, messages, next_tool)
        if self.api == "anthropic":
            request = self._anthropic(tool_list, system_value, messages, option, previous_len - 1)
        else:
            request = self._openai(tool_list, system_value, messages, option)
        self.turn += 1
        return request

    def _option(self, tools: list[Any], system: Any, messages: list[Any],
                next_tool: str | None) -> tuple[str, dict[str, Any]]:
        """(name, request fields) of the cache option for this request."""
        if self.ttl is None:
            return "", {}
        if self.ttl != "auto":
            if self.advisor is not None and self.ttl in self.advisor.costs.options:
                return self.ttl, self.advisor.costs.options[self.ttl].request
            return self.ttl, {}
        assert self.advisor is not None
        prompt = self.count_tokens([tools, system, messages])
        option = self.advisor.choose(prompt, min(self._last_prompt_tokens, prompt), next_tool)
        self._last_prompt_tokens = prompt
        return option.name, option.request

    def _anthropic(self, tools: list[Any], system: Any, messages: list[Any],
                   option: tuple[str, dict[str, Any]], previous_end: int) -> dict[str, Any]:
        name, fields = option
        # the price file's request fields for the option; without one, "1h" asks for it and anything else
        # is the default ephemeral (5-minute) entry
        cache_control = fields.get("cache_control") or (
            {"type": "ephemeral", "ttl": "1h"} if name == "1h" else {"type": "ephemeral"})
        budget = ANTHROPIC_MAX_BREAKPOINTS
        request: dict[str, Any] = {"model": self.model} if self.model else {}
        if tools:
            tools[-1] = {**tools[-1], "cache_control": cache_control}
            budget -= 1
            request["tools"] = tools
        if system:
            blocks = _blocks(system, "text")
            blocks[-1]["cache_control"] = cache_control
            budget -= 1
            request["system"] = blocks
        messages = [{**m, "content": _blocks(m.get("content", ""), "text")} if isinstance(m, dict) else m
                    for m in messages]
        marks = [len(messages) - 1]
        # A breakpoint finds an earlier entry only within 20 blocks before it: when this turn appended more
        # than that, mark where the previous request ended too, so its entry is still read.
        blocks_since = sum(len(m["content"]) for m in messages[max(previous_end, 0) + 1:] if isinstance(m, dict))
        if 0 <= previous_end < len(messages) - 1 and blocks_since >= 20:
            marks.append(previous_end)
        for i in marks[:budget]:
            if i >= 0 and isinstance(messages[i], dict) and messages[i]["content"]:
                messages[i]["content"][-1] = {**messages[i]["content"][-1], "cache_control": cache_control}
        request["messages"] = messages
        return request

    def _openai(self, tools: list[Any], system: Any, messages: list[Any],
                option: tuple[str, dict[str, Any]]) -> dict[str, Any]:
        _, fields = option
        request: dict[str, Any] = {"model": self.model} if self.model else {}
        responses = self.api == "openai-responses"
        text_type = "input_text" if responses else "text"
        if tools:
            request["tools"] = tools
        if self.explicit_breakpoints:
            messages = [self._mark(m, text_type) if i == len(messages) - 1 else m for i, m in enumerate(messages)]
        if system:
            content = _blocks(system, text_type) if self.explicit_breakpoints else system
            sys_message: dict[str, Any] = {"role": "developer" if responses else "system", "content": content}
            if self.explicit_breakpoints:
                sys_message = self._mark(sys_message, text_type)
            if responses and not self.explicit_breakpoints:
                request["instructions"] = system
            else:
                messages = [sys_message, *messages]
        request["input" if responses else "messages"] = messages
        request["prompt_cache_key"] = self.cache_key
        request.update(_canonical(fields))
        return request

    @staticmethod
    def _mark(message: Any, text_type: str) -> Any:
        """A GPT-5.6 explicit breakpoint on the message's last block (not on assistant output: refused)."""
        if not isinstance(message, dict) or message.get("role") == "assistant":
            return message
        blocks = _blocks(message.get("content", ""), text_type)
        blocks[-1] = {**blocks[-1], "prompt_cache_breakpoint": _EXPLICIT}
        return {**message, "content": blocks}

    # ---- the change detector ---------------------------------------------------------------------------
    def _check(self, tools: list[Any], system: Any, messages: list[Any]) -> None:
        early = {"tools": segment_hash(strip_cache_markers(tools)), "system": segment_hash(strip_cache_markers(system))}
        for block, h in early.items():
            before = self._early.get(block)
            if before is not None and before != h:
                self._warn(block, f"the {block} block changed at turn {self.turn}: every token after it is "
                           "written again (a cold prefill the application chose)")
        sent = [segment_hash(strip_cache_markers(m)) for m in messages]
        changed = next((i for i, (a, b) in enumerate(zip(self._sent, sent, strict=False)) if a != b), None)
        if changed is not None or len(sent) < len(self._sent):
            index = changed if changed is not None else len(sent)
            self._warn("message", f"history message {index} changed or was dropped at turn {self.turn}: "
                       "the cache is lost from there on")
        self._early, self._sent = early, sent

    def _warn(self, block: str, message: str) -> None:
        self.warnings.append(message)
        logger.warning("session %s: %s", self.session_id, message)
        if self.recorder is not None:
            self.recorder.warn(self.program_id, self.session_id, self.turn, block, message)

    # ---- the OpenAI Agents SDK -----------------------------------------------------------------------------
    def agents_model_settings(self, next_tool: str | None = None, prompt_tokens: int = 0) -> dict[str, Any]:
        """Keyword arguments for ``agents.ModelSettings``: the retention option and the cache key (the SDK
        builds the request itself; order its tools with :meth:`order_tools`)."""
        fields: dict[str, Any] = {}
        if self.ttl == "auto" and self.advisor is not None:
            fields = dict(self.advisor.choose(max(1, prompt_tokens), 0, next_tool).request)
        elif self.advisor is not None and self.ttl in self.advisor.costs.options:
            fields = dict(self.advisor.costs.options[self.ttl].request)
        settings: dict[str, Any] = {"extra_args": {"prompt_cache_key": self.cache_key}}
        if "prompt_cache_retention" in fields:
            settings["prompt_cache_retention"] = fields.pop("prompt_cache_retention")
        settings["extra_args"].update(fields)
        return settings

    @staticmethod
    def order_tools(tools: Sequence[Any]) -> list[Any]:
        """An agent's tools (dicts, or objects with ``.name`` such as the Agents SDK's) sorted by name."""
        return sorted(tools, key=_tool_name)
