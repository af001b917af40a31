"""An engine node's configuration, from four places: CLI > env (``HINTFLOW_*``) > YAML file > defaults.

Nested sections (``scheduler``, ``model``) are set from the environment with ``__`` as the delimiter, e.g.
``HINTFLOW_SCHEDULER__MAX_NUM_SEQS=8`` or ``HINTFLOW_MODEL__SEED=3``.  The YAML file is checked key by
key before anything else, so a typo (``max_num_seq``) fails loudly with the key's dotted path instead of
being dropped and leaving the node on a default nobody asked for.

This module imports neither torch nor the executors: ``build_engine`` imports the one it needs, so
loading (and validating) a config stays cheap.
"""

from __future__ import annotations

from contextvars import ContextVar
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from ._queue_place import WARM_THRESHOLD_TOKENS

if TYPE_CHECKING:
    from ._engine import EngineCore

__all__ = [
    "ConfigError",
    "EngineConfig",
    "ModelSettings",
    "SchedulerSettings",
    "build_engine",
    "load_engine_config",
]


class ConfigError(ValueError):
    """A configuration file that cannot be used (unreadable, not a mapping, or an unknown key)."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())


class SchedulerSettings(_Section):
    """Mirrors ``SchedulerConfig``: the per-step token budget and the cold-prefill cap."""

    max_num_batched_tokens: int = Field(default=2048, ge=1)
    max_num_seqs: int = Field(default=64, ge=1)
    cold_prefill_budget_tokens: int = Field(default=512, ge=0)
    warm_threshold_tokens: int = Field(default=WARM_THRESHOLD_TOKENS, ge=0)
    warm_first: bool = True
    program_fcfs_aging_s: float | None = Field(default=None, ge=0.0, allow_inf_nan=False)
    ttft_deadline_s: float | None = Field(default=None, gt=0.0, allow_inf_nan=False)
    fcfs_slack: float | None = Field(default=None, ge=0.0, allow_inf_nan=False)
    admission_lookahead: int = Field(default=64, ge=1)
    yield_pins_to_older: bool = False
    admit_fraction: float | None = Field(default=None, gt=0.0, allow_inf_nan=False)
    admit_max_wait_s: float | None = Field(default=None, ge=0.0, allow_inf_nan=False)
    admit_horizon_s: float = Field(default=5.0, ge=0.0, allow_inf_nan=False)
    resumes_are_warm: bool = False
    admit_whole_prompt: bool = False


class ModelSettings(_Section):
    """Mirrors ``TorchModelConfig`` field for field (a test keeps the two in step) without importing torch."""

    vocab_size: int = Field(default=512, ge=1)
    hidden_size: int = Field(default=128, ge=1)
    num_layers: int = Field(default=2, ge=1)
    num_heads: int = Field(default=4, ge=1)
    num_kv_heads: int = Field(default=2, ge=1)
    intermediate_size: int = Field(default=256, ge=1)
    max_model_len: int = Field(default=4096, ge=1)
    block_size: int = Field(default=16, ge=1)
    dtype: str = "float32"
    seed: int = 0
    rope_theta: float = Field(default=10000.0, gt=0.0)


_yaml_data: ContextVar[dict[str, Any] | None] = ContextVar("hintflow_engine_yaml", default=None)
"""The YAML file's contents for the ``EngineConfig`` being built; a context variable because pydantic-
settings asks for sources on the class, while the file is chosen per call."""


class _YamlSource(PydanticBaseSettingsSource):
    """Hands pydantic-settings the already-checked YAML mapping (the lowest source above defaults)."""

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return (_yaml_data.get() or {}).get(field_name), field_name, False

    def __call__(self) -> dict[str, Any]:
        return dict(_yaml_data.get() or {})


class EngineConfig(BaseSettings):
    """Everything needed to build and serve one engine node."""

    model_config = SettingsConfigDict(
        env_prefix="HINTFLOW_",
        env_nested_delimiter="__",
        extra="forbid",
        protected_namespaces=(),
    )

    executor: Literal["torch", "modeled"] = "torch"
    node_id: str = ""
    model_name: str = "hintflow-tiny"
    host: str = "127.0.0.1"
    port: int = Field(default=0, ge=0, le=65535, description="0: pick a free port")
    metrics_port: int = Field(
        default=0, ge=-1, le=65535, description="0: pick a free port; -1: no metrics server"
    )
    num_device_blocks: int = Field(default=256, ge=1)
    num_host_blocks: int = Field(default=0, ge=0)
    pin_budget_fraction: float = Field(default=0.5, ge=0.0, lt=1.0)
    eviction_policy: str = "hinted"
    retain_contexts: bool = True
    scheduler: SchedulerSettings = Field(default_factory=SchedulerSettings)
    model: ModelSettings = Field(default_factory=ModelSettings)
    cost_model: str = Field(default="cpu-tiny", description="bundled profile name or path (modeled executor)")
    pace_modeled: bool = Field(default=True, description="modeled executor: sleep each step's modeled time")

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        """First source wins: explicit (CLI) values, then the environment, then the YAML file."""
        return init_settings, env_settings, _YamlSource(settings_cls)


def _check_keys(data: dict[str, Any], model: type[BaseModel], where: str, prefix: str = "") -> None:
    """Raise ConfigError for the first key the model does not have, naming its dotted path."""
    for key, value in data.items():
        path = f"{prefix}{key}"
        field = model.model_fields.get(str(key))
        if field is None:
            known = ", ".join(model.model_fields)
            raise ConfigError(f"unknown key {path!r} in {where} (known keys here: {known})")
        sub = field.annotation
        if isinstance(sub, type) and issubclass(sub, BaseModel):
            if not isinstance(value, dict):
                raise ConfigError(f"{path!r} in {where} must be a mapping, got {type(value).__name__}")
            _check_keys(value, sub, where, f"{path}.")


def _read_yaml(config_file: str | Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(Path(config_file).read_text())
    except OSError as e:
        raise ConfigError(f"cannot read config file {config_file}: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {config_file} is not valid YAML: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {config_file} must hold a mapping, got {type(data).__name__}")
    _check_keys(data, EngineConfig, str(config_file))
    return data


def _nest(overrides: dict[str, Any]) -> dict[str, Any]:
    """Drop unset (None) overrides and expand ``scheduler__max_num_seqs`` keys into nested dicts."""
    out: dict[str, Any] = {}
    for key, value in overrides.items():
        if value is None:
            continue
        *parents, leaf = key.split("__")
        node = out
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return out


def load_engine_config(config_file: str | Path | None = None, **cli_overrides: Any) -> EngineConfig:
    """Build the config; ``cli_overrides`` left at None count as not given (click passes them so)."""
    token = _yaml_data.set(_read_yaml(config_file) if config_file else None)
    try:
        return EngineConfig(**_nest(cli_overrides))
    finally:
        _yaml_data.reset(token)


def build_engine(cfg: EngineConfig) -> EngineCore:
    """An EngineCore with the configured executor (imported here: torch is heavy, modeled optional)."""
    from ._engine import EngineCore
    from ._executor import Clock, Executor, VirtualClock
    from ._scheduler import SchedulerConfig

    executor: Executor
    clock: Clock | None = None
    if cfg.executor == "torch":
        from ._torch_executor import make_torch_executor

        executor = make_torch_executor(cfg.num_device_blocks, cfg.num_host_blocks, **cfg.model.model_dump())
    else:
        from ._cost_model import load_cost_model
        from ._modeled_executor import ModeledExecutor

        executor = ModeledExecutor(
            load_cost_model(cfg.cost_model),
            cfg.num_device_blocks,
            cfg.num_host_blocks,
            vocab_size=cfg.model.vocab_size,
            max_model_len=cfg.model.max_model_len,
            seed=cfg.model.seed,
        )
        if not cfg.pace_modeled:  # unpaced: time is what the cost model says, not the wall clock
            clock = VirtualClock()
    return EngineCore(
        executor,
        clock=clock,
        scheduler_config=SchedulerConfig(**cfg.scheduler.model_dump()),
        pin_budget_fraction=cfg.pin_budget_fraction,
        eviction_policy=cfg.eviction_policy,
        retain_contexts=cfg.retain_contexts,
        node_id=cfg.node_id,
        model_name=cfg.model_name,
        pace_modeled=cfg.pace_modeled,
    )
