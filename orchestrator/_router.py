"""Which engine node serves a turn: warm-but-busy versus cold-but-idle, priced in seconds.

A node holding a session's KV (or a prefix shared across sessions) saves recomputing it, but if its queue
is long the turn waits longer there than a cold node takes to recompute. So each candidate is priced::

    cost = wait + prefill_s(context - warm, warm) + host_reload_s_per_token * warm_on_host
    wait = backlog_s + Σ pending prefill_s + decode_s_per_running_seq * (num_running + num_pending)

``host_reload_s_per_token`` is the node's own figure when its ``CacheState`` reports one (a torch node
measures its copies, a modeled or vLLM node reports its configured cost), else the router's default.

``backlog_s`` spreads ``prefill_backlog_tokens`` evenly over the ``num_waiting`` requests (priced as one long
prompt, the quadratic term would overcharge it). *Pending* turns are those this router sent
(:meth:`Router.started`) that the node's :class:`~hints.CacheState` cannot show yet; without them a hot
prefix or session piles every turn onto one node between state updates. One is dropped at
:meth:`Router.finished`, or once the node reports a version later than the one known when it was sent
(assumed to include it: simple, and at worst one update early).

:class:`Router` is the mechanism; the rule is a small :class:`RoutingPolicy` from :data:`ROUTING_POLICIES`
(``orchestrator._routing``; baselines too: llm-d, round-robin, session), re-exported here. Plain Python: no
Temporal, gRPC, torch or engine_adapter.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection
from dataclasses import dataclass

from hints import CacheState, SessionResidency
from orchestrator._routing import (
    ROUTING_POLICIES,
    NodeView,
    RouteDecision,
    RouteRequest,
    RoutingPolicy,
    get_routing_policy,
)

__all__ = [
    "ROUTING_POLICIES",
    "NoNodeAvailable",
    "NodeView",
    "RouteDecision",
    "RouteRequest",
    "Router",
    "RoutingPolicy",
    "default_prefill_s",
    "get_routing_policy",
]


def default_prefill_s(num_new_tokens: int, num_cached_tokens: int) -> float:
    """Prefill ``n`` new tokens after ``p`` cached ones: ``b·n + c·((p+n)² − p²)``, an 8B model on an A100.

    Same shape as the engine's profiled cost model (``b`` = 1.4e-4 s/token, ``c`` = 1.4e-9 s/token²; the
    quadratic term is attention over the cached prefix). Pass the node's real model for real numbers.
    """
    n, p = num_new_tokens, num_cached_tokens
    if n < 0 or p < 0:
        raise ValueError(f"prefill_s needs non-negative token counts, got new={n}, cached={p}")
    return 1.4e-4 * n + 1.4e-9 * ((p + n) ** 2 - p**2)


class NoNodeAvailable(RuntimeError):
    """No known, non-excluded node can take the turn (none registered, all removed or excluded)."""


def _seconds(what: str, value: float) -> float:
    """A duration or rate the router adds up: NaN or a negative would silently win (or lose) every turn."""
    if not (math.isfinite(value) and value >= 0.0):
        raise ValueError(f"{what} must be finite and >= 0, got {value}")
    return value


@dataclass(slots=True)
class _Pending:
    new_tokens: int
    cached_tokens: int
    seen_version: int  # the node's state version when the turn was sent


@dataclass(slots=True)
class _Node:
    state: CacheState
    updated_s: float
    pending: dict[str, _Pending]  # by session: one turn in flight each
    residency: dict[str, SessionResidency]


MAX_SESSIONS = 100_000
"""Sessions whose placement the router remembers (most recently sent first kept)."""


class Router:
    """Latest state per node, this router's in-flight turns, and where prefixes and sessions went.

    ``prefill_s(num_new, num_cached)`` defaults to :func:`default_prefill_s`; the host reload default is a
    16-token block over PCIe Gen4 (~1.3e-4 s); each running sequence slows the steps a new turn shares.
    """

    def __init__(
        self,
        prefill_s: Callable[[int, int], float] | None = None,
        *,
        policy: str | RoutingPolicy = "hintflow",
        host_reload_s_per_token: float = 8e-6,
        decode_s_per_running_seq: float = 2e-3,
        stale_after_s: float = 5.0,
    ) -> None:
        self.prefill_s = prefill_s if prefill_s is not None else default_prefill_s
        self.policy = get_routing_policy(policy) if isinstance(policy, str) else policy
        self.host_reload_s_per_token = _seconds("host_reload_s_per_token", host_reload_s_per_token)
        self.decode_s_per_running_seq = _seconds("decode_s_per_running_seq", decode_s_per_running_seq)
        self.stale_after_s = _seconds("stale_after_s", stale_after_s)
        self._nodes: dict[str, _Node] = {}
        self._prefix_nodes: dict[str, set[str]] = {}  # prefix_key -> nodes it was sent to
        self._session_node: dict[str, str] = {}  # session -> node it was last sent to
        # session -> (node, context tokens it computed there, that node's state version when its turn
        # ended): until a newer state says otherwise, the context is where the session just ran
        self._session_ctx: dict[str, tuple[str, int, int]] = {}

    def update(self, address: str, state: CacheState, now_s: float) -> None:
        """Take a node's latest state; a restart (a new node_id or node epoch, or the version going back)
        forgets its prefixes and pending turns, and a later version drops the pending turns it is assumed
        to include."""
        if not address:
            raise ValueError("update needs a non-empty node address")
        old = self._nodes.get(address)
        pending: dict[str, _Pending] = {}
        if old is not None and (
            state.node_id != old.state.node_id
            or state.node_epoch != old.state.node_epoch
            or state.version < old.state.version
        ):
            self._forget_prefixes(address)
        elif old is not None:
            pending = {s: p for s, p in old.pending.items() if p.seen_version >= state.version}
        self._nodes[address] = _Node(state, now_s, pending, {r.session_id: r for r in state.sessions})

    def node_epoch(self, address: str) -> int | None:
        """The node life ``address``'s latest state showed (None: no state, or the node was removed)."""
        node = self._nodes.get(address)
        return node.state.node_epoch if node is not None else None

    def remove(self, address: str) -> None:
        """Forget a node that is gone or unreachable: it is never chosen again until updated anew."""
        self._nodes.pop(address, None)
        self._forget_prefixes(address)

    def choose(self, req: RouteRequest, now_s: float, exclude: Collection[str] = ()) -> RouteDecision:
        """Pick a node for ``req`` by the policy; records nothing (:meth:`started` does)."""
        candidates = [a for a in sorted(self._nodes) if a not in exclude]
        if not candidates:
            known, excluded = sorted(self._nodes) or "none", sorted(exclude) or "none"
            raise NoNodeAvailable(
                f"no engine node for session {req.session_id!r}: known {known}, excluded {excluded}"
            )
        views = [self._view(a, req) for a in candidates]
        home = self._session_node.get(req.session_id)
        chosen, reason = self.policy.pick(req, views, home)
        ages_s = {a: now_s - self._nodes[a].updated_s for a in candidates}
        notes = tuple(f"state of {a} is {t:.1f} s old" for a, t in ages_s.items() if t > self.stale_after_s)
        return RouteDecision(
            address=chosen.address,
            reason="only-node" if len(views) == 1 else reason,
            expected_s={v.address: v.cost_s for v in views},
            warm_tokens=chosen.warm_tokens,
            moved_from=home if home is not None and home != chosen.address else None,
            notes=notes,
        )

    def started(self, address: str, req: RouteRequest) -> None:
        """The turn was sent to ``address``: count it as pending there (only there: a session has one turn in
        flight, so a retry elsewhere replaces it), remember its session and prefix. A node removed since
        :meth:`choose` (a race with health checks) has nothing to track but the session's placement."""
        self._session_node.pop(req.session_id, None)  # re-inserted last: the maps stay in recency order
        self._session_node[req.session_id] = address
        while len(self._session_node) > MAX_SESSIONS:  # a worker runs for weeks: forget the oldest
            gone = next(iter(self._session_node))
            del self._session_node[gone]
            self._session_ctx.pop(gone, None)
        for other in self._nodes.values():
            other.pending.pop(req.session_id, None)
        if (node := self._nodes.get(address)) is None:
            return
        warm = self._warm(address, req)[0]
        node.pending[req.session_id] = _Pending(req.context_tokens - warm, warm, node.state.version)
        self._session_ctx[req.session_id] = (address, req.context_tokens, -1)
        if req.prefix_key:
            self._prefix_nodes.setdefault(req.prefix_key, set()).add(address)

    def finished(self, address: str, session_id: str) -> None:
        """The session's turn on ``address`` ended; drop its pending prefill (a no-op if already dropped)."""
        if (node := self._nodes.get(address)) is not None:
            node.pending.pop(session_id, None)
            ctx = self._session_ctx.get(session_id)
            if ctx is not None and ctx[0] == address:
                self._session_ctx[session_id] = (address, ctx[1], node.state.version)

    def node_state(self, address: str) -> CacheState | None:
        """The latest state of ``address`` (None for a node unknown or removed)."""
        node = self._nodes.get(address)
        return node.state if node is not None else None

    def residency(self, address: str, session_id: str) -> SessionResidency | None:
        """The session as ``address``'s latest state shows it (None if it shows none)."""
        node = self._nodes.get(address)
        return node.residency.get(session_id) if node is not None else None

    def session_tokens(self, address: str, session_id: str) -> int:
        """Tokens of the session's own context the router expects on ``address`` (device + host; 0 for an
        unknown node): its residency there, or the context its last turn there left, until a newer state
        says otherwise.  What a move from there could take along (a shared prefix is not counted)."""
        node = self._nodes.get(address)
        if node is None:
            return 0
        res = node.residency.get(session_id)
        tokens = res.device_tokens + res.host_tokens if res is not None else 0
        ctx = self._session_ctx.get(session_id)
        if ctx is not None and ctx[0] == address and ctx[2] >= 0 and node.state.version <= ctx[2]:
            tokens = max(tokens, ctx[1])
        return tokens

    def _prefill(self, num_new: int, num_cached: int) -> float:
        if num_new == 0:
            return 0.0
        return _seconds(f"prefill_s({num_new}, {num_cached})", float(self.prefill_s(num_new, num_cached)))

    def _warm(self, address: str, req: RouteRequest) -> tuple[int, int]:
        """(warm tokens, of which on host): the session's residency there, or the shared prefix if sent there
        (assumed on device and the start of the session's context, so it overlaps the session's tokens)."""
        node = self._nodes[address]
        res = node.residency.get(req.session_id)
        device, host = (res.device_tokens, res.host_tokens) if res is not None else (0, 0)
        ctx = self._session_ctx.get(req.session_id)
        if ctx is not None and ctx[0] == address and ctx[2] >= 0 and node.state.version <= ctx[2]:
            # No state from this node since the session's turn ended there: the state we hold was taken
            # while the turn ran (or before), so it cannot show the context the turn left.  Assume it is
            # still there rather than route the session away from it and recompute it elsewhere.
            device = max(device, ctx[1])
        if req.prefix_key and address in self._prefix_nodes.get(req.prefix_key, ()):
            device = max(device, req.prefix_tokens)
        if req.cached_tokens is not None:
            device = max(device, req.cached_tokens.get(address, 0))
        device = min(device, req.context_tokens)
        host = min(host, req.context_tokens - device)
        return device + host, host

    def _view(self, address: str, req: RouteRequest) -> NodeView:
        node, st = self._nodes[address], self._nodes[address].state
        backlog_s = 0.0
        if st.prefill_backlog_tokens:
            num_waiting = max(st.num_waiting, 1)
            backlog_s = num_waiting * self._prefill(math.ceil(st.prefill_backlog_tokens / num_waiting), 0)
        pending_s = sum(self._prefill(p.new_tokens, p.cached_tokens) for p in node.pending.values())
        wait_s = backlog_s + pending_s + self.decode_s_per_running_seq * (st.num_running + len(node.pending))
        warm, host = self._warm(address, req)
        cost_s = wait_s + self._prefill(req.context_tokens - warm, warm) + self.host_reload_s(address) * host
        num_queued = st.num_waiting + st.num_running + len(node.pending)
        return NodeView(address, warm, host, wait_s, cost_s, st.kv_utilization, num_queued)

    def host_reload_s(self, address: str) -> float:
        """Seconds per token to bring a context back from ``address``'s host tier: what the node reports,
        else this router's default."""
        node = self._nodes.get(address)
        reported = node.state.host_reload_s_per_token if node is not None else 0.0
        return reported if reported > 0.0 else self.host_reload_s_per_token

    def _forget_prefixes(self, address: str) -> None:
        """A node restarted or went away: nothing it held is assumed to be there any more (its shared
        prefixes, and the contexts sessions left on it when their turns ended)."""
        for nodes in self._prefix_nodes.values():
            nodes.discard(address)
        for sid in [sid for sid, ctx in self._session_ctx.items() if ctx[0] == address]:
            del self._session_ctx[sid]
