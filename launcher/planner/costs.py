"""Memory and time model of one Megatron-Core training step, per GPU (pure arithmetic, no torch).

Memory follows Korthikanti et al. 2022 (activations per stored tensor) and Megatron's
theoretical_memory_usage.py (weights, fp32 grads, Adam states, distributed optimizer, pipeline in-flight
micro-batches, interleaving). Time is compute at a shape-dependent calibrated fraction of peak plus
bandwidth terms for TP, CP, EP, PP and DP traffic: over NVLink inside a node and InfiniBand across with nccl, all
over TCP with gloo on GPUs (TCP_GB_S, Runtime.comm_backend). Constants and how they were fitted: calibration.md.

Check it: ``.venv/bin/python -m pytest tests/test_planner_calibration.py -q``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from launcher.planner.gpus import GIB, GpuSpec
from launcher.planner.moe_comm import IB_LATENCY_S, NVLINK_LATENCY_S, deepep_inter_share, ep_time_s
from megatron_rl.spec.model_shape import ModelShape

# ---- calibration constants (calibration.md says where each comes from) ----
GEMM_HALF_WIDTH = 300.0
"""Shard width (hidden/TP, in elements) at which GEMMs reach half of gpu.gemm_efficiency (fitted, A100 rows)."""
GEMM_TOKEN_WEIGHT = 8.0
"""GEMM row count (tokens) counts 1/8 as much as the shard width in the efficiency curve."""
ATTN_CORE_EFFICIENCY = 0.75
"""Unfused attention core (batched GEMMs) runs at this fraction of the GEMM efficiency."""
FLASH_ATTN_EFFICIENCY = 0.50
"""Flash attention (fused kernel, causal blocks skipped) runs at this fraction of the GEMM efficiency (fitted on
NeMo's long-sequence Llama2-7B CP4 row, calibration.md)."""
FP8_GEMM_RELATIVE = 0.92
"""fp8 GEMMs reach this fraction of the bf16 efficiency, measured against the fp8 peak (casts, amax)."""
LINK_EFFICIENCY = 0.8
"""Achieved collective bus bandwidth over nominal link bandwidth (NVLink, InfiniBand and TCP)."""
TCP_GB_S = 25 / 8
"""Nominal bandwidth of the TCP path one process reaches, GB/s: a 25 Gb/s Ethernet NIC's worth. An assumption, not
measured here. gloo (parallel.backend=gloo on GPUs, Runtime.comm_backend) copies each GPU tensor to host memory and
sends it over TCP sockets, never over NVLink or InfiniBand verbs, so every collective, intra-node ones included
(loopback TCP behind the same device-host staging), is taken at this rate. Weight sync over gloo or files (a shared
file system on the same network) runs at it too (split.weight_sync_s)."""
TCP_LATENCY_S = 50e-6
"""Latency of one collective step over TCP with CPU staging (an assumption: socket round trips plus the device-host
copies, several times InfiniBand's)."""
HBM_EFFICIENCY = 0.8
"""Achieved over nominal HBM bandwidth for element-wise kernels."""
TP_OVERLAP_EXPOSED = 0.25
"""Fraction of TP collectives left exposed with --tp-comm-overlap (userbuffers)."""
OVERLAP_CONTENTION = 0.2
"""Communication hidden behind compute still slows it: NCCL kernels take SMs and HBM bandwidth. Each second
of overlapped communication costs this many seconds of compute."""
DP_BUCKET_BYTES = 160e6
"""Gradient bucket size in bytes (Megatron: 40M fp32 elements)."""
GRAD_ACCUM_BYTES = 4
"""Megatron keeps fp32 main gradients for bf16 training (Runtime.main_grad_bytes)."""
ADAM_BYTES_PER_PARAM = 12.0
"""Optimizer state per parameter: fp32 master weights and Adam's two fp32 moments (sharded over the data-parallel
ranks with the distributed optimizer)."""
MEMORY_MARGIN = 0.05
"""Default safety margin: 5% of device memory (4.0 GiB of an H100's 79.6) left free beyond everything counted."""
MOE_DROPLESS_IMBALANCE = 1.3
"""Assumed busiest-EP-rank load under dropless routing with load balancing, over the even share. Not fitted: an
allowance in the range that auxiliary-loss-balanced MoE training reports (per-expert loads within about +-30% of
even once balancing has converged); early training and small EP groups can exceed it."""

LAYER_PARTS = ("compute", "recompute", "tp_comm", "cp_comm", "ep_all_to_all")
"""The parts a layer's (and the output layer's) time is split into, LayerCost.parts_s's keys."""


@dataclass(frozen=True, kw_only=True)
class Runtime:
    """Software features of the training run. Defaults are what this project's trainers run on GPUs with
    Transformer Engine (``launcher.job.plan_job`` maps the config's ``runtime:`` section onto them); the calibration
    rows state their own era's (calibration.py)."""

    transformer_engine: bool = True
    """Transformer Engine layers (needed by tp_comm_overlap; without TE attention is unfused unless asked)."""
    flash_attention: bool = True
    """Fused (flash) attention: no s*s scores stored, causal blocks skipped; False = unfused softmax(QK^T)V."""
    tp_comm_overlap: bool = False
    """--tp-comm-overlap: TP collectives overlapped with GEMMs (TE userbuffers). Off: no trainer turns it on
    unless runtime.tp_comm_overlap is set."""
    overlap_grad_reduce: bool = True
    """--overlap-grad-reduce: DP gradient reduce overlapped with the last backward."""
    overlap_param_gather: bool = True
    """--overlap-param-gather: distributed-optimizer all-gather overlapped with the next forward."""
    distributed_optimizer: bool = True
    """--use-distributed-optimizer: fp32 master weights and Adam states sharded over DP x CP."""
    main_grad_bytes: int = GRAD_ACCUM_BYTES
    """Bytes per main-gradient element held per parameter: 4 (fp32, Megatron's default for bf16 training) or 2
    (bf16 main grads, runtime.grad_dtype=bf16)."""
    grad_reduce_bytes: int | None = None
    """Bytes per gradient element on the DP wire; None = main_grad_bytes (Megatron reduces the main grads)."""
    fp8_param_gather: bool = False
    """--fp8-param-gather (precision fp8): the model's weights are held in fp8 only (1 B, plus its 1 B transpose
    that Hopper's fp8 GEMMs need for the backward), the fp32 master in the optimizer; False keeps bf16 weights
    and an fp8 copy (3 B). Megatron-Bridge's fp8 recipes set it; no trainer here runs fp8."""
    selective_modules: tuple[str, ...] = ("core_attn", "layernorm", "moe_act", "mla_up_proj")
    """--recompute-modules for recompute=selective (moe_act / mla_up_proj only where the model has them)."""
    moe_a2a_overlap: bool = False
    """--overlap-moe-expert-parallel-comm: the expert all-to-all of one micro-batch hidden behind the compute of
    another (moe_comm.ep_time_s). Off: no trainer here sets it."""
    moe_deepep: bool = False
    """DeepEP (node-deduplicated expert dispatch). Not run by the trainers here: off, and a plan refuses it
    (moe_comm.check_runtime)."""
    moe_capacity_factor: float | None = None
    """MoE expert capacity factor (tokens an expert takes, over the even share); None = dropless routing, where the
    busiest expert-parallel rank gets moe_dropless_imbalance times the even share."""
    moe_dropless_imbalance: float = MOE_DROPLESS_IMBALANCE
    """Busiest EP rank's routed tokens over the even share under dropless routing (memory and expert time)."""
    overhead_gib: float = 3.0
    """Fixed per-GPU overhead: CUDA context, NCCL buffers, cuBLAS/TE workspaces."""
    fragmentation: float = 0.05
    """Allocator fragmentation, as a fraction of everything else."""
    memory_margin: float = MEMORY_MARGIN
    """Safety margin: the fraction of device memory a layout must leave free beyond everything counted (overhead
    and fragmentation included); the plan prints it. 0 = fill to capacity."""
    trainable_fraction: float = 1.0
    """Share of the parameters that train (model.lora: the adapters', ``inputs.lora_trainable_fraction``): main
    gradients and optimizer state are counted for that share only; the frozen rest costs its weights."""
    comm_backend: str = "nccl"
    """Collective library: nccl (NVLink inside a node, InfiniBand across) or gloo (parallel.backend=gloo on GPUs:
    TP, CP, EP, PP and DP traffic all at TCP_GB_S and TCP_LATENCY_S)."""

    @property
    def wire_grad_bytes(self) -> int:
        """Bytes per gradient element the DP reduce moves."""
        return self.main_grad_bytes if self.grad_reduce_bytes is None else self.grad_reduce_bytes

    @property
    def expert_load(self) -> float:
        """Busiest EP rank's routed tokens over the even share (capacity factor, or the dropless allowance)."""
        return self.moe_capacity_factor if self.moe_capacity_factor is not None else self.moe_dropless_imbalance


@dataclass(frozen=True, kw_only=True)
class GrpoSizing:
    """Rollout sizing for the RL modes (grpo, ppo, eval): generation, log-prob passes and optimizer steps."""

    rollout_batch_size: int | None = None
    """Sequences generated per step (prompts x samples per prompt); None = global batch size."""
    max_prompt_length: int | None = None
    """Longest prompt in tokens; None = a quarter of the sequence length. Prompts are taken at this length (the
    planner knows no mean prompt length)."""
    max_response_length: int | None = None
    """Longest response in tokens; None = sequence length minus prompt length."""
    mean_response_length: int | None = None
    """Mean response length in tokens (step time depends on it); None = half of max_response_length. Lengths are
    taken as spread evenly up to twice the mean (capped at the max), and some row reaches the max."""
    samples_per_prompt: int = 1
    """Completions per prompt (algorithm.group_size): a group's shared prompt is prefilled once."""
    generation_concurrency: int | None = None
    """Cap on the sequences decoded at once per generation data-parallel rank (generation.max_concurrent); None =
    no cap (the KV budget is the limit)."""
    kv_memory_gib: float | None = None
    """The paged engine's KV pool per GPU (generation.kv_memory_gib); None = the planner picks it per layout
    (``plans_kv_memory``) or, when it does not, the engine's own default: every row at its longest."""
    plans_kv_memory: bool = True
    """With kv_memory_gib None: the planner picks the pool per layout (rl_step.kv_pool), as launch.py writes it
    into generation.kv_memory_gib under parallel.auto; False: the engine's default, every row at its longest."""
    kv_block_tokens: int = 256
    """Tokens per KV block (generation.kv_block_tokens): a row holds half a block of rounding on average."""
    cuda_graphs: bool = False
    """generation.cuda_graphs: decode steps of up to DECODE_GRAPH_ROWS[-1] rows replay from CUDA graphs (the decode
    floor per layer drops to rl_step.DECODE_LAYER_GRAPH_S), and the graphs' pool keeps the largest bucket's logits
    and sampling buffers beside the eager steps' own."""
    reference_model: bool = True
    """Keep a frozen bf16 reference model on the GPUs for the KL term (algorithm.kl_coef > 0)."""
    recompute_old_logprobs: bool = True
    """Recompute the old policy's log-probs with a training forward (algorithm.recompute_old_logprobs resolved)."""
    epochs: int = 1
    """Passes over each rollout (algorithm.epochs), rollout / global batch optimizer steps each."""
    reward_model: bool = False
    """A colocated reward model (algorithm.reward_model), taken as the policy's shape: bf16 weights on the GPUs
    and one scoring forward over the rollout."""
    teacher_params: float = 0.0
    """Parameters of algorithm.teacher's model (0: no teacher): bf16 weights spread evenly over the tp x pp ranks
    (its embedding's imbalance and expert parallelism left out), and one forward over the rollout per step at the
    policy's forward time scaled by teacher_params / the policy's parameters."""
    teacher_offloaded: bool = True
    """algorithm.teacher.offload: the teacher's weights wait in host memory outside its forward, so they cost two
    host copies per step and only what exceeds training's activations in memory."""
    kv_cache_bytes: int = 2
    """Bytes per cached K/V element."""
    kv_cache_released_for_training: bool = False
    """True when the runtime frees the KV cache before the training phase: the cache then reuses the memory that
    only training holds (activations), so the peak is the larger phase, not the sum."""
    optimizer_offloaded_for_generation: bool = False
    """True when optimizer state and grads wait in host memory while generating (generation.offload_optimizer):
    with the KV cache released for training, the cache also reuses their memory; the copies cost host-link time."""
    turns: int = 1
    """Policy turns of an episode (environment.max_turns, taken at the most; 1: single-turn completions): each turn
    after the first prefills the environment's reply onto the row."""
    reply_tokens: int = 0
    """Tokens of the environment's replies in a mean episode (environment.mean_reply_tokens): held in the KV pool,
    prefilled between turns (not decoded) and in the training forwards (out of the loss)."""
    env_step_s: float = 0.0
    """Seconds of one environment step (environment.mean_step_s), ``turns`` per episode at the most."""
    env_concurrent_steps: int = 1
    """Environment steps a rollout worker runs at once (environment.concurrent_steps; 0 runs them one at a time):
    its steps take rows x turns x env_step_s / this, counted on top of its decoding (they overlap it only in part)."""
    micro_batch_tokens: int | None = None
    """parallel.micro_batch_tokens: the training and log-prob forwards pack rows into micro-batches of this many
    tokens, computing the rows' own tokens (plus PACKING_SLACK), not every row padded to the longest; None =
    padded."""

    @property
    def packed(self) -> bool:
        """Whether the rows are packed (micro_batch_tokens set)."""
        return self.micro_batch_tokens is not None


@dataclass(frozen=True, kw_only=True)
class SplitPlacement:
    """Split placement (cluster.rollout_tasks > 0): separate GPUs only generate, each rollout replica at the
    training layout's tp x pp (cp=1, ep=1); the workload's num_gpus are then the training GPUs alone (rl_step.py's split placement)."""

    rollout_gpus: int
    """GPUs (one process each) that only generate: cluster.rollout_tasks, a multiple of tp*pp."""
    max_staleness: int = 0
    """algorithm.max_staleness: 0 = the trainer waits for rollouts of its current weights, so generation and
    training add up; > 0 = the next rollout is generated while the trainer trains (the step is the longer)."""
    weight_sync: str = "gloo"
    """algorithm.weight_sync: gloo or files (at TCP_GB_S) or nccl (at the inter-node bandwidth)."""
    rollout_tp: Optional[int] = None
    """parallel.rollout_tp: the replicas' tensor-parallel size (None: the training layout's)."""
    rollout_pp: Optional[int] = None
    """parallel.rollout_pp: the replicas' pipeline-parallel size (None: the training layout's)."""

    def dims_keys(self) -> dict:
        """ParallelDims' keys for the rollout GPUs beside a training layout."""
        return {"rollout_tasks": self.rollout_gpus, "rollout_tp": self.rollout_tp, "rollout_pp": self.rollout_pp}

    def replica(self, tp: int, pp: int) -> tuple[int, int]:
        """(tp, pp) of a rollout replica beside a training layout of tp x pp."""
        return self.rollout_tp or tp, self.rollout_pp or pp

    @property
    def overlapped(self) -> bool:
        """Whether generation runs during training (asynchronous GRPO)."""
        return self.max_staleness > 0


@dataclass(frozen=True)
class LayerCost:
    """Per-layer, per-micro-batch cost on one GPU."""

    fwd_s: float
    bwd_s: float  # includes recompute
    stored_bytes: float  # kept until backward (multiplied by micro-batches in flight)
    working_bytes: float  # one layer's full working set (full recompute only)
    hw_flops: float  # fwd+bwd+recompute FLOPs on this GPU
    parts_s: dict[str, float]
    """fwd_s + bwd_s by part (LAYER_PARTS): compute, recompute (what it adds), TP, CP and EP communication."""


@dataclass
class Workload:
    """One planning problem: model, hardware, software, sequence and batch. Caches per-layout pieces."""

    shape: ModelShape
    gpu: GpuSpec
    num_gpus: int
    seq_length: int
    global_batch_size: int
    mode: str = "pretrain"
    precision: str = "bf16"
    runtime: Runtime = field(default_factory=Runtime)
    grpo: GrpoSizing | None = None
    split: SplitPlacement | None = None
    pads_sequences: bool | None = None
    """The trainer rounds sequence lengths up to the layout's multiple (``megatron_rl.spec.parallel.pads_sequences``
    of the job's algorithm: SFT does, though it plans as pretrain); None: every mode but pretrain."""

    def __post_init__(self):
        if self.pads_sequences is None:
            self.pads_sequences = self.mode != "pretrain"
        s = self.shape
        self.h, self.n, self.g, self.d = s.hidden_size, s.num_attention_heads, s.num_query_groups, s.kv_channels
        self.gated = 3 if s.gated_linear_unit else 2
        self.fc1_mult = 2 if s.gated_linear_unit else 1
        if s.is_mla:
            self.dqk, self.dv = s.qk_nope_head_dim + s.qk_rope_head_dim, s.v_head_dim
        else:
            self.dqk = self.dv = self.d
        self.attn_proj_flops = 2 * s.attention_params()  # per token fwd (norm params are noise)
        self.core_flops = 2.0 * self.seq_length * self.n * (self.dqk + self.dv)  # per token fwd, causal unhalved
        self.dense_mlp_flops = 2 * self.h * s.ffn_hidden_size * self.gated
        moe_ffn = s.moe_ffn_hidden_size
        self.expert_flops = 2 * self.h * moe_ffn * self.gated * s.moe_router_topk
        self.moe_other_flops = 2 * self.h * s.num_experts + 2 * self.h * s.moe_shared_expert_intermediate_size * self.gated
        self.vocab_out = 1 if self.mode == "rm" else s.vocab_size
        self.output_flops = 2 * self.h * self.vocab_out
        self.bf16_peak = self.gpu.bf16_tflops * 1e12
        self.gemm_peak = (self.gpu.fp8_tflops * 1e12 * FP8_GEMM_RELATIVE) if self.precision == "fp8" else self.bf16_peak
        self.hbm = self.gpu.hbm_tb_s * 1e12 * HBM_EFFICIENCY
        self.tcp = TCP_GB_S * 1e9 * LINK_EFFICIENCY
        if self.runtime.comm_backend == "gloo":  # no NVLink, no RDMA: every link is TCP
            self.nvlink = self.ib = self.tcp
            self.nic = TCP_GB_S * 1e9
            self.nvlink_latency = self.ib_latency = TCP_LATENCY_S
            self.nvlink_domain = 1  # every all-to-all peer is behind the one TCP path
        else:
            self.nvlink = self.gpu.nvlink_gb_s * 1e9 * LINK_EFFICIENCY
            self.ib = self.gpu.internode_gb_s * 1e9 * LINK_EFFICIENCY
            self.nic = self.gpu.internode_gb_s * 1e9
            self.nvlink_latency, self.ib_latency = NVLINK_LATENCY_S, IB_LATENCY_S
            self.nvlink_domain = self.gpu.gpus_per_node
        self.host_link = self.gpu.host_link_gb_s * 1e9 * LINK_EFFICIENCY
        self.modules = set(self.selective_modules())
        self.active_params = s.num_active_params()
        self.total_params = s.num_params()
        self._cost_cache: dict = {}

    def selective_modules(self) -> tuple[str, ...]:
        """--recompute-modules that recompute=selective uses here: core_attn only without flash attention (flash
        already keeps no scores), moe_act only for MoE models, mla_up_proj only for MLA."""
        s = self.shape
        keep = {"core_attn": not self.runtime.flash_attention, "moe_act": s.is_moe, "mla_up_proj": s.is_mla}
        return tuple(m for m in self.runtime.selective_modules if keep.get(m, True))

    # ---------- FLOPs ----------
    def model_flops_per_token(self) -> float:
        """Model FLOPs (fwd+bwd, no recompute) per trained token, GQA/SwiGLU/MoE/MLA aware, causal unhalved."""
        return self._cached(("model flops per token",), self._model_flops_per_token)

    def _model_flops_per_token(self) -> float:
        s = self.shape
        dense = self.attn_proj_flops + self.core_flops + self.dense_mlp_flops
        moe = self.attn_proj_flops + self.core_flops + self.moe_other_flops + self.expert_flops
        per_token = s.num_dense_layers * dense + s.num_moe_layers * moe + self.output_flops
        if s.mtp_num_layers:
            per_token += s.mtp_num_layers * ((moe if s.is_moe else dense) + 4 * self.h * self.h + self.output_flops)
        return 3.0 * per_token

    # ---------- efficiency ----------
    def gemm_efficiency(self, width: float, tokens: float) -> float:
        """Fraction of peak reached by a GEMM whose shard width is `width` with `tokens` rows."""
        x = 1.0 / (1.0 / width + 1.0 / (GEMM_TOKEN_WEIGHT * tokens))
        return self.gpu.gemm_efficiency * x / (x + GEMM_HALF_WIDTH)

    # ---------- per layer ----------
    def layer_cost(self, kind: str, tp: int, cp: int, sp: bool, mbs: int, recompute: str, ep: int) -> LayerCost:
        """Cost of one decoder layer ('dense' or 'moe') for one micro-batch on one GPU."""
        return self._cached((kind, tp, cp, sp, mbs, recompute, ep),
                            lambda: self._layer_cost(kind, tp, cp, sp, mbs, recompute, ep))

    def _cached(self, key: tuple, make):
        """make()'s value, computed once per key (callers do not mutate it)."""
        hit = self._cost_cache.get(key)
        if hit is None:
            hit = self._cost_cache[key] = make()
        return hit

    def _act_terms(self, kind: str, tp: int, sp: bool, ep: int = 1) -> dict[str, float]:
        """Stored activation bytes per local token for one layer, by tensor (Korthikanti's accounting); under
        EP the routed-expert tensors are the busiest rank's (Runtime.expert_load)."""
        s, h, n, g, d = self.shape, self.h, self.n, self.g, self.d
        rep = tp if sp else 1
        gemm_in = 1.0 if self.precision == "fp8" else 2.0  # TE stores fp8 GEMM inputs
        mask = 1.0 * h / rep if s.hidden_dropout > 0 else 0.0
        t: dict[str, float] = {"x_in": 2 * h / rep, "ln1_out": gemm_in * h / rep, "x2": 2 * h / rep,
                               "ln2_out": gemm_in * h / rep, "masks": 2 * mask}
        if s.is_mla:
            t["latents"] = (4 * s.q_lora_rank + 4 * s.kv_lora_rank + 2 * s.qk_rope_head_dim) / rep
            t["mla_up"] = (4 * n * self.dqk + 2 * n * self.dv) / tp
        else:
            t["qkv"] = 2 * (n + 2 * g) * d / tp
        if self.runtime.flash_attention:
            t["lse"] = 4 * n / tp
        else:
            per_elem = 5 if s.attention_dropout > 0 else 2
            t["core"] = per_elem * n * self.seq_length / tp
        t["proj_in"] = gemm_in * n * self.dv / tp
        if kind == "dense":
            f = s.ffn_hidden_size
            t["fc1_out"] = 2 * f * self.fc1_mult / tp
            t["act_out"] = gemm_in * f / tp
        else:
            fm, fs = s.moe_ffn_hidden_size, s.moe_shared_expert_intermediate_size
            k = s.moe_router_topk * (self.runtime.expert_load if ep > 1 else 1.0)
            t["router"] = 4 * s.num_experts / rep
            t["expert_io"] = k * (gemm_in * h + 2 * h) / rep
            t["expert_fc1"] = k * 2 * fm * self.fc1_mult / rep
            t["expert_act"] = k * gemm_in * fm / rep
            if fs:
                t["shared"] = (2 * fs * self.fc1_mult + gemm_in * fs) / tp
        return t

    def _stored_per_token(self, kind: str, tp: int, sp: bool, recompute: str, ep: int = 1) -> tuple[float, float]:
        terms = self._act_terms(kind, tp, sp, ep)
        full = sum(terms.values())
        if recompute == "full":
            return terms["x_in"], full
        if recompute == "selective":
            drop = {"core_attn": ("core",), "layernorm": ("ln1_out", "ln2_out"), "moe_act": ("expert_act",),
                    "mla_up_proj": ("mla_up",)}
            for module in self.modules:
                for name in drop.get(module, ()):
                    full -= terms.get(name, 0.0)
        return full, 0.0

    def _layer_cost(self, kind, tp, cp, sp, mbs, recompute, ep) -> LayerCost:
        s, h = self.shape, self.h
        tokens = mbs * self.seq_length / cp
        rep = tp if sp else 1
        width = h / tp
        # compute
        gemm = tokens * self.attn_proj_flops / tp
        eff = self.gemm_efficiency(width, tokens)
        t_gemm = gemm / (self.gemm_peak * eff)
        expert_time = 0.0
        if kind == "dense":
            mlp = tokens * self.dense_mlp_flops / tp
            t_gemm += mlp / (self.gemm_peak * eff)
            gemm += mlp
        else:
            other = tokens * self.moe_other_flops / tp
            t_gemm += other / (self.gemm_peak * eff)
            per_expert_tokens = tokens / rep * s.moe_router_topk * ep / s.num_experts
            e_eff = self.gemm_efficiency(min(s.moe_ffn_hidden_size, h), per_expert_tokens)
            experts = tokens * self.expert_flops / tp
            load = self.runtime.expert_load if ep > 1 else 1.0  # the busiest EP rank sets the pace
            expert_time = load * experts / (self.gemm_peak * e_eff)
            t_gemm += expert_time
            gemm += experts
        core_model = tokens * self.core_flops / tp
        flash = self.runtime.flash_attention
        core_eff = self.gpu.gemm_efficiency * (FLASH_ATTN_EFFICIENCY if flash else ATTN_CORE_EFFICIENCY)
        core_hw_fwd = core_model * (0.5 if flash else 1.0)
        t_core_fwd = core_hw_fwd / (self.bf16_peak * core_eff)
        t_core_bwd = t_core_fwd * (2.5 if flash else 2.0)
        # element-wise traffic (norms, residuals, rope, activation, dropout; unfused softmax)
        f_local = (s.ffn_hidden_size if kind == "dense" else
                   s.moe_ffn_hidden_size * s.moe_router_topk * tp / rep + s.moe_shared_expert_intermediate_size)
        ew_fwd = tokens * (20 * h / rep + 4 * (self.n + self.g) * self.d / tp + (6 if self.gated == 3 else 4) * f_local / tp
                           + (10 * h / rep if s.hidden_dropout > 0 else 0))
        t_mem_fwd = ew_fwd / self.hbm
        t_mem_bwd = 2 * t_mem_fwd
        t_softmax_fwd = t_softmax_bwd = 0.0
        if not flash:
            elems = tokens * self.n * self.seq_length / tp
            drop = s.attention_dropout > 0
            t_softmax_fwd = elems * (9 if drop else 4) / self.hbm
            t_softmax_bwd = elems * (11 if drop else 6) / self.hbm
        # TP collectives: 2 AG+RS (or 2 all-reduce) per direction per layer; MoE MLP with ETP=1 has none
        t_tp_unit = 0.0
        if tp > 1:
            unit_bytes = tokens * h * 2 * (tp - 1) / tp
            t_tp_unit = unit_bytes / self.nvlink + self.nvlink_latency
            if self.runtime.tp_comm_overlap:
                t_tp_unit *= TP_OVERLAP_EXPOSED + (1 - TP_OVERLAP_EXPOSED) * OVERLAP_CONTENTION
        tp_units = 4 if kind == "dense" else 2
        t_tp_fwd = t_tp_bwd = tp_units * t_tp_unit
        # CP ring attention: K/V chunks around the ring, overlapped with attention compute
        t_cp_fwd = t_cp_bwd = 0.0
        if cp > 1:
            # ring attention passes per-head K and V (for MLA: after the up-projection, not the latent)
            kv = self.n * (self.dqk + self.dv) / tp if s.is_mla else 2 * self.g * self.d / tp
            chunk = tokens * kv * 2
            bw = self.nvlink if tp * cp <= self.gpu.gpus_per_node else self.ib
            comm_fwd = (cp - 1) * (chunk / bw + (self.nvlink_latency if bw == self.nvlink else self.ib_latency))
            t_cp_fwd = max(0.0, comm_fwd - t_core_fwd) + OVERLAP_CONTENTION * min(comm_fwd, t_core_fwd)
            t_cp_bwd = max(0.0, 2 * comm_fwd - t_core_bwd) + OVERLAP_CONTENTION * min(2 * comm_fwd, t_core_bwd)
        # EP all-to-all: dispatch + combine per direction, by topology (moe_comm.py)
        t_ep = 0.0
        if kind == "moe" and ep > 1:
            routed = tokens / rep * s.moe_router_topk * h * 2 * self.runtime.expert_load
            t_ep = ep_time_s(routed_bytes=routed, ep=ep, gpus_per_node=self.nvlink_domain,
                             nvlink_bytes_s=self.nvlink, nic_bytes_s=self.nic,
                             overlap=self.runtime.moe_a2a_overlap, hideable_s=t_gemm + t_core_fwd,
                             inter_share=self._deepep_share(ep))
        fwd = t_gemm + t_core_fwd + t_mem_fwd + t_softmax_fwd + t_tp_fwd + t_cp_fwd + t_ep
        bwd_once = 2 * t_gemm + t_core_bwd + t_mem_bwd + t_softmax_bwd + t_tp_bwd + t_cp_bwd + t_ep
        bwd = bwd_once
        hw = 3 * gemm + core_hw_fwd * (3.5 if flash else 3.0)
        if recompute == "full":
            bwd += fwd
            hw += gemm + core_hw_fwd
        elif recompute == "selective":
            mods = self.modules
            if "core_attn" in mods:
                bwd += t_core_fwd + t_softmax_fwd
                hw += core_hw_fwd
            if "layernorm" in mods:
                bwd += tokens * 4 * h / rep / self.hbm
            if "mla_up_proj" in mods and s.is_mla:
                up = tokens * 2 * (s.q_lora_rank * self.n * self.dqk + s.kv_lora_rank * self.n * (s.qk_nope_head_dim + self.dv)) / tp
                bwd += up / (self.gemm_peak * eff)
                hw += up
        comm = {"tp_comm": t_tp_fwd + t_tp_bwd, "cp_comm": t_cp_fwd + t_cp_bwd, "ep_all_to_all": 2 * t_ep}
        compute = 3 * t_gemm + t_core_fwd + t_core_bwd + t_mem_fwd + t_mem_bwd + t_softmax_fwd + t_softmax_bwd
        parts = {"compute": compute, "recompute": bwd - bwd_once, **comm}
        stored, working = self._stored_per_token(kind, tp, sp, recompute, ep)
        return LayerCost(fwd_s=fwd, bwd_s=bwd, stored_bytes=stored * tokens, working_bytes=working * tokens,
                         hw_flops=hw, parts_s=parts)

    def _deepep_share(self, ep: int) -> float | None:
        """Inter-node share of routed copies with DeepEP (Runtime.moe_deepep); None = Megatron's all-to-all."""
        if not self.runtime.moe_deepep:
            return None
        s = self.shape
        return deepep_inter_share(ep=ep, gpus_per_node=self.gpu.gpus_per_node, topk=s.moe_router_topk,
                                  group_topk=getattr(s, "moe_router_group_topk", 0) or 0)

    # ---------- embedding / output on the end stages ----------
    def output_cost(self, tp: int, cp: int, sp: bool, mbs: int) -> tuple[dict[str, float], float]:
        """(fwd+bwd seconds by part: compute and tp_comm, logits bytes held) of the output layer and loss for one
        micro-batch."""
        return self._cached(("output", tp, cp, sp, mbs), lambda: self._output_cost(tp, cp, mbs))

    def _output_cost(self, tp: int, cp: int, mbs: int) -> tuple[dict[str, float], float]:
        tokens = mbs * self.seq_length / cp
        flops = 3 * tokens * self.output_flops / tp
        compute = flops / (self.gemm_peak * self.gemm_efficiency(self.h / tp, tokens))
        logits_bytes = tokens * self.vocab_out / tp * 6  # bf16 logits + fp32 softmax for the loss
        compute += tokens * self.vocab_out / tp * 16 / self.hbm
        t_tp = 0.0
        if tp > 1:
            unit = tokens * self.h * 2 * (tp - 1) / tp / self.nvlink
            t_tp = 2 * unit * (TP_OVERLAP_EXPOSED if self.runtime.tp_comm_overlap else 1.0)
        return {"compute": compute, "tp_comm": t_tp}, logits_bytes

    def mtp_cost(self, tp, cp, sp, mbs, recompute, ep) -> tuple[dict[str, float], float]:
        """(seconds fwd+bwd by part, stored bytes) added to the last stage by multi-token prediction per
        micro-batch."""
        return self._cached(("mtp", tp, cp, sp, mbs, recompute, ep),
                            lambda: self._mtp_cost(tp, cp, sp, mbs, recompute, ep))

    def _mtp_cost(self, tp, cp, sp, mbs, recompute, ep) -> tuple[dict[str, float], float]:
        s = self.shape
        if not s.mtp_num_layers:
            return {}, 0.0
        kind = "moe" if s.is_moe else "dense"
        layer = self.layer_cost(kind, tp, cp, sp, mbs, recompute, ep)
        out_parts, out_b = self.output_cost(tp, cp, sp, mbs)
        tokens = mbs * self.seq_length / cp
        proj = 3 * tokens * 4 * self.h * self.h / tp / (self.gemm_peak * self.gemm_efficiency(self.h / tp, tokens))
        per_layer = add_parts(layer.parts_s, out_parts, {"compute": proj})
        return scale_parts(per_layer, s.mtp_num_layers), s.mtp_num_layers * (layer.stored_bytes + out_b)

    # ---------- weights ----------
    def weight_bytes_per_param(self, shard: int) -> tuple[float, float, float]:
        """(weights, grads, optimizer) bytes per parameter held by a GPU, optimizer sharded `shard` ways; eval
        (generation only) holds bf16 weights alone."""
        weights = 2.0 + (1.0 if self.precision == "fp8" and not self.runtime.fp8_param_gather else 0.0)
        if self.mode == "eval":
            return weights, 0.0, 0.0
        opt = ADAM_BYTES_PER_PARAM / shard if self.runtime.distributed_optimizer else ADAM_BYTES_PER_PARAM
        return weights, float(self.runtime.main_grad_bytes), opt

    # ---------- GRPO extras ----------
    def grpo_sizes(self) -> tuple[int, int, int, int]:
        """(rollout sequences, prompt length, response length, concurrency or 0) for the RL modes."""
        g = self.grpo or GrpoSizing()
        rollouts = g.rollout_batch_size or self.global_batch_size
        prompt = g.max_prompt_length if g.max_prompt_length is not None else self.seq_length // 4
        response = g.max_response_length if g.max_response_length is not None else self.seq_length - prompt
        return rollouts, prompt, response, g.generation_concurrency or 0


def kv_cache_elements_per_token_per_layer(shape: ModelShape, tp: int) -> int:
    """Elements the paged engine's blocks hold per token and per layer on one TP rank
    (megatron_rl/generation/paged.py ``LayerCache``).

    Dense/GQA: K and V of ``max(1, groups / tp)`` groups of ``kv_channels``. MLA: the latent
    (``kv_lora_rank + qk_rope_head_dim``), the same on every TP rank (generation/paged_mla.py says why): 576
    elements for DeepSeek-V3, where the expanded K and V at TP8 would be 16 x (192 + 128) = 5120.
    Checked against the engine: tests/test_kv_cache_count.py.
    """
    if shape.is_mla:
        return shape.kv_lora_rank + shape.qk_rope_head_dim
    return 2 * max(1, shape.num_query_groups // tp) * shape.kv_channels


def add_parts(*parts: dict[str, float]) -> dict[str, float]:
    """Sum of time breakdowns, key by key."""
    out: dict[str, float] = {}
    for part in parts:
        for key, seconds in part.items():
            out[key] = out.get(key, 0.0) + seconds
    return out


def scale_parts(parts: dict[str, float], factor: float) -> dict[str, float]:
    """A time breakdown times ``factor`` (layers, micro-batches)."""
    return {key: seconds * factor for key, seconds in parts.items()}


def gib(x: float) -> float:
    """Bytes to GiB."""
    return x / GIB
