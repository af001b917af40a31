"""hintflow's rules under vLLM's async scheduling (``HintflowAsyncScheduler``), against the installed vLLM.

vLLM's CPU build never schedules asynchronously (its platform hook sets ``async_scheduling = False``,
even over ``--async-scheduling``), so a server here cannot show step N+1 being scheduled while step N
runs. Two layers instead, both skipped, saying why, where no Python has vLLM:

- in-process, in the vLLM venv's Python (``python -m tests.test_vllm_async MODEL``: one JSON report; no
  server, no model run): the classes against vLLM's real ``Scheduler`` and ``AsyncScheduler`` (MRO, which
  class each relied-on method resolves to, ``HintflowAutoScheduler``'s choice), and the scheduler driven
  the way ``EngineCore.step_with_batch_queue`` drives it with async scheduling (two steps out: step N+1
  is scheduled before step N's output is handed back; a stand-in model runner samples one token for each
  request whose prompt is done), beside the same run one step at a time (``EngineCore.step``);
- a real server (``--async-scheduling`` through ``build_vllm_command``): vLLM accepts the flag, the
  command names ``HintflowAsyncScheduler``, the engine core says it steps synchronously, and a pinned
  session survives a flood that evicts an unpinned one.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from collections import deque
from typing import TYPE_CHECKING, Any

import pytest

from engine_adapter.vllm_backend import ASYNC_SCHEDULER_CLS, REPO

if TYPE_CHECKING:
    from tests.vllm_support import ServerSpec

BS = 128  # vLLM's CPU block size
NUM_BLOCKS = 32  # 31 usable: vLLM keeps one null block


def _prompt(seed: int, tokens: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 1000) for _ in range(tokens)]


# ---- in the vLLM venv: the scheduler without a server ---------------------------------------------------


class _Engine:
    """vLLM's engine-core loop over a scheduler, with a stand-in model runner; ``depth`` steps out at most
    (1: ``EngineCore.step``; 2: ``step_with_batch_queue`` under async scheduling on the V1 runner)."""

    def __init__(self, sched: Any, depth: int) -> None:
        self.sched, self.depth = sched, depth
        self.out: deque[tuple[Any, Any]] = deque()
        self.hits: dict[str, int] = {}  # request id -> prefix-cache hit when first scheduled
        self.most_out = 0

    def _model_output(self, so: Any) -> Any:
        from vllm.v1.outputs import ModelRunnerOutput  # type: ignore[import-not-found]

        # decided now: whether this step finishes the request's prompt (then it samples a token)
        ids = list(so.num_scheduled_tokens)
        sampled = [[] if self.sched.requests[r].is_prefill_chunk else [7] for r in ids]
        return ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)}, sampled_token_ids=sampled)

    def step(self) -> None:
        if self.sched.has_requests() and len(self.out) < self.depth:
            so = self.sched.schedule()
            for new in so.scheduled_new_reqs:
                self.hits.setdefault(new.req_id, new.num_computed_tokens)
            self.out.append((so, self._model_output(so)))
            self.most_out = max(self.most_out, len(self.out))
            if len(self.out) < self.depth:
                return  # as vLLM: fill the batch queue before waiting for an output
        if self.out:
            self.sched.update_from_output(*self.out.popleft())

    def run(self, *requests: Any) -> None:
        for r in requests:
            self.sched.add_request(r)
        for _ in range(10_000):
            if not (self.sched.has_requests() or self.out):
                return
            self.step()
        raise AssertionError("the engine did not drain")


def _scheduler(model: str, engine_async: bool) -> tuple[Any, Any]:
    """(a scheduler built by ``HintflowAutoScheduler`` as vLLM's engine core builds it, a request factory)."""
    import torch
    from vllm import SamplingParams  # type: ignore[import-not-found]
    from vllm.engine.arg_utils import EngineArgs  # type: ignore[import-not-found]
    from vllm.utils.hashing import get_hash_fn_by_name  # type: ignore[import-not-found]
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # type: ignore[import-not-found]
    from vllm.v1.kv_cache_interface import (  # type: ignore[import-not-found]
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
    )
    from vllm.v1.request import Request  # type: ignore[import-not-found]
    from vllm.v1.structured_output import StructuredOutputManager  # type: ignore[import-not-found]

    from engine_adapter.vllm_backend._scheduler import HintflowAutoScheduler

    args = EngineArgs(
        model=model, dtype="float32", enforce_eager=True, max_model_len=2048, scheduling_policy="priority",
        num_gpu_blocks_override=NUM_BLOCKS,
    )  # fmt: skip
    config = args.create_engine_config()
    # The CPU platform has just turned async scheduling off; a CUDA vLLM would have left it on.
    config.scheduler_config.async_scheduling = engine_async
    config.cache_config.num_gpu_blocks = NUM_BLOCKS  # the engine core sets it after profiling
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=16, dtype=torch.float32)
    kv = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)])
    hash_fn = get_hash_fn_by_name(config.cache_config.prefix_caching_hash_algo)
    init_none_hash(hash_fn)
    hasher = get_request_block_hasher(BS, hash_fn)
    sched = HintflowAutoScheduler(
        vllm_config=config, kv_cache_config=kv, structured_output_manager=StructuredOutputManager(config),
        block_size=BS,
    )  # fmt: skip
    count = iter(range(10**9))

    def request(prompt: list[int], session: str | None = None, max_tokens: int = 1) -> Any:
        extra = {"program_id": f"p-{session}"} if session else None
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, extra_args=extra)
        return Request(f"r{next(count)}", prompt, params, None, block_hasher=hasher, session_id=session)

    return sched, request


def _pin_and_flood(model: str, depth: int) -> dict[str, Any]:
    """test_vllm_backend's flood test, in-process: A and B finish; Pin(A); a flood of 48 blocks goes through
    the 31-block pool; then A's and B's next turns. Also a deadlock-rule setting: three pinned sessions
    (18 blocks), an 8-block request with one output token and a 10-block request behind it, which fits
    once the first finishes (no pin need be dropped)."""
    from engine_adapter.vllm_backend._hint_service import apply_hints
    from hints import Pin

    sched, request = _scheduler(model, engine_async=depth > 1)
    engine = _Engine(sched, depth)
    a, b = _prompt(1, 5 * BS + 10), _prompt(2, 5 * BS + 10)
    engine.run(request(a, "a"))
    engine.run(request(b, "b"))
    pinned = apply_hints(sched, [Pin(session_id="a", ttl_s=60)])[0].pinned_blocks
    engine.run(*(request(_prompt(100 + i, 8 * BS)) for i in range(6)))
    ra, rb = request([*a, 7], "a"), request([*b, 7], "b")
    engine.run(rb)
    engine.run(ra)
    report: dict[str, Any] = {
        "class": type(sched).__name__, "pinned": pinned, "hit_a": engine.hits[ra.request_id],
        "hit_b": engine.hits[rb.request_id], "admitted_fit": sched.admit_stats["fit"],
        "admit_max_wait_s": sched.admit_max_wait_s, "host_tier": sched.host_tier is not None,
        "fcfs_slack": sched.fcfs_bound.slack,
    }  # fmt: skip
    for i in range(3):
        engine.run(request(_prompt(20 + i, 6 * BS + 2), f"g{i}"))
        apply_hints(sched, [Pin(session_id=f"g{i}", ttl_s=60)])
    report["pinned_before"] = sched.book.num_pinned_blocks
    sched.admit_guard = False  # the 10-block request is a new program's first turn: not what is tested here
    big, waiting = request(_prompt(30, 8 * BS)), request(_prompt(31, 10 * BS), "w")
    engine.run(big, waiting)
    report.update(
        forced_unpins=sched.book.stats.forced_unpins, pinned_after=sched.book.num_pinned_blocks,
        waiting_done=waiting.is_finished(), most_out=engine.most_out, steps_left=len(sched.steps),
    )  # fmt: skip
    return report


def _warm_first(model: str) -> dict[str, Any]:
    """An older program's cold turn and a younger one's warm resume, queued together: which goes first with
    the warm-first rule and without (strict program FCFS), and what the resume found cached."""
    sched, request = _scheduler(model, engine_async=False)
    engine = _Engine(sched, 1)
    sched.admit_guard, sched.aging_s = False, float("inf")
    engine.run(request(_prompt(5, BS), "old"))
    a = _prompt(4, 5 * BS + 10)
    engine.run(request(a, "young"))
    cold, warm = request(_prompt(6, 4 * BS), "old"), request([*a, 7, 8], "young")
    out: dict[str, Any] = {"is_warm": [sched.is_warm(warm), sched.is_warm(cold)]}
    sched.add_request(cold)
    sched.add_request(warm)
    out["warm_ahead_on"] = warm.priority < cold.priority
    sched.warm_first = False
    sched._sync_pinned_band()
    out["warm_ahead_off"] = warm.priority < cold.priority
    sched.warm_first = True
    sched._sync_pinned_band()
    engine.run()
    out["warm_hit"] = engine.hits[warm.request_id]
    return out


def _classes() -> dict[str, Any]:
    """Where each method that matters resolves in the two classes, against vLLM's real bases."""
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler  # type: ignore[import-not-found]
    from vllm.v1.core.sched.scheduler import Scheduler  # type: ignore[import-not-found]

    from engine_adapter.vllm_backend._hint_scheduler import HintSchedulerMixin
    from engine_adapter.vllm_backend._scheduler import HintflowAsyncScheduler, HintflowScheduler

    def owner(cls: type, name: str) -> str:
        return next(k.__name__ for k in cls.__mro__ if name in vars(k))

    ours = sorted(n for k in HintSchedulerMixin.__mro__[:-1] for n in vars(k) if hasattr(Scheduler, n) and not n.startswith("__"))
    async_own = sorted(n for n, v in vars(AsyncScheduler).items() if callable(v))
    return {
        "mro": {c.__name__: [k.__name__ for k in c.__mro__] for c in (HintflowScheduler, HintflowAsyncScheduler)},
        "ours": ours,
        "ours_resolve": {c.__name__: {n: owner(c, n) for n in ours} for c in (HintflowScheduler, HintflowAsyncScheduler)},
        "async_own": {n: owner(HintflowAsyncScheduler, n) for n in async_own},
    }


def _report(model: str) -> dict[str, Any]:
    return {"classes": _classes(), "async": _pin_and_flood(model, 2), "sync": _pin_and_flood(model, 1),
            "warm": _warm_first(model)}


# ---- the tests (here: the report comes from the vLLM venv) -----------------------------------------------


@pytest.fixture(scope="module")
def vllm_python() -> str:
    from tests.vllm_support import vllm_python_or_skip

    return vllm_python_or_skip()


@pytest.fixture(scope="module")
def report(vllm_python: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """:func:`_report` from the vLLM venv's Python (about 15 s: one vLLM import, two config builds)."""
    from tests.vllm_support import tiny_model

    model = tiny_model(tmp_path_factory, vllm_python)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    r = subprocess.run(
        [vllm_python, "-m", "tests.test_vllm_async", str(model)],
        capture_output=True, text=True, env=env, cwd=REPO, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    out: dict[str, Any] = json.loads(r.stdout.strip().splitlines()[-1])  # vLLM logs to stdout before it
    return out


def test_the_rules_go_in_front_of_both_of_vllms_schedulers(report: dict[str, Any]) -> None:
    c = report["classes"]
    assert c["mro"]["HintflowScheduler"][:4] == ["HintflowScheduler", "HintSchedulerMixin", "QueueRules", "Scheduler"]
    assert c["mro"]["HintflowAsyncScheduler"][:5] == [
        "HintflowAsyncScheduler", "HintSchedulerMixin", "QueueRules", "AsyncScheduler", "Scheduler",
    ]  # fmt: skip
    # every Scheduler method the rules override resolves to the rules in both classes
    assert {"_free_request_blocks", "_handle_blocked_waiting_request", "schedule", "update_from_output"} <= set(c["ours"])
    for cls in ("HintflowScheduler", "HintflowAsyncScheduler"):
        assert set(c["ours_resolve"][cls].values()) <= {"HintSchedulerMixin", "QueueRules"}, c["ours_resolve"][cls]
    # and what AsyncScheduler adds is still AsyncScheduler's: async scheduling is not lost under the rules
    own = dict(c["async_own"])
    assert own.pop("__init__") == "HintSchedulerMixin"  # which calls AsyncScheduler's (the class was built)
    assert own and set(own.values()) == {"AsyncScheduler"}, c["async_own"]


def test_the_auto_class_builds_the_one_that_matches_the_engine(report: dict[str, Any]) -> None:
    assert report["async"]["class"] == "HintflowAsyncScheduler"
    assert report["sync"]["class"] == "HintflowScheduler"


def test_a_node_without_a_host_tier_holds_new_programs_for_its_own_default(report: dict[str, Any]) -> None:
    """Program admission's longest hold: ADMIT_MAX_WAIT_S on a node without a host tier (not the aging
    bound, nor the host tier's ADMIT_MAX_WAIT_S_WITH_HOST), whatever the scheduler class; and the FCFS
    bound's slack is its device-only default (FCFS_SLACK, not the host tier's FCFS_SLACK_WITH_HOST)."""
    from engine_adapter.vllm_backend import ADMIT_MAX_WAIT_S, AGING_S, FCFS_SLACK, FCFS_SLACK_WITH_HOST

    assert ADMIT_MAX_WAIT_S != AGING_S
    assert FCFS_SLACK != FCFS_SLACK_WITH_HOST
    for mode in ("async", "sync"):
        assert report[mode]["host_tier"] is False
        assert report[mode]["admit_max_wait_s"] == ADMIT_MAX_WAIT_S
        assert report[mode]["fcfs_slack"] == FCFS_SLACK


def test_a_warm_resume_goes_ahead_of_an_older_programs_cold_turn(report: dict[str, Any]) -> None:
    """The warm-first rule on vLLM's real scheduler and block pool (``HINTFLOW_WARM_FIRST``): the resume's
    context is found cached, so it is keyed ahead of the older program's cold prompt; off, program FCFS."""
    w = report["warm"]
    assert w["is_warm"] == [True, False]
    assert w["warm_ahead_on"] is True
    assert w["warm_ahead_off"] is False
    assert w["warm_hit"] == 5 * BS


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_a_pinned_session_survives_a_flood_with_steps_in_flight(report: dict[str, Any], mode: str) -> None:
    r = report[mode]
    assert r["most_out"] == (2 if mode == "async" else 1)  # the async run did schedule ahead of its outputs
    assert r["pinned"] == 5  # _free_request_blocks reached: the session's book holds its finished turn
    assert r["hit_b"] == 0  # vLLM's default: the unpinned paused context is gone
    assert r["hit_a"] == 5 * BS  # pinned: it survived
    assert r["admitted_fit"] > 0  # _handle_blocked_waiting_request reached from vLLM's schedule()


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_the_deadlock_rule_waits_for_steps_in_flight(report: dict[str, Any], mode: str) -> None:
    """With two steps out, a step schedules nothing while the one before it computes a request's last token;
    counting that as a deadlock unpinned a program at every such step (4 unpins, 0 of 18 pinned blocks
    left, with the rule blind to steps in flight)."""
    r = report[mode]
    assert r["pinned_before"] == 18 and r["waiting_done"]
    assert r["forced_unpins"] == 0 and r["pinned_after"] == 18
    assert r["steps_left"] == 0  # every step it scheduled came back


def _async_spec() -> ServerSpec | None:
    """The session's ``async`` server: the shared one's pool, ``--async-scheduling`` through the serve command."""
    from engine_adapter.vllm_backend import find_vllm_python
    from tests.vllm_support import ServerSpec, free_port, want_server

    if find_vllm_python() is None:
        return None
    flags = [
        "--dtype", "float32", "--enforce-eager", "--max-model-len", "2048",
        "--num-gpu-blocks-override", str(NUM_BLOCKS), "--max-num-seqs", "1", "--async-scheduling",
    ]  # fmt: skip
    return want_server(ServerSpec(
        "async", flags, build_kw={"hint_port": free_port(), "pin_budget": 0.6, "infer_hints": False}
    ))  # fmt: skip


SERVER = _async_spec() if __name__ != "__main__" else None  # the vLLM venv's run (below) needs none


@pytest.mark.slow
def test_a_real_server_started_with_async_scheduling(
    vllm_python: str, tmp_path_factory: pytest.TempPathFactory, pytestconfig: pytest.Config
) -> None:
    """``--async-scheduling`` through the serve command: vLLM starts, our async class runs (synchronously:
    the CPU platform turns the mode off and the engine core says so), and pins hold under a flood."""
    from hints import Pin, Release
    from tests.test_vllm_backend import Node
    from tests.vllm_support import session_server

    assert SERVER is not None
    server = session_server("async", tmp_path_factory, pytestconfig)
    assert server.argv[server.argv.index("--scheduler-cls") + 1] == ASYNC_SCHEDULER_CLS
    node = Node(server.port, SERVER.build_kw["hint_port"], str(server.model))
    try:
        a, b = _prompt(1, 5 * BS + 10), _prompt(2, 5 * BS + 10)
        node.complete(a, "a", "pa")
        node.complete(b, "b", "pb")
        assert node.hints(Pin(session_id="a", ttl_s=60)).results[0].pinned_blocks == 5
        node.flood(6, 8 * BS, seed=3)  # 48 blocks through a 31-block pool
        assert node.cached(b + [7], "b", "pb") == 0
        assert node.cached(a + [7], "a", "pa") == 5 * BS
        node.hints(Release(program_id="pa"), Release(program_id="pb"))
    finally:
        node.channel.close()
    log = server.log_path.read_text()
    assert "HintflowAsyncScheduler on an engine that steps synchronously" in log
    assert "pins blocked all progress" not in log  # the deadlock rule never fired


if __name__ == "__main__":
    # Explicit hints only: B stays a vanilla control. The turn-end grace (test_vllm_sched_edges) would hold
    # a's context for 0.5 s past its turn, inside the deadlock setting's count of pinned blocks.
    os.environ.update(HINTFLOW_INFER_HINTS="0", HINTFLOW_PIN_GRACE_S="0")
    print(json.dumps(_report(sys.argv[1])))
