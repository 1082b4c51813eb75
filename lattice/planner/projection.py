"""One step of a pipelined layout as the planner prices it, with what `lattice plan` shows beside
it: the split, each stage's point-to-point traffic and a micro-batch's activations."""

from __future__ import annotations

import dataclasses

from lattice.cost.machine import Machine
from lattice.cost.model import estimate
from lattice.cost.pipeline import stage_p2p
from lattice.modes import get_mode
from lattice.modes.layout import Layout
from lattice.parallel.context import LatticeConfigError
from lattice.parallel.pipeline import batch_problem
from lattice.planner.pricing import Choice, price


def pipeline_projection(cfg, layout: Layout, *, batch: int, machine: Machine, setup: dict | None = None) -> dict:
    """One step of `layout` (tp x pp ranks per replica, docs/references.md#megatron-lm §2.2, §3) on `batch` sequences
    per replica, as the planner prices it (lattice.planner.pricing.price: each stage its blocks and
    the end parts it holds, paced by the slowest), with what `lattice plan` shows beside it: the
    split, each stage's point-to-point elements, a micro-batch's activations, and the step's
    slot (one micro-batch through the slowest chunk) and hop (its residual piece to the next
    stage and the gradient back). `setup`: Choice's zero, precision and checkpointing."""
    tp, pp, setup = layout.tp, layout.pp, setup or {}
    if pp > 1:
        pcfg = layout.pipeline
        problem = batch_problem(pcfg.m, get_mode(layout.mode), layout.context(), batch, cfg.seq_len)
        if problem:  # as training refuses it: no micro-batch of zero sequences
            raise LatticeConfigError(f"{problem}; give each replica a multiple of {pcfg.m} sequences (--batch over "
                                     f"--dp) or fewer --microbatches")
    priced = price(cfg, Choice(layout, **setup), batch=batch * layout.dp, machine=machine)
    if pp == 1:
        return {"tp": tp, "pp": 1, "m": 1, "v": 1, "schedule": "none", "bubble": 0.0, "step_s": priced.step_s}
    slots, terms = pcfg.m * pcfg.v, priced.terms
    chunks = pcfg.chunks(cfg.n_layers + getattr(cfg, "n_decoder_layers", 0))  # an encoder-decoder's two stacks
    stage = dataclasses.replace(cfg, n_layers=max(len(c) for c in chunks))  # the deepest chunk with both ends
    c = estimate(stage, layout.stage_layout(), batch=batch // pcfg.m, zero=priced.choice.zero,
                 precision=priced.choice.precision, activation_checkpointing=priced.choice.checkpointing,
                 selective_checkpointing=priced.choice.selective)
    return {"tp": tp, "pp": pp, "m": pcfg.m, "v": pcfg.v, "schedule": pcfg.schedule, "bubble": pcfg.bubble(),
            "slot_s": sum(terms[k] for k in ("compute", "tensor", "context", "overlapped")) / slots,
            "p2p_s": terms["pipeline"] / slots, "step_s": priced.step_s,
            "stage_p2p": [stage_p2p(cfg, layout, batch, s) for s in range(pp)],
            "chunks": chunks, "itemsize": c.itemsize, "per_microbatch_activations": c.memory["activations"] / pcfg.v,
            "pcfg": pcfg}
