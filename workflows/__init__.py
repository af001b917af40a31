"""hintflow's Temporal SDK: helpers for workflow code and the plugin that connects a worker to engine nodes.

Workflow code (runs in the sandbox; imports nothing heavy)::

    from workflows import llm, tool, session, pause

Worker/client side::

    from workflows import HintflowPlugin
    client = await Client.connect(address, plugins=[HintflowPlugin(engines=["host:port"])])

Worker-side names are loaded on first use so that workflow code never imports grpc.  ``PromptBuilder``
(stable prompts and cache breakpoints for hosted APIs, ``_prompt``) is one of them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from workflows._api import (
    DEFAULT_HEARTBEAT_TIMEOUT,
    MIN_HEARTBEAT_TIMEOUT,
    LLMInput,
    LLMResult,
    PauseInput,
    ProgramEndInput,
    ToolInput,
    ToolResult,
    current_session,
    decode_text,
    encode_text,
    llm,
    pause,
    session,
    tool,
)

if TYPE_CHECKING:
    from workflows._plugin import HintflowActivities, HintflowInterceptor, HintflowPlugin
    from workflows._prompt import PromptBuilder
    from workflows._publisher import HintPublisher
    from workflows._runtime import EngineUnavailable, HintRuntime, InvalidPrompt, ProgramStats, turn_client

_LAZY = {
    "HintflowPlugin": "workflows._plugin",
    "HintflowInterceptor": "workflows._plugin",
    "HintflowActivities": "workflows._plugin",
    "HintRuntime": "workflows._runtime",
    "ProgramStats": "workflows._runtime",
    "EngineUnavailable": "workflows._runtime",
    "InvalidPrompt": "workflows._runtime",
    "turn_client": "workflows._runtime",
    "HintPublisher": "workflows._publisher",
    "PromptBuilder": "workflows._prompt",
}

__all__ = [
    "DEFAULT_HEARTBEAT_TIMEOUT",
    "MIN_HEARTBEAT_TIMEOUT",
    "EngineUnavailable",
    "HintPublisher",
    "HintRuntime",
    "HintflowActivities",
    "HintflowInterceptor",
    "HintflowPlugin",
    "InvalidPrompt",
    "LLMInput",
    "LLMResult",
    "PauseInput",
    "ProgramEndInput",
    "ProgramStats",
    "PromptBuilder",
    "ToolInput",
    "ToolResult",
    "current_session",
    "decode_text",
    "encode_text",
    "llm",
    "pause",
    "session",
    "tool",
    "turn_client",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'workflows' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
