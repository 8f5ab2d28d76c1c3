"""``ParallelDims``: the parallel layout of one job, built once from the config and the world size, and checked.

Pure Python (no torch), so the config checks, the planner and the job all read the same object:

    dims = ParallelDims.from_config(cfg.parallel, world_size=cfg.cluster.training_tasks,
                                    rollout_tasks=cfg.cluster.rollout_tasks)
    dims.check_model(shape)         # heads, query groups, experts and the pipeline split
    dims.dp, dims.edp               # data-parallel sizes of the dense and the expert layers

Megatron's rules (``parallel_state.initialize_model_parallel`` and ``TransformerConfig``):
- world = pp·tp·cp·dp = pp·etp·ep·edp, so the world must be divisible by pp·tp·cp and by pp·etp·ep;
- tp divides the attention heads and the query groups; ep divides the routed experts;
- sequence parallelism needs tp > 1, and MoE layers at tp > 1 need it;
- the pipeline split is even (pp·vpp divides the layers, embedding and loss optionally counted as layers) or
  uneven (``first_stage_layers`` / ``last_stage_layers``, the middle stages sharing the rest evenly); every
  stage's layers divide by vpp. When the layers do not divide evenly and no split is given, ``with_split``
  picks one (5 layers on pp=2 -> 3+2; 126 on pp=16 -> 7 + 14x8 + 7);
- or any split, given as a layout in Megatron's syntax (``pipeline_layout``, megatron_rl/spec/pipeline_layout.py:
  the layers of each virtual stage, embedding and loss placed as stages' members; vpp = stages / pp), which no
  other split key may join.

This job's rule for split placement (``cluster.rollout_tasks`` = R > 0): the world above is the training processes
(world size - R), and the R rollout processes form R / (tp·pp) replicas at the training tp x pp (cp=1, ep=1), so R
is a multiple of tp·pp and ep = 1 (``rollout_replica_error``).

Every rule is written once, below, as a function that returns its one-line reason (None: legal), naming the keys
with ``key`` ("parallel." in a config, "" in the planner's --layout, "--" for the converter's flags). The schema,
ParallelDims, the launch check (``megatron_rl.spec.config.validate.check_layout``), the planner's search, the
converter and the model builder call them; ``tests/test_layout_rules.py`` holds their verdicts against Megatron's.

Test: ``.venv/bin/python -m pytest tests/test_parallel_dims.py tests/test_planner_megatron_rules.py
tests/test_layout_rules.py -q``
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Optional

from megatron_rl.spec.errors import ConfigError
from megatron_rl.spec.pipeline_layout import LayoutSyntaxError, expand_layout, layout_error, stage_decoder_counts

SPLIT_KEYS = ("first_stage_layers", "last_stage_layers", "account_for_embedding", "account_for_loss",
              "pipeline_layout")


@dataclass(frozen=True, kw_only=True)
class ParallelDims:
    """Sizes of every parallel dimension and the pipeline split; names as in the config's ``parallel:``."""

    world_size: int
    """Processes in the job (one per GPU)."""
    tp: int = 1
    """Tensor parallel."""
    pp: int = 1
    """Pipeline parallel."""
    vpp: int = 1
    """Virtual pipeline stages per pipeline rank (1 = plain 1F1B)."""
    cp: int = 1
    """Context parallel."""
    ep: int = 1
    """Expert parallel."""
    etp: Optional[int] = None
    """Expert tensor parallel; None takes ``default_etp``."""
    sp: bool = False
    """Sequence parallelism (activations outside attention/MLP split over the TP group)."""
    first_stage_layers: Optional[int] = None
    """Decoder layers on the first pipeline stage (uneven split); None = even split."""
    last_stage_layers: Optional[int] = None
    """Decoder layers on the last pipeline stage (uneven split); None = even split."""
    account_for_embedding: bool = False
    """Count the embedding as one layer in an even split (Megatron's account_for_embedding_in_pipeline_split)."""
    account_for_loss: bool = False
    """Count the output layer and loss as one layer in an even split."""
    pipeline_layout: Optional[str] = None
    """The layers of every virtual stage in Megatron's syntax ('Et*3|(tt|)*29,m|L'); vpp must be stages / pp (the
    config's vpp: null takes it). None: the split the keys above give."""
    rollout_tasks: int = 0
    """Processes beyond world_size that only generate (cluster.rollout_tasks, split placement): world_size is then
    the training processes alone, and the rollout tasks must split into replicas of tp x pp at ep=1
    (``rollout_replica_error``)."""
    rollout_tp: Optional[int] = None
    """parallel.rollout_tp: the rollout replicas' tensor-parallel size (None: tp)."""
    rollout_pp: Optional[int] = None
    """parallel.rollout_pp: the rollout replicas' pipeline-parallel size (None: pp)."""

    def __post_init__(self) -> None:
        if self.etp is None:
            object.__setattr__(self, "etp", default_etp(tp=self.tp, ep=self.ep))
        object.__setattr__(self, "_split", tuple(getattr(self, key) for key in SPLIT_KEYS))  # a key of the planner's caches
        for key in ("world_size", "tp", "pp", "vpp", "cp", "ep", "etp"):
            value = getattr(self, key)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"parallel.{key}={value!r} must be a positive integer")
        why = (sequence_parallel_error(self.tp, self.sp) or interleave_error(self.pp, self.vpp)
               or pipeline_layout_error(self.pipeline_layout, pp=self.pp, vpp=self.vpp,
                                        other_split=self.uneven or self.account_for_embedding or self.account_for_loss))
        if why is not None:
            raise ConfigError(why)
        why = rollout_replica_error(self.rollout_tasks, self.rollout_tp or self.tp, self.rollout_pp or self.pp,
                                    self.ep)
        if why is not None:
            raise ConfigError(why)
        where = (f"the {self.world_size} training processes (cluster.nodes*cluster.tasks_per_node - "
                 f"cluster.rollout_tasks)" if self.rollout_tasks else
                 f"the world size {self.world_size} (cluster.nodes*cluster.tasks_per_node)")
        dense = self.pp * self.tp * self.cp
        if self.world_size % dense:
            raise ConfigError(f"parallel.tp*pp*cp = {self.tp}*{self.pp}*{self.cp} = {dense} does not divide {where}; "
                              "change the sizes or the number of processes")
        expert = self.pp * self.etp * self.ep
        if self.world_size % expert:
            raise ConfigError(f"parallel.pp*etp*ep = {self.pp}*{self.etp}*{self.ep} = {expert} does not divide "
                              f"{where}; change the sizes or the number of processes")

    @classmethod
    def from_config(cls, parallel: Any, *, world_size: int, rollout_tasks: int = 0) -> "ParallelDims":
        """From a ``ParallelConfig`` (the schema's ``parallel:`` section); ``world_size`` counts the training
        processes, ``rollout_tasks`` the generating ones beyond them."""
        return cls(world_size=world_size, tp=parallel.tp, pp=parallel.pp, cp=parallel.cp,
                   vpp=parallel.vpp or layout_vpp(parallel.pipeline_layout, parallel.pp),
                   ep=parallel.ep, etp=parallel.etp, sp=parallel.sequence_parallel, rollout_tasks=rollout_tasks,
                   rollout_tp=parallel.rollout_tp, rollout_pp=parallel.rollout_pp,
                   **{key: getattr(parallel, key) for key in SPLIT_KEYS})

    @property
    def dp(self) -> int:
        """Data parallel of the dense layers: world / (pp·tp·cp)."""
        return self.world_size // (self.pp * self.tp * self.cp)

    @property
    def edp(self) -> int:
        """Data parallel of the expert layers: world / (pp·etp·ep)."""
        return self.world_size // (self.pp * self.etp * self.ep)

    @property
    def model_parallel_size(self) -> int:
        """Processes holding one replica of the dense layers: pp·tp·cp."""
        return self.pp * self.tp * self.cp

    @property
    def sequence_multiple(self) -> int:
        """Training sequence lengths must be multiples of this: 2*cp under context parallelism (Megatron's
        load-balanced chunks), and each CP rank's part a multiple of tp under sequence parallelism."""
        return sequence_multiple(tp=self.tp, cp=self.cp, sp=self.sp)

    @property
    def uneven(self) -> bool:
        return self.first_stage_layers is not None or self.last_stage_layers is not None

    def split(self) -> tuple:
        """(first, last, account_for_embedding, account_for_loss, pipeline_layout), the arguments of
        ``split_error``."""
        return self._split

    def stage_layers(self, num_layers: int) -> tuple[int, ...]:
        """Decoder layers of each virtual stage, in execution order (virtual stage c*pp + rank)."""
        return virtual_stage_layers(num_layers, self.pp, self.vpp, *self.split())

    def with_split(self, num_layers: int) -> "ParallelDims":
        """These dims with an uneven split chosen when the layers do not divide evenly and none is given."""
        if (self.uneven or self.account_for_embedding or self.account_for_loss or self.pipeline_layout is not None
                or self.pp == 1):
            return self
        if split_error(num_layers, self.pp, self.vpp, None, None, False, False) is None:
            return self
        for first, last in uneven_splits(num_layers, self.pp):
            if split_error(num_layers, self.pp, self.vpp, first, last, False, False) is None:
                return dataclasses.replace(self, first_stage_layers=first, last_stage_layers=last)
        return self

    def check_model(self, shape: Any) -> None:
        """Raise ConfigError naming the key when ``shape`` (a ModelShape) cannot be split this way."""
        why = (attention_split_error(shape, self.tp) or mlp_split_error(shape, self.tp, self.etp)
               or expert_split_error(shape, self.ep)
               or expert_training_error(shape, tp=self.tp, ep=self.ep, etp=self.etp, sp=self.sp))
        if why is not None:
            raise ConfigError(why)
        if self.pipeline_layout is not None:
            why = layout_error(expand_layout(self.pipeline_layout), num_layers=shape.num_layers, pp=self.pp,
                               vpp=self.vpp, mtp_layers=shape.mtp_num_layers)
            if why is not None:
                raise ConfigError(f"parallel.pipeline_layout={self.pipeline_layout} does not fit {shape.name} "
                                  f"({shape.num_layers} layers) at pp={self.pp}: {why}")
        why = split_error(shape.num_layers, self.pp, self.vpp, *self.split())
        if why is not None:
            raise ConfigError(f"the pipeline split of {shape.name}'s {shape.num_layers} layers over parallel.pp="
                              f"{self.pp}{f' x vpp={self.vpp}' if self.vpp > 1 else ''} is not legal: {why}; change "
                              f"parallel.{', '.join(SPLIT_KEYS[:2])} or the pipeline size")


# ----------------------------------------------------------------------------------------------- the layout rules
def default_etp(*, tp: int, ep: int) -> int:
    """The expert tensor-parallel size when none is given: 1 under expert parallelism (experts split by ep alone),
    else tp (experts follow the dense layers' split)."""
    return 1 if ep > 1 else tp


def pads_sequences(algorithm: str) -> bool:
    """Whether the trainer of ``algorithm.name`` rounds its sequence lengths up to ``sequence_multiple`` itself:
    every trainer but pretrain, whose sequences are model.seq_length exactly."""
    return algorithm != "pretrain"


def sequence_parallel_error(tp: int, sp: bool, key: str = "parallel.") -> str | None:
    """Sequence parallelism splits activations over the TP group, so it needs one."""
    if sp and tp == 1:
        return f"{key}sequence_parallel=true needs {key}tp > 1; set it false or raise tp"
    return None


def interleave_error(pp: int, vpp: int, key: str = "parallel.") -> str | None:
    """Virtual pipeline stages interleave over pipeline ranks, so they need more than one."""
    if vpp > 1 and pp == 1:
        return f"{key}vpp={vpp} needs {key}pp > 1; set vpp to 1 (null) or raise pp"
    return None


def attention_split_error(shape: Any, tp: int, key: str = "parallel.") -> str | None:
    """tp divides the attention heads and the query groups (MLA: one per head)."""
    groups = shape.num_attention_heads if shape.is_mla else shape.num_query_groups
    for count, what in ((shape.num_attention_heads, "attention heads"), (groups, "query groups (KV heads)")):
        if count % tp:
            return f"{key}tp={tp} does not divide the {count} {what} of {shape.name}; use a tp that divides {count}"
    return None


def mlp_split_error(shape: Any, tp: int, etp: int, key: str = "parallel.") -> str | None:
    """tp divides the dense MLP and the shared experts, and etp the routed experts' MLP (row/column splits)."""
    sizes = [(shape.ffn_hidden_size, "MLP size (ffn_hidden_size)", tp, "tp")]
    if shape.is_moe:
        sizes += [(shape.moe_ffn_hidden_size, "expert MLP size (moe_ffn_hidden_size)", etp, "etp"),
                  (shape.moe_shared_expert_intermediate_size, "shared expert size", tp, "tp")]
    for size, what, parts, name in sizes:
        if size % parts:
            return f"{key}{name}={parts} does not divide the {what} {size} of {shape.name}; use a {name} that divides it"
    return None


def expert_split_error(shape: Any, ep: int, key: str = "parallel.") -> str | None:
    """ep > 1 needs routed experts, and divides them."""
    if not shape.is_moe:
        return f"{key}ep={ep} but {shape.name} has no experts; set {key}ep=1" if ep > 1 else None
    if shape.num_experts % ep:
        return f"{key}ep={ep} does not divide the {shape.num_experts} experts of {shape.name}"
    return None


def expert_training_error(shape: Any, *, tp: int, ep: int, etp: int, sp: bool, key: str = "parallel.") -> str | None:
    """How MoE layers train: etp is 1 or tp (not 1 at ep = 1 and tp > 1), and tp > 1 needs sequence parallelism."""
    if not shape.is_moe:
        return None
    if etp not in (1, tp):
        return f"{key}etp={etp}: use 1 (experts split by ep alone) or {key}tp={tp}"
    if etp == 1 and ep == 1 and tp > 1:
        return (f"{key}etp=1 with {key}ep=1 at tp={tp}: experts whole on every TP rank without expert parallelism do "
                f"not train like one process (measured on Megatron 0.16.1); set {key}etp to tp or raise {key}ep")
    return moe_sequence_parallel_error(shape, tp, sp, key)


def moe_sequence_parallel_error(shape: Any, tp: int, sp: bool, key: str = "parallel.") -> str | None:
    """Megatron's MoE layers at tp > 1 need sequence parallelism."""
    if shape.is_moe and tp > 1 and not sp:
        return f"MoE models with {key}tp > 1 need {key}sequence_parallel=true (Megatron requires it)"
    return None


def sequence_multiple(*, tp: int, cp: int, sp: bool) -> int:
    """What every training sequence length is a multiple of (see ``sequence_error``)."""
    return math.lcm(2 * cp if cp > 1 else 1, tp * cp if sp else 1)


def sequence_error(seq_length: int, *, tp: int, cp: int, sp: bool, pads: bool, key: str = "parallel.") -> str | None:
    """A training sequence is a multiple of 2*cp (Megatron's load-balanced chunks) and, under sequence parallelism,
    each CP rank's part a multiple of tp. ``pads``: the trainer rounds its lengths up to that multiple itself
    (``pads_sequences``), so any length runs."""
    multiple = sequence_multiple(tp=tp, cp=cp, sp=sp)
    if pads or seq_length % multiple == 0:
        return None
    return (f"model.seq_length={seq_length} is not a multiple of {multiple} ({key}tp={tp}, cp={cp}, "
            f"sequence_parallel={str(sp).lower()}: Megatron splits each sequence into 2*cp chunks and, under sequence "
            f"parallelism, each rank's part over tp); use a multiple of {multiple}")


def microbatch_error(global_batch: int, *, micro_batch: int, dp: int, pp: int, vpp: int,
                     key: str = "parallel.") -> str | None:
    """The global batch splits into whole micro-batches per data-parallel rank; with interleaving (vpp > 1)
    Megatron's schedule runs them in groups of pp, so their count is a multiple of pp."""
    if global_batch % (micro_batch * dp):
        return (f"algorithm.global_batch_size={global_batch} is not divisible by {key}micro_batch_size*dp = "
                f"{micro_batch}*{dp}; make it a multiple of {micro_batch * dp}")
    count = global_batch // (micro_batch * dp)
    if vpp > 1 and count % pp:
        return (f"{key}vpp={vpp}: interleaving needs the micro-batches per step ({count} = global_batch_size / "
                f"(micro_batch_size*dp)) to be a multiple of pp={pp}; change the batch, micro_batch_size or vpp")
    return None


PACKING_CP_REASON = ("packed rows are not split over context-parallel ranks (Megatron does that only inside "
                     "Transformer Engine's THD attention)")
"""Why packing (parallel.micro_batch_tokens) holds cp at 1: ``packing_error``'s, and the planner's limit."""


PACKING_ALGORITHMS = ("grpo", "ppo")
"""The trainers whose training and log-prob forwards pack rows (parallel.micro_batch_tokens)."""


def packing_error(micro_batch_tokens: int | None, *, algorithm: str, cp: int, key: str = "parallel.") -> str | None:
    """Sequence packing runs in the GRPO and PPO trainers only, and not under context parallelism: Megatron splits a packed
    (THD) batch over CP ranks only inside Transformer Engine's attention, with per-sequence load balancing that
    this project's CP slicing does not do."""
    if micro_batch_tokens is None:
        return None
    if algorithm not in PACKING_ALGORITHMS:
        return (f"{key}micro_batch_tokens={micro_batch_tokens}: algorithm.name={algorithm} does not pack its rows "
                f"(only {', '.join(PACKING_ALGORITHMS)} does); set micro_batch_tokens=null")
    if cp > 1:
        return (f"{key}micro_batch_tokens={micro_batch_tokens} with {key}cp={cp}: {PACKING_CP_REASON}; set cp=1 or "
                "micro_batch_tokens=null")
    return None


DECODE_GRAPH_ROWS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
"""generation.cuda_graphs' row buckets (megatron_rl/generation/graphs.py): a decode step of n rows runs at the
smallest bucket >= n (a third of padding at most past 8 rows); larger steps run eagerly (their GEMMs, not the
launches, set their time)."""


def cuda_graph_error(*, moe: bool, mla: bool, pp: int, staged_tp: bool) -> str | None:
    """Why ``generation.cuda_graphs`` cannot replay this rollout's decode steps, or None. A captured step replays
    fixed kernels on fixed addresses, with no host synchronisation: MoE token dispatch sizes its exchanges on the
    host, the MLA latent kernel (the torch reference on every device) selects rows by mask, pipeline stages hand
    activations over point-to-point between steps, and gloo's TP collectives (parallel.backend=gloo on GPUs) run
    on the host, where a graph cannot hold them."""
    if moe:
        return ("generation.cuda_graphs=true: an MoE model's token dispatch sizes its exchanges on the host, which a "
                "CUDA graph cannot replay; set generation.cuda_graphs=false")
    if mla:
        return ("generation.cuda_graphs=true: multi-latent attention decodes on the torch latent kernel, which "
                "synchronises with the host; set generation.cuda_graphs=false")
    if pp > 1:
        return (f"generation.cuda_graphs=true with a {pp}-stage rollout: decode graphs are captured for one stage "
                "only; set generation.cuda_graphs=false, or parallel.rollout_pp=1 (split placement)")
    if staged_tp:
        return ("generation.cuda_graphs=true with parallel.backend=gloo at tp > 1: gloo's collectives run on the "
                "host, outside any CUDA graph; set parallel.backend=nccl or generation.cuda_graphs=false")
    return None


def mla_error(shape: Any, *, tp: int, cp: int, sp: bool, transformer_engine: bool, key: str = "parallel.") -> str | None:
    """Multi-latent attention without Transformer Engine (Megatron's local spec): context parallelism needs TE's
    attention, and at tp > 1 the latent norms' TP grad sum needs sequence parallelism."""
    if not shape.is_mla or transformer_engine:
        return None
    if cp > 1:
        return (f"{key}cp={cp}: {shape.name}'s multi-latent attention with context parallelism needs Transformer "
                "Engine (GPUs, runtime.transformer_engine); set cp=1")
    if tp > 1 and not sp:
        return (f"{shape.name}: multi-latent attention at {key}tp={tp} without Transformer Engine needs "
                f"{key}sequence_parallel=true")
    return None


def rollout_replica_error(rollout_tasks: int, tp: int, pp: int, ep: int) -> str | None:
    """Why ``rollout_tasks`` generating processes cannot run beside this training layout (one line naming
    cluster.rollout_tasks and the fix), or None: each rollout replica runs at tp x pp (the training layout's, or
    parallel.rollout_tp / rollout_pp: pass the replica's sizes), cp=1, ep=1, so the rollout tasks split into whole
    replicas, and split placement runs no expert parallelism."""
    if not rollout_tasks:
        return None
    if ep > 1:
        return (f"cluster.rollout_tasks={rollout_tasks} with parallel.ep={ep}: rollout replicas run at ep=1, so split "
                "placement does not run expert parallelism; set parallel.ep=1, or cluster.rollout_tasks=0 to "
                "generate in the training processes")
    replica = tp * pp
    if rollout_tasks % replica:
        lower = rollout_tasks // replica * replica
        choices = " or ".join(str(n) for n in (lower, lower + replica) if n)
        return (f"cluster.rollout_tasks={rollout_tasks} is not a multiple of the rollout replica's tp*pp = {tp}*{pp} = "
                f"{replica} (parallel.rollout_tp/rollout_pp, or the training tp/pp); set cluster.rollout_tasks to a "
                f"multiple of {replica}, e.g. {choices}")
    return None


def rollout_parallel(par: Any, num_layers: int) -> Any:
    """The parallel section (``par``) as a split-placement rollout worker runs it: tp x pp of parallel.rollout_tp /
    rollout_pp (default: the training layout's, with its pipeline split; another pp gets its own split over
    ``num_layers``), without context or expert parallelism; its data-parallel size is what the rollout processes
    allow."""
    tp, pp = par.rollout_tp or par.tp, par.rollout_pp or par.pp
    parallel = dataclasses.replace(par, tp=tp, cp=1, ep=1, etp=None, sequence_parallel=par.sequence_parallel and tp > 1,
                                   rollout_tp=None, rollout_pp=None)
    if pp != par.pp:
        parallel = dataclasses.replace(parallel, pp=pp, vpp=None, **{key: None for key in SPLIT_KEYS[:2]},
                                       account_for_embedding=False, account_for_loss=False, pipeline_layout=None)
        dims = ParallelDims(world_size=tp * pp, tp=tp, pp=pp).with_split(num_layers)
        parallel = dataclasses.replace(parallel, first_stage_layers=dims.first_stage_layers,
                                       last_stage_layers=dims.last_stage_layers)
    return parallel


def reshards(par: Any) -> bool:
    """Whether the rollout replicas run at another tp x pp than the trainers (the parallel section ``par``; the
    weights then travel as a distributed checkpoint, which Megatron loads at any layout)."""
    return (par.rollout_tp or par.tp, par.rollout_pp or par.pp) != (par.tp, par.pp)


def layout_vpp(layout: str | None, pp: int) -> int:
    """The virtual stages per rank a pipeline layout gives at ``pp`` (1 without one, or when it is unreadable:
    ``pipeline_layout_error`` says why)."""
    if layout is None:
        return 1
    try:
        return max(len(expand_layout(layout)) // pp, 1)
    except LayoutSyntaxError:
        return 1


def pipeline_layout_error(layout: str | None, *, pp: int, vpp: int, other_split: bool = False,
                          key: str = "parallel.") -> str | None:
    """A layout is readable, has pp*vpp stages and is the only split given (Megatron refuses it beside
    first/last stage layers or accounting for embedding and loss)."""
    if layout is None:
        return None
    try:
        stages = expand_layout(layout)
    except LayoutSyntaxError as err:
        return f"{key}pipeline_layout={layout}: {err}"
    if other_split:
        return (f"{key}pipeline_layout cannot be combined with {key}first_stage_layers/last_stage_layers/"
                "account_for_embedding/account_for_loss (the layout places every layer); drop one")
    if len(stages) != pp * vpp:
        return (f"{key}pipeline_layout has {len(stages)} stages, not pp*vpp = {pp}*{vpp}; give one stage per "
                f"pipeline rank and virtual chunk, or set {key}vpp to null (stages / pp)")
    return None


def uneven_splits(num_layers: int, pp: int) -> list[tuple[int, int]]:
    """Candidate (first, last) stage sizes for ``num_layers`` on ``pp`` ranks when they do not divide evenly,
    best first: the middle stages take the smallest per-stage count k that fits, and first + last share the rest
    with neither above k, the last (which carries the output layer and loss) a little lighter."""
    if pp < 2:
        return []
    out: list[tuple[int, int]] = []
    lo = -(-num_layers // pp)
    for k in (lo, lo + 1):
        rest = num_layers - (pp - 2) * k
        pairs = [(f, rest - f) for f in range(1, rest) if f <= k and rest - f <= k]
        pairs.sort(key=lambda fl: abs(fl[0] - fl[1] - 1))
        out.extend(pairs[:4])
    return out


def split_error(num_layers: int, pp: int, vpp: int, first: int | None, last: int | None, emb: bool,
                loss: bool, layout: str | None = None) -> str | None:
    """Why Megatron rejects this split, or None when it is legal."""
    if vpp > 1 and pp < 2:
        return f"interleaving (vpp={vpp}) needs pp >= 2"
    if layout is not None:
        if first is not None or last is not None or emb or loss:
            return "a pipeline layout cannot be combined with first/last stage sizes or accounting for embedding/loss"
        return layout_error(expand_layout(layout), num_layers=num_layers, pp=pp, vpp=vpp)
    if (first is not None or last is not None) and (emb or loss):
        return "first/last stage sizes cannot be combined with accounting for embedding/loss"
    if first is not None or last is not None:
        if pp < 2:
            return "first/last stage sizes need pp >= 2"
        rest, middle = num_layers, pp
        for name, n in (("first", first), ("last", last)):
            if n is None:
                continue
            if n <= 0:
                return f"{name} stage needs at least one layer"
            if n % vpp:
                return f"{name} stage layers ({n}) not divisible by vpp={vpp}"
            rest, middle = rest - n, middle - 1
        if bool(rest) != bool(middle) or rest < 0:
            return f"{rest} layers left for {middle} middle stages"
        if middle and rest % middle:
            return f"middle layers ({rest}) not divisible by the {middle} middle stages"
        if middle and (rest // middle) % vpp:
            return f"layers per middle stage ({rest // middle}) not divisible by vpp={vpp}"
        return None
    total = num_layers + int(emb) + int(loss)
    if total % pp:
        extra = " (embedding/loss counted as layers)" if emb or loss else ""
        return f"num_layers {total}{extra} not divisible by pp={pp}"
    per_rank = total // pp
    if per_rank % vpp:
        return f"layers per pipeline rank ({per_rank}) not divisible by vpp={vpp}"
    if (emb or loss) and per_rank // vpp < 1 + (emb and loss and pp * vpp == 1):
        return "no layers left on a stage after accounting for embedding/loss"
    return None


@lru_cache(maxsize=4096)
def virtual_stage_layers(num_layers: int, pp: int, vpp: int, first: int | None, last: int | None, emb: bool,
                         loss: bool, layout: str | None = None) -> tuple[int, ...]:
    """Decoder layers of each virtual stage, in execution order (virtual stage c*pp + rank)."""
    if layout is not None:
        return stage_decoder_counts(expand_layout(layout))
    counts = [0] * (pp * vpp)
    if first is not None or last is not None:
        rest, middle = num_layers, pp
        if first is not None:
            rest, middle = rest - first, middle - 1
        if last is not None:
            rest, middle = rest - last, middle - 1
        per_middle = rest // middle if middle else 0
        for c in range(vpp):
            for r in range(pp):
                n = per_middle
                if r == 0 and first is not None:
                    n = first
                elif r == pp - 1 and last is not None:
                    n = last
                counts[c * pp + r] = n // vpp
        return tuple(counts)
    per_vs = (num_layers + int(emb) + int(loss)) // (pp * vpp)
    counts = [per_vs] * (pp * vpp)
    if emb:
        counts[0] -= 1
    if loss:
        counts[-1] -= 1
    return tuple(counts)
