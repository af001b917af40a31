"""What a hintflow vLLM node says about its own load while a benchmark runs: its ``CacheState`` readings of
the measured pin price (``prefill_share``, ``unpinned_survival``), sampled once a second over its hint port
while it has work, averaged over the run.

Why a benchmark records them: the replay's prediction of a real node (``scripts/vllm_predict.py``) fits its
cost model to the stock run's latencies, and more than one split of a step between prefill and decode fits
those; the pin price depends on that split, so the node's own prefill share picks the right one.
"""

from __future__ import annotations

import threading
from typing import Any

__all__ = ["NodeReadings"]


class NodeReadings:
    """A thread that samples a node's ``CacheState`` every ``period_s`` until :meth:`stop`."""

    def __init__(self, hint_address: str, period_s: float = 1.0) -> None:
        import grpc

        from hints import engine_pb2_grpc

        self.period_s = period_s
        self._channel = grpc.insecure_channel(hint_address)
        self._stub = engine_pb2_grpc.EngineNodeStub(self._channel)
        self.samples: list[tuple[float, float]] = []  # (prefill_share, unpinned_survival) while busy
        self.num_failed = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="node-readings", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        from hints import engine_pb2

        while not self._stop.wait(self.period_s):
            try:
                state = self._stub.GetCacheState(engine_pb2.WatchCacheStateRequest(), timeout=2)
            except Exception:  # a missed sample is not a failed benchmark
                self.num_failed += 1
                continue
            if state.num_running + state.num_waiting > 0:
                self.samples.append((float(state.prefill_share), float(state.unpinned_survival)))

    def stop(self) -> dict[str, Any]:
        """Stop sampling; the means over the samples taken while the node had work (none: nothing)."""
        self._stop.set()
        self._thread.join(timeout=5)
        self._channel.close()
        if not self.samples:
            return {}
        n = len(self.samples)
        return {"node_prefill_share": sum(p for p, _ in self.samples) / n,
                "node_unpinned_kept": sum(s for _, s in self.samples) / n,
                "node_readings": n}
