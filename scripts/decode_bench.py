"""Decode-step time of the torch executor at the demo nodes' shape (hidden 256, 4 layers, 4 heads / 2 KV
heads; one torch thread, CPU unless a device is given): 1 and 16 sequences at a 1,000-token context.

Usage: ``python3 scripts/decode_bench.py [cpu|cuda] [thread|main]``.  Prints the median and best of 100
steps, wall clock, each after one untimed step, stepped on a thread of its own as a node steps (default) or
on the main thread as the torch replay and the profiler do (glibc gives threads their own malloc arenas,
which behave differently from the main thread's; ``main`` keeps freed memory as those callers do).  A small batch costs per-op dispatch
rather than FLOPs, so this tracks how many ops a layer runs.
"""

from __future__ import annotations

import statistics
import sys
import threading
import time

import torch

from engine_adapter import ScheduledBatch, ScheduledSeq, TorchExecutor, TorchModelConfig, retain_freed_memory

CTX, BLOCKS_PER_SEQ, ROUNDS = 1000, 63, 100


def bench(device: str) -> None:
    torch.set_num_threads(1)
    cfg = TorchModelConfig(
        hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=512, max_model_len=4096
    )
    ex = TorchExecutor(cfg, num_device_blocks=16 * BLOCKS_PER_SEQ, device=device)
    for num_seqs in (1, 16):
        seqs = [
            ScheduledSeq(
                f"d{i}", [1], CTX - 1, list(range(i * BLOCKS_PER_SEQ, (i + 1) * BLOCKS_PER_SEQ)), True
            )
            for i in range(num_seqs)
        ]
        batch = ScheduledBatch(seqs)
        ex.execute(batch)
        times = []
        for _ in range(ROUNDS):
            t0 = time.perf_counter()
            ex.execute(batch)
            times.append(time.perf_counter() - t0)
        print(
            f"{num_seqs} decodes at {CTX} tokens on {device}: median {statistics.median(times) * 1e3:.3f} ms, "
            f"best {min(times) * 1e3:.3f} ms"
        )


def main() -> None:
    device = sys.argv[1] if len(sys.argv) > 1 else "cpu"
    if (sys.argv[2] if len(sys.argv) > 2 else "thread") == "main":
        retain_freed_memory()
        bench(device)
        return
    stepper = threading.Thread(target=bench, args=(device,), name="hintflow-engine-bench")
    stepper.start()
    stepper.join()


if __name__ == "__main__":
    main()
