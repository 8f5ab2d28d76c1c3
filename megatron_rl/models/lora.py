"""LoRA on Megatron Core: low-rank adapters on the decoder's parallel linears, TP-sharded like their base.

    .venv/bin/python -m pytest tests/test_lora.py -q          # layer numerics, TP1 vs TP2, PP, dropout, export

``add_adapters(model, lora, ...)`` runs after the model is built (``build_gpt_model``): every decoder linear whose
name is in ``model.lora.targets`` (linear_qkv, linear_proj, linear_fc1, linear_fc2) gets a child ``lora``
(``LoraAdapter``) and a forward hook that adds ``dropout(x) A^T B^T * alpha / rank`` to the base's output, keeping
Megatron's ``(output, bias)`` contract; every other weight is frozen (``requires_grad=False``) before DDP and the
optimizer exist, so Megatron's DDP gives gradient buffers, and the (distributed) optimizer state, to the
adapters only. Sharding follows the base:

* column-parallel (qkv, fc1): A [r, in] replicated, B [out/tp, r] sharded on dim 0. The low-rank activation
  enters the TP region like the base's input: ``copy_to_tensor_model_parallel_region`` (backward all-reduce),
  or under sequence parallelism ``gather_from_sequence_parallel_region`` of A's sequence-local product (A's
  grad then covers the rank's tokens only: it is tagged ``sequence_parallel``, so Megatron's
  ``finalize_model_grads`` sums it over TP, as it does the norms');
* row-parallel (proj, fc2): A [r, in/tp] sharded on dim 1, B [out, r] replicated; A's partial product is
  all-reduced (under SP reduce-scattered over the sequence, B tagged ``sequence_parallel``);
* replicated ("duplicated": MLA's q and kv down projections, replicated over TP as their base): A and B whole,
  no communication; under SP each rank's input is its chunk of the sequence, so both are tagged
  ``sequence_parallel``. MLA's up projections (and linear_q_proj without q-LoRA) are column-parallel.

* a routed expert's linears (``experts.linear_fc1/fc2``, SequentialMLP's local experts): the token dispatcher
  does the expert-TP communication (Megatron's ``explicit_expert_comm``), so the adapter reduces no activation;
  its replicated matrix (column: A, row: B) gets its gradient summed over the expert-TP group instead
  (``LoraAdapter._expert_output``), and its parameters are reduced over the expert-data-parallel group, as the
  expert's weights. Shared experts (``shared_experts.linear_fc1/fc2``) are dense linears.
* grouped experts (Megatron's ``TEGroupedMLP``: TE's grouped GEMM, or the torch grouped linears of
  grouped_linear.py): the grouped linear gets a ``lora`` ModuleList of one such expert adapter per local expert
  (seeded by its global index, as a sequential expert's), and a hook that splits the tokens by ``m_splits``; its
  sharded state dict stores each adapter under the sequential experts' keys, so checkpoints, exports and PEFT
  adapters do not depend on the choice.

A is drawn as PEFT does (kaiming-uniform, a=sqrt(5)) on the whole [r, in] matrix from a seed of its global layer
and target, then sliced, so the initial adapters do not depend on the layout; B starts at zero, so step 0 is the
base. Checkpoints store ``<linear>.lora.A`` / ``.lora.B`` under global keys next to the base weights (the fc1 B
of a gated MLP through Megatron's swiglu factory, as fc1's weight), so they reshard and resume like any weight.

``model.lora.dropout`` drops the adapter's input only, in training mode (eval and the merged weights agree), from
Megatron's tracked RNG states (``LoraAdapter.dropped``: equal masks over TP where the input is replicated), which
its activation recompute replays. Under full recompute the frozen embedding's output is made to require grad, or
the recomputed layers would give the adapters no gradient.

``model.lora.modules_to_save`` (PEFT's): the word embeddings, output layer and/or final norm train in full beside
the adapters (``requires_grad`` set here too, so DDP and the optimizer hold their state; with tied embeddings either
name trains the one shared weight, and its last-stage copy under pipelining, whose grads Megatron all-reduces with
the first stage's: PP2 trains as PP1, tests/test_lora.py).

``adapters_disabled(chunks)`` runs the base alone: the KL reference of a LoRA run, without a second model copy;
the modules_to_save get their original weights swapped in meanwhile, from a copy of just those weights
(``BaseModules``, which ``Engine.reference_model`` keeps and checkpoints in the run's reference folder).
Transformer Engine's linears take the same hook (their forward also returns ``(out, bias)``); for TE's
LayerNorm-fused column linears the hook applies the fused norm to the adapter's input itself. The TE path is
unverified on the CPU.
"""

from __future__ import annotations

import contextlib
import logging
import math
import re
import types
from typing import Iterator, Optional

import torch
import torch.nn.functional as F

from megatron_rl.models.norms import te_fused_norm
from megatron_rl.spec.config.schema import LoraConfig

ADAPTER = "lora"
"""Name of the adapter child of each adapted linear (checkpoint keys ``<linear>.lora.A`` / ``.lora.B``)."""
_ADAPTER_KEY = re.compile(rf"\.{ADAPTER}\.(\d+\.)?[AB]\b")
TRAINABLE_HEADS = ("rm_head.",)
"""Top-level modules that stay trainable beside the adapters (a reward model's or critic's new head)."""
SAVED_MODULES = {"embedding": "embedding.word_embeddings.", "output_layer": "output_layer.",
                 "final_layernorm": "decoder.final_layernorm."}
"""model.lora.modules_to_save name -> parameter-name prefix of the base module trained in full."""
_TARGET = re.compile(r"^decoder\.layers\.(\d+)\.(?:self_attention|mlp)\."
                     r"(?:(?P<group>shared_experts|experts)\.(?:local_experts\.(?P<expert>\d+)\.)?)?"
                     r"(?P<linear>linear_qkv|linear_proj|linear_fc1|linear_fc2|linear_q_proj|linear_q_down_proj|"
                     r"linear_q_up_proj|linear_kv_down_proj|linear_kv_up_proj)$")
"""An adaptable linear: a dense layer's, MLA's, a shared expert's, or a routed expert's (SequentialMLP's local
experts)."""


def is_adapter_key(key: str) -> bool:
    """Whether a (checkpoint or state-dict) key is a LoRA adapter matrix (``<linear>.lora.A``, or a grouped expert
    linear's ``<linear>.lora.<expert>.A``)."""
    return _ADAPTER_KEY.search(key) is not None


class LoraAdapter(torch.nn.Module):
    """A [r, in_local] and B [out_local, r] of one linear; ``forward(x)`` is the adapter's share of its output."""

    def __init__(self, *, settings: dict, parallel: str, in_local: int, out_local: int, rank: int, alpha: float, dropout: float,
                 sequence_parallel: bool, tp_group=None, gated: bool = False, expert: bool = False,
                 dtype=torch.float32, device=None):
        super().__init__()
        self.settings = settings  # model.lora, recorded in checkpoints (extra["lora"]) for the exports
        self.parallel, self.rank, self.scale = parallel, rank, alpha / rank
        self.sequence_parallel, self.tp_group, self.gated = sequence_parallel and not expert, tp_group, gated
        self.expert = expert
        self.enabled = True
        self.dropout = torch.nn.Dropout(dropout) if dropout else torch.nn.Identity()
        self.A = torch.nn.Parameter(torch.empty(rank, in_local, dtype=dtype, device=device))
        self.B = torch.nn.Parameter(torch.zeros(out_local, rank, dtype=dtype, device=device))
        self.norm = None  # set for TE's LayerNorm-fused linears: the base normalises its own input

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from megatron.core.tensor_parallel import mappings

        if self.expert:  # the token dispatcher does the expert-TP communication of the base: see _expert_output
            return self._expert_output(self.dropped(x))
        h = F.linear(self.dropped(x), self.A)
        if self.parallel == "duplicated":  # replicated over TP, as its base: no communication
            return F.linear(h, self.B) * self.scale
        if self.parallel == "column":
            h = (mappings.gather_from_sequence_parallel_region(h, tensor_parallel_output_grad=True, group=self.tp_group)
                 if self.sequence_parallel else mappings.copy_to_tensor_model_parallel_region(h, group=self.tp_group))
        else:
            h = (mappings.reduce_scatter_to_sequence_parallel_region(h, group=self.tp_group)
                 if self.sequence_parallel else mappings.reduce_from_tensor_model_parallel_region(h, group=self.tp_group))
        return F.linear(h, self.B) * self.scale

    def _expert_output(self, x: torch.Tensor) -> torch.Tensor:
        """A routed expert's linear (Megatron's ``explicit_expert_comm``): its input is whole over the expert-TP
        group (column) or sharded on features (row), its output this rank's shard (column) or partial sum (row),
        and the dispatcher gathers or sums outputs and input gradients over the group. So no activation is
        reduced here (the dispatcher's sum of the input gradients would count a reduced one once per rank);
        instead the replicated matrix (column: A, row: B) sees only this rank's share of its gradient, which
        ``copy_to_tensor_model_parallel_region`` on the matrix itself sums over the group in backward, keeping the
        copies equal."""
        from megatron.core.tensor_parallel import mappings

        shared = lambda m: mappings.copy_to_tensor_model_parallel_region(m, group=self.tp_group)  # noqa: E731
        if self.parallel == "column":
            return F.linear(F.linear(x, shared(self.A)), self.B) * self.scale
        return F.linear(F.linear(x, self.A), shared(self.B)) * self.scale

    def dropped(self, x: torch.Tensor) -> torch.Tensor:
        """Dropout of the adapter's input in training mode, from one of Megatron's tracked (checkpointed, recompute-
        replayed) RNG states. A column linear's input (without sequence parallelism) is the same on every TP rank,
        and so must its mask be, or the copies of A would get different gradients and drift apart: the
        data-parallel state, equal over TP and drawn from by nothing else that varies by rank. A TP-sharded input
        (a row linear's, or a sequence chunk) draws from the model-parallel state, different per TP rank."""
        if not (self.training and isinstance(self.dropout, torch.nn.Dropout)):
            return x
        from megatron.core.tensor_parallel import get_cuda_rng_tracker, get_data_parallel_rng_tracker_name

        tracker = get_cuda_rng_tracker()
        replicated = self.parallel in ("column", "duplicated") and not self.sequence_parallel and not self.expert
        with tracker.fork(get_data_parallel_rng_tracker_name()) if replicated else tracker.fork():
            return self.dropout(x)

    def delta_weight(self) -> torch.Tensor:
        """This rank's shard of B A * alpha / r, shaped like the base weight's shard."""
        return (self.B @ self.A) * self.scale


def _parallel_mode(module) -> Optional[str]:
    """column, row, or duplicated (replicated over TP: MLA's down projections, TE's ``TELinear`` or Megatron's
    plain ``Linear`` the local MLA spec uses)."""
    from megatron.core.post_training.modelopt.layers import Linear
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    if isinstance(module, ColumnParallelLinear):
        return "column"
    if isinstance(module, RowParallelLinear):
        return "row"
    if isinstance(module, Linear):
        return "duplicated"
    mode = getattr(module, "parallel_mode", None)  # Transformer Engine linears
    return mode if mode in ("column", "row", "duplicated") else None


def _add_adapter_output(module, args, kwargs, output):
    adapter = module.lora
    if not adapter.enabled:
        return output
    x = args[0] if args else kwargs["input_"]
    if adapter.norm is not None:
        x = adapter.norm(x)
    out, bias = output
    return out + adapter(x).to(out.dtype), bias


def _sharded_state_dict(module, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None):
    """The base linear's sharded state dict plus its adapter's, each adapter matrix sharded on the TP axis it
    has (column: B on dim 0; row: A on dim 1); a gated fc1's B split into its gate and up halves as fc1's
    weight is, so the stored B is [B_gate; B_up] whatever the TP size."""
    from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
    from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

    adapter_prefix = f"{prefix}{ADAPTER}."
    state = {k: v for k, v in type(module).sharded_state_dict(module, prefix, sharded_offsets, metadata).items()
             if not k.startswith(adapter_prefix)}
    adapter = module.lora
    axes = {"column": {"B": 0}, "row": {"A": 1}, "duplicated": {}}[adapter.parallel]
    tensors = {"A": adapter.A, "B": adapter.B}
    sharded = make_sharded_tensors_for_checkpoint(tensors, adapter_prefix, axes, sharded_offsets,
                                                  tp_group=getattr(module, "tp_group", None),
                                                  dp_cp_group=(metadata or {}).get("dp_cp_group"))
    if adapter.gated:
        key = f"{adapter_prefix}B"
        sharded[key] = apply_swiglu_sharded_factory(sharded[key], sharded_offsets,
                                                    (metadata or {}).get("singleton_local_shards", False))
    state.update(sharded)
    return state


def _add_grouped_adapter_output(module, args, kwargs, output):
    """A grouped expert linear's hook: its tokens come sorted by local expert (``m_splits`` per expert), and each
    expert's run gets its own adapter's output."""
    if not module.lora[0].enabled:
        return output
    x, m_splits = args
    out, bias = output
    parts = torch.split(x, [int(m) for m in m_splits])
    return out + torch.cat([adapter(part) for adapter, part in zip(module.lora, parts)]).to(out.dtype), bias


def _grouped_sharded_state_dict(module, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None):
    """A grouped expert linear's sharded state dict plus its adapters', each under the key a sequential expert's
    adapter has (models/grouped_linear.py ``expert_sharded_tensors``), so checkpoints move between the two."""
    from megatron_rl.models.grouped_linear import expert_sharded_tensors

    state = {k: v for k, v in type(module).sharded_state_dict(module, prefix, sharded_offsets, metadata).items()
             if f".{ADAPTER}." not in f".{k}"}
    first = module.lora[0]
    axes = {"column": {f"{ADAPTER}.B": 0}, "row": {f"{ADAPTER}.A": 1}}[first.parallel]
    experts = [{f"{ADAPTER}.{i}.A": (f"{ADAPTER}.A", adapter.A), f"{ADAPTER}.{i}.B": (f"{ADAPTER}.B", adapter.B)}
               for i, adapter in enumerate(module.lora)]
    state.update(expert_sharded_tensors(module, experts, axes, prefix, sharded_offsets, metadata,
                                        gated=(f"{ADAPTER}.B",) if first.gated else ()))
    return state


def _embedding_output_requires_grad(module, args, output):
    if torch.is_grad_enabled() and not output.requires_grad:
        output.requires_grad_(True)
    return output


class _CpuForkNotice(logging.Filter):
    """On the CPU Megatron's tracked "CUDA" RNG states are the CPU generator's (``runtime.cpu_compat``), so the
    tracker's check that a fork left the CPU generator alone fires on every adapter dropout: expected there."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "CPU RNG state changed within GPU RNG context" not in record.getMessage()


def adapter_seed(seed: int, layer: int, target: str, expert: Optional[int] = None) -> int:
    """Seed of A's initial draw for global decoder layer ``layer`` (1-based), ``target`` (one of LORA_TARGETS) and,
    for a routed expert, its global index."""
    from megatron_rl.spec.config.schema import LORA_TARGETS

    base = (seed * 1000 + layer) * 10 + 7_000_003 + LORA_TARGETS.index(target)
    return base if expert is None else base + (expert + 1) * 100_000_007


def _new_adapter(*, weight: torch.nn.Parameter, parallel: str, tp_group, expert: bool, gated: bool, settings: dict,
                 lora: LoraConfig, sequence_parallel: bool, seed: int) -> "LoraAdapter":
    """The adapter of one linear (or one expert of a grouped linear) whose local weight is ``weight``: A drawn as
    PEFT does on the whole [r, in] matrix from ``seed``, then sliced; B zero; TP and reduction attributes as
    the weight's."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    out_local, in_local = weight.shape
    adapter = LoraAdapter(settings=settings, parallel=parallel, in_local=in_local, out_local=out_local,
                          rank=lora.rank, alpha=lora.alpha, dropout=lora.dropout, sequence_parallel=sequence_parallel,
                          tp_group=tp_group, gated=gated, expert=expert, dtype=weight.dtype, device=weight.device)
    size, index = (tp_group.size(), tp_group.rank()) if tp_group is not None else (
        parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_tensor_model_parallel_rank())
    in_full = in_local * (size if parallel == "row" else 1)
    full_a = torch.empty(lora.rank, in_full)
    torch.nn.init.kaiming_uniform_(full_a, a=math.sqrt(5), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        adapter.A.copy_(full_a[:, index * in_local:(index + 1) * in_local] if parallel == "row" else full_a)
    if parallel == "column":
        set_tensor_model_parallel_attributes(adapter.B, True, 0, 1)
    elif parallel == "row":
        set_tensor_model_parallel_attributes(adapter.A, True, 1, 1)
    if adapter.sequence_parallel:  # grads cover this rank's tokens only: summed over TP by finalize_model_grads
        replicated = {"column": [adapter.A], "row": [adapter.B], "duplicated": [adapter.A, adapter.B]}[parallel]
        for param in replicated:
            param.sequence_parallel = True
    for param in (adapter.A, adapter.B):  # an expert's: reduced over the expert-data-parallel group, as its weight
        param.allreduce = getattr(weight, "allreduce", True)
    return adapter


def add_adapters(model, lora: LoraConfig, *, seed: int) -> int:
    """Give ``model``'s target linears adapters and freeze everything else but ``TRAINABLE_HEADS`` and the
    modules_to_save (their parameters tagged ``lora_saved``); returns how many linears were adapted. Routed experts
    (SequentialMLP's, each seeded by its global index; their adapters reduced over the expert-data-parallel group as
    their weights) and shared experts are adapted when ``experts.*`` / ``shared_experts.*`` are targets, MLA's
    projections when named (linear_q_proj, linear_q_down_proj, linear_q_up_proj, linear_kv_down_proj,
    linear_kv_up_proj; its output projection is linear_proj)."""
    config = model.config
    adapted = 0
    settings = {"rank": lora.rank, "alpha": lora.alpha, "dropout": lora.dropout, "targets": list(lora.targets),
                "modules_to_save": list(lora.modules_to_save)}
    for name, module in list(model.named_modules()):
        match = _TARGET.match(name)
        target = match and (f"{match['group']}.{match['linear']}" if match["group"] else match["linear"])
        if match is None or target not in lora.targets:
            continue
        layer = model.decoder.layers[int(match.group(1))]
        group = getattr(module, "tp_group", None)
        gated = match["linear"] == "linear_fc1" and config.gated_linear_unit
        if match["group"] == "experts" and match["expert"] is None and hasattr(module, "num_gemms"):
            # grouped experts (TEGroupedMLP): one adapter per local expert, as SequentialMLP's would have
            experts = layer.mlp.experts
            first = experts.ep_group.rank() * experts.num_local_experts
            parallel = "column" if match["linear"] == "linear_fc1" else "row"
            found = torch.nn.ModuleList(
                _new_adapter(weight=getattr(module, f"weight{i}"), parallel=parallel, tp_group=module._tp_group,
                             expert=module.explicit_expert_comm, gated=gated, settings=settings, lora=lora,
                             sequence_parallel=config.sequence_parallel,
                             seed=adapter_seed(seed, layer.layer_number, target, first + i))
                for i in range(module.num_gemms))
            module.add_module(ADAPTER, found)
            module.register_forward_hook(_add_grouped_adapter_output, with_kwargs=True)
            module.sharded_state_dict = types.MethodType(_grouped_sharded_state_dict, module)
            adapted += module.num_gemms
            continue
        parallel = _parallel_mode(module)
        if parallel is None or (match["group"] == "experts" and match["expert"] is None):
            from megatron_rl.spec.errors import ConfigError

            raise ConfigError(f"model.lora.targets: {name} is a {type(module).__name__}, not a parallel linear of one "
                              "expert nor a grouped expert linear: leave experts.* out of the targets")
        expert = None
        if match["expert"] is not None:  # global index: this EP rank's first expert + the local one
            experts = layer.mlp.experts
            expert = experts.ep_group.rank() * experts.num_local_experts + int(match["expert"])
        adapter = _new_adapter(weight=module.weight, parallel=parallel, tp_group=group, gated=gated,
                               expert=bool(getattr(module, "explicit_expert_comm", False)), settings=settings,
                               lora=lora, sequence_parallel=config.sequence_parallel,
                               seed=adapter_seed(seed, layer.layer_number, target, expert))
        if parallel != "row":
            adapter.norm = te_fused_norm(module)
        module.add_module(ADAPTER, adapter)
        module.register_forward_hook(_add_adapter_output, with_kwargs=True)
        module.sharded_state_dict = types.MethodType(_sharded_state_dict, module)
        adapted += 1
    if not adapted:
        raise NotImplementedError(f"LoRA: no layer of this model chunk matches model.lora.targets={lora.targets}")
    if config.recompute_granularity == "full" and model.pre_process:
        # Full recompute runs each layer in Megatron's CheckpointFunction, whose output needs grad only if its input
        # does: from the frozen embedding it would not, and the adapters inside would silently get no gradient.
        model.embedding.register_forward_hook(_embedding_output_requires_grad)
    if lora.dropout and not torch.cuda.is_available():
        random_logger = logging.getLogger("megatron.core.tensor_parallel.random")
        if not any(isinstance(f, _CpuForkNotice) for f in random_logger.filters):
            random_logger.addFilter(_CpuForkNotice())
    saved = set(lora.modules_to_save)
    if model.share_embeddings_and_output_weights and saved & {"embedding", "output_layer"}:
        saved |= {"embedding", "output_layer"}  # one shared weight (a copy on the last stage, grads all-reduced)
    prefixes = tuple(SAVED_MODULES[m] for m in saved)
    for name, param in model.named_parameters():
        param.lora_saved = bool(prefixes) and name.startswith(prefixes)
        param.requires_grad_(f".{ADAPTER}." in name or name.startswith(TRAINABLE_HEADS) or param.lora_saved)
    return adapted


def adapters(chunks) -> Iterator[LoraAdapter]:
    for chunk in chunks if isinstance(chunks, (list, tuple)) else [chunks]:
        for module in chunk.modules():
            if isinstance(module, LoraAdapter):
                yield module


def merge_adapters(chunks) -> None:
    """Add every adapter of ``chunks`` into its base weight shard (W + B A alpha / r; a grouped expert linear's
    each into its expert's weight); run them with the adapters disabled afterwards to see the merged model."""
    with torch.no_grad():
        for chunk in chunks if isinstance(chunks, (list, tuple)) else [chunks]:
            for module in chunk.modules():
                found = getattr(module, ADAPTER, None)
                if isinstance(found, LoraAdapter):
                    module.weight += found.delta_weight()
                elif isinstance(found, torch.nn.ModuleList):
                    for i, adapter in enumerate(found):
                        getattr(module, f"weight{i}").add_(adapter.delta_weight())


def stored_lora_config(extra: Optional[dict]) -> Optional[LoraConfig]:
    """The model.lora a checkpoint's adapters were trained with, from its common state's ``extra`` (where
    ``save_checkpoint`` records ``adapter_settings``); None: no adapters."""
    import dataclasses

    settings = (extra or {}).get("lora")
    if not settings:
        return None
    known = {f.name for f in dataclasses.fields(LoraConfig)}
    return LoraConfig(**{key: value for key, value in settings.items() if key in known})


def adapter_settings(chunks) -> Optional[dict]:
    """The model.lora settings of ``chunks``' adapters (None: no adapters)."""
    first = next(adapters(chunks), None)
    return None if first is None else dict(first.settings)


def saved_parameters(chunks) -> dict[int, torch.nn.Parameter]:
    """The parameters of ``chunks``' modules_to_save (once each: a tied embedding is one weight)."""
    return {id(p): p for chunk in (chunks if isinstance(chunks, (list, tuple)) else [chunks])
            for p in chunk.parameters() if getattr(p, "lora_saved", False)}


class BaseModules(torch.nn.Module):
    """A frozen copy of one model chunk's modules_to_save weights as they are now (each parameter's
    ``lora_base``), checkpointed like a model chunk (``runtime.checkpoint``) under the model's own keys, so it
    reshards; ``adapters_disabled`` swaps it in. Holds only those modules' weights."""

    def __init__(self, model):
        super().__init__()
        self._model = [model]  # not a submodule
        self.saved = {name: p for name, p in model.named_parameters() if getattr(p, "lora_saved", False)}
        for param in self.saved.values():
            param.lora_base = param.detach().clone()

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None):
        import dataclasses

        full = self._model[0].sharded_state_dict(prefix, sharded_offsets, metadata)
        return {name: dataclasses.replace(full[prefix + name], data=param.lora_base)
                for name, param in self.saved.items() if prefix + name in full}

    def load_state_dict(self, state_dict, strict: bool = True):
        with torch.no_grad():
            for name, value in state_dict.items():
                self.saved[name].lora_base.copy_(value)
        missing = [name for name in self.saved if name not in state_dict]
        return missing, [name for name in state_dict if name not in self.saved]


@contextlib.contextmanager
def adapters_disabled(chunks):
    """Run ``chunks`` as their frozen base (the KL reference of a LoRA run): no second copy of the model. The
    modules_to_save get their original weights back meanwhile (``BaseModules``; an error if none were kept)."""
    found = list(adapters(chunks))
    states = [a.enabled for a in found]
    saved = list(saved_parameters(chunks).values())
    if any(not hasattr(p, "lora_base") for p in saved):
        raise RuntimeError("LoRA modules_to_save: their base weights were not kept (BaseModules)")
    live = [p.detach().clone() for p in saved]
    with torch.no_grad():
        for param in saved:
            param.copy_(param.lora_base)
    for adapter in found:
        adapter.enabled = False
    try:
        yield
    finally:
        for adapter, state in zip(found, states):
            adapter.enabled = state
        with torch.no_grad():
            for param, value in zip(saved, live):
                param.copy_(value)


def trainable_fraction(chunks) -> float:
    """Trainable share of the model's parameters, over the whole model (every TP/PP rank's own parameters,
    TP-replicated ones and a tied embedding once; routed experts' over the expert-parallel ranks, expert-TP
    replicas once), so it is the same at every layout."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.layers import param_is_not_tensor_parallel_duplicate
    from megatron.core.transformer.module import param_is_not_shared

    from megatron_rl.runtime.distributed import collective_device

    device = collective_device(ps.get_model_parallel_group())
    dense, expert = (torch.zeros(2, dtype=torch.float64, device=device) for _ in range(2))
    expert_tp = ps.get_expert_tensor_parallel_group()
    for chunk in chunks:
        for param in chunk.parameters():  # a tied output layer's copy on the last pipeline stage is Megatron's `shared`
            counts = dense if getattr(param, "allreduce", True) else expert
            if param_is_not_tensor_parallel_duplicate(param, expert_tp_group=expert_tp) and param_is_not_shared(param):
                counts[0] += param.numel() if param.requires_grad else 0
                counts[1] += param.numel()
    torch.distributed.all_reduce(dense, group=ps.get_model_parallel_group())
    torch.distributed.all_reduce(expert, group=ps.get_expert_tensor_model_pipeline_parallel_group())
    counts = dense + expert
    return float(counts[0] / counts[1])
