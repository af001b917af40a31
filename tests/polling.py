"""Waiting helpers the tests share: poll a condition until it holds, and a free loopback port."""

from __future__ import annotations

import asyncio
import inspect
import socket
import time
from collections.abc import Awaitable, Callable

__all__ = ["free_port", "until"]


async def until(
    cond: Callable[[], Awaitable[bool] | bool], timeout_s: float = 10.0, what: str = "the condition"
) -> float:
    """Poll ``cond`` (plain or async) every 50 ms until it holds; the monotonic time it first did.  Fails
    the test, naming ``what``, when it has not within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = cond()
        if inspect.isawaitable(got):
            got = await got
        if got:
            return time.monotonic()
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s} s"
        await asyncio.sleep(0.05)


def free_port() -> int:
    """A loopback port free now (the OS may hand it out again: bind it soon)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port
