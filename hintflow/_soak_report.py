"""What a ``hintflow soak`` run did, read from where it is real, and the report that says so.

Programs are counted from their results (``_soak.Program``); retries and model calls from each workflow's
history; what an unfinished program waits on from its pending activities; failovers from the workers' logs;
migrations from the workers' ``/metrics`` (``_soak_fleet.Fleet.migrations``); pools from each node's
``GetCacheState``, once every node holds nothing or ``POOL_SETTLE_S`` has passed.  ``build_report`` gathers
them into one dict (what ``--json`` prints), ``format_report`` into lines for a person.
"""

from __future__ import annotations

import asyncio
import collections
import statistics
import time
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from hintflow._soak_chaos import Chaos
from hintflow._soak_fleet import Fleet, Member

if TYPE_CHECKING:  # (_soak imports this module to run the report: its types only, not a cycle at run time)
    from hintflow._soak import Program, Soak

__all__ = ["POOL_SETTLE_S", "build_report", "format_report", "settle_pools"]

POOL_SETTLE_S = 60.0
"""After the last program ends, how long a node may take to hold nothing: its programs' releases arrive at
once; a pin from a killed worker's runtime lapses within its TTL (tool pauses here are at most 10 s)."""
_MODEL_CALL = "hintflow.llm"  # the activity type of a model call (a turn); every other activity is a tool
_FAILOVER_LINE = "model call failed over to"  # the runtime's INFO line for a call rerun on another node


async def _history(program: Program) -> dict[str, Any]:
    """From the workflow's history: its model calls, and the activities that ran more than one attempt
    (history records an activity's start once, with the attempt that ended it) with the last failure."""
    from temporalio.api.enums.v1 import TimeoutType

    kinds: dict[int, str] = {}
    out: dict[str, Any] = {"num_model_calls": 0, "num_turns_retried": 0, "num_tools_retried": 0, "causes": []}
    async for e in program.handle.fetch_history_events():
        if e.HasField("activity_task_scheduled_event_attributes"):
            kinds[e.event_id] = e.activity_task_scheduled_event_attributes.activity_type.name
        elif e.HasField("activity_task_started_event_attributes"):
            a = e.activity_task_started_event_attributes
            is_call = kinds.get(a.scheduled_event_id) == _MODEL_CALL
            out["num_model_calls"] += is_call
            if a.attempt > 1:
                out["num_turns_retried" if is_call else "num_tools_retried"] += 1
                heartbeat = (
                    a.last_failure.timeout_failure_info.timeout_type == TimeoutType.TIMEOUT_TYPE_HEARTBEAT
                )
                out["causes"].append("heartbeat timeout" if heartbeat else a.last_failure.message[:100])
    return out


async def _pending(program: Program) -> str:
    """What an unfinished program waits on: its pending activities, their attempts and last failures."""
    try:
        desc = await asyncio.wait_for(program.handle.describe(), 5.0)
    except Exception as exc:
        return f"(describe failed: {exc})"
    acts = desc.raw_description.pending_activities
    parts = [
        f"{a.activity_type.name} attempt {a.attempt}"
        + (f" (last failure: {a.last_failure.message[:100]})" if a.last_failure.message else "")
        for a in acts
    ]
    return "; ".join(parts) or f"status {desc.status.name if desc.status else '?'}, no activity pending"


async def _pool(m: Member) -> dict[str, Any]:
    """The node's pool now: blocks free and used, pinned, in flight, sessions; ``whole``: it holds nothing."""
    from hints import EngineClient

    row: dict[str, Any] = {"name": m.name, "address": m.address, "lives": m.num_lives}
    if not m.alive:
        return row | {"error": "not running", "whole": False}
    try:
        async with EngineClient(m.address) as c:
            st = await asyncio.wait_for(c.get_cache_state(include_sessions=True), 5.0)
    except Exception as exc:
        return row | {"error": f"GetCacheState failed: {exc}", "whole": False}
    row |= {
        "pool_blocks": st.total_blocks,
        "free_blocks": st.free_blocks,
        "used_blocks": st.total_blocks - st.free_blocks,
        "pinned_blocks": st.pinned_blocks,
        "in_flight": st.num_running + st.num_waiting,
        "sessions": len(st.sessions),
        "session_tokens": sum(s.device_tokens for s in st.sessions),
        "host_pool_blocks": st.host_total_blocks,
        "host_free_blocks": st.host_free_blocks,
    }
    row["whole"] = (
        row["free_blocks"] == row["pool_blocks"]
        and row["host_free_blocks"] == row["host_pool_blocks"]
        and (row["pinned_blocks"], row["in_flight"], row["sessions"]) == (0, 0, 0)
    )
    return row


async def settle_pools(nodes: list[Member], timeout_s: float) -> list[dict[str, Any]]:
    """Every node's pool once all are whole, or as they stand after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        rows = list(await asyncio.gather(*(_pool(n) for n in nodes)))
        if all(r["whole"] for r in rows) or time.monotonic() > deadline:
            return rows
        await asyncio.sleep(0.5)


async def build_report(soak: Soak, fleet: Fleet, chaos: Chaos, pools: list[dict[str, Any]]) -> dict[str, Any]:
    cfg, programs = soak.cfg, soak.programs
    sem = asyncio.Semaphore(8)

    async def history(p: Program) -> dict[str, Any]:
        async with sem:
            return await _history(p)

    histories = await asyncio.gather(*(history(p) for p in programs))
    unfinished = [p for p in programs if not p.done]
    pending = await asyncio.gather(*(_pending(p) for p in unfinished))
    causes = collections.Counter(c for h in histories for c in h["causes"])
    by_example: dict[str, list[int]] = {}
    for p in programs:
        row = by_example.setdefault(p.example, [0, 0])
        row[0] += 1
        row[1] += p.finished_s is not None
    jcts = [p.finished_s - p.started_s for p in programs if p.finished_s is not None]
    worker_logs = sorted(soak.log_dir.glob("worker-*.log"))
    migrations = fleet.migrations()
    num_finished = len(jcts)
    ok = num_finished == len(programs) and bool(pools) and all(r["whole"] for r in pools)
    problems = []
    if num_finished < len(programs):
        problems.append(f"{len(programs) - num_finished} of {len(programs)} programs did not finish")
    problems += [f"{r['name']} is not whole" for r in pools if not r["whole"]]
    return {
        "config": asdict(cfg),
        "task_queue": soak.task_queue,
        "log_dir": str(soak.log_dir),
        "window_s": cfg.minutes * 60.0,
        "wall_s": time.monotonic() - soak.t0,
        "programs": {
            "started": len(programs),
            "finished": num_finished,
            "failed": sum(p.failure is not None for p in programs),
            "unfinished": len(unfinished),
            "by_example": {k: {"started": s, "finished": f} for k, (s, f) in sorted(by_example.items())},
            "jct_mean_s": statistics.fmean(jcts) if jcts else 0.0,
            "jct_max_s": max(jcts, default=0.0),
        },
        "failures": [{"workflow_id": p.workflow_id, "failure": p.failure} for p in programs if p.failure],
        "unfinished": [
            {"workflow_id": p.workflow_id, "pending": w} for p, w in zip(unfinished, pending, strict=True)
        ],
        "model_calls": sum(h["num_model_calls"] for h in histories),
        "turns_retried": sum(h["num_turns_retried"] for h in histories),
        "tools_retried": sum(h["num_tools_retried"] for h in histories),
        "retry_causes": dict(causes.most_common()),
        "failovers": sum(p.read_text(errors="replace").count(_FAILOVER_LINE) for p in worker_logs),
        "chaos": asdict(chaos.counts),
        "migrations": {
            "reported": migrations.reported,
            "done": migrations.num_done,
            "failed": migrations.num_failed,
            "skipped": migrations.num_skipped,
            "note": "" if migrations.reported else "not yet: the runtime does not migrate",
        },
        "nodes": pools,
        "num_processes_started": len(fleet.pids),
        "ok": ok,
        "verdict": "PASS: every program finished and every pool is whole"
        if ok
        else "FAIL: " + "; ".join(problems),
    }


def format_report(r: dict[str, Any]) -> str:
    cfg, pr, ch, mg = r["config"], r["programs"], r["chaos"], r["migrations"]
    lines = [
        f"hintflow soak: {cfg['minutes']:g} min of arrivals at {cfg['rate_per_s']:g}/s, {cfg['num_nodes']} nodes "
        f"({cfg['num_device_blocks']} device + {cfg['num_host_blocks']} host blocks), {cfg['num_workers']} "
        f"workers, chaos every ~{cfg['chaos_interval_s']:g} s, seed {cfg['seed']}; wall {r['wall_s']:.0f} s",
        f"programs    started {pr['started']}, finished {pr['finished']}, failed {pr['failed']}, unfinished "
        f"{pr['unfinished']}; JCT mean {pr['jct_mean_s']:.1f} s, max {pr['jct_max_s']:.1f} s",
        "            "
        + ", ".join(f"{k} {v['finished']}/{v['started']}" for k, v in pr["by_example"].items()),
    ]
    lines += [f"  failed    {f['workflow_id']}: {f['failure']}" for f in r["failures"]]
    lines += [f"  waiting   {u['workflow_id']}: {u['pending']}" for u in r["unfinished"]]
    causes = ", ".join(f"{c} {n}" for c, n in r["retry_causes"].items())
    lines += [
        f"turns       {r['model_calls']} model calls; retried {r['turns_retried']} (attempt > 1), tools retried "
        f"{r['tools_retried']}" + (f"; last failures: {causes}" if causes else ""),
        f"failovers   {r['failovers']} model calls run again on another node within their attempt",
        f"chaos       node kills {ch['num_node_kills']} (restarted {ch['num_node_restarts']}), worker kills "
        f"{ch['num_worker_kills']} (restarted {ch['num_worker_restarts']}), migration cuts "
        f"{ch['num_migration_cuts']} (cuts with none in flight {ch['num_cuts_not_found']}), restarts failed "
        f"{ch['num_restart_failures']}",
        f"migrations  done {mg['done']}, failed {mg['failed']}, not tried (recomputing was quicker) "
        f"{mg['skipped']}" + (f" ({mg['note']})" if mg["note"] else ""),
        f"{'node':<8} {'lives':>5} {'pool':>5} {'free':>5} {'used':>5} {'pinned':>6} {'in-flight':>9} "
        f"{'sessions':>8} {'host free/pool':>14}  whole",
    ]
    for n in r["nodes"]:
        if "error" in n:
            lines.append(f"{n['name']:<8} {n['lives']:>5}  {n['error']}")
            continue
        lines.append(
            f"{n['name']:<8} {n['lives']:>5} {n['pool_blocks']:>5} {n['free_blocks']:>5} {n['used_blocks']:>5} "
            f"{n['pinned_blocks']:>6} {n['in_flight']:>9} {n['sessions']:>8} "
            f"{str(n['host_free_blocks']) + '/' + str(n['host_pool_blocks']):>14}  {'yes' if n['whole'] else 'NO'}"
        )
    lines.append(f"verdict     {r['verdict']}")
    return "\n".join(lines)
