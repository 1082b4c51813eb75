"""Analytic cost of one training step, per rank: communication, computation, memory, time.

    cost = estimate(cfg, "2d", batch=8, tp=4)
    cost.elements(phase="forward")            # CommMeter units (see lattice/parallel/comm.py)
    cost.flops, cost.memory, cost.time(machine)

Every figure is derived from the papers and the layout, never from a run. The model family
describes one step as its sequence of operations (`Model.cost_layout`: embedding, per layer
norms, linears, attention, activation; final norm and head), and the mode prices each
operation in its layout (`Mode.cost_embedding`, `cost_norm`, `cost_linear`, `cost_lm_head`,
`cost_pool`): its collectives, the bytes autograd saves, its share of the work. Communication is
a list of `Term`s (phase, collective, mesh axes, calls, elements) in CommMeter's units --
elements of the logical buffer per call: the tensor for all-reduce / broadcast / reduce /
all-to-all, the gathered output for all-gather, the full input for reduce-scatter -- so
measured / analytic is a ratio of like with like. `wire()` converts to the papers' per-rank
volume (ring all-reduce 2(n-1)/n, all-gather / reduce-scatter / all-to-all (n-1)/n, tree
broadcast / reduce log2 n), in which `lattice.cost.tables.optimus_table1` reproduces Table 1 of
Optimus (docs/references.md#optimus).

Symbols: B sequences of T tokens per replica, M = B·T tokens, h = d_model, L layers, V' the
vocabulary padded to what the layout divides, p ranks per replica (q = √p in 2D, ∛p in 3D).
FLOPs count matrix products only (2 per multiply-add); backward is twice the forward, plus one
forward of every layer under activation checkpointing (under selective checkpointing, of every
layer's work but its products and fused attention).
"""

from __future__ import annotations

import functools
import math
from collections import OrderedDict
from dataclasses import dataclass, field
from dataclasses import fields as dataclass_fields

import torch

from lattice.cost.builder import DDP_BUCKET_BYTES, WORK_KINDS, CostBuilder  # noqa: F401  (lattice.cost's names)
from lattice.cost.machine import Machine, Term, algorithm, message_steps, wire_factor
from lattice.data.corpus import DEFAULT_VOCAB
from lattice.models import build_model, get_arch
from lattice.models.recompute import recompute_kind
from lattice.modes import get_mode
from lattice.modes.layout import Layout, as_layout
from lattice.parallel.context import LatticeConfigError, MeshAxis, Topology

# ----------------------------------------------------------------------------- the estimate


def grads_beside_backward(figures: dict, overlap: float) -> float:
    """Seconds of the gradients' reductions started in backward (`grads_started`: those of
    Term.beside_backward) that its compute hides: `overlap` (Machine.overlap) of the shorter of
    them and the backward's compute beside no ZeRO-3 gather (`backward_weights_overlapped`)."""
    cover = figures["backward_compute"] - figures.get("backward_weights_overlapped", 0.0)
    return overlap * max(0.0, min(figures.get("grads_started", 0.0), cover))


def spans_nodes(topo: Topology, axes) -> bool:
    """Whether some group of `topo` along `axes` (ranks that differ only there) has ranks on more
    than one node."""
    dims = tuple(topo.axis_names.index(a) for a in axes if a in topo.axis_names)
    return _spans_nodes(topo.shape, tuple(topo.rank_grid), topo.ranks_per_node, dims)


@functools.lru_cache(maxsize=4096)
def _spans_nodes(shape: tuple[int, ...], grid: tuple[int, ...], ranks_per_node: int, dims: tuple[int, ...]) -> bool:
    nodes = torch.tensor(grid, device="cpu").reshape(shape) // ranks_per_node
    rest = [d for d in range(nodes.dim()) if d not in dims]
    groups = nodes.permute(*rest, *dims).reshape(math.prod(nodes.shape[d] for d in rest), -1)
    return bool((groups.amax(1) != groups.amin(1)).any())


@dataclass
class Cost:
    """One training step (forward, backward, optimizer update) of one rank."""

    mode: str
    cfg: object
    batch: int
    seq: int
    topology: Topology
    options: dict
    itemsize: int
    checkpointing: str | None  # "full" or "selective" recomputation of each block (lattice.models.recompute), or None
    terms: list[Term] = field(default_factory=list)
    flops: dict[str, float] = field(default_factory=dict)  # forward, backward (attention's included)
    attention_flops: dict[str, float] = field(default_factory=dict)  # the QKᵀ and AV products alone
    elementwise: dict[str, float] = field(default_factory=dict)  # elements through non-matmul operators
    scores: dict[str, float] = field(default_factory=dict)  # attention score elements (B·n·T² share)
    biased_scores: dict[str, float] = field(default_factory=dict)  # of them, where an additive bias takes its own kernel
    linear_calls: dict[str, float] = field(default_factory=dict)  # matrix products of linear layers
    ops: dict[str, float] = field(default_factory=dict)  # operations the family describes (norms, linears, ...)
    product_weights: dict[str, float] = field(default_factory=dict)  # weight elements the linear products read
    # `elementwise` by operator (lattice.cost.builder.ELEMENTWISE_OPERATORS), each at its own rate
    elementwise_ops: dict[str, dict[str, float]] = field(default_factory=dict)
    stem: dict[str, dict[str, float]] = field(default_factory=dict)  # the same for the layers alone
    memory: dict[str, float] = field(default_factory=dict)  # bytes: parameters, gradients, optimizer, activations
    param_tensors: int = 0  # parameter tensors on this rank (the optimizer's per-tensor work)
    pipeline: object = None  # lattice.parallel.pipeline_config.PipelineConfig with pp > 1, and this rank's stage
    stage: int = 0
    # without a pipeline: (first, last), whether the rank runs the model's first part (the embedding)
    # and its last (the final norm and the head), as a pipeline's stage would (None: both)
    parts: tuple[bool, bool] | None = None
    target_seq: int | None = None  # an encoder-decoder's target length (T5's decoder); seq is the source's
    residual_elements: float = 0.0  # this rank's piece of the residual stream between blocks
    zero: int = 0  # the distributed optimizer's stage (lattice.parallel.zero); 0: DDP
    precision: str = "fp32"  # "bf16": bf16 weights with fp32 master rows (lattice.parallel.zero), else `itemsize` throughout
    rank: int = 0  # the global rank whose share this is
    overlap_param_gather: bool = False  # ZeRO's all-gather of updated weights beside the next forward (ZeRO-3: the next block's)
    reshard_after_forward: bool = True  # ZeRO-3: a block's weights gathered again for its backward
    reshard_microbatches: bool = False  # ZeRO-3: and around every micro-batch
    grad_reduce_dtype: str = "fp32"  # "bf16": bf16 weights' gradients reduced in bf16 (--grad-reduce-dtype)
    overlap_grad_reduce: bool = True  # the distributed optimizer's reductions start in backward (--overlap-grad-reduce)
    # gradient bytes copied once into a flat buffer for the data-parallel all-reduce (DDP's buckets,
    # whose gradients then stay views of them; a pipeline's flat all-reduce, likewise)
    reduced_grad_bytes: float = 0.0
    padded: bool = False  # batches with an attention mask (whose copies attention saves)
    # every term's seconds on the last machine they were priced for (term_times): a step's time asks
    # for them once per phase and site, and the planner prices thousands of Costs
    _term_seconds: tuple | None = field(default=None, init=False, repr=False, compare=False)
    _group_sizes: tuple | None = field(default=None, init=False, repr=False, compare=False)  # (topology, {axes: ranks})

    @staticmethod
    def _elementwise_seconds(by_operator: dict, phase: str, machine) -> float:
        """Each elementwise operator's elements ({operator: {phase: elements}}) at its rate (Machine.elementwise_rate)."""
        return sum(n[phase] / machine.elementwise_rate(op) for op, n in by_operator.items())

    def _select(self, phase=None, op=None, site=None):
        return [t for t in self.terms if (phase is None or t.phase == phase) and (op is None or t.op == op)
                and (site is None or t.site == site or t.site.startswith(site + "."))]

    def group_size(self, axes) -> int:
        if self._group_sizes is None or self._group_sizes[0] is not self.topology:
            self._group_sizes = (self.topology, {})
        sizes = self._group_sizes[1]
        if axes not in sizes:
            sizes[axes] = math.prod(self.topology.size(a) for a in axes)
        return sizes[axes]

    def term_ranks(self, t: Term) -> int:
        return t.ranks if t.ranks is not None else self.group_size(t.axes)

    def elements(self, phase=None, op=None, site=None) -> float:
        return sum(t.elements for t in self._select(phase, op, site))

    def bytes(self, phase=None, op=None, site=None) -> float:
        return sum(t.bytes for t in self._select(phase, op, site))

    def calls(self, phase=None, op=None, site=None) -> float:
        return sum(t.calls for t in self._select(phase, op, site))

    def wire(self, phase=None, op=None, site=None) -> float:
        """Per-rank words on the wire, the papers' unit (Optimus Table 1)."""
        return sum(t.elements * wire_factor(t.op, self.term_ranks(t)) for t in self._select(phase, op, site))

    def messages(self, phase=None, op=None, site=None) -> float:
        """Point-to-point message steps per rank under the ring / tree algorithms."""
        return sum(t.calls * message_steps(t.op, self.term_ranks(t)) for t in self._select(phase, op, site))

    def syncs(self, grads: bool = True) -> dict[int, float]:
        """{group ranks: synchronisations per step} of forward and backward, each collective call one
        (a layer's waits for its slowest rank), with the gradients' reductions (`grad_syncs`) or,
        with grads=False, without them (a pipeline's stage counts them once, not per micro-batch)."""
        out: dict[int, float] = self.grad_syncs() if grads else {}
        for t in self.terms:
            if t.phase in ("forward", "backward") and t.site != "grads":
                out[self.term_ranks(t)] = out.get(self.term_ranks(t), 0.0) + t.calls
        return out

    def ring_waits(self, machine: Machine) -> tuple[float, float]:
        """(seconds of attention, calls) of the cp ring's exchanges that wait after a block of
        attention alone (Machine.skew_seconds' apart). Of a layer's forward, the ring's first wait
        follows the layer's other work and its first block, each of the other cp - 2 one block;
        of its backward (cp - 1 sends of keys, cp of their gradients) the first follows the other
        work and a block, the other 2 cp - 2 the cp - 1 blocks after the first, in turn with none."""
        cp = self.topology.size(MeshAxis.CP)
        sends = {phase: sum(t.calls for t in self.terms if t.site == "layer.ring" and t.phase == phase)
                 for phase in ("forward", "backward")}
        if cp < 2 or not any(sends.values()):
            return 0.0, 0.0
        machine = machine.at(self.topology.world_size)
        calls = sends["forward"] * (cp - 2) / (cp - 1) + sends["backward"] * (2 * cp - 2) / (2 * cp - 1)
        attention = (self.scores["forward"] * (cp - 2) + self.scores["backward"] * (cp - 1)) / cp / machine.attn_rate
        return attention, calls

    def grad_syncs(self) -> dict[int, float]:
        """{group ranks: synchronisations per step} of the gradients' reductions after backward, one
        per group (they start as backward frees buckets and are awaited together)."""
        out: dict[int, float] = {}
        for ranks in {t.axes: self.term_ranks(t) for t in self.terms
                      if t.site == "grads" and t.phase == "backward"}.values():
            out[ranks] = out.get(ranks, 0.0) + 1
        return out

    def summary(self) -> dict[tuple[str, str, int], dict[str, float]]:
        """{(phase, op, group size): {calls, elements, bytes}}, CommMeter.summary()'s shape."""
        out: dict = {}
        for t in self.terms:
            row = out.setdefault((t.phase, t.op, self.term_ranks(t)), {"calls": 0, "elements": 0, "bytes": 0})
            row["calls"] += t.calls
            row["elements"] += t.elements
            row["bytes"] += t.bytes
        return out

    def spans_nodes(self, axes) -> bool:
        """Whether some group along `axes` has ranks on more than one node."""
        return spans_nodes(self.topology, axes)

    def comm_time(self, machine: Machine, phase: str, site: str | None = None) -> float:
        return sum(seconds for _, seconds in self.term_times(machine, self._select(phase, site=site)))

    def term_times(self, machine: Machine, terms=None) -> list[tuple[Term, float]]:
        """Each term's seconds (every term, or `terms`): per call, its latency steps times α plus its
        wire bytes times β, inside a node (its wire bytes on the machine's curve where it has one,
        Machine.wire_seconds; a group smaller than the world on its group size's curve,
        Machine.group_seconds) or between nodes where its group spans them."""
        seconds = self._seconds_by_term(machine.at(self.topology.world_size))
        return [(t, seconds[id(t)]) for t in (self.terms if terms is None else terms)]

    def _seconds_by_term(self, machine: Machine) -> dict[int, float]:
        """{id(term): seconds} of every term on `machine` (as the world sees it), kept until the
        machine, the topology or the terms change."""
        memo = self._term_seconds
        if (memo is not None and memo[1] is self.topology and memo[2] == len(self.terms)
                and (memo[0] is machine or memo[0] == machine)):
            return memo[3]
        out, span = {}, {}
        for t in self.terms:
            n = self.term_ranks(t)
            if t.axes not in span:
                span[t.axes] = self.spans_nodes(t.axes)
            # a cp ring's exchanges wait for both neighbours between compute (alpha_send); a
            # pipeline's hops are priced at α, as the validation measured them; a collective at
            # its own rates where the machine has them
            kind = "send" if t.site.endswith("ring") else ("" if t.op == "send" else t.op)
            alpha, beta = machine.link(span[t.axes], kind)
            steps, words = algorithm(t.op, n, machine.pipelined_broadcast)
            if span[t.axes] or t.calls <= 0:
                out[id(t)] = t.calls * steps * alpha + t.bytes * words * beta
                continue
            per_call = t.bytes * words / t.calls
            # a group smaller than the world at its own calibration, where it has one
            in_groups = machine.group_seconds(t.op, n, per_call) if n < self.topology.world_size else None
            seconds = in_groups if in_groups is not None else steps * alpha + machine.wire_seconds(kind, per_call, beta)
            if t.site == "grads" and t.op == "all_reduce":  # the gradients' sum as a step runs it
                seconds *= machine.grad_sum_ratio(per_call)
            out[id(t)] = t.calls * seconds
        self._term_seconds = (machine, self.topology, len(self.terms), out)
        return out

    def time(self, machine: Machine, stem: bool = False) -> dict[str, float]:
        """Predicted seconds. Communication and computation do not overlap, except a cp ring's
        keys and values (site layer.ring), which travel while attention computes the block before,
        and the layers' collectives a layout starts before the weight gradients' products and
        awaits after them (sites ending in ".hidden"; the products are half of backward's linear
        work), the gradients' reductions started in backward as their buckets complete
        (Term.beside_backward) beside its compute, and ZeRO-3's gathers of the next block's weights
        beside a block's compute (site weights, with overlap_param_gather) (`overlapped`: the
        seconds of them hidden so, Machine.overlap of the shorter of the collectives and that
        compute; the reductions' and ZeRO-3's apart, `grads_overlapped` and `weights_overlapped`,
        as they come once a step under several micro-batches). With stem=True, the Transformer
        layers alone (no embedding, head, loss or update), as the papers measure."""
        out = {}
        machine = machine.at(self.topology.world_size)
        work = self.stem if stem else {kind: getattr(self, kind) for kind in WORK_KINDS}
        by_operator = ({kind.split(":", 1)[1]: n for kind, n in self.stem.items() if kind.startswith("elementwise:")}
                       if stem else self.elementwise_ops)
        for phase in ("forward", "backward"):
            linear = work["flops"][phase] - work["attention_flops"][phase]
            # each product of f FLOPs at F·f/(f + kernel_flops): kernel_flops/F more per product; and
            # as if it had kernel_rows more rows: 2·kernel_rows FLOPs more per weight element it reads
            kernels = (work["linear_calls"][phase] * machine.kernel_flops
                       + 2 * machine.kernel_rows * work["product_weights"][phase])
            out[f"{phase}_compute"] = ((linear + kernels) / machine.flop_rate + work["scores"][phase] / machine.attn_rate
                                       + work["biased_scores"][phase] / machine.biased_attention_rate()
                                       + self._elementwise_seconds(by_operator, phase, machine)
                                       + work["ops"][phase] * machine.op_overhead)
            out[f"{phase}_comm"] = self.comm_time(machine, phase, "layer" if stem else None)
            gathers_hidden = 0.0
            if self.zero == 3 and self.overlap_param_gather and not stem:  # the next block's gather beside a block
                gathers = self.comm_time(machine, phase, "weights")
                gathers_hidden = machine.overlap * min(gathers, out[f"{phase}_compute"])
                out["weights_overlapped"] = out.get("weights_overlapped", 0.0) + gathers_hidden
                out[f"{phase}_comm"] -= gathers_hidden
            cp = self.topology.size(MeshAxis.CP)
            if cp > 1:  # each of the ring's cp - 1 sends beside one of its cp blocks of attention
                attention = work["scores"][phase] / machine.attn_rate * (1 - 1 / cp)
                ring = machine.overlap * min(self.comm_time(machine, phase, "layer.ring"), attention)
                out[f"{phase}_overlapped"] = out.get(f"{phase}_overlapped", 0.0) + ring
                out[f"{phase}_comm"] -= ring
            beside_products = sum(self.comm_time(machine, phase, site) for site in
                                  sorted({t.site for t in self.terms if t.phase == phase and t.site.endswith(".hidden")}))
            if beside_products:
                hidden = machine.overlap * min(beside_products, linear / 2 / machine.flop_rate)
                out[f"{phase}_overlapped"] = out.get(f"{phase}_overlapped", 0.0) + hidden
                out[f"{phase}_comm"] -= hidden
            if phase == "backward" and not stem:  # the reductions started as their buckets complete, beside
                # the compute the gathers before them left (one link carries both)
                out["grads_started"] = sum(s for t, s in self.term_times(machine, self._select(phase, site="grads"))
                                           if t.beside_backward)
                if gathers_hidden:
                    out["backward_weights_overlapped"] = gathers_hidden
                out["grads_overlapped"] = grads_beside_backward(out, machine.overlap)
                out[f"{phase}_comm"] -= out["grads_overlapped"]
            out[phase] = out[f"{phase}_compute"] + out[f"{phase}_comm"]
        # waiting for the slowest rank's compute at each synchronisation (Machine.skew_seconds)
        syncs = self.syncs()
        out["skew"] = machine.skew_seconds(out["forward_compute"] + out["backward_compute"], syncs,
                                           collectives=sum(syncs.values()), apart=self.ring_waits(machine))
        if stem:
            out["step"] = out["forward"] + out["backward"] + out["skew"]
            return out
        # AdamW reads parameter, gradient and two moments and writes three of them back (under
        # ZeRO of this rank's rows alone, and then the all-gather of the updated weights, which
        # with overlap_param_gather runs beside the next step's forward: hidden up to its compute)
        updated = (self.memory["optimizer"] / (3 if self.precision == "bf16" else 2) if self.zero or self.precision == "bf16"
                   else self.memory["parameters"])
        gather = self.comm_time(machine, "optimizer")
        out["update_overlapped"] = machine.overlap * min(gather, out["forward_compute"]) if self.overlap_param_gather else 0.0
        # before it the gradient norm reads each gradient and clipping reads and writes it
        out["update"] = (self.param_tensors * (machine.update_per_tensor + machine.norm_per_tensor)
                         + ((7 + 3) * updated + 2 * self.reduced_grad_bytes) / machine.mem_bandwidth
                         + gather - out["update_overlapped"])
        out["step"] = out["forward"] + out["backward"] + out["skew"] + out["update"]
        return out


def kept(store: OrderedDict, limit: int, key, compute):
    """`store[key]`, from `compute()` where it is not there yet: a store of the planner's many
    prices of one layout or stage (hashable keys: reprs of the unhashable configs and layouts) that
    keeps at most `limit` entries, the least recently used dropped first."""
    if key in store:
        store.move_to_end(key)
        return store[key]
    value = store[key] = compute()
    while len(store) > limit:
        store.popitem(last=False)
    return value


_MODELS: OrderedDict = OrderedDict()  # (config, layout, rank) -> meta model, the latest used last
_MODELS_KEPT = 256


def meta_model(cfg, layout: Layout, rank: int):
    """The context and meta model of `rank` under `layout` (its shard specs and local shapes,
    nothing allocated), built once for the planner's many prices of one layout (the cost builder
    only reads the model)."""
    ctx = layout.context(rank)
    # the micro-batch count shapes no module (the builder reads it from the Cost's context); a plugin
    # registered anew is built anew
    shape = layout.replace(microbatches=None) if layout.pp > 1 and layout.pp_schedule != "interleaved" else layout
    key = (type(cfg), repr(cfg), get_mode(layout.mode), repr(shape), rank)

    def meta_build():
        with torch.device("meta"):
            return build_model(cfg, ctx)
    return ctx, kept(_MODELS, _MODELS_KEPT, key, meta_build)


def estimate(cfg, layout: Layout | str, *, batch: int, seq: int | None = None, target_seq: int | None = None,
             dtype: torch.dtype = torch.float32, activation_checkpointing: bool = False,
             selective_checkpointing: bool = False, rank: int = 0,
             zero: int = 0, precision: str = "fp32", padded: bool = False, overlap_param_gather: bool | None = None,
             grad_reduce_dtype: str = "fp32", parts: tuple[bool, bool] | None = None, reshard_after_forward: bool = True,
             reshard_microbatches: bool = False, overlap_grad_reduce: bool = True, **layout_kwargs) -> Cost:
    """The analytic cost of one step of `layout` (a Layout, or a mode name with `lattice.init`'s
    keyword arguments) on `batch` sequences (per replica) of `seq` tokens, for global rank `rank`
    (ranks differ where a mode hosts parameters on some ranks), of the model `cfg` describes (any
    family). With pp > 1 the rank runs its stages' blocks (with the first part on the first
    stage, the head on the last) on each of the m micro-batches of batch/m sequences, sends the
    residual point-to-point (see lattice.cost.pipeline) and sums shared parameters' gradients
    between the end stages; the activations are those of one micro-batch through its stages. An
    encoder-decoder reads `seq` source and `target_seq` target tokens (default: its config's
    target_len). `zero`: the distributed optimizer's stage (lattice.parallel.zero), whose reduce-scatter
    and all-gather replace the data-parallel all-reduce and whose moments are this rank's rows;
    `precision` "bf16": bf16 weights and activations with fp32 master rows, moments and
    gradient reduction (then `dtype` is bf16). `padded`: the batches carry an attention mask,
    whose copies every masked attention saves (padding costs no communication).
    `overlap_param_gather` (default: with ZeRO, as the Trainer), `grad_reduce_dtype`,
    `overlap_grad_reduce`, `reshard_after_forward` and `reshard_microbatches` (ZeRO-3's): as
    `lattice train`'s flags. `parts` (first, last), for a layout without a pipeline: the rank runs
    only those of the model's end parts, as one stage of a pipeline would (the planner prices a
    stage so)."""
    if precision == "bf16":
        dtype = torch.bfloat16
    ctx, model = meta_model(cfg, as_layout(layout, layout_kwargs), rank)
    if parts is not None and ctx.pipeline is not None:
        raise ValueError("estimate(parts=...) is for a layout without a pipeline; a pipeline's stage holds its own parts")
    mode = ctx.mode
    itemsize = torch.empty((), dtype=dtype).element_size()
    cost = Cost(mode, cfg, batch, seq or cfg.seq_len, ctx.topology, dict(ctx.options), itemsize,
                recompute_kind(activation_checkpointing, selective_checkpointing), pipeline=ctx.pipeline, stage=ctx.stage,
                target_seq=target_seq or getattr(cfg, "target_len", None), zero=zero, rank=rank,
                precision=precision, padded=padded, grad_reduce_dtype=grad_reduce_dtype,
                overlap_param_gather=bool(zero) if overlap_param_gather is None else overlap_param_gather,
                parts=parts, reshard_after_forward=reshard_after_forward, reshard_microbatches=reshard_microbatches,
                overlap_grad_reduce=overlap_grad_reduce)
    CostBuilder(cost, model).build()
    return cost


def model_config(arch: str, preset: str | None, **sizes):
    """The config of `arch`'s preset (its default one without a name) with the sizes given (None: the preset's)."""
    config_class = get_arch(arch).config_class
    name = preset or config_class.default_preset
    sizes = {k: v for k, v in sizes.items() if v is not None}
    unknown = sorted(set(sizes) - {f.name for f in dataclass_fields(config_class)})
    if unknown:
        raise LatticeConfigError(f"--arch {arch} has no {', '.join(unknown)} (its sizes: "
                                 f"{', '.join(f.name for f in dataclass_fields(config_class))})")
    if "vocab_size" not in sizes and "vocab_size" not in config_class.presets.get(name, {}):
        sizes["vocab_size"] = DEFAULT_VOCAB  # the built-in corpus's, for presets of no published model
    return config_class.preset(name, **sizes)
