"""What a vLLM node holds, from vLLM's own KV events: the wire format and the residency index they fold into.

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

This module is the pure fold: no sockets, no threads, no gRPC, so it is tested on synthetic events. What
feeds it from a live node is ``_kv_subscriber`` (:class:`KvEventSubscriber`); what serves it to the router
for a stock vLLM is ``_kv_sidecar``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import TypeAdapter, ValidationError

from hints import SessionId, SessionResidency, residency_reported

__all__ = [
    "CPU",
    "GPU",
    "KvResidency",
    "KvStats",
    "decode_event_batch",
    "kv_events_config",
]

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
            if not residency_reported(device, host, "parked"):
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
