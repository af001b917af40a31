"""The ``hintflow`` command line.

Layout: ``hintflow`` (group) > ``engine`` (group) > commands.  Each command is thin: it parses options and
delegates to a module function, importing that module (and anything heavy: torch, grpc) inside the command
so that ``hintflow --help`` stays fast.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import click

from replay import writable_parent

DEFAULT_CAPACITIES = (100_000, 200_000, 400_000, 800_000, 1_600_000)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("hintflow")
    except PackageNotFoundError:  # running from a source checkout that is not pip-installed
        import tomllib

        pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
        try:
            return str(tomllib.loads(pyproject.read_text())["project"]["version"]) + "+src"
        except (OSError, KeyError, tomllib.TOMLDecodeError):
            return "unknown"


def _print_version(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    if value and not ctx.resilient_parsing:
        click.echo(f"hintflow {_version()}")
        ctx.exit()


class CommaInts(click.ParamType):
    """A comma-separated list of positive integers, e.g. ``100000,200000``."""

    name = "N1,N2,..."

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> list[int]:
        if isinstance(value, list | tuple):
            return list(value)
        out = []
        for part in str(value).split(","):
            part = part.strip().replace("_", "")
            try:
                n = int(part)
            except ValueError:
                self.fail(f"{part!r} in {value!r} is not an integer", param, ctx)
            if n <= 0:
                self.fail(f"{n} in {value!r} must be positive", param, ctx)
            out.append(n)
        return out


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--version",
    is_flag=True,
    expose_value=False,
    is_eager=True,
    callback=_print_version,
    help="Show the version and exit.",
)
def hintflow() -> None:
    """hintflow: agent runtime with a program-aware KV-cache engine node."""


@hintflow.group()
def engine() -> None:
    """The engine node: KV cache, scheduler, and their offline tools."""


@engine.command("cache-replay")
@click.argument("trace", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option(
    "--capacity-tokens",
    type=CommaInts(),
    default=",".join(map(str, DEFAULT_CAPACITIES)),
    show_default=True,
    help="KV capacities to replay, in tokens (comma-separated).",
)
@click.option(
    "--block-size",
    type=click.IntRange(min=1),
    default=512,
    show_default=True,
    help="Tokens per trace block (Mooncake hash_ids use 512).",
)
@click.option("--limit", type=click.IntRange(min=0), default=None, help="Replay only the first N requests.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of a table.")
def cache_replay(
    trace: Path, capacity_tokens: list[int], block_size: int, limit: int | None, as_json: bool
) -> None:
    """Replay a Mooncake-format TRACE through the block pool: prefix hit rate per capacity, LRU vs Belady."""
    import time

    from engine_adapter import replay_mooncake

    t0 = time.perf_counter()
    try:
        result = replay_mooncake(
            trace,
            capacity_tokens,
            block_size=block_size,
            limit=limit,
            progress=not as_json and sys.stderr.isatty(),
        )
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    except OSError as e:
        raise click.UsageError(f"cannot read {trace}: {e.strerror or e}") from None
    if as_json:
        click.echo(json.dumps(result))
        return
    click.echo(_cache_replay_table(result, time.perf_counter() - t0))


def _cache_replay_table(result: dict[str, Any], seconds: float) -> str:
    lines = [
        f"trace              {result['trace']}",
        f"requests           {result['num_requests']:,}",
        f"input tokens       {result['input_tokens']:,}",
        f"infinite hit rate  {result['infinite_hit_rate']:.2%}",
    ]
    if result.get("clamped_requests"):
        lines.append(
            f"clamped requests   {result['clamped_requests']:,} (input_length disagrees with hash_ids)"
        )
    lines += ["", f"{'capacity_tokens':>15}  {'blocks':>7}  {'LRU':>7}  {'Belady':>7}"]
    for row in result["capacities"]:
        lines.append(
            f"{row['capacity_tokens']:>15,}  {row['num_blocks']:>7,}  "
            f"{row['lru_hit_rate']:>7.2%}  {row['belady_hit_rate']:>7.2%}"
        )
    lines += ["", f"replayed in {seconds:.1f} s"]
    return "\n".join(lines)


@engine.command("serve", context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
@click.option(
    "--config", "config_file", type=click.Path(exists=True, dir_okay=False), help="YAML config file."
)
@click.option(
    "--backend",
    type=click.Choice(["embedded", "vllm"]),
    default="embedded",
    show_default=True,
    help="vllm: a real vLLM OpenAI server with hintflow's scheduler; flags after -- go to vLLM.",
)
@click.option(
    "--model",
    "vllm_model",
    type=click.Path(exists=True, file_okay=False),
    default=None,
    help="vllm: model folder (see `hintflow make-tiny-model`).",
)
@click.option("--hint-port", type=click.IntRange(0, 65535), default=None, help="vllm: PushHints gRPC port.")
@click.option(
    "--state-dir",
    type=click.Path(file_okay=False),
    default=".hintflow-vllm",
    show_default=True,
    help="vllm: caches, sockets and TMPDIR of the server.",
)
@click.option("--vllm-python", default=None, help="vllm: the Python that has vLLM.  [default: .venv-vllm]")
@click.option(
    "--host-capacity-tokens",
    type=click.IntRange(min=1),
    default=None,
    help="vllm: hintflow's host KV tier (a vLLM KV connector) of this many tokens.  [default: none]",
)
@click.option(
    "--context-moves/--no-context-moves",
    default=False,
    help="vllm: run the model in vLLM's engine-core process (VLLM_ENABLE_V1_MULTIPROCESSING=0), so that "
    "this node can export and import contexts; vLLM does so on one GPU anyway.  [default: off]",
)
@click.argument("vllm_args", nargs=-1, type=click.UNPROCESSED)
@click.option("--executor", type=click.Choice(["torch", "modeled"]), default=None, help="[default: torch]")
@click.option("--host", default=None, help="Address to bind.  [default: 127.0.0.1]")
@click.option("--port", type=click.IntRange(0, 65535), default=None, help="gRPC port, 0: any free one.")
@click.option(
    "--metrics-port",
    type=click.IntRange(-1, 65535),
    default=None,
    help="Prometheus port; 0: any, -1: off.  vllm: hintflow_* metrics from the engine-core process.",
)
@click.option("--node-id", default=None, help="Node id in cache state and logs.  [default: random]")
@click.option("--model-name", default=None, help="model_name metric label.  [default: hintflow-tiny]")
@click.option("--num-device-blocks", type=click.IntRange(min=1), default=None, help="Device KV blocks.")
@click.option("--num-host-blocks", type=click.IntRange(min=0), default=None, help="Host-tier KV blocks.")
@click.option("--pin-budget-fraction", type=click.FloatRange(0.0, 1.0, max_open=True), default=None)
@click.option("--eviction-policy", default=None, help="Eviction policy name.  [default: hinted]")
@click.option("--cost-model", default=None, help="Modeled executor: bundled profile name or JSON path.")
def serve(
    config_file: str | None,
    backend: str,
    vllm_model: str | None,
    hint_port: int | None,
    state_dir: str,
    vllm_python: str | None,
    host_capacity_tokens: int | None,
    context_moves: bool,
    vllm_args: tuple[str, ...],
    **overrides: Any,
) -> None:
    """Serve an engine node over gRPC until SIGINT/SIGTERM.

    Settings come from the options, then HINTFLOW_* environment variables (nested with __, e.g.
    HINTFLOW_SCHEDULER__MAX_NUM_SEQS), then --config, then defaults.  With --backend vllm: vLLM's
    OpenAI server (HTTP on --port) with hintflow's scheduler and hint service (gRPC on --hint-port).
    """
    import asyncio

    if backend == "vllm":
        if vllm_model is None:
            raise click.UsageError(
                "--backend vllm needs --model DIR (build one with `hintflow make-tiny-model DIR`)"
            )
        from engine_adapter.vllm_backend import serve_vllm

        host, port = overrides.get("host") or "127.0.0.1", overrides.get("port") or 8000
        if hint_port:  # how orchestrators name this node (hintflow worker/run --engines, HintRuntime)
            import os

            hint_host = os.environ.get("HINTFLOW_HINT_HOST", "127.0.0.1")  # where the scheduler binds it
            spec = f"vllm+http://{host}:{port}?hints={hint_host}:{hint_port}"
            click.echo(f"hintflow: orchestrators name this node --engines {spec}", err=True)
        try:
            status = serve_vllm(
                vllm_model,
                host=host,
                port=port,
                hint_port=hint_port,
                metrics_port=overrides.get("metrics_port"),
                pin_budget=overrides.get("pin_budget_fraction"),  # None: the node's own default (_hint_scheduler.pin_budget)
                node_id=overrides.get("node_id") or "vllm-0",
                state_dir=state_dir,
                python=vllm_python,
                extra_args=list(vllm_args),
                host_capacity_tokens=host_capacity_tokens,
                context_moves=context_moves,
            )
        except (RuntimeError, ValueError) as e:  # an incompatible vLLM, or one that exited at start-up: say so, no traceback
            raise click.ClickException(str(e)) from None
        raise SystemExit(status)
    if host_capacity_tokens is not None:
        raise click.UsageError("--host-capacity-tokens is for --backend vllm (this node: --num-host-blocks)")
    if context_moves:
        raise click.UsageError("--context-moves is for --backend vllm (an embedded node always moves contexts)")
    if vllm_args:
        raise click.UsageError(
            f"unexpected arguments {' '.join(vllm_args)!r} (only --backend vllm passes flags on)"
        )

    from pydantic import ValidationError

    from engine_adapter import ConfigError, load_engine_config

    try:
        cfg = load_engine_config(config_file, **overrides)
    except (ConfigError, ValidationError) as e:
        raise click.UsageError(str(e)) from None
    asyncio.run(_serve(cfg))


async def _serve(cfg: Any) -> None:
    """Build, start, announce, wait for a signal, stop gracefully."""
    import asyncio
    import signal

    from engine_adapter import build_engine, start_node

    core = build_engine(cfg)
    node = await start_node(core, cfg.host, cfg.port, cfg.metrics_port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    metrics = f"metrics on {node.metrics_address}" if node.metrics_address else "metrics off"
    click.echo(f"hintflow engine node {core.node_id} serving on {node.address} ({metrics})")
    sys.stdout.flush()
    try:
        await stop.wait()
    finally:
        await node.stop(grace=2.0)
    click.echo(f"hintflow engine node {core.node_id} stopped", err=True)


@engine.command("profile")
@click.option(
    "--out", "out", required=True, type=click.Path(dir_okay=False, path_type=Path), help="JSON file to write."
)
@click.option("--quick", is_flag=True, help="Fewer points: ~2 s with the tiny model (full plan: ~10 s).")
@click.option(
    "--plan",
    type=click.Choice(["quick", "full", "large"]),
    default=None,
    help="Which points: quick, full (the default), or large (a real-size model on a GPU: prefills to 8k, "
    "contexts to 24k, 64-sequence decodes; needs --max-model-len 24576).",
)
@click.option("--name", default=None, help="Profile name (default: DEVICE-tiny, or DEVICE-hHIDDEN-lLAYERS).")
@click.option(
    "--repeats",
    type=click.IntRange(min=1),
    default=3,
    show_default=True,
    help="Timed rounds per point (median).",
)
@click.option(
    "--threads", type=click.IntRange(min=1), default=None, help="torch intra-op threads (default: torch's)."
)
@click.option("--device", default="cpu", show_default=True, help="torch device to profile on.")
@click.option(
    "--clock",
    type=click.Choice(["wall", "cpu"]),
    default=None,
    help="Step timer (default: cpu time for a one-thread CPU run, immune to other load; else wall).",
)
@click.option("--hidden-size", type=click.IntRange(min=1), default=128, show_default=True)
@click.option("--num-layers", type=click.IntRange(min=1), default=2, show_default=True)
@click.option("--num-heads", type=click.IntRange(min=1), default=4, show_default=True)
@click.option("--num-kv-heads", type=click.IntRange(min=1), default=2, show_default=True)
@click.option("--intermediate-size", type=click.IntRange(min=1), default=256, show_default=True)
@click.option("--vocab-size", type=click.IntRange(min=1), default=512, show_default=True)
@click.option("--block-size", type=click.IntRange(min=1), default=16, show_default=True)
@click.option("--max-model-len", type=click.IntRange(min=1), default=4096, show_default=True)
@click.option(
    "--dtype",
    type=click.Choice(["float32", "float16", "bfloat16", "float64"]),
    default="float32",
    show_default=True,
)
def profile(
    out: Path,
    quick: bool,
    plan: str | None,
    name: str | None,
    repeats: int,
    threads: int | None,
    device: str,
    clock: str | None,
    **model: Any,
) -> None:
    """Time the embedded torch executor and write a fitted cost model (for the modeled executor)."""
    import time

    import torch

    from engine_adapter import TorchModelConfig, profile_torch_executor

    try:  # a device this machine lacks: say so, not an assertion from deep inside torch
        torch.empty(1, device=device)
    except (RuntimeError, AssertionError) as exc:
        raise click.BadParameter(f"device {device!r} is not usable here: {exc}", param_hint="--device") from None
    t0 = time.perf_counter()
    try:
        cm = profile_torch_executor(
            TorchModelConfig(**model),  # inside the try: a bad size combination is a usage error
            repeats=repeats,
            quick=quick,
            plan=plan,
            device=device,
            threads=threads,
            clock="cpu" if clock == "cpu" else "wall" if clock == "wall" else None,
            name=name,
            progress=lambda msg: click.echo(msg, err=True),
        )
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    try:
        cm.save(out)
    except OSError as e:
        raise click.UsageError(f"cannot write {out}: {e.strerror or e}") from None
    fit = cm.fit or {}
    r2 = {part: fit.get(part, {}).get("r2", float("nan")) for part in ("prefill", "decode", "copy")}
    click.echo(
        f"{cm.name} on {cm.hardware}\n"
        f"prefill  a={cm.prefill_a_s:.3e} s  b={cm.prefill_b_s_per_token:.3e} s/tok  "
        f"c={cm.prefill_c_s_per_token2:.3e} s/tok²  R²={r2['prefill']:.3f}\n"
        f"decode   base={cm.decode_base_s:.3e} s  per_seq={cm.decode_per_seq_s:.3e} s  "
        f"per_ctx_token={cm.decode_per_ctx_token_s:.3e} s  R²={r2['decode']:.3f}\n"
        f"copy     {cm.copy_per_block_s:.3e} s/block  R²={r2['copy']:.3f}\n"
        f"wrote {out} in {time.perf_counter() - t0:.1f} s"
    )


def main() -> None:
    hintflow(prog_name="hintflow")


def _register_replay() -> None:
    from replay import replay_command

    hintflow.add_command(replay_command, "replay")


_register_replay()


def _register_diagnose() -> None:
    """``hintflow diagnose`` and ``hintflow price`` (the hosted-API side: docs/hosted-apis.md)."""
    from diagnose import diagnose_command, price_command

    hintflow.add_command(diagnose_command, "diagnose")
    hintflow.add_command(price_command, "price")


_register_diagnose()


@engine.command("bench")
@click.option(
    "--sessions", type=click.IntRange(min=1), default=10_000, show_default=True, help="Live sessions."
)
@click.option("--context-tokens", type=click.IntRange(min=1), default=256, show_default=True)
@click.option("--running", "num_running", type=click.IntRange(min=1), default=64, show_default=True)
@click.option("--steps", type=click.IntRange(min=1), default=500, show_default=True)
@click.option("--hints", "num_hints", type=click.IntRange(min=1), default=50_000, show_default=True)
@click.option(
    "--batch-size", type=click.IntRange(min=1), default=64, show_default=True, help="Hints per batch."
)
@click.option("--cost-model", default="h100-llama3-8b", show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def bench(as_json: bool, **kwargs: Any) -> None:
    """Scheduler overhead per step and hint throughput with many live sessions (modeled executor)."""
    import json

    from engine_adapter import run_bench

    try:
        result = run_bench(**kwargs)
    except ValueError as e:
        raise click.UsageError(str(e)) from e
    if as_json:
        click.echo(json.dumps(result))
    else:
        for k, v in result.items():
            click.echo(f"{k:>24}: {v}")


@hintflow.command("demo")
@click.option("--programs", type=click.IntRange(min=1), default=24, show_default=True)
@click.option("--turns", type=click.IntRange(min=2), default=10, show_default=True)
@click.option("--nodes", "num_nodes", type=click.IntRange(min=1), default=2, show_default=True)
@click.option(
    "--time-scale",
    type=click.FloatRange(min=0.0),
    default=0.1,
    show_default=True,
    help="Multiply the SWE-like tool pauses (mean 0.9 s, sd 3.5 s).",
)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--temporal", default=None, help="Use this Temporal frontend instead of starting a dev server.")
@click.option(
    "--fcfs-aging",
    "fcfs_aging_s",
    type=click.FloatRange(min=0.0),
    default=None,
    help="hintflow nodes: cap an older program's head start in the queue at this many seconds.  [default: strict]",
)
@click.option(
    "--ttft-deadline",
    "ttft_deadline_s",
    type=click.FloatRange(min=0.0, min_open=True),
    default=None,
    help="hintflow nodes: a request that has waited this long goes ahead of pins and program order.  [default: off]",
)
@click.option(
    "--admit-fraction",
    type=click.FloatRange(min=0.0),
    default=1.0,
    show_default=True,
    help="hintflow nodes: a new program starts only while the in-flight programs' contexts fit in this share "
    "of the KV pool (program admission; 0: off).",
)
@click.option(
    "--background-rate",
    "--competing-rate",  # its name until hintflow run's option of the same meaning was the one kept
    "background_rate",
    type=click.FloatRange(min=0.0),
    default=4.0,
    show_default=True,
    help="Other tenants' cold 200-token prompts a second per node, Poisson arrivals (open loop; 0: none).",
)
@click.option(
    "--out",
    "out_dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("hintflow-demo"),
    show_default=True,
    help="Where the plots and the JSON go.",
)
def demo(
    programs: int,
    turns: int,
    num_nodes: int,
    time_scale: float,
    seed: int,
    temporal: str | None,
    fcfs_aging_s: float | None,
    ttft_deadline_s: float | None,
    admit_fraction: float,
    background_rate: float,
    out_dir: Path,
) -> None:
    """Coding agents on Temporal and two engine nodes: vLLM-like behaviour, then with hints; side by side."""
    import logging

    from hintflow._demo import DemoConfig, format_table, run_demo, write_plots

    logging.basicConfig(level=logging.WARNING)
    cfg = DemoConfig(
        programs=programs,
        turns=turns,
        num_nodes=num_nodes,
        time_scale=time_scale,
        seed=seed,
        fcfs_aging_s=fcfs_aging_s,
        ttft_deadline_s=ttft_deadline_s,
        admit_fraction=admit_fraction or None,
        background_rate=background_rate,
    )
    click.echo(
        f"starting Temporal and {num_nodes} torch engine nodes; {programs} coding-agent programs x {turns} turns, "
        "once without hints and once with (a few minutes on 2 cores)...",
        err=True,
    )
    try:
        result = run_demo(cfg, temporal)
    except Exception as exc:
        click.echo(f"hintflow demo: {type(exc).__name__}: {exc}", err=True)
        _exit_after_temporal(1)
    click.echo(format_table(result))
    for path in write_plots(result, out_dir):
        click.echo(f"wrote {path}")
    _exit_after_temporal(0)


# ---- Temporal: worker and example programs ---------------------------------------------------------------
class CommaStrs(click.ParamType):
    """A comma-separated list of engine nodes: ``HOST:PORT`` or ``vllm+http://HOST:PORT?hints=HOST:PORT``."""

    name = "ENGINE,..."

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> list[str]:
        from hints import parse_engine

        if isinstance(value, list | tuple):
            return list(value)
        out = [p.strip() for p in str(value).split(",") if p.strip()]
        for a in out:
            try:
                parse_engine(a)
            except ValueError as exc:
                self.fail(str(exc), param, ctx)
        return out


def _temporal_options(f: Any) -> Any:
    f = click.option(
        "--engines",
        type=CommaStrs(),
        default="",
        help="Engine nodes, comma-separated: HOST:PORT (embedded node) or "
        "vllm+http://HOST:PORT?hints=HOST:PORT[&model=NAME] (vLLM node: OpenAI server, hint service).  "
        "[default: start one local torch node]",
    )(f)
    return click.option(
        "--temporal", default=None, help="Temporal frontend HOST:PORT.  [default: start a local dev server]"
    )(f)


def _check_cost_model(name: str | None) -> None:
    """Fail before starting anything: a bad --cost-model should not cost a Temporal server start."""
    if name is None:
        return
    from engine_adapter import load_cost_model

    try:
        load_cost_model(name)
    except (ValueError, OSError) as exc:
        raise click.BadParameter(str(exc), param_hint="--cost-model") from exc


def _exit_after_temporal(status: int) -> None:
    """The Temporal SDK can abort at interpreter exit even after a clean shutdown: flush, then leave."""
    import os

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _check_policy(spec: str) -> None:
    """``NAME[:KEY=VALUE,...]`` (orchestrator._policy_spec), or a usage error naming what is wrong."""
    from orchestrator import POLICIES, parse_policy_spec

    try:
        parse_policy_spec(spec, POLICIES)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--policy") from None


_POLICY_HELP = ("Hint policy by name, with options as NAME:KEY=VALUE,... (rel_change, min_change_s, "
                "renew_ahead_s, pause.min_samples, pause.default_mean_s, pause.capacity), e.g. "
                "hintflow:rel_change=0.05.")


@hintflow.command("worker")
@_temporal_options
@click.option("--task-queue", default="hintflow", show_default=True)
@click.option("--policy", default="hintflow", show_default=True, help=_POLICY_HELP)
@click.option("--metrics-port", type=click.IntRange(1, 65535), default=None, help="Serve /metrics here.")
@click.option(
    "--cost-model", default=None, help="Engine cost model (profile name or JSON) for routing and pin TTLs."
)
def worker(
    temporal: str | None,
    engines: list[str],
    task_queue: str,
    policy: str,
    metrics_port: int | None,
    cost_model: str | None,
) -> None:
    """Run a Temporal worker with the hintflow plugin and the example workflows until Ctrl-C or SIGTERM."""
    import asyncio
    import logging

    from hintflow._run import run_worker

    _check_policy(policy)
    _check_cost_model(cost_model)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    status = 0
    try:
        asyncio.run(run_worker(temporal, engines, task_queue, policy, metrics_port, cost_model))
    except Exception as exc:
        click.echo(f"hintflow worker: {exc}", err=True)
        status = 1
    _exit_after_temporal(status)


@hintflow.command("run")
@click.argument("example")
@_temporal_options
@click.option("--programs", type=click.IntRange(min=1), default=4, show_default=True)
@click.option("--policy", default="hintflow", show_default=True, help=_POLICY_HELP)
@click.option(
    "--time-scale",
    type=click.FloatRange(min=0.0),
    default=1.0,
    show_default=True,
    help="Multiply every sampled tool/human pause.",
)
@click.option(
    "--arrival-gap", "arrival_gap_s", type=click.FloatRange(min=0.0), default=0.5, show_default=True
)
@click.option(
    "--background-clients",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="Competing tenants per node sending cold prompts while the programs run, each its next as soon as "
    "the last returns (closed loop).",
)
@click.option(
    "--background-rate",
    type=click.FloatRange(min=0.0),
    default=0.0,
    show_default=True,
    help="Competing cold prompts a second per node, Poisson arrivals (open loop: the same load whatever the "
    "node does with it).",
)
@click.option(
    "--device-blocks",
    "num_device_blocks",
    type=click.IntRange(min=16),
    default=256,
    show_default=True,
    help="Device KV blocks of each local node (16 tokens each).",
)
@click.option(
    "--nodes",
    "num_nodes",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Local torch engine nodes to start (without --engines).",
)
@click.option(
    "--routing",
    default=None,
    help="Routing rule: hintflow, llm-d, session, round-robin.  [default: session for vllm-default, else hintflow]",
)
@click.option(
    "--seed",
    type=int,
    default=0,
    show_default=True,
    help="Seeds each program's random draws (its text, tool times): the same seed runs the same programs.",
)
@click.option(
    "--migrate/--no-migrate",
    default=None,
    help="Move contexts between embedded nodes: with a session the router sends elsewhere, and with a turn "
    "queued on its node to a node with room.  [default: on for hintflow]",
)
@click.option(
    "--set",
    "sets",
    multiple=True,
    metavar="FIELD=VALUE",
    help="Override a field of the example's input, e.g. --set turns=12.",
)
@click.option(
    "--cost-model", default=None, help="Engine cost model (profile name or JSON) for routing and pin TTLs."
)
@click.option(
    "--json", "json_out", type=click.Path(dir_okay=False), default=None, callback=writable_parent,
    help="Write the report here.",
)
def run(
    example: str,
    temporal: str | None,
    engines: list[str],
    json_out: str | None,
    sets: tuple[str, ...],
    num_device_blocks: int,
    num_nodes: int,
    **kw: Any,
) -> None:
    """Start N programs of EXAMPLE (coding-agent, pipeline, human-in-loop) and report each turn."""
    import asyncio

    from hintflow._run import RunConfig, run_programs
    from workflows.examples import EXAMPLES

    if example not in EXAMPLES:
        raise click.BadParameter(f"unknown example {example!r}; known: {', '.join(sorted(EXAMPLES))}")
    _check_policy(kw["policy"])
    input_type = EXAMPLES[example].input_type
    overrides = _parse_sets(input_type, sets)
    # The input the programs will get, checked here: a bad value is a usage error, not a failed program.
    inp = EXAMPLES[example].make_input(**({"time_scale": kw["time_scale"]} | overrides))
    problems = inp.problems() if hasattr(inp, "problems") else []
    if problems:
        raise click.BadParameter("; ".join(problems), param_hint="--set")
    _check_cost_model(kw.get("cost_model"))
    if kw["routing"] is not None:
        from orchestrator import ROUTING_POLICIES

        if kw["routing"] not in ROUTING_POLICIES:
            raise click.BadParameter(
                f"unknown routing {kw['routing']!r}; known: {', '.join(sorted(ROUTING_POLICIES))}",
                param_hint="--routing",
            )
    cfg = RunConfig(example=example, overrides=overrides, **kw)
    status = 0
    try:
        report = asyncio.run(
            run_programs(cfg, temporal, engines, num_device_blocks=num_device_blocks, num_nodes=num_nodes)
        )
    except (KeyboardInterrupt, asyncio.CancelledError):  # Ctrl-C: asyncio.run cancelled the run and what it started
        click.echo("hintflow run: interrupted", err=True)
        _exit_after_temporal(130)  # (not interpreter exit: the Temporal SDK can abort there)
    except Exception as exc:
        click.echo(f"hintflow run: {_failure_text(exc)}", err=True)
        _exit_after_temporal(1)
    click.echo(_run_table(report))
    if json_out:
        try:
            Path(json_out).write_text(json.dumps(report, indent=2) + "\n")
            click.echo(f"wrote {json_out}", err=True)
        except OSError as exc:
            click.echo(f"hintflow run: could not write --json {json_out}: {exc}", err=True)
            status = 1
    _exit_after_temporal(status)


def _coerce(name: str, raw: str, typ: Any) -> Any:
    """``raw`` as a value of the field's type, or ValueError saying what was expected (scalars parse as a
    policy option's value does: one parser, one wording)."""
    from orchestrator import Option, parse_value

    if typ in (bool, int, float, str):
        return raw if typ is str else parse_value(name, raw, Option(typ, ""))
    try:  # a structured field (none of the examples has one today): JSON
        return json.loads(raw)
    except json.JSONDecodeError:
        raise ValueError(f"{name}={raw!r}: expected a JSON value") from None


def _parse_sets(input_type: type, sets: tuple[str, ...]) -> dict[str, Any]:
    """``--set FIELD=VALUE`` overrides, each coerced to the field's type; a bad one is a usage error."""
    import typing

    hints = typing.get_type_hints(input_type)
    fields = [f.name for f in dataclasses.fields(input_type)]
    overrides: dict[str, Any] = {}
    for s in sets:
        name, sep, raw = s.partition("=")
        if not sep or name not in fields:
            raise click.BadParameter(f"--set {s!r}: expected FIELD=VALUE with FIELD in {', '.join(fields)}")
        try:
            overrides[name] = _coerce(name, raw, hints.get(name))
        except ValueError as exc:
            raise click.BadParameter(f"--set {exc}") from None  # (the message names FIELD='VALUE')
    return overrides


def _failure_text(exc: BaseException) -> str:
    """The innermost cause of a failure, e.g. the ApplicationError inside WorkflowFailureError's
    ActivityError: "WorkflowFailureError: Workflow execution failed" alone says nothing."""
    inner, seen = exc, {id(exc)}
    while True:
        nxt = getattr(inner, "cause", None) or inner.__cause__
        if not isinstance(nxt, BaseException) or id(nxt) in seen:
            break
        seen.add(id(nxt))
        inner = nxt
    kind = getattr(inner, "type", None)  # an ApplicationError's type names the error (InvalidPrompt, ...)
    if not isinstance(kind, str) or not kind:
        kind = type(inner).__name__
    message = getattr(inner, "message", None)
    if not isinstance(message, str):
        message = str(inner)
    return f"{kind}: {message or repr(inner)}"


def _run_table(r: dict[str, Any]) -> str:
    lines = [
        f"{r['example']} x {r['num_programs']} programs, policy {r['policy']}, engines {', '.join(r['engines'])}"
    ]
    lines.append(
        f"{'program':<40} {'turns':>5} {'JCT s':>7} {'TTFT p50':>9} {'cached':>8} {'recomp':>7} {'pins':>5}"
    )
    for p in r["programs"]:
        ttft = sorted(p["ttft_s"])
        lines.append(
            f"{p['program_id'][:40]:<40} {p['num_turns']:>5} {p['jct_s']:>7.2f} {ttft[len(ttft) // 2]:>9.3f} "
            f"{sum(p['cached_tokens']):>8} {sum(p['recomputed_tokens']):>7} {p['pins_placed']:>5}"
        )
    lines.append(
        f"total: {r['num_turns']} turns, JCT mean {r['jct_mean_s']:.2f} s p90 {r['jct_p90_s']:.2f} s, "
        f"TTFT p50 {r['ttft_p50_s']:.3f} s p90 {r['ttft_p90_s']:.3f} s, across-turn hit rate "
        f"{r['across_turn_hit_rate']:.1%}, recomputed {r['recomputed_tokens']} tokens, pins placed "
        f"{r['pins_placed']} (held to the next turn {r['pins_held']}, expired {r['pins_expired']}), wall {r['wall_s']:.1f} s"
    )
    if str(r.get("policy", "")).split(":")[0] == "thunderagent":
        lines.append(f"thunderagent: {r['thunderagent_pauses']} pauses, {r['thunderagent_restores']} restores")
    if r.get("migrate"):
        lines.append(
            f"migrations: {r['migrations']} ({r['migrated_tokens']} tokens, {r['migrated_bytes'] / 2**20:.1f} MiB, "
            f"{r['migration_s']:.2f} s), failed {r['migrations_failed']}, recomputed instead "
            f"{r['migrations_skipped']}"
        )
    return "\n".join(lines)


@hintflow.command("soak")
@click.option(
    "--minutes",
    type=click.FloatRange(min=0.0, min_open=True),
    required=True,
    help="How long programs arrive.",
)
@click.option("--nodes", "num_nodes", type=click.IntRange(min=1), default=3, show_default=True)
@click.option("--workers", "num_workers", type=click.IntRange(min=1), default=2, show_default=True)
@click.option(
    "--rate",
    "rate_per_s",
    type=click.FloatRange(min=0.0, min_open=True),
    default=1.0,
    show_default=True,
    help="Programs started per second (Poisson arrivals).",
)
@click.option("--seed", type=int, default=0, show_default=True, help="Seeds the arrivals and the chaos.")
@click.option(
    "--chaos-interval-s",
    type=click.FloatRange(min=0.0),
    default=20.0,
    show_default=True,
    help="Mean seconds between chaos events (each 0.5-1.5x it); 0: no chaos.",
)
@click.option(
    "--device-blocks",
    "num_device_blocks",
    type=click.IntRange(min=64),
    default=64,
    show_default=True,
    help="Device KV blocks per node (16 tokens; the longest program needs ~54).",
)
@click.option(
    "--host-blocks", "num_host_blocks", type=click.IntRange(min=0), default=64, show_default=True,
    help="Host-tier KV blocks per node.",
)  # fmt: skip
@click.option("--policy", default="hintflow", show_default=True, help=_POLICY_HELP)
@click.option(
    "--drain-timeout-s",
    type=click.FloatRange(min=0.0),
    default=300.0,
    show_default=True,
    help="After the arrivals, how long the programs still running may take to finish.",
)
@click.option(
    "--task-queue", default=None, help="The workers' task queue (also in node ids).  [default: random]"
)
@click.option(
    "--log-dir",
    type=click.Path(file_okay=False),
    default=None,
    help="Children's logs.  [default: a temp dir]",
)
@click.option(
    "--temporal", default=None, help="Temporal frontend HOST:PORT.  [default: start a local dev server]"
)
@click.option("--json", "as_json", is_flag=True, help="Print the report as one JSON object.")
def soak(as_json: bool, **kw: Any) -> None:
    """Programs arrive on Temporal and torch nodes while nodes and workers are SIGKILLed and restarted.

    Exit status 0 only if every program finished and every node's pool is whole at the end."""
    import asyncio
    import logging

    from hintflow._soak import SoakConfig, format_report, run_soak

    _check_policy(kw["policy"])
    logging.basicConfig(level=logging.WARNING)
    try:
        status, report = asyncio.run(run_soak(SoakConfig(**kw), lambda line: click.echo(line, err=True)))
    except Exception as exc:
        click.echo(f"hintflow soak: {_failure_text(exc)}", err=True)
        _exit_after_temporal(1)
    if report is not None:
        click.echo(json.dumps(report) if as_json else format_report(report))
    _exit_after_temporal(status)


@engine.command(
    "vllm-bench",
    context_settings={"ignore_unknown_options": True, "allow_extra_args": True, "help_option_names": []},
)
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def vllm_bench(args: tuple[str, ...]) -> None:
    """Agent programs against real vLLM nodes: vanilla vs hintflow (infer / orchestrator); --help for flags."""
    from replay import vllm_bench_main as bench_main

    bench_main(list(args))


@hintflow.command("make-tiny-model")
@click.argument("out_dir", type=click.Path(file_okay=False, path_type=Path))
def make_tiny_model_cmd(out_dir: Path) -> None:
    """Build the random-weight Llama test model and a byte-level BPE tokenizer in OUT_DIR (no hub access).

    Needs transformers and tokenizers, which come with vLLM (run it with the .venv-vllm Python)."""
    try:  # (the tiny model's module imports tokenizers and transformers only when it builds)
        import tokenizers  # noqa: F401
        import transformers  # noqa: F401

        from engine_adapter.vllm_backend import make_tiny_model
    except ImportError as exc:
        raise click.ClickException(
            f"{exc}: run this with the Python that has vLLM (.venv-vllm/bin/python)"
        ) from exc
    path = make_tiny_model(out_dir)
    click.echo(f"wrote {path}")
