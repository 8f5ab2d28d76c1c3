"""The job config schema: one kw_only dataclass per section.

YAML files and ``key=value`` overrides are merged onto ``OmegaConf.structured(JobConfig)``, so an unknown or
misspelt key fails at load time. Checks that involve one section live in that section's ``__post_init__``;
checks that need the model shape or the world size live in ``megatron_rl.spec.config.validate``. The
``algorithm:`` section is in ``algorithm.py``, the choices and one-line checks the sections share in
``fields.py``.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Optional, Union

from megatron_rl.spec.config.algorithm import AlgorithmConfig
from megatron_rl.spec.config.fields import (  # noqa: F401 (ALGORITHMS and DPO_LOSSES re-exported)
    ALGORITHMS, ATTENTION_KERNELS, BACKENDS, DPO_LOSSES, DTYPES, ENV_NAME, EXECUTORS, GRAD_DTYPES, MAX_LENGTH,
    MAX_WORLD_SIZE, MOE_LOAD_BALANCING, RECOMPUTE_MODES, TRUNCATION_POLICIES, WANDB_MODES, _at_most, _non_negative,
    _one_of, _positive)
from megatron_rl.spec.environments import check_environment
from megatron_rl.spec.errors import ConfigError
from megatron_rl.spec.parallel import interleave_error, layout_vpp, pipeline_layout_error, sequence_parallel_error

LORA_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "experts.linear_fc1", "experts.linear_fc2",
                "shared_experts.linear_fc1", "shared_experts.linear_fc2", "linear_q_proj", "linear_q_down_proj",
                "linear_q_up_proj", "linear_kv_down_proj", "linear_kv_up_proj")
"""Adaptable Megatron linears; the order fixes each target's seed (models/lora.py:adapter_seed): append only."""
LORA_DEFAULT_TARGETS = LORA_TARGETS[:4]
"""model.lora.targets when none are given: the dense layers' attention and MLP linears (MoE experts are named)."""
LORA_MODULES_TO_SAVE = ("embedding", "output_layer", "final_layernorm")


@dataclass(kw_only=True)
class LoraConfig:
    """Low-rank adapters on the decoder's linear layers (megatron_rl/models/lora.py); the base stays frozen."""

    rank: int = 8
    """Rank r of each adapter: A is [r, in], B is [out, r]."""
    alpha: float = 16.0
    """Scale numerator: the adapter adds (x A^T B^T) * alpha / rank."""
    dropout: float = 0.0
    """Dropout on the adapter's input, in [0, 1)."""
    targets: list[str] = field(default_factory=lambda: list(LORA_DEFAULT_TARGETS))
    """Megatron module names to adapt, a subset of linear_qkv, linear_proj, linear_fc1, linear_fc2 (the dense
    layers' attention and MLP), experts.linear_fc1/fc2 (an MoE layer's routed experts, every one, sequential or
    grouped: runtime.moe_grouped_gemm), shared_experts.linear_fc1/fc2 and multi-latent attention's
    linear_q_proj (without q-LoRA), linear_q_down_proj, linear_q_up_proj, linear_kv_down_proj, linear_kv_up_proj
    (its output projection is linear_proj; linear_qkv names nothing there). Default: the first four."""
    modules_to_save: list[str] = field(default_factory=list)
    """Base modules trained in full beside the adapters (PEFT's modules_to_save), a subset of embedding (word
    embeddings), output_layer, final_layernorm; with tied embeddings either trains the shared weight. The KL
    reference keeps their original weights. []: the base stays frozen."""

    def __post_init__(self) -> None:
        _positive("model.lora", rank=self.rank, alpha=self.alpha)
        if not 0 <= self.dropout < 1:
            raise ConfigError(f"model.lora.dropout={self.dropout} must be in [0, 1); e.g. 0.05")
        unknown = [t for t in self.targets if t not in LORA_TARGETS]
        if unknown or not self.targets:
            raise ConfigError(f"model.lora.targets={list(self.targets)}: {', '.join(map(repr, unknown)) or 'empty'}"
                              f" is not valid; use names from: {', '.join(LORA_TARGETS)}")
        unknown = [m for m in self.modules_to_save if m not in LORA_MODULES_TO_SAVE]
        if unknown:
            raise ConfigError(f"model.lora.modules_to_save={list(self.modules_to_save)}: "
                              f"{', '.join(map(repr, unknown))} is not valid; use names from: "
                              f"{', '.join(LORA_MODULES_TO_SAVE)}")


@dataclass(kw_only=True)
class ModelConfig:
    name: str = "tiny-cpu"
    """Model shape: a preset under configs/models/, an HF config.json (or its folder), or a Megatron-style YAML."""
    dtype: str = "auto"
    """Parameter/compute dtype: auto (bf16 on GPUs, fp32 on CPU), fp32, bf16 or fp16."""
    seq_length: Optional[int] = None
    """Training sequence length; None takes the shape's own seq_length."""
    tokenizer: Optional[str] = None
    """A local Hugging Face tokenizer folder; None uses the built-in character tokenizer (tiny CPU tasks), as
    builtin:char-ascii does; builtin:char-arabic is its Arabic-script twin (the Arabic synthetic tasks)."""
    trust_remote_code: bool = False
    """Let model.tokenizer run Python code shipped in its folder (tokenizer_config.json `auto_map`, e.g.
    Kimi-K2's tiktoken tokenizer). false (default) refuses such a folder with an error naming this key. Only
    local files are ever read (never the hub), but that code runs in every training process: trust the folder."""
    init_from: Optional[str] = None
    """Weights to start from: one of our checkpoints (a folder with a `latest` pointer or a step folder)."""
    moe_load_balancing: str = "none"
    """MoE router load-balancing loss: none, aux_loss (per micro-batch) or seq_aux_loss (per sequence)."""
    moe_aux_loss_coeff: float = 0.0
    """Coefficient of that loss (e.g. 1e-3); 0 switches it off."""
    moe_expert_bias_update: bool = False
    """Aux-loss-free balancing (DeepSeek-V3 e_score_correction_bias, Megatron router.expert_bias): false (default)
    keeps the imported per-expert routing bias frozen during RL; true updates it after every step by
    +-1e-3 toward balanced expert loads, as in DeepSeek-V3 pre-training. Models without the bias ignore it."""
    lora: Optional[LoraConfig] = None
    """Train low-rank adapters {rank, alpha, dropout, targets} on a frozen base instead of every weight; null:
    full training."""

    def __post_init__(self) -> None:
        _one_of("model", "dtype", self.dtype, DTYPES)
        _one_of("model", "moe_load_balancing", self.moe_load_balancing, MOE_LOAD_BALANCING)
        _non_negative("model", moe_aux_loss_coeff=self.moe_aux_loss_coeff)
        _positive("model", seq_length=self.seq_length)
        _at_most("model", MAX_LENGTH, seq_length=self.seq_length)
        if not self.name.strip():
            raise ConfigError("model.name is empty; give a preset (e.g. tiny-cpu) or a path to config.json")


@dataclass(kw_only=True)
class ParallelConfig:
    auto: bool = False
    """Let the planner pick tp/pp/vpp/cp/ep/micro_batch_size/recompute and the pipeline split; the keys below that
    the config file or the command line sets are kept as constraints."""
    tp: int = 1
    """Tensor-parallel size (kept inside a node)."""
    pp: int = 1
    """Pipeline-parallel size."""
    vpp: Optional[int] = None
    """Virtual pipeline stages per rank (interleaved 1F1B); None or 1 for plain 1F1B."""
    cp: int = 1
    """Context-parallel size."""
    ep: int = 1
    """Expert-parallel size (MoE models only)."""
    etp: Optional[int] = None
    """Expert tensor-parallel size: 1 or tp; None takes 1 when ep > 1, else tp."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism (needs tp > 1)."""
    first_stage_layers: Optional[int] = None
    """Decoder layers on the first pipeline stage (uneven split). None: an even split, or one the launcher
    chooses when pp (x vpp) does not divide the layers (5 layers on pp=2 -> 3 + 2)."""
    last_stage_layers: Optional[int] = None
    """Decoder layers on the last pipeline stage (uneven split); None as for first_stage_layers."""
    account_for_embedding: bool = False
    """Even split only: count the embedding as one layer (the first stage gets one decoder layer fewer)."""
    account_for_loss: bool = False
    """Even split only: count the output layer and loss as one layer (the last stage gets one fewer)."""
    pipeline_layout: Optional[str] = None
    """Any pipeline split, as the layers of every virtual stage in Megatron's syntax
    (``pipeline_model_parallel_layout``): stages separated by '|', E the embedding, t a decoder layer, m an MTP
    layer (accepted, not built), L the loss; x*n and (...)*n repeat. NVIDIA's DeepSeek-V3 at pp=8:
    'Et*3|(tt|)*29,m|L' (32 stages: vpp 4). vpp null takes stages / pp. Not with the four keys above."""
    micro_batch_size: int = 32
    """Sequences per micro-batch."""
    micro_batch_tokens: Optional[int] = None
    """GRPO and PPO: pack the training and log-prob forwards' rows (the critic's too) into micro-batches of at most this many tokens, each
    row attending only to itself (sequence packing: no padding to the longest row; megatron_rl/rollout/packing.py),
    instead of micro_batch_size rows padded to the longest. A row longer than this gets a micro-batch of its
    own. null: padded micro-batches."""
    recompute: str = "none"
    """Activation recompute: none, selective (attention core) or full."""
    recompute_num_layers: Optional[int] = None
    """With recompute=full: recompute only the first N decoder layers of each (virtual) pipeline stage and keep
    the others' activations (Megatron's recompute_method=block); None recomputes every layer."""
    distributed_optimizer: bool = True
    """Shard optimizer state over data-parallel ranks (Megatron's distributed optimizer)."""
    rollout_tp: Optional[int] = None
    """With cluster.rollout_tasks > 0: the tensor-parallel size of each rollout replica; None: parallel.tp. Another
    size than the training's reshards every weight version through a distributed checkpoint
    (algorithm.weight_sync=files only)."""
    rollout_pp: Optional[int] = None
    """With cluster.rollout_tasks > 0: the pipeline-parallel size of each rollout replica; None: parallel.pp
    (resharded as rollout_tp is)."""
    backend: str = "auto"
    """torch.distributed backend: auto (nccl on GPUs, gloo on CPU), nccl or gloo."""
    timeout_s: int = 1800
    """Process-group timeout in seconds: how long a rank waits in a collective for the others (rank 0's
    checkpoint publish, a slow node) before the job fails."""

    def __post_init__(self) -> None:
        _positive("parallel", tp=self.tp, pp=self.pp, vpp=self.vpp, cp=self.cp, ep=self.ep, etp=self.etp,
                  micro_batch_size=self.micro_batch_size, micro_batch_tokens=self.micro_batch_tokens,
                  first_stage_layers=self.first_stage_layers,
                  last_stage_layers=self.last_stage_layers, timeout_s=self.timeout_s,
                  recompute_num_layers=self.recompute_num_layers, rollout_tp=self.rollout_tp,
                  rollout_pp=self.rollout_pp)
        _one_of("parallel", "recompute", self.recompute, RECOMPUTE_MODES)
        if self.recompute_num_layers is not None and self.recompute != "full":
            raise ConfigError(f"parallel.recompute_num_layers={self.recompute_num_layers} needs parallel.recompute="
                              f"full (it is {self.recompute}); set recompute=full or recompute_num_layers=null")
        _one_of("parallel", "backend", self.backend, BACKENDS)
        other_split = (self.first_stage_layers is not None or self.last_stage_layers is not None
                       or self.account_for_embedding or self.account_for_loss)
        why = pipeline_layout_error(self.pipeline_layout, pp=1, vpp=layout_vpp(self.pipeline_layout, 1),
                                    other_split=other_split)
        if why is not None:
            raise ConfigError(why)
        if self.auto:
            return  # the planner picks the tp and pp these need; ParallelDims checks the layout it resolves
        vpp = self.vpp or layout_vpp(self.pipeline_layout, self.pp)
        why = (sequence_parallel_error(self.tp, self.sequence_parallel) or interleave_error(self.pp, vpp)
               or pipeline_layout_error(self.pipeline_layout, pp=self.pp, vpp=vpp))
        if why is not None:
            raise ConfigError(why)


@dataclass(kw_only=True)
class EvalConfig:
    """algorithm.name=eval (``launch.py eval --ckpt CKPT``): held-out generation, scored by algorithm.rewards."""

    samples: int = 8
    """Completions sampled per held-out prompt (n); pass@k is reported for k = samples, with pass@1."""
    stage: Optional[str] = None
    """This checkpoint's key in <run.dir>/eval.json (e.g. sft, grpo); None: run.name."""
    max_prompts: Optional[int] = None
    """Evaluate only the first N held-out prompts; None: all of them."""
    min_pass_at_1: Optional[float] = None
    """Gate: below this pass@1 the result is marked discarded and the job exits 3 (a pipeline stops there)."""

    def __post_init__(self) -> None:
        _positive("eval", samples=self.samples, max_prompts=self.max_prompts)
        if self.min_pass_at_1 is not None and not 0.0 <= self.min_pass_at_1 <= 1.0:
            raise ConfigError(f"eval.min_pass_at_1={self.min_pass_at_1} must be in [0, 1]; e.g. 0.5, or null")
        if self.stage is not None and not re.fullmatch(r"[A-Za-z0-9_.-]+", self.stage):
            raise ConfigError(f"eval.stage={self.stage!r}: use letters, digits, '_', '.' and '-' only")


@dataclass(kw_only=True)
class RuntimeConfig:
    """Kernels and overlaps the job runs with. ``launch.py plan`` plans with the same ones (``plan_job``)."""

    transformer_engine: Union[bool, str] = "auto"
    """Transformer Engine layers: true (the job stops when TE does not import on a GPU), false (Megatron's local
    torch layers even where TE is installed) or auto (TE whenever it imports and a GPU is present). The planner
    takes auto as TE on GPU jobs (cluster.gpus_per_node > 0) and none on CPU jobs."""
    moe_grouped_gemm: Union[bool, str] = "auto"
    """An MoE layer's routed experts as grouped linears, one module per linear holding every local expert
    (Megatron's TEGroupedMLP: Transformer Engine's grouped GEMM; without TE, one torch linear per expert in that
    module, megatron_rl/models/grouped_linear.py), or as one MLP per expert (SequentialMLP): true, false, or auto
    (grouped where TE runs). Checkpoints move between the two."""
    attention: str = "auto"
    """Core attention kernel: flash (TE's fused attention; without TE, torch's scaled_dot_product_attention:
    neither keeps the s x s scores), unfused (softmax(QK^T)V with the scores kept for backward: Megatron's
    DotProductAttention, or TE's unfused backend) or auto (flash)."""
    tp_comm_overlap: bool = False
    """Overlap tensor-parallel collectives with the GEMMs (TE userbuffers, Megatron's --tp-comm-overlap); needs
    TE on GPUs and parallel.sequence_parallel."""
    overlap_grad_reduce: bool = True
    """Reduce the data-parallel gradients bucket by bucket during the last micro-batch's backward pass (Megatron
    DDP's overlap_grad_reduce) instead of all after it."""
    grad_bucket_size: Optional[int] = None
    """Elements per data-parallel gradient bucket (Megatron DDP's bucket_size): smaller buckets start their
    reduction earlier in the backward pass, larger ones move more per message. None: Megatron's max(40M, 1M x DP)
    with overlap_grad_reduce, one bucket without it."""
    grad_dtype: str = "fp32"
    """Main gradients and their data-parallel reduction: fp32, or bf16 (half the gradient memory and traffic;
    needs bf16 parameters)."""

    def __post_init__(self) -> None:
        if isinstance(self.transformer_engine, str) and self.transformer_engine != "auto":
            raise ConfigError(f"runtime.transformer_engine={self.transformer_engine!r} is not valid; use true, false "
                              "or auto")
        if isinstance(self.moe_grouped_gemm, str) and self.moe_grouped_gemm != "auto":
            raise ConfigError(f"runtime.moe_grouped_gemm={self.moe_grouped_gemm!r} is not valid; use true, false or "
                              "auto")
        _one_of("runtime", "attention", self.attention, ATTENTION_KERNELS)
        _one_of("runtime", "grad_dtype", self.grad_dtype, GRAD_DTYPES)
        if self.grad_bucket_size is not None and self.grad_bucket_size < 1:
            raise ConfigError(f"runtime.grad_bucket_size={self.grad_bucket_size} must be positive (or null for "
                              "Megatron's default)")

    def uses_transformer_engine(self, *, gpus: bool) -> bool:
        """Whether a job on GPUs (or not) runs TE layers, as planned: auto counts on TE wherever there are GPUs."""
        return gpus if self.transformer_engine == "auto" else bool(self.transformer_engine)

    @property
    def attention_kernel(self) -> str:
        """flash or unfused: auto resolved."""
        return attention_kernel(self.attention)


def attention_kernel(setting: str) -> str:
    """runtime.attention resolved: auto is flash, with Transformer Engine (its fused kernels) or without (torch's
    scaled_dot_product_attention)."""
    return "flash" if setting == "auto" else setting


@dataclass(kw_only=True)
class ClusterConfig:
    executor: str = "local"
    """Where the job runs: local (processes on this machine), slurm, or auto (slurm when `sbatch` is on PATH,
    else local). The built-in default job is local; cluster configs set slurm or auto."""
    nodes: int = 1
    """Number of nodes (local runs use 1)."""
    tasks_per_node: int = 2
    """Processes per node; on GPU nodes, one per GPU."""
    rollout_tasks: int = 0
    """Processes (of nodes x tasks_per_node, the last ones) that only generate GRPO rollouts with a copy of the
    policy, while the others train; 0 (default): generation is colocated in the training processes."""
    gpus_per_node: int = 0
    """GPUs per node to request (0 on CPU-only nodes)."""
    gpu_type: str = "h100-80gb"
    """GPU model for planning (see `python launch.py plan --help`)."""
    cpus_per_task: Optional[int] = None
    """sbatch --cpus-per-task."""
    mem: Optional[str] = None
    """sbatch --mem, e.g. 0 (all) or 400G."""
    time: str = "04:00:00"
    """sbatch --time (HH:MM:SS or D-HH:MM:SS)."""
    partition: Optional[str] = None
    """sbatch --partition."""
    account: Optional[str] = None
    """sbatch --account."""
    qos: Optional[str] = None
    """sbatch --qos."""
    reservation: Optional[str] = None
    """sbatch --reservation."""
    constraint: Optional[str] = None
    """sbatch --constraint."""
    exclude: Optional[str] = None
    """sbatch --exclude (node list)."""
    job_name: str = "megatron-rl"
    """sbatch --job-name."""
    sbatch_extra: list[str] = field(default_factory=list)
    """Extra sbatch flags, each one `--flag=value`."""
    setup: list[str] = field(default_factory=list)
    """Shell lines run before the job starts (module loads, env activation). Run verbatim: they are commands, and
    they are written into the job script, so they are no place for secrets: name those in cluster.env."""
    container_image: Optional[str] = None
    """pyxis/enroot image for `srun --container-image`."""
    container_mounts: list[str] = field(default_factory=list)
    """pyxis mounts, each `src:dst`."""
    signal_delay_s: int = 120
    """Seconds before the time limit (the warning window) at which Slurm signals the job to checkpoint and
    requeue; checkpoint.save_interval=auto also keeps the work a hard kill can lose to about this long."""
    max_requeues: int = 3
    """How many times the job may start again: after its own preemption checkpoint, an admin's `scontrol
    requeue`, a scheduler preemption or a node failure (each start resumes from the newest checkpoint). 0
    submits the job --no-requeue."""
    env: list[str] = field(default_factory=list)
    """Names of environment variables the job takes from the submitting shell (tokens, say): their values are
    passed in the environment (sbatch --export), never written to a file. Refer to them as ${oc.env:NAME} in
    config keys, which stay unresolved in config.yaml, or as $NAME in setup lines."""

    def __post_init__(self) -> None:
        _one_of("cluster", "executor", self.executor, EXECUTORS)
        _non_negative("cluster", rollout_tasks=self.rollout_tasks)
        if self.rollout_tasks and self.rollout_tasks >= self.nodes * self.tasks_per_node:
            raise ConfigError(f"cluster.rollout_tasks={self.rollout_tasks} leaves no training process of the "
                              f"{self.nodes * self.tasks_per_node} (cluster.nodes x cluster.tasks_per_node); give at "
                              f"most {self.nodes * self.tasks_per_node - 1}, or 0 to generate in the training processes")
        _positive("cluster", nodes=self.nodes, tasks_per_node=self.tasks_per_node, cpus_per_task=self.cpus_per_task)
        _at_most("cluster", MAX_WORLD_SIZE, nodes=self.nodes, tasks_per_node=self.tasks_per_node)
        if self.world_size > MAX_WORLD_SIZE:
            raise ConfigError(f"cluster.nodes={self.nodes} x cluster.tasks_per_node={self.tasks_per_node} is "
                              f"{self.world_size:,} processes; give at most {MAX_WORLD_SIZE:,} in all")
        _non_negative("cluster", gpus_per_node=self.gpus_per_node, signal_delay_s=self.signal_delay_s,
                      max_requeues=self.max_requeues)
        if self.gpus_per_node and self.tasks_per_node != self.gpus_per_node:
            raise ConfigError(
                f"cluster.tasks_per_node={self.tasks_per_node} differs from cluster.gpus_per_node="
                f"{self.gpus_per_node}; run one task per GPU (set both to the same value)")
        for name in self.env:
            if not ENV_NAME.match(name):
                raise ConfigError(f"cluster.env entry {name!r} is not an environment variable name; give names "
                                  "such as WANDB_API_KEY (letters, digits and _), not NAME=value")
        for flag in self.sbatch_extra:
            if not flag.startswith("--"):
                raise ConfigError(f"cluster.sbatch_extra entry {flag!r} must look like --flag=value")

    @property
    def world_size(self) -> int:
        return self.nodes * self.tasks_per_node

    @property
    def training_tasks(self) -> int:
        """Processes that train: all but the rollout_tasks (the training layout, parallel.*, is over these)."""
        return self.world_size - self.rollout_tasks

    @property
    def has_gpus(self) -> bool:
        """A GPU job (gpus_per_node > 0); CPU jobs request none."""
        return self.gpus_per_node > 0


@dataclass(kw_only=True)
class GenerationConfig:
    max_new_tokens: int = 4
    """Most tokens generated per completion."""
    temperature: float = 1.0
    """Sampling temperature; 0 means greedy."""
    top_p: float = 1.0
    """Nucleus sampling mass (1.0 = off)."""
    top_k: int = 0
    """Top-k sampling (0 = off)."""
    stop: list[str] = field(default_factory=list)
    """Stop strings, in addition to the tokenizer's end-of-sequence token."""
    offload_optimizer: bool = False
    """Move optimizer state and grads to host memory while generating (frees GPU memory for the KV cache; on
    CPU it runs the same code for nothing)."""
    mean_new_tokens: Optional[int] = None
    """The mean response length you expect (tokens), a planning input: the planner sizes the KV memory and the
    step time with it (``launch.py plan --mean-response-len`` overrides it). Generation does not read it. null:
    half of max_new_tokens."""
    max_concurrent: Optional[int] = None
    """Most completions a rollout worker decodes at once (an optional cap; the KV memory is the limit); null: no
    cap."""
    kv_memory_gib: Optional[float] = None
    """KV-cache memory per GPU for the paged engine's block pool (GiB; every pipeline stage holds as many blocks as
    the one with the most layers gets from this). Completions are admitted as blocks free up; one that cannot grow
    is evicted and prefilled again later, never cut. null: on GPU jobs the planner picks it (what the layout's
    memory leaves while generating, up to what the rollout needs) and launch.py writes it here; on CPU jobs,
    enough blocks for every completion at its longest."""
    kv_block_tokens: int = 256
    """Tokens per KV block. flash-attn's paged kernels need a multiple of 256 on GPUs; CPU runs may use less."""
    cuda_graphs: bool = False
    """Replay decode-only engine steps (every row feeding one token) from CUDA graphs, one per row-count bucket,
    captured in each rollout's first steps of that size (megatron_rl/generation/graphs.py): the long tail of a
    rollout, a few rows decoding, stops paying the kernels' launch time. Dense models decoding at one pipeline
    stage only. Off until a GPU has validated it; on CPU jobs the same bucketed steps run without capture."""

    def __post_init__(self) -> None:
        _positive("generation", max_new_tokens=self.max_new_tokens)
        if self.max_concurrent is not None:
            _positive("generation", max_concurrent=self.max_concurrent)
        if self.kv_memory_gib is not None:
            _positive("generation", kv_memory_gib=self.kv_memory_gib)
        if self.mean_new_tokens is not None and not 1 <= self.mean_new_tokens <= self.max_new_tokens:
            raise ConfigError(f"generation.mean_new_tokens={self.mean_new_tokens} must be from 1 to "
                              f"generation.max_new_tokens={self.max_new_tokens}")
        _positive("generation", kv_block_tokens=self.kv_block_tokens)
        _non_negative("generation", temperature=self.temperature, top_k=self.top_k)
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"generation.top_p={self.top_p} must be in (0, 1]")


@dataclass(kw_only=True)
class EnvironmentConfig:
    """Multi-turn rollouts (GRPO): each completion is an episode with an environment, which answers the policy's
    turns (a tool's result, the user's next message) and gives the reward (megatron_rl/environments). The
    policy's tokens are trained; the environment's are context."""

    name: Optional[str] = None
    """A built-in environment (calculator, python_math) or a dotted path "package.module:Class" on PYTHONPATH on
    every node; null: single-turn completions."""
    options: dict = field(default_factory=dict)
    """The environment's keyword options (a built-in's are checked at launch, others' when the job builds it)."""
    max_turns: int = 4
    """Policy turns per episode."""
    max_turn_tokens: int = 64
    """Tokens the policy may generate in one turn; a turn cut there ends the episode."""
    max_episode_tokens: int = 512
    """Tokens of a whole conversation (prompt, turns and replies); it ends the episode there."""
    step_timeout_s: float = 30.0
    """Seconds one environment step may take; a slower one ends its episode (its tools have their own limits)."""
    mean_reply_tokens: int = 0
    """Tokens of the environment's replies in a mean episode (tool outputs, the user's next messages), for the
    planner: the rows hold them in the KV pool, the engine prefills them between turns, and the training forwards
    run over them (out of the loss). 0: only the policy's tokens are counted. The episode's policy tokens are
    generation.max_new_tokens at most and generation.mean_new_tokens on average, as for single turns."""
    concurrent_steps: int = 8
    """Environment steps a rollout worker runs at once, in threads, while its other rows go on decoding (at tp or
    pp > 1 in the threads of its first rank, its ranks agreeing at each engine step which replies came). Each
    episode's steps stay in order; a row waits for its reply holding its KV blocks, and its tokens do not depend on
    when the reply comes. 0: each step runs between engine steps, the others waiting."""
    reply_steps: int = 4
    """Engine steps after a turn ends at which the environment's reply (made in a thread, concurrent_steps > 0)
    joins its row; the engine waits for it there if it is not ready. So the step a reply joins, and with it every
    step's batch and the log-probs computed in it, depend on nothing but the run: runs repeat bit for bit. Raise
    it for environments slower than that many decode steps; 0 takes each reply at the first step it is ready (no
    wait, but the log-probs' last digits then depend on thread timing, and a run does not repeat exactly)."""
    mean_step_s: float = 0.0
    """Seconds one environment step takes on average (a tool's run, a judge's call), for the planner: a rollout
    worker makes its episodes' steps concurrent_steps at a time (one for 0), and the planner adds them to the
    rollout's time (up to max_turns per episode)."""

    def __post_init__(self) -> None:
        _positive("environment", max_turns=self.max_turns, max_turn_tokens=self.max_turn_tokens,
                  max_episode_tokens=self.max_episode_tokens, step_timeout_s=self.step_timeout_s)
        _non_negative("environment", mean_reply_tokens=self.mean_reply_tokens, mean_step_s=self.mean_step_s,
                      concurrent_steps=self.concurrent_steps, reply_steps=self.reply_steps)
        if self.mean_reply_tokens >= self.max_episode_tokens:
            raise ConfigError(f"environment.mean_reply_tokens={self.mean_reply_tokens} must be below "
                              f"environment.max_episode_tokens={self.max_episode_tokens}")
        if self.max_turn_tokens >= self.max_episode_tokens:
            raise ConfigError(f"environment.max_turn_tokens={self.max_turn_tokens} must be below "
                              f"environment.max_episode_tokens={self.max_episode_tokens}")
        if self.name is not None:
            check_environment(self.name, self.options)
        elif self.options:
            raise ConfigError("environment.options are given but environment.name is null; name the environment")


@dataclass(kw_only=True)
class OptimizerConfig:
    lr: float = 2e-3
    """Peak learning rate."""
    min_lr: float = 0.0
    """Learning rate at the end of the decay."""
    lr_warmup_steps: int = 0
    """Linear warm-up steps."""
    lr_decay_style: str = "constant"
    """constant, linear or cosine."""
    weight_decay: float = 0.0
    """Decoupled weight decay (AdamW)."""
    adam_beta1: float = 0.9
    """Adam beta1."""
    adam_beta2: float = 0.999
    """Adam beta2."""
    adam_eps: float = 1e-8
    """Adam epsilon."""
    clip_grad: float = 1.0
    """Global gradient-norm clip (0 disables)."""

    def __post_init__(self) -> None:
        _positive("optimizer", lr=self.lr, adam_eps=self.adam_eps)
        _non_negative("optimizer", min_lr=self.min_lr, lr_warmup_steps=self.lr_warmup_steps,
                      weight_decay=self.weight_decay, clip_grad=self.clip_grad)
        _one_of("optimizer", "lr_decay_style", self.lr_decay_style, ("constant", "linear", "cosine"))
        if self.min_lr > self.lr:
            raise ConfigError(f"optimizer.min_lr={self.min_lr} is above optimizer.lr={self.lr}")


@dataclass(kw_only=True)
class DataConfig:
    task: Optional[str] = "last_digit"
    """Built-in synthetic task used when train_path is null."""
    train_path: Optional[str] = None
    """Training data (GRPO prompts, RM preference pairs, SFT examples): a .jsonl, .json, .parquet or .arrow file,
    or a datasets.save_to_disk folder (read with Hugging Face datasets, offline)."""
    eval_path: Optional[str] = None
    """Held-out data, in the same formats."""
    prompt_key: str = "prompt"
    """Field (column) with the prompt text."""
    answer_key: str = "answer"
    """Field with the reference answer or metadata for reward functions (SFT: the completion when a record has no
    completion field)."""
    messages_key: str = "messages"
    """Field with a chat, a list of {role, content} messages, used when a record has no prompt_key field: the
    prompt for GRPO, the prompt of a preference pair, and for SFT the conversation whose last (assistant)
    message is the completion."""
    chat_template: bool = False
    """Render prompts and conversations with the tokenizer's chat template (prompts with the generation prompt);
    needs a model.tokenizer that has one. False: text as is, messages as "role: content" lines."""
    system_prompt: Optional[str] = None
    """System message put before each conversation that has none (needs chat_template=true)."""
    max_length: Optional[int] = None
    """Longest tokenized example; None uses the model's seq_length."""
    truncation: str = "truncate"
    """Examples over max_length: truncate or drop (both are counted)."""
    eval_interval: int = 0
    """Evaluate every N steps (0 = never)."""
    warmup_task: Optional[str] = "first_digit"
    """SFT warm-up data for GRPO: correct answers of this synthetic task, teaching the answer format and to read
    the prompt; null uses data.task's prompts with random well-formed answers (format only)."""

    def __post_init__(self) -> None:
        _one_of("data", "truncation", self.truncation, TRUNCATION_POLICIES)
        _positive("data", max_length=self.max_length)
        _non_negative("data", eval_interval=self.eval_interval)
        if self.system_prompt is not None and not self.chat_template:
            raise ConfigError("data.system_prompt is set but data.chat_template=false; set data.chat_template=true "
                              "(the system prompt is a message of the chat template) or drop data.system_prompt")


@dataclass(kw_only=True)
class CheckpointConfig:
    dir: Optional[str] = None
    """Checkpoint folder; None means <run.dir>/checkpoints."""
    save_interval: Union[int, str] = "auto"
    """Save every N steps; 0: only at the end and on preemption; auto: whenever max(cluster.signal_delay_s, 10 x
    the last save's duration) seconds have passed since the previous save, so a hard kill (node failure, a kill
    inside the warning window) loses about one warning window of work and saving takes at most ~10% of the time.
    The trainer warns when one step plus a save does not fit in the warning window."""
    keep_last: int = 2
    """Complete checkpoints kept; older ones are deleted."""
    resume: bool = True
    """Resume from the newest complete checkpoint in dir when there is one."""
    save_at_end: bool = True
    """Save when training finishes."""
    export_hf: bool = False
    """Export the final checkpoint to Hugging Face format under <run.dir>/hf."""
    export_hf_every: int = 0
    """Also export every N saves (0 = final only)."""
    hash: bool = True
    """Hash each checkpoint for the run's manifest: every rank hashes the files it wrote, in the background, never
    inside a collective (megatron_rl/runtime/manifest.py). false: checkpoints are recorded unhashed."""
    hash_wait_s: int = 600
    """How long the end of a process waits for the pending hashes; the manifest records what was not hashed."""

    def __post_init__(self) -> None:
        _positive("checkpoint", keep_last=self.keep_last)
        _non_negative("checkpoint", hash_wait_s=self.hash_wait_s)
        if isinstance(self.save_interval, str) and self.save_interval != "auto":
            raise ConfigError(f"checkpoint.save_interval={self.save_interval!r} is not valid; use auto or a number "
                              "of steps (0: only at the end and on preemption)")
        _non_negative("checkpoint", save_interval=None if self.save_interval == "auto" else self.save_interval,
                      export_hf_every=self.export_hf_every)


@dataclass(kw_only=True)
class WandbConfig:
    """Weights & Biases logging from global rank 0. The API key comes only from WANDB_API_KEY in the job's
    environment: no config key holds it, so it is never written to a file."""

    project: Optional[str] = None
    """W&B project (null: WANDB_PROJECT, else W&B's default)."""
    entity: Optional[str] = None
    """W&B team or user (null: WANDB_ENTITY, else the key's default entity)."""
    mode: str = "online"
    """online, offline (files under the run folder, `wandb sync` later) or disabled."""

    def __post_init__(self) -> None:
        _one_of("logging.wandb", "mode", self.mode, WANDB_MODES)


@dataclass(kw_only=True)
class LoggingConfig:
    log_interval: int = 1
    """Console progress every N steps (metrics.jsonl gets every step)."""
    console: str = "progress"
    """Console style: progress (one updating line per step), json, or quiet."""
    tensorboard: bool = True
    """Also write TensorBoard scalars under <run.dir>/tensorboard/<phase> (needs tensorboard:
    pip install 'megatron-rl[logging]')."""
    wandb: Optional[WandbConfig] = None
    """Weights & Biases logging, off when null; e.g. logging.wandb.project=NAME. A requeued or resumed job
    continues the same W&B run (its id is kept in <run.dir>/wandb_run_id)."""
    plot: bool = False
    """Write <run.dir>/curves.png (reward and KL against step) at the end."""
    sample_every: int = 10
    """GRPO and PPO: every N steps, write ``samples`` of the step's completions to <run.dir>/samples.jsonl (prompt,
    completion, reference answer, reward per function, advantage, length, truncation), and a W&B table when W&B
    is on; ``launch.py logs RUN --samples`` prints the latest. 0: off."""
    samples: int = 4
    """Completions written each ``sample_every`` steps, spread over the step's prompts."""

    def __post_init__(self) -> None:
        _positive("logging", log_interval=self.log_interval, samples=self.samples)
        _non_negative("logging", sample_every=self.sample_every)
        _one_of("logging", "console", self.console, ("progress", "json", "quiet"))


@dataclass(kw_only=True)
class RunConfig:
    dir: str = "runs/default"
    """Output folder of the run: resolved config, logs, metrics.jsonl, checkpoints."""
    name: str = "default"
    """Run name shown in logs."""
    seed: int = 1234
    """Seed for weights, data order and sampling."""
    steps: int = 300
    """Training steps (optimizer steps; GRPO: rollout batches)."""

    def __post_init__(self) -> None:
        _positive("run", steps=self.steps)
        if not self.dir.strip():
            raise ConfigError("run.dir is empty; give an output folder")


@dataclass(kw_only=True)
class JobConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    environment: EnvironmentConfig = field(default_factory=EnvironmentConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    run: RunConfig = field(default_factory=RunConfig)

    @property
    def checkpoint_dir(self) -> str:
        """Where the trainers save: checkpoint.dir, or <run.dir>/checkpoints."""
        return self.checkpoint.dir or os.path.join(self.run.dir, "checkpoints")

    def __post_init__(self) -> None:
        if self.cluster.executor == "local" and self.cluster.nodes != 1:
            raise ConfigError(
                f"cluster.nodes={self.cluster.nodes} with cluster.executor=local; local runs use one node "
                "(set cluster.nodes=1 or cluster.executor=slurm)")
        self._check_runtime()
        self._check_rollout_placement()
        self._check_environment()
        overlong = self.algorithm.overlong
        if overlong is not None and overlong.buffer > self.generation.max_new_tokens:
            raise ConfigError(f"algorithm.overlong.buffer={overlong.buffer} exceeds generation.max_new_tokens="
                              f"{self.generation.max_new_tokens}; the penalty window must lie inside the limit")

    def _check_rollout_placement(self) -> None:
        algo, rollout_tasks = self.algorithm, self.cluster.rollout_tasks
        if not rollout_tasks and algo.max_staleness:
            raise ConfigError(f"algorithm.max_staleness={algo.max_staleness} needs cluster.rollout_tasks > 0 "
                              "(colocated generation is synchronous); set algorithm.max_staleness=0 or give rollout "
                              "tasks")
        if rollout_tasks and algo.name != "grpo":
            raise ConfigError(f"cluster.rollout_tasks={rollout_tasks}: separate rollout processes run "
                              f"algorithm.name=grpo only, not {algo.name}; set cluster.rollout_tasks=0")
        if rollout_tasks and algo.router_replay:
            raise ConfigError(f"algorithm.router_replay=true with cluster.rollout_tasks={rollout_tasks}: the rollout "
                              "processes do not record the experts they route to yet; set algorithm.router_replay=false "
                              "or cluster.rollout_tasks=0")
        if algo.weight_sync == "nccl" and (not self.cluster.has_gpus or self.parallel.backend == "gloo"):
            raise ConfigError("algorithm.weight_sync=nccl needs GPUs and the nccl backend (cluster.gpus_per_node > 0, "
                              "parallel.backend auto or nccl); set algorithm.weight_sync=gloo or files")
        par = self.parallel
        if not rollout_tasks and (par.rollout_tp is not None or par.rollout_pp is not None):
            raise ConfigError("parallel.rollout_tp / rollout_pp size the rollout replicas, which need "
                              "cluster.rollout_tasks > 0; set them null or give rollout tasks")
        resharded = (par.rollout_tp or par.tp, par.rollout_pp or par.pp) != (par.tp, par.pp)
        if rollout_tasks and resharded and algo.weight_sync != "files":
            raise ConfigError(f"parallel.rollout_tp/rollout_pp = {par.rollout_tp or par.tp}/{par.rollout_pp or par.pp} "
                              f"differ from the training tp/pp = {par.tp}/{par.pp}: the weights are resharded through "
                              "a distributed checkpoint in the run folder; set algorithm.weight_sync=files")
        if not rollout_tasks and algo.off_policy_correction != "none":
            raise ConfigError(f"algorithm.off_policy_correction={algo.off_policy_correction} corrects for samples of "
                              "older weights, which only rollout tasks produce; set algorithm.off_policy_correction=none "
                              "or cluster.rollout_tasks > 0")
        if rollout_tasks and algo.drop_zero_signal_groups:
            raise ConfigError("algorithm.drop_zero_signal_groups=true draws more prompts inside a step, which split "
                              "placement does not do; set it false or cluster.rollout_tasks=0")
        if rollout_tasks and self.parallel.ep > 1:
            raise ConfigError(f"parallel.ep={self.parallel.ep} with cluster.rollout_tasks={rollout_tasks}: rollout "
                              "workers hold no expert-parallel copy yet; set cluster.rollout_tasks=0 or parallel.ep=1")

    def _check_environment(self) -> None:
        if self.environment.name is None:
            return
        if self.algorithm.name not in ("grpo", "ppo", "eval"):
            raise ConfigError(f"environment.name={self.environment.name}: multi-turn episodes run with "
                              f"algorithm.name=grpo, ppo or eval, not {self.algorithm.name}; set environment.name=null")

    def _check_runtime(self) -> None:
        rt, gpus = self.runtime, self.cluster.has_gpus
        if rt.transformer_engine is True and not gpus:
            raise ConfigError("runtime.transformer_engine=true needs GPUs, and cluster.gpus_per_node is 0; set "
                              "runtime.transformer_engine=auto or give the GPUs")
        if rt.tp_comm_overlap:
            if not rt.uses_transformer_engine(gpus=gpus):
                raise ConfigError("runtime.tp_comm_overlap=true needs Transformer Engine on GPUs; set it false")
            if not self.parallel.auto and not self.parallel.sequence_parallel:
                raise ConfigError("runtime.tp_comm_overlap=true needs parallel.sequence_parallel=true; set both")
        if rt.grad_dtype == "bf16":
            bf16 = self.model.dtype == "bf16" or (self.model.dtype == "auto" and gpus)
            if not bf16:
                raise ConfigError(f"runtime.grad_dtype=bf16 needs bf16 parameters, and model.dtype={self.model.dtype}"
                                  f"{' on CPU' if self.model.dtype == 'auto' else ''} is not; set "
                                  "runtime.grad_dtype=fp32 or model.dtype=bf16")
