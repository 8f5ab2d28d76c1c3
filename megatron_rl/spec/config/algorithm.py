"""The ``algorithm:`` section of the job config: what the job trains and how (GRPO, PPO, RM, SFT, pretraining,
DPO, evaluation), with its one-section checks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from megatron_rl.spec.config.fields import (ADVANTAGE_MODES, ALGORITHMS, CRITIC_INITS, DPO_LOSSES, IMPORTANCE_RATIOS,
                                            KL_ESTIMATORS, LOSS_AGGREGATIONS, MAX_LENGTH, OFF_POLICY_CORRECTIONS,
                                            POLICY_LOSSES, WEIGHT_SYNCS, _at_most, _non_negative, _one_of, _positive)
from megatron_rl.spec.errors import ConfigError
from megatron_rl.spec.rewards import check_reward_options


@dataclass(kw_only=True)
class OverlongConfig:
    """DAPO soft overlong punishment, added to the reward of each completion."""

    buffer: int
    """Tokens before generation.max_new_tokens where the penalty starts; it falls linearly to -penalty there."""
    penalty: float = 1.0
    """Penalty at (and beyond) generation.max_new_tokens."""

    def __post_init__(self) -> None:
        _positive("algorithm.overlong", buffer=self.buffer)
        _non_negative("algorithm.overlong", penalty=self.penalty)


@dataclass(kw_only=True)
class TeacherConfig:
    """On-policy distillation (GRPO): a frozen teacher scores the student's own samples, token by token, and each
    response token's advantage is -coef x the estimated KL(student || teacher) at that token
    (megatron_rl/algorithms/policy_loss.py ``distillation_advantages``), alone or added to the rewards' group
    advantage. The teacher runs in the training processes at the job's tp/pp/cp (its own pipeline split of its
    layers), its weights parked in host memory outside its forward (``offload``)."""

    checkpoint: str
    """A checkpoint folder of any run of this project (a run's checkpoints/ or one step folder): its model is read
    from what the run recorded; it may be larger than the student, and must use the same tokenizer."""
    coef: float = 1.0
    """Weight of the per-token distillation advantage (> 0)."""
    kl_estimator: str = "k1"
    """How the per-token reverse KL is estimated at the sampled token, with s = log pi_student, t = log
    pi_teacher: k1 = s - t (on-policy distillation's per-token reverse KL, Agarwal et al. 2024; Thinking Machines
    2025), k2 = (s - t)^2 / 2, k3 = exp(t - s) - (t - s) - 1."""
    with_rewards: bool = False
    """false: the teacher's advantage alone (rewards are still scored and logged); true: added to the group
    advantage of algorithm.rewards."""
    offload: bool = True
    """Park the teacher's weights in host memory outside its forward, so generation and training have the
    device memory (costs two host copies of its weights per step); false: keep them on the device."""

    def __post_init__(self) -> None:
        if not isinstance(self.checkpoint, str) or not self.checkpoint:
            raise ConfigError("algorithm.teacher.checkpoint must name a checkpoint folder of a run (its "
                              "checkpoints/ folder or a step folder)")
        _positive("algorithm.teacher", coef=self.coef)
        _one_of("algorithm.teacher", "kl_estimator", self.kl_estimator, KL_ESTIMATORS)


@dataclass(kw_only=True)
class AlgorithmConfig:
    name: str = "grpo"
    """What the job trains: grpo, ppo (with a critic), rm (reward model), sft, pretrain (next-token prediction) or
    dpo (direct preference optimisation on preference pairs); or eval (no training: held-out pass@k of
    model.init_from)."""
    global_batch_size: int = 128
    """Sequences per optimizer step (GRPO: completions per optimizer step)."""
    group_size: int = 8
    """GRPO: completions sampled per prompt."""
    prompts_per_step: int = 16
    """GRPO: prompts per rollout batch."""
    advantage: str = "std"
    """GRPO advantage: std ((r - mean) / (std + eps)) or mean (Dr. GRPO: r - mean)."""
    drop_zero_signal_groups: bool = False
    """GRPO dynamic sampling (DAPO): drop groups whose rewards are all equal (else they get advantage 0) and draw
    more prompts until prompts_per_step groups with signal are in the batch, at most max_sampling_draws rounds."""
    max_sampling_draws: int = 3
    """Rollout rounds per step at most when drop_zero_signal_groups refills the batch (DAPO's max_num_gen_batches);
    a batch still short after them is trained on as it is (whole mini-batches)."""
    epochs: int = 1
    """Passes over each rollout, in mini-batches of global_batch_size (PPO epochs)."""
    recompute_old_logprobs: Union[bool, str] = "auto"
    """Recompute the old policy's log-probs with a training forward before the first update instead of taking
    the decode path's: true, false, or auto (true when generation and training kernels differ: bf16, Transformer
    Engine, or an MoE model)."""
    importance_ratio: str = "token"
    """token (PPO/GRPO) or sequence (GSPO: the length-normalised sequence ratio exp(mean(logp - old_logp)),
    clipped per sequence; use small clip_eps_low/high, e.g. 3e-4/4e-4, and loss_aggregation seq-mean-token-mean)."""
    policy_loss: str = "clip"
    """clip (PPO/GRPO: -min(r A, clip(r, 1 - clip_eps_low, 1 + clip_eps_high) A), whose clipped tokens get no
    gradient) or cispo (MiniMax-M1: -sg(clip(r, 1 - clip_eps_low, 1 + clip_eps_high)) A log pi, the clipped ratio
    a detached weight, so every token keeps its gradient; the paper sets no lower bound, clip_eps_low 1, and tunes
    clip_eps_high). r is the token's ratio, or the sequence's with importance_ratio=sequence."""
    overlong: Optional[OverlongConfig] = None
    """DAPO soft overlong punishment {buffer, penalty}; null: off."""
    mask_truncated: bool = False
    """Leave completions cut at generation.max_new_tokens out of the loss (DAPO's overlong filtering)."""
    router_replay: bool = False
    """MoE models: record the experts generation routed each token to and route the rollout's training forwards
    (old log-probs, reference, updates) the same way, so routing flips do not show up as policy ratios (R3)."""
    max_staleness: int = 0
    """With cluster.rollout_tasks > 0: the trainer takes only samples generated at most this many policy
    versions (GRPO steps) ago, dropping older ones (megatron_rl/rollout/buffer.py), and at most
    (max_staleness + 1) x prompts_per_step prompts are out at once; 0: only samples of the current weights
    (synchronous, split placement). Must be 0 without rollout tasks (colocated generation is synchronous)."""
    weight_sync: str = "files"
    """How new weights reach the rollout tasks after each step: gloo (torch.distributed broadcast over TCP, CPU
    staging), nccl (GPUs only) or files (versioned safetensors in a shared folder, for ranks that cannot reach
    each other; the samples come back through the same folder). Unused without rollout tasks. Prompts and samples
    always travel through the run folder (small)."""
    weight_sync_bucket_mib: int = 512
    """With weight_sync gloo or nccl: the most MiB one broadcast of a weight shard carries (a tensor larger than
    that travels alone). The sender stages one bucket at a time, so a GPU that still holds the optimizer's state
    needs this much spare memory beside its shard, not a second copy of it."""
    off_policy_correction: str = "none"
    """Correction for samples of an older (behaviour) policy (megatron_rl/algorithms/policy_loss.py): none,
    truncated_is (the surrogate times min(pi_old / pi_behav, is_cap), Yao et al. 2025) or decoupled (AReaL's
    decoupled PPO: the ratio against the proximal policy, the weights before the step, times pi_prox /
    pi_behav; tokens whose weight exceeds is_cap are left out)."""
    is_cap: float = 2.0
    """The cap C (>= 1) of the behaviour importance weight of off_policy_correction."""
    clip_eps_low: float = 0.2
    """Lower clip of the policy ratio: 1 - clip_eps_low."""
    clip_eps_high: float = 0.2
    """Upper clip of the policy ratio: 1 + clip_eps_high (DAPO clip-higher uses 0.28)."""
    dual_clip: Optional[float] = None
    """Dual-clip constant c (> 1) for negative advantages; None disables."""
    kl_coef: float = 0.05
    """KL-to-reference coefficient; 0 switches the reference model off and frees its memory."""
    kl_estimator: str = "k3"
    """KL estimator: k1, k2 or k3."""
    loss_aggregation: str = "token-mean"
    """seq-mean-token-mean (DeepSeekMath), token-mean (DAPO) or seq-mean-token-sum-norm (Dr. GRPO)."""
    rewards: dict[str, Any] = field(default_factory=dict)
    """Reward functions: name -> weight, or name -> {weight: w, option: value, ...} (the options go to the
    reward's factory; no weight means 1.0). A name is a built-in reward (exact, math, math_verify, format),
    `rm`, or a dotted path `package.module:function`. Empty means {exact: 1.0}, the synthetic tasks' verifier."""
    reward_model: Optional[str] = None
    """Checkpoint folder of a trained reward model, used by the `rm` reward."""
    teacher: Optional[TeacherConfig] = None
    """GRPO: on-policy distillation from a teacher checkpoint {checkpoint, coef, kl_estimator, with_rewards,
    offload}; null: off."""
    rm_margin: float = 0.0
    """RM: margin subtracted in -log sigmoid(r_chosen - r_rejected - margin)."""
    rm_centering_coef: float = 0.0
    """RM: coefficient of the reward-centering term mean((r_c + r_r)^2)."""
    dpo_beta: float = 0.1
    """DPO: beta (> 0), how strongly the policy is held to the reference; the implicit reward of a response is
    beta * (log pi - log ref), summed over its tokens. IPO: the regulariser tau (target margin 1 / (2 beta))."""
    dpo_label_smoothing: float = 0.0
    """DPO (dpo_loss=sigmoid): the assumed probability that a preference label is flipped, in [0, 0.5)
    (conservative DPO: (1 - e) * -log sigmoid(z) + e * -log sigmoid(-z)); 0 = plain DPO."""
    dpo_loss: str = "sigmoid"
    """DPO loss: sigmoid (DPO) or ipo (squared distance of the length-averaged log-ratio margin from 1 / (2 beta),
    as TRL)."""
    dpo_sft_coef: float = 0.0
    """DPO: weight of an NLL term on the chosen responses (mean per chosen token over the batch); 0 = off."""
    sft_warmup_steps: int = 30
    """Supervised steps run before GRPO (0 = none); the data is set by data.warmup_task."""
    gamma: float = 1.0
    """PPO: discount of GAE over response tokens, in [0, 1]."""
    gae_lambda: float = 0.95
    """PPO: GAE's lambda, in [0, 1] (1 = Monte-Carlo returns minus the value, 0 = one-step TD)."""
    value_clip: Optional[float] = 0.2
    """PPO: the critic's values are clipped to old_value +- value_clip in the value loss (> 0); null = off."""
    value_coef: float = 1.0
    """PPO: factor on the critic's value loss (> 0). The critic has its own optimizer and LR, so it does not weigh
    the value loss against the policy loss; it scales the critic's gradients (seen through Adam's eps and
    optimizer.clip_grad only). Kept for recipes that quote it; critic_lr is the knob that matters."""
    kl_in_reward: bool = False
    """PPO: subtract kl_coef * KL(old policy || reference) (estimator kl_estimator) from every response token's
    reward, as InstructGPT does, instead of adding the KL to the policy loss."""
    whiten_advantages: bool = True
    """PPO: whiten the GAE advantages over every response token of the rollout (mean 0, std 1)."""
    whiten_shift_mean: bool = True
    """PPO, with whiten_advantages: subtract the mean (TRL, verl); false only rescales by the std (OpenRLHF)."""
    critic_init: str = "policy"
    """PPO: where the critic's trunk starts: policy (the policy's weights after the SFT warm-up, a fresh value
    head) or rm (a reward-model checkpoint, critic_init_from, head included)."""
    critic_init_from: Optional[str] = None
    """PPO with critic_init=rm: the reward-model checkpoint folder (default algorithm.reward_model)."""
    critic_lr: Optional[float] = None
    """PPO: the critic's peak learning rate (its own Adam, schedule as optimizer.*); null = optimizer.lr."""
    critic_warmup_steps: int = 0
    """PPO: rollouts at the start on which only the critic trains (the policy waits), so the advantages of the
    first policy updates come from a fitted critic; 0 = none."""

    def __post_init__(self) -> None:
        _one_of("algorithm", "name", self.name, ALGORITHMS)
        _one_of("algorithm", "advantage", self.advantage, ADVANTAGE_MODES)
        _one_of("algorithm", "kl_estimator", self.kl_estimator, KL_ESTIMATORS)
        _one_of("algorithm", "loss_aggregation", self.loss_aggregation, LOSS_AGGREGATIONS)
        _one_of("algorithm", "importance_ratio", self.importance_ratio, IMPORTANCE_RATIOS)
        _one_of("algorithm", "policy_loss", self.policy_loss, POLICY_LOSSES)
        self._check_dpo()
        self._check_off_policy()
        if isinstance(self.recompute_old_logprobs, str) and self.recompute_old_logprobs != "auto":
            raise ConfigError(f"algorithm.recompute_old_logprobs={self.recompute_old_logprobs!r} is not valid; use "
                              "true, false or auto")
        _positive("algorithm", global_batch_size=self.global_batch_size, group_size=self.group_size,
                  prompts_per_step=self.prompts_per_step, epochs=self.epochs,
                  max_sampling_draws=self.max_sampling_draws)
        _at_most("algorithm", MAX_LENGTH, global_batch_size=self.global_batch_size)
        _non_negative("algorithm", clip_eps_low=self.clip_eps_low, clip_eps_high=self.clip_eps_high,
                      kl_coef=self.kl_coef, rm_centering_coef=self.rm_centering_coef,
                      sft_warmup_steps=self.sft_warmup_steps)
        if self.router_replay and self.name != "grpo":
            raise ConfigError(f"algorithm.router_replay=true replays the experts of GRPO rollouts; algorithm.name="
                              f"{self.name} has none, so set it to false")
        if self.dual_clip is not None and self.dual_clip <= 1:
            raise ConfigError(f"algorithm.dual_clip={self.dual_clip} must be > 1 (or null to disable)")
        if self.dual_clip is not None and self.policy_loss == "cispo":
            raise ConfigError("algorithm.dual_clip caps the clipped surrogate's loss, which policy_loss=cispo does "
                              "not use; set dual_clip: null (cispo bounds its weight by clip_eps_high)")
        if self.policy_loss == "clip" and self.clip_eps_low >= 1:
            raise ConfigError(f"algorithm.clip_eps_low={self.clip_eps_low} must be below 1 (the ratio is clipped "
                              "at 1 - clip_eps_low)")
        self._check_ppo()
        if self.teacher is not None and self.name != "grpo":
            raise ConfigError(f"algorithm.teacher distils into GRPO's samples; algorithm.name={self.name} takes none, "
                              "so set algorithm.teacher=null")
        if self.name in ("grpo", "ppo"):
            completions = self.prompts_per_step * self.group_size
            if completions % self.global_batch_size:
                raise ConfigError(
                    f"algorithm.global_batch_size={self.global_batch_size} must divide the rollout batch "
                    f"prompts_per_step*group_size={completions}")
        self._check_rewards()

    def _check_ppo(self) -> None:
        _one_of("algorithm", "critic_init", self.critic_init, CRITIC_INITS)
        for key in ("gamma", "gae_lambda"):
            if not 0 <= getattr(self, key) <= 1:
                raise ConfigError(f"algorithm.{key}={getattr(self, key)} must be in [0, 1]; e.g. "
                                  f"{'1.0' if key == 'gamma' else '0.95'}")
        _positive("algorithm", value_clip=self.value_clip, value_coef=self.value_coef, critic_lr=self.critic_lr)
        _non_negative("algorithm", critic_warmup_steps=self.critic_warmup_steps)
        if self.critic_init_from and self.critic_init != "rm":
            raise ConfigError(f"algorithm.critic_init_from={self.critic_init_from!r} is read only with "
                              "algorithm.critic_init=rm; set that, or critic_init_from=null")
        if self.critic_init == "rm" and self.name == "ppo" and not (self.critic_init_from or self.reward_model):
            raise ConfigError("algorithm.critic_init=rm needs algorithm.critic_init_from (or algorithm.reward_model): "
                              "a reward-model checkpoint folder; or set algorithm.critic_init=policy")

    def _check_off_policy(self) -> None:
        _non_negative("algorithm", max_staleness=self.max_staleness)
        _one_of("algorithm", "weight_sync", self.weight_sync, WEIGHT_SYNCS)
        _positive("algorithm", weight_sync_bucket_mib=self.weight_sync_bucket_mib)
        _one_of("algorithm", "off_policy_correction", self.off_policy_correction, OFF_POLICY_CORRECTIONS)
        if self.is_cap < 1:
            raise ConfigError(f"algorithm.is_cap={self.is_cap} must be >= 1 (an on-policy token has weight 1); "
                              "e.g. 2.0")

    def _check_dpo(self) -> None:
        _one_of("algorithm", "dpo_loss", self.dpo_loss, DPO_LOSSES)
        _positive("algorithm", dpo_beta=self.dpo_beta)
        _non_negative("algorithm", dpo_sft_coef=self.dpo_sft_coef)
        smoothing = self.dpo_label_smoothing
        if not 0 <= smoothing < 0.5:
            raise ConfigError(f"algorithm.dpo_label_smoothing={smoothing} must be in [0, 0.5) (the probability "
                              "that a label is flipped); use e.g. 0.1, or 0 for plain DPO")
        if smoothing and self.dpo_loss != "sigmoid":
            raise ConfigError(f"algorithm.dpo_label_smoothing={smoothing} applies to dpo_loss=sigmoid only; set it to "
                              f"0 with dpo_loss={self.dpo_loss}")

    def _check_rewards(self) -> None:
        """Each entry's shape, and the options of the built-in rewards (other rewards' are checked by the job)."""
        for name, options in self.reward_options.items():
            if name == "rm" and options:
                raise ConfigError(f"algorithm.rewards.rm takes only a weight, not {', '.join(sorted(options))}; "
                                  "the checkpoint is algorithm.reward_model")
            check_reward_options(name, options, label=f"algorithm.rewards.{name}")

    @property
    def _reward_entries(self) -> dict[str, tuple[float, dict[str, Any]]]:
        entries = {}
        for name, entry in (self.rewards or {"exact": 1.0}).items():
            options = dict(entry) if isinstance(entry, dict) else {"weight": entry}
            weight = options.pop("weight", 1.0)
            if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight):
                raise ConfigError(f"algorithm.rewards.{name}: weight {weight!r} is not a number; give "
                                  f"algorithm.rewards.{name}=1.0 or {{weight: 1.0, option: value, ...}}")
            entries[name] = float(weight), options
        return entries

    @property
    def reward_weights(self) -> dict[str, float]:
        """Weight per reward name (algorithm.rewards, or {exact: 1.0} when it is empty)."""
        return {name: weight for name, (weight, _) in self._reward_entries.items()}

    @property
    def reward_options(self) -> dict[str, dict[str, Any]]:
        """Options per reward name: its entry's keys other than weight ({} for a plain weight)."""
        return {name: options for name, (_, options) in self._reward_entries.items()}

    @property
    def rollout_size(self) -> int:
        return self.prompts_per_step * self.group_size
