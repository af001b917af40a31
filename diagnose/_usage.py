"""Providers' usage objects, read into one shape: prompt tokens, output tokens, cache reads, cache writes.

Each provider counts differently, and the difference matters for a cache diagnosis:

* Anthropic Messages: ``input_tokens`` are only the tokens after the last cache breakpoint;
  ``cache_read_input_tokens`` and ``cache_creation_input_tokens`` come on top.  The prompt is their sum.
* OpenAI Chat Completions: ``prompt_tokens`` is the whole prompt; ``prompt_tokens_details.cached_tokens``
  the part read from the cache (GPT-5.6 and later also report ``cache_write_tokens``).
* OpenAI Responses (and the Agents SDK's ``Usage``): ``input_tokens`` is the whole prompt;
  ``input_tokens_details.cached_tokens`` the cached part.
* vLLM's OpenAI server: as Chat/Completions, with ``prompt_tokens_details.cached_tokens`` when enabled.
* hintflow's own engine (``LLMResult``): ``num_prompt_tokens``, ``num_cached_tokens`` (+ host-tier hits).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from diagnose._records import jsonable

__all__ = ["Usage", "jsonable_usage", "normalize_usage"]


@dataclass(frozen=True, slots=True)
class Usage:
    """One call's counts in one convention: ``input_tokens`` is the whole prompt, cached tokens included."""

    provider: str  # "anthropic", "openai", "hintflow", or "" when the shape does not say
    input_tokens: int | None
    output_tokens: int | None
    cached_tokens: int | None
    cache_write_tokens: int | None


def _int(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return int(value)


def _details(usage: Mapping[str, Any], *names: str) -> Mapping[str, Any]:
    for name in names:
        d = usage.get(name)
        if isinstance(d, Mapping):
            return d
    return {}


def normalize_usage(usage: Mapping[str, Any], provider: str = "") -> Usage:
    """Read a usage object of any of the shapes in the module doc; ``provider`` breaks a tie.

    Anthropic and OpenAI Responses both say ``input_tokens``, with opposite meanings (after the last
    breakpoint, or the whole prompt): the ``cache_*_input_tokens`` keys mark Anthropic's, an
    ``input_tokens_details`` object OpenAI's; with neither, ``provider`` decides, else the whole prompt."""
    if "num_prompt_tokens" in usage:  # hintflow's LLMResult
        cached = (_int(usage.get("num_cached_tokens")) or 0) + (_int(usage.get("num_host_hit_tokens")) or 0)
        return Usage(provider or "hintflow", _int(usage.get("num_prompt_tokens")),
                     _int(usage.get("num_output_tokens")), cached, None)
    anthropic_keys = "cache_read_input_tokens" in usage or "cache_creation_input_tokens" in usage
    if anthropic_keys or (provider == "anthropic" and "prompt_tokens" not in usage):
        read = _int(usage.get("cache_read_input_tokens"))
        write = _int(usage.get("cache_creation_input_tokens"))
        after = _int(usage.get("input_tokens"))
        total = None if after is None else after + (read or 0) + (write or 0)
        return Usage("anthropic", total, _int(usage.get("output_tokens")), read or 0, write or 0)
    if "prompt_tokens" in usage:  # Chat Completions (and vLLM)
        details = _details(usage, "prompt_tokens_details")
        return Usage(provider or "openai", _int(usage.get("prompt_tokens")),
                     _int(usage.get("completion_tokens")), _int(details.get("cached_tokens")),
                     _int(details.get("cache_write_tokens", usage.get("cache_write_tokens"))))
    details = _details(usage, "input_tokens_details")
    return Usage(provider or ("openai" if details else ""), _int(usage.get("input_tokens")),
                 _int(usage.get("output_tokens")), _int(details.get("cached_tokens")),
                 _int(details.get("cache_write_tokens", usage.get("cache_write_tokens"))))


def jsonable_usage(usage: Any, provider: str = "") -> tuple[dict[str, Any], Usage] | None:
    """An SDK's usage object (pydantic model, dataclass or dict) as (plain dict, normalised), or None."""
    if usage is None:
        return None
    raw = jsonable(usage)
    if not isinstance(raw, dict):
        return None
    return raw, normalize_usage(raw, provider)
