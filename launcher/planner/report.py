"""Human-readable plan: the chosen layout, memory and step-time breakdowns, predicted speed, the runner-up and
why it lost, alternatives, constraints.

Print one: ``python launch.py plan --model llama-3.3-70b --gpus 64 --gpu-type h100-80gb``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from launcher.planner.costs import TCP_GB_S
from launcher.planner.estimate import TIME_PARTS, Estimate, Layout
from launcher.planner.rl_step import SUGGESTION_SLACK, generation_pool
from megatron_rl.spec.errors import as_yaml
from megatron_rl.spec.pipeline_layout import format_layout, layout_from_counts

if TYPE_CHECKING:
    from launcher.planner import PlanResult
    from launcher.planner.compare import RunnerUp


def layout_line(layout: Layout) -> str:
    """One-line layout."""
    d = layout.dims
    experts = f" etp={d.etp}" if d.ep > 1 else ""
    return (f"tp={d.tp} pp={d.pp} vpp={d.vpp} cp={d.cp} ep={d.ep}{experts} dp={d.dp} mbs={layout.micro_batch_size} "
            f"recompute={layout.recompute} sp={'true' if d.sp else 'false'}")


def stage_summary(stage_layers: tuple[int, ...], pp: int, vpp: int) -> str:
    """Decoder layers per pipeline rank, run-length encoded: '7, 8 x14, 7'."""
    per_rank = [sum(stage_layers[c * pp + r] for c in range(vpp)) for r in range(pp)]
    runs: list[list[int]] = []
    for n in per_rank:
        if runs and runs[-1][0] == n:
            runs[-1][1] += 1
        else:
            runs.append([n, 1])
    text = ", ".join(f"{n} x{k}" if k > 1 else str(n) for n, k in runs)
    return text + (f" (each rank split into {vpp} virtual stages)" if vpp > 1 else "")


def _row(e: Estimate) -> str:
    lay = e.layout
    d = lay.dims
    return (f"  {d.tp:>3} {d.pp:>4} {d.vpp:>4} {d.cp:>3} {d.ep:>4} {d.dp:>6} {lay.micro_batch_size:>4} {lay.recompute:>10}"
            f" {e.step_time_s:>9.3f} {100 * e.mfu:>6.1f} {e.total / 1024**3:>8.1f}")


def _count(n: float) -> str:
    return f"{n / 1e9:.3g}B" if n >= 1e9 else f"{n / 1e6:.3g}M"


def _grpo_line(grpo: dict | None) -> list[str]:
    if not grpo:
        return []
    extras = [name for name, on in (("reference model", grpo["reference_model"]),
                                    ("old log-probs recomputed", grpo["recompute_old_logprobs"]),
                                    ("reward model", grpo["reward_model"]),
                                    (f"teacher of {_count(grpo.get('teacher_params', 0))} parameters"
                                     + (", offloaded between its passes" if grpo.get("teacher_offloaded") else ""),
                                     grpo.get("teacher_params", 0)),
                                    ("KV cache released for training", grpo["kv_cache_released_for_training"]),
                                    ("optimizer offloaded while generating",
                                     grpo["optimizer_offloaded_for_generation"])) if on]
    concurrency = grpo["generation_concurrency"]
    return [f"Rollout     {grpo['rollout_batch_size']} sequences ({grpo['samples_per_prompt']} per prompt) of "
            f"{grpo['max_prompt_length']} + up to {grpo['max_response_length']} tokens, mean response "
            f"{grpo['mean_response_length']:g} (--mean-response-len or generation.mean_new_tokens)"
            + (f", at most {concurrency} decoded at once per rank (generation.max_concurrent)" if concurrency else ""),
            *([f"            episodes of up to {grpo['turns']} turns with {grpo['reply_tokens']:g} tokens of environment "
               "replies on average (environment.max_turns, mean_reply_tokens): prefilled between turns, held in the "
               "KV pool and trained over, out of the loss"
               + (f"; {grpo['env_step_s']:g} s per environment step (environment.mean_step_s), "
                  f"{grpo['env_concurrent_steps']} at a time"
                  if grpo.get("env_step_s") else "")] if grpo.get("turns", 1) > 1 else []),
            f"            {grpo['optimizer_steps']} optimizer steps at {grpo['train_seq_length']} tokens"
            + "".join(f", {x}" for x in extras)]


def _dpo_line(dpo: dict | None) -> list[str]:
    if not dpo:
        return []
    return [f"DPO         {dpo['pairs']} pairs = {dpo['sequences']} sequences per step (chosen and rejected); "
            f"reference {dpo['reference']}"]


def _runtime_line(runtime: dict | None) -> list[str]:
    if not runtime:
        return []
    te = "Transformer Engine" if runtime["transformer_engine"] else "no Transformer Engine"
    grads = "fp32" if runtime["main_grad_bytes"] == 4 else "bf16"
    gloo = (f", gloo collectives (every link at TCP, {8 * TCP_GB_S:g} Gb/s)"
            if runtime.get("comm_backend") == "gloo" else "")
    return [f"Runtime     {te}, {runtime['attention']} attention, TP overlap "
            f"{'on' if runtime['tp_comm_overlap'] else 'off'}, DP overlap "
            f"{'on' if runtime['overlap_grad_reduce'] else 'off'}, {grads} main grads{gloo}"]


def split_lines(result: PlanResult) -> list[str]:
    """Split placement: the rollout GPUs' memory, both sides' times and how they make the step, the weight sync,
    and the suggested rollout_tasks."""
    e, w = result.estimate, result.workload
    sp = e.split
    if sp is None:
        return []
    rollout = sp.rollout_gpu
    mem = rollout.memory_gib()
    parts = ", ".join(f"{key} {mem[key]:.2f}" for key in ("weights", "kv_cache", "inference_buffers", "overhead")
                      if mem[key])
    rule = (f"max of the two (max_staleness={w['split']['max_staleness']}: the next rollout is generated while "
            f"the trainer trains)" if sp.overlapped else
            "their sum (max_staleness=0: the trainer waits for rollouts of its current weights)")
    lines = ["", f"Rollout GPUs {sp.rollout_gpus} = {sp.replicas} replica(s) of tp={rollout.layout.dims.tp} x "
                 f"pp={rollout.layout.dims.pp} (cp=1, ep=1); per GPU (GiB): {parts}, total {mem['total']:.2f} of "
                 f"{mem['capacity']:.1f} -> {'fits' if rollout.fits else 'DOES NOT FIT'}, {margin_text(rollout)}",
             f"Split step  training {sp.trainer_s:.4g} s on the {w['gpus']} trainer GPUs (weight sync "
             f"{sp.weight_sync_s:.3g} s: {sp.weight_sync_bytes / 1e9:.3g} GB over {sp.weight_sync}), generation "
             f"{sp.generation_s:.4g} s on the rollout GPUs; step {sp.step_s:.4g} s = {rule}"]
    hint = result.rollout_suggestion
    if hint is not None:
        how = ("balances generation and training" if hint.balanced else
               f"comes within {SUGGESTION_SLACK:.0%} of the fastest generation, which is still longer than training")
        lines.append(f"Suggested   cluster.rollout_tasks={hint.rollout_tasks} ({hint.replicas} replica(s)) {how} for "
                     f"this layout: generation {hint.generation_s:.4g} s vs training {hint.trainer_s:.4g} s "
                     f"(the config keeps {sp.rollout_gpus})")
    return lines


POOL_SOURCES = {"given": "given",
                "chosen": "chosen: what memory leaves while generating, up to what the rows need",
                "every row": "every row at its longest, the engine's default on CPU jobs"}


def kv_pool_lines(result: PlanResult) -> list[str]:
    """The KV memory per generating GPU, the key that sets it and where its value comes from, and the rows it
    decodes at once."""
    pool, w = generation_pool(result.estimate), result.workload
    if pool is None:
        return []
    e = result.estimate.split.rollout_gpu if result.estimate.split else result.estimate
    share = w["grpo"]["rollout_batch_size"] / (e.layout.dims.dp * e.layout.dims.cp)
    where = f"per {'rollout ' if result.estimate.split else ''}GPU"
    return ["", f"KV pool     {pool.gib:.2f} GiB {where} ({pool.key}, {POOL_SOURCES[pool.source]}): "
                f"{pool.tokens:,.0f} tokens, {pool.rows:,.0f} of the {share:,.0f} rows per rank decode at once "
                f"(continuous admission)"]


def margin_text(e: Estimate) -> str:
    """'margin 11.2 GiB (14.1%; keeps >= 5%)': what the layout leaves free and the safety margin it must keep."""
    free = e.capacity - e.total
    return (f"margin {free / 1024**3:.1f} GiB ({_percent(free / e.capacity)}; keeps >= "
            f"{_percent(e.margin)})")


def predicted_lines(e: Estimate, *, rl: bool, expected=None) -> list[str]:
    """Step time (with its expected error on published runs, error_bands.py), MFU and tokens/s; for the RL modes
    the training MFU apart from the whole step's."""
    band = f" ({expected.text()})" if expected is not None else ""
    head = (f"Predicted   step {e.step_time_s:.4g} s{band}, {e.tokens_per_s_per_gpu:,.0f} tokens/s/GPU"
            + (" (trained tokens per step / step / GPUs, as NeMo RL)" if rl else "")
            + f", pipeline bubble {100 * e.bubble_fraction:.1f}%")
    if not rl:
        return [head + f", MFU {100 * e.mfu:.1f}% of bf16 peak"]
    return [head, f"            MFU {100 * e.training_mfu:.1f}% of bf16 peak in training (its FLOPs over its time), "
                  f"{100 * e.mfu:.1f}% over the whole step (generation and log-prob passes included)"]


def time_lines(e: Estimate) -> list[str]:
    """The step time by part (the parts that take time), with each one's share."""
    lines = ["Time per step (s; the training parts are the slowest pipeline rank's)"]
    for key, seconds in e.breakdown_s.items():
        if seconds > 0 or key == "compute":
            lines.append(f"  {TIME_PARTS[key]:<28}{seconds:>10.3f}  {_percent(seconds / e.step_time_s):>6}")
    lines.append(f"  {'total':<28}{e.step_time_s:>10.3f}")
    return lines


def runner_up_line(r: RunnerUp, chosen: Estimate) -> str:
    """Why the runner-up lost: how much slower it is and the part that accounts for most of it, or how much faster
    it is and the kept keys that excluded it."""
    main = f"{_percent(r.deltas_s[r.main_reason] / chosen.step_time_s, sign=True)} {TIME_PARTS[r.main_reason]}"
    head = f"Runner-up   {layout_line(r.estimate.layout)} is"
    if r.slower_by >= 0:
        return f"{head} {_percent(r.slower_by)} slower ({r.estimate.step_time_s:.4g} s): {main}"
    kept = ",".join(f"{k}={as_yaml(v)}" for k, v in r.excluded_by.items())
    return (f"{head} {_percent(-r.slower_by)} faster ({r.estimate.step_time_s:.4g} s: {main}), "
            f"excluded by the kept {kept}")


def _percent(fraction: float, sign: bool = False) -> str:
    """A share as a percentage: one decimal, or two significant digits below 0.1%."""
    spec = ("+" if sign else "") + (".1f" if abs(fraction) >= 1e-3 or fraction == 0 else ".2g")
    return f"{100 * fraction:{spec}}%"


def explain(result: PlanResult) -> str:
    """Tables for the terminal."""
    w, e = result.workload, result.estimate
    mem = e.memory_gib()
    rollout = f" training + {w['split']['rollout_gpus']} rollout" if "split" in w else ""
    lines = [f"Plan for {w['model']} on {w['gpus']}{rollout} x {w['gpu_type']} (seq {w['seq_length']}, global batch "
             f"{w['global_batch_size']}, mode {w['mode']}, {w['precision']})",
             *_grpo_line(w.get("grpo")), *_dpo_line(w.get("dpo")), *_runtime_line(w.get("runtime")),
             "", f"Layout      {layout_line(e.layout)}",
             f"Pipeline    {e.layout.split_name()}; decoder layers per rank: "
             f"{stage_summary(e.stage_layers, e.layout.dims.pp, e.layout.dims.vpp)}",
             *([f"            as parallel.pipeline_layout: {format_layout(layout_from_counts(e.stage_layers))}"]
               if e.layout.dims.pp > 1 and e.layout.dims.pipeline_layout is None else []),
             "", f"Memory per {'trainer ' if e.split else ''}GPU (GiB, fullest pipeline rank = {e.worst_rank})"]
    always = {"weights", "gradients", "optimizer", "activations", "overhead",
              *(("kv_cache",) if "grpo" in w and e.split is None else ())}
    shared = w.get("grpo", {}).get("kv_cache_released_for_training")
    for key in ("weights", "gradients", "optimizer", "activations", "kv_cache", "inference_buffers", "reference_model",
                "reward_model", "teacher_model", "critic", "overhead"):
        if mem[key] or key in always:
            note = (f"  (beyond the memory it shares with training; {mem['kv_cache_generating']:.2f} while generating)"
                    if key == "kv_cache" and shared else "  (beyond the memory it shares with training)"
                    if key == "inference_buffers" and shared else "")
            lines.append(f"  {key:<16}{mem[key]:>9.2f}{note}")
    verdict = "fits" if e.fits else "DOES NOT FIT"
    lines.append(f"  {'total':<16}{mem['total']:>9.2f}  of {mem['capacity']:.1f}  -> {verdict}, {margin_text(e)}")
    lines += split_lines(result)
    lines += kv_pool_lines(result)
    lines += ["", *predicted_lines(e, rl="grpo" in w, expected=result.expected_error)]
    lines += ["", *time_lines(e)]
    if result.runner_up is not None:
        lines += ["", runner_up_line(result.runner_up, e)]
    if result.alternatives:
        lines += ["", "Alternatives (the fastest of each other tp/pp/cp/ep, then other variants; fastest first)",
                  "   tp   pp  vpp  cp   ep     dp  mbs  recompute    step_s   mfu%  mem_gib"]
        lines += [_row(a) for a in result.alternatives]
    if result.constraints:
        lines += ["", "Kept        " + " ".join(f"{k}={as_yaml(v)}" for k, v in result.constraints.items())
                  + " (given)"]
    if result.limits:
        lines += ["", "Limits (held: the trainers cannot run other values yet)"]
        lines += [f"  {k + '=' + as_yaml(value):<24}{why}" for k, (value, why) in result.limits.items()]
    if result.rejections:
        lines += ["", "Ruled out (candidates: constraint, e.g.)"]
        for name, info in result.rejections.items():
            lines.append(f"  {info['count']:>8}  {name}: {info['example']}")
    lines += ["", f"Search      {result.considered} candidate layouts, {result.evaluated} estimated, "
                  f"{result.search_seconds:.3f} s"]
    return "\n".join(lines)
