"""Per-request accounting of the vLLM backend (``_accounting``) and its export (``_metrics``), no vLLM.

Requests and the scheduler are duck-typed here: the split of a prompt into hits, history, across-turn
hits, within-turn hits and recomputed tokens is pinned down on exact numbers; tests/test_vllm_accounting.py
checks the same against a real vLLM server.
"""

from __future__ import annotations

import threading
from array import array
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from engine_adapter._metrics import _LATENCY_BUCKETS
from engine_adapter.vllm_backend._accounting import (
    LATENCY_BUCKETS,
    Histogram,
    RequestAccounting,
    common_prefix_len,
)
from engine_adapter.vllm_backend._metrics import SchedulerCollector
from engine_adapter.vllm_backend._sessions import SessionBook, VSession


@dataclass
class Req:
    """The part of ``vllm.v1.request.Request`` the accounting reads."""

    request_id: str
    prompt_token_ids: list[int]
    arrival_time: float
    output: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    finished: bool = False

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output

    def is_finished(self) -> bool:
        return self.finished


class Wall:
    t = 1000.0

    def __call__(self) -> float:
        return self.t


def _session(sid: str = "s") -> VSession:
    return VSession(sid, sid, first_seen_s=0.0, last_active_s=0.0)


def _finish(acct: RequestAccounting, req: Req, s: VSession | None, out: list[int]) -> None:
    """vLLM's end of a request: the output appended, all but the last sampled token computed, freed."""
    req.output = out
    req.num_computed_tokens = len(req.all_token_ids) - 1
    req.finished = True
    acct.on_finished(req, s)


def test_common_prefix_len() -> None:
    a = array("q", range(1000))
    assert common_prefix_len(a, a) == 1000
    assert common_prefix_len(a, array("q", range(600))) == 600  # the prompt extends the context
    assert common_prefix_len(array("q", range(10)), a) == 10
    for k in (0, 1, 137, 999):
        b = array("q", a)
        b[k] = -1
        assert common_prefix_len(a, b) == k
    assert common_prefix_len(array("q"), a) == 0


def test_a_turn_is_split_into_across_turn_hits_recomputed_and_within_turn_hits() -> None:
    wall = Wall()
    acct = RequestAccounting(wall_clock=wall)
    s = _session()
    first = Req("r1", list(range(300)), arrival_time=wall.t)
    wall.t += 0.5
    acct.on_scheduled(first, 0, s)  # nothing cached, no history
    assert (acct.computed_tokens, acct.across_turn_prompt_tokens, acct.device_hit_tokens) == (300, 0, 0)
    wall.t += 0.25
    _finish(acct, first, s, [7, 8])
    assert list(s.context) == [*range(300), 7]  # the last sampled token's KV was never computed

    # Turn 2 resends its inputs without the model's output: its history is the 300 inputs (not 301
    # tokens); vLLM found 256 of them cached (two full 128-token blocks), the partial block is recomputed.
    second = Req("r2", [*range(300), *range(5000, 5200)], arrival_time=wall.t)
    acct.on_scheduled(second, 256, s)
    assert acct.across_turn_prompt_tokens == 300
    assert acct.across_turn_hit_tokens == 256 and acct.recomputed_tokens == 44
    assert acct.within_turn_hit_tokens == 0
    assert acct.device_hit_tokens == 256 and acct.computed_tokens == 300 + 244

    # A new session whose prompt starts with another session's cached prefix: within-turn hits only.
    other = Req("r3", [*range(256), 9, 9], arrival_time=wall.t)
    acct.on_scheduled(other, 256, _session("t"))
    assert acct.within_turn_hit_tokens == 256 and acct.across_turn_prompt_tokens == 300

    # A request without a session (no session_id, no program_id): prompt tokens only.
    acct.on_scheduled(Req("r4", [1, 2, 3], arrival_time=wall.t), 0, None)
    assert acct.computed_tokens == 300 + 244 + 2 + 3 and acct.across_turn_prompt_tokens == 300


def test_a_resumed_request_is_not_counted_twice() -> None:
    acct = RequestAccounting(wall_clock=Wall())
    req = Req("r", list(range(100)), arrival_time=0.0)
    acct.on_scheduled(req, 0, None)
    acct.on_scheduled(req, 64, None)  # vLLM's V2 runner lists a resumed (preempted) request as new again
    assert acct.computed_tokens == 100 and acct.device_hit_tokens == 0
    assert sum(acct.queue_wait.counts) == 1


def test_ttft_and_queue_wait_are_measured_from_arrival() -> None:
    wall = Wall()
    acct = RequestAccounting(wall_clock=wall)
    a = Req("a", [1] * 10, arrival_time=wall.t)
    b = Req("b", [2] * 10, arrival_time=wall.t)
    c = Req("c", [3] * 10, arrival_time=wall.t)
    wall.t += 0.03
    for r in (a, b, c):
        acct.on_scheduled(r, 0, None)
    wall.t += 0.2
    a.output = [5]  # a's first token came out of this step; b is still prefilling (chunked)
    acct.after_step()
    wall.t += 2.0
    b.output = [6]
    c.finished = True  # aborted before its first token: no TTFT, as on the embedded node
    acct.after_step()
    acct.after_step()  # nothing left to observe
    assert abs(acct.ttft.sum - (0.23 + 2.23)) < 1e-9 and sum(acct.ttft.counts) == 2
    assert acct.ttft.counts[LATENCY_BUCKETS.index(0.25)] == 1 and acct.ttft.counts[LATENCY_BUCKETS.index(2.5)] == 1
    assert abs(acct.queue_wait.sum - 3 * 0.03) < 1e-9 and sum(acct.queue_wait.counts) == 3


def test_buckets_are_the_embedded_nodes() -> None:
    assert LATENCY_BUCKETS == _LATENCY_BUCKETS
    h = Histogram((1.0, 2.0))
    for v in (0.5, 1.0, 1.5, 9.0):
        h.observe(v)
    assert h.cumulative() == [("1.0", 2.0), ("2.0", 3.0), ("+Inf", 4.0)] and h.sum == 12.0


def test_the_collector_exports_the_embedded_names_from_the_accounting() -> None:
    """SchedulerCollector over a duck-typed scheduler: the per-request series as the embedded engine names them."""

    class Pool:
        def get_num_free_blocks(self) -> int:
            return 10

    wall = Wall()
    acct = RequestAccounting(wall_clock=wall)
    s = _session()
    r1 = Req("r1", list(range(300)), arrival_time=wall.t)
    acct.on_scheduled(r1, 0, s)
    _finish(acct, r1, s, [7])
    acct.on_scheduled(Req("r2", [*range(300), 1, 2], arrival_time=wall.t - 1.5), 256, s)
    book = SessionBook(Pool(), 16)
    sched = SimpleNamespace(
        hint_lock=threading.RLock(),
        book=book,
        expire_pins=book.expire,  # (HintSchedulerMixin.expire_pins: the book's expiry, renewing nothing here)
        accounting=acct,
        waiting=[],
        running=[],
        kv_cache_manager=SimpleNamespace(block_pool=Pool()),
        prefill_backlog_tokens=lambda: 0,
        model_name="m",
    )
    registry = CollectorRegistry()
    registry.register(SchedulerCollector(sched, lambda: None))  # type: ignore[arg-type]
    samples = {
        (smp.name, smp.labels.get("source", smp.labels.get("le", ""))): smp.value
        for fam in text_string_to_metric_families(generate_latest(registry).decode())
        for smp in fam.samples
    }
    assert samples[("hintflow_prompt_tokens_total", "device_hit")] == 256
    assert samples[("hintflow_prompt_tokens_total", "host_hit")] == 0
    assert samples[("hintflow_prompt_tokens_total", "computed")] == 300 + 46
    assert samples[("hintflow_across_turn_prompt_tokens_total", "")] == 300
    assert samples[("hintflow_across_turn_hit_tokens_total", "")] == 256
    assert samples[("hintflow_recomputed_tokens_total", "")] == 44
    assert samples[("hintflow_within_turn_hit_tokens_total", "")] == 0
    assert samples[("hintflow_queue_wait_seconds_count", "")] == 2
    assert samples[("hintflow_queue_wait_seconds_bucket", "2.5")] == 2
    assert samples[("hintflow_queue_wait_seconds_bucket", "1.0")] == 1
    assert samples[("hintflow_time_to_first_token_seconds_count", "")] == 1
    # the recomputed 44 by cause (no arrival known: put down to "unpinned"), as the embedded node labels them
    assert 'hintflow_recomputed_tokens_by_cause_total{cause="unpinned",model_name="m"} 44.0' in generate_latest(
        registry
    ).decode()
    assert ("hintflow_kv_host_total_blocks", "") not in samples  # no host tier: no host series

    # with hintflow's host tier (_host_connector): its book's numbers, and host hits by source
    from engine_adapter.vllm_backend._host_index import HostIndex

    index = HostIndex(8)
    for h in "abcdefghij":  # ten saves into eight slots: the two oldest dropped
        index.reserve(h)
    index.stats.num_loaded_blocks = 2
    sched.host_tier = SimpleNamespace(index=index)
    acct.on_scheduled(Req("r3", [*range(300), 1, 2, 3], arrival_time=wall.t), 256, s, host_hit_tokens=128)
    text = generate_latest(registry).decode()
    got = {smp.name: smp.value for fam in text_string_to_metric_families(text) for smp in fam.samples
           if smp.name.startswith(("hintflow_kv_host", "hintflow_offloaded", "hintflow_reloaded", "hintflow_dropped"))}
    assert got == {"hintflow_kv_host_total_blocks": 8, "hintflow_kv_host_free_blocks": 0,
                   "hintflow_offloaded_blocks_total": 10, "hintflow_reloaded_blocks_total": 2,
                   "hintflow_dropped_host_blocks_total": 2}  # fmt: skip
    assert 'hintflow_prompt_tokens_total{model_name="m",source="host_hit"} 128.0' in text


def test_host_tier_loads_are_host_hits() -> None:
    wall = Wall()
    acct = RequestAccounting(wall_clock=wall)
    acct.on_scheduled(Req("r1", list(range(600)), arrival_time=wall.t), 512, None, host_hit_tokens=384)
    assert (acct.device_hit_tokens, acct.host_hit_tokens, acct.computed_tokens) == (128, 384, 88)
    acct.on_scheduled(Req("r2", list(range(600)), arrival_time=wall.t), 128, None, host_hit_tokens=999)
    assert acct.host_hit_tokens == 384 + 128  # never more than the hits


def test_recomputed_tokens_are_told_apart_by_why_the_context_was_not_there() -> None:
    """What the turn lost while it queued (cached when it arrived, gone when vLLM scheduled it) is
    ``queued``; the rest goes to its session's pause fate at arrival. The causes add up to the recomputed
    tokens, and the log line gives their shares, largest first."""
    acct = RequestAccounting(wall_clock=Wall())
    s = _session()
    first = Req("r1", list(range(1000)), arrival_time=0.0)
    acct.on_scheduled(first, 0, s)
    _finish(acct, first, s, [1])
    assert acct.lost_by == {} and acct.lost_shares() == "-"
    # arrived with 896 of its 1,000-token history cached, found 384 when scheduled: 512 lost queued,
    # 104 (the unfilled last block and what the pause took) to the pin's fate
    second = Req("r2", [*range(1000), *range(7000, 7100)], arrival_time=0.0)
    acct.on_scheduled(second, 384, s, arrival=("yielded", 896))
    assert acct.lost_by == {"queued": 512, "yielded": 104}
    _finish(acct, second, s, [2])
    third = Req("r3", [*range(1000), *range(7000, 7100), *range(9000, 9050)], arrival_time=0.0)
    acct.on_scheduled(third, 0, s, arrival=None)  # not known: all to "unpinned"
    assert acct.lost_by == {"queued": 512, "yielded": 104, "unpinned": 1100}
    assert sum(acct.lost_by.values()) == acct.recomputed_tokens
    assert acct.lost_shares() == "unpinned:0.64,queued:0.30,yielded:0.06"
    assert acct.snapshot().lost_by == acct.lost_by and acct.snapshot().lost_by is not acct.lost_by


def test_a_split_caps_the_queued_part_and_names_an_unknown_fate() -> None:
    from engine_adapter._lost_context import split_lost

    assert split_lost(1000, 1000, "yielded", 1000) == []  # nothing recomputed
    assert split_lost(1000, 0, "yielded", 4000) == [("queued", 1000)]  # all there at arrival, all lost waiting
    assert split_lost(1000, 600, "clamped", 200) == [("clamped", 400)]  # less at arrival than at admission
    with pytest.raises(ValueError, match="pause fate 'gone' is not one of"):
        split_lost(10, 0, "gone", 0)


def test_a_loss_recorded_in_a_pause_stays_whatever_pin_comes_later() -> None:
    from engine_adapter._lost_context import after_grant, after_unpin

    for loss in ("clamped", "yielded", "forced", "expired"):
        assert after_grant(loss, whole=True, clamped=False, held=True) == loss
        assert after_unpin(loss) == loss
    assert after_grant("unpinned", whole=True, clamped=False, held=True) == "pinned"
    assert after_grant("unpinned", whole=True, clamped=True, held=False) == "clamped"
    assert after_grant("unpinned", whole=False, clamped=True, held=True) == "unpinned"  # lost before the pin came
    assert after_unpin("pinned") == "unpinned"
