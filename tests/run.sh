#!/usr/bin/env bash
# The test command of the README (and of CI): install the project with its test extras into .venv, start the
# dev Slurm cluster when this machine can (root + apt), run every test, and always stop the cluster again. The 20
# slowest tests are listed at the end.
#
#   bash tests/run.sh [pytest args...]
#   bash tests/run.sh -m "not slow"      # the quick tier: no test that starts a job (tests/conftest.py finds them)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

# Python 3.12 or newer (megatron-core 0.19); pyenv takes it from .python-version. A .venv of an older Python
# (made before the move to 3.12) is made again.
PYTHON="${PYTHON:-python3}"
supported='import sys; sys.exit(sys.version_info < (3, 12))'
if [ -x .venv/bin/python ] && ! .venv/bin/python -c "$supported"; then
  echo "tests/run.sh: .venv is Python $(.venv/bin/python -c 'import platform; print(platform.python_version())'); making it again with $PYTHON" >&2
  rm -rf .venv
fi
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -c "$supported" || { echo "error: tests/run.sh needs Python >= 3.12 ($PYTHON is $("$PYTHON" --version 2>&1)); set PYTHON=python3.12" >&2; exit 2; }
  "$PYTHON" -m venv .venv
fi
# uv installs the same pinned set in ~30 s where pip takes ~2 minutes (most of it unpacking torch's CUDA build, the
# only Linux torch PyPI has for Python 3.12); bytecode is compiled up front, as pip does. pip when uv cannot be had.
if ! { .venv/bin/python -m pip install -q --disable-pip-version-check uv 2>/dev/null && [ -x .venv/bin/uv ] &&
        .venv/bin/uv pip install -q --python .venv/bin/python --compile-bytecode -c constraints/cpu.txt -e '.[dev]'; }; then
  .venv/bin/python -m pip install -q --disable-pip-version-check -c constraints/cpu.txt -e '.[dev]'
fi

export DEV_CLUSTER_DIR="${DEV_CLUSTER_DIR:-/tmp/megatron-rl-dev-cluster}"
started_cluster=0
case " $* " in *"not slow"*) SKIP_SLURM=1 ;; esac  # the quick tier starts no Slurm job
if [ "${SKIP_SLURM:-0}" != 1 ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  trap 'if [ "$started_cluster" = 1 ]; then slurm/dev-cluster.sh down >/dev/null 2>&1 || true; fi' EXIT
  if ! slurm/dev-cluster.sh status >/dev/null 2>&1; then
    started_cluster=1
    slurm/dev-cluster.sh up >/dev/null
  fi
  # shellcheck disable=SC1091
  source "$DEV_CLUSTER_DIR/env.sh"
  export REQUIRE_SLURM=1
else
  echo "tests/run.sh: not root or no apt-get (or SKIP_SLURM=1): Slurm tests will be skipped" >&2
fi

# The linter first (pyproject.toml's [tool.ruff]: well under a second), then the tests.
.venv/bin/ruff check --quiet .

# One pytest-xdist worker per two cores, as a test's job runs two ranks (TEST_WORKERS=N to choose; 2 cores: one
# process). tests/conftest.py keeps each module's tests, and all Slurm tests, on one worker.
workers="${TEST_WORKERS:-$(( $(nproc) / 2 ))}"
[ "$workers" -gt 1 ] || workers=0
.venv/bin/python -m pytest -q --durations=20 -n "$workers" --dist loadgroup "$@"
