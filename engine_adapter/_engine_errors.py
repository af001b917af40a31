"""The engine's errors; each carries the gRPC status code the node's server answers with (``code``).

Why apart from ``_engine``: hint enforcement and context moves raise them too, and the server maps them.
"""

from __future__ import annotations

__all__ = ["EngineError", "FailedPrecondition", "InvalidArgument", "NotFound", "ResourceExhausted"]


class EngineError(Exception):
    code = "INTERNAL"


class InvalidArgument(EngineError, ValueError):
    code = "INVALID_ARGUMENT"


class NotFound(EngineError, KeyError):
    code = "NOT_FOUND"

    def __str__(self) -> str:  # KeyError quotes its message otherwise
        return str(self.args[0]) if self.args else ""


class FailedPrecondition(EngineError):
    code = "FAILED_PRECONDITION"


class ResourceExhausted(EngineError):
    code = "RESOURCE_EXHAUSTED"
