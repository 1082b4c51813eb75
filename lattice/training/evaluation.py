"""Validation, written once for the trainer and `lattice eval`: the mean loss over fixed batches
and the task's score, each the mean over data-parallel replicas, identical on every rank."""

from __future__ import annotations

from contextlib import nullcontext

import torch

from lattice.parallel.comm import raw_all_reduce
from lattice.parallel.context import MeshAxis, ParallelContext


def autocast(ctx: ParallelContext, bf16: bool):
    return torch.autocast(device_type=ctx.device.type, dtype=torch.bfloat16) if bf16 else nullcontext()


def dp_mean(value: torch.Tensor, ctx: ParallelContext) -> float:
    """Mean over data-parallel replicas of a per-replica scalar (identical on every rank)."""
    value = value.detach().to(torch.promote_types(value.dtype, torch.float32)).reshape(1)
    if ctx.dp > 1:
        value = raw_all_reduce(value.clone(), ctx.group(MeshAxis.DP)) / ctx.dp
    return float(value)


def replica_weight(model, batch, ctx: ParallelContext) -> float:
    """dp x this replica's labelled targets / the global batch's (lattice.data.batches.Batch): the
    weight of the replica's mean loss by which the replicas' average is the global batch's mean
    (1 with equal counts, as without padding)."""
    if ctx.dp == 1:
        return 1.0
    mine = model.labelled_count(model.unpadded_targets(batch.targets, batch.inputs.get("attention_mask")))
    return ctx.dp * int(mine) / max(batch.labelled, 1)


@torch.no_grad()
def evaluate(model, batches, ctx: ParallelContext, *, bf16: bool = False) -> float:
    """Mean loss of `model` over `batches` (each this replica's lattice.data.batches.Batch), each
    batch's the mean over its labelled targets, identical on every rank. No optimizer, no
    data-parallel wrapper: `lattice eval` calls this directly."""
    model.eval()
    with autocast(ctx, bf16):
        total = sum(model(b.tokens, b.targets, **b.inputs).double() * replica_weight(model, b, ctx)
                    for b in batches) / len(batches)  # summed in float64, as the train loss is
    model.train()
    return dp_mean(total, ctx)


def validation_metric(task, ctx: ParallelContext) -> tuple[str | None, str | None]:
    """(the score validation reports beside the loss, or None; why the task's score is left out
    in this layout, or None). A pipeline cannot score (scoring runs every stage at once), and
    context parallelism cannot generate (each new token attends to every position before it)."""
    if not task.metric:
        return None, None
    if ctx.pipeline is not None:
        return None, f"with --pp {ctx.pp} validation reports the loss only"
    if ctx.cp > 1 and getattr(task, "scored_by_generation", False):
        return None, f"with --cp {ctx.cp} validation reports the loss only ({task.metric} is scored by generation, " \
                     f"which runs with cp = 1)"
    return task.metric, None


def task_score(task, model, batches, ctx: ParallelContext, *, bf16: bool = False) -> float:
    """The task's score of `batches` (this replica's) over every replica: the accuracy of a
    classifier, the exact match of an encoder-decoder's greedy outputs."""
    with autocast(ctx, bf16):
        return dp_mean(task.score(model, batches), ctx)
