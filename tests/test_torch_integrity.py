"""Context integrity with real KV bytes: random operations on two torch nodes, checked through outputs.

``test_context_integrity.py`` tracks which token each block slot holds under a modeled executor.  Here the
executor is the real ``TorchExecutor`` (the tiny default model in float64, so argmax ties cannot flip), and
the KV that offloads, reloads, prefetches, preemptions and context export/import move around is the KV the
model attends over.  Every token a node samples must be the argmax of a plain full forward over that
request's tokens so far (``reference_logits``), and its logits must match that forward's.

Two nodes with one executor config (one fingerprint) trade sessions through ``export_context`` and
``import_context`` and carry on their turns there.  Small device pools with a host tier leave contexts
split across the tiers when they are exported (the layer-major join of ``_join_blocks``), and a run
asserts that it exported such split contexts, served turns from them after the move, and offloaded,
reloaded, evicted and preempted, so it cannot pass without exercising those paths.
"""

from __future__ import annotations

import dataclasses
import random
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from engine_adapter import (
    EngineCore,
    EngineError,
    Request,
    RequestState,
    ScheduledBatch,
    SchedulerConfig,
    SessionState,
    StepOutput,
    TorchExecutor,
    TorchModelConfig,
    VirtualClock,
    make_torch_executor,
)
from hints import EvictionOrder, NextUse, Pin, Prefetch, Priority, Release
from tests.engine_support import deadline_scheduler_config, release_everything

VOCAB = TorchModelConfig().vocab_size
# The model computes in float64 and hands out float32 logits: the paged and full forwards agreed exactly
# in every run measured, and wrong KV moves them by ~1.
LOGITS_ATOL = 1e-4
SESSIONS = [f"s{i}" for i in range(6)]
PROGRAMS = {s: f"p{int(s[1:]) % 3}" for s in SESSIONS}
MAX_PROMPT = 56  # + at most 7 new tokens (+ a probe's 3 + 4): fits every configuration's device pools


class LogitsTorchExecutor(TorchExecutor):
    """The real torch executor, asked for the sampled rows' logits too (``return_logits``), which the
    engine never asks for: a step's logits are kept in ``last_logits`` for the token checks."""

    def __init__(self, config: TorchModelConfig, num_device_blocks: int, num_host_blocks: int) -> None:
        super().__init__(config, num_device_blocks, num_host_blocks, device="cpu")
        self.last_logits: dict[str, object] = {}

    def execute(self, batch: ScheduledBatch) -> StepOutput:
        out = super().execute(dataclasses.replace(batch, return_logits=True))
        self.last_logits = out.logits or {}
        return out


def default_cfg() -> SchedulerConfig:
    return SchedulerConfig(max_num_batched_tokens=64, cold_prefill_budget_tokens=16, warm_threshold_tokens=8)


# name -> block size, (device, host) blocks of each node, scheduler config, EngineCore keywords
CONFIGS: dict[str, dict[str, Any]] = {
    "bs4": dict(bs=4, pools=((22, 16), (20, 24))),
    "bs16": dict(bs=16, pools=((6, 6), (5, 8))),
    # vLLM's host connectors: every turn written through to the host, contexts not kept on the device
    "bs4_write_through": dict(bs=4, pools=((22, 14), (20, 10)),
                              engine=dict(host_write_through=True, retain_contexts=False)),
    "bs3_deadline_pins": dict(
        bs=3,
        pools=((24, 12), (26, 20)),
        cfg=deadline_scheduler_config(),
        engine=dict(pin_budget_fraction=0.9),
    ),
}
NUM_OPS = 110
NUM_SEEDS = 30  # per configuration: about 4 s each on this repo's 2-core machine


def make_node(
    bs: int, dev: int, host: int, cfg: SchedulerConfig | None = None, **engine: Any
) -> tuple[EngineCore, LogitsTorchExecutor, VirtualClock]:
    ex = LogitsTorchExecutor(TorchModelConfig(dtype="float64", block_size=bs), dev, host)
    clock = VirtualClock()
    core = EngineCore(ex, clock=clock, scheduler_config=cfg or default_cfg(), **engine)
    return core, ex, clock


def token_errors(ex: LogitsTorchExecutor, req: Request, toks: list[int]) -> list[str]:
    """Check each just-sampled token (the last of ``req.output``) against a full forward's."""
    errors = []
    for tok in toks:
        assert req.output and req.output[-1] == tok
        ref = ex.reference_logits(req.prompt + req.output[:-1])
        want = int(ref.argmax())
        got = ex.last_logits.get(req.request_id)
        diff = float((got - ref).abs().max()) if isinstance(got, torch.Tensor) else float("nan")
        if tok != want or not diff <= LOGITS_ATOL:
            errors.append(
                f"{req.request_id} (session {req.session.session_id}) output {len(req.output) - 1} after "
                f"{len(req.prompt)} prompt tokens: sampled {tok}, a full forward picks {want}; "
                f"max |logit diff| {diff:.3g}"
            )
    return errors


class TwoNodeFuzz:
    """One seeded run: random turns, hints, aborts, time and context moves on two nodes."""

    def __init__(self, seed: int, config: dict[str, Any]) -> None:
        self.seed = seed
        self.rng = random.Random(seed)
        self.bs: int = config["bs"]
        self.nodes = [
            make_node(self.bs, dev, host, config.get("cfg"), **config.get("engine", {}))
            for dev, host in config["pools"]
        ]
        fingerprints = {ex.fingerprint() for _, ex, _ in self.nodes}
        assert len(fingerprints) == 1, "both nodes must run one model to trade contexts"
        assert fingerprints == {
            make_torch_executor(1, 0, device="cpu", dtype="float64", block_size=self.bs).fingerprint()
        }
        self.base = [self.rng.randrange(VOCAB) for _ in range(12)]  # a shared system prefix
        self.hist: dict[str, list[int]] = {}
        self.home = {sid: self.rng.randrange(2) for sid in SESSIONS}  # where a session's turns go
        self.reqs: list[tuple[int, str]] = []
        self.log: list[tuple[Any, ...]] = []
        self.errors: list[str] = []
        self.counts: Counter[str] = Counter()

    # ---- submitting turns ---------------------------------------------------------------------
    def submit(self, node: int, sid: str, prompt: list[int], n_out: int) -> Request:
        core, ex, _ = self.nodes[node]

        def on_event(req: Request, toks: list[int], done: bool) -> None:
            self.counts["tokens_checked"] += len(toks)
            self.errors.extend(token_errors(ex, req, toks))
            if done:
                self.hist[sid] = req.prompt + req.output

        req = core.submit(prompt, n_out, session_id=sid, program_id=PROGRAMS[sid], on_event=on_event)
        self.reqs.append((node, req.request_id))
        return req

    # ---- one random operation -----------------------------------------------------------------
    def op(self) -> None:
        rng, log = self.rng, self.log
        r = rng.random()
        if r < 0.28:
            sid = rng.choice(SESSIONS)
            node = self.home[sid]
            s = self.nodes[node][0].kv.sessions.get(sid)
            if s is not None and s.state is not SessionState.PARKED:  # one turn at a time: step instead
                log.append(("step", node))
                self.nodes[node][0].step()
                return
            h = self.hist.get(sid, list(self.base) if rng.random() < 0.6 else [])
            if h and rng.random() < 0.15:
                h = h[: rng.randrange(len(h))]  # a history that diverges from what is cached
            prompt = (h + [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 16))])[-MAX_PROMPT:]
            n_out = rng.randrange(1, 8)
            log.append(("submit", node, sid, len(prompt), n_out))
            self.submit(node, sid, prompt, n_out)
        elif r < 0.48:
            n = rng.randrange(1, 5)
            which = rng.choice([[0], [1], [0, 1]])
            log.append(("step", which, n))
            for _ in range(n):
                for node in which:
                    self.nodes[node][0].step()
        elif r < 0.53:
            sid, ttl = rng.choice(SESSIONS), rng.choice([0.0, 0.5, 2.0, 10.0])
            log.append(("pin", sid, ttl))
            self.nodes[self.home[sid]][0].apply_hints([Pin(session_id=sid, ttl_s=ttl)])
        elif r < 0.57:
            sid, at = rng.choice(SESSIONS), rng.uniform(0, 20)
            log.append(("order", sid, at))
            self.nodes[self.home[sid]][0].apply_hints(
                [EvictionOrder(entries=[NextUse(session_id=sid, next_use_s=at)])]
            )
        elif r < 0.62:
            sid, at = rng.choice(SESSIONS), rng.uniform(0, 2)
            log.append(("prefetch", sid, at))
            self.nodes[self.home[sid]][0].apply_hints([Prefetch(session_id=sid, at_s=at)])
        elif r < 0.64:
            sid, age = rng.choice(SESSIONS), rng.uniform(0, 50)
            log.append(("priority", sid, age))
            self.nodes[self.home[sid]][0].apply_hints(
                [Priority(session_id=sid, program_id=PROGRAMS[sid], program_age_s=age)]
            )
        elif r < 0.66:
            prog = rng.choice(sorted(set(PROGRAMS.values())))
            log.append(("release", prog))
            for core, _, _ in self.nodes:
                core.apply_hints([Release(program_id=prog)])
            for sid in SESSIONS:
                if PROGRAMS[sid] == prog:
                    self.hist.pop(sid, None)
        elif r < 0.71 and self.reqs:
            node, rid = rng.choice(self.reqs)
            log.append(("abort", node, rid))
            self.nodes[node][0].abort(rid)
        elif r < 0.78:
            node, dt = rng.randrange(2), rng.uniform(0, 3)
            log.append(("advance", node, dt))
            self.nodes[node][2].advance(dt)
        elif r < 0.81:
            node = rng.randrange(2)
            log.append(("tick", node))
            self.nodes[node][0].kv.tick()
        else:
            self.ship()

    def is_split(self, sid: str) -> bool:
        """Whether the session is parked on its home node with its context on both tiers."""
        s = self.nodes[self.home[sid]][0].kv.sessions.get(sid)
        return (
            s is not None
            and s.state is SessionState.PARKED
            and s.num_device_tokens > 0
            and s.num_host_tokens > 0
        )

    def ship(self) -> None:
        """Export a session from its home node and import it into the other (or, now and then, into the
        same node under another id); then, mostly, run a turn on it there at once."""
        rng = self.rng
        split_now = [sid for sid in SESSIONS if self.is_split(sid)]
        sid = rng.choice(split_now if split_now and rng.random() < 0.5 else SESSIONS)
        src = self.home[sid]
        dst = 1 - src if rng.random() < 0.85 else src
        target = sid if dst != src and rng.random() < 0.8 else rng.choice(SESSIONS)
        release_after = rng.random() < 0.6
        split = self.is_split(sid)
        self.log.append(("ship", sid, src, dst, target, release_after, split))
        blob = self.nodes[src][0].export_context(sid, release_after=release_after)
        self.counts["exports"] += 1
        self.counts["split_exports"] += split
        blob.session_id, blob.program_id = target, PROGRAMS[target]
        self.nodes[dst][0].import_context(blob)
        self.counts["imports"] += 1
        self.counts["split_imports"] += split
        self.home[target] = dst
        if target != sid:
            self.hist[target] = list(blob.token_ids)
        if not blob.token_ids or rng.random() < 0.35:
            return  # the next turn comes later (if the context is still there then)
        # A turn that reads the imported context at once: its tokens check the moved KV.
        prompt = [*blob.token_ids, *(rng.randrange(VOCAB) for _ in range(rng.randrange(1, 4)))]
        n_out = rng.randrange(1, 5)
        self.log.append(("probe", dst, target, len(prompt), n_out))
        req = self.submit(dst, target, prompt, n_out)
        core = self.nodes[dst][0]
        for _ in range(500):
            if req.state is RequestState.FINISHED:
                break
            core.step()
        assert req.state is RequestState.FINISHED, f"probe {req.request_id} never finished"
        full = len(blob.token_ids) // self.bs * self.bs
        if req.num_cached_tokens >= full > 0:  # it was served from the moved blocks
            self.counts["probes_from_import"] += 1
            self.counts["split_probes_from_import"] += split

    # ---- the run -------------------------------------------------------------------------------
    def fail(self, k: int | str, what: str) -> AssertionError:
        return AssertionError(f"seed {self.seed}, op {k}: {what}\nlast ops: {self.log[-8:]}")

    def check(self, k: int | str) -> None:
        if self.errors:
            raise self.fail(k, "wrong tokens:\n  " + "\n  ".join(self.errors[:4]))
        for core, _, _ in self.nodes:
            try:
                core.check_invariants()
            except AssertionError as e:
                raise self.fail(k, str(e)) from None

    def run(self, num_ops: int) -> Counter[str]:
        for k in range(num_ops):
            try:
                self.op()
            except EngineError as e:  # refusals are fine (unknown session, busy, no room): state must hold
                self.log[-1] = (*self.log[-1], f"{type(e).__name__}: {e}")
            except Exception as e:
                raise self.fail(k, f"{type(e).__name__}: {e}") from e
            self.check(k)
        for core, _, _ in self.nodes:
            core.run_until_idle()
        self.check("end")
        for core, _, _ in self.nodes:
            kv = core.kv
            self.counts["offloaded_blocks"] += kv.stats.offloaded_blocks
            self.counts["reloaded_blocks"] += kv.stats.reloaded_blocks
            self.counts["prefetched_blocks"] += kv.stats.prefetched_blocks
            self.counts["evicted_blocks"] += kv.stats.evicted_blocks
            self.counts["dropped_host_blocks"] += kv.stats.dropped_host_blocks
            self.counts["preemptions"] += core.scheduler.num_preemptions
            release_everything(core)
        return self.counts


@pytest.fixture
def one_torch_thread() -> Iterator[None]:
    """The tiny model's ops are too small to gain from threads, and two intra-op threads that share the two
    cores with another busy process spin for theirs (the fuzz ran 40x slower beside a second one)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("config", list(CONFIGS))
def test_random_operations_on_two_torch_nodes_sample_what_a_full_forward_samples(config: str) -> None:
    """Any mix of turns, steps, hints, aborts, time, and context moves between two nodes (contexts split
    over device and host included): every sampled token and its logits equal a full forward's."""
    total: Counter[str] = Counter()
    for seed in range(NUM_SEEDS):
        total += TwoNodeFuzz(seed, CONFIGS[config]).run(NUM_OPS)
    # Not vacuous: the run moved contexts split over both tiers and served turns from them afterwards,
    # and it offloaded, reloaded, evicted and preempted.
    assert total["tokens_checked"] > 500, total
    assert total["split_exports"] > 0 and total["split_imports"] > 0, total
    assert total["split_probes_from_import"] > 0, total
    for what in ("offloaded_blocks", "reloaded_blocks", "evicted_blocks", "preemptions"):
        assert total[what] > 0, (what, total)


def test_a_context_split_across_tiers_moves_to_another_node_intact() -> None:
    """A context with its first blocks on the device and the rest on the host, exported and imported into
    a twin node: the next turn there is served from the moved KV and samples what a full forward does."""
    cfg = SchedulerConfig(max_num_batched_tokens=64, cold_prefill_budget_tokens=64, warm_threshold_tokens=8)
    core, _, _ = make_node(4, 8, 4, cfg)
    twin, twin_ex, _ = make_node(4, 8, 4)
    a1 = [(7 * i + 3) % VOCAB for i in range(16)]
    ra = core.submit(a1, 1, session_id="A")
    core.run_until_idle()
    core.submit([(11 * i + 5) % VOCAB for i in range(28)], 1, session_id="B")  # pushes some of A to host
    core.run_until_idle()
    a = core.kv.sessions["A"]
    assert a.num_device_tokens > 0 and a.num_host_tokens > 0, (a.num_device_tokens, a.num_host_tokens)
    assert twin.import_context(core.export_context("A")) == (16, 4)
    prompt = [*a1, *ra.output, 1, 2, 3]
    errors: list[str] = []
    r = twin.submit(
        prompt,
        4,
        session_id="A",
        on_event=lambda req, toks, _: errors.extend(token_errors(twin_ex, req, toks)),
    )
    twin.run_until_idle()
    assert r.num_cached_tokens == 16 and len(r.output) == 4
    assert not errors, errors
