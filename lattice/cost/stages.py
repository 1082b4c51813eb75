"""A pipeline stage in the cost model (papers/002 §2.2, §4.1): the point-to-point traffic of a
stage's chunks and the terms the pipeline adds to a stage's tensor-parallel ones."""

from __future__ import annotations

from lattice.cost.machine import Term
from lattice.parallel.context import MeshAxis


def stage_sends(pcfg, stage: int, piece: float) -> dict[str, float]:
    """Elements one rank of `stage` sends point-to-point in one step: forward, each micro-batch's
    piece out of every chunk it holds but the last; backward, the same gradient out of every
    chunk but the first."""
    n = pcfg.stages * pcfg.v
    mine = range(stage, n, pcfg.stages)
    return {"forward": pcfg.m * piece * sum(1 for k in mine if k < n - 1),
            "backward": pcfg.m * piece * sum(1 for k in mine if k > 0)}


def pipeline_terms(b) -> None:
    """What the pipeline adds to a stage's terms (b: the CostBuilder): the residual sent
    point-to-point (`stage_sends`), its all-gather on arrival under the scatter/gather
    optimisation (and in backward on the sending side), the gradients of shared parameters summed
    between the first and the last stage, and the loss broadcast from the last stage."""
    c, pcfg, PP = b.c, b.c.pipeline, MeshAxis.PP
    piece, tensor_axes = b.residual, b.topo.tensor_axes
    scatter = pcfg.scatter_gather and b.mode.residual_replicated and b.p > 1
    calls = stage_sends(pcfg, c.stage, 1)  # one send per micro-batch and chunk boundary
    for phase in ("forward", "backward"):
        if calls[phase]:
            sent = calls[phase] * (piece / b.p if scatter else piece)
            c.terms.append(Term(phase, "send", (PP,), calls[phase], sent, "pipeline", c.itemsize))
    if scatter:  # gathered where a piece arrives: forward into every chunk but the first, backward the reverse
        for phase, arrivals in (("forward", calls["backward"]), ("backward", calls["forward"])):
            if arrivals:
                c.terms.append(Term(phase, "all_gather", tensor_axes, arrivals, arrivals * piece, "pipeline",
                                    c.itemsize))
    shared = b.model.parts_.shared
    if shared and (b.first or b.last) and not (b.first and b.last):
        params = dict(b.model.named_parameters())
        for name in shared:
            if name in params:  # over the pp group (two stages) or the first and last stage's pair
                c.terms.append(Term("backward", "all_reduce", (PP,), 1, params[name].numel(), "grads", c.itemsize,
                                    ranks=2))
    c.terms.append(Term("forward", "broadcast", (PP,), 1, 1, "loss", max(4, c.itemsize)))
