"""Pipeline parallelism in the cost model (papers/002 §2.2, §3): the point-to-point traffic of
each stage, the micro-batches it holds in flight, and a step's projected time for a tp x pp split."""

from __future__ import annotations

import dataclasses

from lattice.cost.machine import Machine
from lattice.cost.model import estimate
from lattice.cost.stages import stage_sends
from lattice.modes import get_mode
from lattice.modes.layout import Layout
from lattice.parallel.context import LatticeConfigError, MeshAxis
from lattice.parallel.pipeline import PipelineConfig, batch_problem


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


def _stage_p2p(cfg, layout: Layout, batch: int, stage: int) -> dict[str, float]:
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


def pipeline_projection(cfg, layout: Layout, *, batch: int, machine: Machine) -> dict:
    """One step of tp x pp ranks per replica (papers/002 §2.2, §3): each stage runs its L/pp
    blocks on micro-batches of B/m sequences under the tensor layout (this module's estimate,
    forward and backward; the embedding on the first stage and the head on the last); the
    schedule takes (m + p - 1) micro-batch slots of the slowest stage, (m + (p - 1)/v) with
    interleaving; each slot adds the point-to-point transfer of one residual piece (scatter /
    gather applied) over the link between stages; the AdamW update follows."""
    tp, pp, stage = layout.tp, layout.pp, layout.stage_layout()
    if pp == 1:  # no pipeline: the whole batch through the tensor layout
        c = estimate(cfg, stage, batch=batch)
        return {"tp": tp, "pp": 1, "m": 1, "v": 1, "schedule": "none", "bubble": 0.0, "step_s": c.time(machine)["step"]}
    pcfg = layout.pipeline
    problem = batch_problem(pcfg, get_mode(layout.mode), layout.context(), batch, cfg.seq_len)
    if problem:  # as training refuses it: no micro-batch of zero sequences
        raise LatticeConfigError(f"{problem}; give each replica a multiple of {pcfg.m} sequences (--batch over "
                                 f"--dp) or fewer --microbatches")
    chunks = pcfg.chunks(cfg.n_layers + getattr(cfg, "n_decoder_layers", 0))  # an encoder-decoder's two stacks
    blocks = max(len(c) for c in chunks)
    stage_cfg = dataclasses.replace(cfg, n_layers=blocks)
    c = estimate(stage_cfg, stage, batch=batch // pcfg.m)
    t = c.time(machine)
    slot = t["forward"] + t["backward"]  # one micro-batch through the slowest chunk (head included: an upper bound)
    piece = p2p_piece(cfg, layout, batch=batch)
    stage_p2p = [_stage_p2p(cfg, layout, batch, s) for s in range(pp)]
    inter = tp * pp > machine.ranks_per_node  # stages on other nodes once a replica leaves its node
    alpha, beta = machine.link(inter)
    # activation forward, gradient backward, and the schedule's own time for the chunk
    hop = 2 * (alpha + piece * c.itemsize * beta) + machine.pipeline_action(pcfg.schedule)
    slots = pcfg.m * pcfg.v + pp - 1
    pipeline_time = slots * (slot / pcfg.v + hop)
    update = t["update"]  # the stage's own parameters (its blocks and both end parts: an upper bound)
    return {"tp": tp, "pp": pp, "m": pcfg.m, "v": pcfg.v, "schedule": pcfg.schedule, "bubble": pcfg.bubble(),
            "slot_s": slot / pcfg.v, "p2p_s": hop, "step_s": pipeline_time + update, "stage_p2p": stage_p2p,
            "chunks": chunks, "itemsize": c.itemsize, "per_microbatch_activations": c.memory["activations"] / pcfg.v,
            "pcfg": pcfg}
