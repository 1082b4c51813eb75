"""3D tensor parallelism on a load-balanced q x q x q cube (docs/references.md#3d).

    ctx = lattice.init("3d", tp=8)      # q = 2

Rank (i, j, l) on mesh axes CUBE_I x CUBE_J x CUBE_L. A linear Y = X W with X [M, N] (M = B·T
tokens, whole sequences) and W [N, K]:

    tensor           held on rank (i, j, l)                            shape
    X (input)        piece j of row block i, column block l            [M/q², N/q]
    W                piece i of row block l, column block j            [N/q², K/q]
    forward          all-gather X along j -> X_il; all-gather W along i -> W_lj; X_il W_lj;
                     reduce-scatter along l -> piece l of Y_ij         [M/q², K/q]
    backward         all-gather dY along l; dX = dY Wᵀ reduce-scattered along j; dW = Xᵀ dY
                     reduce-scattered along i (X and W gathered again, not kept)
    overlap          (option, on by default) W's all-gather is issued asynchronously first and
                     runs while X's (and in backward dY's and X's) gathers do; dX's
                     reduce-scatter runs while dW's product is computed

So every rank stores exactly 1/p of X, W and Y, and the output's column index is j and its piece
index l: the roles of j and l swap. The first linear of a block (Position.IN: qkv, fc) takes the
residual layout R = (B/q², T, h/q), batch pieces (i, j), hidden block l, and returns batch pieces
(i, l) with feature block j -- whole heads j·n/q .. of whole sequences, so attention is local --
and the second (Position.OUT: the projections) swaps back to R. Each block returns activations in
its input's layout with no transposition.

Vectors (biases, LayerNorm weight and bias, the position table) are split q ways along the
feature index they are added to and stored once per block, on the ranks with the other two
coordinates 0; forward broadcasts them over that plane, backward reduces their gradients back.
LayerNorm all-reduces per-token (Σx, Σx²) along l. The token table is the 3D weight of
onehot(tokens) E (pieces over (j, i) of the vocabulary, padded to a multiple of q², columns over
l); the LM head is X Eᵀ with the same table and a vocabulary-parallel cross-entropy over j that
never gathers the logits.

Placement: with the activations much larger than the weights (B·T > h), the input gathers and
output reduce-scatters along j and l carry nearly all the traffic, the weight gathers along i
little; the natural order keeps l innermost and j next, so "topology" placement is the natural
one: `lattice info --mode 3d --tp 8 --ranks-per-node 4` counts 16 / 0 intra / inter-node
messages for one collective along j and along l, and 8 / 8 along i (summed over the 8 ranks).
"""

from __future__ import annotations

import math

import torch.nn as nn

from lattice.modes import register
from lattice.modes.base import Block, Mode, Option, Position, divisible, nearby_multiples
from lattice.modes.kernels.cube import Cube, CubeEmbed, hosted, linear_3d
from lattice.modes.kernels.layers import (TiedHead, add_position_rows, check_norm_kind, compute_dtype, linear_params,
                                          normalize_split_hidden, pool_pieces, position_rows, position_span,
                                          register_linear, register_position_tables, round_up, rows_on_every_rank,
                                          split_segments, vocab_bias_spec, vocab_table_spec)
from lattice.modes.kernels.loss import labelled_count, vocab_parallel_cross_entropy
from lattice.modes.kernels.tokens import columns_to_tokens, cost_columns_to_tokens
from lattice.parallel import comm
from lattice.parallel.context import LatticeConfigError, MeshAxis
from lattice.parallel.sharding import ShardSpec, register_sharded

CI, CJ, CL = MeshAxis.CUBE_I, MeshAxis.CUBE_J, MeshAxis.CUBE_L


# plane over which a vector indexed by a feature block along `axis` is broadcast, and its holders
PLANE = {CL: (CI, CJ), CJ: (CI, CL)}


def vector_spec(shape, dim, axis, replicated: bool = False) -> ShardSpec:
    """A vector (or the position table) split along `dim` over `axis`, held where the plane's
    coordinates are 0, or (`replicated`) on every rank of the plane with its gradient summed there."""
    if replicated:
        return ShardSpec(shape, ((dim, (axis,)),), grad_sum=PLANE[axis])
    return ShardSpec(shape, ((dim, (axis,)),), tuple((a, 0) for a in PLANE[axis]))


class Embedding(nn.Module):
    """tokens (B, T), identical on every rank of the replica -> (B/q², T, h/q): batch pieces (i, j),
    hidden block l."""

    def __init__(self, cfg, mode: "Cube3D", positions: bool, types: int = 0):
        super().__init__()
        self.cube, self.q = mode.cube, mode.q
        register_sharded(self, "wte", mode.table_spec(), mode.ctx)
        register_position_tables(self, cfg, mode.ctx, positions, types, lambda shape: vector_spec(shape, 1, CL, self.cube.replicated))

    def forward(self, tokens, start: int = 0, token_types=None, positions=None):
        c, q = self.cube, self.q
        B, T = tokens.shape
        rows = tokens[c.i * (B // q):(c.i + 1) * (B // q)].reshape(-1)  # row block i: (B/q · T,)
        vocab_start = c.j * q * self.wte.shape[0]
        x = CubeEmbed.apply(self.wte, rows, vocab_start, (c.group(CI), c.group(CJ)))
        x = x.view(B // (q * q), T, -1)
        if not self.positions:
            return x
        first, count, index = position_span(start, T, positions)
        pos = hosted(position_rows(self, first, count), (count + self.types, x.shape[-1]), c, PLANE[CL], x.dtype,
                     x.device)
        piece = slice((c.i * q + c.j) * x.shape[0], (c.i * q + c.j + 1) * x.shape[0])  # the residual's batch piece (i, j)
        return add_position_rows(x, pos, count, None if token_types is None else token_types[piece],
                                 slice(None) if index is None else index[piece])


class Norm(nn.Module):
    """LayerNorm or RMSNorm of (B/q², T, h/q), hidden block l -> same; statistics all-reduced
    along l."""

    def __init__(self, cfg, mode: "Cube3D", kind: str, eps: float, bias: bool):
        super().__init__()
        check_norm_kind(kind, bias)
        self.cube, self.h, self.eps, self.kind = mode.cube, cfg.d_model, eps, kind
        spec = vector_spec((cfg.d_model,), 0, CL, mode.cube.replicated)
        register_sharded(self, "weight", spec, mode.ctx)
        self.has_bias = bias
        if bias:
            register_sharded(self, "bias", spec, mode.ctx)
        else:
            self.bias = None

    def forward(self, x):
        c, shape = self.cube, x.shape[-1:]
        w = hosted(self.weight, shape, c, PLANE[CL], x.dtype, x.device)
        b = hosted(self.bias, shape, c, PLANE[CL], x.dtype, x.device) if self.has_bias else None
        y = normalize_split_hidden(x, c.group(CL), self.h, self.eps, self.kind) * w
        return y + b if b is not None else y


class Linear(nn.Module):
    """Position.IN: (B/q², T, in/q) batch (i, j), features l -> (B/q², T, [stack,] out/q) batch
    (i, l), features j. Position.OUT: the swapped roles, back to the residual layout."""

    def __init__(self, cfg, mode: "Cube3D", in_features, out_features, position, stack=None, segments=None,
                 bias=True):
        super().__init__()
        self.cube, self.overlap, self.keep = mode.cube, mode.overlap, mode.keep_gathered
        out_shape = (stack, out_features) if stack else (out_features,)
        last = len(out_shape)
        # IN: x columns along l, output along j; OUT: the other way round
        self.x_axis, self.y_axis = (CL, CJ) if position == Position.IN else (CJ, CL)
        # with segments, piece i of block (l, j) of each segment side by side: the gathers run
        # along rows and the reduce-scatter along tokens, so the segments' columns stay apart
        register_linear(self, mode.ctx, out_shape,
                        lambda s: ShardSpec((in_features,) + s, ((0, (self.x_axis, CI)), (last, (self.y_axis,)))),
                        lambda s: vector_spec(s, last - 1, self.y_axis, mode.cube.replicated), bias, segments)
        self.has_bias = bias
        self.local_out = out_shape[:-1] + (out_shape[-1] // mode.q,)

    def forward(self, x):
        c = self.cube
        weight, bias = linear_params(self)
        # the bias broadcast first, so that checkpoint recomputation repeats every collective
        b = (hosted(bias, self.local_out, c, PLANE[self.y_axis], compute_dtype(x), x.device)
             if self.has_bias else None)
        w = weight if isinstance(weight, tuple) else weight.reshape(weight.shape[0], -1)
        # the input's batch pieces are gathered along the axis that is not its feature axis, and
        # the product reduce-scattered along its feature axis (which then indexes the batch pieces)
        batch_axis = CJ if self.x_axis == CL else CL
        y = linear_3d(x.reshape(-1, x.shape[-1]), w, c.group(batch_axis), c.group(CI), c.group(self.x_axis),
                      overlap=self.overlap, keep=self.keep)
        if b is not None:
            y = y + b.reshape(-1)
        return split_segments(self, y.view(x.shape[0], x.shape[1], *self.local_out))


class GatheredLinear(nn.Module):
    """`Cube3D.dense`: x (B/q², T, in/q), hidden block l, all-gathered along l to whole hidden
    vectors, times column block l of W (in, out) -> (B/q², T, out/q), the residual layout again.
    W and b are split over l alone (a 3D product would swap l for j) and replicated over the
    (i, j) plane, whose ranks hold other tokens: their gradients are summed there. Backward:
    the input gradient x̄ = ȳ W_lᵀ is a partial sum over l, reduce-scattered along l."""

    def __init__(self, cfg, mode: "Cube3D", in_features, out_features, bias):
        super().__init__()
        self.cube = mode.cube
        plane = {"grad_sum": (CI, CJ)}
        register_sharded(self, "weight", ShardSpec((in_features, out_features), ((1, (CL,)),), **plane), mode.ctx)
        if bias:
            register_sharded(self, "bias", ShardSpec((out_features,), ((0, (CL,)),), **plane), mode.ctx)
        else:
            self.bias = None

    def forward(self, x):
        whole = comm.all_gather(x, self.cube.group(CL), x.dim() - 1)  # (B/q², T, in)
        y = whole @ self.weight
        return y if self.bias is None else y + self.bias


class LMHead(TiedHead):
    """logits = X Eᵀ on the cube (X in the residual layout, E the token table's pieces), with the
    vocabulary-parallel cross-entropy over j; the mean loss summed over the (i, l) plane."""

    def __init__(self, cfg, mode: "Cube3D", embedding, bias: bool = False):
        # the bias: vocabulary block j of the logits, on every (i, l) (each scores other tokens)
        super().__init__(cfg, mode.ctx, embedding, mode.table_spec(),
                         vocab_bias_spec(cfg, (CJ,), mode.q * mode.q, grad_sum=(CI, CL)) if bias else None)
        self.cube, self.q, self.vocab_size, self.vocab_pad = mode.cube, mode.q, cfg.vocab_size, mode.vocab_pad
        self.overlap, self.keep = mode.overlap, mode.keep_gathered

    def _local_logits(self, x):  # (B/q², T, h/q) batch (i, j) -> (B/q² · T, V'/q) batch (i, l), vocab j
        c = self.cube
        return self.add_bias(linear_3d(x.reshape(-1, x.shape[-1]), self.table(), c.group(CJ), c.group(CI),
                                       c.group(CL), transpose_w=True, overlap=self.overlap, keep=self.keep))

    def loss(self, x, targets):
        c, q = self.cube, self.q
        B, T = targets.shape
        b = B // (q * q)
        start = c.i * (B // q) + c.l * b  # rows of batch pieces (i, l)
        mine = targets[start:start + b].reshape(-1)
        vb = self.vocab_pad // q
        per_token = vocab_parallel_cross_entropy(self._local_logits(x), mine, c.group(CJ), c.j * vb, self.vocab_size)
        return comm.all_reduce(per_token.sum() / labelled_count(targets), c.group(CI, CL))

    def logits(self, x):
        """Full (B, T, V) logits on every rank (inference only): the vocabulary gathered along j,
        then each rank's batch piece (i, l) placed in zeros and summed over the (i, l) plane."""
        c, q, b = self.cube, self.q, x.shape[0]
        local = comm.all_gather(self._local_logits(x), c.group(CJ), 1)[:, : self.vocab_size]  # (b·T, V)
        piece = c.i * q + c.l
        return rows_on_every_rank(local.view(b, x.shape[1], -1), slice(piece * b, (piece + 1) * b), q * q * b,
                                  c.group(CI, CL))


@register
class Cube3D(Mode):
    """Mesh axes CUBE_I x CUBE_J x CUBE_L (q each, tp = q³) inside each data-parallel replica.
    Needs the replica batch divisible by q², heads by q and d_model by q²; the vocabulary is
    padded to a multiple of q²."""

    name = "3d"
    residual_replicated = False
    options = {"overlap": Option(True, "gather each weight asynchronously while the input's gather runs "
                                       "(forward) or dY's and X's (backward), and reduce-scatter dX while "
                                       "dW is computed"),
               "vectors": Option("replicated", "where the vectors (biases, norm weights, position rows) live: "
                                               "once per plane, broadcast in forward and reduced in backward "
                                               "(hosted), or on every rank of the plane, their gradients summed "
                                               "after backward (replicated)", choices=("hosted", "replicated")),
               "keep_gathered": Option(True, "keep each product's all-gathered input and weight for backward "
                                             "(q times their pieces' memory until backward) instead of "
                                             "gathering them again")}
    # the defaults are the settings measured fastest (benchmarks/results/peer_blocks.txt)
    paper_options = {"vectors": "hosted", "keep_gathered": False}
    test_layouts = ({"tp": 8}, {"tp": 8, "overlap": False, **paper_options})

    @classmethod
    def mesh_axes(cls, tp, options):
        q = round(tp ** (1 / 3))
        if q ** 3 != tp or q < 2:
            lower = max(2, math.floor(tp ** (1 / 3)))
            raise LatticeConfigError(
                f"mode '3d' needs tp = q*q*q ranks per replica with q >= 2; tp={tp} is not such a cube: use "
                f"tp={lower ** 3} (q={lower}) or tp={(lower + 1) ** 3} (q={lower + 1})")
        return ((CI, q), (CJ, q), (CL, q))

    @classmethod
    def groups(cls, topology):
        return ((CI, CJ), (CI, CL))  # the planes of the vectors' broadcasts and the loss sum

    def __init__(self, cfg, ctx):
        self.q = ctx.size(CI)
        self.overlap, self.keep_gathered = ctx.options["overlap"], ctx.options["keep_gathered"]
        super().__init__(cfg, ctx)
        self.vocab_pad = round_up(cfg.vocab_size, self.q * self.q)
        self.cube = Cube(ctx)

    @classmethod
    def check_config(cls, cfg, ctx):
        q = ctx.size(CI)
        divisible("d_model", cfg.d_model, q * q, "q² (the 3D cube side squared)")

    @classmethod
    def check_heads(cls, ctx, name, count):
        q = ctx.size(CI)
        divisible(name, count, q, "the 3D cube side q",
                  f"use a head count that is a multiple of {q}, or a cube with a side dividing {count}")

    @classmethod
    def check_batch(cls, ctx, tokens):
        q, b = ctx.size(CI), tokens.shape[0]
        divisible("batch size", b, q * q, "q² (the 3D cube side squared)",
                  f"give each replica a multiple of {q * q} sequences (for example {nearby_multiples(b, q * q)})")

    def table_spec(self) -> ShardSpec:
        """(V, h): vocabulary rows in q² pieces over (j, i) -- block j, piece i -- and hidden
        columns over l; V padded with zero rows to a multiple of q²."""
        return vocab_table_spec(self.cfg, ((0, (CJ, CI)), (1, (CL,))), self.q * self.q)

    # after the first linear of a block, feature block j (whole heads) of batch pieces (i, l)
    head_axes, attention_batch_axes = (CJ,), (CI, CL)

    def embedding(self, *, positions=True, types=0):
        return Embedding(self.cfg, self, positions, types)

    def norm(self, kind="layer", *, eps, bias):
        return Norm(self.cfg, self, kind, eps, bias)

    def linear(self, in_features, out_features, *, block: Block, position: Position, stack=None, segments=None,
               bias: bool):
        if segments and position != Position.IN:
            raise ValueError("only a Position.IN linear can be segmented")
        return Linear(self.cfg, self, in_features, out_features, position, stack, segments,
                      bias)

    def dense(self, in_features, out_features, *, bias=True):
        return GatheredLinear(self.cfg, self, in_features, out_features, bias)

    def lm_head(self, embedding, *, bias=False):
        return LMHead(self.cfg, self, embedding, bias)

    def residual_shape(self, batch, seq):
        return (batch // self.q ** 2, seq, self.cfg.d_model // self.q)

    def attention_rows(self, batch):
        rows = batch // self.q ** 2  # batch piece (i, l), heads of block j
        start = self.cube.i * self.q * rows + self.cube.l * rows
        return slice(start, start + rows)

    expert_split_axis = CL  # the hidden group, which trades columns for tokens

    def token_spec(self):
        return {"grad_sum": (CI, CJ, CL)}

    def residual_rows(self, batch):
        rows = batch // self.q ** 2  # batch piece (i, j)
        start = self.cube.i * self.q * rows + self.cube.j * rows
        return slice(start, start + rows)

    def cost_expert_tokens(self, b):
        return cost_columns_to_tokens(b, (CL,), self.q)

    def expert_tokens(self, x, mask):  # piece (i, j)'s tokens, hidden block l: 1/q of them, whole
        return columns_to_tokens(*super().expert_tokens(x, mask), self.cube.group(CL))

    def pool(self, x, index, batch):
        """(B/q², T, h/q) batch pieces (i, j), hidden block l -> the (batch, h) position `index`."""
        c, (rows, h_local) = self.cube, (x.shape[0], x.shape[-1])
        start = c.i * self.q * rows + c.j * rows
        return pool_pieces(x[:, index], slice(start, start + rows), slice(c.l * h_local, (c.l + 1) * h_local),
                           batch, h_local * self.q, self.ctx.tensor_group())

    def padded_vocab(self):
        return self.vocab_pad

    # Per linear Y = X W (X [M, N], W [N, K]): forward all-gathers X's pieces (M·N/q² gathered)
    # along its batch-piece axis and W's (N·K/q²) along i, reduce-scatters the product (M·K/q²)
    # along its feature axis; backward all-gathers dY, X and W again and reduce-scatters dX and
    # dW (with keep_gathered, X and W are the ones forward gathered and kept: no gathers but dY's).
    # Vectors of a K/q block are broadcast over their plane (q² ranks) and reduced back.
    # Under checkpointing every forward collective of a layer runs again: a custom Function
    # packs its saved inputs only after its forward (collectives included) returns.
    def _product(self, b, M, N, K, batch_axis, x_axis, site):
        q = self.q
        mn, nk, mk = M * N / q ** 2, N * K / q ** 2, M * K / q ** 2
        for op, axis, elements in (("all_gather", batch_axis, mn), ("all_gather", CI, nk),
                                   ("reduce_scatter", x_axis, mk)):
            b.add("forward", op, (axis,), elements, 1, site)
        regathered = () if self.keep_gathered else (("all_gather", batch_axis, mn), ("all_gather", CI, nk))
        for op, axis, elements in (("all_gather", x_axis, mk), *regathered, ("reduce_scatter", CI, nk)):
            b.add("backward", op, (axis,), elements, 1, site)
        # dX's reduce-scatter, with overlap beside dW's product (Cost.time's ".hidden" terms)
        b.add("backward", "reduce_scatter", (batch_axis,), mn, 1, f"{site}.hidden" if self.overlap else site)

    def _kept(self, M, N, K) -> float:
        """Elements a product saves with keep_gathered (instead of its input): the gathered X and W."""
        return (M * N + N * K) / self.q ** 2

    def _vectors(self, b, elements, calls, plane, site):
        """Hosted vectors' broadcast and reduce (replicated ones are summed over the plane with the
        in-replica gradient sums, which the builder prices from their specs)."""
        if not self.cube.replicated:
            b.add("forward", "broadcast", plane, elements, calls, site)
            b.add("backward", "reduce", plane, elements, calls, site)

    def cost_product_rows(self, b, block):
        return b.M / self.q  # x gathered along one cube axis: (B/q · T) rows

    def cost_embedding(self, b, positions, types):
        """onehot(tokens) E with the swapped roles (table pieces gathered along i, rows
        reduce-scattered along j); wpe[:T] broadcast over its plane. Saves the token ids."""
        q, h = self.q, b.h
        b.add("forward", "all_gather", (CI,), b.vocab_padded * h / q ** 2)
        b.add("forward", "reduce_scatter", (CJ,), b.M * h / q ** 2)
        b.add("backward", "all_gather", (CJ,), b.M * h / q ** 2)
        b.add("backward", "reduce_scatter", (CI,), b.vocab_padded * h / q ** 2)
        if positions:
            self._vectors(b, (b.position_rows + types) * h / q, 1, PLANE[CL], "embedding")
        b.save_ints(8 * b.M)

    def cost_norm(self, b, kind, bias):
        """Weight (and bias) blocks broadcast over the (i, j) plane; (Σx, Σx²) (RMSNorm: Σx²) of
        M/q² tokens all-reduced along l, forward and backward. Saves x̂, rstd per token and the
        broadcast weight block."""
        q, vec, sums = self.q, (2 if bias else 1), (2 if kind == "layer" else 1)
        self._vectors(b, vec * b.h / q, vec, PLANE[CL], "norm")
        b.add("forward", "all_reduce", (CL,), sums * b.M / q ** 2, 1, "norm")
        b.add("backward", "all_reduce", (CL,), sums * b.M / q ** 2, 1, "norm")
        return b.M * b.h / q ** 3 + b.M / q ** 2 + (0 if self.cube.replicated else b.h / q)  # (a parameter's own)

    def cost_linear(self, b, in_features, out_features, *, block, position, bias, input_saved):
        """IN: the input's batch pieces gathered along j, the product reduce-scattered along l
        (features j out); OUT: the swapped roles, back to the residual layout."""
        q = self.q
        first = position == "in"
        if bias:
            self._vectors(b, out_features / q, 1, PLANE[CJ] if first else PLANE[CL], "bias")
        self._product(b, b.M, in_features, out_features, CJ if first else CL, CL if first else CJ, "linear")
        if self.keep_gathered:  # the gathered copies, not the input
            return self._kept(b.M, in_features, out_features), b.M * out_features / q ** 3
        saved = 0 if input_saved else b.M * in_features / q ** 3
        return saved, b.M * out_features / q ** 3

    def cost_product_output(self, b, out_features, *, block, position, out):
        return out * self.q  # before its reduce-scatter

    def cost_keeps_input(self, block, position):
        return not self.keep_gathered

    def cost_dense(self, b, in_features, out_features, bias):
        """The input all-gathered along l, its gradient reduce-scattered back. Saves the
        gathered input."""
        rows = b.M / self.q ** 2
        b.add("forward", "all_gather", (CL,), rows * in_features)
        b.add("backward", "reduce_scatter", (CL,), rows * in_features)
        return rows * in_features, rows * out_features / self.q

    def cost_lm_head(self, b):
        """X Eᵀ as a product with the first roles; the cross-entropy's max and (Σe^x, target
        logit) of M/q² tokens all-reduced along j, the mean loss over the (i, l) plane. Saves the
        head input, the softmax piece and the targets of the rank's batch pieces."""
        q, M = self.q, b.M
        self._product(b, M, b.h, b.vocab_padded, CJ, CL, "head")
        loss_size = max(4, b.c.itemsize)
        b.add("forward", "all_reduce", (CJ,), 3 * M / q ** 2, 2, "loss", itemsize=loss_size)
        b.add("forward", "all_reduce", (CI, CL), 1, 1, "loss", itemsize=loss_size)
        b.save_ints(M / q ** 2 * (8 + 1))  # target ids, hit mask
        head_input = self._kept(M, b.h, b.vocab_padded) if self.keep_gathered else M * b.h / q ** 3
        return head_input + M * b.vocab_padded / q ** 3

    def cost_pool(self, b):
        """Every piece of the position placed and all-reduced over the q³ ranks."""
        b.add("forward", "all_reduce", (CI, CJ, CL), b.B * b.h)
        return b.B * b.h
