"""Moving queued turns' contexts between nodes in the replay (``replay/_migration.py``): the turn runs on the
other node from the context it copied there (nothing recomputed), a copy that finds no room leaves the turn
where its context still is, and no block is lost or counted twice on either path."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from engine_adapter import EngineCore, ResourceExhausted
from replay import (
    Program,
    ReplaySetup,
    SimResult,
    Simulation,
    generate,
    get_replay_config,
    parse_variant,
    report_json,
    run_replay,
)
from replay._migration import Migrator


def _programs(n: int = 24) -> list[Program]:
    return generate("swe-agent", seed=3, num_programs=n, rate=4.0, scale=0.05)


def _setup() -> ReplaySetup:
    return ReplaySetup(block_size=16, num_nodes=2, host_memory="all")  # every context fits on the host


def _check_nodes_empty(result: SimResult) -> None:
    """Every block back, nothing pinned, no session left, no work: after a replay every program released."""
    for node in result.nodes:
        node.engine.check_invariants()
        kv = node.engine.kv
        assert kv.device.num_free_blocks == kv.device.num_blocks, node.address
        assert kv.host.num_free_blocks == kv.host.num_blocks, node.address
        assert kv.num_pinned_blocks == 0
        assert not kv.sessions, list(kv.sessions)[:3]
        assert not node.engine.scheduler.has_work()


class _Moves:
    """Records each call of ``Migrator.move``: (turn queued on its node, or one the router moved; tokens)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[tuple[bool, str, int]] = []
        self.turns: list[tuple[str, int]] = []
        self.num_left_behind = self.num_lost_place = self.num_unseen_moves = 0
        self.num_in_flight = self.num_unleased_in_flight = 0
        self.num_in_flight_blocks = self.num_pinned_in_flight_blocks = 0
        move, arrive = Migrator.move, Migrator._arrive

        def spy(m: Migrator, src, dst, s, queued=None):  # type: ignore[no-untyped-def]
            held = src.engine.kv.sessions[s.key]
            self.calls.append((queued is not None, s.key, held.num_device_tokens + held.num_host_tokens))
            self.turns.append((s.key, s.turn_index))
            # A turn moved before is moved on only after the node it reached has scheduled since it arrived.
            self.num_unseen_moves += s.num_moves > 0 and src.last_schedule_s <= s.landed_s
            move(m, src, dst, s, queued)
            copy = dst.engine.kv.sessions.get(s.key)
            if s.node != dst.address and copy is not None:  # in flight: its blocks are being written
                self.num_in_flight += 1
                self.num_unleased_in_flight += copy.pin_deadline_s is None
                self.num_in_flight_blocks += len(copy.block_ids)
                self.num_pinned_in_flight_blocks += copy.pinned_blocks

        def arrived(m: Migrator, planned, src, dst, s, num_tokens, arrival_s, overdue):  # type: ignore[no-untyped-def]
            arrive(m, planned, src, dst, s, num_tokens, arrival_s, overdue)
            if s.node == dst.address:  # it took: the source let go of its copy (no block counted twice)
                self.num_left_behind += s.key in src.engine.kv.sessions
            # The turn keeps its place in line: the arrival time (and deadline status) it queued with.
            self.num_lost_place += (s.request.arrival_s, s.request.overdue) != (arrival_s, overdue)

        monkeypatch.setattr(Migrator, "move", spy)
        monkeypatch.setattr(Migrator, "_arrive", arrived)


def test_queued_turns_move_with_their_context_and_recompute_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    moves = _Moves(monkeypatch)
    programs = _programs()
    setup, (result,) = run_replay(_setup(), [get_replay_config("hintflow")], programs=programs)
    m = report_json(setup, [result])["policies"]["hintflow"]
    # (both paths ran: turns queued on a full node, and sessions the router sent elsewhere at turn start)
    assert any(queued for queued, _, _ in moves.calls) and not all(queued for queued, _, _ in moves.calls)
    assert m["migrations"] > 0 and m["failed_migrations"] == 0
    assert m["migrations"] == len(moves.calls)  # every copy arrived and was counted once
    assert m["migrated_tokens"] == sum(n for _, _, n in moves.calls) > 0
    moved = [t for t in result.turns if t.migrated_tokens]
    assert moved and all(t.recomputed_tokens == 0 for t in moved)
    # The copied context is what the turn found: its history came from the import, on the new node.
    assert all(t.hit_tokens >= t.migrated_tokens and t.across_hit_tokens == t.history_tokens for t in moved)
    # Nothing else recomputed but sessions the router moved where their context could not follow (no room
    # or no sequence slot there): those are session moves, and the only turns that recompute.
    last: dict[str, str] = {}
    for t in sorted(result.turns, key=lambda t: t.ready_s):
        moved_without = last.setdefault(t.session_key, t.node) != t.node and not t.migrated_tokens
        assert t.recomputed_tokens == 0 or moved_without, t
        last[t.session_key] = t.node
    assert moves.num_left_behind == 0 and moves.num_lost_place == 0
    assert moves.num_unseen_moves == 0 and len(moves.turns) > len(set(moves.turns))  # (some turns moved twice)
    # A copy on the wire is pinned on its new node (within the node's pin budget, as every lease is).
    assert moves.num_in_flight > 0 and moves.num_unleased_in_flight == 0
    assert moves.num_pinned_in_flight_blocks >= 0.8 * moves.num_in_flight_blocks > 0
    # A moved turn is not moved on before its new node has looked at it (no ping-pong between nodes).
    assert max(moves.turns.count(k) for k in set(moves.turns)) <= 2
    assert sum(1 for p in programs for s in p.sessions for _ in s.turns) == len(result.turns)
    _check_nodes_empty(result)


def test_without_migration_nothing_moves_and_the_same_programs_finish() -> None:
    off = dataclasses.replace(get_replay_config("hintflow"), name="static", migrate=False)
    setup, (result,) = run_replay(_setup(), [off], programs=_programs())
    m = report_json(setup, [result])["policies"]["static"]
    assert m["migrations"] == m["migrated_tokens"] == m["migrated_bytes"] == m["failed_migrations"] == 0
    assert all(t.migrated_tokens == 0 for t in result.turns)
    _check_nodes_empty(result)


def test_a_copy_that_finds_no_room_leaves_the_turn_where_its_context_is(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every import fails (as when the destination's free blocks went while the copy was on the wire): the
    turn goes back to its own node's queue and finds its context there, which was never let go of."""
    moves = _Moves(monkeypatch)

    def full(self: EngineCore, blob) -> tuple[int, int]:  # type: ignore[no-untyped-def]
        raise ResourceExhausted(f"no room for {len(blob.token_ids)} tokens on node {self.node_id}")

    monkeypatch.setattr(EngineCore, "import_context", full)
    setup, (result,) = run_replay(_setup(), [get_replay_config("hintflow")], programs=_programs())
    m = report_json(setup, [result])["policies"]["hintflow"]
    assert moves.calls and m["failed_migrations"] == len(moves.calls)
    assert m["migrations"] == 0 and m["migrated_tokens"] == 0
    assert m["recomputed_tokens"] == 0 and m["across_turn_hit_rate"] == 1.0
    _check_nodes_empty(result)


def test_replays_with_migrations_are_deterministic() -> None:
    one = report_json(*run_replay(_setup(), [get_replay_config("hintflow")], programs=_programs()))
    two = report_json(*run_replay(_setup(), [get_replay_config("hintflow")], programs=_programs()))
    for r in (one, two):
        r["policies"]["hintflow"].pop("wall_s")
    assert one["policies"]["hintflow"]["migrations"] > 0
    assert json.dumps(one, sort_keys=True) == json.dumps(two, sort_keys=True)


def test_migration_rate_must_be_a_duration() -> None:
    setup = _setup().with_defaults()
    programs = _programs(2)
    cm = setup.cost()
    setup = setup.resolve(programs, cm)
    spec = setup.node_spec(cm, infinite_kv=False, programs=programs)
    sim = Simulation(programs, get_replay_config("hintflow"), spec)
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="per_token_s must be finite and >= 0"):
            Migrator(sim, bad)


def test_link_rate_prices_a_migration_by_the_cost_model_s_kv_bytes(tmp_path) -> None:  # type: ignore[no-untyped-def]
    setup = ReplaySetup(block_size=16, num_nodes=2, link_gb_per_s=10.0)
    cm = setup.cost()
    assert cm.kv_bytes_per_token == 131072  # (h100-llama3-8b, the modeled default)
    assert setup.link_s_per_token(cm) == pytest.approx(131072 / 10e9)
    assert ReplaySetup(block_size=16).link_s_per_token(cm) == pytest.approx(cm.copy_per_block_s / 16)
    programs = _programs(2)
    resolved = setup.with_defaults().resolve(programs, cm)
    sim = Simulation(programs, get_replay_config("hintflow"), resolved.node_spec(cm, infinite_kv=False,
                                                                                 programs=programs))
    assert sim.migrator is not None and sim.migrator.per_token_s == pytest.approx(131072 / 10e9)
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="link_gb_per_s must be a positive number of GB/s"):
            ReplaySetup(link_gb_per_s=bad)
    # A cost model that does not say how many bytes a token's KV is cannot turn GB/s into seconds.
    profile = json.loads((Path(__file__).parents[1] / "engine_adapter/profiles/h100-llama3-8b.json").read_text())
    del profile["kv_bytes_per_token"]
    path = tmp_path / "no-bytes.json"
    path.write_text(json.dumps(profile))
    odd = ReplaySetup(block_size=16, cost_model=str(path), link_gb_per_s=10.0)
    with pytest.raises(ValueError, match="gives no kv_bytes_per_token"):
        odd.link_s_per_token(odd.cost())


def test_cli_rejects_a_link_rate_that_is_not_positive() -> None:
    from click.testing import CliRunner

    from replay import replay_command

    out = CliRunner().invoke(replay_command, ["--link-gb-per-s", "0", "--no-progress"])
    assert out.exit_code == 2 and "--link-gb-per-s" in out.output


def test_a_turn_moves_only_to_a_node_with_a_free_sequence_slot_and_at_most_twice(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With two sequences a step, memory alone said "room" at nodes that could not admit the turn: it moved
    on every step, one node to the next (a review found a turn moved 79 times on three nodes)."""
    moves: dict[tuple[str, int], int] = {}
    into_full: list[str] = []
    move = Migrator.move

    def spy(m: Migrator, src, dst, s, queued=None):  # type: ignore[no-untyped-def]
        moves[(s.key, s.turn_index)] = moves.get((s.key, s.turn_index), 0) + 1
        sched = dst.engine.scheduler
        if len(sched.running) + m.planner.promised_turns(dst.address) >= sched.config.max_num_seqs:
            into_full.append(s.key)
        return move(m, src, dst, s, queued)

    monkeypatch.setattr(Migrator, "move", spy)
    two = parse_variant("two=hintflow:scheduler.max_num_seqs=2")
    _, (result,) = run_replay(ReplaySetup(workload="multi-agent", seed=2, num_programs=20, num_nodes=3), [two])
    assert moves and not into_full
    assert max(moves.values()) <= Migrator.max_moves_per_turn
    _check_nodes_empty(result)
