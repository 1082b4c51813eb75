"""2D tensor parallelism: SUMMA / Optimus (docs/references.md#optimus §3.2) on a q x q mesh per replica.

    tensor                       full            on rank (i, j)                        held by
    residual x, LN, linear in    (B, T, h)       (B/q, T, h/q): batch i, hidden j      all
    fc output / attention out    (B, T, 4h | h)  (B/q, T, 4h/q | h/q)                  all
    qkv output                   (B, T, 3, h)    (B/q, T, 3, h/q): heads j·n/q ..      all
    linear weight W[in, out]     (in, [3,] out)  block (i, j): (in/q, [3,] out/q)      all
    token table wte              (V, h)          block (i, j): (V_pad/q, h/q)          all
    biases, LayerNorm, wpe       (.., h | 4h)    columns block j                       row 0
    logits (loss: never whole)   (B, T, V)       (B/q, T, V_pad/q): batch i, vocab j   all

Linear layers are SUMMA C = A B; attention is local (n/q heads of B/q sequences per rank); the
LM head is C = A Bᵀ against the (tied) table. Row-0 parameters are broadcast down their column
in forward and their gradients reduced back to row 0 (Fig. 5). LayerNorm and cross-entropy
all-reduce per-token sums along the row (§3.2.2).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from lattice.modes import register
from lattice.modes.base import Block, Mode, Option, Position, divisible, nearby_multiples
from lattice.modes.kernels.layers import (TiedHead, add_position_rows, check_norm_kind, compute_dtype, linear_params,
                                          normalize_split_hidden, pool_pieces, position_rows, position_span,
                                          register_linear, register_position_tables, register_weight_and_bias, round_up,
                                          split_segments, vocab_bias_spec, vocab_table_spec)
from lattice.modes.kernels.loss import labelled_count, vocab_parallel_cross_entropy
from lattice.modes.kernels.summa import SummaEmbed, SummaGrid, summa_ab, summa_abt
from lattice.modes.kernels.tokens import columns_to_tokens, cost_columns_to_tokens
from lattice.parallel import comm
from lattice.parallel.context import LatticeConfigError, MeshAxis, Topology
from lattice.parallel.sharding import ShardSpec, register_sharded

ROW, COL = MeshAxis.ROW, MeshAxis.COL
ON_ROW_0 = ((ROW, 0),)


def vector_spec(shape, dim, grid: SummaGrid) -> ShardSpec:
    """A vector (bias, norm weight, position rows) split along `dim` over the columns, held on
    row 0 (Fig. 5), or with replicated vectors on every row, its gradient summed down the column."""
    if grid.replicated:
        return ShardSpec(shape, ((dim, (COL,)),), grad_sum=(ROW,))
    return ShardSpec(shape, ((dim, (COL,)),), ON_ROW_0)


def hosted(param, shape, grid: SummaGrid, dtype: torch.dtype, device) -> torch.Tensor:
    """Fig. 5: a row-0 parameter block on every rank of its column. Forward: broadcast from row 0
    down column j; backward: the gradients of the column reduced to row 0. `dtype` must be the
    same on every rank (the activations' dtype: under autocast, parameters join in its dtype).
    With vectors="replicated" every row holds the block (its gradient summed down the column with
    the other in-replica sums, after backward): no collective here."""
    if grid.replicated:
        return param.to(dtype)
    if grid.i == 0:
        src = param.to(dtype)
    else:
        src = grid.workspace.receive(shape, dtype, device)
    return comm.broadcast(src, grid.col, 0)


class Embedding(nn.Module):
    """Tokens (B, T), identical on every rank of the replica -> x (B/q, T, h/q)."""

    def __init__(self, cfg, mode: "Summa2D", positions: bool, types: int = 0):
        super().__init__()
        self.grid = mode.grid
        register_sharded(self, "wte", mode.table_spec(), mode.ctx)
        register_position_tables(self, cfg, mode.ctx, positions, types,
                                 lambda shape: vector_spec(shape, 1, self.grid))

    def forward(self, tokens, start: int = 0, token_types=None, positions=None):
        g = self.grid
        B, T = tokens.shape
        mine = slice(g.i * (B // g.q), (g.i + 1) * (B // g.q))
        x = SummaEmbed.apply(self.wte, tokens[mine].reshape(-1), g).view(B // g.q, T, -1)  # (B/q, T, h/q)
        if not self.positions:
            return x
        first, count, index = position_span(start, T, positions)
        pos = hosted(position_rows(self, first, count), (count + self.types, x.shape[-1]), g, x.dtype, x.device)
        return add_position_rows(x, pos, count, None if token_types is None else token_types[mine],
                                 slice(None) if index is None else index[mine])


class Norm(nn.Module):
    """LayerNorm or RMSNorm of (B/q, T, h/q): the statistics all-reduced along the row (§3.2.2),
    weight and bias hosted on row 0 and broadcast down the column."""

    def __init__(self, cfg, mode: "Summa2D", kind: str, eps: float, bias: bool):
        super().__init__()
        check_norm_kind(kind, bias)
        self.grid, self.h, self.eps, self.kind = mode.grid, cfg.d_model, eps, kind
        spec = vector_spec((cfg.d_model,), 0, mode.grid)
        register_weight_and_bias(self, mode.ctx, spec, spec if bias else None)
        self.has_bias = bias

    def forward(self, x):  # (B/q, T, h/q) -> same
        shape = x.shape[-1:]
        w = hosted(self.weight, shape, self.grid, x.dtype, x.device)
        b = hosted(self.bias, shape, self.grid, x.dtype, x.device) if self.has_bias else None
        y = normalize_split_hidden(x, self.grid.row, self.h, self.eps, self.kind) * w
        return y + b if b is not None else y


class Linear(nn.Module):
    """y = x W + b as SUMMA C = A B: x (B/q, T, in/q), W block (in/q, [stack,] out/q) ->
    (B/q, T, [stack,] out/q). With a stack (qkv), out columns j are heads j·n/q .. of q, k and v;
    with segments, block j of every segment (SUMMA's columns are independent, so the segments'
    blocks side by side are one product)."""

    def __init__(self, cfg, mode: "Summa2D", in_features, out_features, stack=None, segments=None, bias=True):
        super().__init__()
        self.grid = mode.grid
        out_shape = (stack, out_features) if stack else (out_features,)
        last = len(out_shape)
        register_linear(self, mode.ctx, out_shape,
                        lambda s: ShardSpec((in_features,) + s, ((0, (ROW,)), (last, (COL,)))),  # rows over ROW, out over COL
                        lambda s: vector_spec(s, last - 1, self.grid), bias, segments)
        self.has_bias = bias
        self.local_out = out_shape[:-1] + (out_shape[-1] // mode.q,)
        total = math.prod(out_shape)
        # what the workspace plan (Summa2D.begin_batch) reads: the product's (K, N), the bias's length
        self.product, self.vector = (in_features, total), total // mode.q if bias else 0

    def forward(self, x):
        weight, bias = linear_params(self)
        # the bias broadcast comes first so that checkpoint recomputation, which stops after the
        # last tensor saved for backward, repeats every collective of the block
        b = hosted(bias, self.local_out, self.grid, compute_dtype(x), x.device) if self.has_bias else None
        w = weight if isinstance(weight, tuple) else weight.reshape(weight.shape[0], -1)  # (in/q, [stack·]out/q)
        y = summa_ab(x.reshape(-1, x.shape[-1]), w, self.grid)  # (B/q·T, [stack·]out/q)
        if b is not None:
            y = y + b.reshape(-1)
        return split_segments(self, y.view(*x.shape[:-1], *self.local_out))


class LMHead(TiedHead):
    """logits = x Eᵀ (SUMMA C = A Bᵀ) against the tied table (or its own), with 2D cross-entropy."""

    def __init__(self, cfg, mode: "Summa2D", embedding: Embedding, bias: bool = False):
        # the bias: vocabulary block j of the logits, on every row (each scores other sequences)
        super().__init__(cfg, mode.ctx, embedding, mode.table_spec(),
                         vocab_bias_spec(cfg, (COL,), mode.q, grad_sum=(ROW,)) if bias else None)
        self.grid, self.cfg, self.vocab_pad = mode.grid, cfg, mode.vocab_pad

    def _local_logits(self, x):  # (B/q, T, h/q) -> (B/q·T, V_pad/q): batch i, vocab j
        return self.add_bias(summa_abt(x.reshape(-1, x.shape[-1]), self.table(), self.grid))

    def loss(self, x, targets):
        g = self.grid
        B, T = targets.shape
        rows = targets[g.i * (B // g.q):(g.i + 1) * (B // g.q)].reshape(-1)
        vb = self.vocab_pad // g.q
        # the vocabulary is split along the mesh row (§3.2.2)
        per_token = vocab_parallel_cross_entropy(self._local_logits(x), rows, g.row, g.j * vb, self.cfg.vocab_size,
                                                owned=True)
        # every rank of a row holds the same per-token losses: sum the rows' shares down the column
        return comm.all_reduce(per_token.sum() / labelled_count(targets), g.col)

    def logits(self, x):
        """Full (B, T, V) logits on every rank (gathered: for inference and debugging only)."""
        g = self.grid
        local = comm.all_gather(self._local_logits(x), g.row, 1)[:, : self.cfg.vocab_size]  # (B/q·T, V)
        return comm.all_gather(local.reshape(x.shape[0], x.shape[1], -1), g.col, 0)  # (B, T, V)


# ----------------------------------------------------------------------------- placement


def _nearest_squares(tp: int) -> str:
    r = math.isqrt(tp)
    options = [s * s for s in (r, r + 1) if s >= 2]
    return " or ".join(f"tp={s} (q={math.isqrt(s)})" for s in options)


def tiled_grid(dp: int, q: int, tile_rows: int, tile_cols: int) -> tuple[int, ...]:
    """Global rank at each (dp, row, col) when each node holds a tile_rows x tile_cols block of a
    replica's mesh (Fig. 8b), nodes numbered row-major over tiles."""
    per_node = tile_rows * tile_cols
    grid = []
    for d in range(dp):
        for i in range(q):
            for j in range(q):
                tile = (i // tile_rows) * (q // tile_cols) + j // tile_cols
                within = (i % tile_rows) * tile_cols + j % tile_cols
                grid.append(d * q * q + tile * per_node + within)
    return tuple(grid)


def nodes_spanned(topo: Topology, axis: MeshAxis) -> float:
    """Mean number of nodes one group along `axis` touches."""
    groups = topo.all_groups(axis)
    return sum(len({topo.node_of(r) for r in grp}) for grp in groups) / len(groups)


# ----------------------------------------------------------------------------- the mode


@register
class Summa2D(Mode):
    """Mesh axes ROW x COL (q each, tp = q²) inside each data-parallel replica. Needs d_model,
    n_heads and the replica batch divisible by q; the vocabulary is padded to a multiple of q."""

    name = "2d"
    residual_replicated = False
    # the defaults are the settings measured fastest (benchmarks/results/peer_blocks.txt)
    options = {"vectors": Option("replicated", "where the vectors (biases, norm weights, position rows) live: on "
                                               "row 0, broadcast down the column in forward and reduced back in "
                                               "backward (hosted, Fig. 5), or on every row, their gradients summed "
                                               "down the column after backward (replicated)",
                                 choices=("hosted", "replicated")),
               "summa": Option("all_gather", "each product's collectives: q broadcasts of blocks and q reduces "
                                             "(broadcast, Alg. 1-3), or one all-gather of the q blocks and one "
                                             "reduce-scatter (all_gather: fewer, larger messages; q blocks held "
                                             "during the product)", choices=("broadcast", "all_gather")),
               "keep_gathered": Option(True, "with summa=all_gather: keep each linear's gathered input row and "
                                             "weight column for backward (q times their blocks' memory until "
                                             "backward), whose products then need one reduce-scatter each and "
                                             "no all-gather; off by default with summa=broadcast")}
    paper_options = {"vectors": "hosted", "summa": "broadcast", "keep_gathered": False}
    test_layouts = ({"tp": 4}, {"tp": 4, "dp": 2, **paper_options},
                    {"tp": 4, "keep_gathered": False},
                    {"tp": 4, "ranks_per_node": 2, "placement": "topology"})

    @classmethod
    def resolve_options(cls, given):
        if given.get("summa") == "broadcast" and "keep_gathered" not in given:
            given = {**given, "keep_gathered": False}  # nothing gathered to keep
        options = super().resolve_options(given)
        if options["keep_gathered"] and options["summa"] != "all_gather":
            raise LatticeConfigError("mode '2d' keep_gathered=True keeps what the all-gather form of SUMMA gathered: "
                                     "give it with summa='all_gather' (--summa all_gather)")
        return options

    @classmethod
    def mesh_axes(cls, tp, options):
        q = math.isqrt(tp)
        if q * q != tp or q < 2:
            raise LatticeConfigError(
                f"mode '2d' needs tp = q*q ranks per replica with q >= 2; tp={tp} is not such a square: "
                f"use {_nearest_squares(tp)}")
        return ((ROW, q), (COL, q))

    @classmethod
    def rank_grid(cls, axes, ranks_per_node, placement, options):
        """Bunched placement (Fig. 8): of the natural order and every tiling of the mesh into
        node-sized tile_rows x tile_cols blocks, the one whose row and column groups together
        touch the fewest nodes; ties go to fewer nodes per column (SUMMA's weight broadcasts)."""
        sizes = dict(axes)
        dp, q = sizes.get(MeshAxis.DP, 1), sizes[ROW]
        natural = tuple(range(dp * q * q))
        candidates = [natural] + [tiled_grid(dp, q, r, ranks_per_node // r) for r in range(1, q + 1)
                                  if ranks_per_node % r == 0 and q % r == 0 and q % (ranks_per_node // r) == 0]

        def cost(grid):
            topo = Topology("2d", tuple(axes), grid, ranks_per_node)
            col, row = nodes_spanned(topo, ROW), nodes_spanned(topo, COL)
            return (col + row, col)

        return min(candidates, key=cost)

    def __init__(self, cfg, ctx):
        super().__init__(cfg, ctx)
        self.q = ctx.size(ROW)
        self.vocab_pad = round_up(cfg.vocab_size, self.q)
        self.grid = SummaGrid(ctx, replicated_vectors=ctx.options["vectors"] == "replicated",
                              gathered=ctx.options["summa"] == "all_gather", keep=ctx.options["keep_gathered"])

    @classmethod
    def check_config(cls, cfg, ctx):
        divisible("d_model", cfg.d_model, ctx.size(ROW), "the 2D mesh side q")

    @classmethod
    def check_heads(cls, ctx, name, count):
        divisible(name, count, ctx.size(ROW), "the 2D mesh side q")

    @classmethod
    def check_batch(cls, ctx, tokens):
        q, b = ctx.size(ROW), tokens.shape[0]
        divisible("batch size", b, q, "the 2D mesh side q",
                  f"give each replica a multiple of {q} sequences (for example {nearby_multiples(b, q)})")

    def begin_batch(self, model, batch, seq):
        self.grid.workspace.reserve(*self.workspace_plan(model, batch, seq))

    def table_spec(self) -> ShardSpec:
        """(V, h) in q x q blocks, V padded with zero rows to a multiple of q."""
        return vocab_table_spec(self.cfg, ((0, (ROW,)), (1, (COL,))), self.q)

    def workspace_plan(self, model, batch: int, seq: int) -> tuple[int, int]:
        """(receive-buffer, step) sizes in elements: the largest of any SUMMA step (two blocks,
        §3.2.3) and of any row-0 parameter broadcast, for a (batch, seq) replica batch through
        `model`'s linears, the LM head and the norms."""
        cfg, q = self.cfg, self.q
        h, m = cfg.d_model, batch // q * seq
        linears = [module for module in model.modules() if isinstance(module, Linear)]
        products = [(self.vocab_pad, h)] + [linear.product for linear in linears]  # the LM head: (K, N) = (V, h)
        # a product of A [M, K] and B [K, N]: blocks of (M/q)·(K/q) and (K/q)·(N/q) in every form
        step = max(m * k // q + k * n // (q * q) for k, n in products)
        step = max(step, self.vocab_pad * h // (q * q))  # embedding: one table block
        recv = max([seq * h // q, h // q] + [linear.vector for linear in linears])  # positions, norms, biases
        return recv, step

    # heads by column j, sequences by row i
    head_axes, attention_batch_axes = (COL,), (ROW,)

    def embedding(self, *, positions=True, types=0):
        return Embedding(self.cfg, self, positions, types)

    def norm(self, kind="layer", *, eps, bias):
        return Norm(self.cfg, self, kind, eps, bias)

    def linear(self, in_features, out_features, *, block: Block, position: Position, stack=None, segments=None,
               bias: bool):
        if segments and position != Position.IN:
            raise ValueError("only a Position.IN linear can be segmented")
        return Linear(self.cfg, self, in_features, out_features, stack, segments, bias)

    def lm_head(self, embedding, *, bias=False):
        return LMHead(self.cfg, self, embedding, bias)

    def residual_shape(self, batch, seq):
        return (batch // self.q, seq, self.cfg.d_model // self.q)

    def attention_rows(self, batch):
        rows = batch // self.q  # row block i, heads of column j
        return slice(self.grid.i * rows, (self.grid.i + 1) * rows)

    expert_split_axis = COL  # the row's ranks, which trade columns for tokens

    def token_spec(self):
        return {"grad_sum": (ROW, COL)}

    def cost_expert_tokens(self, b):
        return cost_columns_to_tokens(b, (COL,), self.q)

    def expert_tokens(self, x, mask):  # row i's tokens, columns j: 1/q of them, whole, by one all-to-all
        return columns_to_tokens(*super().expert_tokens(x, mask), self.grid.row)

    def pool(self, x, index, batch):
        """(B/q, T, h/q) -> rows i, columns j of the (batch, h) position `index`."""
        g, (rows, h_local) = self.grid, (x.shape[0], x.shape[-1])
        return pool_pieces(x[:, index], slice(g.i * rows, (g.i + 1) * rows), slice(g.j * h_local, (g.j + 1) * h_local),
                           batch, h_local * g.q, self.ctx.tensor_group())

    @classmethod
    def optimus_table1_row(cls, b, s, h, p):
        """Optimus Table 1, 2D: tree broadcasts (log2 p / 2q per element) of the SUMMA blocks."""
        q, lg = math.sqrt(p), math.log2(p)
        return {"forward": lg / (2 * q) * (7 * b * s * h + 12 * h * h),
                "backward": lg / (2 * q) * (21 * b * s * h + 36 * h * h),
                "forward_mults": (12 * b * s * h * h + 2 * b * s * s * h) / p,
                "backward_mults": (36 * b * s * h * h + 6 * b * s * s * h) / p}

    def padded_vocab(self):
        return self.vocab_pad

    # Activations [B/q, T, h/q], weights in q x q blocks; SUMMA for every linear; bias, norm and
    # wpe vectors on row 0, broadcast down the column forward and reduced back in backward
    # (Fig. 5); norm and cross-entropy sums all-reduced along the row (§3.2.2).
    def cost_product_rows(self, b, block):
        return b.M / self.q  # each SUMMA step multiplies a (B/q · T)-row block

    def cost_embedding(self, b, positions, types):
        """SUMMA with the one-hot token matrix local to the row: q table-block (V'/q, h/q)
        broadcasts down the column, and the gradient's q reduces (Alg. 3); wpe hosted on row 0.
        Saves the token ids (a view of the whole batch)."""
        q, h = self.q, b.h
        b.add("forward", "broadcast", (ROW,), b.vocab_padded * h / q, q)
        b.add("backward", "reduce", (ROW,), b.vocab_padded * h / q, q)
        if positions and not self.grid.replicated:  # (replicated: summed with the gradients, from the specs)
            b.add("forward", "broadcast", (ROW,), (b.position_rows + types) * h / q)
            b.add("backward", "reduce", (ROW,), (b.position_rows + types) * h / q)
        b.save_ints(8 * b.M)

    def cost_norm(self, b, kind, bias):
        """Weight (and bias) broadcast from row 0; (Σx, Σx²) (RMSNorm: Σx²) of the row block's
        m = M/q tokens all-reduced along the row, and in backward (Σg, Σg·x̂) (Σg·x̂). Saves x̂,
        rstd per token of the row block (q-fold replicated) and the broadcast weight."""
        q, m = self.q, b.M / self.q
        vec = 2 if bias else 1
        sums = 2 if kind == "layer" else 1
        if not self.grid.replicated:
            b.add("forward", "broadcast", (ROW,), vec * b.h / q, vec, "norm")
            b.add("backward", "reduce", (ROW,), vec * b.h / q, vec, "norm")
        b.add("forward", "all_reduce", (COL,), sums * m, 1, "norm")
        b.add("backward", "all_reduce", (COL,), sums * m, 1, "norm")
        return b.M * b.h / q ** 2 + m + (0 if self.grid.replicated else b.h / q)  # (a parameter's own)

    def cost_linear(self, b, in_features, out_features, *, block, position, bias, input_saved):
        if bias and not self.grid.replicated:
            b.add("forward", "broadcast", (ROW,), out_features / self.q, 1, "bias")
            b.add("backward", "reduce", (ROW,), out_features / self.q, 1, "bias")
        summa_product_terms(b, "linear", b.M, in_features, out_features, self.q, self.grid.gathered, self.grid.keep)
        if self.grid.keep:  # the gathered input row and weight column, not the input
            return (b.M * in_features + in_features * out_features) / self.q, b.M * out_features / self.q ** 2
        return (0 if input_saved else b.M * in_features / self.q ** 2), b.M * out_features / self.q ** 2

    def cost_product_output(self, b, out_features, *, block, position, out):
        return out if self.grid.gathered else None  # broadcast SUMMA: C_ij summed in place

    def cost_keeps_input(self, block, position):
        return not self.grid.keep

    def cost_lm_head(self, b):
        """logits (M, V') = X Eᵀ: forward Alg. 2 (q broadcasts of table blocks, q reduces of
        logit blocks), backward Alg. 1 (dX) and Alg. 3 (dE); the cross-entropy's (max, then
        Σe^x with the target logit) of m tokens all-reduced along the row, the mean loss down
        the column. Saves the head input, the softmax block, and the targets of the row block."""
        q, M, Vp = self.q, b.M, b.vocab_padded
        e, z = Vp * b.h / q ** 2, M * Vp / q ** 2
        for phase, op, axis, elements in (("forward", "broadcast", ROW, e), ("forward", "reduce", COL, z),
                                          ("backward", "broadcast", COL, z), ("backward", "broadcast", ROW, e),
                                          ("backward", "broadcast", COL, z), ("backward", "reduce", ROW, e)):
            summa_term(b, self.grid.gathered, phase, op, (axis,), q * elements, q)
        loss_size = max(4, b.c.itemsize)
        b.add("forward", "all_reduce", (COL,), 3 * M / q, 2, "loss", itemsize=loss_size)
        b.add("forward", "all_reduce", (ROW,), 1, 1, "loss", itemsize=loss_size)
        b.save_ints(M / q * (8 + 1))  # target ids, hit mask
        return (M * b.h + M * Vp) / q ** 2

    def cost_pool(self, b):
        """Every block of the position placed and all-reduced over the q² ranks."""
        b.add("forward", "all_reduce", (ROW, COL), b.B * b.h)
        return b.B * b.h


def summa_product_terms(b, site, M, K, N, q, gathered=False, keep=False):
    """C = A B with A [M, K], B [K, N] on a q x q mesh (Alg. 1): q broadcasts of A blocks along
    the row (axis COL) and of B blocks along the column (axis ROW). Backward (Eq. 1): dA by Alg. 2
    (q broadcasts of B blocks, q reduces of A-sized blocks along the row) and dB by Alg. 3 (q
    broadcasts of A blocks along the row, q reduces of B-sized blocks along the column); with
    `keep` (all-gather form) backward's gathers are forward's, kept: its two reduce-scatters alone."""
    a, w = M * K / q ** 2, K * N / q ** 2
    for phase, op, axis, elements in (("forward", "broadcast", COL, a), ("forward", "broadcast", ROW, w),
                                      ("backward", "broadcast", ROW, w), ("backward", "reduce", COL, a),
                                      ("backward", "broadcast", COL, a), ("backward", "reduce", ROW, w)):
        if not (keep and phase == "backward" and op == "broadcast"):
            summa_term(b, gathered, phase, op, (axis,), q * elements, q, site)


def summa_term(b, gathered, phase, op, axes, elements, q, site=""):
    """q broadcasts (reduces) of blocks, or in the all-gather form one all-gather (reduce-scatter)
    of the same elements."""
    if gathered:
        op, q = {"broadcast": "all_gather", "reduce": "reduce_scatter"}[op], 1
    b.add(phase, op, axes, elements, q, site)
