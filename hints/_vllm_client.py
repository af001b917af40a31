"""Run one turn on a vLLM node through its OpenAI-compatible ``/v1/completions``, like ``EngineClient.generate``.

A vLLM node (``hintflow engine serve --backend vllm``) takes requests on vLLM's own HTTP server; its hint
service answers ``Generate`` with UNIMPLEMENTED. So the runtime sends a vLLM node's turns here: the prompt
as token ids, ``stream: true`` (time to first token is the first streamed token), the session in vLLM's
``session_id`` field and the program in ``vllm_xargs.program_id`` (what hintflow's scheduler maps hints
by), ``max_tokens``, greedy, ``ignore_eos`` (an embedded node also runs every turn to ``max_new_tokens``:
the runtime has no stop tokens), and ``return_token_ids`` so the output comes back as token ids.
The result is the embedded path's :class:`GenerateResult`: output tokens, prompt tokens, cached prompt
tokens from the final usage chunk's ``prompt_tokens_details.cached_tokens`` (the server needs
``--enable-prompt-tokens-details``, which ``hintflow engine serve --backend vllm`` passes; without it 0),
the client-side time to first token and, when the server runs with ``--enable-per-request-metrics``, its
queue time. vLLM reports neither host-tier hits nor recomputed tokens: both are 0.

Errors say what the runtime should do: :class:`VllmUnreachable` (no connection, the connection lost
mid-turn, HTTP 503): try another node; :class:`VllmRejected` (HTTP 400/413/422, or a streamed error with
such a code, e.g. a token id outside the vocabulary, which vLLM finds only once the stream has started):
a bad prompt, retrying cannot help; :class:`VllmFailed`: anything else (HTTP 500, an unknown model).

Why threads and ``http.client``: the main environment has no async HTTP client. Each call holds a thread of
the client's own pool (not asyncio's default one, which has 6 threads on 2 cores and would queue turns);
cancelling the call shuts the socket down, so the thread ends and vLLM sees the disconnect and aborts the
request. Imports nothing of ours but :class:`GenerateResult`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import http.client
import json
import socket
import threading
import time
import urllib.parse
from collections.abc import Sequence
from typing import Any

from hints._client import GenerateResult

__all__ = ["VllmClient", "VllmError", "VllmFailed", "VllmRejected", "VllmUnreachable"]

_REJECTED = frozenset({400, 413, 422})


class VllmUnreachable(ConnectionError):
    """The node could not be reached, dropped the connection, or said it is unavailable (503)."""


class VllmError(Exception):
    """The node answered with an error: ``status`` (HTTP, or the streamed error's code) and its message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status, self.message = status, message


class VllmRejected(VllmError, ValueError):
    """The node refused the request as bad (a prompt too long, a token id outside the vocabulary, ...)."""


class VllmFailed(VllmError, RuntimeError):
    """Any other error the node answered with (an internal error, an unknown model)."""


def _error(status: int, message: str) -> Exception:
    if status in _REJECTED:
        return VllmRejected(status, message)
    if status == 503:
        return VllmUnreachable(f"HTTP 503: {message}")
    return VllmFailed(status, message)


def _error_message(payload: bytes) -> str:
    """vLLM's ``{"error": {"message": ...}}``, FastAPI's ``{"detail": ...}``, else the text itself."""
    try:
        doc = json.loads(payload)
    except ValueError:
        return payload.decode("utf-8", "replace").strip()[:500]
    if isinstance(doc, dict):
        err = doc.get("error")
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
        if "detail" in doc:
            return str(doc["detail"])
    return str(doc)[:500]


class _Call:
    """One request's connection, so that the event loop can abort the thread reading it."""

    def __init__(self) -> None:
        self.conn: http.client.HTTPConnection | None = None
        self.cancelled = False
        self._lock = threading.Lock()

    def attach(self, conn: http.client.HTTPConnection) -> None:
        with self._lock:
            self.conn = conn
            if self.cancelled:
                raise VllmUnreachable("the call was cancelled")

    def abort(self) -> None:
        with self._lock:
            self.cancelled = True
            sock = self.conn.sock if self.conn is not None else None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)


class VllmClient:
    """Turns for the vLLM OpenAI server at ``base_url`` (``http://HOST:PORT``); ``model`` "" = its default.

    ``connect_timeout_s`` bounds reaching the server (an unreachable node fails fast); ``read_timeout_s``
    bounds each wait for the next bytes, including the first token behind a long queue.
    """

    def __init__(
        self,
        base_url: str,
        model: str = "",
        *,
        connect_timeout_s: float = 5.0,
        read_timeout_s: float = 600.0,
        max_concurrent: int = 512,
    ) -> None:
        u = urllib.parse.urlsplit(base_url)
        if u.scheme != "http" or not u.hostname or u.port is None:
            raise ValueError(f"VllmClient needs http://HOST:PORT, got {base_url!r}")
        self.base_url = f"http://{u.netloc}"
        self.host, self.port = u.hostname, u.port
        self.model = model
        self.connect_timeout_s, self.read_timeout_s = connect_timeout_s, read_timeout_s
        self._pool = concurrent.futures.ThreadPoolExecutor(max_concurrent, thread_name_prefix="vllm-http")
        self._closed = False

    def request_body(
        self, prompt: Sequence[int], max_new_tokens: int, session_id: str, program_id: str = ""
    ) -> dict[str, Any]:
        """The JSON body of one turn (see the module doc)."""
        body: dict[str, Any] = {
            "prompt": [int(t) for t in prompt],
            "max_tokens": int(max_new_tokens),
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
            "return_token_ids": True,
            "session_id": session_id,
        }
        if self.model:
            body["model"] = self.model
        if program_id:
            body["vllm_xargs"] = {"program_id": program_id}
        return body

    async def generate(
        self, prompt: Sequence[int], max_new_tokens: int, session_id: str, program_id: str = ""
    ) -> GenerateResult:
        """Run one turn to completion; cancelling the coroutine aborts the request on the node."""
        if self._closed:
            raise RuntimeError("VllmClient is closed")
        data = json.dumps(self.request_body(prompt, max_new_tokens, session_id, program_id)).encode()
        call = _Call()
        fut = asyncio.get_running_loop().run_in_executor(self._pool, self._post, data, call)
        try:
            return await fut
        except asyncio.CancelledError:
            call.abort()
            raise

    def _post(self, data: bytes, call: _Call) -> GenerateResult:
        """The blocking request (in a pool thread)."""
        t0 = time.monotonic()
        conn = http.client.HTTPConnection(self.host, self.port, timeout=self.connect_timeout_s)
        try:
            call.attach(conn)
            try:
                conn.connect()
            except OSError as exc:
                raise VllmUnreachable(f"cannot reach {self.base_url}: {exc}") from None
            if call.cancelled:
                raise VllmUnreachable("the call was cancelled")
            assert conn.sock is not None
            conn.sock.settimeout(self.read_timeout_s)
            headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
            try:
                conn.request("POST", "/v1/completions", data, headers)
                resp = conn.getresponse()
                if resp.status != 200:
                    raise _error(resp.status, _error_message(resp.read()))
                return self._read_stream(resp, t0)
            except (VllmUnreachable, VllmError):
                raise
            except ValueError as exc:  # a line that is not JSON
                raise VllmFailed(200, f"bad stream from {self.base_url}: {exc}") from None
            except (OSError, http.client.HTTPException) as exc:
                raise VllmUnreachable(
                    f"{self.base_url} dropped the turn: {type(exc).__name__}: {exc}"
                ) from None
        finally:
            conn.close()

    def _read_stream(self, resp: http.client.HTTPResponse, t0: float) -> GenerateResult:
        out = GenerateResult(ttft_s=-1.0)
        usage: dict[str, Any] = {}
        metrics: dict[str, Any] = {}
        done = False
        for raw in resp:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                done = True
                break
            chunk = json.loads(payload)
            if "error" in chunk:  # a failure after the response had started (status 200 already sent)
                err = chunk["error"] if isinstance(chunk["error"], dict) else {"message": chunk["error"]}
                raise _error(int(err.get("code") or 500), str(err.get("message", "")))
            out.request_id = out.request_id or str(chunk.get("id", ""))
            for choice in chunk.get("choices") or ():
                ids = choice.get("token_ids") or []
                if ids and out.ttft_s < 0:
                    out.ttft_s = time.monotonic() - t0
                out.token_ids.extend(int(t) for t in ids)
                if choice.get("finish_reason"):
                    out.finish_reason = str(choice["finish_reason"])
            usage = chunk.get("usage") or usage
            metrics = chunk.get("metrics") or metrics
        if not done:
            raise VllmUnreachable(f"{self.base_url} ended the stream before [DONE]")
        if usage.get("completion_tokens") and not out.token_ids:
            raise VllmFailed(200, "the server returned no token ids (needs vLLM with return_token_ids)")
        out.ttft_s = max(out.ttft_s, 0.0)
        out.num_prompt_tokens = int(usage.get("prompt_tokens") or 0)
        out.num_cached_tokens = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        out.queue_wait_s = float(metrics.get("queue_time_ms") or 0.0) / 1000.0
        return out

    async def close(self) -> None:
        """Stop taking calls; threads of calls in flight end with their requests."""
        self._closed = True
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def __aenter__(self) -> VllmClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
