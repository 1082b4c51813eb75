"""A pipeline stage in the cost model (docs/references.md#megatron-lm §2.2, §4.1): the point-to-point traffic of a
stage's chunks and the terms the pipeline adds to a stage's tensor-parallel ones."""

from __future__ import annotations

import math

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


def boundary_sends(b) -> dict[str, list[float]]:
    """The elements of each tensor one rank of this stage sends point-to-point for one
    micro-batch: forward, what crosses the boundary after each of its chunks but the last;
    backward, the gradients of what crosses the boundary before each but the first (the residual
    stream, and an encoder-decoder's memory beside the decoder's: Model.boundary_shapes)."""
    pcfg, stage = b.c.pipeline, b.c.stage
    chunks = pcfg.chunks(len(b.model.pipeline_blocks()))
    n, mine = len(chunks), range(stage, len(chunks), pcfg.stages)

    def pieces(after):
        return [math.prod(s) for s in b.model.boundary_shapes(after, b.B, b.c.seq // b.cp, b.target_T)]

    def cut(after):
        return list(b.model.boundary_scattered(after))

    return {"forward": [e for k in mine if k < n - 1 for e in pieces(chunks[k][-1])],
            "backward": [e for k in mine if k > 0 for e in pieces(chunks[k][0] - 1)],
            "forward_cut": [c for k in mine if k < n - 1 for c in cut(chunks[k][-1])],
            "backward_cut": [c for k in mine if k > 0 for c in cut(chunks[k][0] - 1)]}


def pipeline_terms(b) -> None:
    """What the pipeline adds to a stage's terms (b: the CostBuilder): the tensors sent
    point-to-point (`boundary_sends`, once per micro-batch), their all-gather on arrival under the
    scatter/gather optimisation (and in backward on the sending side), the gradients of shared
    parameters summed between the first and the last stage (those every stage holds: over the
    pipeline), and the loss broadcast from the last stage."""
    c, pcfg, PP = b.c, b.c.pipeline, MeshAxis.PP
    tensor_axes, m = b.topo.tensor_axes, pcfg.m
    scatter = pcfg.scatter_gather and b.mode.residual_replicated and b.p > 1
    sends = boundary_sends(b)
    for phase in ("forward", "backward"):
        tensors, cut = sends[phase], sends[f"{phase}_cut"]
        if tensors:
            sent = m * sum(e / (b.p if scatter and s else 1) for e, s in zip(tensors, cut))
            c.terms.append(Term(phase, "send", (PP,), m * len(tensors), sent, "pipeline", c.itemsize))
    if scatter:  # gathered where a piece arrives: forward into every chunk but the first, backward the reverse
        for phase, side in (("forward", "backward"), ("backward", "forward")):
            arrivals = [e for e, s in zip(sends[side], sends[f"{side}_cut"]) if s]
            if arrivals:
                c.terms.append(Term(phase, "all_gather", tensor_axes, m * len(arrivals), m * sum(arrivals), "pipeline",
                                    c.itemsize))
    params = b.params
    for name in b.model.parts_.everywhere:
        if name in params:
            c.terms.append(Term("backward", "all_reduce", (PP,), 1, params[name].numel(), "grads", c.itemsize))
    shared = b.model.parts_.shared
    if shared and (b.first or b.last) and not (b.first and b.last):
        for name in shared:
            if name in params:  # over the pp group (two stages) or the first and last stage's pair
                c.terms.append(Term("backward", "all_reduce", (PP,), 1, params[name].numel(), "grads", c.itemsize,
                                    ranks=2))
    c.terms.append(Term("forward", "broadcast", (PP,), 1, 1, "loss", max(4, c.itemsize)))
    if b.cp > 1:  # each cp rank's part of the replica's mean, summed
        c.terms.append(Term("forward", "all_reduce", (MeshAxis.CP,), 1, 1, "loss", max(4, c.itemsize)))
