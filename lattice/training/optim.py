"""The optimizer side of a training step, for any family in any layout: AdamW with weight decay
on matrices only, the warmup + cosine learning-rate schedule, and the global gradient norm from
the shard specs (which clipping scales every gradient to)."""

from __future__ import annotations

import math

import torch

from lattice.parallel.comm import raw_all_reduce
from lattice.parallel.context import MeshAxis
from lattice.parallel.sharding import weighted_square_sum
from lattice.parallel.zero import adamw, decays


def make_optimizer(model, *, lr: float, betas: tuple[float, float], weight_decay: float) -> torch.optim.AdamW:
    """Decay only matrices (lattice.parallel.zero.decays)."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if model.specs[name].trainable:
            (decay if decays(model.specs[name].full_shape) else no_decay).append(p)
    return adamw(decay, no_decay, lr=lr, betas=betas, weight_decay=weight_decay)


def lr_at(step: int, *, lr: float, warmup: int, steps: int, min_lr_ratio: float) -> float:
    """Linear warmup over `warmup` steps, then cosine from lr to lr * min_lr_ratio at `steps`."""
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, steps - warmup))
    low = lr * min_lr_ratio
    return low + 0.5 * (1.0 + math.cos(math.pi * progress)) * (lr - low)


@torch.no_grad()
def grad_norm(model, ctx) -> torch.Tensor:
    """Global L2 norm of the full gradient, identical on every rank.

    Each rank sums its shards' squares divided by the number of ranks in its model replica that
    hold the same shard, so replicated copies count once, and the sum is all-reduced over the
    model replica's group. After the data-parallel sync every replica holds the same gradients,
    so one replica's norm is the global one."""
    acc = torch.promote_types(model.dtype, torch.float32)
    held = [(name, p) for name, p in model.named_parameters() if p.grad is not None and not model.is_mirror(name)]
    split = [name for name, _ in held if model.specs[name].split_over_dp]
    sq = weighted_square_sum([(p.grad.detach(), model.specs[name].replicas(ctx.topology))
                              for name, p in held if name not in split], acc, ctx.device)
    if not any(spec.split_over_dp for spec in model.specs.values()):
        return raw_all_reduce(sq, ctx.model_group()).reshape(()).sqrt()
    # experts split over the replicas: each replica's own pieces add up, the rest counts once
    mine = weighted_square_sum([(p.grad.detach(), model.specs[name].replicas(ctx.topology))
                                for name, p in held if name in split], acc, ctx.device)
    sq = raw_all_reduce(raw_all_reduce(torch.cat([sq, mine]), ctx.model_group()), ctx.group(MeshAxis.DP))
    return (sq[0] / ctx.dp + sq[1]).sqrt()


@torch.no_grad()
def clip_grads(model, norm: torch.Tensor, max_norm: float) -> None:
    """Scale every gradient by min(1, max_norm / norm) (the global norm, so every rank alike), in
    one fused multiply per device and dtype."""
    torch.nn.utils.clip_grads_with_norm_(list(model.parameters()), max_norm, norm, foreach=True)
