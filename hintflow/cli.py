"""The ``hintflow`` command line.

Layout: ``hintflow`` (group) > ``engine`` (group) > commands.  Each command is thin: it parses options and
delegates to a module function, importing that module (and anything heavy: torch, grpc) inside the command
so that ``hintflow --help`` stays fast.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import click

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

    from engine_adapter._cache_replay import replay_mooncake

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


def main() -> None:
    hintflow(prog_name="hintflow")
