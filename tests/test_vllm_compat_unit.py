"""The check that the installed vLLM has every internal hintflow's scheduler relies on (``_compat``).

Without vLLM: stand-in classes with every required name pass; one name fewer, a class gone, an
overridden hook that vLLM's ``Scheduler`` or ``AsyncScheduler`` no longer calls, or an ``AsyncScheduler``
that no longer extends ``Scheduler`` raise ``RuntimeError`` naming the installed version, each missing
name and the tested one; another version with every name logs one warning; ``serve_vllm`` checks before
it launches anything. With the vLLM venv's Python (skipped, saying why, where there is none): the
installed vLLM passes, and ``HintflowScheduler`` / ``HintflowAsyncScheduler`` fail at construction, before
vLLM builds anything, once a name is deleted from vLLM's own ``Scheduler`` or a hook is no longer called
(by ``Scheduler``, or by ``AsyncScheduler`` alone). The host KV tier's names (``HOST_TIER_REQUIRED``) are
checked the same way when the connector is constructed, under any scheduler, and ``_scheduler`` imports
vLLM's scheduler classes only after the check, so a vLLM that moved one fails with the check's error.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import subprocess
import sys
from typing import Any

import pytest

from engine_adapter.vllm_backend import _serve
from engine_adapter.vllm_backend._compat import (
    HOST_TIER_COMPONENT,
    HOST_TIER_REQUIRED,
    OVERRIDDEN_HOOKS,
    REQUIRED,
    SCHEDULER_CLASSES,
    TESTED_VLLM_VERSION,
    check_vllm_python,
    missing_internals,
    verdict,
)


class _SchedulerBase:
    """Like vLLM's: its own code calls the hooks hintflow overrides, and ``__init__`` sets its state."""

    def __init__(self) -> None:
        self.kv_cache_manager = None
        self.waiting = None

    def _free_blocks(self, request: Any) -> None:
        self._free_request_blocks(request)

    def _free_request_blocks(self, request: Any) -> None:
        pass

    def schedule(self) -> bool:
        return self._handle_blocked_waiting_request(None)

    def _handle_blocked_waiting_request(self, request: Any) -> bool:
        return True


def _stand_ins(
    drop: str = "", base: type = _SchedulerBase, required: dict[str, tuple[str, tuple[str, ...]]] = REQUIRED
) -> dict[str, type | None]:
    """A class per required owner with every required name, less ``drop`` (``Owner.name``); the
    ``AsyncScheduler`` stand-in extends the ``Scheduler`` one, as vLLM's does."""
    classes: dict[str, type | None] = {}
    for owner, (_, names) in required.items():
        bases: tuple[type, ...] = ()
        if owner == "Scheduler":
            bases = (base,)
        elif owner == "AsyncScheduler":
            sched = classes["Scheduler"]  # built first (REQUIRED's order)
            assert sched is not None
            bases = (sched,)
        attrs = {n: None for n in names if f"{owner}.{n}" != drop and not any(hasattr(b, n) for b in bases)}
        classes[owner] = type(owner, bases, attrs)
    return classes


def test_stand_ins_with_every_name_pass_quietly(caplog: pytest.LogCaptureFixture) -> None:
    assert missing_internals(_stand_ins()) == []
    with caplog.at_level(logging.WARNING, logger="vllm.hintflow"):
        verdict(TESTED_VLLM_VERSION, [])
        verdict(TESTED_VLLM_VERSION + "+cpu", [])  # a local build of the same release
    assert caplog.records == []


@pytest.mark.parametrize(
    "drop",
    [
        "Scheduler._request_blocks_can_be_freed", "BlockPool.free_block_queue", "Request.session_id",
        # preemptions, deferred block frees and cache resets (_hint_scheduler)
        "CachedRequestData.resumed_req_ids", "Scheduler.reset_prefix_cache", "KVCacheManager.get_blocks",
        "Request.is_finished",
    ],
)  # fmt: skip
def test_a_missing_name_fails_naming_it_and_both_versions(drop: str) -> None:
    missing = missing_internals(_stand_ins(drop))
    assert missing == [drop]
    with pytest.raises(RuntimeError) as err:
        verdict("0.33.1", missing)
    msg = str(err.value)
    assert "vLLM 0.33.1" in msg and drop in msg and f"tested against vLLM {TESTED_VLLM_VERSION}" in msg


@pytest.mark.parametrize(
    "drop",
    [
        "Request.num_in_flight_tokens", "Request.block_hashes", "KVConnectorBase_V1._kv_cache_manager",
        "KVConnectorBase_V1._kv_transfer_config", "KVConnectorBase_V1._kv_cache_config",
    ],
)  # fmt: skip
def test_the_host_tier_names_are_checked_with_the_same_error(drop: str) -> None:
    """The host tier also runs under stock vLLM's scheduler, where no scheduler check runs: its own names,
    before, were in no list (a renamed ``num_in_flight_tokens`` read as 0: blocks still being written saved)."""
    assert missing_internals(_stand_ins(required=HOST_TIER_REQUIRED), HOST_TIER_REQUIRED) == []
    missing = missing_internals(_stand_ins(drop, required=HOST_TIER_REQUIRED), HOST_TIER_REQUIRED)
    assert missing == [drop]
    with pytest.raises(RuntimeError) as err:
        verdict("0.33.1", missing, component=HOST_TIER_COMPONENT)
    msg = str(err.value)
    assert msg.startswith(HOST_TIER_COMPONENT) and drop in msg and f"tested against vLLM {TESTED_VLLM_VERSION}" in msg


def test_names_set_in_init_and_dataclass_fields_count_as_present() -> None:
    """vLLM keeps most scheduler state as attributes its ``__init__`` assigns: no class attribute."""
    from dataclasses import make_dataclass

    classes = _stand_ins()
    in_init = {"kv_cache_manager", "waiting"}  # only _SchedulerBase.__init__ sets these
    attrs = {n: None for n in REQUIRED["Scheduler"][1] if not hasattr(_SchedulerBase, n) and n not in in_init}
    classes["Scheduler"] = sched = type("Scheduler", (_SchedulerBase,), attrs)
    classes["AsyncScheduler"] = type("AsyncScheduler", (sched,), {})  # inherits them all
    classes["SchedulerOutput"] = make_dataclass(
        "SchedulerOutput", [(n, int) for n in REQUIRED["SchedulerOutput"][1]]
    )
    assert not any(hasattr(classes["Scheduler"], n) for n in in_init)
    assert not hasattr(classes["SchedulerOutput"], "scheduled_new_reqs")  # a field without a default
    assert missing_internals(classes) == []


def test_a_hook_vllm_no_longer_calls_fails_and_a_vanished_class_is_named() -> None:
    class Refactored(_SchedulerBase):
        def _free_blocks(self, request: Any) -> None:  # frees without the hook hintflow overrides
            pass

    missing = missing_internals(_stand_ins(base=Refactored))
    assert missing == [  # AsyncScheduler inherits the refactoring
        f"{owner}._free_request_blocks (overridden by hintflow, but no longer called by vLLM)"
        for owner in ("Scheduler", "AsyncScheduler")
    ]
    assert set(OVERRIDDEN_HOOKS) == {"_free_request_blocks", "_handle_blocked_waiting_request"}

    classes = _stand_ins()
    classes["FreeKVCacheBlockQueue"] = None
    assert missing_internals(classes) == ["vllm.v1.core.kv_cache_utils.FreeKVCacheBlockQueue (the class)"]


def test_the_async_scheduler_must_stay_a_scheduler_that_calls_the_hooks() -> None:
    """HintflowAsyncScheduler puts the same rules over AsyncScheduler: an AsyncScheduler that frees blocks
    its own way, or no longer extends Scheduler, would bypass them there only."""
    assert SCHEDULER_CLASSES == ("Scheduler", "AsyncScheduler")
    classes = _stand_ins()
    sched = classes["Scheduler"]
    assert sched is not None

    def free_blocks_its_own_way(self: Any, request: Any) -> None:
        pass

    classes["AsyncScheduler"] = type("AsyncScheduler", (sched,), {"_free_blocks": free_blocks_its_own_way})
    assert missing_internals(classes) == [
        "AsyncScheduler._free_request_blocks (overridden by hintflow, but no longer called by vLLM)"
    ]
    classes["AsyncScheduler"] = type("AsyncScheduler", (_SchedulerBase,), dict(vars(sched)))
    assert missing_internals(classes) == ["AsyncScheduler (no longer a subclass of Scheduler)"]


def test_another_version_with_every_name_warns_once(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="vllm.hintflow"):
        verdict("0.33.0", [])
    assert len(caplog.records) == 1
    text = caplog.records[0].getMessage()
    assert "0.33.0" in text and TESTED_VLLM_VERSION in text


def test_serve_checks_before_launching(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    launched: list[Any] = []
    checked: list[str] = []

    def check(python: str, env: Any = None) -> str:
        checked.append(python)
        verdict("0.40.0", ["BlockPool.touch"])
        return "0.40.0"

    monkeypatch.setattr(_serve, "check_vllm_python", check)
    monkeypatch.setattr(_serve.subprocess, "Popen", lambda *a, **k: launched.append(a))
    with pytest.raises(RuntimeError, match=r"BlockPool\.touch"):
        _serve.serve_vllm(tmp_path, python="py", state_dir=tmp_path / "state")
    assert checked == ["py"] and launched == []


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is importable here")
def test_a_python_without_vllm_is_reported() -> None:
    with pytest.raises(RuntimeError, match="has no vLLM installed") as err:
        check_vllm_python(sys.executable)
    assert "--vllm-python" in str(err.value) and TESTED_VLLM_VERSION in str(err.value)  # what to do instead


def test_node_settings_name_every_setting_the_node_reads() -> None:
    """``NODE_SETTINGS`` (what ``--variant ...:env.KEY=`` accepts) is exactly the ``HINTFLOW_*`` names the
    package reads from its environment: a new setting not listed, or a listed one no longer read, fails."""
    import re
    from pathlib import Path

    read = set()
    for path in (Path(_serve.__file__).parent).glob("*.py"):
        read |= set(re.findall(r'(?:environ\.get|env_on|env_float|env_?|getenv)\(\s*"(HINTFLOW_[A-Z0-9_]+)"', path.read_text()))
    read.discard("HINTFLOW_VLLM_PYTHON")  # where the launcher finds vLLM, not a node setting
    assert read == set(_serve.NODE_SETTINGS)


# ---- against the installed vLLM ---------------------------------------------------------------------------

_MUTATE = r"""
import json
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from engine_adapter.vllm_backend._scheduler import HintflowAsyncScheduler, HintflowScheduler

def construct(cls=HintflowScheduler):
    try:
        cls(None, None)  # fails in our check, before vLLM's __init__ reads its arguments
    except RuntimeError as e:
        return str(e)
    except Exception as e:  # vLLM's __init__ ran: the check passed
        return "passed: " + type(e).__name__

out = {"intact": construct(), "async_intact": construct(HintflowAsyncScheduler)}
callers = [  # Scheduler's functions that call the hook
    name for name, f in vars(Scheduler).items()
    if name != "_free_request_blocks" and "_free_request_blocks" in getattr(getattr(f, "__code__", None), "co_names", ())
]
for name in callers:  # as an upgrade in which AsyncScheduler frees blocks its own way
    setattr(AsyncScheduler, name, lambda self, *a, **k: None)
out["async_hook"] = construct(HintflowAsyncScheduler)
out["sync_class"] = construct()  # the check is one for the installed vLLM: it fails for both classes
for name in callers:
    delattr(AsyncScheduler, name)
saved = Scheduler._request_blocks_can_be_freed
del Scheduler._request_blocks_can_be_freed  # as a vLLM upgrade that dropped it
out["deleted"] = construct()
Scheduler._request_blocks_can_be_freed = saved
for name, f in list(vars(Scheduler).items()):  # as an upgrade that frees blocks without the hook
    code = getattr(f, "__code__", None)
    if name != "_free_request_blocks" and code is not None and "_free_request_blocks" in code.co_names:
        setattr(Scheduler, name, lambda self, *a, **k: None)
out["hook"] = construct()
print(json.dumps(out))
"""


_HOST_TIER_MUTATE = r"""
import json, sys
from types import SimpleNamespace
out = {}
# vLLM's scheduler module moved: importing our scheduler classes fails with the check's error
sys.modules["vllm.v1.core.sched.async_scheduler"] = None
try:
    import engine_adapter.vllm_backend._scheduler
    out["moved"] = "imported"
except RuntimeError as e:
    out["moved"] = str(e)
except ImportError as e:
    out["moved"] = "ImportError: " + str(e)
del sys.modules["vllm.v1.core.sched.async_scheduler"]
import engine_adapter.vllm_backend._scheduler  # intact: imports

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
from engine_adapter.vllm_backend._host_connector import HintflowHostTier

def construct():
    try:
        HintflowHostTier(None, None)  # fails in our check, before vLLM's __init__ reads its arguments
    except RuntimeError as e:
        return str(e)
    except Exception as e:
        return "passed: " + type(e).__name__

out["intact"] = construct()
saved = KVConnectorBase_V1._get_connector_metadata
del KVConnectorBase_V1._get_connector_metadata  # as a vLLM upgrade that renamed it
out["deleted"] = construct()
KVConnectorBase_V1._get_connector_metadata = saved

# no silent defaults: an unbound cache manager, or a request without num_in_flight_tokens, is an error
tier = object.__new__(HintflowHostTier)
tier.block_size = 128
req = SimpleNamespace(request_id="r", block_hashes=[1, 2], num_computed_tokens=256)
tier._tracked = {"r": [req, 0]}
tier._kv_cache_manager = None
step = SimpleNamespace(num_scheduled_tokens={"r": 1})
for case, manager in (("unbound", None), ("no_in_flight", SimpleNamespace(get_block_ids=lambda r: ([5, 6],)))):
    tier._kv_cache_manager = manager
    try:
        tier._plan_running_saves(step)
        out[case] = "no error"
    except Exception as e:
        out[case] = type(e).__name__ + ": " + str(e)
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def vllm_env() -> tuple[str, dict[str, str]]:
    """The vLLM venv's Python, and an environment in which it imports ``engine_adapter``."""
    from tests.vllm_support import vllm_python_or_skip

    python = vllm_python_or_skip()
    pythonpath = os.pathsep.join(p for p in (str(_serve.REPO), os.environ.get("PYTHONPATH", "")) if p)
    return python, {**os.environ, "PYTHONPATH": pythonpath}


@pytest.fixture(scope="module")
def mutated(vllm_env: tuple[str, dict[str, str]]) -> tuple[dict[str, str], dict[str, str]]:
    """The outcomes of ``_HOST_TIER_MUTATE`` then ``_MUTATE``, run in one vLLM process (importing vLLM takes
    about 13 s on the CPU VM; each script restores what it changed before the next reads it)."""
    python, env = vllm_env
    code = _HOST_TIER_MUTATE + _MUTATE
    r = subprocess.run([python, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    host, sched = (json.loads(line) for line in r.stdout.strip().splitlines()[-2:])
    return host, sched


@pytest.mark.slow
def test_the_installed_vllm_passes_the_check(vllm_env: tuple[str, dict[str, str]]) -> None:
    python, env = vllm_env
    assert check_vllm_python(python, env) == TESTED_VLLM_VERSION


@pytest.mark.slow
def test_the_scheduler_fails_at_construction_once_vllm_lacks_an_internal(
    mutated: tuple[dict[str, str], dict[str, str]],
) -> None:
    out = mutated[1]
    assert out["intact"].startswith("passed: ") and out["async_intact"].startswith("passed: ")
    assert "AsyncScheduler._free_request_blocks" in out["sync_class"]
    for case, name in (
        ("async_hook", "AsyncScheduler._free_request_blocks (overridden by hintflow, but no longer called by vLLM)"),
        ("deleted", "Scheduler._request_blocks_can_be_freed"),
        ("hook", "Scheduler._free_request_blocks (overridden by hintflow, but no longer called by vLLM)"),
    ):
        assert f"vLLM {TESTED_VLLM_VERSION}" in out[case] and name in out[case], out[case]


@pytest.mark.slow
def test_the_host_tier_and_the_scheduler_module_fail_naming_what_vllm_lacks(
    mutated: tuple[dict[str, str], dict[str, str]],
) -> None:
    out = mutated[0]
    assert "vllm.v1.core.sched.async_scheduler.AsyncScheduler (the class)" in out["moved"], out["moved"]
    assert out["moved"].startswith("hintflow's vLLM scheduler cannot run")
    assert out["intact"].startswith("passed: ")
    assert out["deleted"].startswith(HOST_TIER_COMPONENT), out["deleted"]
    assert "KVConnectorBase_V1._get_connector_metadata" in out["deleted"]
    assert out["unbound"].startswith("RuntimeError") and "bind_kv_cache_manager" in out["unbound"]
    assert out["no_in_flight"].startswith("AttributeError") and "num_in_flight_tokens" in out["no_in_flight"]
