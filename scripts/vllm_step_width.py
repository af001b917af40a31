"""How wide the real vLLM nodes' steps are while a ``hintflow replay --backend vllm`` sitting runs.

Run it beside a sitting (``python scripts/vllm_step_width.py watch OUT.jsonl SECONDS &``): every 2 s it
reads the /metrics of each replay server whose log is being written (``/tmp/hintflow-replay-vllm``) and
appends vLLM's own counters: ``vllm:iteration_tokens_total`` (tokens scheduled per engine step, a
histogram: its sum and count), requests waiting and running, prompt and generation tokens, preemptions.
Then ``python scripts/vllm_step_width.py report OUT.jsonl`` prints, per server run, over the stretch where
ten or more requests waited (the load's peak): steps a second, tokens a step, tokens a second, ms a step,
decode tokens a step and requests running. Why: at the same queue a node that runs fewer requests at once
takes more, narrower steps, and each step has a fixed cost (docs/benchmarks.md, "Batch width").
"""

from __future__ import annotations

import collections
import glob
import json
import os
import re
import sys
import time

from replay import vllm_counters

LOG_DIR = "/tmp/hintflow-replay-vllm"
SERIES = (
    "vllm:iteration_tokens_total_sum", "vllm:iteration_tokens_total_count", "vllm:num_requests_waiting",
    "vllm:num_requests_running", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
    "vllm:num_preemptions_total",
)  # fmt: skip


def watch(out_path: str, seconds: float) -> None:
    with open(out_path, "a") as out:
        end = time.time() + seconds
        while time.time() < end:
            for log in glob.glob(f"{LOG_DIR}/*.log"):
                if os.path.getmtime(log) < time.time() - 5:
                    continue  # not the server running now
                with open(log) as f:
                    m = re.search(r"'port': (\d+)", f.read(20000))
                if m is None:
                    continue
                values = vllm_counters(f"http://127.0.0.1:{m.group(1)}", SERIES)
                if values is None:
                    continue  # (not up yet, or gone)
                row: dict[str, float | str] = {"t": time.time(), "log": os.path.basename(log)}
                row.update({name.split(":")[1]: v for name, v in values.items()})
                out.write(json.dumps(row) + "\n")
                out.flush()
            time.sleep(2)


def report(path: str) -> None:
    by_log: dict[str, list[dict]] = collections.defaultdict(list)
    with open(path) as f:
        for line in f:
            r = json.loads(line)
            if "iteration_tokens_total_count" in r:
                by_log[r["log"]].append(r)
    for log, rows in by_log.items():
        runs: list[list[dict]] = [[]]
        for r in rows:  # a new server (counters restart) or a gap starts a new run
            prev = runs[-1][-1] if runs[-1] else None
            if prev and (r["t"] - prev["t"] > 20 or r["iteration_tokens_total_count"] < prev["iteration_tokens_total_count"]):
                runs.append([])
            runs[-1].append(r)
        for k, run in enumerate(runs):
            peak = [i for i, r in enumerate(run) if r.get("num_requests_waiting", 0) >= 10]
            if len(peak) < 2:
                continue
            a, b = run[peak[0]], run[peak[-1]]
            steps = b["iteration_tokens_total_count"] - a["iteration_tokens_total_count"]
            tokens = b["iteration_tokens_total_sum"] - a["iteration_tokens_total_sum"]
            decode = b["generation_tokens_total"] - a["generation_tokens_total"]
            secs = b["t"] - a["t"]
            running = sum(r.get("num_requests_running", 0) for r in run[peak[0] : peak[-1] + 1]) / (len(run[peak[0] : peak[-1] + 1]))
            print(
                f"{log:26s} run {k}: peak {secs:4.0f} s  steps/s {steps / secs:5.1f}  tokens/step {tokens / steps:5.0f}"
                f"  tokens/s {tokens / secs:6.0f}  ms/step {secs / steps * 1e3:5.1f}  decode tokens/step {decode / steps:4.1f}"
                f"  running {running:4.1f}"
            )


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "watch":
        watch(sys.argv[2], float(sys.argv[3]))
    elif len(sys.argv) == 3 and sys.argv[1] == "report":
        report(sys.argv[2])
    else:
        sys.exit(__doc__)
