"""Router replay for MoE RL (algorithm.router_replay): a rollout's training forwards route its tokens to the
experts that generation chose for them.

Why. An MoE policy's routing is discontinuous. Generation and the training forward run the same weights at
different batch shapes and kernels (KV-cache decode against a full forward, bf16 GEMMs, Transformer Engine),
so a token near a routing tie can reach other experts in training than when it was sampled. Its importance
ratio then measures a routing flip rather than a policy change, the ratio spread widens, and the clip fires on
noise. With replay, the old-log-prob forward, the reference forward and every training forward of a rollout
use the recorded top-k experts; the gate weights still come from the current router (Megatron gathers the
router's scores at the replayed indices), so the router keeps its gradient.

Megatron Core pieces. ``moe_enable_routing_replay`` gives each ``TopKRouter`` a ``RouterReplay``, and
``topk_routing_with_score_function`` asks it for the top-k (record, replay, or compute). ``install`` swaps in
``RolloutRouterReplay``, a subclass with two changes: a token whose route is ``NO_ROUTE`` (the right padding of
a training micro-batch) is routed as usual, and a recompute in the backward pass (full activation recompute
re-runs the router) takes the routes of the micro-batch being recomputed. Megatron's ``REPLAY_FORWARD`` would
take the latest micro-batch's, wrong once a pipeline schedule holds several in flight; its FIFO
``replay_backward_list`` is right, because every schedule runs a chunk's backward passes in the order of its
forwards. The routers are addressed by slot (their order over this rank's chunks) rather than through
Megatron's global instance list, which would mix the policy with the reference model and any frozen copy.

Layout. Generation runs with SP and CP off (megatron_rl/generation/layout.py), so a router sees whole
sequences: ``RouteRecorder`` stores ``[row, position, slot, topk]``. A training micro-batch carries its rows'
routes as ``batch["routes"]`` ``[b, s, slots, topk]``; context parallelism slices it with the other per-token
entries, and ``replay`` takes this rank's sequence-parallel part with Megatron's own
``scatter_to_sequence_parallel_region``, the split the embedding output gets. Pipeline stages record and
replay only their own layers' slots.

Not covered: TE's fused router (``moe_router_fusion``, which bypasses the replay hook) and recompute through
``te_checkpoint`` (FP8 training): both are GPU-only and unverified.

Test: ``.venv/bin/python -m pytest tests/test_router_replay.py -q``
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

NO_ROUTE = -1
"""Route entry of a token generation never fed (training padding): it is routed by the current router."""


def _recomputing() -> bool:
    """Inside a backward-pass recompute of Megatron's ``CheckpointFunction`` (its forward runs without grad)."""
    from megatron.core.tensor_parallel.random import is_checkpointing

    return is_checkpointing() and torch.is_grad_enabled()


class RolloutRouterReplay(RouterReplay):
    """Megatron's ``RouterReplay`` for one router, with ``NO_ROUTE`` entries and recompute-safe replay."""

    def __init__(self, slot: int) -> None:
        # RouterReplay.__init__ also registers in the global list, which this module does not use (see above)
        self.target_topk_idx: Optional[torch.Tensor] = None
        self.recorded_topk_idx: Optional[torch.Tensor] = None
        self.router_replay_action: Optional[RouterReplayAction] = None
        self.replay_backward_list: list[torch.Tensor] = []
        self.recorded_parts: list[torch.Tensor] = []
        self.slot = slot

    def record_indices(self, topk_indices: torch.Tensor) -> None:
        """Every forward's indices until cleared: a pipelined decode step runs its rows in several parts."""
        self.recorded_topk_idx = topk_indices
        self.recorded_parts.append(topk_indices)

    def clear_indices(self) -> None:
        super().clear_indices()
        self.recorded_parts = []

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        action = self.router_replay_action
        if action not in (RouterReplayAction.REPLAY_FORWARD, RouterReplayAction.REPLAY_BACKWARD):
            return super().get_replay_topk(scores, topk, num_groups, group_topk, default_compute_topk)
        if action == RouterReplayAction.REPLAY_BACKWARD or _recomputing():
            target = self.replay_backward_list.pop(0)
        else:
            target = self.target_topk_idx
        _, computed = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        target = target.to(device=scores.device, dtype=computed.dtype)
        indices = torch.where(target[:, :1] == NO_ROUTE, computed, target)
        return scores.gather(1, indices), indices


def _topk_routers(chunk) -> list:
    from megatron.core.transformer.moe.router import TopKRouter

    from megatron_rl.models import unwrap

    return [m for m in unwrap(chunk).modules() if isinstance(m, TopKRouter)]


def routers(chunk) -> list:
    """The ``RolloutRouterReplay`` of each MoE layer of ``chunk``, in layer order ([] when not installed)."""
    return [r.router_replay for r in _topk_routers(chunk) if isinstance(r.router_replay, RolloutRouterReplay)]


def install(chunks: list) -> int:
    """Give every router of this rank's ``chunks`` (built with ``moe_enable_routing_replay``) a
    ``RolloutRouterReplay``, slots numbered over the chunks in order; return the number of slots."""
    slot = 0
    replaced = []
    for chunk in chunks:
        for router in _topk_routers(chunk):
            replaced.append(router.router_replay)
            router.router_replay = RolloutRouterReplay(slot)
            slot += 1
    RouterReplay.global_router_replay_instances[:] = [
        r for r in RouterReplay.global_router_replay_instances if not any(r is old for old in replaced)]
    return slot


class RouteRecorder:
    """Records the experts each fed position of a generation batch was routed to, on the batch's device.

    ``take_tokens(rows, positions)`` after each packed forward of the paged engine; ``rows(lengths)`` gives
    each row's first ``lengths[i]`` positions as ``[length, slots, topk]`` int16 on the CPU."""

    def __init__(self, chunks: list, *, batch: int, total: int, device: torch.device) -> None:
        self.chunk_replays = [routers(chunk) for chunk in chunks]
        self.replays = [r for replays in self.chunk_replays for r in replays]
        if not self.replays:
            raise ValueError("record_routes needs an MoE model built with router replay (algorithm.router_replay)")
        self.batch = batch
        self.slots = max(r.slot for r in self.replays) + 1
        self.routes: Optional[torch.Tensor] = None
        self.device = device
        self.total = total
        for replay in self.replays:
            replay.set_router_replay_action(RouterReplayAction.RECORD)

    def take_tokens(self, rows: torch.Tensor, positions: torch.Tensor, *, chunk: Optional[int] = None) -> None:
        """After a packed forward (the paged engine): fed token i belonged to batch row ``rows[i]`` at position
        ``positions[i]`` (tokens past ``len(rows)`` were an expert-parallel lockstep's padding); ``chunk``: only
        that chunk (virtual stage) of this rank ran."""
        for replay in self.replays if chunk is None else self.chunk_replays[chunk]:
            parts = replay.recorded_parts  # each [tokens, topk], in the packed token order
            per_token = torch.cat(parts)[:rows.numel()].to(torch.int16)
            if self.routes is None:
                self.routes = torch.full((self.batch, self.total, self.slots, per_token.size(-1)), NO_ROUTE,
                                         dtype=torch.int16, device=self.device)
            self.routes[rows, positions, replay.slot] = per_token
            replay.clear_indices()

    def copy_prefix(self, source: int, targets: list[int], positions: int) -> None:
        """Rows ``targets`` share row ``source``'s first ``positions`` positions (a prompt prefilled once)."""
        if self.routes is not None and targets:
            self.routes[targets, :positions] = self.routes[source, :positions]

    def rows(self, lengths: list[int]) -> list[torch.Tensor]:
        routes = self.routes.cpu()
        return [routes[i, :n].clone() for i, n in enumerate(lengths)]

    def close(self) -> None:
        _release(self.replays)


def replay(chunk, routes: torch.Tensor) -> None:
    """Make ``chunk``'s next forward (and its recompute) route by ``routes`` ``[b, s, slots, topk]``: this
    rank's micro-batch, already sliced for context parallelism."""
    from megatron.core.tensor_parallel import scatter_to_sequence_parallel_region

    replays = routers(chunk)
    if not replays:
        return
    sequence_first = routes.transpose(0, 1).contiguous()  # [s, b, slots, topk], the layers' token order
    if _sequence_parallel(chunk):
        sequence_first = scatter_to_sequence_parallel_region(sequence_first)
    for r in replays:
        r.set_target_indices(sequence_first[:, :, r.slot].reshape(-1, sequence_first.size(-1)).long())
        r.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)


def _sequence_parallel(chunk) -> bool:
    from megatron_rl.models import unwrap

    return bool(unwrap(chunk).config.sequence_parallel)


@contextlib.contextmanager
def routes_released(chunks: list):
    """Forget the replayed routes of ``chunks`` when a schedule ends (they hold a rollout's worth of indices)."""
    try:
        yield
    finally:
        _release([r for chunk in chunks for r in routers(chunk)])


def _release(replays: list) -> None:
    for r in replays:
        r.clear_indices()
        r.clear_router_replay_action()
