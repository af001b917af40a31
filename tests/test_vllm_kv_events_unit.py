"""The KV-event fold (``engine_adapter.vllm_backend._kv_events``) and its subscriber (``_kv_subscriber``)
on synthetic events, no vLLM needed: session chains across turns and shared prefixes, removal and
clearing, the content index, both wire forms, sequence gaps and a restarted publisher."""

from __future__ import annotations

import threading
import time
from typing import Any

import msgspec
import pytest
import zmq

from engine_adapter.vllm_backend import KvEventSubscriber
from engine_adapter.vllm_backend._kv_events import KvResidency, decode_event_batch

BS = 4


def stored(hashes: list[bytes], parent: bytes | None, tokens: list[int], session: str | None = None) -> dict:
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": BS,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "session_id": session,
    }


def removed(hashes: list[bytes], medium: str = "GPU") -> dict:
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": medium}


def toks(n_blocks: int, start: int = 0) -> list[int]:
    return list(range(start, start + n_blocks * BS))


def test_session_chain_across_turns_and_eviction() -> None:
    r = KvResidency()
    r.apply_batch([stored([b"a", b"b", b"c"], None, toks(3), "s1")])
    assert r.session_blocks("s1") == (3, 0)
    # next turn: a hit on a, b (not reported), then new blocks after b: the chain is a, b, d, e
    r.apply_batch([stored([b"d", b"e"], b"b", toks(2, 100), "s1")])
    assert r.sessions["s1"] == [b"a", b"b", b"d", b"e"]
    assert r.session_blocks("s1") == (4, 0)
    r.apply_batch([removed([b"d"])])
    assert r.session_blocks("s1") == (2, 0)  # leading resident blocks only: e is unreachable
    r.apply_batch([removed([b"a"])])
    assert r.session_blocks("s1") == (0, 0)
    assert r.stats.removed_blocks == {"GPU": 2}
    assert r.version == 4


def test_shared_prefix_from_another_session_and_reuse_reports() -> None:
    r = KvResidency()
    r.apply_batch([stored([b"p1", b"p2"], None, toks(2), "sys")])
    r.apply_batch([stored([b"x"], b"p2", toks(1, 50), "s2")])  # s2 hit the shared prefix, stored x
    assert r.sessions["s2"] == [b"p1", b"p2", b"x"]
    assert r.session_blocks("s2") == (3, 0)
    # kv_cache_report_mode=full: reused blocks are reported with no parent; the chain restarts there
    r.apply_batch([stored([b"p1"], None, toks(1), "s2")])
    assert r.sessions["s2"] == [b"p1"]
    r.apply_batch([stored([b"y"], b"gone", toks(1, 70), "s3")])  # unknown ancestry counts as not resident
    assert r.session_blocks("s3") == (0, 0)


def test_prefix_index_and_host_tier_and_clear() -> None:
    r = KvResidency()
    prompt = toks(3) + [999]
    r.apply_batch([stored([b"a", b"b", b"c"], None, toks(3), "s")])
    assert r.prefix_tokens(prompt) == 3 * BS
    assert r.prefix_tokens(toks(1) + [7, 7, 7, 7]) == BS  # diverges in the second block
    r.apply_batch([{**stored([b"c"], b"b", toks(1, 8)), "medium": "CPU"}, removed([b"c"], "GPU")])
    assert r.session_blocks("s") == (2, 1)  # c offloaded: on the host after a device prefix of two
    assert r.prefix_tokens(prompt) == 2 * BS
    r.apply_batch([{"type": "AllBlocksCleared"}])
    assert r.session_blocks("s") == (0, 0) and r.prefix_tokens(prompt) == 0 and not r.blocks
    assert r.residencies() == []  # nothing left: not reported
    r.apply_batch([stored([b"a"], None, toks(1), "s")])
    assert [(x.session_id, x.device_tokens, x.state) for x in r.residencies()] == [("s", BS, "parked")]


def test_bad_session_ids_and_other_groups_are_skipped() -> None:
    r = KvResidency(max_sessions=2)
    r.apply_batch(
        [stored([b"a"], None, toks(1), "bad\nid"), {**stored([b"z"], None, toks(1), "g"), "group_idx": 1}]
    )
    assert "bad\nid" not in r.sessions and b"z" not in r.blocks and r.stats.ignored_events == 1
    for sid in ("s1", "s2", "s3"):
        r.apply_batch([stored([sid.encode()], None, toks(1), sid)])
    assert list(r.sessions) == ["s2", "s3"]  # bounded, least recently stored first out


def test_decodes_map_and_array_forms() -> None:
    ev = stored([b"a", 7], None, toks(2), "s")  # type: ignore[list-item]  # hashes are bytes or int
    ts, events = decode_event_batch(msgspec.msgpack.encode([1.5, [ev, {"type": "AllBlocksCleared"}], 0]))
    assert ts == 1.5 and events[0]["block_hashes"] == [b"a", 7] and events[1]["type"] == "AllBlocksCleared"
    old = ["BlockStored", [b"a"], None, toks(1), BS, None, "GPU"]
    _, events = decode_event_batch(msgspec.msgpack.encode([2.0, [old, ["BlockRemoved", [b"a"], "GPU"]]]))
    assert events[0]["parent_block_hash"] is None and events[0]["token_ids"] == toks(1)
    assert events[1] == {"type": "BlockRemoved", "block_hashes": [b"a"], "medium": "GPU"}


def _publish(sock: Any, seq: int, events: list[dict]) -> None:
    sock.send_multipart(
        [b"kv", seq.to_bytes(8, "big", signed=True), msgspec.msgpack.encode([0.0, events, 0])]
    )


def test_subscriber_counts_gaps_and_resets_on_a_restarted_publisher() -> None:
    ctx = zmq.Context.instance()
    pub = ctx.socket(zmq.PUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    try:
        with KvEventSubscriber(f"tcp://127.0.0.1:{port}", topic="kv") as sub:
            deadline = time.monotonic() + 10
            while sub.next_seq is None:  # PUB drops what it sends before the subscription arrives
                assert time.monotonic() < deadline
                _publish(pub, 0, [stored([b"a"], None, toks(1), "s")])
                time.sleep(0.05)
            _publish(pub, 1, [stored([b"b"], b"a", toks(1, 4), "s")])
            _publish(pub, 3, [stored([b"c"], b"b", toks(1, 8), "s")])  # 2 was lost
            assert sub.wait_for(lambda r: r.session_blocks("s") == (3, 0), 5)
            assert sub.missed_batches == 1
            _publish(pub, 0, [stored([b"q"], None, toks(1, 40), "t")])  # the node restarted
            assert sub.wait_for(lambda r: "t" in r.sessions, 5)
            assert sub.restarts == 1 and sub.read(lambda r: r.session_blocks("s")) == (0, 0)
    finally:
        pub.close(linger=0)


@pytest.mark.timeout(30)
def test_subscriber_catches_up_from_the_replay_socket() -> None:
    """vLLM's replay protocol: a DEALER asks a ROUTER for batches from a sequence number; an 8-byte -1 ends."""
    ctx = zmq.Context.instance()
    pub, router = ctx.socket(zmq.PUB), ctx.socket(zmq.ROUTER)
    port, rport = pub.bind_to_random_port("tcp://127.0.0.1"), router.bind_to_random_port("tcp://127.0.0.1")
    history = {0: [stored([b"a"], None, toks(1), "s")], 1: [stored([b"b"], b"a", toks(1, 4), "s")]}

    def serve_replay() -> None:
        if not router.poll(10_000):
            return
        client, _, start = router.recv_multipart()
        for seq in range(int.from_bytes(start, "big"), 2):
            payload = msgspec.msgpack.encode([0.0, history[seq], 0])
            router.send_multipart([client, b"", b"kv", seq.to_bytes(8, "big"), payload])
        router.send_multipart([client, b"", b"", (-1).to_bytes(8, "big", signed=True), b""])

    t = threading.Thread(target=serve_replay)
    t.start()
    try:
        with KvEventSubscriber(
            f"tcp://127.0.0.1:{port}", topic="kv", replay_endpoint=f"tcp://127.0.0.1:{rport}"
        ) as sub:
            deadline = time.monotonic() + 10
            while sub.next_seq is None:
                assert time.monotonic() < deadline
                _publish(pub, 2, [stored([b"c"], b"b", toks(1, 8), "s")])
                time.sleep(0.05)
            assert sub.wait_for(lambda r: r.session_blocks("s") == (3, 0), 5)
            assert sub.missed_batches == 0
    finally:
        t.join(15)
        pub.close(linger=0)
        router.close(linger=0)
