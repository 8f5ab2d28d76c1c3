"""Fixtures shared by every test (helpers live in tests/helpers.py), and the no-process-left-behind check.

Every process a test starts inherits ``MEGATRON_RL_TEST_SESSION`` (set here, before any test runs). When the
session ends, a process that still carries this session's marker outlived its test: the run fails and the
leftovers are listed, then killed.
"""

from __future__ import annotations

import os
import time
import uuid

import psutil
import pytest

from helpers import run_launch

SESSION_MARKER = "MEGATRON_RL_TEST_SESSION"
os.environ[SESSION_MARKER] = uuid.uuid4().hex


@pytest.fixture
def launch():
    """Run `python launch.py ARGS` in a subprocess: launch(*args, timeout=, env=) -> CompletedProcess."""
    return run_launch


def _leftover_processes() -> list[psutil.Process]:
    marker, me = os.environ[SESSION_MARKER], os.getpid()
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.pid != me and proc.environ().get(SESSION_MARKER) == marker:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def pytest_sessionfinish(session, exitstatus):
    leftovers = _leftover_processes()
    deadline = time.monotonic() + 5  # a job's last ranks may still be exiting
    while leftovers and time.monotonic() < deadline:
        time.sleep(0.5)
        leftovers = [p for p in leftovers if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    if not leftovers:
        return
    lines = []
    for proc in leftovers:
        try:
            lines.append(f"  pid {proc.pid}: {' '.join(proc.cmdline())[:200]}")
            proc.kill()
        except psutil.Error:
            continue
    print("\nprocesses started by this test session outlived it (now killed):\n" + "\n".join(lines))
    session.exitstatus = pytest.ExitCode.TESTS_FAILED
