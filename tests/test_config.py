"""Engine config precedence (defaults < YAML < env < explicit), loud unknown keys, and build_engine."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from pydantic import ValidationError

from engine_adapter import (
    ConfigError,
    EngineConfig,
    ModelSettings,
    SchedulerConfig,
    SchedulerSettings,
    build_engine,
    load_engine_config,
)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """A developer's own HINTFLOW_* variables must not leak into these tests."""
    import os

    for key in list(os.environ):
        if key.startswith("HINTFLOW_"):
            monkeypatch.delenv(key)


def _yaml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "engine.yaml"
    path.write_text(text)
    return path


def test_defaults() -> None:
    cfg = load_engine_config(None)
    assert (cfg.executor, cfg.model_name, cfg.host, cfg.port, cfg.metrics_port) == (
        "torch",
        "hintflow-tiny",
        "127.0.0.1",
        0,
        0,
    )
    assert (cfg.num_device_blocks, cfg.num_host_blocks, cfg.pin_budget_fraction) == (256, 0, 0.5)
    assert cfg.eviction_policy == "hinted" and cfg.retain_contexts and cfg.pace_modeled
    assert cfg.scheduler.max_num_batched_tokens == 2048 and cfg.scheduler.max_num_seqs == 64
    assert cfg.scheduler.cold_prefill_budget_tokens == 512 and cfg.scheduler.warm_threshold_tokens == 256
    assert cfg.cost_model == "cpu-tiny"


def test_model_settings_mirror_torch_model_config() -> None:
    from engine_adapter import TorchModelConfig

    torch_defaults = {f.name: f.default for f in dataclasses.fields(TorchModelConfig)}
    assert ModelSettings().model_dump() == torch_defaults


def test_scheduler_settings_mirror_scheduler_config() -> None:
    """A served node and an embedded one (replay, tests) must schedule alike by default."""
    defaults = {f.name: f.default for f in dataclasses.fields(SchedulerConfig)}
    assert SchedulerSettings().model_dump() == defaults


def test_precedence_defaults_yaml_env_explicit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _yaml(
        tmp_path,
        "port: 5001\nnum_host_blocks: 4\nmodel_name: from-yaml\n"
        "scheduler:\n  max_num_seqs: 7\n  warm_threshold_tokens: 100\nmodel:\n  seed: 3\n",
    )
    cfg = load_engine_config(path)
    assert (cfg.port, cfg.num_host_blocks, cfg.model_name) == (5001, 4, "from-yaml")
    assert cfg.scheduler.max_num_seqs == 7 and cfg.model.seed == 3
    assert cfg.num_device_blocks == 256  # untouched: default

    monkeypatch.setenv("HINTFLOW_PORT", "5002")
    monkeypatch.setenv("HINTFLOW_SCHEDULER__MAX_NUM_SEQS", "8")
    monkeypatch.setenv("HINTFLOW_MODEL__SEED", "4")
    cfg = load_engine_config(path)
    assert (cfg.port, cfg.scheduler.max_num_seqs, cfg.model.seed) == (5002, 8, 4)
    assert cfg.scheduler.warm_threshold_tokens == 100  # a nested sibling from YAML survives the env merge
    assert cfg.num_host_blocks == 4 and cfg.model_name == "from-yaml"

    cfg = load_engine_config(path, port=5003, scheduler__max_num_seqs=9, model={"seed": 5}, node_id=None)
    assert (cfg.port, cfg.scheduler.max_num_seqs, cfg.model.seed) == (5003, 9, 5)
    assert cfg.scheduler.warm_threshold_tokens == 100 and cfg.node_id == ""  # None: not given


@pytest.mark.parametrize(
    ("text", "key"),
    [("prot: 1\n", "'prot'"), ("scheduler:\n  max_num_seq: 3\n", "'scheduler.max_num_seq'")],
)
def test_unknown_yaml_key_is_named(tmp_path: Path, text: str, key: str) -> None:
    with pytest.raises(ConfigError, match=f"unknown key {key}"):
        load_engine_config(_yaml(tmp_path, text))


def test_bad_yaml_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="must hold a mapping"):
        load_engine_config(_yaml(tmp_path, "- 1\n- 2\n"))
    with pytest.raises(ConfigError, match="must be a mapping"):
        load_engine_config(_yaml(tmp_path, "model: 3\n"))
    with pytest.raises(ConfigError, match="cannot read"):
        load_engine_config(tmp_path / "missing.yaml")
    assert load_engine_config(_yaml(tmp_path, "")) == EngineConfig()
    with pytest.raises(ValidationError, match="executor"):
        load_engine_config(_yaml(tmp_path, "executor: tpu\n"))
    with pytest.raises(ValidationError):
        load_engine_config(None, no_such_option=1)


def test_cli_reports_unknown_key_as_usage_error(tmp_path: Path) -> None:
    from hintflow.cli import hintflow

    result = CliRunner().invoke(hintflow, ["engine", "serve", "--config", str(_yaml(tmp_path, "bogus: 1\n"))])
    assert result.exit_code == 2 and "unknown key 'bogus'" in result.output


def test_build_torch_engine() -> None:
    cfg = load_engine_config(
        None,
        node_id="n",
        num_device_blocks=32,
        num_host_blocks=4,
        scheduler={"max_num_seqs": 3},
        model={"hidden_size": 32, "intermediate_size": 64, "max_model_len": 128, "seed": 2},
    )
    core = build_engine(cfg)
    assert core.node_id == "n" and core.executor.name == "torch"
    assert (core.kv.device.num_blocks, core.kv.host.num_blocks) == (32, 4)
    assert core.scheduler.config.max_num_seqs == 3 and core.executor.max_model_len == 128


def test_build_modeled_engine(tmp_path: Path) -> None:
    cost_model = pytest.importorskip("engine_adapter._cost_model")
    pytest.importorskip("engine_adapter._modeled_executor")
    from engine_adapter import VirtualClock

    profile = cost_model.CostModel(
        name="test",
        hardware="none",
        model="none",
        source="test",
        prefill_a_s=1e-3,
        prefill_b_s_per_token=1e-5,
        prefill_c_s_per_token2=0.0,
        decode_base_s=1e-3,
        decode_per_seq_s=1e-4,
        decode_per_ctx_token_s=0.0,
        copy_per_block_s=1e-4,
        block_size=16,
        max_batched_tokens=2048,
    )
    path = tmp_path / "profile.json"
    path.write_text(profile.to_json())
    cfg = load_engine_config(None, executor="modeled", cost_model=str(path), pace_modeled=False)
    core = build_engine(cfg)
    assert core.executor.name == "modeled" and isinstance(core.clock, VirtualClock)
    assert json.loads(path.read_text())["name"] == "test"
