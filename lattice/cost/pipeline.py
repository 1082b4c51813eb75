"""Pipeline parallelism in the cost model (docs/references.md#megatron-lm §2.2, §3): the point-to-point traffic of
each stage and the micro-batches it holds in flight (a pipelined step's time: lattice.planner.pricing)."""

from __future__ import annotations

from lattice.cost.model import estimate
from lattice.cost.stages import stage_sends
from lattice.modes import get_mode
from lattice.modes.layout import Layout
from lattice.parallel.context import MeshAxis
from lattice.parallel.pipeline_config import PipelineConfig


def p2p_piece(cfg, layout: Layout, *, batch: int, seq: int | None = None) -> float:
    """Elements of one micro-batch's residual piece that a tensor rank of the pipelined `layout`
    sends to the next stage: B/m · T/cp · h over the layout's residual split (the cost model's
    figure; `batch` is a replica's), divided by the t tensor ranks that replicate it under the
    scatter/gather optimisation."""
    pcfg, stage = layout.pipeline, layout.stage_layout()
    piece = estimate(cfg, stage, batch=batch // pcfg.m, seq=(seq or cfg.seq_len) // layout.cp).residual_elements
    replicated = get_mode(layout.mode)(cfg, stage.context()).residual_replicated
    return piece / layout.tp if pcfg.scatter_gather and replicated and layout.tp > 1 else piece


def p2p_elements(cfg, layout: Layout, *, batch: int, stage: int, seq: int | None = None) -> dict[str, float]:
    """What one rank of `stage` sends point-to-point in one step (see p2p_piece, stage_sends)."""
    return stage_sends(layout.pipeline, stage, p2p_piece(cfg, layout, batch=batch, seq=seq))


def stage_p2p(cfg, layout: Layout, batch: int, stage: int) -> dict[str, float]:
    """What a rank of `stage` sends point-to-point in one step, from the cost model of that rank
    (every tensor crossing its boundaries: an encoder-decoder's decoder stages send the memory
    beside their stream)."""
    coords = {axis: 0 for axis, _ in layout.topology.axes} | {MeshAxis.PP: stage}
    terms = estimate(cfg, layout, batch=batch, rank=layout.topology.rank_at(coords)).terms
    return {phase: sum(t.elements for t in terms if t.op == "send" and t.phase == phase)
            for phase in ("forward", "backward")}


def in_flight(pcfg: PipelineConfig, stage: int) -> int:
    """Micro-batches whose activations a stage holds at its peak: all m under GPipe; under 1F1B
    the warm-up depth p - stage (at most m); interleaved, Megatron's warm-up of
    (p - stage - 1) * 2 + (v - 1) * p forwards plus the current one, in chunk-forwards (at most v m)."""
    p, m, v = pcfg.stages, pcfg.m, pcfg.v
    if pcfg.schedule == "gpipe":
        return m
    if pcfg.schedule == "1f1b":
        return min(m, p - stage)
    return min(v * m, (p - stage - 1) * 2 + (v - 1) * p + 1)
