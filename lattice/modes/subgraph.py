"""Sub-graph parallelism: SUPER's D&SP and D&SP-cSub (docs/references.md#super §III-V).

    ctx = lattice.init("subgraph", tp=4, subgrids=2, common="all")     # D&SP
    ctx = lattice.init("subgraph", tp=4, subgrids=2, common="subgrid") # D&SP-cSub

p = tp ranks per replica form g sub-grids of n_g = p/g ranks; rank (k, m) is member m of
sub-grid k (mesh axes SUBGRID x MEMBER). The attention heads are the branches: sub-grid k owns
heads k·n/g .. (k+1)·n/g - 1 and runs them data-parallel over its n_g members, member m taking
sequences m·B/n_g .. of the replica batch B. Everything else is a common layer:

| common = | common layers run on                      | rows per rank (common) | boundaries (segmented)       |
|----------|-------------------------------------------|------------------------|------------------------------|
| "all"    | all p ranks, data parallel (D&SP)         | B/p: chunk m·g + k     | all-gather / reduce-scatter, |
|          |                                           |                        | all-to-all                   |
| "subgrid"| sub-grid 0 alone (D&SP-cSub); the others  | B/n_g on sub-grid 0,   | broadcast / reduce,          |
|          | hold no common parameters and do no       | none elsewhere         | scatter / gather             |
|          | common work                               |                        |                              |

Inside a branch the per-rank batch is B/n_g, larger than the common layers' B/p (§III-B).
A segmented collective is one collective per cross-sub-grid group: the g ranks (0..g-1, m) at
the same position of their sub-grids (the group along SUBGRID). The four boundaries of §IV:

| boundary | where (option projections=)       | D&SP forward      | D&SP-cSub forward | backward       |
|----------|-----------------------------------|-------------------|-------------------|----------------|
| split    | attention input ("branch")        | all-gather rows   | broadcast         | its conjugate: |
| sum      | attention output ("branch")       | reduce-scatter    | reduce            | reduce-scatter,|
| slice    | q, k, v by heads ("common")       | all-to-all        | scatter           | all-gather,    |
| concat   | heads back ("common")             | all-to-all        | gather            | and so on      |

With projections="branch" (the default) sub-grid k also owns its heads' q, k, v columns and
output-projection rows, so the branch is qkv → attention → proj, entered by a split and left by
a sum (the output projection's partial products over heads). With projections="common" the
projections are common layers, as in the paper's Q_i = Slice_i(W^Q Q), and the branch is the
attention itself, entered by a slice and left by a concatenation. `slice_collective="all_gather"`
replaces the slice's all-to-all (scatter) with an all-gather (broadcast) whose unneeded part is
discarded, and the concatenation's with an all-gather, as the paper does on NCCL.

Gradients: branch weights are summed over their sub-grid's members, common parameters over the
ranks that run them (ShardSpec.grad_sum, applied by Model.sync_grads).

Placement "topology" (§V, Fig. 11) deals each sub-grid's ranks round-robin over the nodes, so
the g ranks of one cross-sub-grid group are consecutive and share a node when g divides the
ranks per node: `lattice info --mode subgraph --tp 8 --subgrids 2 --ranks-per-node 4` prints
the intra/inter-node messages of a split for both placements (SUPER Eq. 4-7).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from lattice.modes import register, serial
from lattice.modes.base import Block, Mode, Option, Position, divisible, nearby_multiples
from lattice.modes.kernels.layers import (TiedHead, idle_output, linear_params, local_linear, pool_pieces,
                                          register_linear, register_weight_and_bias, rows_on_every_rank, split_segments,
                                          vocab_bias_spec)
from lattice.modes.kernels.loss import labelled_count
from lattice.modes.kernels.subgraph import Segments
from lattice.parallel import comm
from lattice.parallel.context import LatticeConfigError, MeshAxis
from lattice.parallel.sharding import ShardSpec

SUB, MEM = MeshAxis.SUBGRID, MeshAxis.MEMBER


# ----------------------------------------------------------------------------- common layers
class Embedding(serial.Embedding):
    """Token (+ position) embedding of this rank's common rows: tokens (B, T) -> (rows, T, h)."""

    def __init__(self, cfg, ctx, mode: "SubGraph", positions: bool, types: int = 0):
        super().__init__(cfg, ctx, positions, types, **mode.common_spec)
        self.seg, self.d_model = mode.seg, cfg.d_model
        # carries the model's dtype and device to the idle ranks' empty residual (GPT.to moves it)
        self.register_buffer("idle_residual", torch.zeros(0), persistent=False)

    def forward(self, tokens, start: int = 0, token_types=None, positions=None):
        mine = self.seg.common_rows(tokens.shape[0])
        if not self.seg.runs_common:  # idle: an empty residual that requires grad (see layers.idle_output)
            empty = self.idle_residual.new_zeros(0, tokens.shape[1], self.d_model)
            return empty.requires_grad_(torch.is_grad_enabled())
        return super().forward(tokens[mine], start, *(None if t is None else t[mine] for t in (token_types, positions)))


class Norm(serial.Norm):
    def __init__(self, cfg, ctx, mode: "SubGraph", kind: str, eps: float, bias: bool):
        super().__init__(cfg, ctx, kind, eps, bias, **mode.common_spec)
        self.runs = mode.seg.runs_common

    def forward(self, x):
        return super().forward(x) if self.runs else x


class CommonLinear(serial.Linear):
    """A whole linear of the common layers (MLP; attention projections with projections="common")."""

    def __init__(self, cfg, ctx, mode: "SubGraph", in_features, out_features, stack=None, segments=None, bias=True):
        super().__init__(cfg, ctx, in_features, out_features, stack, segments, bias, **mode.common_spec)
        self.seg = mode.seg
        self.out_shape = (stack, out_features) if stack else (out_features,)

    def forward(self, x):
        if self.seg.runs_common:
            return super().forward(x)
        if self.segment_names is None:
            return idle_output(x, self.out_shape)
        return tuple(idle_output(x, (w,)) for w in self.segment_widths)


class LMHead(TiedHead):
    """Cross-entropy of this rank's common rows, scaled by rows/B and summed over the replica."""

    def __init__(self, cfg, ctx, mode: "SubGraph", embedding, bias: bool = False):
        super().__init__(cfg, ctx, embedding, ShardSpec((cfg.vocab_size, cfg.d_model), **mode.common_spec),
                         vocab_bias_spec(cfg, **mode.common_spec) if bias else None)
        self.seg, self.ctx, self.vocab_size = mode.seg, ctx, cfg.vocab_size

    def _local_logits(self, x):
        return self.add_bias(x @ self.table().t())

    def loss(self, x, targets):
        B = targets.shape[0]
        rows = targets[self.seg.common_rows(B)]
        if self.seg.runs_common:
            logits = serial.upcast(self._local_logits(x))
            part = F.cross_entropy(logits.flatten(0, 1), rows.flatten(), reduction="sum") / labelled_count(targets)
        else:  # no rows here; 0 that stays in the graph, so backward reaches the branches
            part = x.sum() * 0.0
        return comm.all_reduce(part, self.ctx.tensor_group())

    def logits(self, x):
        """Full (B, T, V) logits on every rank (inference only): each rank's common rows placed in
        zeros and summed over the replica, whose ranks hold disjoint rows (idle ranks none)."""
        B = self.seg.batch
        rows = self.seg.common_rows(B)
        local = self._local_logits(x) if self.seg.runs_common else x.new_zeros(0, x.shape[1], self.vocab_size)
        return rows_on_every_rank(local, rows, B, self.ctx.tensor_group())


# ----------------------------------------------------------------------------- branch layers
class BranchLinear(nn.Module):
    """A projection inside the attention branch (projections="branch"): sub-grid k's columns
    (Position.IN: q, k, v of its heads) or rows (Position.OUT: the output projection over its
    heads); replicated over the sub-grid's members, whose gradients are summed.

    IN:  x (common rows, T, h) --split--> (B/n_g, T, h) @ W[:, .., block k] -> (B/n_g, T, [3,] h/g)
    OUT: y (B/n_g, T, h/g) @ W[block k, :] --sum--> (common rows, T, h) + b (common)
    """

    def __init__(self, cfg, ctx, mode: "SubGraph", in_features, out_features, position, stack=None, segments=None,
                 bias=True):
        super().__init__()
        self.seg, self.position = mode.seg, position
        member_sum = {"grad_sum": (MEM,)}
        if position == Position.IN:
            out_shape = (stack, out_features) if stack else (out_features,)
            last = len(out_shape)
            register_linear(self, ctx, out_shape,
                            lambda s: ShardSpec((in_features,) + s, splits=((last, (SUB,)),), **member_sum),
                            lambda s: ShardSpec(s, splits=((last - 1, (SUB,)),), **member_sum), bias, segments)
        else:  # the bias is added once, after the sum: a common parameter
            register_weight_and_bias(self, ctx, ShardSpec((in_features, out_features), splits=((0, (SUB,)),),
                                                          **member_sum),
                                     ShardSpec((out_features,), **mode.common_spec) if bias else None)

    def forward(self, x):
        if self.position == Position.IN:
            return split_segments(self, local_linear(self.seg.split(x), *linear_params(self)))
        y = self.seg.sum(x @ self.weight)
        if self.bias is None or not self.seg.runs_common:
            return y
        return y + self.bias


class SlicedProjection(CommonLinear):
    """A projection in the common layers (projections="common") whose output (IN) is sliced by
    heads into the branches, or whose input (OUT) is the branches' heads concatenated back.
    Segments (q, k, v of different widths) are interleaved by head block before the slice, so
    that one segmented collective gives sub-grid k head block k of every segment."""

    def __init__(self, cfg, ctx, mode, in_features, out_features, position, stack=None, segments=None, bias=True):
        super().__init__(cfg, ctx, mode, in_features, out_features, stack, segments, bias)
        self.position = position

    def forward(self, x):
        if self.position == Position.OUT:
            return super().forward(self.seg.concat(x))
        y = super().forward(x)
        if self.segment_names is None:
            return self.seg.slice(y)
        g = self.seg.g
        blocks = torch.cat([part.unflatten(-1, (g, -1)) for part in y], dim=-1).flatten(-2)  # head block major
        return tuple(self.seg.slice(blocks).split([w // g for w in self.segment_widths], dim=-1))


# ----------------------------------------------------------------------------- the mode
@register
class SubGraph(Mode):
    """Mesh axes SUBGRID (g) x MEMBER (n_g = tp/g) inside each data-parallel replica."""

    name = "subgraph"
    residual_replicated = False
    options = {
        "subgrids": Option(2, "number of sub-grids g (the attention heads' branches)"),
        "common": Option("all", "common layers on all ranks (D&SP) or on sub-grid 0 (D&SP-cSub)", choices=("all", "subgrid")),
        "projections": Option("branch", "attention q/k/v/output projections owned by the branches (split/sum boundaries) "
                                        "or common (slice/concat boundaries)", choices=("branch", "common")),
        "slice_collective": Option("all_to_all", "slice/concat as all-to-all (scatter/gather) or as all-gather "
                                                 "(broadcast) and discard", choices=("all_to_all", "all_gather")),
    }
    test_layouts = ({"tp": 4, "subgrids": 2}, {"tp": 4, "subgrids": 4, "common": "subgrid"},
                    {"tp": 4, "subgrids": 2, "common": "subgrid", "projections": "common"},
                    {"tp": 4, "subgrids": 4, "projections": "common", "slice_collective": "all_gather"}, {"tp": 2, "dp": 2, "subgrids": 2})

    @classmethod
    def mesh_axes(cls, tp, options):
        g = options["subgrids"]
        if g < 1 or tp % g:
            divisors = [d for d in range(1, tp + 1) if tp % d == 0]
            raise LatticeConfigError(f"mode 'subgraph' needs subgrids dividing tp: subgrids = {g} does not divide "
                                     f"tp = {tp}; use subgrids among {divisors}")
        return ((SUB, g), (MEM, tp // g))

    @classmethod
    def fit_options(cls, cfg, tp):
        """The fewest sub-grids above one that divide both tp and the head count."""
        return {"subgrids": next((g for g in range(2, tp + 1) if tp % g == 0 and cfg.n_heads % g == 0), tp)}

    @classmethod
    def rank_grid(cls, axes, ranks_per_node, placement, options):
        """Global rank at (dp d, sub-grid k, member m) = d·p + m·g + k (placement, above)."""
        sizes = dict(axes)
        dp, g, n_g = sizes.get(MeshAxis.DP, 1), sizes[SUB], sizes[MEM]
        return tuple(d * g * n_g + m * g + k for d in range(dp) for k in range(g) for m in range(n_g))

    def __init__(self, cfg, ctx):
        self.g, self.n_g = ctx.size(SUB), ctx.size(MEM)
        self.common_all = ctx.options["common"] == "all"
        self.projections, self.slice_collective = ctx.options["projections"], ctx.options["slice_collective"]
        super().__init__(cfg, ctx)
        self.seg = Segments(self)
        common_axes = (SUB, MEM) if self.common_all else (MEM,)
        self.common_spec = {"grad_sum": common_axes, "holders": () if self.common_all else ((SUB, 0),)}

    @classmethod
    def check_heads(cls, ctx, name, count):
        divisible(name, count, ctx.size(SUB), "subgrids g", f"use a number of sub-grids that divides {count} heads, "
                                                            f"or a head count that is a multiple of {ctx.size(SUB)}")

    @classmethod
    def check_batch(cls, ctx, tokens):
        b, common_all = tokens.shape[0], ctx.options["common"] == "all"
        per, what = ((ctx.size(SUB) * ctx.size(MEM), "all p ranks (D&SP)") if common_all
                     else (ctx.size(MEM), "the n_g ranks of sub-grid 0 (D&SP-cSub)"))
        divisible("batch size", b, per, "the ranks running the common layers",
                  f"the common layers split each replica's batch over {what}: give each replica a multiple "
                  f"of {per} sequences (for example {nearby_multiples(b, per)})")

    def begin_batch(self, model, batch, seq):  # the idle ranks of D&SP-cSub size what they receive by it
        self.seg.batch = batch

    # heads: sub-grid k's block; the members of a sub-grid run other sequences
    head_axes, attention_batch_axes = (SUB,), (MEM,)

    def embedding(self, *, positions=True, types=0):
        return Embedding(self.cfg, self.ctx, self, positions, types)

    def norm(self, kind="layer", *, eps, bias):
        return Norm(self.cfg, self.ctx, self, kind, eps, bias)

    def linear(self, in_features, out_features, *, block: Block, position: Position, stack=None, segments=None,
               bias: bool):
        if segments and position != Position.IN:
            raise ValueError("only a Position.IN linear can be segmented")
        if block == Block.MLP:
            return CommonLinear(self.cfg, self.ctx, self, in_features, out_features, stack, segments, bias)
        kind = BranchLinear if self.projections == "branch" else SlicedProjection
        return kind(self.cfg, self.ctx, self, in_features, out_features, position, stack, segments, bias)

    def lm_head(self, embedding, *, bias=False):
        return LMHead(self.cfg, self.ctx, self, embedding, bias)

    def residual_shape(self, batch, seq):
        rows = self.seg.common_rows(batch)
        return (rows.stop - rows.start, seq, self.cfg.d_model)

    def attention_rows(self, batch):
        rows = self.seg.branch_rows(batch)  # member m's sequences, its sub-grid's heads
        return slice(self.seg.m * rows, (self.seg.m + 1) * rows)

    expert_split_axis = MEM

    @classmethod
    def usable_expert_axis(cls, options):
        return MEM if options.get("common") == "all" else None  # common="subgrid": sub-grid 0 alone routes

    @classmethod
    def expert_axes(cls, ep, tp, dp, options, cp=1):
        try:
            return super().expert_axes(ep, tp, dp, options, cp)
        except LatticeConfigError as e:
            if options.get("common") == "all":
                raise
            raise LatticeConfigError(f"{e} (with common='subgrid' the common rows run on sub-grid 0 alone; "
                                     f"common='all' splits them over the sub-grids' members too)") from None

    def token_spec(self):
        return self.common_spec  # the common rows' parameters: an expert is one

    def residual_rows(self, batch):
        return self.seg.common_rows(batch)

    def pool(self, x, index, batch):
        """This rank's common rows (none on an idle rank of D&SP-cSub) of the position `index`."""
        rows = self.seg.common_rows(batch)
        return pool_pieces(x[:, index], rows, slice(0, x.shape[-1]), batch, x.shape[-1], self.ctx.tensor_group())

    # Rank (k, m) runs common rows r_c (D&SP: B/p; D&SP-cSub: B/n_g on sub-grid 0, none
    # elsewhere) and branch rows r_b = B/n_g. Every forward boundary is recomputed under
    # checkpointing (the block's last saved tensors follow them). Gradient sums (branch weights
    # over the sub-grid, common parameters over the ranks running them) follow from the specs.
    def _rows(self, b) -> tuple[float, float]:
        r_b = b.B / self.n_g
        if not self.seg.runs_common:
            return 0.0, r_b
        return (b.B / (self.g * self.n_g) if self.common_all else r_b), r_b

    def cost_product_rows(self, b, block):
        r_c, r_b = self._rows(b)  # a branch's projections on its members' rows, the rest on common rows
        return (r_b if block == "attention" and self.projections == "branch" else r_c) * b.T

    def cost_shares(self, b):
        r_c, r_b = self._rows(b)
        common = r_c / b.B
        return {"attention": r_b / b.B / self.g, "mlp": common, "head": common, "replicated": common}

    def _boundary(self, b, forward, backward, elements):
        b.add("forward", forward, (SUB,), elements, 1, "branch")
        b.add("backward", backward, (SUB,), elements, 1, "branch")

    def cost_embedding(self, b, positions, types):
        """Common rows only; no communication. Saves the token ids (a view of the whole batch)."""
        b.save_ints(8 * b.M if self.seg.runs_common else 0)

    def cost_norm(self, b, kind, bias):
        r_c, _ = self._rows(b)
        return r_c * b.T * (b.h + (2 if kind == "layer" else 1))

    def cost_linear(self, b, in_features, out_features, *, block, position, bias, input_saved):
        """MLP linears are common layers. With projections="branch" an attention block is
        entered by a split of (r_b, T, h) (D&SP all-gather, cSub broadcast) and left by a sum of
        the same size (reduce-scatter, reduce), each with the other as its backward; with
        projections="common" by a slice of the projection's output and a concatenation of the
        heads (all-to-all counting the buffer a rank sends, scatter/gather the group's whole
        buffer; or all-gather / broadcast and discard)."""
        r_c, r_b = self._rows(b)
        T, g = b.T, self.g
        if block == "mlp":
            return (0 if input_saved else r_c * T * in_features), r_c * T * out_features
        first = position == "in"
        if self.projections == "branch":
            split, join = ("all_gather", "reduce_scatter") if self.common_all else ("broadcast", "reduce")
            if first:
                self._boundary(b, split, join, r_b * T * in_features)
                return r_b * T * in_features, r_b * T * out_features / g
            self._boundary(b, join, split, r_b * T * out_features)
            return (0 if input_saved else r_b * T * in_features / g), r_c * T * out_features
        by_gather = self.slice_collective == "all_gather"
        if first:  # the slice of q, k, v
            if self.common_all and not by_gather:  # the slice sends its common rows of every head
                self._boundary(b, "all_to_all", "all_to_all", r_c * T * out_features)
            elif self.common_all:
                self._boundary(b, "all_gather", "reduce_scatter", r_b * T * out_features)
            elif not by_gather:
                self._boundary(b, "scatter", "gather", r_b * T * out_features)
            else:
                self._boundary(b, "broadcast", "reduce", r_b * T * out_features)
            return (0 if input_saved else r_c * T * in_features), r_b * T * out_features / (1 if by_gather else g)
        # the concatenation of the heads back into the common rows
        if self.common_all and not by_gather:
            self._boundary(b, "all_to_all", "all_to_all", r_b * T * in_features / g)
            saved = r_c * T * in_features
        elif not self.common_all and not by_gather:
            self._boundary(b, "gather", "scatter", r_b * T * in_features)
            saved = r_c * T * in_features
        else:  # all-gather and discard: the whole gathered buffer stays alive through the view
            self._boundary(b, "all_gather", "reduce_scatter", r_b * T * in_features)
            saved = r_b * T * in_features if self.seg.runs_common else 0
        return saved, r_c * T * out_features

    def cost_product_output(self, b, out_features, *, block, position, out):
        if block != "attention" or (position == "in" and self.projections == "branch"):
            return out
        # a branch's OUT product on its rows, summed over the branch after; a common projection's whole
        return self.cost_product_rows(b, block) * out_features

    def cost_keeps_input(self, block, position):
        return not (block == "attention" and position == "in" and self.projections == "branch")  # a split's copy

    def cost_lm_head(self, b):
        """Cross-entropy of the common rows, its one value all-reduced over the replica. Saves
        the head input, the log-softmax, the total weight and the targets (common ranks)."""
        r_c, _ = self._rows(b)
        b.add("forward", "all_reduce", (SUB, MEM), 1, 1, "loss", itemsize=max(4, b.c.itemsize))
        runs = self.seg.runs_common
        b.save_ints(8 * b.M if runs else 0)
        return r_c * b.T * (b.h + b.V) + (1 if runs else 0)

    def cost_pool(self, b):
        """Every rank's common rows of the position placed and all-reduced over the replica."""
        b.add("forward", "all_reduce", (SUB, MEM), b.B * b.h)
        return b.B * b.h
