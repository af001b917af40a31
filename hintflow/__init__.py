"""hintflow: agent runtime that pushes KV-cache hints to a program-aware engine node.

This package is the command line (``hintflow.cli``, the ``hintflow`` command) and the demo. Its public
face below loads on first use, so that starting the command line imports only what a command needs.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hintflow._demo import DemoConfig, run_mode
    from hintflow._run import local_temporal, make_runtime

__all__ = ["DemoConfig", "local_temporal", "make_runtime", "run_mode"]

_HOME = {
    "DemoConfig": "hintflow._demo",
    "run_mode": "hintflow._demo",
    "local_temporal": "hintflow._run",
    "make_runtime": "hintflow._run",
}


def __getattr__(name: str) -> object:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module 'hintflow' has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)
