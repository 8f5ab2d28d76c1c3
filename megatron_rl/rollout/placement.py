"""Split placement (``cluster.rollout_tasks = R``): the last R of the job's processes only generate, the others
train, and each role is a torch.distributed world of its own.

    placement = split_placement(read_dist_env(), rollout_tasks=R, run_dir=cfg.run.dir)
    placement.enter()          # this process's RANK / WORLD_SIZE / rendezvous become its role's world

Why two worlds and not one: Megatron's parallel state is global to a process and spans its whole world, so the
trainers (at ``parallel.*`` over world - R processes) and the rollout workers (at the training layout's tp x pp or
parallel.rollout_tp x rollout_pp, over R processes; cp = ep = 1) each initialise it over their own world. The
trainer world meets at the job's rendezvous (MASTER_ADDR:MASTER_PORT); the rollout world meets through a file in
the run folder (``init_method=file://``), so the two need share nothing but the folder, which is also how weights,
prompts and samples travel between them (``megatron_rl.rollout.channel``).

A *session* is one attempt of the job (a start, or a requeue): both roles derive the same id from the
environment the launcher gave every process, without talking to each other, and the channel keeps one folder
per session, so nothing an earlier attempt left behind is taken for this one's.

Test: ``.venv/bin/python -m pytest tests/test_async_grpo.py -q -k placement``
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional

from megatron_rl.runtime.distributed import INIT_METHOD_ENV, JOB_RANK_ENV, DistEnv
from megatron_rl.spec.private import make_private_dir

ROLES = ("train", "rollout")
ROLE_ENV = "MEGATRON_RL_ROLE"
SESSIONS = "sessions"
ROLLOUT_FOLDER = "rollout"
"""Under run.dir: the channel between the roles (weights, sessions with their prompts and samples)."""


@dataclass(frozen=True, kw_only=True)
class Placement:
    """This process's role and its role's world."""

    role: str
    """train or rollout."""
    job_rank: int
    """Rank among all the job's processes."""
    world: DistEnv
    """Rank, size and rendezvous of this role's world."""
    session: str
    """Id of this attempt of the job, the same in every process of it."""
    folder: Path
    """run.dir/rollout: the channel's folder."""

    @property
    def session_dir(self) -> Path:
        return session_dir(self.folder, self.session)

    def enter(self, env: Optional[dict] = None) -> None:
        """Make ``world`` this process's world: read_dist_env() (and so initialize()) sees it from now on."""
        env = os.environ if env is None else env
        env.update({"RANK": str(self.world.rank), "WORLD_SIZE": str(self.world.world_size),
                    "LOCAL_RANK": str(self.world.local_rank), "MASTER_ADDR": self.world.master_addr,
                    "MASTER_PORT": str(self.world.master_port), ROLE_ENV: self.role, JOB_RANK_ENV: str(self.job_rank)})
        if self.role == "rollout":
            make_private_dir(self.session_dir)
            env[INIT_METHOD_ENV] = f"file://{self.session_dir / 'rendezvous'}"
        else:
            env.pop(INIT_METHOD_ENV, None)


def session_dir(folder: Path, session: str) -> Path:
    """Where a session's orders, stop file and rollout rendezvous live, under the channel's folder."""
    return Path(folder) / SESSIONS / session


def session_id(env: Optional[Mapping[str, str]] = None) -> str:
    """The attempt's id from what every process of it shares: the Slurm job and its requeue count, and the
    rendezvous port (a local launch picks a free one each time)."""
    env = os.environ if env is None else env
    parts = [env.get("SLURM_JOB_ID", "local"), env.get("SLURM_RESTART_COUNT", "0"), env.get("MASTER_PORT", "0")]
    return re.sub(r"[^A-Za-z0-9_]", "_", "_".join(parts))


def split_placement(job: DistEnv, *, rollout_tasks: int, run_dir: str | Path,
                    env: Optional[Mapping[str, str]] = None) -> Placement:
    """The role of process ``job.rank`` of ``job.world_size``: the last ``rollout_tasks`` ranks roll out."""
    trainers = job.world_size - rollout_tasks
    if not 0 < trainers <= job.world_size:
        raise ValueError(f"rollout_tasks={rollout_tasks} of {job.world_size} processes leaves no trainer")
    rollout = job.rank >= trainers
    world = DistEnv(rank=job.rank - trainers if rollout else job.rank,
                    world_size=rollout_tasks if rollout else trainers, local_rank=job.local_rank,
                    master_addr=job.master_addr, master_port=job.master_port)
    return Placement(role="rollout" if rollout else "train", job_rank=job.rank, world=world,
                     session=session_id(env), folder=Path(run_dir) / ROLLOUT_FOLDER)
