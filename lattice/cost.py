"""Analytic cost of one training step, per rank: communication, computation, memory, time.

    cost = estimate(cfg, "2d", batch=8, tp=4)
    cost.elements(phase="forward")            # CommMeter units (see lattice/comm.py)
    cost.flops, cost.memory, cost.time(machine)

Every figure is derived from the papers and the layout, never from a run. Communication is a list
of `Term`s (phase, collective, mesh axes, calls, elements) in CommMeter's units -- elements of the
logical buffer per call: the tensor for all-reduce / broadcast / reduce / all-to-all, the gathered
output for all-gather, the full input for reduce-scatter -- so measured / analytic is a ratio of
like with like. `wire()` converts to the papers' per-rank volume (ring all-reduce 2(n-1)/n,
all-gather / reduce-scatter / all-to-all (n-1)/n, tree broadcast / reduce log2 n), in which
`optimus_table1` reproduces Table 1 of Optimus (papers/000).

Symbols: B sequences of T tokens per replica, h = d_model, n heads, L layers, V' the vocabulary
padded to what the layout divides, p ranks per replica (q = √p in 2D, ∛p in 3D), m = tokens
per rank block. FLOPs count matrix products only (2 per multiply-add); backward is twice the
forward, plus one forward of every layer under activation checkpointing.
"""

from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass, field

import torch

from lattice.config import PRESETS, GPTConfig
from lattice.context import LatticeConfigError, MeshAxis, Topology
from lattice.sharding import grad_sum_buckets

DP = MeshAxis.DP
DDP_BUCKET_BYTES = 25 * 2 ** 20  # torch DDP's default gradient bucket


@dataclass(frozen=True)
class Term:
    """`calls` collectives of one kind at one site of the model, per rank, moving `elements` in all."""

    phase: str  # "forward" | "backward"
    op: str  # CommMeter op name
    axes: tuple[MeshAxis, ...]  # the group: ranks that differ only along these mesh axes
    calls: float
    elements: float
    site: str  # embedding | layer.linear | layer.bias | layer.norm | layer.branch | head | loss | grads
    itemsize: int = 4

    @property
    def bytes(self) -> float:
        return self.elements * self.itemsize


# ----------------------------------------------------------------------------- collective algorithms


def wire_factor(op: str, n: int) -> float:
    """Per-rank words on the wire per element of the CommMeter buffer: ring algorithms for
    all-reduce (Optimus Eq. 5), all-gather, reduce-scatter and all-to-all; a binomial tree for
    broadcast and reduce (Optimus Eq. 4)."""
    if n <= 1:
        return 0.0
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    if op in ("broadcast", "reduce"):
        return math.log2(n)
    raise ValueError(f"unknown collective {op!r}")


def message_steps(op: str, n: int) -> int:
    """Sequential point-to-point steps (latency terms α) of one call under the same algorithms."""
    if n <= 1:
        return 0
    if op == "all_reduce":
        return 2 * (n - 1)
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return n - 1
    return math.ceil(math.log2(n))


def _algorithm(op: str, n: int, pipelined: bool) -> tuple[float, float]:
    """(latency steps, wire words per element) of one call. A pipelined broadcast / reduce (NCCL's
    ring) moves each element once per rank, over n - 1 steps, instead of a tree's log2 n times."""
    if pipelined and op in ("broadcast", "reduce") and n > 1:
        return n - 1, 1.0
    return message_steps(op, n), wire_factor(op, n)


@dataclass(frozen=True)
class Machine:
    """α-β-F machine: latency α (s per message) and inverse bandwidth β (s per byte) inside a node
    and between nodes, and per rank: the matrix-product rate F (FLOP/s), the rate of elementwise
    operators (LayerNorm, GELU, bias and residual adds, softmax: elements/s), of causal attention
    (score elements B·n·T² per second, forward), and the optimizer update's cost per parameter
    tensor (s) and memory bandwidth (bytes/s). Backward runs at the same rates (twice the work)."""

    name: str
    flop_rate: float
    alpha_intra: float
    beta_intra: float
    alpha_inter: float
    beta_inter: float
    ranks_per_node: int
    elem_rate: float = 1e9
    attn_rate: float = 1e9
    update_per_tensor: float = 0.0
    mem_bandwidth: float = 10e9
    pipelined_broadcast: bool = False  # True: broadcast / reduce as pipelined rings (NCCL), else trees

    def describe(self) -> str:
        return (f"{self.name}: F = {self.flop_rate / 1e9:.3g} GFLOP/s, elementwise {self.elem_rate / 1e9:.3g} "
                f"G elements/s, attention {self.attn_rate / 1e9:.3g} G scores/s, update {self.update_per_tensor * 1e6:.3g} µs per tensor + "
                f"{self.mem_bandwidth / 1e9:.3g} GB/s (per rank); intra-node α = {self.alpha_intra * 1e6:.3g} µs, "
                f"β = 1/({1e-9 / self.beta_intra:.3g} GB/s); inter-node α = {self.alpha_inter * 1e6:.3g} µs, "
                f"β = 1/({1e-9 / self.beta_inter:.3g} GB/s); {self.ranks_per_node} ranks per node; "
                f"{'pipelined' if self.pipelined_broadcast else 'tree'} broadcast / reduce")


# A GPU cluster like the papers' (4 GPUs per node: Frontera RTX, Longhorn V100), for projections.
PAPER_CLUSTER = Machine("4-GPU nodes, InfiniBand EDR", flop_rate=30e12, alpha_intra=10e-6,
                        beta_intra=1 / 40e9, alpha_inter=20e-6, beta_inter=1 / 10e9, ranks_per_node=4,
                        elem_rate=60e9, attn_rate=60e9, update_per_tensor=10e-6, mem_bandwidth=700e9, pipelined_broadcast=True)


# ----------------------------------------------------------------------------- the estimate


@dataclass
class Cost:
    """One training step (forward, backward, optimizer update) of one rank."""

    mode: str
    cfg: GPTConfig
    batch: int
    seq: int
    topology: Topology
    options: dict
    itemsize: int
    checkpointing: bool
    terms: list[Term] = field(default_factory=list)
    flops: dict[str, float] = field(default_factory=dict)  # forward, backward
    elementwise: dict[str, float] = field(default_factory=dict)  # elements through non-matmul operators
    scores: dict[str, float] = field(default_factory=dict)  # attention score elements (B·n·T² share)
    stem: dict[str, dict[str, float]] = field(default_factory=dict)  # the same for the layers alone
    memory: dict[str, float] = field(default_factory=dict)  # bytes: parameters, gradients, optimizer, activations
    param_tensors: int = 0  # parameter tensors on this rank (the optimizer's per-tensor work)
    residual_elements: float = 0.0  # this rank's piece of the residual stream between blocks, B·T·h / split

    def _select(self, phase=None, op=None, site=None):
        return [t for t in self.terms if (phase is None or t.phase == phase) and (op is None or t.op == op)
                and (site is None or t.site == site or t.site.startswith(site + "."))]

    def group_size(self, axes) -> int:
        return math.prod(self.topology.size(a) for a in axes)

    def elements(self, phase=None, op=None, site=None) -> float:
        return sum(t.elements for t in self._select(phase, op, site))

    def bytes(self, phase=None, op=None, site=None) -> float:
        return sum(t.bytes for t in self._select(phase, op, site))

    def calls(self, phase=None, op=None, site=None) -> float:
        return sum(t.calls for t in self._select(phase, op, site))

    def wire(self, phase=None, op=None, site=None) -> float:
        """Per-rank words on the wire, the papers' unit (Optimus Table 1)."""
        return sum(t.elements * wire_factor(t.op, self.group_size(t.axes)) for t in self._select(phase, op, site))

    def messages(self, phase=None, op=None, site=None) -> float:
        """Point-to-point message steps per rank under the ring / tree algorithms."""
        return sum(t.calls * message_steps(t.op, self.group_size(t.axes)) for t in self._select(phase, op, site))

    def summary(self) -> dict[tuple[str, str, int], dict[str, float]]:
        """{(phase, op, group size): {calls, elements, bytes}}, CommMeter.summary()'s shape."""
        out: dict = {}
        for t in self.terms:
            row = out.setdefault((t.phase, t.op, self.group_size(t.axes)), {"calls": 0, "elements": 0, "bytes": 0})
            row["calls"] += t.calls
            row["elements"] += t.elements
            row["bytes"] += t.bytes
        return out

    def spans_nodes(self, axes) -> bool:
        """Whether some group along `axes` has ranks on more than one node."""
        topo = self.topology
        for rank in range(topo.world_size):
            coords = topo.coords(rank)
            nodes = {topo.node_of(topo.rank_at({**coords, **dict(zip(axes, ks))}))
                     for ks in _product([topo.size(a) for a in axes])}
            if len(nodes) > 1:
                return True
        return False

    def comm_time(self, machine: Machine, phase: str, site: str | None = None) -> float:
        total, span = 0.0, {}
        for t in self._select(phase, site=site):
            n = self.group_size(t.axes)
            if t.axes not in span:
                span[t.axes] = self.spans_nodes(t.axes)
            alpha, beta = ((machine.alpha_inter, machine.beta_inter) if span[t.axes]
                           else (machine.alpha_intra, machine.beta_intra))
            steps, words = _algorithm(t.op, n, machine.pipelined_broadcast)
            total += t.calls * steps * alpha + t.bytes * words * beta
        return total

    def time(self, machine: Machine, stem: bool = False) -> dict[str, float]:
        """Predicted seconds (no overlap of communication and computation). With stem=True, the
        Transformer layers alone (no embedding, head, loss or update), as the papers measure."""
        out = {}
        work = self.stem if stem else {"flops": self.flops, "elementwise": self.elementwise, "scores": self.scores}
        hs = self.cfg.d_model / self.cfg.n_heads
        for phase in ("forward", "backward"):
            scores = work["scores"][phase]
            linear = work["flops"][phase] - 4 * hs * scores  # QKᵀ and AV: 4·hs FLOPs per score
            out[f"{phase}_compute"] = (linear / machine.flop_rate + scores / machine.attn_rate
                                       + work["elementwise"][phase] / machine.elem_rate)
            out[f"{phase}_comm"] = self.comm_time(machine, phase, "layer" if stem else None)
            out[phase] = out[f"{phase}_compute"] + out[f"{phase}_comm"]
        if stem:
            out["step"] = out["forward"] + out["backward"]
            return out
        # AdamW reads parameter, gradient and two moments and writes three of them back
        out["update"] = (self.param_tensors * machine.update_per_tensor
                         + 7 * self.memory["parameters"] / machine.mem_bandwidth)
        out["step"] = out["forward"] + out["backward"] + out["update"]
        return out


def _product(sizes):
    if not sizes:
        yield ()
        return
    for k in range(sizes[0]):
        for rest in _product(sizes[1:]):
            yield (k,) + rest


def estimate(cfg: GPTConfig, mode: str, *, batch: int, seq: int | None = None, tp: int = 1, dp: int = 1,
             dtype: torch.dtype = torch.float32, activation_checkpointing: bool = False,
             ranks_per_node: int | None = None, placement: str = "natural", rank: int = 0,
             **options) -> Cost:
    """The analytic cost of one step of `mode` on `batch` sequences (per replica) of `seq` tokens,
    for global rank `rank` (ranks differ where a mode hosts parameters on some ranks)."""
    from lattice.layout import plan
    from lattice.model import GPT

    ctx = plan(mode, tp=tp, dp=dp, ranks_per_node=ranks_per_node, placement=placement, rank=rank, **options)
    with torch.device("meta"):  # the shard specs and local shapes, nothing allocated
        model = GPT(cfg, ctx)
    itemsize = torch.empty((), dtype=dtype).element_size()
    cost = Cost(mode, cfg, batch, seq or cfg.seq_len, ctx.topology, dict(ctx.options), itemsize,
                activation_checkpointing)
    CostBuilder(cost, model).build()
    return cost


class CostBuilder:
    """Fills a Cost. The mode describes its own layout (`Mode.cost_terms(builder)`: collectives,
    FLOP shares, saved activations, written from its paper); the builder adds what follows from
    the shard specs alone -- parameter memory and tensor count, the padded vocabulary, the
    in-replica gradient sums (`ShardSpec.grad_sum`, bucketed as `GPT.sync_grads` does) and the
    data-parallel gradient all-reduce (bucketed as DDP does).

    For the mode: B sequences of T tokens per replica, h, n heads, L layers, V, Tmax = seq_len,
    `bias`, p ranks per replica, `coords` of this rank, `vocab_padded`, `options`, `itemsize`.
    """

    def __init__(self, cost: Cost, model):
        c, cfg = cost, cost.cfg
        self.c, self.cfg, self.topo, self.model = c, cfg, c.topology, model
        self.coords = model.ctx.coords
        self.B, self.T, self.h, self.n, self.L = c.batch, c.seq, cfg.d_model, cfg.n_heads, cfg.n_layers
        self.V, self.Tmax, self.bias = cfg.vocab_size, cfg.seq_len, cfg.bias
        self.p = c.topology.tp_size
        self.options = c.options
        self.vocab_padded = model.specs["embed.wte"].storage_shape[0]
        self.residual_split = 1  # how many ranks share one replica's residual stream
        self.share: dict[str, float] = {}  # FLOP shares (see _flops)
        self.layer: list[Term] = []  # one layer's terms, forward and backward
        self.recompute: list[Term] = []  # forward terms a checkpointed layer repeats in backward

    def add(self, phase, op, axes, elements, calls=1, site="", *, layer=False, itemsize=None):
        """One term; `layer` terms are per layer (multiplied by L, forward ones recomputed under
        checkpointing unless the mode drops them from `self.recompute`)."""
        t = Term(phase, op, tuple(axes), calls, elements, site, itemsize or self.c.itemsize)
        if not layer:
            self.c.terms.append(t)
            return
        self.layer.append(t)
        if phase == "forward":
            self.recompute.append(t)

    def activations(self, per_layer: float, head: float, ints: float) -> None:
        """Bytes saved for backward: floats of the layers and the head, plus int64/bool index bytes."""
        if self.c.checkpointing:  # only each layer's input survives the forward
            per_layer = self.B * self.T * self.h / self.residual_split
        self.c.memory["activations"] = self.c.itemsize * (self.L * per_layer + head) + ints

    def build(self):
        c, L = self.c, self.L
        self.model.mode.cost_terms(self)
        c.residual_elements = self.B * self.T * self.h / self.residual_split
        for t in self.layer:
            c.terms.append(Term(t.phase, t.op, t.axes, t.calls * L, t.elements * L, t.site, t.itemsize))
        if c.checkpointing:
            for t in self.recompute:
                c.terms.append(Term("backward", t.op, t.axes, t.calls * L, t.elements * L, t.site, t.itemsize))
        params = list(self.model.parameters())
        c.memory = {"parameters": c.itemsize * sum(p.numel() for p in params), **c.memory}
        c.param_tensors = len(params)
        self._gradient_sums()
        if self.topo.size(DP) > 1:  # data-parallel gradient averaging, bucketed as DDP does
            grads = c.memory["parameters"] / c.itemsize
            self.add("backward", "all_reduce", (DP,), grads, max(1, math.ceil(grads * c.itemsize / DDP_BUCKET_BYTES)),
                     "grads")
        c.memory["gradients"] = c.memory["parameters"]
        c.memory["optimizer"] = 2 * c.memory["parameters"]  # AdamW's two moments
        self._flops()

    def _gradient_sums(self):
        """GPT.sync_grads: one all-reduce per bucket of parameters whose specs share grad_sum axes."""
        params = dict(self.model.named_parameters())
        for axes, names in grad_sum_buckets(self.model):
            if self.c.group_size(axes) > 1:
                self.add("backward", "all_reduce", axes, sum(params[n].numel() for n in names), 1, "grads")

    def _flops(self):
        """Matrix-product FLOPs of this rank: per layer 24·B·T·h² + 4·B·T²·h, LM head 2·B·T·h·V'.
        Elementwise work, in elements through each operator once: per layer LayerNorm (2), residual
        adds (2), output-linear biases (2) -- the "replicated" part, whole on every 1D rank -- and
        the qkv and fc biases (7) and GELU (4) -- the "split" part -- times B·T·h; the head's
        LayerNorm and two passes over the logits (softmax, loss). Attention is counted apart in
        score elements B·n·T² per layer. Backward is twice the forward in all three. A mode's
        `share` gives its fraction of each part (default 1/p)."""
        B, T, h, L, n = self.B, self.T, self.h, self.L, self.n
        share = self.share
        split = share.get("split", 1 / self.p)
        attention, mlp, head = (share.get(k, split) for k in ("attention", "mlp", "head"))
        replicated = share.get("replicated", split)
        attn = (8 * B * T * h * h + 4 * B * T * T * h) * attention
        mlp_flops = 16 * B * T * h * h * mlp
        head_flops = 2 * B * T * h * self.vocab_padded * head
        fwd = L * (attn + mlp_flops) + head_flops
        layer_fwd = L * (attn + mlp_flops)
        ckpt = self.c.checkpointing
        self.c.flops = {"forward": fwd, "backward": 2 * fwd + (layer_fwd if ckpt else 0)}
        act = B * T * h
        layer = act * (6 * replicated + 3 * attention + 8 * mlp)
        ew = L * layer + act * replicated + 2 * B * T * self.vocab_padded * head
        self.c.elementwise = {"forward": ew, "backward": 2 * ew + (L * layer if ckpt else 0)}
        scores = L * B * n * T * T * attention
        self.c.scores = {"forward": scores, "backward": (3 if ckpt else 2) * scores}
        self.c.stem = {"flops": {"forward": layer_fwd, "backward": (3 if ckpt else 2) * layer_fwd},
                       "elementwise": {"forward": L * layer, "backward": (3 if ckpt else 2) * L * layer},
                       "scores": self.c.scores}


# ----------------------------------------------------------------------------- the papers' tables


def optimus_table1(b: int, s: int, h: int, p: int) -> dict[str, dict[str, float]]:
    """Optimus Table 1 as printed, for the modes it has a row for (each mode states its own row,
    `Mode.optimus_table1_row`): one Transformer layer, activation checkpointing, scalars moved per
    rank (communication) and scalar multiplications per rank (computation)."""
    from lattice.modes import available_modes, get_mode

    rows = {m: get_mode(m).optimus_table1_row(b, s, h, p) for m in available_modes()}
    return {m: row for m, row in rows.items() if row is not None}


def layer_table(b: int, s: int, h: int, p: int, **options) -> dict[str, dict[str, float]]:
    """Table 1's rows from this model, for every registered mode whose layout fits p: one layer
    with activation checkpointing, wire words per rank of its linear layers and of its branch
    boundaries (sites "layer.linear" and "layer.branch"), and scalar multiplications per rank.
    "backward" recomputes the whole forward as Table 1 does; "backward_as_run" is lattice's, whose
    checkpoint stops the recomputation after the last tensor saved for backward (1D then skips
    the MLP's all-reduce). `options` go to the modes that take them (e.g. subgrids=4)."""
    from lattice.modes import get_mode, parallel_modes

    cfg = GPTConfig(vocab_size=8, seq_len=s, d_model=h, n_heads=h, n_layers=1)
    out = {}
    for mode in parallel_modes():
        taken = get_mode(mode).options
        extra = {**get_mode(mode).fit_options(cfg, p), **{k: v for k, v in options.items() if k in taken}}
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
        for ks in _product([topo.size(a) for a in axes]):
            other = topo.rank_at({**coords, **dict(zip(axes, ks))})
            if topo.node_of(other) == topo.node_of(rank):
                intra += 1
            else:
                inter += 1
    return intra, inter


# ----------------------------------------------------------------------------- `lattice plan`


def add_plan_arguments(p: argparse.ArgumentParser) -> None:
    from lattice.modes import available_modes, parallel_modes
    from lattice.options import add_mode_option_flags

    p.add_argument("--mode", default=parallel_modes()[0], choices=available_modes())
    p.add_argument("--tp", type=int, default=4, help="ranks per model replica")
    p.add_argument("--dp", type=int, default=1, help="data-parallel replicas")
    p.add_argument("--rank", type=int, default=0, help="which rank's share to show")
    p.add_argument("--model", default="small", choices=list(PRESETS))
    p.add_argument("--vocab-size", type=int, default=2048)
    p.add_argument("--d-model", type=int, default=None)
    p.add_argument("--n-heads", type=int, default=None)
    p.add_argument("--n-layers", type=int, default=None)
    p.add_argument("--seq-len", type=int, default=None)
    p.add_argument("--batch", type=int, default=8, help="sequences per replica")
    p.add_argument("--bf16", action="store_true", help="2-byte activations and parameters")
    p.add_argument("--activation-checkpointing", action="store_true")
    add_mode_option_flags(p)
    p.add_argument("--ranks-per-node", type=int, default=None)
    p.add_argument("--placement", choices=("natural", "topology"), default="natural")
    p.add_argument("--machine", default=None, metavar="JSON",
                   help="Machine fields as inline JSON or a JSON file (e.g. a calibration from `lattice bench`); "
                        "default: the papers' 4-GPU-node cluster")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages (the cost above is then per micro-batch and stage)")
    p.add_argument("--microbatches", type=int, default=None, help="micro-batches per step with --pp (default pp)")
    p.add_argument("--pp-schedule", choices=("gpipe", "1f1b", "interleaved"), default="1f1b")
    p.add_argument("--splits", type=int, default=None, metavar="N",
                   help="project every tp x pp split of N ranks per replica (Megatron-LM Fig. 9) and name the fastest")
    p.add_argument("--table1", action="store_true",
                   help="print Optimus Table 1 for this b, s, h, p beside this model's rows for every mode")


def run_plan(args) -> int:
    sizes = {k: v for k, v in (("d_model", args.d_model), ("n_heads", args.n_heads), ("n_layers", args.n_layers),
                                ("seq_len", args.seq_len)) if v}
    try:
        cfg = GPTConfig.preset(args.model, vocab_size=args.vocab_size, **sizes)
        if args.table1:
            print(format_table1(args.batch, cfg.seq_len, cfg.d_model, args.tp))
            return 0
        from lattice.options import given_mode_options

        options = given_mode_options(args)
        machine = _machine(args.machine) if args.machine else PAPER_CLUSTER
        if args.splits:
            print(format_splits(cfg, args.mode, args.splits, batch=args.batch, machine=machine,
                                schedule=args.pp_schedule, microbatches=args.microbatches, **options))
            return 0
        if args.pp > 1:
            print(format_pipeline(cfg, args.mode, tp=args.tp, pp=args.pp, batch=args.batch, machine=machine,
                                  schedule=args.pp_schedule, microbatches=args.microbatches, **options))
            return 0
        c = estimate(cfg, args.mode, batch=args.batch, tp=args.tp, dp=args.dp, rank=args.rank,
                     dtype=torch.bfloat16 if args.bf16 else torch.float32,
                     activation_checkpointing=args.activation_checkpointing,
                     ranks_per_node=args.ranks_per_node, placement=args.placement, **options)
    except LatticeConfigError as e:
        print(f"lattice plan: {e}")
        return 2
    try:
        machine = _machine(args.machine) if args.machine else PAPER_CLUSTER
    except LatticeConfigError as e:
        print(f"lattice plan: {e}")
        return 2
    print(format_cost(c, machine))
    return 0


def _machine(spec: str) -> Machine:
    """A Machine from inline JSON or from a JSON file (e.g. a calibration `lattice bench` wrote)."""
    import json
    from dataclasses import fields as dataclass_fields

    try:
        text = open(spec).read() if os.path.isfile(spec) else spec
        values = json.loads(text)
    except (OSError, ValueError) as e:
        raise LatticeConfigError(f"--machine {spec[:60]!r} is neither a JSON file nor inline JSON ({type(e).__name__}); "
                                 f"pass e.g. '{{\"flop_rate\": 1e12}}' or a file holding such an object") from None
    known = {f.name for f in dataclass_fields(Machine)}
    if not isinstance(values, dict) or set(values) - known:
        extra = sorted(set(values) - known) if isinstance(values, dict) else type(values).__name__
        raise LatticeConfigError(f"--machine has unknown fields {extra}; Machine takes {', '.join(sorted(known))}")
    from dataclasses import MISSING

    required = {f.name for f in dataclass_fields(Machine) if f.default is MISSING} - {"name"}
    if required - set(values):
        raise LatticeConfigError(f"--machine lacks {sorted(required - set(values))}; give every one of "
                                 f"{', '.join(sorted(required))}")
    return Machine(**{"name": "given", **values})


def format_cost(c: Cost, machine: Machine) -> str:
    axes = " x ".join(f"{a.value}={n}" for a, n in c.topology.axes)
    lines = [f"{c.mode} on {axes}, {c.cfg}", f"batch {c.batch} x {c.seq} per replica, {c.itemsize}-byte values"
             f"{', activation checkpointing' if c.checkpointing else ''}; per rank:", "",
             f"  {'phase':<9}{'collective':<15}{'group':>6}{'calls':>8}{'elements':>14}{'MiB':>10}"
             f"{'wire words':>14}{'messages':>10}"]
    for (phase, op, n), row in sorted(c.summary().items()):
        sel = [t for t in c.terms if t.phase == phase and t.op == op and c.group_size(t.axes) == n]
        wire = sum(t.elements * wire_factor(op, n) for t in sel)
        msgs = sum(t.calls * message_steps(op, n) for t in sel)
        lines.append(f"  {phase:<9}{op:<15}{n:>6}{row['calls']:>8.0f}{row['elements']:>14,.0f}"
                     f"{row['bytes'] / 2 ** 20:>10.3f}{wire:>14,.0f}{msgs:>10.0f}")
    lines.append(f"  {'total':<30}{c.calls():>8.0f}{c.elements():>14,.0f}{c.bytes() / 2 ** 20:>10.3f}"
                 f"{c.wire():>14,.0f}{c.messages():>10.0f}")
    lines += ["", f"  compute: forward {c.flops['forward'] / 1e9:.3f} GFLOP, backward {c.flops['backward'] / 1e9:.3f} "
                  f"GFLOP (matrix products); elementwise {c.elementwise['forward'] / 1e6:.2f} + "
                  f"{c.elementwise['backward'] / 1e6:.2f} M elements",
              "  memory: " + ", ".join(f"{k} {v / 2 ** 20:.2f} MiB" for k, v in c.memory.items()),
              "", f"  time on {machine.describe()}:"]
    t = c.time(machine)
    lines.append("  " + ", ".join(f"{k} {v * 1e3:.3f} ms" for k, v in t.items()))
    return "\n".join(lines)


# ----------------------------------------------------------------------------- pipeline parallelism
def pipeline_projection(cfg: GPTConfig, mode: str, *, tp: int, pp: int, batch: int, machine: Machine,
                        schedule: str = "1f1b", microbatches: int | None = None, **options) -> dict:
    """One step of tp x pp ranks per replica (papers/002 §2.2, §3): each stage runs its L/pp
    blocks on micro-batches of B/m sequences under the tensor layout (this module's estimate,
    forward and backward; the embedding on the first stage and the head on the last); the
    schedule takes (m + p - 1) micro-batch slots of the slowest stage, (m + (p - 1)/v) with
    interleaving; each slot adds the point-to-point transfer of one residual piece (scatter /
    gather applied) over the link between stages; the AdamW update follows."""
    from lattice.layout import plan
    from lattice.pipeline import p2p_piece, stage_sends

    if pp == 1:  # no pipeline: the whole batch through the tensor layout
        c = estimate(cfg, mode, batch=batch, tp=tp, **options)
        return {"tp": tp, "pp": 1, "m": 1, "v": 1, "schedule": "none", "bubble": 0.0, "step_s": c.time(machine)["step"]}
    ctx = plan(mode, tp=tp, pp=pp, microbatches=microbatches, pp_schedule=schedule, **options)
    pcfg = ctx.pipeline
    chunks = pcfg.chunks(cfg.n_layers)
    blocks = max(len(c) for c in chunks)
    stage_cfg = GPTConfig(**{**cfg.to_dict(), "n_layers": blocks})
    c = estimate(stage_cfg, mode, batch=batch // pcfg.m, tp=tp, **options)
    t = c.time(machine)
    slot = t["forward"] + t["backward"]  # one micro-batch through the slowest chunk (head included: an upper bound)
    piece = p2p_piece(cfg, mode, tp=tp, pcfg=pcfg, batch=batch, **options)
    stage_p2p = [stage_sends(pcfg, s, piece) for s in range(pp)]
    inter = tp * pp > machine.ranks_per_node  # stages on other nodes once a replica leaves its node
    alpha, beta = (machine.alpha_inter, machine.beta_inter) if inter else (machine.alpha_intra, machine.beta_intra)
    hop = 2 * (alpha + piece * c.itemsize * beta)  # activation forward, gradient backward
    slots = pcfg.m * pcfg.v + pp - 1
    pipeline_time = slots * (slot / pcfg.v + hop)
    update = t["update"] / pp
    return {"tp": tp, "pp": pp, "m": pcfg.m, "v": pcfg.v, "schedule": schedule, "bubble": pcfg.bubble(),
            "slot_s": slot / pcfg.v, "p2p_s": hop, "step_s": pipeline_time + update, "stage_p2p": stage_p2p,
            "chunks": chunks, "itemsize": c.itemsize, "per_microbatch_activations": c.memory["activations"] / pcfg.v,
            "pcfg": pcfg}


def format_pipeline(cfg: GPTConfig, mode: str, *, tp: int, pp: int, batch: int, machine: Machine, **kw) -> str:
    from lattice.pipeline import in_flight

    r = pipeline_projection(cfg, mode, tp=tp, pp=pp, batch=batch, machine=machine, **kw)
    pcfg = r["pcfg"]
    virtual = f" (v={r['v']})" if r["v"] > 1 else ""
    lines = [f"{mode} tp={tp} x pp={pp}, {cfg}", f"batch {batch} per replica in {r['m']} micro-batches of "
             f"{batch // r['m']}, schedule {r['schedule']}{virtual}; bubble "
             f"(p-1)/(v m) = {r['bubble']:.3f}", "",
             f"  {'stage':<7}{'blocks':<22}{'p2p fwd elements':>18}{'p2p bwd elements':>18}{'MiB':>9}"
             f"{'in flight':>11}{'activations MiB':>17}"]
    n = len(r["chunks"])
    for s in range(pp):
        mine = [c for c in range(s, n, pp)]
        blocks = ", ".join(f"{r['chunks'][c].start}-{r['chunks'][c].stop - 1}" for c in mine)
        e = r["stage_p2p"][s]
        k = in_flight(pcfg, s)
        mib = (e["forward"] + e["backward"]) * r["itemsize"] / 2 ** 20
        lines.append(f"  {s:<7}{blocks:<22}{e['forward']:>18,.0f}{e['backward']:>18,.0f}{mib:>9.3f}{k:>11}"
                     f"{k * r['per_microbatch_activations'] / 2 ** 20:>17.2f}")
    lines += ["", f"  time on {machine.describe()}:",
              f"  micro-batch slot {r['slot_s'] * 1e3:.3f} ms + stage hop {r['p2p_s'] * 1e3:.3f} ms, "
              f"step {r['step_s'] * 1e3:.3f} ms"]
    return "\n".join(lines)


def format_splits(cfg: GPTConfig, mode: str, ranks: int, *, batch: int, machine: Machine, **kw) -> str:
    """Megatron-LM's Fig. 9 as a projection: every tp x pp = ranks the layout and model allow."""
    rows = []
    for pp in [d for d in range(1, ranks + 1) if ranks % d == 0]:
        try:
            rows.append(pipeline_projection(cfg, mode, tp=ranks // pp, pp=pp, batch=batch, machine=machine, **kw))
        except LatticeConfigError as e:
            rows.append({"tp": ranks // pp, "pp": pp, "error": str(e)})
    lines = [f"{mode}: tp x pp = {ranks} ranks per replica, {cfg}, batch {batch}, on {machine.name}",
             f"  {'tp':>4}{'pp':>4}{'m':>4}{'bubble':>8}{'step ms':>10}"]
    ok = [r for r in rows if "error" not in r]
    for r in rows:
        if "error" in r:
            lines.append(f"  {r['tp']:>4}{r['pp']:>4}  does not fit: {r['error'][:100]}")
        else:
            lines.append(f"  {r['tp']:>4}{r['pp']:>4}{r['m']:>4}{r['bubble']:>8.3f}{r['step_s'] * 1e3:>10.3f}")
    if ok:
        best = min(ok, key=lambda r: r["step_s"])
        lines.append(f"  fastest: tp={best['tp']} x pp={best['pp']}")
    return "\n".join(lines)


def format_table1(b: int, s: int, h: int, p: int) -> str:
    """Optimus Table 1 (as printed) beside this model's figures, and the 3D / sub-graph rows."""
    paper, ours = optimus_table1(b, s, h, p), layer_table(b, s, h, p)
    lines = [f"one layer, b={b} s={s} h={h} p={p}, activation checkpointing: words moved per rank "
             f"(ring all-reduce 2(p-1)/p, tree broadcast/reduce log2 q) and multiplications per rank",
             f"  {'':<14}{'fwd comm':>16}{'bwd comm':>16}{'bwd as run':>16}{'fwd mults':>18}{'bwd mults':>18}"]
    for mode, row in ours.items():
        for src, r in (("paper", paper.get(mode)), ("model", row)):
            if r:
                run = f"{r['backward_as_run']:,.0f}" if "backward_as_run" in r else ""
                lines.append(f"  {mode + ' ' + src:<14}{r['forward']:>16,.0f}{r['backward']:>16,.0f}{run:>16}"
                             f"{r['forward_mults']:>18,.0f}{r['backward_mults']:>18,.0f}")
    return "\n".join(lines)
