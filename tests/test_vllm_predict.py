"""scripts/vllm_predict.py's spread: the prediction replayed at step prices scaled around the profile's, and
each ratio the median of the replays (a mirror of hintflow's node is chaotic: one replay is one draw)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.scripts_support import load_script


def test_the_spread_is_centred_on_the_profile_and_one_percent_apart() -> None:
    vp = load_script("vllm_predict")
    assert vp.spread_factors(1) == [1.0]
    assert vp.spread_factors(5) == pytest.approx([0.98, 0.99, 1.0, 1.01, 1.02])
    for bad in (0, 2, -1):
        with pytest.raises(ValueError, match="odd number"):
            vp.spread_factors(bad)


def test_a_ratio_is_the_median_of_the_replays_with_its_range() -> None:
    vp = load_script("vllm_predict")
    runs = [{"h": {"jct_mean_s": h}, "v": {"jct_mean_s": 100.0}} for h in (56.0, 52.0, 60.0, 53.0, 51.0)]
    assert vp.ratio_spread(runs, "h", "v", "jct_mean_s") == pytest.approx((0.53, 0.51, 0.60))
    # each ratio within its own replay: a replay where both rows are slower is not a worse ratio
    runs = [{"h": {"k": 50.0}, "v": {"k": 100.0}}, {"h": {"k": 60.0}, "v": {"k": 120.0}}]
    assert vp.ratio_spread(runs, "h", "v", "k") == pytest.approx((0.5, 0.5, 0.5))


def test_a_scaled_profile_scales_every_step_price_and_nothing_else(tmp_path: Path) -> None:
    vp = load_script("vllm_predict")
    base = Path(__file__).resolve().parents[1] / "engine_adapter/profiles/cpu-vllm-tiny.json"
    out = Path(vp._scaled_profile(str(base), 1.02, tmp_path / "p.json"))
    before, after = json.loads(base.read_text()), json.loads(out.read_text())
    for key, value in before.items():
        assert after[key] == (pytest.approx(value * 1.02) if key in vp.STEP_PRICES else value), key
    assert {"copy_per_block_s", "decode_base_s", "prefill_b_s_per_token"} <= set(vp.STEP_PRICES)


@pytest.mark.parametrize("mode", ["kvflow+host", "hintflow-infer+host", "continuum+host", "vanilla+host"])
def test_a_host_modes_mirror_drops_host_blocks_as_the_vllm_connector_does(mode: str) -> None:
    """The connector drops least recently saved or loaded blocks first, whatever the hints say: a mirror
    with the hinted host order replayed kvflow's real short-host node at twice its hits."""
    from replay import parse_variant

    vp = load_script("vllm_predict")
    config = parse_variant(vp._mirror(mode), [])
    assert config.host_tier
    assert config.host_lru or config.eviction_policy == "lru"  # stock's mirror is LRU on both tiers


def test_the_fit_is_refined_between_the_grids_points() -> None:
    """The grid steps 1.25x in prefill and 1.4x in decode; a minimum between its points is found to within
    a quarter step (hintflow's mirror moves with the split far more than stock's run)."""
    import math

    vp = load_script("vllm_predict")
    target = (0.55, 0.8)  # s25's: between the grid's 0.512 / 0.64 and 0.7 / 1.0
    evaluated: list[tuple[float, float]] = []

    def error(b: float, d: float) -> float:
        evaluated.append((b, d))
        return math.log(b / target[0]) ** 2 + math.log(d / target[1]) ** 2

    b, d = vp.search_scales(error)
    grid_best = min(abs(math.log(gb / target[0])) for gb in vp.PREFILL_SCALE)
    assert abs(math.log(b / target[0])) < grid_best
    assert abs(math.log(b / target[0])) <= math.log(vp.PREFILL_STEP) / 8 + 1e-9
    assert abs(math.log(d / target[1])) <= math.log(vp.DECODE_STEP) / 8 + 1e-9
    assert len(evaluated) == len(vp.PREFILL_SCALE) * len(vp.DECODE_SCALE) + 9 * vp.REFINE_LEVELS


def test_a_tried_setting_must_be_one_the_mirror_carries_on_a_mode_the_sitting_ran() -> None:
    """``--try``: predicted only, so it must be a node setting the replay's node has (``NODE_ENV``) on a
    mirrored mode with its stock row in the report; each mistake names what is wrong."""
    vp = load_script("vllm_predict")
    real: dict[str, dict[str, dict[str, float]]] = {"policies": {"vanilla+host": {}, "hintflow-infer+host": {}, "F1+host": {}}}
    modes = ["vanilla+host", "hintflow-infer+host", "F1+host"]
    got = vp._tries(["PB2+host=hintflow-infer+host:env.HINTFLOW_PIN_BUDGET=0.2"], real, modes)
    assert got == {"PB2+host": {"mode": "hintflow-infer+host", "policy_options": {}, "env": {"HINTFLOW_PIN_BUDGET": "0.2"}}}
    cases = {
        "X+host=hintflow-infer+host:env.HINTFLOW_YIELD_PINS=head": "no equivalent of HINTFLOW_YIELD_PINS",
        "X=hintflow-infer:env.HINTFLOW_PIN_BUDGET=0.2": "not a mirrored mode of this report",
        "F1+host=hintflow-infer+host:env.HINTFLOW_PIN_BUDGET=0.2": "a mode the sitting ran",
        "X+host=hintflow-infer+host:env.HINTFLOW_NOPE=1": "unknown option 'env.HINTFLOW_NOPE'",
        "X=hintflow-infer+host:env.HINTFLOW_PIN_BUDGET=0.2": "'+host'",
    }
    for text, message in cases.items():
        with pytest.raises(SystemExit, match=re.escape(message)):
            vp._tries([text], real, modes)


def test_pins_that_never_yield_are_mirrored_and_yielding_to_the_head_alone_is_not() -> None:
    """``HINTFLOW_YIELD_PINS=0`` is the replay node's ``yield_pins=false`` (the mirror yields by default, as the
    node does); ``head`` has no equivalent, so a sitting's variant with it is not mirrored."""
    vp = load_script("vllm_predict")
    off = {"mode": "hintflow-infer+host", "policy_options": {}, "env": {"HINTFLOW_YIELD_PINS": "0"}}
    default = {"mode": "hintflow-infer+host", "policy_options": {}, "env": {}}
    keys = [vp._variant_mirror("V+host", v, "evict", None).partition(":")[2].split(",") for v in (off, default)]
    assert "yield_pins=false" in keys[0] and "yield_pins=true" not in keys[0]
    assert "yield_pins=true" in keys[1]
    assert "policy.renew_ahead_s=0.05" in keys[1]  # the node's inference renews at the lapse: no gap of a tick
    assert vp._unmirrored({"HINTFLOW_YIELD_PINS": "0"}) == []
    assert vp._unmirrored({"HINTFLOW_YIELD_PINS": "head", "HINTFLOW_NOPE": "1"}) == ["HINTFLOW_NOPE", "HINTFLOW_YIELD_PINS=head"]


def test_the_queue_hold_is_mirrored_as_the_embedded_nodes_rule_for_hintflows_modes_only() -> None:
    """A node that ran the queue hold (the report's ``hold_queued_host``, or a variant's
    ``HINTFLOW_HOLD_QUEUED``) keeps a queued turn's context: the mirror's ``evict_queued=false``. Stock vLLM and
    the baselines' nodes (``MODE_ENV`` turns it off) keep ``evict_queued=true``; reports before the hold have none."""
    vp = load_script("vllm_predict")
    real: dict = {"config": {"hold_queued": False, "hold_queued_host": True}, "policies": {}}
    spec = {m: vp._spec(real, m, {}, "evict", True, 0.9) for m in ("hintflow-infer+host", "kvflow+host", "hintflow-infer")}
    assert "evict_queued=false,host_hold=true" in spec["hintflow-infer+host"]
    for m in ("kvflow+host", "hintflow-infer"):
        assert "evict_queued=true,host_hold=false" in spec[m]
    old = vp._spec({"config": {}, "policies": {}}, "hintflow-infer+host", {}, "evict", True, 0.9)
    assert "evict_queued=true,host_hold=false" in old
    off = {"mode": "hintflow-infer+host", "policy_options": {}, "env": {"HINTFLOW_HOLD_QUEUED": "0"}}
    mirror = vp._variant_mirror("V+host", off, "evict", None, hold_queued=True)
    assert "evict_queued=true" in mirror and "host_hold=false" in mirror
    assert "evict_queued=false" not in mirror and "host_hold=true" not in mirror
    on = {"mode": "hintflow-infer", "policy_options": {}, "env": {"HINTFLOW_HOLD_QUEUED": "1"}}
    mirror = vp._variant_mirror("V", on, "evict", None)
    assert "evict_queued=false" in mirror and "host_hold=true" in mirror
    assert vp._unmirrored({"HINTFLOW_HOLD_QUEUED": "1"}) == []


def test_the_nodes_lost_reading_is_set_beside_the_mirrors() -> None:
    """The harness keeps a hintflow node's last ``lost=`` log reading (``node_lost_by``); the prediction prints
    it beside the mirror's ``lost_by`` tokens as shares, largest cause first, for modes that have both."""
    from replay._vllm_bench import node_lost_shares

    log = ("... hintflow: pinned_blocks=3 lost=pinned:1.00 admit: ...\n"
           "... hintflow: pinned_blocks=9 lost=queued:0.40,yielded:0.35,clamped:0.25 admit: ...\n")  # fmt: skip
    assert node_lost_shares(log) == {"queued": 0.40, "yielded": 0.35, "clamped": 0.25}
    assert node_lost_shares("hintflow: lost=- admit") == {} and node_lost_shares("no line yet") is None
    vp = load_script("vllm_predict")
    meas = {"h+host": {"node_lost_by": {"queued": 0.4, "yielded": 0.6}}, "vanilla+host": {}}
    pred = {"h+host": {"lost_by": {"yielded": 300, "unpinned": 700}}, "vanilla+host": {"lost_by": {"queued": 5}}}
    assert vp.lost_table(meas, pred, ["vanilla+host", "h+host"]) == [
        "h+host: unpinned 0.00 / 0.70, yielded 0.60 / 0.30, queued 0.40 / 0.00"
    ]
