"""hintflow's host KV tier for vLLM (``_host_connector``), against the installed vLLM, in-process.

The run happens in the vLLM venv's Python (``python -m tests.test_vllm_host_tier MODEL STATE SCHEDULER``:
one JSON report, one process per scheduler: vLLM's KV-connector group is a process global), with vLLM's
engine in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so the scheduler and the
connector can be read directly; skipped, saying why, where no Python has vLLM. Under vLLM's own
scheduler and under hintflow's, with a 24-block pool:

- a 1,500-token prompt A, three unrelated prompts that flood A out of the device pool, then A again:
  the second A must find its full blocks on the host (external hits; copied there when the device
  evicted them, in the step that reused them) and produce the same log-probs as the first (the KV it
  loaded is the KV it computed: a copy made after that step's forward would carry another prompt's);
- the control: flooded out again, with the host copy overwritten by zeros, A's log-probs must differ
  (so the comparison above can fail);
- the blocks a load read go first in line for eviction once the step's copies are shipped (the device holds
  them again);
- the step trace (``HINTFLOW_STEP_TRACE``, ``_step_trace``) records each step as vLLM scheduled it, once:
  A's first prompt as one 1,500-token chunk, A again as the rest after what came back from the host,
  the host tier's copies in the steps that ran them, and every decode (stock vLLM's scheduler runs as the traced class the harness gives a traced stock node);
- hintflow's scheduler does not save a turn flagged ``is_last_turn`` when the device evicts it, puts the released program's host
  blocks first in line for eviction, and counts host hits as ``host_hit`` tokens; every device block is
  free again at the end (none lost to a delayed free).
"""

from __future__ import annotations

import itertools
import json
import os
import random
import subprocess
import sys
from typing import Any

import pytest

from engine_adapter.vllm_backend import REPO, SCHEDULER_CLS, TRACED_STOCK_SCHEDULER_CLS

NUM_BLOCKS = 24
HOST_TOKENS = 20_000


def _prompt(seed: int, n: int = 1500) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 500) for _ in range(n)]


# ---- in the vLLM venv -----------------------------------------------------------------------------------


def _run(model: str, scheduler_cls: str | None, prefix_caching: bool = True) -> dict[str, Any]:
    from vllm import LLM, SamplingParams  # type: ignore[import-not-found]
    from vllm.inputs import TokensPrompt  # type: ignore[import-not-found]

    kw: dict[str, Any] = {} if scheduler_cls is None else {"scheduler_cls": scheduler_cls}
    from engine_adapter.vllm_backend import host_tier_config

    # gpu_memory_utilization: on the CPU backend, the share of the machine's memory vLLM reserves (the default
    # 0.92 fails whenever anything else runs)
    llm = LLM(
        model=model, enforce_eager=True, num_gpu_blocks_override=NUM_BLOCKS, max_model_len=2048,
        dtype="float32", gpu_memory_utilization=0.1, kv_transfer_config=host_tier_config(HOST_TOKENS),
        enable_prefix_caching=prefix_caching, **kw,
    )  # fmt: skip
    core = llm.llm_engine.engine_core.engine_core
    sched = core.scheduler
    tier = sched.connector
    worker_tier = _worker_connector(core)

    def run(p: list[int], **extra: Any) -> dict[str, Any]:
        sp = SamplingParams(max_tokens=8, temperature=0.0, logprobs=1, extra_args=extra or None)
        o = llm.generate([TokensPrompt(prompt_token_ids=p)], sp, use_tqdm=False)[0]
        lps = [max(d.values(), key=lambda x: x.logprob).logprob for d in o.outputs[0].logprobs]
        return {"logprobs": lps, "cached": o.num_cached_tokens}

    a = _prompt(1)
    out: dict[str, Any] = {"first": run(a, program_id="pa")}
    for seed in (2, 3, 4):
        run(_prompt(seed))
    if scheduler_cls == SCHEDULER_CLS:  # what the router reads: the node's host tier, and pa's context on it
        from engine_adapter.vllm_backend._cache_state import cache_state

        st = cache_state(sched, include_sessions=True)
        pa = [x for x in st.sessions if x.session_id == "pa"]
        out["cache_state"] = {"host_total_blocks": st.host_total_blocks, "host_free_blocks": st.host_free_blocks,
                              "pa_host_tokens": pa[0].host_tokens if pa else None,
                              "host_reload_s_per_token": st.host_reload_s_per_token}  # fmt: skip
    if scheduler_cls == SCHEDULER_CLS:  # a waiting turn's hold on its host run (hold_for_waiting): locked, then let go
        hashes = sched.hash_blocks(a)
        on_host = len(tier.index.match(hashes, 0, len(hashes)))
        held = tier.hold_for_waiting("probe", hashes, 0, len(hashes))
        slots = [tier.index.slot_of(h) for h in hashes[:held]]
        locked = all(s in tier.index._locks for s in slots)
        num_held = tier.num_held_slots
        tier.release_hold("probe")
        out["hold"] = {"on_host": on_host, "held": held, "locked": locked, "num_held": num_held,
                       "after": tier.num_held_slots, "unlocked": not any(s in tier.index._locks for s in slots)}  # fmt: skip
    # The copies a load reads are spares once shipped: they must go first in line (HostIndex.release_loads)
    released: list[Any] = []
    release = tier.index.release_loads

    def recording(slots: list[int]) -> None:
        released.extend(tier.index.slot_hash(s) for s in slots)
        release(slots)

    tier.index.release_loads = recording
    out["again"] = run(a, program_id="pa", is_last_turn=True)  # under hintflow: releases program pa
    tier.index.release_loads = release
    order = tier.index.order()
    out["released_loads"] = len(released)
    out["released_first_in_line"] = set(order[: len(released)]) == set(released)
    for seed in (5, 6, 7):
        run(_prompt(seed))
    for t in worker_tier._host.values():
        t.zero_()
    out["corrupted"] = run(a)
    # A program's last turn, flooded off the device: is it on the host when it comes back?
    run(_prompt(8), program_id="p8", is_last_turn=True)
    for seed in (9, 10):
        run(_prompt(seed))
    out["last_turn_again"] = run(_prompt(8))
    out["stats"] = vars(tier.index.stats)
    out["delayed_frees"] = tier.num_delayed_frees
    out["host_hit_tokens"] = getattr(getattr(sched, "accounting", None), "host_hit_tokens", None)
    # A save holds its request's blocks until the next step copies them; vLLM keeps stepping while it
    # does (a server's busy loop; offline, generate() has already returned, so step here).
    out["saves_after_generate"] = len(tier._in_flight_req_ids)
    out["engine_keeps_stepping"] = bool(sched.has_requests())
    for _ in range(4):
        if not sched.has_requests():
            break
        core.step()
    pool = sched.kv_cache_manager.block_pool
    out["free_blocks"], out["usable_blocks"] = pool.get_num_free_blocks(), pool.num_gpu_blocks - 1
    if scheduler_cls == SCHEDULER_CLS:  # the host tier's own pin budget (HINTFLOW_PIN_BUDGET unset)
        out["pin_budget_blocks"] = sched.book.pin_budget_blocks
        out["fcfs_slack"] = sched.fcfs_bound.slack  # (HINTFLOW_FCFS_SLACK unset: the host tier's default)
    out["in_flight_saves"] = len(tier._in_flight_req_ids)
    from engine_adapter.vllm_backend._step_trace import step_trace

    trace = step_trace("")  # (opened by the scheduler or the connector at the first step: HINTFLOW_STEP_TRACE)
    out["trace"] = [json.loads(x) for x in trace.path.read_text().splitlines()] if trace is not None else None
    return out


def _worker_connector(core: Any) -> Any:
    """The worker-side connector (same process: vLLM's uniproc executor)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group  # type: ignore[import-not-found]

    return get_kv_transfer_group()


def _report(model: str, state: str, scheduler: str) -> dict[str, Any]:
    for var, sub in (("VLLM_CACHE_ROOT", "cache"), ("TORCHINDUCTOR_CACHE_DIR", "inductor"),
                     ("VLLM_RPC_BASE_PATH", "rpc")):  # fmt: skip
        os.makedirs(os.path.join(state, sub), exist_ok=True)
        os.environ[var] = os.path.join(state, sub)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["HINTFLOW_STEP_TRACE"] = os.path.join(state, "steps")  # (both schedulers write one)
    if scheduler == "no-prefix-caching":  # must fail at start-up, naming the reason
        return _run(model, None, prefix_caching=False)
    # stock: vLLM's scheduler as the harness runs it while tracing (TracedAutoScheduler, which writes the
    # trace as the connector does: each step once)
    return _run(model, SCHEDULER_CLS if scheduler == "hintflow" else TRACED_STOCK_SCHEDULER_CLS)


# ---- the tests --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, subprocess.CompletedProcess[str]]:
    """The three runs (vLLM's scheduler, hintflow's, and one without prefix caching that must refuse to
    start), each its own process, started together: each spends most of its time importing vLLM on one
    core, so on a 2-core machine running them side by side roughly halves the wait."""
    from tests.vllm_support import tiny_model, vllm_python_or_skip

    python = vllm_python_or_skip()
    model = tiny_model(tmp_path_factory, python)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    env.pop("HINTFLOW_PIN_BUDGET", None)  # the node's own default is checked
    procs = {}
    for scheduler in ("stock", "hintflow", "no-prefix-caching"):
        state = tmp_path_factory.mktemp(f"host-tier-{scheduler}")
        procs[scheduler] = subprocess.Popen(
            [python, "-m", "tests.test_vllm_host_tier", str(model), str(state), scheduler],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO,
        )  # fmt: skip
    out = {}
    try:
        for scheduler, proc in procs.items():
            stdout, stderr = proc.communicate(timeout=600)
            out[scheduler] = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return out


@pytest.fixture(scope="module")
def report(runs: dict[str, subprocess.CompletedProcess[str]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for scheduler in ("stock", "hintflow"):
        r = runs[scheduler]
        assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
        out[scheduler] = json.loads(r.stdout.strip().splitlines()[-1])  # vLLM logs to stdout before it
    return out


@pytest.mark.parametrize("scheduler", ["stock", "hintflow"])
def test_a_flooded_prefix_comes_back_from_the_host_with_the_same_kv(report: dict[str, Any], scheduler: str) -> None:
    r = report[scheduler]
    assert r["first"]["cached"] == 0
    assert r["again"]["cached"] >= 1280, r  # 10+ full blocks of 128 found (on the host: the pool was flooded)
    assert r["stats"]["num_loaded_blocks"] >= 10
    assert r["again"]["logprobs"] == pytest.approx(r["first"]["logprobs"], abs=1e-3)


@pytest.mark.parametrize("scheduler", ["stock", "hintflow"])
def test_a_loaded_blocks_host_copy_goes_first_in_line(report: dict[str, Any], scheduler: str) -> None:
    r = report[scheduler]
    assert r["released_loads"] >= 10, r  # the connector released the slots of the load it shipped ...
    assert r["released_first_in_line"], r  # ... to the front of the eviction order


@pytest.mark.parametrize("scheduler", ["stock", "hintflow"])
def test_the_comparison_can_fail_a_zeroed_host_copy_changes_the_output(report: dict[str, Any], scheduler: str) -> None:
    r = report[scheduler]
    assert r["corrupted"]["cached"] >= 1280  # it did load (zeros) from the host
    assert r["corrupted"]["logprobs"] != pytest.approx(r["first"]["logprobs"], abs=1e-3)


@pytest.mark.parametrize("scheduler", ["stock", "hintflow"])
def test_no_device_block_is_left_held_by_a_save(report: dict[str, Any], scheduler: str) -> None:
    r = report[scheduler]
    # blocks are saved when the device evicts them: a finished turn never waits for a copy
    assert r["delayed_frees"] == 0, r
    if r["saves_after_generate"]:
        assert r["engine_keeps_stepping"]  # the engine does not go idle with blocks held for a copy
    assert r["in_flight_saves"] == 0
    assert r["free_blocks"] == r["usable_blocks"], r


def test_without_prefix_caching_the_host_tier_refuses_to_start(runs: dict[str, subprocess.CompletedProcess[str]]) -> None:
    r = runs["no-prefix-caching"]
    assert r.returncode != 0
    assert "HintflowHostTier needs vLLM's prefix caching" in r.stdout + r.stderr


def test_the_routers_cache_state_shows_the_host_tier(report: dict[str, Any]) -> None:
    st = report["hintflow"]["cache_state"]
    assert st["host_total_blocks"] == HOST_TOKENS // 128
    assert 0 < st["host_free_blocks"] < st["host_total_blocks"]
    assert st["pa_host_tokens"] >= 1280  # program pa's 11 full blocks, flooded off the device
    from engine_adapter.vllm_backend import HOST_RELOAD_S_PER_TOKEN

    assert st["host_reload_s_per_token"] == HOST_RELOAD_S_PER_TOKEN  # the node's one figure, for the router


def test_a_waiting_turns_hold_locks_its_host_run_until_let_go(report: dict[str, Any]) -> None:
    hold = report["hintflow"]["hold"]
    assert hold["held"] == hold["on_host"] > 0  # pa's flooded context, on the host, all of it held
    assert hold["locked"] and hold["num_held"] == hold["held"]
    assert hold["after"] == 0 and hold["unlocked"]


def test_with_a_host_tier_pins_hold_the_host_tiers_budget(report: dict[str, Any]) -> None:
    from engine_adapter.vllm_backend import FCFS_SLACK, FCFS_SLACK_WITH_HOST, PIN_BUDGET_WITH_HOST

    r = report["hintflow"]
    assert r["pin_budget_blocks"] == int(PIN_BUDGET_WITH_HOST * r["usable_blocks"])
    assert r["fcfs_slack"] == FCFS_SLACK_WITH_HOST != FCFS_SLACK  # the FCFS bound's default with the tier


def test_hintflow_skips_saving_a_last_turn_and_counts_host_hits(report: dict[str, Any]) -> None:
    # the last turn's blocks were evicted from the device and not saved: nothing of it is found
    assert report["hintflow"]["last_turn_again"]["cached"] == 0
    assert report["hintflow"]["stats"]["num_demoted_blocks"] >= 11  # program pa's blocks, at its release
    assert report["stock"]["stats"]["num_demoted_blocks"] == 0
    assert report["stock"]["last_turn_again"]["cached"] >= 1280  # vLLM's scheduler knows no last turn
    assert report["hintflow"]["host_hit_tokens"] >= 2 * 1280  # "again" and "corrupted"


if __name__ == "__main__":
    print(json.dumps(_report(sys.argv[1], sys.argv[2], sys.argv[3])))


@pytest.mark.parametrize("scheduler", ["stock", "hintflow"])
def test_the_step_trace_records_each_step_as_vllm_scheduled_it(report: dict[str, Any], scheduler: str) -> None:
    header, *steps = report[scheduler]["trace"]
    assert header["scheduler"] == ("hintflow" if scheduler == "hintflow" else "vllm")  # one file, either way
    chunks = [c for s in steps for c in s[2]]
    assert [1500, 0] in chunks  # A's first time: nothing cached
    loaded = report[scheduler]["again"]["cached"]
    assert loaded > 0 and [1500 - loaded, loaded] in chunks  # A again: only what did not come back
    assert all(s[1] == sum(n for n, _ in s[2]) + s[3] for s in steps)  # every scheduled token is in a line
    assert sum(s[3] for s in steps) == 7 * 13  # 13 prompts of 8 tokens, each 7 decodes after its prefill
    stats = report[scheduler]["stats"]  # the host tier's copies, in the steps that ran them
    assert sum(s[5] for s in steps) == stats["num_loaded_blocks"] > 0
    assert sum(s[6] for s in steps) >= stats["num_saved_blocks"] > 0  # (the trace also has the last steps')
    assert all(a[0] <= b[0] for a, b in itertools.pairwise(steps))
    # the pool and the queue once each step is placed (StepTrace.pool_state), from either scheduler: free
    # blocks within the pool, pins only on hintflow's node, and a step's requests among the running (a step
    # that scheduled nothing, the last saves', may have none)
    usable = report[scheduler]["usable_blocks"]
    assert all(len(s) == 11 and 0 <= s[7] <= usable and s[9] >= 0 and (s[10] >= 1 or not s[1]) for s in steps)
    assert scheduler == "hintflow" or all(s[8] == 0 for s in steps)
