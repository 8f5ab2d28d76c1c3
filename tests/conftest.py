"""Fixtures shared by every test (helpers live in tests/helpers.py), the slow marker, and the no-process-left-behind
check.

Every process a test starts inherits ``MEGATRON_RL_TEST_SESSION`` (set here, before any test runs). When the
session ends, a process that still carries this session's marker outlived its test: the run fails and the
leftovers are listed, then killed.

Slow tests are found, not listed: a test is marked ``slow`` when its code, its fixtures or the module functions
they call start a job (``starts_a_job``: launch.py without --dry-run/plan/status, torchrun, the converter's
workers, the job entry point, the dev Slurm cluster). ``bash tests/run.sh -m "not slow"`` is the quick tier; in it a
test that starts a job anyway fails, naming the command, so the finder cannot quietly miss one.
"""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid

import psutil
import pytest

from helpers import REPO_ROOT, SESSION_MARKER, run_launch
from megatron_rl.spec.local_ranks import ZYGOTE_ENV, ZygoteRank, has_nvidia_gpu

os.environ[SESSION_MARKER] = uuid.uuid4().hex


@pytest.fixture
def launch():
    """Run `python launch.py ARGS` in a subprocess: launch(*args, timeout=, env=) -> CompletedProcess."""
    return run_launch


@pytest.fixture(scope="module")
def tensor_parallel_group():
    """A one-process gloo group with Megatron's parallel state (TP = PP = CP = 1), for the vocab-parallel kernels
    and the modules whose constructors read the groups (core attention)."""
    import datetime

    import torch
    from megatron.core import parallel_state

    from megatron_rl.spec.ports import free_port

    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                                         world_size=1, timeout=datetime.timedelta(seconds=60))
    parallel_state.initialize_model_parallel()
    yield
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()


QUICK_LAUNCH_ARGS = frozenset({"--dry-run", "plan", "status", "logs", "cancel", "--help", "-h"})
"""An argument that makes launch.py start no job."""
JOB_CALLS = frozenset({"torchrun_check", "run_worker", "import_hf_to_megatron", "verify_export"})
"""Functions that start worker processes."""
JOB_MODULES = frozenset({"torch.distributed.run", "megatron_rl.main", "megatron_rl.conversion.command",
                         "megatron_rl.conversion.worker"})
"""``python -m MODULE`` starts a job."""
DIST_SCRIPTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "dist") + os.sep
"""``python tests/dist/SCRIPT`` is a rank of a torchrun check."""
JOB_PROGRAMS = frozenset({"sbatch", "srun", "torchrun"})
JOB_FIXTURES = frozenset({"slurm_cluster"})
JOB_SCRIPTS = ("bench/gpu_check.sh",)
"""Scripts that start jobs (gpu_check.sh runs the GPU checks' CPU path on real models, --dry-run too)."""
TESTS_DIR = os.path.dirname(os.path.abspath(__file__))


def _strings(node: ast.AST) -> list[str]:
    return [n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)]


def _node_starts_a_job(node: ast.AST) -> bool:
    """A call of launch.py (as run_launch, the launch fixture or a command list) without a no-job argument, of a
    function that starts workers, or a command list running a job module or program."""
    if isinstance(node, ast.Call):
        name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
        if name in ("run_launch", "launch", "_launch"):
            return not QUICK_LAUNCH_ARGS & set(_strings(node))
        return name in JOB_CALLS
    if isinstance(node, ast.List):
        words = [n.value if isinstance(n, ast.Constant) else None for n in node.elts]
        if any(a == "-m" and b in JOB_MODULES for a, b in zip(words, words[1:])) or (words and words[0] in JOB_PROGRAMS):
            return True
        launches = [w for w in _strings(node) if w.endswith("launch.py")]
        return bool(launches) and not QUICK_LAUNCH_ARGS & set(_strings(node))
    return False


def _functions_reached(fn, module, seen: set) -> list:
    """fn and the test-code functions (any module under tests/) that it names, transitively, with their syntax trees."""
    if fn in seen or not inspect.isfunction(fn):
        return []
    seen.add(fn)
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):
        return [(fn, None, {})]
    namespace = {**vars(module), **fn.__globals__}
    for node in ast.walk(tree):  # names a function imports itself from another test module
        if (isinstance(node, ast.ImportFrom) and node.module and not node.level
                and os.path.exists(os.path.join(TESTS_DIR, *node.module.split(".")) + ".py")):
            imported = importlib.import_module(node.module)
            if _is_test_code(imported):
                namespace.update({a.asname or a.name: getattr(imported, a.name, None) for a in node.names})
    found = [(fn, tree, namespace)]
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and inspect.isfunction(namespace.get(node.id)):
            target = namespace[node.id]
            if _is_test_code(target):
                found += _functions_reached(target, module, seen)
    return found


def _is_test_code(obj) -> bool:
    try:
        path = inspect.getsourcefile(obj) or ""
    except TypeError:  # a built-in
        return False
    return os.path.abspath(path).startswith(TESTS_DIR)


def _names_a_job_script(node: ast.AST, namespace: dict) -> bool:
    """A name bound to one of JOB_SCRIPTS (a path or string)."""
    value = namespace.get(node.id) if isinstance(node, ast.Name) else None
    return isinstance(value, (str, os.PathLike)) and os.fspath(value).endswith(JOB_SCRIPTS)


def _fixture_functions(item: pytest.Item) -> list:
    """The functions of the fixtures the test asks for, and, when it asks for fixtures by name at run time
    (``request.getfixturevalue``), of every fixture defined in its module."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return []
    found = [defs[-1].func for defs in info.name2fixturedefs.values() if defs]
    if _asks_fixtures_by_name(item.function):
        found += [d.func for d in item.session._fixturemanager._get_all_fixture_defs()
                  if getattr(d.func, "__module__", None) == item.module.__name__]
    return found


@functools.lru_cache(maxsize=None)
def _asks_fixtures_by_name(fn) -> bool:
    return "getfixturevalue" in inspect.getsource(fn)


def starts_a_job(item: pytest.Item) -> bool:
    """Whether the test, its fixtures or what they call start a job (see the module docstring)."""
    fixtures = getattr(item, "_fixtureinfo", None)
    names = set(fixtures.names_closure) if fixtures else set()
    if names & JOB_FIXTURES:
        return True
    return any(_reaches_a_job(fn, item.module) for fn in [item.function, *_fixture_functions(item)])


_REACHES: dict = {}
"""(function, module name) -> ``_reaches_a_job``: the variants of a parametrized test, and the tests that share a
fixture or helper, are read once."""


def _reaches_a_job(fn, module) -> bool:
    """Whether ``fn`` or a test-code function it names (transitively) starts a job."""
    key = (fn, module.__name__)
    if key not in _REACHES:
        _REACHES[key] = any(tree is not None and any(_node_starts_a_job(n) or _names_a_job_script(n, namespace)
                                                     for n in ast.walk(tree))
                            for _, tree, namespace in _functions_reached(fn, module, set()))
    return _REACHES[key]


def pytest_collection_modifyitems(config, items):
    for item in items:
        if isinstance(item, pytest.Function) and not item.get_closest_marker("slow") and starts_a_job(item):
            item.add_marker(pytest.mark.slow)
        # tests/run.sh runs pytest-xdist workers on 4 cores or more (--dist loadgroup): a module's tests stay on one
        # worker, so its module fixtures (shared launches) run once, and the Slurm tests share one, so the dev
        # cluster runs one test's jobs at a time
        group = "slurm" if item.get_closest_marker("slurm") else item.nodeid.split("::")[0]
        item.add_marker(pytest.mark.xdist_group(group))


def _is_job(args) -> bool:
    """A command that starts a job itself (what launch.py starts in turn is judged by starts_a_job alone)."""
    argv = [str(a) for a in (args if isinstance(args, (list, tuple)) else [args])]
    return (any(a == "-m" and b in JOB_MODULES for a, b in zip(argv, argv[1:]))
            or bool(argv) and os.path.basename(argv[0]) in JOB_PROGRAMS
            or any(a.endswith(JOB_SCRIPTS) for a in argv[:2])
            or any(os.path.abspath(a).startswith(DIST_SCRIPTS) for a in argv[1:2]))


@pytest.fixture(autouse=True)
def _quick_tests_start_no_job(request, monkeypatch):
    """A test not marked slow that starts a job fails at once, naming the command (started as a process, or
    forked by the zygote)."""
    if request.node.get_closest_marker("slow"):
        yield
        return
    real, real_fork = subprocess.Popen.__init__, ZygoteRank.start.__func__

    def check(args) -> None:
        if _is_job(args):
            pytest.fail(f"{request.node.nodeid} starts a job ({args!r}) but was not found slow: teach "
                        "tests/conftest.py's starts_a_job to see it")

    def checked(self, args, *rest, **kwargs):
        check(args)
        real(self, args, *rest, **kwargs)

    def checked_fork(cls, path, cmd, **kwargs):
        check(cmd)
        return real_fork(cls, path, cmd, **kwargs)

    monkeypatch.setattr(subprocess.Popen, "__init__", checked)
    monkeypatch.setattr(ZygoteRank, "start", classmethod(checked_fork))
    yield


@pytest.fixture(scope="session", autouse=True)
def _zygote(request, tmp_path_factory):
    """One zygote for the session (megatron_rl/runtime/zygote.py): the ranks of every local job, torchrun check
    and converter the tests start are forked from it, with torch and Megatron imported already, instead of each
    importing them again (~4 s of CPU a rank). Stopped when the session ends. ``MEGATRON_RL_ZYGOTE=0`` leaves it
    out (every rank an interpreter of its own); a session without a slow test (the quick tier) starts none."""
    wanted = any(item.get_closest_marker("slow") or "_zygote" in getattr(item, "fixturenames", ())
                 for item in request.session.items)
    if os.environ.get(ZYGOTE_ENV) == "0" or not wanted or has_nvidia_gpu():
        os.environ.pop(ZYGOTE_ENV, None)
        yield None
        return
    folder = tmp_path_factory.mktemp("zygote")
    path = os.path.join(tempfile.mkdtemp(prefix="mrl-zygote-"), "socket")  # a Unix socket path is short
    log = open(folder / "zygote.log", "w")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "megatron_rl.runtime.zygote", path], stdout=log,
                            stderr=subprocess.STDOUT, env=env, cwd=str(REPO_ROOT))
    deadline = time.monotonic() + 180
    while not os.path.exists(path) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    if not os.path.exists(path):
        proc.kill()
        proc.wait()
        log.close()
        raise RuntimeError(f"the test zygote did not start: {(folder / 'zygote.log').read_text()[-2000:]}")
    os.environ[ZYGOTE_ENV] = path
    try:
        yield path
    finally:
        os.environ.pop(ZYGOTE_ENV, None)
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        shutil.rmtree(os.path.dirname(path), ignore_errors=True)


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
