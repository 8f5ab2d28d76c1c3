"""Checkpoints are never lost: save-order retention, re-saves kept aside, fsync, a reference model per run.

The unit tests publish small fake saves (folders of files) with the real publishing code; the runs are tiny
real Megatron Core jobs on one process. Jobs that need ``checkpoint.resume=false`` on a folder that already has
checkpoints (which the launcher refuses) start the job entry point ``megatron_rl.main`` directly, as the
local executor does.
"""

from __future__ import annotations

import os
import shutil
import signal
import stat
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest
import yaml

from helpers import REPO_ROOT, read_metrics, without_measurements

from megatron_rl.spec.ports import free_port
from megatron_rl.runtime import checkpoint as ckpt

ONE_RANK = ["cluster.executor=local", "cluster.tasks_per_node=1", "algorithm.name=pretrain", "run.steps=6",
            "algorithm.global_batch_size=4", "parallel.micro_batch_size=2", "logging.tensorboard=false",
            "checkpoint.save_at_end=false"]
TAG = "MEGATRON_RL_TEST_TAG"


# ------------------------------------------------------------------------------------------------ fake saves
def _fake_save(root, step, content="x", *, keep_last=2):
    """Publish a fake save of ``step`` (two files in a subfolder) as save_checkpoint does after writing."""
    tmp = root / f".tmp-{ckpt.step_dir_name(step)}"
    (tmp / "shard").mkdir(parents=True)
    (tmp / "common.pt").write_text(content)
    (tmp / "shard" / "0.distcp").write_text(content)
    ckpt.fsync_tree(tmp)
    doomed = ckpt.publish_checkpoint(root, tmp, step, keep_last=keep_last)
    ckpt.delete_later(doomed, step=step)
    ckpt.wait_for_deletes()
    return root / ckpt.step_dir_name(step)


def _names(root):
    return sorted(p.name for p in root.iterdir())


def _latest(root):
    return (root / "latest").read_text().strip()


def test_retention_follows_save_order_not_step_numbers(tmp_path):
    """An old run left steps 20 and 30; a new run saves step 10: it stays, `latest` names it, 20 goes."""
    for step in (20, 30):
        _fake_save(tmp_path, step)
    _fake_save(tmp_path, 10, keep_last=2)
    assert _latest(tmp_path) == "step_00000010"
    assert _names(tmp_path) == ["latest", "step_00000010", "step_00000030"]
    _fake_save(tmp_path, 12, keep_last=1)
    assert _names(tmp_path) == ["latest", "step_00000012"]
    assert ckpt.latest_checkpoint(tmp_path).name == "step_00000012"


def test_retention_keeps_latest_over_legacy_folders_without_save_order(tmp_path):
    """Folders saved by older versions (no saved.json) count as older than any new save."""
    for step in (20, 30):
        (tmp_path / ckpt.step_dir_name(step)).mkdir()
    _fake_save(tmp_path, 10, keep_last=1)
    assert _names(tmp_path) == ["latest", "step_00000010"]


def test_resave_keeps_the_old_copy_until_the_new_one_is_published(tmp_path):
    _fake_save(tmp_path, 5, "old", keep_last=1)
    _fake_save(tmp_path, 5, "new", keep_last=1)
    assert _names(tmp_path) == ["latest", "step_00000005"]
    assert (tmp_path / "step_00000005" / "common.pt").read_text() == "new"


def _killed_publish(root, fault, script):
    """Run ``script`` (publishing fake saves into ``root``) in a child process SIGKILLed at ``fault``."""
    code = textwrap.dedent(f"""
        import sys
        from pathlib import Path
        sys.path.insert(0, {str(REPO_ROOT / 'tests')!r})
        from test_checkpoint_safety import _fake_save
        root = Path({str(root)!r})
    """) + textwrap.dedent(script)
    env = {**os.environ, "MEGATRON_RL_FAULT": fault}
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == -9, result.stdout + result.stderr


def test_sigkill_during_a_resave_leaves_the_old_copy_as_latest(tmp_path):
    """Killed after the old step_5 went aside, before the new one was renamed in: `latest` still finds the
    old copy, and the cleanup puts it back as step_5."""
    _killed_publish(tmp_path, "kill-during-resave:5", """
        _fake_save(root, 5, "old", keep_last=1)
        _fake_save(root, 5, "new", keep_last=1)
    """)
    assert _names(tmp_path) == [".old-step_00000005", ".tmp-step_00000005", "latest"]
    assert _latest(tmp_path) == "step_00000005"
    assert ckpt.latest_checkpoint(tmp_path).name == ".old-step_00000005"  # still loadable as it is
    ckpt.remove_partial_saves(tmp_path)
    ckpt.wait_for_deletes()
    assert _names(tmp_path) == ["latest", "step_00000005"]
    assert (tmp_path / "step_00000005" / "common.pt").read_text() == "old"


def test_latest_naming_an_aside_folder_is_recovered(tmp_path):
    _fake_save(tmp_path, 5, keep_last=1)
    os.replace(tmp_path / "step_00000005", tmp_path / ".old-step_00000005")
    (tmp_path / "latest").write_text(".old-step_00000005\n")
    ckpt.remove_partial_saves(tmp_path)
    ckpt.wait_for_deletes()
    assert _names(tmp_path) == ["latest", "step_00000005"] and _latest(tmp_path) == "step_00000005"


def test_sigkill_during_the_retention_delete_keeps_latest_complete(tmp_path):
    """Killed half-way through deleting step 1: step 2 is published and whole; the half-deleted folder no
    longer looks like a checkpoint and the next start removes it."""
    _killed_publish(tmp_path, "kill-during-retention:2", """
        _fake_save(root, 1, keep_last=1)
        _fake_save(root, 2, keep_last=1)
    """)
    assert _latest(tmp_path) == "step_00000002"
    assert [p.name for p in ckpt.complete_checkpoints(tmp_path)] == ["step_00000002"]
    assert sorted(p.name for p in (tmp_path / "step_00000002").rglob("*")) == \
           ["0.distcp", "common.pt", "saved.json", "shard"]
    assert any(name.startswith(".del-step_00000001") for name in _names(tmp_path))
    ckpt.remove_partial_saves(tmp_path)
    ckpt.wait_for_deletes()
    assert _names(tmp_path) == ["latest", "step_00000002"]


def test_files_and_folders_are_fsynced_before_the_rename_and_the_latest_write(tmp_path, monkeypatch):
    """Every file and folder of the save, then the checkpoint folder after the rename, then `latest`."""
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        kind = "dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file"
        events.append(("fsync", kind, os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def replace(src, dst):
        events.append(("replace", str(src), str(dst)))
        return real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    _fake_save(tmp_path, 3)
    root, tmp = str(tmp_path), str(tmp_path / ".tmp-step_00000003")
    publish = events.index(("replace", tmp, str(tmp_path / "step_00000003")))
    before = {(kind, path) for _, kind, path in (e for e in events[:publish] if e[0] == "fsync")}
    assert {("file", f"{tmp}/common.pt"), ("file", f"{tmp}/shard/0.distcp"), ("file", f"{tmp}/.saved.json.tmp"),
            ("dir", tmp), ("dir", f"{tmp}/shard")} <= before
    pointer = events.index(("replace", f"{root}/.latest.tmp", f"{root}/latest"))
    assert ("fsync", "dir", root) in events[publish + 1:pointer]  # the rename is durable before `latest`
    assert ("fsync", "file", f"{root}/.latest.tmp") in events[publish + 1:pointer]
    assert ("fsync", "dir", root) in events[pointer + 1:]


def test_a_damaged_newest_checkpoint_falls_back_to_the_one_before_with_one_warning(tmp_path):
    """saved.json lists every file's size; a truncated or deleted file marks the folder damaged (stats only), and
    the resume takes the newest undamaged one, one warning line per damaged one; a companion's (PPO's critic's)
    save of the same step counts; all damaged: one-line error, never a fresh start."""
    for step in (2, 4, 6):
        _fake_save(tmp_path, step, content="abc", keep_last=3)
    assert [ckpt.damage(tmp_path / ckpt.step_dir_name(s)) for s in (2, 4, 6)] == [None] * 3
    (tmp_path / "step_00000006" / "shard" / "0.distcp").write_text("a")  # truncated
    (tmp_path / "step_00000004" / "common.pt").unlink()
    warnings = []
    assert ckpt.resumable_checkpoint(tmp_path, warn=warnings.append) == tmp_path / "step_00000002"
    assert warnings == [f"warning: checkpoint {tmp_path / 'step_00000006'} is damaged (shard/0.distcp holds 1 of its "
                        "3 bytes); resuming from the one before it",
                        f"warning: checkpoint {tmp_path / 'step_00000004'} is damaged (common.pt is missing); "
                        "resuming from the one before it"]
    critic = tmp_path / "critic"
    critic.mkdir()
    _fake_save(critic, 2)
    assert ckpt.resumable_checkpoint(tmp_path, companions=("critic",), warn=warnings.append) == tmp_path / "step_00000002"
    (critic / "step_00000002" / "common.pt").write_text("")
    from megatron_rl.spec.errors import ConfigError

    with pytest.raises(ConfigError, match=r"every checkpoint is damaged \(step_00000006 .*step_00000002 \(critic: "
                                          r"common.pt holds 0 of its 1 bytes\)\); nothing to resume from"):
        ckpt.resumable_checkpoint(tmp_path, companions=("critic",), warn=warnings.append)
    legacy = tmp_path / "legacy"  # a save of an older version lists no files: its .metadata is what is checked
    _fake_save(legacy, 2)
    (legacy / "step_00000002" / "saved.json").write_text('{"step": 2, "seq": 1}')
    assert ckpt.damage(legacy / "step_00000002") == "no .metadata"
    (legacy / "step_00000002" / ".metadata").write_text("m")
    assert ckpt.resumable_checkpoint(legacy) == legacy / "step_00000002"
    assert ckpt.resumable_checkpoint(tmp_path / "none") is None


def test_parallel_timeout_is_a_config_key():
    from megatron_rl.spec.config.schema import ParallelConfig
    from megatron_rl.spec.errors import ConfigError

    assert ParallelConfig().timeout_s == 1800
    assert ParallelConfig(timeout_s=60).timeout_s == 60
    with pytest.raises(ConfigError, match="parallel.timeout_s"):
        ParallelConfig(timeout_s=0)


# ------------------------------------------------------------------------------------------------ real runs
def _launch(launch, run_dir, *extra, env=None, expect=0):
    result = launch(*ONE_RANK, f"run.dir={run_dir}", *extra, env=env)
    assert result.returncode == expect, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def _job(run_dir, env=None, **overrides):
    """Rerun the job of ``run_dir`` without the launcher, with ``overrides`` ({"checkpoint.resume": False}).

    Returns (exit code, output). Output goes to a file, not a pipe: a SIGKILLed job leaves Megatron's
    multiprocessing helpers behind holding its output, and they are killed here."""
    path = run_dir / "config.yaml"
    cfg = yaml.safe_load(path.read_text())
    for key, value in overrides.items():
        section, name = key.split(".")
        cfg[section][name] = value
    path.write_text(yaml.safe_dump(cfg))
    tag = uuid.uuid4().hex
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_PORT": str(free_port()), TAG: tag, **(env or {})}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS"):
        full_env.pop(name, None)
    log = run_dir / f"job-{tag}.log"
    try:
        with open(log, "w") as out:
            rc = subprocess.run([sys.executable, "-m", "megatron_rl.main", str(path)], cwd=REPO_ROOT, env=full_env,
                                stdout=out, stderr=subprocess.STDOUT, timeout=300).returncode
    finally:
        _kill_tagged(tag)
    return rc, log.read_text()


def _kill_tagged(tag):
    """SIGKILL every process started with ``TAG=tag`` in its environment (what a killed job left)."""
    marker = f"{TAG}={tag}".encode()
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and marker in (proc / "environ").read_bytes().split(b"\0"):
                os.kill(int(proc.name), signal.SIGKILL)
        except OSError:
            pass


def _killed_launch(launch, run_dir, *extra, fault):
    tag = uuid.uuid4().hex
    try:
        return launch(*ONE_RANK, f"run.dir={run_dir}", *extra, env={"MEGATRON_RL_FAULT": fault, TAG: tag})
    finally:
        _kill_tagged(tag)


def _stable(metrics):
    return without_measurements(metrics)


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    from helpers import run_launch

    run_dir = tmp_path_factory.mktemp("whole")
    _launch(run_launch, run_dir)
    return _stable(read_metrics(run_dir))


def test_sigkill_during_the_retention_delete_resumes(launch, tmp_path, whole):
    run_dir = tmp_path / "run"
    args = ("checkpoint.save_interval=2", "checkpoint.keep_last=1")
    killed = _killed_launch(launch, run_dir, *args, fault="kill-during-retention:4")
    assert killed.returncode != 0
    ckpts = run_dir / "checkpoints"
    assert _latest(ckpts) == "step_00000004"
    assert [p.name for p in ckpt.complete_checkpoints(ckpts)] == ["step_00000004"]
    resumed = _launch(launch, run_dir, *args)
    assert "step_00000004 (step 4" in resumed.stdout
    assert _stable(read_metrics(run_dir)) == whole
    assert not [name for name in _names(ckpts) if name.startswith(".")]


def test_a_truncated_newest_checkpoint_and_a_save_that_cannot_be_written(launch, tmp_path, whole):
    """Saves at steps 2 and 4, stopped after 4; the largest file of step 4 loses its second half. A rerun under a
    1 MiB file-size limit (a save that cannot be written, as on a full disk) warns in one line, resumes from step 2
    exactly, and ends at step 4's save with one line and exit 2, its partial save removed, the saved checkpoints
    untouched."""
    import resource

    run_dir = tmp_path / "run"
    args = ("checkpoint.save_interval=2", "checkpoint.keep_last=2")
    _launch(launch, run_dir, *args, env={"MEGATRON_RL_STOP_AFTER_STEP": "4"}, expect=3)
    ckpts = run_dir / "checkpoints"
    newest = ckpts / "step_00000004"
    shard = max((p for p in newest.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    assert shard.stat().st_size > 2**20  # beyond the limit below
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size // 2)
    warning = f"warning: checkpoint {newest} is damaged ({shard.relative_to(newest)} holds"

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (2**20, 2**20))

    limited = subprocess.run([sys.executable, "launch.py", *ONE_RANK, f"run.dir={run_dir}", *args], cwd=REPO_ROOT,
                             env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300,
                             preexec_fn=limit)
    assert limited.returncode == 2, limited.stdout[-3000:] + limited.stderr[-3000:]
    assert warning in limited.stdout and "step_00000002 (step 2" in limited.stdout
    errors = [line.strip() for line in limited.stderr.splitlines() if line.strip().startswith("error:")]  # the tail
    assert len(errors) == 1 and "saving step 4 failed (rank 0: File too large (EFBIG) writing " \
        f"{ckpts / '.tmp-step_00000004'}/" in errors[0], limited.stderr[-3000:]
    assert "Raise the file-size limit (ulimit -f)" in errors[0]
    assert "Traceback" not in limited.stdout + limited.stderr
    assert _names(ckpts) == ["latest", "step_00000002", "step_00000004"]  # no partial save left
    assert ckpt.damage(ckpts / "step_00000002") is None
    # steps 3 and 4 of the limited run were the uninterrupted run's (resumed exactly from step 2)
    assert _stable(read_metrics(run_dir)) == whole[:len(read_metrics(run_dir))]


@pytest.fixture(scope="module")
def new_run_in_an_old_folder(tmp_path_factory):
    """An old run (seed 7) stopped after step 4 with saves at steps 2 and 4; then a resume=false run (the default
    seed, keep_last=1) into the same folder, stopped after its own step 2. Shared by the resume=false test and
    the killed re-save test, each of which continues a copy of the folder. Returns the folder and what was seen
    on the way: the old step 4's owner, the checkpoint names after the old run, the second run's exit code and
    output."""
    from helpers import run_launch

    run_dir = tmp_path_factory.mktemp("old_folder") / "run"
    _launch(run_launch, run_dir, "checkpoint.save_interval=2", "checkpoint.keep_last=5", "run.seed=7",
            env={"MEGATRON_RL_STOP_AFTER_STEP": "4"}, expect=3)
    ckpts = run_dir / "checkpoints"
    old = {"owner": ckpt.checkpoint_owner(ckpts / "step_00000004"), "names": _names(ckpts)}
    rc, out = _job(run_dir, {"MEGATRON_RL_STOP_AFTER_STEP": "2"}, **{"checkpoint.resume": False, "run.seed": 1234,
                                                                    "checkpoint.keep_last": 1})
    return run_dir, old, rc, out


def _copy_run(src, dst):
    """A copy of the run folder ``src`` at ``dst`` whose config names ``dst`` as run.dir (the folder moved)."""
    shutil.copytree(src, dst, symlinks=True)
    path = dst / "config.yaml"
    cfg = yaml.safe_load(path.read_text())
    cfg["run"]["dir"] = str(dst)
    path.write_text(yaml.safe_dump(cfg))
    return dst


def test_resume_false_into_an_old_folder_keeps_its_own_save_as_latest(tmp_path, whole, new_run_in_an_old_folder):
    """The old run left steps 2 and 4; a resume=false run saves step 2 with keep_last=1: its own step 2
    stays as `latest` (the old step 4 goes), and resuming continues this run."""
    folder, old, rc, out = new_run_in_an_old_folder
    assert old["owner"] and old["names"] == ["latest", "step_00000002", "step_00000004"]
    assert rc == 3, out[-3000:]
    ckpts = folder / "checkpoints"
    assert _latest(ckpts) == "step_00000002" and _names(ckpts) == ["latest", "step_00000002"]
    assert ckpt.checkpoint_owner(ckpts / "step_00000002") not in (None, old["owner"])
    run_dir = _copy_run(folder, tmp_path / "run")
    rc, out = _job(run_dir, **{"checkpoint.resume": True})
    assert rc == 0, out[-3000:]
    assert "step_00000002 (step 2" in out
    assert _stable(read_metrics(run_dir)) == whole


def test_sigkill_during_a_resave_resumes_from_the_old_copy(tmp_path, whole, new_run_in_an_old_folder):
    """A resume=false run re-saves step 2 and is killed between moving the old step 2 aside and publishing
    the new one: the next start puts the old copy back and resumes from it. (The folder is a copy of the one
    the resume=false test continues: its step 2 is `latest`, keep_last=1.)"""
    run_dir = _copy_run(new_run_in_an_old_folder[0], tmp_path / "run")
    ckpts = run_dir / "checkpoints"
    assert _latest(ckpts) == "step_00000002" and _names(ckpts) == ["latest", "step_00000002"]
    rc, out = _job(run_dir, {"MEGATRON_RL_STOP_AFTER_STEP": "2", "MEGATRON_RL_FAULT": "kill-during-resave:2"},
                   **{"checkpoint.resume": False})
    assert rc == -9, out[-3000:]
    assert _latest(ckpts) == "step_00000002" and ".old-step_00000002" in _names(ckpts)
    assert not (ckpts / "step_00000002").exists()
    rc, out = _job(run_dir, **{"checkpoint.resume": True})
    assert rc == 0, out[-3000:]
    assert "step_00000002 (step 2" in out
    assert _stable(read_metrics(run_dir)) == whole
    assert not [name for name in _names(ckpts) if name.startswith(".")]


GRPO = ["cluster.executor=local", "cluster.tasks_per_node=1", "logging.tensorboard=false",
        "algorithm.sft_warmup_steps=2", "algorithm.prompts_per_step=2", "algorithm.group_size=4",
        "algorithm.global_batch_size=8", "parallel.micro_batch_size=4", "run.steps=2", "algorithm.kl_coef=0.05"]


def test_a_reference_model_from_another_run_is_rebuilt(launch, tmp_path):
    """resume=false into a GRPO folder: the old run's checkpoints/reference is not reused but rebuilt as this
    run's; a resume of this run then reuses it."""
    run_dir = tmp_path / "run"
    result = launch(*GRPO, f"run.dir={run_dir}", "run.seed=7")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    ckpts = run_dir / "checkpoints"
    old = ckpt.checkpoint_owner(ckpts / "reference")
    assert old is not None and old == ckpt.checkpoint_owner(ckpts)
    rc, out = _job(run_dir, {"MEGATRON_RL_STOP_AFTER_STEP": "1"}, **{"checkpoint.resume": False, "run.seed": 1234})
    assert rc == 3, out[-3000:]
    mine = ckpt.checkpoint_owner(ckpts)
    assert mine not in (None, old) and ckpt.checkpoint_owner(ckpts / "reference") == mine
    saved = (ckpts / "reference" / "step_00000000" / "saved.json").read_text()
    rc, out = _job(run_dir, **{"checkpoint.resume": True})
    assert rc == 0, out[-3000:]
    assert (ckpts / "reference" / "step_00000000" / "saved.json").read_text() == saved  # reused, not re-saved


def test_the_distributed_optimizer_saves_each_parameters_own_state(launch, tmp_path):
    """Defect 7 of #35: the buffer splits into gradient buckets (40M elements each with overlap_grad_reduce on real
    models; 4,000 here), each padded at its end. Megatron 0.19's layout-free save cut every parameter after a padded
    bucket end off by the padding (zero-filling the last one's tail, with the warning "data corruption"), and a
    resume loaded those copies as weights and moments. In fp32 the optimizer's copy of a weight is the weight, so
    every saved pair must be equal."""
    import torch
    import torch.distributed.checkpoint as dcp

    run = launch("cluster.executor=local", "cluster.tasks_per_node=2", "algorithm.name=pretrain", "run.steps=1",
                 "algorithm.global_batch_size=4", "parallel.micro_batch_size=2", "logging.tensorboard=false",
                 "runtime.grad_bucket_size=4000", f"run.dir={tmp_path / 'run'}")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    logs = "".join(p.read_text() for p in (tmp_path / "run" / "logs").glob("rank*.log"))
    assert "data corruption" not in logs
    reader = dcp.FileSystemReader(str(tmp_path / "run" / "checkpoints" / "step_00000001"))
    stored = reader.read_metadata().state_dict_metadata
    prefix = "optimizer.state.param."
    names = [key[len(prefix):] for key in stored if key.startswith(prefix)]
    assert len(names) >= 8
    tensors = {key: torch.empty(stored[key].size, dtype=stored[key].properties.dtype)
               for name in names for key in (name, prefix + name)}
    dcp.load(tensors, storage_reader=reader, no_dist=True)
    differ = [name for name in names if not torch.equal(tensors[name].float(), tensors[prefix + name])]
    assert not differ, differ


def test_a_write_that_finds_the_disk_full_is_named_with_its_rank_and_file(tensor_parallel_group, tmp_path):
    """Megatron's writer keeps only the type of a failed write's exception ("Worker failure: An error is caught
    while starting worker 0, error: <class 'RuntimeError'>"). A write to /dev/full (ENOSPC on every write) through
    that writer, as the gathered result of rank 1 on the coordinating rank: the save's error line names the OS's
    error, its errno, the file and rank 1, and the fix."""
    import io
    import queue

    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

    ckpt._keep_write_errors()  # as save_checkpoint does
    writer = FileSystemWriterAsync(str(tmp_path))
    item = WriteItem(index=MetadataIndex("rng_state"), type=WriteItemType.BYTE_IO)
    writer.write_buckets = [("/dev/full", "__1_0.distcp", ([(item, io.BytesIO(b"state"))], []))]
    writer.results_queue = queue.Queue()
    write, _, args = writer.get_save_function_and_args()
    try:
        write(*args)
        rank1 = writer.retrieve_write_results()
    finally:
        ckpt._WRITE_ERRORS.clear()
    error = ckpt._save_failed(tmp_path, tmp_path / ".tmp-step_00000040", 40,
                              *ckpt._agreed_cause(CheckpointException("write", {1: rank1})))
    assert str(error) == (f"checkpoint.dir {tmp_path}: saving step 40 failed (rank 1: No space left on device "
                          "(ENOSPC) writing /dev/full); the checkpoints saved before are untouched. Free space there "
                          "(or set checkpoint.dir elsewhere) and rerun to resume")
