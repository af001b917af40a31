"""The hosted-API side of hintflow: recording a program's turns, diagnosing the loop, pricing the pauses.

Teams on a hosted model cannot pin KV, but they choose the cache TTL, keep early prompt blocks stable or
break them, and pay for every cold prefill.  This package records each turn as hashes and counts (never
text unless asked), answers where reuse was lost and why, and prices each cache option against the run's
own pauses.  See docs/hosted-apis.md.

    rec = Recorder("run.jsonl")
    client = record_client(anthropic.Anthropic(), rec, session_id="fix-1")
    ...
    report = diagnose_run(load_run("run.jsonl"))
    bill = price_run(load_run("run.jsonl"), load_prices(), "anthropic", "claude-opus-5")

Imports nothing of ours but ``predictors`` (and ``replay``, only to read a replay trace); never Temporal,
torch or vLLM, so a plain client script can record.
"""

from typing import TYPE_CHECKING

from diagnose._advice import TTLAdvisor
from diagnose._bill import price_run, render_price
from diagnose._client import record_client
from diagnose._price import (
    CostModel,
    PriceTurn,
    Step,
    fixed_bill,
    predicted_bill,
    price_turns,
    recommended_bill,
)
from diagnose._prices import DEFAULT_PRICES, CacheOption, ModelPrices, PriceBook, load_prices
from diagnose._readers import Run, load_run, records_to_run
from diagnose._record import Recorder, prompt_segments, strip_cache_markers, token_segments
from diagnose._records import (
    FORMAT,
    PauseRecord,
    Segment,
    TraceFormatError,
    TurnRecord,
    WarningRecord,
    canonical_json,
    common_prefix,
    estimate_tokens,
    segment_hash,
)
from diagnose._usage import Usage, jsonable_usage, normalize_usage

if TYPE_CHECKING:
    from diagnose._cli import diagnose_command, price_command, render_diagnosis
    from diagnose._diagnose import QUESTIONS, Diagnosis, Finding, diagnose_run
    from diagnose._report_html import render_html, write_html

__all__ = [
    "DEFAULT_PRICES",
    "FORMAT",
    "QUESTIONS",
    "CacheOption",
    "CostModel",
    "Diagnosis",
    "Finding",
    "ModelPrices",
    "PauseRecord",
    "PriceBook",
    "PriceTurn",
    "Recorder",
    "Run",
    "Segment",
    "Step",
    "TTLAdvisor",
    "TraceFormatError",
    "TurnRecord",
    "Usage",
    "WarningRecord",
    "canonical_json",
    "common_prefix",
    "diagnose_command",
    "diagnose_run",
    "estimate_tokens",
    "fixed_bill",
    "jsonable_usage",
    "load_prices",
    "load_run",
    "normalize_usage",
    "predicted_bill",
    "price_command",
    "price_run",
    "price_turns",
    "prompt_segments",
    "recommended_bill",
    "record_client",
    "records_to_run",
    "render_diagnosis",
    "render_html",
    "render_price",
    "segment_hash",
    "strip_cache_markers",
    "token_segments",
    "write_html",
]

# The diagnosis, its report (matplotlib) and the commands (click, rich) load on first use, so that a
# client script that only records imports none of them.  name -> module
_LAZY = {
    **dict.fromkeys(("diagnose_command", "price_command", "render_diagnosis"), "diagnose._cli"),
    **dict.fromkeys(("QUESTIONS", "Diagnosis", "Finding", "diagnose_run"), "diagnose._diagnose"),
    **dict.fromkeys(("render_html", "write_html"), "diagnose._report_html"),
}


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'diagnose' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
