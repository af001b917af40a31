"""Where a replay's queueing for device memory comes from: prints, per policy, how long turns waited and
what the nodes held meanwhile.

    python scripts/queue_anatomy.py [--workload swe-agent] [--seed 0] [-p kvflow,hintflow,oracle] [replay knobs]

For each policy, over virtual time and both nodes (sampled before every simulator event):

* ``waiting node-s``: node-seconds with at least one turn queued, and ``turn-s queued`` the queued turns
  integrated over time (the JCT the queue costs, summed over programs);
* ``running share`` / ``head share``: while a node has a queue, the device share its running turns'
  contexts hold, and the share the queue's first turn needs;
* ``other node fits``: the share of queued turn-seconds during which another node had no queue and room
  for the waiting turn beside its running contexts (what moving the context there could take back).

A diagnostic, not a benchmark of hintflow: it changes nothing in the replay (the same reports as
``hintflow replay``), it only looks.
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from collections.abc import Callable

from replay import ReplaySetup, Simulation, parse_policy_list


class _Watched(Simulation):
    """A simulation that samples its nodes before every event (``at`` wraps each action)."""

    def __init__(self, *args: object, **kw: object) -> None:
        super().__init__(*args, **kw)  # type: ignore[arg-type]
        self.totals: defaultdict[str, float] = defaultdict(float)
        self._last_s = 0.0

    def at(self, t_s: float, action: Callable[[], None]) -> None:
        def sampled() -> None:
            self._sample_queues()
            action()

        super().at(t_s, sampled)

    def _sample_queues(self) -> None:
        dt, self._last_s = self.now - self._last_s, self.now
        if dt <= 0:
            return
        views = []
        for n in self.nodes:
            sched, kv = n.engine.scheduler, n.engine.kv
            capacity = kv.device.num_blocks * n.block_size
            # distinct blocks: sessions share their prefix blocks (an agent role's system prompt)
            running = len({b for r in sched.running for b in r.session.block_ids}) * n.block_size
            head = sched.waiting[0].num_tokens if sched.waiting else 0
            views.append((capacity, running, head, len(sched.waiting)))
        t = self.totals
        for i, (capacity, running, head, num_waiting) in enumerate(views):
            if not num_waiting:
                continue
            t["waiting_node_s"] += dt
            t["queued_turn_s"] += dt * num_waiting
            t["running_share_s"] += dt * running / capacity
            t["head_share_s"] += dt * head / capacity
            if any(j != i and not w and cap - run >= head for j, (cap, run, _, w) in enumerate(views)):
                t["other_fits_turn_s"] += dt * num_waiting


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", "-w", default="swe-agent")
    ap.add_argument("--policy", "-p", default="kvflow,hintflow,oracle")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--programs", type=int)
    ap.add_argument("--rate", type=float)
    ap.add_argument("--kv-capacity-tokens", type=int)
    args = ap.parse_args()
    setup = ReplaySetup(workload=args.workload, seed=args.seed, num_programs=args.programs, rate=args.rate,
                        kv_capacity_tokens=args.kv_capacity_tokens).with_defaults()
    programs = setup.load_programs()
    cm = setup.cost()
    setup = setup.resolve(programs, cm)
    print(f"{setup.workload}, seed {setup.seed}, {len(programs)} programs, {setup.num_nodes} nodes, "
          f"device {setup.kv_capacity_tokens:,} tokens/node, cost model {cm.name}")
    print("| policy | waiting node-s | turn-s queued | running share | head share | other node fits |")
    print("|---|---|---|---|---|---|")
    for config in parse_policy_list(args.policy):
        spec = setup.node_spec(cm, infinite_kv=config.infinite_kv, programs=programs)
        sim = _Watched(programs, config, spec, num_nodes=setup.num_nodes, seed=setup.seed, tick_s=setup.tick_s)
        sim.run()
        t = sim.totals
        wait = t["waiting_node_s"] or 1.0
        queued = t["queued_turn_s"] or 1.0
        print(f"| {config.name} | {t['waiting_node_s']:.1f} | {t['queued_turn_s']:.1f} | "
              f"{t['running_share_s'] / wait:.0%} | {t['head_share_s'] / wait:.0%} | "
              f"{t['other_fits_turn_s'] / queued:.0%} |")


if __name__ == "__main__":
    main()
