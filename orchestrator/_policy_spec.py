"""A hint policy and its options as one string, ``NAME[:KEY=VALUE,...]``, so what an operator tunes on a
replay is what a worker then runs:

    hintflow replay --variant 'eager=hintflow:policy.rel_change=0.02' -p hintflow,eager
    hintflow worker --policy 'hintflow:rel_change=0.02'

The options are the knobs every registered policy shares (:data:`POLICY_OPTIONS`): how eagerly eviction
orders are re-sent, how early pins are renewed, and the pause model's cold start.  Each is checked on
parse: an unknown key lists the known ones, a bad value names its key and what it accepts.  A spec builds
its policy with :meth:`PolicySpec.build`; ``orchestrator.get_policy`` takes a spec string wherever it takes
a name.  Plain Python: no Temporal, gRPC, torch or engine import.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["POLICY_OPTIONS", "Option", "PolicySpec", "parse_options", "parse_policy_spec", "parse_value"]

Scalar = int | float | bool | str | None


@dataclass(frozen=True, slots=True)
class Option:
    """One tunable: its type, the smallest value it accepts (``min_open``: strictly above), and whether
    ``none`` is allowed (it then means "the built-in default")."""

    kind: type
    doc: str
    minimum: float | None = None
    min_open: bool = False
    nullable: bool = False
    choices: tuple[str, ...] = ()


POLICY_OPTIONS: dict[str, Option] = {
    "rel_change": Option(float, "re-send a session's predicted next use only when it moved by more than "
                                "this fraction (default 0.1)", minimum=0.0),
    "min_change_s": Option(float, "... and only when it moved by more than this many seconds (default 0.0)",
                           minimum=0.0),
    "renew_ahead_s": Option(float, "renew a pin this many seconds before its lease lapses (default: the "
                                   "policy's; the live runtime uses 5 ticks)", minimum=0.0, nullable=True),
    "backlog_floor": Option(bool, "price a pin with Continuum's T at least the wait behind the nodes' prefill "
                                  "backlog, as the vLLM node's own inference does (hintflow only; default true)"),
    "queue_delay": Option(bool, "price a pin with Continuum's queueing term T as well as the re-prefill, for "
                                "the share of a context the nodes lose (with a host tier: what it does not "
                                "give back) (hintflow only; default true; false: the re-prefill alone, "
                                "which wins where memory is what every turn queues for)"),
    "measured_price": Option(bool, "with no host tier, price a pin by what the nodes measure (the prefill share "
                                   "of their step time, what they keep of unpinned contexts, the pool share it "
                                   "holds) instead of Continuum's T (hintflow only; default true; false: "
                                   "queue_delay and memory_share decide)"),
    "memory_share": Option(bool, "price a pin by the share of the device pool it holds, not as if it held "
                                 "the whole pool (hintflow only; default false: Continuum's cost)"),
    "pause.min_samples": Option(int, "pauses a tool needs before its own distribution is used; before "
                                     "that, all tools' together, then the default (default 100)", minimum=1),
    "pause.default_mean_s": Option(float, "mean of the cold-start exponential pause (default 1.0)",
                                   minimum=0.0, min_open=True),
    "pause.capacity": Option(int, "most recent pauses kept per tool (default 2000)", minimum=1),
}
"""Options every registered hint policy takes (``_BasePolicy`` keywords and ``pause.*``: ``PauseModel``)."""

_TRUE, _FALSE = ("true", "yes", "on", "1"), ("false", "no", "off", "0")


def parse_value(key: str, raw: str, option: Option) -> Scalar:
    """``raw`` as ``option``'s type; ``ValueError`` naming ``key`` and what it accepts otherwise."""
    text = raw.strip()
    if option.nullable and text.lower() in ("none", "null"):
        return None
    kind = option.kind
    what = {int: "an integer", float: "a finite number", bool: "true or false", str: "a string"}[kind]
    value: Scalar
    try:
        if kind is bool:
            if text.lower() not in _TRUE + _FALSE:
                raise ValueError
            value = text.lower() in _TRUE
        elif kind is int:
            value = int(text)
        elif kind is float:
            value = float(text)
            if not math.isfinite(value):
                raise ValueError
        else:
            value = text
    except ValueError:
        raise ValueError(f"{key}={raw!r}: expected {what}{' or none' if option.nullable else ''}") from None
    if option.choices and value not in option.choices:
        raise ValueError(f"{key}={raw!r}: expected one of {', '.join(option.choices)}")
    lo = option.minimum
    if lo is not None and isinstance(value, int | float) and not isinstance(value, bool) and (
        value < lo or (option.min_open and value == lo)
    ):
        bound = f"> {lo:g}" if option.min_open else f">= {lo:g}"
        raise ValueError(f"{key}={raw!r}: must be {bound}")
    return value


def parse_options(text: str, options: Mapping[str, Option], where: str) -> tuple[tuple[str, Scalar], ...]:
    """``KEY=VALUE,...`` checked against ``options``; in the order given, a repeated key is an error."""
    out: dict[str, Scalar] = {}
    for item in (p for p in text.split(",") if p.strip()):
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep:
            raise ValueError(f"{where}: {item.strip()!r} is not KEY=VALUE")
        option = options.get(key)
        if option is None:
            raise ValueError(f"{where}: unknown option {key!r}; known: {', '.join(options)}")
        if key in out:
            raise ValueError(f"{where}: option {key!r} given twice")
        try:
            out[key] = parse_value(key, raw, option)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
    return tuple(out.items())


@dataclass(frozen=True, slots=True)
class PolicySpec:
    """A registered policy's name and the options it is built with (``str()`` gives the spec back)."""

    name: str
    options: tuple[tuple[str, Scalar], ...] = ()

    def __str__(self) -> str:
        opts = ",".join(f"{k}={'none' if v is None else v}" for k, v in self.options)
        return f"{self.name}:{opts}" if opts else self.name

    def build(self, factories: Mapping[str, Callable[..., Any]], **kw: Any) -> Any:
        """The policy, built with the caller's keywords (``prefill_reload=`` ...) and this spec's options on
        top: an option the operator set wins over the caller's default for it (``renew_ahead_s``)."""
        factory = factories.get(self.name)
        if factory is None:
            raise ValueError(f"unknown policy {self.name!r}; known policies: {', '.join(sorted(factories))}")
        pause: dict[str, Any] = {k.removeprefix("pause."): v for k, v in self.options if k.startswith("pause.")}
        if pause:
            if kw.get("pause_model") is not None:
                raise ValueError(f"policy {self}: pause.* options and a pause_model object both given")
            from predictors import PauseModel

            kw["pause_model"] = PauseModel(**pause)
        kw.update((k, v) for k, v in self.options if not k.startswith("pause."))
        return factory(**kw)


def parse_policy_spec(text: str, known: Mapping[str, object]) -> PolicySpec:
    """``NAME[:KEY=VALUE,...]`` with NAME in ``known``; ``ValueError`` naming what is wrong otherwise."""
    name, _, opts = text.strip().partition(":")
    name = name.strip()
    if name not in known:
        raise ValueError(f"unknown policy {name!r}; known policies: {', '.join(sorted(known))}")
    return PolicySpec(name, parse_options(opts, POLICY_OPTIONS, f"policy {text.strip()!r}"))
