"""hintflow: agent runtime that pushes KV-cache hints to a program-aware engine node.

This package is the command line (``hintflow.cli``, the ``hintflow`` command) and the demo. Its public
face below loads on first use, so that starting the command line imports only what a command needs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hintflow._run import make_runtime

__all__ = ["make_runtime"]


def __getattr__(name: str) -> object:
    if name != "make_runtime":
        raise AttributeError(f"module 'hintflow' has no attribute {name!r}")
    from hintflow import _run

    return _run.make_runtime
