"""The parts of the RL trainer (``megatron_rl.trainers.rl``) that differ between its algorithms and placements,
as strategies the one loop calls:

- where a step's completions come from (``sources``): generated in the training processes (colocated), or taken
  from rollout workers that generate while the trainers step (``rollout_workers``, split placement);
- how advantages are formed (``advantages``): group-relative from the rewards (GRPO), or GAE over a learned
  critic's values (``critic``, PPO);
- the mini-batches and the figures a step reports of them (``minibatches``).

Each takes the run (``RLRun``) it serves; none imports the trainer.
"""
