"""Which node a hint goes to: one rule for the live runtime (``workflows/_runtime.py``) and the replay
(``replay/_sim.py``).

A hint about a session goes to the node holding the session (its last turn's node); a session no turn
has placed yet, e.g. one whose model calls did not go through our nodes, is hinted to every node (a node
without it answers NOT_FOUND, but records it from a ``Priority`` that names its program, until the
program's ``Release``).  ``Release`` goes to every node: a program's sessions may be anywhere.  An
``EvictionOrder`` is split by its entries' sessions, so each node gets only the entries it can use.
Plain Python, no I/O.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence

from hints import EvictionOrder, HintModel, NextUse, Release

__all__ = ["hints_by_node"]


def hints_by_node(
    hints: Sequence[HintModel], node_of: Callable[[str], str | None], nodes: Sequence[str]
) -> dict[str, list[HintModel]]:
    """``hints`` addressed to ``nodes``: ``node_of(session_id)`` is the session's node, or None when it has
    none of the ``nodes``.  Each node's hints keep the order they came in."""
    every = list(nodes)

    def targets(session_id: str) -> list[str]:
        node = node_of(session_id)
        return [node] if node is not None else every

    per_node: dict[str, list[HintModel]] = defaultdict(list)
    for h in hints:
        if isinstance(h, Release):
            for a in every:
                per_node[a].append(h)
        elif isinstance(h, EvictionOrder):
            split: dict[str, list[NextUse]] = defaultdict(list)
            for e in h.entries:
                for a in targets(e.session_id):
                    split[a].append(e)
            for a, entries in split.items():
                per_node[a].append(EvictionOrder(entries=entries))
        else:
            for a in targets(getattr(h, "session_id", "")):
                per_node[a].append(h)
    return dict(per_node)
