"""What a vLLM node holds, from vLLM's own KV events: the router's ``CacheState`` for any vLLM, ours or stock.

vLLM started with ``--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint":
"tcp://*:5557", "topic": "kv"}'`` publishes, after every step, what its prefix cache gained and lost over a
ZMQ PUB socket. Each message is three frames: the topic, an 8-byte big-endian sequence number, and a
msgpack ``[ts, [event, ...], data_parallel_rank]`` where an event is a map tagged by ``type``:
``BlockStored`` (``block_hashes``, ``parent_block_hash``, ``token_ids``, ``block_size``, ``medium``,
``session_id``, ...), ``BlockRemoved`` (``block_hashes``, ``medium``) or ``AllBlocksCleared`` (older vLLMs
send arrays in field order; both are read). An endpoint without ``*`` makes vLLM *connect*, so a
subscriber may bind instead (``bind=True``) and miss nothing from the server's start.

:class:`KvResidency` folds the events into the set of resident block hashes (per medium: ``GPU`` is
device, ``CPU`` host), a content index (parent hash + the block's token ids -> hash) that answers "how
many leading tokens of this prompt would hit", and per session the chain of block hashes its requests
stored or reused (vLLM puts the request's ``session_id`` on ``BlockStored``). A session's resident
tokens are the leading blocks of its chain still resident: exactly what its next turn's prefix lookup
can hit. Reused blocks are reported only for requests with ``vllm_xargs.kv_cache_report_mode = "full"``;
otherwise a turn's chain is found through its first new block's parent. A hash stored twice (two
requests computed the same block at once) and removed once counts as gone: residency errs low.
Only KV cache group 0 is tracked (the full-attention group of a hybrid model).

:class:`KvEventSubscriber` runs the SUB socket in a thread, in sequence order: a gap is filled from vLLM's
replay socket when one is configured (``replay_endpoint``; also used to catch up on start), else counted in
``missed_batches``; a sequence that starts again at 0 is a restarted publisher and clears the state.

:class:`VllmCacheStateSource` adds what events cannot tell (queue lengths, usage, pool size, model name)
from vLLM's own ``/metrics`` and yields a ``CacheState``; ``python -m engine_adapter.vllm_backend._kv_events``
serves it as ``GetCacheState`` / ``WatchCacheState`` (a sidecar beside a stock vLLM, so the orchestrator's
router sees it like any node; its ``PushHints`` answers UNIMPLEMENTED for each hint: stock vLLM cannot
enforce them). The prefill backlog is an estimate there (waiting requests x mean uncached prompt).
"""

from __future__ import annotations

import argparse
import logging
import signal
import threading
import time
import urllib.request
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator, Sequence
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import grpc
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector
from pydantic import TypeAdapter, ValidationError

from hints import (
    CacheState,
    HintAck,
    HintResult,
    ack_to_proto,
    batch_from_proto_lenient,
    cache_state_to_proto,
    engine_pb2_grpc,
)
from hints._models import SessionId, SessionResidency

from ._hint_service import MAX_WORKERS, serve_watch

__all__ = [
    "KvEventSubscriber",
    "KvResidency",
    "VllmCacheStateSource",
    "decode_event_batch",
    "kv_events_config",
    "serve_sidecar",
]

log = logging.getLogger(__name__)

GPU, CPU = "GPU", "CPU"
Hash = Hashable  # vLLM's ExternalBlockHash: bytes (or int in older versions)
_SESSION_ID: TypeAdapter[str] = TypeAdapter(SessionId)
_FIELDS = {  # field order of the array form (vLLM < 0.11 encoded events array-like)
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium"),
    "BlockRemoved": ("block_hashes", "medium"),
    "AllBlocksCleared": (),
}


def kv_events_config(endpoint: str, topic: str = "", replay_endpoint: str | None = None) -> str:
    """The JSON for vLLM's ``--kv-events-config``: zmq publisher on ``endpoint``."""
    import json

    cfg: dict[str, Any] = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": endpoint,
        "topic": topic,
    }
    if replay_endpoint:
        cfg["replay_endpoint"] = replay_endpoint
    return json.dumps(cfg)


def decode_event_batch(payload: bytes) -> tuple[float, list[dict[str, Any]]]:
    """(timestamp, events as dicts with ``type``) from one message's payload frame."""
    import msgspec

    raw = msgspec.msgpack.decode(payload)
    if isinstance(raw, dict):  # a batch encoded as a map (not vLLM's default, but cheap to accept)
        ts, events = raw.get("ts", 0.0), raw.get("events", [])
    else:
        ts, events = raw[0], raw[1]
    out = []
    for ev in events:
        if isinstance(ev, dict):
            out.append(ev)
        elif isinstance(ev, list | tuple) and ev and isinstance(ev[0], str):
            names = _FIELDS.get(ev[0], ())
            out.append({"type": ev[0], **dict(zip(names, ev[1:], strict=False))})
    return float(ts), out


@dataclass(slots=True)
class _Block:
    parent: Hash | None
    content: tuple[Any, ...] | None  # (parent, token ids, extra keys) of a full block: the content index key
    media: set[str] = field(default_factory=set)


@dataclass
class KvStats:
    batches: int = 0
    stored_blocks: int = 0
    removed_blocks: dict[str, int] = field(default_factory=dict)  # by medium
    cleared: int = 0
    ignored_events: int = 0  # other KV cache groups, unknown types


class KvResidency:
    """Resident blocks, a content index and session chains, folded from KV events (not thread-safe)."""

    def __init__(self, max_sessions: int = 100_000) -> None:
        self.max_sessions = max_sessions
        self.block_size = 0
        self.blocks: dict[Hash, _Block] = {}
        self.by_content: dict[tuple[Any, ...], Hash] = {}
        self.sessions: OrderedDict[str, list[Hash | None]] = OrderedDict()
        self.stats = KvStats()
        self.version = 0  # bumps with every batch applied

    # ---- events in ------------------------------------------------------------------------------------
    def apply_batch(self, events: Sequence[dict[str, Any]]) -> None:
        for ev in events:
            self.apply(ev)
        self.stats.batches += 1
        self.version += 1

    def apply(self, ev: dict[str, Any]) -> None:
        kind = ev.get("type")
        if ev.get("group_idx") not in (None, 0):
            self.stats.ignored_events += 1
        elif kind == "BlockStored":
            self._stored(ev)
        elif kind == "BlockRemoved":
            medium = ev.get("medium") or GPU
            for h in ev.get("block_hashes") or ():
                b = self.blocks.get(h)
                if b is not None and medium in b.media:
                    b.media.discard(medium)
                    self.stats.removed_blocks[medium] = self.stats.removed_blocks.get(medium, 0) + 1
                    if not b.media:
                        self._drop(h, b)
        elif kind == "AllBlocksCleared":
            self.blocks.clear()
            self.by_content.clear()
            self.stats.cleared += 1
        else:
            self.stats.ignored_events += 1

    def _stored(self, ev: dict[str, Any]) -> None:
        hashes = list(ev.get("block_hashes") or ())
        if not hashes:
            return
        parent = ev.get("parent_block_hash")
        tokens = list(ev.get("token_ids") or ())
        bs = int(ev.get("block_size") or 0)
        full = bs > 0 and len(tokens) == bs * len(hashes)
        if full and not self.block_size:
            self.block_size = bs
        extra = ev.get("extra_keys") or [None] * len(hashes)
        lora = ev.get("lora_name")
        medium = ev.get("medium") or GPU
        prev = parent
        for i, h in enumerate(hashes):
            b = self.blocks.get(h)
            if b is None:
                content = None
                if full and bs == self.block_size:
                    x = extra[i] if i < len(extra) else None
                    content = (prev, tuple(tokens[i * bs : (i + 1) * bs]), lora, _freeze(x))
                b = _Block(prev, content)
                self.blocks[h] = b
                if content is not None:
                    self.by_content[content] = h
            if medium not in b.media:
                b.media.add(medium)
                self.stats.stored_blocks += 1
            prev = h
        sid = ev.get("session_id")
        if sid and medium == GPU:
            self._extend_session(str(sid), parent, hashes)

    def _extend_session(self, sid: str, parent: Hash | None, hashes: list[Hash]) -> None:
        chain = self.sessions.get(sid)
        if chain is None:
            try:
                _SESSION_ID.validate_python(sid)
            except ValidationError:
                return  # not a protocol session id: it could never be reported
        if parent is None:
            new: list[Hash | None] = list(hashes)
        elif chain and chain[-1] == parent:
            new = [*chain, *hashes]
        elif chain and parent in chain:
            i = len(chain) - 1 - chain[::-1].index(parent)
            new = [*chain[: i + 1], *hashes]
        else:
            new = [*self._ancestry(parent), *hashes]  # a prefix another session stored
        self.sessions[sid] = new
        self.sessions.move_to_end(sid)
        while len(self.sessions) > self.max_sessions:
            self.sessions.popitem(last=False)

    def _ancestry(self, h: Hash) -> list[Hash | None]:
        """The chain from the root to ``h``; a leading None where an ancestor is no longer known."""
        out: list[Hash | None] = []
        seen: set[Hash] = set()
        cur: Hash | None = h
        while cur is not None and cur not in seen:
            b = self.blocks.get(cur)
            out.append(cur)
            seen.add(cur)
            if b is None:
                out.append(None)  # unknown ancestry: nothing before it can be counted resident
                break
            cur = b.parent
        out.reverse()
        return out

    def _drop(self, h: Hash, b: _Block) -> None:
        del self.blocks[h]
        if b.content is not None and self.by_content.get(b.content) == h:
            del self.by_content[b.content]

    # ---- questions ------------------------------------------------------------------------------------
    def resident(self, h: Hash | None, medium: str = GPU) -> bool:
        b = self.blocks.get(h) if h is not None else None
        return b is not None and medium in b.media

    def session_blocks(self, session_id: str) -> tuple[int, int]:
        """(leading blocks of the session's chain on the device, blocks after those on the host)."""
        chain = self.sessions.get(session_id) or []
        device = 0
        while device < len(chain) and self.resident(chain[device], GPU):
            device += 1
        host = 0
        while device + host < len(chain) and self.resident(chain[device + host], CPU):
            host += 1
        return device, host

    def prefix_tokens(self, token_ids: Sequence[int], medium: str = GPU) -> int:
        """Leading tokens of a prompt whose blocks are resident (what vLLM's prefix lookup would hit,
        except that vLLM never hits the prompt's last token: a block-aligned prompt hits one block less)."""
        bs = self.block_size
        if not bs:
            return 0
        parent: Hash | None = None
        n = 0
        while (n + 1) * bs <= len(token_ids):
            h = self.by_content.get((parent, tuple(token_ids[n * bs : (n + 1) * bs]), None, None))
            if h is None or not self.resident(h, medium):
                break
            parent = h
            n += 1
        return n * bs

    def residencies(self) -> list[SessionResidency]:
        """Sessions with something resident (one with nothing left is as good as unknown to a router)."""
        bs = self.block_size
        out = []
        for sid in self.sessions:
            device, host = self.session_blocks(sid)
            if not device and not host:
                continue
            out.append(
                SessionResidency(
                    session_id=sid, device_tokens=device * bs, host_tokens=host * bs, state="parked"
                )
            )
        return out

    def num_resident(self, medium: str = GPU) -> int:
        return sum(1 for b in self.blocks.values() if medium in b.media)


def _freeze(x: Any) -> Any:
    if isinstance(x, list | tuple):
        return tuple(_freeze(v) for v in x)
    return x


class KvEventSubscriber:
    """A thread that applies a vLLM node's KV events to a :class:`KvResidency`, in sequence order.

    ``endpoint``: vLLM's ``endpoint`` with ``*`` replaced by its address (``tcp://127.0.0.1:5557``), or,
    with ``bind=True``, an address to bind that vLLM's endpoint connects to. Read the residency under
    ``lock`` (or through :meth:`read`).
    """

    def __init__(
        self,
        endpoint: str,
        *,
        topic: str = "",
        bind: bool = False,
        replay_endpoint: str | None = None,
        residency: KvResidency | None = None,
        replay_timeout_s: float = 2.0,
    ) -> None:
        import zmq

        self.endpoint = endpoint
        self.topic = topic
        self.replay_endpoint = replay_endpoint
        self.replay_timeout_s = replay_timeout_s
        self.residency = residency if residency is not None else KvResidency()
        self.lock = threading.Condition()
        self.next_seq: int | None = None
        self.missed_batches = 0
        self.restarts = 0
        self.last_event_s: float | None = None
        self._ctx = zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self._sub.setsockopt(zmq.RCVHWM, 0)
        if bind:
            self._sub.bind(endpoint)
        else:
            self._sub.connect(endpoint)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hintflow-kv-events", daemon=True)

    def start(self) -> KvEventSubscriber:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.ident is not None:
            self._thread.join(timeout=5)
        self._sub.close(linger=0)
        self._ctx.term()

    def __enter__(self) -> KvEventSubscriber:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def read(self, fn: Callable[[KvResidency], Any]) -> Any:
        with self.lock:
            return fn(self.residency)

    def wait_for(self, predicate: Callable[[KvResidency], bool], timeout_s: float) -> bool:
        """Wait until ``predicate(residency)`` holds (checked after each batch); whether it did."""
        with self.lock:
            return self.lock.wait_for(lambda: predicate(self.residency), timeout=timeout_s)

    # ---- the thread ---------------------------------------------------------------------------------
    def _run(self) -> None:
        import zmq

        poller = zmq.Poller()
        poller.register(self._sub, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            try:
                frames = self._sub.recv_multipart(zmq.NOBLOCK)
                self._on_message(frames)
            except zmq.Again:
                continue
            except Exception:  # a bad message must not stop the node's view
                log.exception("hintflow: KV event message from %s failed", self.endpoint)

    def _on_message(self, frames: list[bytes]) -> None:
        if len(frames) != 3:
            return
        seq = int.from_bytes(frames[1], "big", signed=True)
        with self.lock:
            if self.next_seq is not None and seq == 0 and self.next_seq > 0:
                self.restarts += 1  # the publisher started again: what we knew is gone
                self.residency.blocks.clear()
                self.residency.by_content.clear()
                self.next_seq = 0
            expected = self.next_seq
        if expected is None:
            if self.replay_endpoint:
                self._replay(0, seq)  # catch up on what was published before we subscribed
        elif seq < expected:
            return  # already applied (from a replay)
        elif seq > expected:
            if self.replay_endpoint:
                self._replay(expected, seq)
            with self.lock:
                if self.next_seq is not None and seq > self.next_seq:
                    self.missed_batches += seq - self.next_seq
        self._apply(seq, frames[2])

    def _apply(self, seq: int, payload: bytes) -> None:
        _, events = decode_event_batch(payload)
        with self.lock:
            if self.next_seq is not None and seq < self.next_seq:
                return
            self.residency.apply_batch(events)
            self.next_seq = seq + 1
            self.last_event_s = time.monotonic()
            self.lock.notify_all()

    def _replay(self, start: int, until: int) -> None:
        """Ask vLLM's replay socket for batches ``start..until-1`` and apply them in order."""
        import zmq

        assert self.replay_endpoint is not None
        sock = self._ctx.socket(zmq.DEALER)
        try:
            sock.connect(self.replay_endpoint)
            sock.send_multipart([b"", start.to_bytes(8, "big")])
            deadline = time.monotonic() + self.replay_timeout_s
            while (left := deadline - time.monotonic()) > 0:
                if not sock.poll(int(left * 1000)):
                    break
                frames = sock.recv_multipart()
                if len(frames) != 4:
                    continue
                seq = int.from_bytes(frames[2], "big", signed=True)
                if seq < 0:
                    break  # end of replay
                if seq < until:
                    with self.lock:
                        behind = self.next_seq is not None and seq > self.next_seq
                        if behind and self.next_seq is not None:
                            self.missed_batches += seq - self.next_seq
                    self._apply(seq, frames[3])
        finally:
            sock.close(linger=0)


def _scrape(url: str, timeout_s: float = 2.0) -> dict[str, Any]:
    """The few ``vllm:*`` values a CacheState needs, from vLLM's Prometheus text."""
    with urllib.request.urlopen(url, timeout=timeout_s) as r:
        text = r.read().decode()
    out: dict[str, Any] = {}
    sums: dict[str, float] = {}
    usage: list[float] = []
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if not s.name.startswith("vllm:"):
                continue
            if "model_name" in s.labels:
                out.setdefault("model_name", s.labels["model_name"])
            if s.name == "vllm:cache_config_info":
                out["num_gpu_blocks"] = int(float(s.labels.get("num_gpu_blocks") or 0))
                out["block_size"] = int(float(s.labels.get("block_size") or 0))
            elif s.name == "vllm:kv_cache_usage_perc":
                usage.append(s.value)  # per engine: several (data parallel) share the pool size
            elif s.name in (
                "vllm:num_requests_waiting",
                "vllm:num_requests_running",
                "vllm:request_prompt_tokens_sum",
                "vllm:request_prompt_tokens_count",
                "vllm:prompt_tokens_cached_total",
            ):
                sums[s.name] = sums.get(s.name, 0.0) + s.value
    out.update(sums)
    if usage:
        out["vllm:kv_cache_usage_perc"] = sum(usage) / len(usage)
    return out


class VllmCacheStateSource:
    """A stock vLLM node's ``CacheState``: residency from KV events, the rest from vLLM's ``/metrics``.

    ``metrics_url`` None: events only (no queue lengths; usage from resident blocks over ``total_blocks``).
    Scrapes at most every ``scrape_period_s``; a failed scrape keeps the last values.
    """

    def __init__(
        self,
        subscriber: KvEventSubscriber,
        metrics_url: str | None,
        *,
        node_id: str = "vllm",
        model_name: str = "",
        total_blocks: int = 0,
        scrape_period_s: float = 0.5,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.subscriber = subscriber
        self.metrics_url = metrics_url
        self.node_id = node_id
        self.model_name = model_name
        self.total_blocks = total_blocks
        self.scrape_period_s = scrape_period_s
        self.clock = clock
        self._lock = threading.Lock()
        self._metrics: dict[str, Any] = {}
        self._scraped_at = -float("inf")
        self._metrics_changes = 0

    def _refresh(self) -> dict[str, Any]:
        with self._lock:
            if self.metrics_url and self.clock() - self._scraped_at >= self.scrape_period_s:
                self._scraped_at = self.clock()
                try:
                    new = _scrape(self.metrics_url)
                except Exception as e:  # the node is down or slow: keep the last view, the router ages it
                    log.info("hintflow: scraping %s failed: %s", self.metrics_url, e)
                else:
                    if new != self._metrics:
                        self._metrics = new
                        self._metrics_changes += 1
            return self._metrics

    def version(self) -> int:
        self._refresh()
        with self.subscriber.lock:
            return self.subscriber.residency.version + self._metrics_changes

    def state(self, include_sessions: bool) -> CacheState:
        m = self._refresh()
        with self.subscriber.lock:
            res = self.subscriber.residency
            version = res.version + self._metrics_changes
            bs = res.block_size or int(m.get("block_size", 0))
            sessions = res.residencies() if include_sessions else []
            resident = res.num_resident(GPU)
        total = self.total_blocks or max(0, int(m.get("num_gpu_blocks", 0)) - 1)  # less vLLM's null block
        usage = m.get("vllm:kv_cache_usage_perc")
        if usage is None:  # events only: cached blocks are "used" by this measure (an upper bound)
            usage = resident / total if total else 0.0
        waiting = int(m.get("vllm:num_requests_waiting", 0))
        count = m.get("vllm:request_prompt_tokens_count", 0.0)
        uncached = 0.0
        if count:
            uncached = (
                m.get("vllm:request_prompt_tokens_sum", 0.0) - m.get("vllm:prompt_tokens_cached_total", 0.0)
            ) / count
        return CacheState(
            node_id=self.node_id,
            model_name=self.model_name or str(m.get("model_name", "")),
            block_size=bs,
            total_blocks=total,
            free_blocks=max(0, min(total, round(total * (1.0 - float(usage))))),
            pinned_blocks=0,
            host_total_blocks=0,
            host_free_blocks=0,
            num_waiting=waiting,
            num_running=int(m.get("vllm:num_requests_running", 0)),
            prefill_backlog_tokens=max(0, round(waiting * uncached)),
            sessions=sessions,
            node_time_s=self.clock(),
            version=version,
        )


class _KvEventCollector(Collector):
    """``hintflow_*`` series the sidecar can derive from the events (evictions above all)."""

    def __init__(self, subscriber: KvEventSubscriber, model_name: Callable[[], str]) -> None:
        self.subscriber = subscriber
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        with self.subscriber.lock:
            res, sub = self.subscriber.residency, self.subscriber
            removed = dict(res.stats.removed_blocks)
            values = (res.num_resident(GPU), res.stats.stored_blocks, sub.missed_batches, len(res.sessions))
        label = [self.model_name()]
        resident = GaugeMetricFamily(
            "hintflow_kv_cached_blocks", "Device blocks in vLLM's prefix cache.", labels=["model_name"]
        )
        resident.add_metric(label, float(values[0]))
        yield resident
        evicted = CounterMetricFamily(
            "hintflow_evicted_blocks_total",
            "Device KV blocks evicted (vLLM BlockRemoved, GPU).",
            labels=["model_name"],
        )
        evicted.add_metric(label, float(removed.get(GPU, 0)))
        yield evicted
        for name, doc, v in (
            ("hintflow_kv_event_stored_blocks_total", "Blocks vLLM reported stored (any medium).", values[1]),
            (
                "hintflow_kv_event_missed_batches_total",
                "KV event batches lost (sequence gaps not replayed).",
                values[2],
            ),
        ):
            fam = CounterMetricFamily(name, doc, labels=["model_name"])
            fam.add_metric(label, float(v))
            yield fam
        sessions = GaugeMetricFamily(
            "hintflow_sessions", "Sessions seen in KV events (bounded).", labels=["model_name"]
        )
        sessions.add_metric(label, float(values[3]))
        yield sessions


class _SidecarServicer(engine_pb2_grpc.EngineNodeServicer):  # type: ignore[misc]
    def __init__(self, source: VllmCacheStateSource, watch_min_period_s: float = 0.05) -> None:
        self.source = source
        self.watch_min_period_s = watch_min_period_s
        self.closing = threading.Event()

    def GetCacheState(self, request: Any, context: grpc.ServicerContext) -> Any:
        return cache_state_to_proto(self.source.state(request.include_sessions))

    def WatchCacheState(self, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        yield from serve_watch(self.source, request, context, 1.0, self.watch_min_period_s, self.closing)

    def PushHints(self, request_iterator: Iterator[Any], context: grpc.ServicerContext) -> Iterator[Any]:
        msg = "stock vLLM behind a KV-event sidecar: hints are not enforced (serve with hintflow's scheduler)"
        for batch in request_iterator:
            decoded = batch_from_proto_lenient(batch)
            results = [
                HintResult(index=i, code="UNIMPLEMENTED", message=msg) for i in range(len(decoded.hints))
            ]
            yield ack_to_proto(HintAck(batch_id=decoded.batch_id, results=results))


@dataclass
class Sidecar:
    server: grpc.Server
    port: int
    servicer: _SidecarServicer
    subscriber: KvEventSubscriber
    metrics_port: int | None = None
    own_subscriber: bool = True
    _http: tuple[Any, threading.Thread] | None = None

    def stop(self) -> None:
        self.servicer.closing.set()
        self.server.stop(grace=0.5).wait()
        if self._http is not None:
            self._http[0].shutdown()
            self._http[0].server_close()
        if self.own_subscriber:
            self.subscriber.stop()


def serve_sidecar(
    subscriber: KvEventSubscriber,
    metrics_url: str | None,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    metrics_port: int | None = None,
    own_subscriber: bool = True,
    **source_kw: Any,
) -> Sidecar:
    """Start ``subscriber`` (if not yet) and serve its node's CacheState over gRPC on ``host:port``.

    ``metrics_port`` (0: a free one) serves the ``hintflow_*`` series the events give (evicted blocks
    above all); ``own_subscriber``: :meth:`Sidecar.stop` stops the subscriber too.
    """
    if not subscriber._thread.is_alive():
        subscriber.start()
    source = VllmCacheStateSource(subscriber, metrics_url, **source_kw)
    servicer = _SidecarServicer(source)
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=MAX_WORKERS, thread_name_prefix="hintflow-kv")
    )
    engine_pb2_grpc.add_EngineNodeServicer_to_server(servicer, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"hintflow: cannot bind the KV-event sidecar to {host}:{port}")
    http = None
    if metrics_port is not None and metrics_port >= 0:
        registry = CollectorRegistry()
        registry.register(
            _KvEventCollector(
                subscriber, lambda: source.model_name or str(source._metrics.get("model_name", ""))
            )
        )
        http = start_http_server(metrics_port, addr=host, registry=registry)
    server.start()
    mport = int(http[0].server_port) if http is not None else None
    return Sidecar(server, bound, servicer, subscriber, mport, own_subscriber, http)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m engine_adapter.vllm_backend._kv_events",
        description="CacheState of a (stock) vLLM node from its KV events, served as hintflow's "
        "GetCacheState/WatchCacheState for the orchestrator's router.",
    )
    ap.add_argument("--events", required=True, help="vLLM's KV event endpoint, e.g. tcp://127.0.0.1:5557")
    ap.add_argument("--bind", action="store_true", help="bind --events (vLLM's endpoint then connects here)")
    ap.add_argument("--topic", default="", help="vLLM's kv-events topic")
    ap.add_argument("--replay", default=None, help="vLLM's replay_endpoint, to catch up and fill gaps")
    ap.add_argument("--vllm-url", default=None, help="vLLM's HTTP base URL, for /metrics (queues, usage)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0, help="gRPC port of the sidecar (0: any free one)")
    ap.add_argument("--metrics-port", type=int, default=None, help="serve hintflow_* metrics here")
    ap.add_argument("--node-id", default="vllm")
    ap.add_argument("--total-blocks", type=int, default=0, help="pool size if vLLM's /metrics is not read")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    sub = KvEventSubscriber(a.events, topic=a.topic, bind=a.bind, replay_endpoint=a.replay)
    url = a.vllm_url.rstrip("/") + "/metrics" if a.vllm_url else None
    car = serve_sidecar(
        sub,
        url,
        host=a.host,
        port=a.port,
        metrics_port=a.metrics_port,
        node_id=a.node_id,
        total_blocks=a.total_blocks,
    )
    print(f"hintflow KV-event sidecar for {a.events}: CacheState on {a.host}:{car.port}", flush=True)
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    done.wait()
    car.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
