"""The dated price file (``prices.json`` beside this module, or a user's copy): loaded and checked.

Prices change every few months and differ per model, so they are data, not code: a user edits a copy and
passes ``--prices FILE``.  A bad entry is an error that names the file and the key path
(``providers.anthropic.models.claude-opus-5.cache_read_usd_per_mtok``).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from diagnose._records import TraceFormatError

__all__ = ["DEFAULT_PRICES", "CacheOption", "ModelPrices", "PriceBook", "load_prices"]

DEFAULT_PRICES = Path(__file__).with_name("prices.json")


@dataclass(frozen=True, slots=True)
class CacheOption:
    """One way to ask a provider to cache: its name says the TTL (``5m``, ``1h``, ``30m``, ``24h``)."""

    name: str
    ttl_s: float
    refresh_on_read: bool
    available: bool = True
    request: dict[str, Any] = field(default_factory=dict)
    note: str = ""


@dataclass(frozen=True, slots=True)
class ModelPrices:
    """USD per million tokens for one model; ``write_usd_per_mtok`` per option it offers."""

    provider: str
    model: str
    input_usd_per_mtok: float
    output_usd_per_mtok: float
    read_usd_per_mtok: float
    write_usd_per_mtok: dict[str, float]
    min_cacheable_tokens: int = 0
    source: str = ""
    verified: bool = False


@dataclass(frozen=True)
class PriceBook:
    path: str
    checked: str
    options: dict[str, dict[str, CacheOption]]  # provider -> name -> option
    models: dict[str, dict[str, ModelPrices]]  # provider -> model id -> prices

    def model(self, provider: str, model: str) -> ModelPrices:
        """``model``'s prices: the exact id, else the longest listed id it starts with
        (``claude-opus-5-20260724`` is ``claude-opus-5``; ``claude-opus-5-5`` is not)."""
        table = self.models.get(provider)
        if table is None:
            raise ValueError(f"{self.path}: no provider {provider!r} (listed: {', '.join(sorted(self.models))})")
        if model in table:
            return table[model]
        matches = [m for m in table if model.startswith(m + "-") or model.startswith(m + "@")]
        if not matches:
            raise ValueError(f"{self.path}: no prices for {provider} model {model!r} "
                             f"(listed: {', '.join(sorted(table))}); add it to a copy and pass --prices")
        return table[max(matches, key=len)]

    def options_for(self, prices: ModelPrices) -> tuple[list[CacheOption], list[CacheOption]]:
        """(priced options, listed but unavailable ones) of a model, shortest TTL first."""
        known = self.options[prices.provider]
        opts = sorted((known[name] for name in prices.write_usd_per_mtok), key=lambda o: o.ttl_s)
        return [o for o in opts if o.available], [o for o in opts if not o.available]


def _number(value: Any, where: str, *, minimum: float = 0.0) -> float:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < minimum:
        raise ValueError(f"{where} must be a number >= {minimum:g}, got {value!r}")
    return float(value)


def _obj(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ValueError(f"{where} must be an object, got {type(value).__name__}")
    return value


def _parse(data: Any, path: str) -> PriceBook:
    root = _obj(data, "the file")
    checked = root.get("checked")
    if not isinstance(checked, str):
        raise ValueError(f"checked must be the date the prices were checked (YYYY-MM-DD), got {checked!r}")
    options: dict[str, dict[str, CacheOption]] = {}
    models: dict[str, dict[str, ModelPrices]] = {}
    for provider, pdata in _obj(root.get("providers"), "providers").items():
        where = f"providers.{provider}"
        pdata = _obj(pdata, where)
        options[provider] = {}
        for name, o in _obj(pdata.get("options"), f"{where}.options").items():
            ow = f"{where}.options.{name}"
            o = _obj(o, ow)
            options[provider][name] = CacheOption(
                name, _number(o.get("ttl_s"), f"{ow}.ttl_s"), bool(o.get("refresh_on_read", False)),
                bool(o.get("available", True)), dict(_obj(o.get("request", {}), f"{ow}.request")),
                str(o.get("note", "")))
        models[provider] = {}
        for model, m in _obj(pdata.get("models"), f"{where}.models").items():
            mw = f"{where}.models.{model}"
            m = _obj(m, mw)
            writes = _obj(m.get("cache_write_usd_per_mtok"), f"{mw}.cache_write_usd_per_mtok")
            for name in writes:
                if name not in options[provider]:
                    raise ValueError(f"{mw}.cache_write_usd_per_mtok.{name}: no option {name!r} in "
                                     f"{where}.options ({', '.join(sorted(options[provider]))})")
            minimum = m.get("min_cacheable_tokens", 0)
            if type(minimum) is not int or minimum < 0:
                raise ValueError(f"{mw}.min_cacheable_tokens must be an integer >= 0, got {minimum!r}")
            models[provider][model] = ModelPrices(
                provider, model, _number(m.get("input_usd_per_mtok"), f"{mw}.input_usd_per_mtok"),
                _number(m.get("output_usd_per_mtok"), f"{mw}.output_usd_per_mtok"),
                _number(m.get("cache_read_usd_per_mtok"), f"{mw}.cache_read_usd_per_mtok"),
                {k: _number(v, f"{mw}.cache_write_usd_per_mtok.{k}") for k, v in writes.items()},
                minimum, str(m.get("source", "")), bool(m.get("verified", False)))
    return PriceBook(path, checked, options, models)


def load_prices(path: str | os.PathLike[str] | None = None) -> PriceBook:
    """The price file at ``path`` (default: the bundled, dated one); ``TraceFormatError`` naming the key."""
    path = str(path or DEFAULT_PRICES)
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as e:
        raise TraceFormatError(path, 0, f"cannot read: {e.strerror or e}") from None
    except json.JSONDecodeError as e:
        raise TraceFormatError(path, e.lineno, f"not valid JSON ({e.msg} at column {e.colno})") from None
    try:
        return _parse(data, path)
    except ValueError as e:
        raise TraceFormatError(path, 0, str(e)) from None
