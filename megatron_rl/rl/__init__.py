"""The parts of the RL trainer (``megatron_rl.trainers.rl``) that differ between its algorithms and placements,
as strategies the one loop calls:

- where a step's completions come from (``sources``): generated in the training processes (colocated), or taken
  from rollout workers that generate while the trainers step (``rollout_workers``, split placement);
- how advantages are formed (``advantages``): group-relative from the rewards (GRPO), or GAE over a learned
  critic's values (``critic``, PPO);
- the mini-batches and the figures a step reports of them (``minibatches``).

Each takes the run (``RLRun``) it serves; none imports the trainer.
"""

from megatron_rl.rl.advantages import GroupAdvantages, advantage_strategy
from megatron_rl.rl.critic import Critic
from megatron_rl.rl.evaluation import evaluate_held_out
from megatron_rl.rl.metrics import rl_step_metrics
from megatron_rl.rl.minibatches import Minibatcher
from megatron_rl.rl.policy import PolicyUpdate, teacher_of, wants_recomputed_old_logprobs
from megatron_rl.rl.rollouts import PolicyRollouts
from megatron_rl.rl.sampled import SampledBatch
from megatron_rl.rl.scoring import Scorer
from megatron_rl.rl.sources import Colocated, sample_source
from megatron_rl.rl.warmup import sft_warm_up

__all__ = ["Colocated", "Critic", "GroupAdvantages", "Minibatcher", "PolicyRollouts", "PolicyUpdate", "SampledBatch",
           "Scorer", "advantage_strategy", "evaluate_held_out", "rl_step_metrics", "sample_source", "sft_warm_up",
           "teacher_of", "wants_recomputed_old_logprobs"]
