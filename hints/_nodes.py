"""How the orchestrator names an engine node: an embedded gRPC node, or a vLLM node (HTTP + hint service).

Two kinds of node serve turns, and every name in a runtime's engine list (``HintRuntime(engines=...)``,
``hintflow worker --engines``, ``hintflow run --engines``) says which::

    HOST:PORT                                   an embedded node (engine_adapter): Generate, PushHints,
                                                WatchCacheState, all on one gRPC port
    vllm+http://HOST:PORT?hints=HOST:PORT        a vLLM node (hintflow engine serve --backend vllm):
    vllm+http://HOST:PORT?hints=HOST:PORT&model=NAME    turns go to vLLM's OpenAI server at
                                                http://HOST:PORT (/v1/completions), hints and cache
                                                state to its hint service's gRPC port ``hints=``

``model`` is the ``model`` field of the OpenAI requests; without it the server's default model is used
(vLLM serves the first ``--served-model-name`` then). The hint address is required: it is where the router
learns what the node holds, so a vLLM node without one could be sent turns but never be chosen well.
A stock vLLM with the KV-event sidecar (``_kv_events.py``) works too: ``hints=`` names the sidecar.

Plain Python, no grpc import: the command line validates names with it before starting anything.
"""

from __future__ import annotations

import urllib.parse
from dataclasses import dataclass

__all__ = ["VLLM_SCHEME", "EngineSpec", "parse_engine"]

VLLM_SCHEME = "vllm+http"


def _host_port(text: str, what: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{what} {text!r} is not HOST:PORT")
    return host, int(port)


@dataclass(frozen=True, slots=True)
class EngineSpec:
    """One engine node: where its gRPC hint service is, and (vLLM nodes) where its OpenAI server is.

    ``name`` is the canonical form of the spec; the runtime keys its router, clients and reports by it.
    """

    hint_address: str  # gRPC HOST:PORT: PushHints and WatchCacheState (and Generate on an embedded node)
    http_base: str = ""  # "http://HOST:PORT" of a vLLM node's OpenAI server; "" for an embedded node
    model: str = ""  # the OpenAI requests' model ("" : the server's default)

    def __post_init__(self) -> None:
        _host_port(self.hint_address, "hint address")
        if self.model and not self.http_base:
            raise ValueError("a model name only applies to a vLLM node (vllm+http://...)")
        if self.http_base:
            u = urllib.parse.urlsplit(self.http_base)
            if u.scheme != "http" or not u.hostname or u.port is None or u.path not in ("", "/"):
                raise ValueError(f"vLLM server address {self.http_base!r} is not http://HOST:PORT")

    @property
    def is_vllm(self) -> bool:
        return bool(self.http_base)

    @property
    def name(self) -> str:
        if not self.is_vllm:
            return self.hint_address
        params = {"hints": self.hint_address} | ({"model": self.model} if self.model else {})
        return f"vllm+{self.http_base.rstrip('/')}?{urllib.parse.urlencode(params, safe=':/')}"

    def __str__(self) -> str:
        return self.name


def parse_engine(text: str | EngineSpec) -> EngineSpec:
    """``HOST:PORT`` or ``vllm+http://HOST:PORT?hints=HOST:PORT[&model=NAME]``; ValueError saying what is wrong."""
    if isinstance(text, EngineSpec):
        return text
    text = text.strip()
    if "://" not in text:
        _host_port(text, "engine address")
        return EngineSpec(text)
    u = urllib.parse.urlsplit(text)
    if u.scheme != VLLM_SCHEME:
        raise ValueError(
            f"engine {text!r}: unknown scheme {u.scheme!r}; use HOST:PORT (embedded node) or "
            f"{VLLM_SCHEME}://HOST:PORT?hints=HOST:PORT (vLLM node)"
        )
    if u.path not in ("", "/") or u.fragment:
        raise ValueError(
            f"engine {text!r}: a vLLM node is {VLLM_SCHEME}://HOST:PORT?hints=HOST:PORT, no path"
        )
    try:
        query = urllib.parse.parse_qs(u.query, keep_blank_values=True, strict_parsing=bool(u.query))
    except ValueError:
        raise ValueError(f"engine {text!r}: bad query {u.query!r}") from None
    unknown = sorted(set(query) - {"hints", "model"})
    if unknown:
        raise ValueError(f"engine {text!r}: unknown parameter(s) {', '.join(unknown)} (known: hints, model)")
    if any(len(v) > 1 for v in query.values()):
        raise ValueError(f"engine {text!r}: a parameter is given twice")
    hints = query.get("hints", [""])[0]
    if not hints:
        raise ValueError(
            f"engine {text!r}: a vLLM node needs its hint service, ?hints=HOST:PORT "
            "(the --hint-port of hintflow engine serve --backend vllm)"
        )
    if "@" in u.netloc:
        raise ValueError(f"engine {text!r}: no user or password in a vLLM node's address")
    _host_port(u.netloc, f"engine {text!r}: vLLM server")
    _host_port(hints, f"engine {text!r}: hints")
    return EngineSpec(hints, f"http://{u.netloc}", query.get("model", [""])[0])
