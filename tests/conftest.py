"""Fixtures shared by every test (helpers live in tests/helpers.py)."""

from __future__ import annotations

import pytest

from helpers import run_launch


@pytest.fixture
def launch():
    """Run `python launch.py ARGS` in a subprocess: launch(*args, timeout=, env=) -> CompletedProcess."""
    return run_launch
