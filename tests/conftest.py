"""Session-wide test plumbing.

The Temporal Python SDK (1.35) can abort at interpreter exit ("PyGILState_Release", exit 134/139) even
after every worker and environment was shut down.  So the run's status is kept when the session finishes
and the process ends with ``os._exit(status)`` once pytest has written its report: same result, no
teardown lottery.
"""

from __future__ import annotations

import os
import sys

import pytest

_exit_status: int | None = None


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    global _exit_status
    _exit_status = int(exitstatus)


def pytest_unconfigure(config: pytest.Config) -> None:
    if _exit_status is None or os.environ.get("HINTFLOW_NO_HARD_EXIT"):
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(_exit_status)
