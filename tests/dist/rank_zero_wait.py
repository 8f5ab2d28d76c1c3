"""Started by tests/test_rank_zero_wait.py under torchrun on 2 processes, with parallel.timeout_s = 2 s:
rank 0 works alone for longer than that inside ``on_rank_zero`` (rank 1 must wait for it, not time out), then
does the same before a plain barrier (which must time out: the short timeout is in force). Each rank prints
one JSON line."""

from __future__ import annotations

import json
import sys
import time

import torch

from megatron_rl.runtime.distributed import global_rank, initialize, job_dims, on_rank_zero

SHORT_TIMEOUT_S = 2
RANK_ZERO_WORK_S = 3 * SHORT_TIMEOUT_S

initialize(job_dims(), seed=1, backend="gloo", timeout_s=SHORT_TIMEOUT_S)
start = time.time()  # wall clock: the two processes of one machine compare their times
work_ended = None


def work() -> None:
    global work_ended
    time.sleep(RANK_ZERO_WORK_S)
    work_ended = time.time()


on_rank_zero(work)
wait_ended = time.time()
plain_barrier_timed_out = False
try:
    if global_rank() == 0:
        time.sleep(RANK_ZERO_WORK_S)
    torch.distributed.barrier()
except RuntimeError:
    plain_barrier_timed_out = True
print(json.dumps({"rank": global_rank(), "started": start, "work_ended": work_ended, "wait_ended": wait_ended,
                  "plain_barrier_timed_out": plain_barrier_timed_out}), flush=True)
sys.stdout.flush()
