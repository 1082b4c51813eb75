"""The papers' tables from the cost model: Optimus Table 1 as printed beside the model's rows for
every mode, and SUPER's message counts (Eq. 3-7) against counting on the layouts."""

from __future__ import annotations

import itertools

from lattice.cost.model import estimate
from lattice.models.gpt2 import GPTConfig
from lattice.modes import available_modes, get_mode, parallel_modes
from lattice.parallel.context import LatticeConfigError, Topology


def optimus_table1(b: int, s: int, h: int, p: int) -> dict[str, dict[str, float]]:
    """Optimus Table 1 as printed, for the modes it has a row for (each mode states its own row,
    `Mode.optimus_table1_row`): one Transformer layer, activation checkpointing, scalars moved per
    rank (communication) and scalar multiplications per rank (computation)."""
    rows = {m: get_mode(m).optimus_table1_row(b, s, h, p) for m in available_modes()}
    return {m: row for m, row in rows.items() if row is not None}


def layer_table(b: int, s: int, h: int, p: int, **options) -> dict[str, dict[str, float]]:
    """Table 1's rows from this model, for every registered mode whose layout fits p: one layer
    with activation checkpointing, wire words per rank of its linear layers and of its branch
    boundaries (sites "layer.linear" and "layer.branch"), and scalar multiplications per rank.
    "backward" recomputes the whole forward as Table 1 does; "backward_as_run" is lattice's, whose
    checkpoint stops the recomputation after the last tensor saved for backward (1D then skips
    the MLP's all-reduce). Each mode at its paper's options (`Mode.paper_options`); `options` go to
    the modes that take them (e.g. subgrids=4)."""
    cfg = GPTConfig(vocab_size=8, seq_len=s, d_model=h, n_heads=h, n_layers=1)
    out = {}
    for mode in parallel_modes():
        taken = get_mode(mode).options
        extra = {**get_mode(mode).paper_options, **get_mode(mode).fit_options(cfg, p),
                 **{k: v for k, v in options.items() if k in taken}}
        try:
            c = estimate(cfg, mode, batch=b, tp=p, activation_checkpointing=True, **extra)
        except LatticeConfigError:
            continue
        plain = estimate(cfg, mode, batch=b, tp=p, **extra)

        def wire(cost, phase):
            return cost.wire(phase, site="layer.linear") + cost.wire(phase, site="layer.branch")

        fwd = wire(plain, "forward")
        layer = (8 * b * s * h * h + 4 * b * s * s * h + 16 * b * s * h * h) / p / 2  # multiplications
        # the paper recomputes the whole forward; torch's checkpoint stops after the last saved tensor
        out[mode] = {"forward": fwd, "backward": fwd + wire(plain, "backward"),
                     "backward_as_run": wire(c, "backward"), "forward_mults": layer, "backward_mults": 3 * layer}
    return out


def super_messages(n: int, g: int, n_node: int, topology_aware: bool) -> tuple[int, int]:
    """SUPER Eq. 4-7: (intra-node, inter-node) messages of one segmented collective over n
    processes in g sub-grids of n_g = n/g, n_node processes per node. Eq. 4-5 (natural placement)
    are printed with the cases "n_g <= n_node" / "n_g > n_node" but hold the other way round (at
    n_g = n_node both agree); counted on the layout they match as written here."""
    n_g = n // g
    if topology_aware:
        return (n * g, 0) if g <= n_node else (n * n_node, n * (g - n_node))
    return (n, n * (g - 1)) if n_g >= n_node else (n_node * g, (n - n_node) * g)


def count_messages(topo: Topology, axes) -> tuple[int, int]:
    """SUPER Eq. 3 counted on a layout: every rank exchanges one message with each member of its
    group along `axes` (itself included); (intra-node, inter-node) totals over all ranks."""
    intra = inter = 0
    for rank in range(topo.world_size):
        coords = topo.coords(rank)
        for ks in itertools.product(*(range(topo.size(a)) for a in axes)):
            other = topo.rank_at({**coords, **dict(zip(axes, ks))})
            if topo.node_of(other) == topo.node_of(rank):
                intra += 1
            else:
                inter += 1
    return intra, inter
