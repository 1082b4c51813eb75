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
from dataclasses import dataclass, field

import torch

from lattice.context import LatticeConfigError, MeshAxis, Topology
from lattice.model import PRESETS, GPTConfig

TP, DP, ROW, COL = MeshAxis.TP, MeshAxis.DP, MeshAxis.ROW, MeshAxis.COL
CI, CJ, CL, SUB, MEM = MeshAxis.CUBE_I, MeshAxis.CUBE_J, MeshAxis.CUBE_L, MeshAxis.SUBGRID, MeshAxis.MEMBER
MODES = ("serial", "1d", "2d", "3d", "subgraph")
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


def topology(mode: str, *, tp: int = 1, dp: int = 1, ranks_per_node: int | None = None,
             placement: str = "natural", **options) -> tuple[Topology, dict]:
    """The layout of a registered mode (lattice.context.make_topology); for a mode not written
    yet, the mesh the design notes give it, with natural placement or SUPER's round-robin one."""
    from lattice.layout import make_topology
    from lattice.modes import available_modes

    if mode in available_modes():
        return make_topology(mode, tp=tp, dp=dp, ranks_per_node=ranks_per_node, placement=placement, **options)
    if mode == "3d":
        q = round(tp ** (1 / 3))
        if q ** 3 != tp or q < 2:
            raise LatticeConfigError(f"mode '3d' needs tp = q*q*q ranks with q >= 2; tp={tp} is not a cube")
        axes = ((CI, q), (CJ, q), (CL, q))
    elif mode == "subgraph":
        options = {"subgrids": 2, "common": "all", **options}
        g = options["subgrids"]
        if tp % g:
            raise LatticeConfigError(f"mode 'subgraph' needs tp divisible by subgrids = {g}; got tp={tp}")
        axes = ((SUB, g), (MEM, tp // g))
    else:
        raise LatticeConfigError(f"unknown mode {mode!r}; the cost model knows {', '.join(MODES)}")
    axes = ((DP, dp),) + axes
    world = dp * tp
    rpn = ranks_per_node or world
    grid = tuple(range(world))
    if placement == "topology" and mode == "subgraph":
        grid = round_robin_grid(dp, axes[1][1], axes[2][1])
    return Topology(mode, axes, grid, rpn), options


def round_robin_grid(dp: int, g: int, n_g: int) -> tuple[int, ...]:
    """SUPER Fig. 11: the ranks of each sub-grid dealt round-robin over the nodes, i.e. the g ranks
    holding one sub-grid position (one segmented collective) are consecutive, so they share a node
    when g divides the ranks per node. Global rank at each (dp, subgrid k, member m)."""
    p = g * n_g
    return tuple(d * p + m * g + k for d in range(dp) for k in range(g) for m in range(n_g))


def estimate(cfg: GPTConfig, mode: str, *, batch: int, seq: int | None = None, tp: int = 1, dp: int = 1,
             dtype: torch.dtype = torch.float32, activation_checkpointing: bool = False,
             ranks_per_node: int | None = None, placement: str = "natural", rank: int = 0,
             **options) -> Cost:
    """The analytic cost of one step of `mode` on `batch` sequences (per replica) of `seq` tokens,
    for global rank `rank` (ranks differ only where a mode hosts parameters on some ranks)."""
    topo, options = topology(mode, tp=tp, dp=dp, ranks_per_node=ranks_per_node, placement=placement, **options)
    itemsize = torch.empty((), dtype=dtype).element_size()
    cost = Cost(mode, cfg, batch, seq or cfg.seq_len, topo, dict(options), itemsize, activation_checkpointing)
    _Builder(cost, rank).build()
    return cost


class _Builder:
    """Fills a Cost: one method per mode, written from its paper (sections cited there)."""

    def __init__(self, cost: Cost, rank: int):
        c, cfg = cost, cost.cfg
        self.c, self.cfg, self.topo = c, cfg, c.topology
        self.coords = c.topology.coords(rank)
        self.B, self.T, self.h, self.n, self.L = c.batch, c.seq, cfg.d_model, cfg.n_heads, cfg.n_layers
        self.V, self.Tmax, self.bias = cfg.vocab_size, cfg.seq_len, cfg.bias
        self.p = c.topology.tp_size
        self.layer: list[Term] = []  # one layer's terms, forward and backward
        self.recompute: list[Term] = []  # forward terms a checkpointed layer repeats in backward

    def add(self, phase, op, axes, elements, calls=1, site="", *, layer=False, itemsize=None):
        """One term; `layer` terms are per layer (multiplied by L, forward ones recomputed under
        checkpointing unless a mode drops them from `self.recompute`)."""
        t = Term(phase, op, tuple(axes), calls, elements, site, itemsize or self.c.itemsize)
        if not layer:
            self.c.terms.append(t)
            return
        self.layer.append(t)
        if phase == "forward":
            self.recompute.append(t)

    def build(self):
        getattr(self, "_" + {"1d": "megatron1d", "2d": "summa2d", "3d": "cube3d"}.get(self.c.mode, self.c.mode))()
        c, L = self.c, self.L
        for t in self.layer:
            c.terms.append(Term(t.phase, t.op, t.axes, t.calls * L, t.elements * L, t.site, t.itemsize))
        if c.checkpointing:
            for t in self.recompute:
                c.terms.append(Term("backward", t.op, t.axes, t.calls * L, t.elements * L, t.site, t.itemsize))
        if self.topo.size(DP) > 1:  # data-parallel gradient averaging, bucketed as DDP does
            grads = c.memory["parameters"] / c.itemsize
            self.add("backward", "all_reduce", (DP,), grads, max(1, math.ceil(grads * c.itemsize / DDP_BUCKET_BYTES)),
                     "grads")
        if not c.param_tensors:
            c.param_tensors = self._tensor_count()
        c.memory["gradients"] = c.memory["parameters"]
        c.memory["optimizer"] = 2 * c.memory["parameters"]  # AdamW's two moments
        self._flops()

    # ------------------------------------------------------------------ shared pieces
    def _flops(self):
        """Matrix-product FLOPs of this rank: per layer 24·B·T·h² + 4·B·T²·h, LM head 2·B·T·h·V'.
        Elementwise work, in elements through each operator once: per layer LayerNorm (2), residual
        adds (2), output-linear biases (2) -- the "replicated" part, whole on every 1D rank -- and
        the qkv and fc biases (7) and GELU (4) -- the "split" part -- times B·T·h; the head's
        LayerNorm and two passes over the logits (softmax, loss). Attention is counted apart in
        score elements B·n·T² per layer. Backward is twice the forward in all three."""
        B, T, h, L, n = self.B, self.T, self.h, self.L, self.n
        share = getattr(self, "share", {})
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

    def _tensor_count(self, vectors: bool = True) -> int:
        """Parameter tensors of the model (all of them, or only the matrices and tables)."""
        tables = 2 if self.cfg.tie_embeddings else 3
        if not vectors:
            return tables - 1 + 4 * self.L  # wte (and head); wpe counts with the vectors
        return tables + self.L * (12 if self.bias else 6) + (2 if self.bias else 1)

    def _serial_params(self) -> float:
        """Elements of the full model's parameters (weights, biases, norms, both embeddings)."""
        h, L, V = self.h, self.L, self.V
        layer = 12 * h * h + (13 * h if self.bias else 4 * h)
        head = 0 if self.cfg.tie_embeddings else V * h
        return V * h + self.Tmax * h + L * layer + (2 if self.bias else 1) * h + head

    def _activations(self, per_layer: float, head: float, ints: float) -> None:
        """Bytes saved for backward: floats of the layers and the head, plus int64/bool index bytes."""
        if self.c.checkpointing:  # only each layer's input survives the forward
            per_layer = self.B * self.T * self.h / self.residual_split
        self.c.memory["activations"] = self.c.itemsize * (self.L * per_layer + head) + ints

    # ------------------------------------------------------------------ serial
    def _serial(self):
        """Whole model on one rank; what autograd saves per layer: LayerNorm input, output, mean,
        rstd (x2); q, k, v; attention output and log-sum-exp; the MLP's 4h input and output."""
        B, T, h, n = self.B, self.T, self.h, self.n
        self.vocab_padded, self.residual_split = self.V, 1
        self.c.memory["parameters"] = self.c.itemsize * self._serial_params()
        self._activations(16 * B * T * h + 4 * B * T + B * n * T,
                          2 * B * T * h + 2 * B * T + B * T * self.V + 1, 16 * B * T)

    # ------------------------------------------------------------------ 1D: Megatron (papers/002)
    def _megatron1d(self):
        """f/g around every column/row pair: forward g = all-reduce of [B, T, h] after the attention
        and MLP output linears, backward f = all-reduce of the input gradient before qkv and fc.
        Vocab-parallel embedding (forward all-reduce) and head fused with the cross-entropy: three
        per-token values all-reduced (max, then Σe^x and the target logit in one call), and the
        head's f in backward. Sequence parallelism swaps each all-reduce for a reduce-scatter plus
        an all-gather over T of the same buffer, and sums the gradients of the vectors applied to
        sequence chunks (LayerNorm, output-linear bias, wpe) with an all-reduce."""
        B, T, h, n, p = self.B, self.T, self.h, self.n, self.p
        sp = self.c.options.get("sequence_parallel", False)
        act = B * T * h
        self.vocab_padded = -(-self.V // p) * p
        N = B * T  # tokens
        if not sp:
            self.add("forward", "all_reduce", (TP,), act, 1, "embedding")
            for _ in range(2):  # attention, MLP
                self.add("forward", "all_reduce", (TP,), act, 1, "layer.linear", layer=True)
                self.add("backward", "all_reduce", (TP,), act, 1, "layer.linear", layer=True)
            # recomputation stops at the MLP's last saved input: its g is not repeated
            self.recompute.pop()
            self.add("backward", "all_reduce", (TP,), act, 1, "head")
        else:
            self.add("forward", "reduce_scatter", (TP,), act, 1, "embedding")
            self.add("backward", "all_gather", (TP,), act, 1, "embedding")
            self.add("backward", "all_reduce", (TP,), T * h, 1, "embedding")  # wpe over the chunks
            vectors = 2 if self.bias else 1
            for _ in range(2):
                self.add("forward", "all_gather", (TP,), act, 1, "layer.linear", layer=True)
                self.add("backward", "reduce_scatter", (TP,), act, 1, "layer.linear", layer=True)
                self.add("forward", "reduce_scatter", (TP,), act, 1, "layer.linear", layer=True)
                self.add("backward", "all_gather", (TP,), act, 1, "layer.linear", layer=True)
            self.recompute.pop()  # the MLP's reduce-scatter follows its last saved input
            # LayerNorm weights/biases and row-linear biases (grad_sum=(TP,)): one bucket after backward
            self.add("backward", "all_reduce", (TP,), h * (self.L * (2 * vectors + (2 if self.bias else 0)) + vectors),
                     1, "grads")
            self.add("forward", "all_gather", (TP,), act, 1, "head")
            self.add("backward", "reduce_scatter", (TP,), act, 1, "head")
        self.add("forward", "all_reduce", (TP,), 3 * N, 2, "loss", itemsize=max(4, self.c.itemsize))
        self.share = {"split": 1 / p, "replicated": 1 / p if sp else 1}
        # parameters: column/row weights split, vocabulary rows split, the rest replicated
        layer = 12 * h * h / p + ((7 * h / p + 6 * h) if self.bias else 2 * h)
        params = (self.vocab_padded * h / p * (1 if self.cfg.tie_embeddings else 2) + self.Tmax * h
                  + self.L * layer + (2 if self.bias else 1) * h)
        self.c.memory["parameters"] = self.c.itemsize * params
        # saved: LayerNorm inputs whole (a 1/p chunk under sequence parallelism) and outputs whole
        # (all-gathered there), q, k, v, attention output and the MLP's 4h tensors at 1/p
        r = p if sp else 1
        self.residual_split = r
        per_layer = 2 * act / r + 2 * act + 12 * act / p + 4 * N / r + B * n * T / p
        head = act / r + act + N * self.vocab_padded / p + 2 * N / r
        ints = N * (8 + 1) + N * (8 + 1)  # token ids, mask; target ids, mask
        self._activations(per_layer, head, ints)

    # ------------------------------------------------------------------ 2D: SUMMA / Optimus (papers/000)
    def _summa_product(self, phase_site, M, K, N, q, *, forward_only=False, layer=True):
        """C = A B with A [M, K], B [K, N] on a q x q mesh (Alg. 1): q broadcasts of A blocks along
        the row (axis COL) and of B blocks along the column (axis ROW). Backward (Eq. 1): dA by
        Alg. 2 (q broadcasts of B blocks, q reduces of A-sized blocks along the row) and dB by
        Alg. 3 (q broadcasts of A blocks along the row, q reduces of B-sized blocks along the column)."""
        a, b = M * K / q ** 2, K * N / q ** 2
        self.add("forward", "broadcast", (COL,), q * a, q, phase_site, layer=layer)
        self.add("forward", "broadcast", (ROW,), q * b, q, phase_site, layer=layer)
        if forward_only:
            return
        self.add("backward", "broadcast", (ROW,), q * b, q, phase_site, layer=layer)
        self.add("backward", "reduce", (COL,), q * a, q, phase_site, layer=layer)
        self.add("backward", "broadcast", (COL,), q * a, q, phase_site, layer=layer)
        self.add("backward", "reduce", (ROW,), q * b, q, phase_site, layer=layer)

    def _summa2d(self):
        """Activations [B/q, T, h/q], weights in q x q blocks; SUMMA for every linear; bias,
        LayerNorm and wpe on row 0, broadcast down the column forward and reduced back in backward
        (Fig. 5); LayerNorm sums (Σx, Σx²) and cross-entropy sums (max, then Σe^x with the target
        logit) all-reduced along the row (§3.2.2). Embedding as SUMMA with the one-hot token matrix
        local to the row: q table-block broadcasts down the column, and the gradient's q reduces
        (Alg. 3). LM head C = X Eᵀ (Alg. 2: q broadcasts of table blocks, q reduces of logit blocks),
        its backward by Alg. 1 and Alg. 3; the mean loss is summed down the column."""
        B, T, h, n = self.B, self.T, self.h, self.n
        q = math.isqrt(self.p)
        Vp = self.vocab_padded = -(-self.V // q) * q
        M = B * T  # the full token count; blocks are M/q rows
        m = M / q
        vec = 2 if self.bias else 1
        # embedding: table block (V'/q, h/q) broadcast q times; wpe hosted on row 0
        self.add("forward", "broadcast", (ROW,), Vp * h / q, q, "embedding")
        self.add("backward", "reduce", (ROW,), Vp * h / q, q, "embedding")
        self.add("forward", "broadcast", (ROW,), T * h / q, 1, "embedding")
        self.add("backward", "reduce", (ROW,), T * h / q, 1, "embedding")

        def layer_norm(layer, site):
            self.add("forward", "broadcast", (ROW,), vec * h / q, vec, site, layer=layer)
            self.add("backward", "reduce", (ROW,), vec * h / q, vec, site, layer=layer)
            self.add("forward", "all_reduce", (COL,), 2 * m, 1, site, layer=layer)
            self.add("backward", "all_reduce", (COL,), 2 * m, 1, site, layer=layer)

        for k_in, n_out in ((h, 3 * h), (h, h), (h, 4 * h), (4 * h, h)):
            if self.bias:
                self.add("forward", "broadcast", (ROW,), n_out / q, 1, "layer.bias", layer=True)
                self.add("backward", "reduce", (ROW,), n_out / q, 1, "layer.bias", layer=True)
            self._summa_product("layer.linear", M, k_in, n_out, q)
        for _ in range(2):
            layer_norm(True, "layer.norm")
        layer_norm(False, "head")
        # head: logits (M, V') = X (M, h) Eᵀ; forward Alg. 2, backward Alg. 1 (dX) and Alg. 3 (dE)
        e, x, z = Vp * h / q ** 2, M * h / q ** 2, M * Vp / q ** 2
        self.add("forward", "broadcast", (ROW,), q * e, q, "head")
        self.add("forward", "reduce", (COL,), q * z, q, "head")
        self.add("backward", "broadcast", (COL,), q * z, q, "head")
        self.add("backward", "broadcast", (ROW,), q * e, q, "head")
        self.add("backward", "broadcast", (COL,), q * z, q, "head")
        self.add("backward", "reduce", (ROW,), q * e, q, "head")
        loss_size = max(4, self.c.itemsize)
        self.add("forward", "all_reduce", (COL,), 3 * m, 2, "loss", itemsize=loss_size)
        self.add("forward", "all_reduce", (ROW,), 1, 1, "loss", itemsize=loss_size)
        # parameters: weight and table blocks everywhere; vectors and wpe on row 0 only
        row0 = self.coords.get(ROW, 0) == 0
        vectors = (self.L * (13 * h if self.bias else 4 * h) + vec * h + self.Tmax * h) / q
        tables = Vp * h / self.p * (1 if self.cfg.tie_embeddings else 2)
        self.c.memory["parameters"] = self.c.itemsize * (self.L * 12 * h * h / self.p + tables
                                                         + (vectors if row0 else 0))
        self.c.param_tensors = self._tensor_count(vectors=row0)
        # saved per layer: every [B, T, h]-sized tensor of serial at 1/p; x̂ replaces the LayerNorm
        # input, whose rstd is per token of the row block (q-fold replicated); broadcast vectors
        self.residual_split = self.p
        per_layer = 16 * M * h / self.p + 2 * m + B * n * T / self.p + 2 * h / q
        head = (2 * M * h + M * Vp) / self.p + m + h / q
        ints = 8 * M + m * (8 + 1)  # the token ids (a view of the whole batch); target ids, hit mask
        self._activations(per_layer, head, ints)

    # ------------------------------------------------------------------ 3D: load-balanced cube (papers/004)
    def _cube3d(self):
        """Cube q x q x q, Y = X W (DESIGN.md "3D"): forward all-gathers X [M/q², N/q] along j and W
        [N/q², K/q] along i, reduce-scatters Y along l; backward all-gathers dY along l, reduce-scatters
        dX along j and dW along i, re-gathering X and W rather than keeping q-fold copies (storage
        stays 1/p). The second linear of a block swaps the roles of j and l. Vectors (bias, LayerNorm)
        of a K/q column block are kept once and broadcast / reduced along the two remaining axes.
        LayerNorm sums and cross-entropy sums are all-reduced along the hidden axis."""
        B, T, h, n = self.B, self.T, self.h, self.n
        q = round(self.p ** (1 / 3))
        Vp = self.vocab_padded = -(-self.V // q ** 2) * q ** 2
        M = B * T
        vec = 2 if self.bias else 1

        def linear(M_, N_, K_, x_axis, y_axis, site="layer.linear", layer=True):
            mn, nk, mk = M_ * N_ / q ** 2, N_ * K_ / q ** 2, M_ * K_ / q ** 2
            self.add("forward", "all_gather", (x_axis,), mn, 1, site, layer=layer)
            self.add("forward", "all_gather", (CI,), nk, 1, site, layer=layer)
            self.add("forward", "reduce_scatter", (y_axis,), mk, 1, site, layer=layer)
            self.add("backward", "all_gather", (x_axis,), mn, 1, site, layer=layer)
            self.add("backward", "all_gather", (CI,), nk, 1, site, layer=layer)
            self.add("backward", "all_gather", (y_axis,), mk, 1, site, layer=layer)
            self.add("backward", "reduce_scatter", (x_axis,), mn, 1, site, layer=layer)
            self.add("backward", "reduce_scatter", (CI,), nk, 1, site, layer=layer)

        def vector(size, k, site, layer=True):  # k vectors of `size` elements, a column block each
            self.add("forward", "broadcast", (CI, CJ), k * size / q, k, site, layer=layer)
            self.add("backward", "reduce", (CI, CJ), k * size / q, k, site, layer=layer)

        def layer_norm(site, layer=True):
            vector(h, vec, site, layer)
            self.add("forward", "all_reduce", (CL,), 2 * M / q ** 2, 1, site, layer=layer)
            self.add("backward", "all_reduce", (CL,), 2 * M / q ** 2, 1, site, layer=layer)

        # embedding: table (V'/q², h/q) pieces all-gathered along i like a weight, then a local lookup
        self.add("forward", "all_gather", (CI,), Vp * h / q ** 2, 1, "embedding")
        self.add("backward", "reduce_scatter", (CI,), Vp * h / q ** 2, 1, "embedding")
        vector(T * h, 1, "embedding", layer=False)
        for k_in, n_out, first in ((h, 3 * h, True), (h, h, False), (h, 4 * h, True), (4 * h, h, False)):
            x_axis, y_axis = (CJ, CL) if first else (CL, CJ)
            linear(M, k_in, n_out, x_axis, y_axis)
            if self.bias:
                vector(n_out, 1, "layer.bias")
        layer_norm("layer.norm")
        layer_norm("layer.norm")
        layer_norm("head", layer=False)
        linear(M, h, Vp, CL, CJ, "head", layer=False)
        loss_size = max(4, self.c.itemsize)
        self.add("forward", "all_reduce", (CJ,), 3 * M / q ** 2, 2, "loss", itemsize=loss_size)
        self.add("forward", "all_reduce", (CI, CL), 1, 1, "loss", itemsize=loss_size)
        vectors = (self.L * (13 * h if self.bias else 4 * h) + vec * h + self.Tmax * h) / q
        diag = self.coords.get(CI, 0) == 0 and self.coords.get(CJ, 0) == 0
        tables = Vp * h / self.p * (1 if self.cfg.tie_embeddings else 2)
        self.c.memory["parameters"] = self.c.itemsize * (self.L * 12 * h * h / self.p + tables
                                                         + (vectors if diag else 0))
        self.c.param_tensors = self._tensor_count(vectors=diag)
        self.residual_split = self.p
        per_layer = 16 * M * h / self.p + 4 * M / q ** 2 + B * n * T / self.p
        head = (2 * M * h + M * Vp) / self.p + 2 * M / q ** 2
        self._activations(per_layer, head, M / q ** 2 * 17)

    # ------------------------------------------------------------------ sub-graph: SUPER (papers/003)
    def _subgraph(self):
        """g sub-grids of n_g ranks; rank (k, m) runs common rows r_c (D&SP: B/p; D&SP-cSub: B/n_g
        on sub-grid 0, none elsewhere) and branch rows r_b = B/n_g. With projections="branch" a
        layer's attention is entered by a split of (r_b, T, h) (D&SP all-gather, cSub broadcast)
        and left by a sum of the same size (reduce-scatter, reduce), each with the other as its
        backward; with projections="common" by a slice of q, k, v and a concatenation of the
        heads (all-to-all counting the buffer a rank sends, scatter/gather the group's whole
        buffer; or all-gather / broadcast and discard). Every forward boundary is recomputed under
        checkpointing (the block's last saved tensors follow them). The loss is one value
        all-reduced over the replica; the gradient sums come from the shard specs: branch weights
        over the sub-grid (MEMBER), common parameters over the ranks running them."""
        B, T, h, n, p, L = self.B, self.T, self.h, self.n, self.p, self.L
        o = self.c.options
        g = o.get("subgrids", 2)
        n_g = p // g
        common_all = o.get("common", "all") == "all"
        proj_common = o.get("projections", "branch") == "common"
        by_gather = o.get("slice_collective", "all_to_all") == "all_gather"
        runs_common = common_all or self.coords.get(SUB, 0) == 0
        self.vocab_padded = self.V
        r_b = B / n_g
        r_c = (B / p if common_all else r_b) if runs_common else 0
        act = r_b * T * h  # a branch activation of one rank

        def boundary(fwd_op, bwd_op, elements_fwd, elements_bwd):
            self.add("forward", fwd_op, (SUB,), elements_fwd, 1, "layer.branch", layer=True)
            self.add("backward", bwd_op, (SUB,), elements_bwd, 1, "layer.branch", layer=True)

        if not proj_common:
            split, join = ("all_gather", "reduce_scatter") if common_all else ("broadcast", "reduce")
            boundary(split, join, act, act)
            boundary(join, split, act, act)
        elif common_all and not by_gather:  # all-to-all: the slice sends r_c rows of every head
            boundary("all_to_all", "all_to_all", 3 * B / p * T * h, 3 * B / p * T * h)
            boundary("all_to_all", "all_to_all", act / g, act / g)
        elif common_all:
            boundary("all_gather", "reduce_scatter", 3 * act, 3 * act)
            boundary("all_gather", "reduce_scatter", act, act)
        elif not by_gather:
            boundary("scatter", "gather", 3 * act, 3 * act)
            boundary("gather", "scatter", act, act)
        else:
            boundary("broadcast", "reduce", 3 * act, 3 * act)
            boundary("all_gather", "reduce_scatter", act, act)
        self.add("forward", "all_reduce", (SUB, MEM), 1, 1, "loss", itemsize=max(4, self.c.itemsize))
        # parameters: the branch's head block of q, k, v (and their bias) and of the output
        # projection; the common ones where the common layers run
        branch = 0 if proj_common else 4 * h * h / g + (3 * h / g if self.bias else 0)
        common = self._serial_params() - L * g * branch
        self.c.memory["parameters"] = self.c.itemsize * (L * branch + (common if runs_common else 0))
        sums = {(MEM,): L * branch}  # GPT.sync_grads: one bucket per axes and 25 MiB
        common_axes = (SUB, MEM) if common_all else (MEM,)
        sums[common_axes] = sums.get(common_axes, 0) + (common if runs_common else 0)
        for axes, elements in sums.items():
            if elements and self.c.group_size(axes) > 1:
                self.add("backward", "all_reduce", axes, elements,
                         max(1, math.ceil(elements * self.c.itemsize / DDP_BUCKET_BYTES)), "grads")
        if not runs_common:
            self.c.param_tensors = 0 if proj_common else L * (3 if self.bias else 2)
        share = r_c / B
        self.share = {"attention": r_b / B / g, "mlp": share, "head": share, "replicated": share}
        self.residual_split = B / r_c if r_c else float("inf")
        # saved for backward, per layer: common rows keep both LayerNorm inputs, the fc input,
        # GELU input and MLP-proj input (11h) and the norms' mean/rstd; a branch keeps its qkv
        # input, the q, k, v storage, attention output (which the proj input views) and log-sum-exp
        if not proj_common:
            per_layer = r_c * T * (11 * h + 4) + r_b * T * (h + 4 * h / g + n / g)
        else:  # the projections' inputs are common rows; discarding collectives keep whole buffers
            qkv, proj_in = (3 * h, r_b * T * h if runs_common else 0) if by_gather else (3 * h / g, r_c * T * h)
            per_layer = r_c * T * (12 * h + 4) + proj_in + r_b * T * (qkv + h / g + n / g)
        head = r_c * T * (2 * h + 2 + self.V) + (1 if runs_common else 0)
        ints = 2 * 8 * B * T if runs_common else 0  # token and target rows: views of the whole batch
        self._activations(per_layer, head, ints)


# ----------------------------------------------------------------------------- the papers' tables


def optimus_table1(b: int, s: int, h: int, p: int) -> dict[str, dict[str, float]]:
    """Optimus Table 1 as printed: one Transformer layer, activation checkpointing, scalars moved
    per rank (communication) and scalar multiplications per rank (computation)."""
    q = math.sqrt(p)
    lg = math.log2(p)
    return {
        "1d": {"forward": 4 * (p - 1) / p * b * s * h, "backward": 8 * (p - 1) / p * b * s * h,
               "forward_mults": (12 * b * s * h * h + 2 * b * s * s * h) / p,
               "backward_mults": (36 * b * s * h * h + 6 * b * s * s * h) / p},
        "2d": {"forward": lg / (2 * q) * (7 * b * s * h + 12 * h * h),
               "backward": lg / (2 * q) * (21 * b * s * h + 36 * h * h),
               "forward_mults": (12 * b * s * h * h + 2 * b * s * s * h) / p,
               "backward_mults": (36 * b * s * h * h + 6 * b * s * s * h) / p},
    }


def layer_table(b: int, s: int, h: int, p: int, subgrids: int = 2) -> dict[str, dict[str, float]]:
    """Table 1's rows from this model, for every mode whose layout fits p: one layer with
    activation checkpointing, wire words per rank of its linear layers (of the branch entry and
    exit for sub-graph parallelism) and scalar multiplications per rank. "backward" recomputes the
    whole forward as Table 1 does; "backward_as_run" is lattice's, whose checkpoint stops the
    recomputation after the last tensor saved for backward (1D then skips the MLP's all-reduce)."""
    cfg = GPTConfig(vocab_size=8, seq_len=s, d_model=h, n_heads=h, n_layers=1)
    out = {}
    for mode, extra in (("1d", {}), ("2d", {}), ("3d", {}), ("subgraph", {"subgrids": subgrids})):
        try:
            c = estimate(cfg, mode, batch=b, tp=p, activation_checkpointing=True, **extra)
        except LatticeConfigError:
            continue
        plain = estimate(cfg, mode, batch=b, tp=p, **extra)
        site = "layer.branch" if mode == "subgraph" else "layer.linear"
        fwd = plain.wire("forward", site=site)
        layer = (8 * b * s * h * h + 4 * b * s * s * h + 16 * b * s * h * h) / p / 2  # multiplications
        # the paper recomputes the whole forward; torch's checkpoint stops after the last saved tensor
        out[mode] = {"forward": fwd, "backward": fwd + plain.wire("backward", site=site),
                     "backward_as_run": c.wire("backward", site=site),
                     "forward_mults": layer, "backward_mults": 3 * layer}
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
    p.add_argument("--mode", default="1d", choices=MODES)
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
    p.add_argument("--sequence-parallel", action="store_true", help="1d")
    p.add_argument("--subgrids", type=int, default=None, help="subgraph: g")
    p.add_argument("--common", choices=("all", "subgrid"), default=None, help="subgraph: D&SP or D&SP-cSub")
    p.add_argument("--ranks-per-node", type=int, default=None)
    p.add_argument("--placement", choices=("natural", "topology"), default="natural")
    p.add_argument("--machine", default=None, metavar="JSON",
                   help="Machine fields as JSON (e.g. a calibration from `lattice bench`); default: "
                        "the papers' 4-GPU-node cluster")
    p.add_argument("--table1", action="store_true",
                   help="print Optimus Table 1 for this b, s, h, p beside this model's 1D/2D/3D/sub-graph rows")


def run_plan(args) -> int:
    import json

    sizes = {k: v for k, v in (("d_model", args.d_model), ("n_heads", args.n_heads), ("n_layers", args.n_layers),
                                ("seq_len", args.seq_len)) if v}
    try:
        cfg = GPTConfig.preset(args.model, vocab_size=args.vocab_size, **sizes)
        if args.table1:
            print(format_table1(args.batch, cfg.seq_len, cfg.d_model, args.tp))
            return 0
        options = {k: v for k, v in (("sequence_parallel", args.sequence_parallel or None),
                                     ("subgrids", args.subgrids), ("common", args.common)) if v is not None}
        c = estimate(cfg, args.mode, batch=args.batch, tp=args.tp, dp=args.dp, rank=args.rank,
                     dtype=torch.bfloat16 if args.bf16 else torch.float32,
                     activation_checkpointing=args.activation_checkpointing,
                     ranks_per_node=args.ranks_per_node, placement=args.placement, **options)
    except LatticeConfigError as e:
        print(f"lattice plan: {e}")
        return 2
    machine = Machine(**json.loads(args.machine)) if args.machine else PAPER_CLUSTER
    print(format_cost(c, machine))
    return 0


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
