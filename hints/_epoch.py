"""A node's epoch: which life of a node process a hint was meant for.

Why: a node that restarts comes back empty, on the same address. Hints queued for it while it was down
(pins, eviction orders, releases of the sessions it held) name sessions of its earlier life; applied to
the new one they would at best miss and at worst act on a new session that reuses an id. Each node
draws a random nonzero epoch when it starts and reports it (``CacheState.node_epoch``, ``HintAck``); a
sender stamps each batch with the epoch it knew when the hints were made (``HintBatch.node_epoch``, 0
before it knew one), and a node applies none of a batch stamped with another epoch. Both engines (the
embedded node and the vLLM node's hint service) answer with :func:`stale_batch_results`.
"""

from __future__ import annotations

import secrets

from hints._models import HintResult

__all__ = ["new_node_epoch", "stale_batch_results"]

_EPOCH_BITS = 63  # fits int64 as well as uint64 (a node's id in logs and JSON)


def new_node_epoch() -> int:
    """A random nonzero epoch for a node process that is starting."""
    return secrets.randbits(_EPOCH_BITS) or 1


def stale_batch_results(batch_epoch: int, node_epoch: int, num_hints: int) -> list[HintResult] | None:
    """None if a batch stamped ``batch_epoch`` is for this node's life (or for any: 0); else one
    ``FAILED_PRECONDITION`` result per hint, none applied."""
    if batch_epoch == 0 or batch_epoch == node_epoch:
        return None
    msg = (f"hint batch meant for node epoch {batch_epoch}, this node is epoch {node_epoch} "
           "(it restarted since): not applied")  # fmt: skip
    return [HintResult(index=i, code="FAILED_PRECONDITION", message=msg) for i in range(num_hints)]
