"""Context-parallel core attention checks under torchrun; every rank writes ``OUT/rank{R}.json`` for the test.

Run: ``.venv/bin/python -m torch.distributed.run --nproc-per-node 2 tests/dist/cp_attention_check.py --out DIR``
(``--cases attention`` for the attention checks alone; ``--nproc-per-node 4`` runs them at cp=4).

All processes form one CP group (cp = world size, tp = pp = dp = 1). Cases:

* ``attention``: ``CPDotProductAttention`` on this rank's part of q/k/v (sliced by Megatron's own
  ``get_batch_on_this_cp_rank``) against Megatron's ``DotProductAttention`` on the whole sequence, in the same
  process: outputs (local and gathered back into natural order) and the gradients w.r.t. q, k, v of
  ``sum(out * dout)`` for a fixed random ``dout``. Variants: causal GQA, causal MHA, explicit mask (causal and
  right padding, [b, 1, s, s] sliced by ``slice_batch_for_cp``). Plus: at cp=1 the module's output and grads
  are bit-identical to ``DotProductAttention``.
* ``gpt``: the tiny-cpu GPTModel (RoPE, GQA, RMSNorm, SwiGLU), local spec with the module swapped in, at cp=world:
  per-token losses (gathered) and every parameter gradient of the masked loss sum (summed over the CP group, as
  Megatron's DP-with-CP grad all-reduce does) against the same weights at cp=1 with the stock local spec, after
  re-initialising Megatron's parallel state with cp=1 in this process.
* ``engine``: ``build_engine`` (DDP, distributed optimizer, calculate_per_token_loss, finalize_model_grads) as the
  trainers run it (the spec swap in ``builder.layer_spec``, ``slice_batch_for_cp`` in ``training._forward_step``,
  ``gather_from_cp`` in ``training.logprob_collector``); two pretrain steps at cp=world vs cp=1 (then data
  parallel over the same processes): loss and grad norm, then ``sequence_logprobs`` of fresh sequences.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

SEQ, BATCH, HEADS, GROUPS, DIM = 16, 2, 4, 2, 8


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max()) if a.numel() else 0.0


def cp_slice_seq_first(x: torch.Tensor) -> torch.Tensor:
    """[s, b, ...] -> this CP rank's [s/cp, b, ...] with Megatron's own slicing (which wants [b, s, ...])."""
    from megatron.core import parallel_state
    from megatron.core.utils import get_batch_on_this_cp_rank

    return get_batch_on_this_cp_rank({"x": x.transpose(0, 1)}, is_hybrid_cp=False,
                                     cp_group=parallel_state.get_context_parallel_group())["x"].transpose(0, 1).contiguous()


def attention_config(cp: int, groups: int):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=1, hidden_size=HEADS * DIM, num_attention_heads=HEADS, num_query_groups=groups, kv_channels=DIM,
        attention_dropout=0.0, hidden_dropout=0.0, context_parallel_size=cp, use_cpu_initialization=True,
        gradient_accumulation_fusion=False, persist_layer_norm=False, masked_softmax_fusion=False,
        params_dtype=torch.float32)


def run_attention(module, q, k, v, dout, mask=None):
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    out = module(q, k, v, mask)
    (out * dout).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


def attention_case(name: str, *, groups: int, padded: bool, cp: int) -> dict:
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_rl.models.cp_attention import CPDotProductAttention, gather_from_cp, slice_batch_for_cp

    gen = torch.Generator().manual_seed(11 + groups + 7 * padded)
    q = torch.randn(SEQ, BATCH, HEADS, DIM, generator=gen)
    k = torch.randn(SEQ, BATCH, groups, DIM, generator=gen)
    v = torch.randn(SEQ, BATCH, groups, DIM, generator=gen)
    dout = torch.randn(SEQ, BATCH, HEADS * DIM, generator=gen)
    mask = None
    if padded:  # causal + right padding of the second sequence's keys (True = masked), [b, 1, s, s]
        causal = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1)
        pad = torch.zeros(BATCH, SEQ, dtype=torch.bool)
        pad[1, SEQ - 5:] = True
        mask = (causal.unsqueeze(0) | pad.unsqueeze(1)).unsqueeze(1)

    kwargs = dict(layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
    reference = DotProductAttention(config=attention_config(1, groups), **kwargs)
    ref_out, ref_dq, ref_dk, ref_dv = run_attention(reference, q, k, v, dout, mask)

    module = CPDotProductAttention(config=attention_config(cp, groups), **kwargs)
    local = [cp_slice_seq_first(t) for t in (q, k, v, dout)]
    local_mask = None if mask is None else slice_batch_for_cp({"tokens": torch.zeros(BATCH, SEQ),
                                                               "attention_mask": mask})["attention_mask"]
    out, dq, dk, dv = run_attention(module, *local[:3], local[3], local_mask)
    gathered = gather_from_cp(out, seq_dim=0)

    # at cp=1 the module is DotProductAttention: bit-identical output and grads
    same = CPDotProductAttention(config=attention_config(1, groups), **kwargs)
    one_out, one_dq, one_dk, one_dv = run_attention(same, q, k, v, dout, mask)
    sdpa = sdpa_results(q, k, v, dout, mask, local, local_mask, (ref_out, ref_dq, ref_dk, ref_dv), kwargs,
                        groups=groups, cp=cp)
    return {**sdpa,
        "case": name, "local_shape": list(out.shape), "mask_shape": None if mask is None else list(local_mask.shape),
        "out": max_diff(out, cp_slice_seq_first(ref_out)), "out_gathered": max_diff(gathered, ref_out),
        "dq": max_diff(dq, cp_slice_seq_first(ref_dq)), "dk": max_diff(dk, cp_slice_seq_first(ref_dk)),
        "dv": max_diff(dv, cp_slice_seq_first(ref_dv)),
        "ref_grad_scale": float(max(ref_dq.abs().max(), ref_dk.abs().max(), ref_dv.abs().max())),
        "cp1_bitwise": bool(torch.equal(one_out, ref_out) and torch.equal(one_dq, ref_dq)
                            and torch.equal(one_dk, ref_dk) and torch.equal(one_dv, ref_dv)),
    }


def sdpa_results(q, k, v, dout, mask, local, local_mask, reference, kwargs, *, groups: int, cp: int) -> dict:
    """runtime.attention=flash without TE: SDPADotProductAttention on the whole sequence and SDPACPAttention on
    this rank's part, output and grads against DotProductAttention's (``reference``); sdpa_context for one
    decode query and a 4-query chunk over all keys, against the reference's last rows (causal cases only)."""
    from megatron_rl.models.sdpa_attention import SDPACPAttention, SDPADotProductAttention, sdpa_context

    ref_out, ref_dq, ref_dk, ref_dv = reference
    whole = run_attention(SDPADotProductAttention(config=attention_config(1, groups), **kwargs), q, k, v, dout, mask)
    part = run_attention(SDPACPAttention(config=attention_config(cp, groups), **kwargs), *local[:3], local[3],
                         local_mask)
    out = {"sdpa_whole": max(max_diff(a, b) for a, b in zip(whole, reference)),
           "sdpa_cp": max(max_diff(a, cp_slice_seq_first(b)) for a, b in zip(part, reference))}
    if mask is None:
        scale = 1.0 / math.sqrt(DIM)
        with torch.no_grad():
            out["sdpa_decode"] = max_diff(sdpa_context(q[-1:], k, v, scale=scale), ref_out[-1:])
            out["sdpa_chunk"] = max_diff(sdpa_context(q[-4:], k, v, scale=scale), ref_out[-4:])
    return out


def tiny_gpt(shape, cp: int, *, swap: bool):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    from megatron_rl.spec.parallel import ParallelDims
    from megatron_rl.models import builder
    from megatron_rl.models.cp_attention import with_cp_core_attention

    config = builder.transformer_config(shape, builder.ModelOptions(dims=ParallelDims(world_size=cp, cp=cp)))
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization=shape.normalization)
    if swap:
        stock = spec
        spec = with_cp_core_attention(stock)
        # the copy is swapped, the argument is not
        assert all(s.submodules.self_attention.submodules.core_attention.__name__ == "DotProductAttention"
                   for s in stock.layer_specs)
    with builder.layout_invariant_init(1234):
        return GPTModel(config=config, transformer_layer_spec=spec,
                        vocab_size=builder.padded_vocab_size(shape.vocab_size), max_sequence_length=
                        shape.max_position_embeddings, position_embedding_type=shape.position_embedding_type,
                        rotary_base=int(shape.rotary_base), share_embeddings_and_output_weights=shape.tie_embeddings)


def gpt_batch(shape):
    from megatron_rl.data.batches import lm_batch, progression_batch

    rows = progression_batch(seed=3, step=1, batch_size=2, seq_length=shape.seq_length, vocab_size=shape.vocab_size)
    mask = torch.ones_like(rows, dtype=torch.float32)
    mask[1, -9:] = 0.0  # some label positions are not targets
    return lm_batch(rows, mask)


def gpt_forward_backward(model, batch):
    per_token = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    loss_sum = (per_token.float() * batch["loss_mask"]).sum()
    loss_sum.backward()
    return per_token.detach(), loss_sum.detach()


def initialize_cp(seed: int) -> None:
    """What ``megatron_rl.runtime.distributed.initialize`` does on CPU, with every process in one CP group: the
    CPU redirections, gloo, Megatron's parallel state (cp = world size) and its RNG trackers."""
    import datetime
    import os

    from megatron.core import parallel_state, tensor_parallel

    from megatron_rl.runtime import cpu_compat

    if not torch.cuda.is_available():
        cpu_compat.apply()
    torch.distributed.init_process_group(backend="gloo", timeout=datetime.timedelta(seconds=120))
    parallel_state.initialize_model_parallel(context_parallel_size=int(os.environ["WORLD_SIZE"]))
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def reinit_parallel_state(cp: int, seed: int) -> None:
    from megatron.core import parallel_state, tensor_parallel

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(context_parallel_size=cp)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def engine_steps(cfg, shape, steps: int = 2) -> tuple[list[dict], torch.Tensor]:
    """Two pretrain steps through ``Engine.train_step`` (batches stay whole: the patched ``_forward_step`` slices
    them), then ``sequence_logprobs`` of 4 fresh sequences."""
    from megatron.core import parallel_state

    from megatron_rl.runtime.training import data_parallel_slice, sequence_logprobs
    from megatron_rl.trainers.common import job_engine
    from megatron_rl.algorithms.lm_loss import lm_loss
    from megatron_rl.data.batches import collate_lm, progression_batch

    engine = job_engine(cfg, shape, total_steps=10)
    seq_length = cfg.model.seq_length or shape.seq_length
    metrics = []
    for step in range(1, steps + 1):
        rows = progression_batch(seed=cfg.run.seed, step=step, batch_size=cfg.algorithm.global_batch_size,
                                 seq_length=seq_length, vocab_size=shape.vocab_size)
        micro = data_parallel_slice(list(rows), micro_batch_size=cfg.parallel.micro_batch_size)
        batches = [collate_lm(torch.stack(mb)) for mb in micro]
        # the schedule wants the GLOBAL sequence length (it divides by cp for its pipeline buffers)
        metrics.append(engine.train_step(batches, lm_loss, seq_length=seq_length, report_names=("loss",)))
    metrics[0]["cp"] = parallel_state.get_context_parallel_world_size()
    metrics[0]["dp"] = parallel_state.get_data_parallel_world_size()
    rows = progression_batch(seed=99, step=0, batch_size=4, seq_length=seq_length, vocab_size=shape.vocab_size)
    return metrics, sequence_logprobs(engine.chunks, rows)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--cases", default="attention,gpt,engine")
    args = parser.parse_args()
    cases = set(args.cases.split(","))

    torch.set_num_threads(1)
    from megatron.core import parallel_state

    from megatron_rl.runtime import cpu_compat

    initialize_cp(seed=5)
    cp = parallel_state.get_context_parallel_world_size()
    result: dict = {"cp": cp, "cp_rank": parallel_state.get_context_parallel_rank(), "timings": {}}

    t0 = time.perf_counter()
    if "attention" in cases:
        result["attention"] = [attention_case("gqa_causal", groups=GROUPS, padded=False, cp=cp),
                               attention_case("mha_causal", groups=HEADS, padded=False, cp=cp),
                               attention_case("gqa_padded_mask", groups=GROUPS, padded=True, cp=cp)]
    result["timings"]["attention_s"] = time.perf_counter() - t0

    if "gpt" in cases or "engine" in cases:
        from megatron_rl.spec.model_shape import load_model_shape

        shape = load_model_shape("tiny-cpu")

    if "gpt" in cases:
        t0 = time.perf_counter()
        from megatron_rl.models.cp_attention import gather_from_cp, slice_batch_for_cp

        batch = gpt_batch(shape)
        model = tiny_gpt(shape, cp, swap=True)
        local = slice_batch_for_cp(batch)
        per_token, loss_sum = gpt_forward_backward(model, local)
        gathered = gather_from_cp(per_token, seq_dim=1)
        group = parallel_state.get_context_parallel_group()
        total = loss_sum.clone()
        torch.distributed.all_reduce(total, group=group)
        grads = {}
        for name, param in model.named_parameters():
            grad = param.grad.clone()
            torch.distributed.all_reduce(grad, group=group)  # what DDP's DP-with-CP all-reduce does
            grads[name] = grad
        state = {k: v.clone() if torch.is_tensor(v) else v for k, v in model.state_dict().items()}
        redirects_cp = cpu_compat.redirect_counts()

        reinit_parallel_state(1, seed=5)
        reference = tiny_gpt(shape, 1, swap=False)
        missing = reference.load_state_dict(state, strict=True)
        ref_per_token, ref_sum = gpt_forward_backward(reference, batch)
        ref_grads = dict(reference.named_parameters())
        core_types = sorted({type(m.self_attention.core_attention).__name__ for m in model.decoder.layers})
        ref_types = sorted({type(m.self_attention.core_attention).__name__ for m in reference.decoder.layers})
        result["gpt"] = {
            "core_attention": core_types, "ref_core_attention": ref_types,
            "local_tokens_shape": list(local["tokens"].shape), "per_token_shape": list(per_token.shape),
            "per_token_loss": max_diff(gathered, ref_per_token),
            "loss_sum_cp": float(total), "loss_sum_ref": float(ref_sum),
            "loss_mean_ref": float(ref_sum / batch["loss_mask"].sum()),
            "grad_max_diff": max(max_diff(grads[n], p.grad) for n, p in ref_grads.items()),
            "grad_max_abs": max(float(p.grad.abs().max()) for p in ref_grads.values()),
            "grad_names": len(ref_grads), "state_dict_ok": not missing.missing_keys and not missing.unexpected_keys,
            "new_redirect_sites_at_cp": sorted(s for s in redirects_cp if s not in cpu_compat.KNOWN_SITES),
        }
        result["timings"]["gpt_s"] = time.perf_counter() - t0

    if "engine" in cases:
        t0 = time.perf_counter()
        from megatron_rl.spec.config.loader import load_config

        common = ["algorithm.name=pretrain", "parallel.micro_batch_size=1", "algorithm.global_batch_size=4",
                  "run.seed=7", "optimizer.lr=0.01", "optimizer.lr_warmup_steps=0"]
        cfg_cp = load_config(overrides=[*common, f"parallel.cp={cp}"])
        cfg = load_config(overrides=[*common, "parallel.cp=1"])
        reinit_parallel_state(cp, seed=cfg.run.seed)
        at_cp, logp_cp = engine_steps(cfg_cp, shape)
        reinit_parallel_state(1, seed=cfg.run.seed)
        at_1, logp_1 = engine_steps(cfg, shape)
        result["engine"] = {"cp": at_cp, "ref": at_1, "logp_shape": list(logp_cp.shape),
                            "logprobs": max_diff(logp_cp, logp_1),
                            "loss": max(abs(a["loss"] - b["loss"]) for a, b in zip(at_cp, at_1)),
                            "grad_norm": max(abs(a["grad_norm"] - b["grad_norm"]) for a, b in zip(at_cp, at_1))}
        result["timings"]["engine_s"] = time.perf_counter() - t0

    result["finite"] = all(math.isfinite(x) for x in _numbers(result))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{torch.distributed.get_rank()}.json").write_text(json.dumps(result, indent=1))
    torch.distributed.barrier()


def _numbers(obj):
    if isinstance(obj, bool):
        return
    if isinstance(obj, (int, float)):
        yield float(obj)
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _numbers(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from _numbers(v)


if __name__ == "__main__":
    from megatron_rl.spec.local_ranks import exit_process

    exit_process(main())
