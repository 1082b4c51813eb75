"""1D tensor parallelism (Megatron-LM, docs/references.md#megatron-lm), with optional sequence parallelism.

p = tp ranks per model replica, one mesh axis TP. Rank r holds:

| tensor                           | full shape     | held on rank r                        |
|----------------------------------|----------------|---------------------------------------|
| qkv weight / bias (column split) | (h, 3, h) / (3, h) | (h, 3, h/p) / (3, h/p): heads r·n/p.. of q, k, v |
| fc weight / bias (column split)  | (h, 4h) / (4h) | (h, 4h/p) / (4h/p)                    |
| proj weights (row split)         | (k, h)         | (k/p, h); their bias (h) replicated   |
| wte / untied LM head (vocab split)| (V, h)        | rows r·V'/p .. of the table padded to V' = p·⌈V/p⌉ |
| wpe, LayerNorm                   | whole          | replicated                            |
| residual stream                  | (B, T, h)      | whole, or (B, T/p, h) with sequence parallel |

Without sequence parallelism a block is f → column linear → local work → row linear → g:
one all-reduce forward (g) and one backward (f's conjugate) per attention and per MLP block.
With it (Korthikanti et al., "Reducing activation recomputation"), LayerNorm, dropout and the
residual stay split along the sequence; g becomes a reduce-scatter over T and f an all-gather
over T (a ring all-reduce is a reduce-scatter plus an all-gather, so the wire traffic stays the
same while LayerNorm/dropout activations shrink to 1/p; CommMeter, counting each collective's
logical buffer, reports twice the elements). Replicated vectors used on the sequence
chunk then see partial gradients: LayerNorm weights and biases and the row-linear biases declare
`grad_sum=(TP,)` in their shard specs, so `GPT.sync_grads` sums them in one bucketed all-reduce
after backward; wpe, of which only the rows in use get a gradient, passes its slice through
`copy_to_group`, whose backward sums it. Every rank keeps identical values.

The LM head never gathers logits for the loss: each rank scores its vocabulary slice and the
cross-entropy exchanges only per-token max, sum-of-exp and target logit (3·B·T values).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from lattice.modes import register
from lattice.modes.base import Block, Mode, Option, Position, divisible
from lattice.modes.kernels.layers import (TiedHead, add_position_rows, compute_dtype, linear_params, local_linear, pool_pieces,
                                          position_rows, position_span, register_linear, register_position_tables,
                                          split_segments, vocab_bias_spec, vocab_table_spec)
from lattice.modes.kernels.loss import labelled_count, vocab_parallel_cross_entropy
from lattice.modes.kernels.tokens import split_replicated
from lattice.modes.serial import Linear, Norm
from lattice.parallel import comm
from lattice.parallel.context import MeshAxis
from lattice.parallel.sharding import ShardSpec, register_sharded


def tp_group(ctx):
    """Looked up at call time, so that a planned (group-less) context can still build the model."""
    return ctx.group(MeshAxis.TP)


def vocab_spec(cfg, ctx) -> ShardSpec:
    """(V, h) split by rows over TP; V padded up to a multiple of p with zero rows."""
    return vocab_table_spec(cfg, ((0, (MeshAxis.TP,)),), ctx.size(MeshAxis.TP))


def vocab_range(cfg, ctx) -> tuple[int, int]:
    """(first vocabulary row held here, rows held here) of the padded table."""
    local = vocab_spec(cfg, ctx).local_shape(ctx.topology)[0]
    return ctx.coord(MeshAxis.TP) * local, local


class VocabParallelEmbedding(nn.Module):
    """Token rows split over TP, summed by all-reduce (reduce-scatter over T with sequence
    parallelism); position table replicated.

    tokens (B, T) whole on every rank -> (B, T, h), or (B, T/p, h) with sequence parallel.
    """

    def __init__(self, cfg, ctx, sequence_parallel: bool, positions: bool, types: int = 0):
        super().__init__()
        self.ctx, self.sp = ctx, sequence_parallel
        self.vocab_start, self.vocab_local = vocab_range(cfg, ctx)
        register_sharded(self, "wte", vocab_spec(cfg, ctx), ctx)
        register_position_tables(self, cfg, ctx, positions, types, ShardSpec)

    def forward(self, tokens, start: int = 0, token_types=None, positions=None):
        group = tp_group(self.ctx)
        first, count, index = position_span(start, tokens.shape[1], positions)
        local = tokens - self.vocab_start
        elsewhere = (local < 0) | (local >= self.vocab_local)  # another rank owns these rows
        part = F.embedding(local.masked_fill(elsewhere, 0), self.wte)  # (B, T, h), zero-filled below
        part = part.masked_fill(elsewhere.unsqueeze(-1), 0.0)
        if not self.sp:
            x = comm.all_reduce(part, group)
            if not self.positions:
                return x
            return add_position_rows(x, position_rows(self, first, count), count, token_types,
                                     slice(None) if index is None else index)
        x_seq = comm.reduce_scatter(part, group, 1)  # (B, T/p, h)
        if not self.positions:
            return x_seq
        t_local = x_seq.shape[1]
        rows = comm.copy_to_group(position_rows(self, first, count), group)  # each rank's rows are a partial gradient
        chunk = slice(comm.group_rank(group) * t_local, (comm.group_rank(group) + 1) * t_local)
        return add_position_rows(x_seq, rows, count, None if token_types is None else token_types[:, chunk],
                                 chunk if index is None else index[:, chunk])


class _ColumnProduct(torch.autograd.Function):
    """Megatron's f and the column-parallel product in one: Y = X W_r (X replicated, W_r this
    rank's columns, the segments side by side). Forward: the product alone. Backward:
    dX = Σ_ranks dY W_rᵀ (all-reduce), started before dW_r = Xᵀ dY is computed and awaited after
    it, so the sum travels while the weight gradient's product runs."""

    @staticmethod
    def forward(ctx, x, group, *ws):  # x (..., in), ws (in, out_i) -> (..., Σ out_i)
        ctx.group, ctx.widths = group, [w.shape[-1] for w in ws]
        ctx.save_for_backward(x, *ws)
        return x @ (torch.cat(ws, dim=-1) if len(ws) > 1 else ws[0])

    @staticmethod
    def backward(ctx, dy):
        x, *ws = ctx.saved_tensors
        w = torch.cat(ws, dim=-1) if len(ws) > 1 else ws[0]
        dx, work = comm.start_all_reduce(dy @ w.t(), ctx.group)
        dw = x.reshape(-1, x.shape[-1]).t() @ dy.reshape(-1, dy.shape[-1])
        if work is not None:
            work.wait()
        return dx, None, *dw.split(ctx.widths, dim=-1)


class _TableProduct(torch.autograd.Function):
    """The tied head's product against this rank's vocabulary rows E_r (V/p, h): Z = X E_rᵀ, X
    replicated. Backward: dX = Σ_ranks dZ E_r (all-reduce), started before dE_r = dZᵀ X is
    computed and awaited after it, as `_ColumnProduct`; dE_r comes out in the table's own (V/p, h)
    layout, so the embedding's gradient adds to it without a strided pass."""

    @staticmethod
    def forward(ctx, x, group, table):  # x (..., h), table (V/p, h) -> (..., V/p)
        ctx.group = group
        ctx.save_for_backward(x, table)
        return x @ table.t()

    @staticmethod
    def backward(ctx, dz):
        x, table = ctx.saved_tensors
        dx, work = comm.start_all_reduce(dz @ table, ctx.group)
        dtable = dz.reshape(-1, dz.shape[-1]).t() @ x.reshape(-1, x.shape[-1])
        if work is not None:
            work.wait()
        return dx, None, dtable


class ColumnParallelLinear(nn.Module):
    """y = x W + b with W (in, [stack,] out) split over TP along its last dim (out).

    x: (B, T, in) replicated (through f), or (B, T/p, in) all-gathered over T with sequence
    parallel -> (B, T, [stack,] out/p).
    """

    def __init__(self, cfg, ctx, in_features, out_features, stack, segments, bias, sequence_parallel,
                 async_grad_allreduce):
        super().__init__()
        self.ctx, self.sp, self.async_allreduce = ctx, sequence_parallel, async_grad_allreduce
        out_shape = (stack, out_features) if stack else (out_features,)
        last = len(out_shape)
        register_linear(self, ctx, out_shape,
                        lambda s: ShardSpec((in_features,) + s, splits=((last, (MeshAxis.TP,)),)),
                        lambda s: ShardSpec(s, splits=((last - 1, (MeshAxis.TP,)),)), bias, segments)

    def forward(self, x):
        group = tp_group(self.ctx)
        weight, bias = linear_params(self)
        if self.async_allreduce and not self.sp and group is not None:
            dtype = compute_dtype(x)  # under autocast, the casts outside the Function (as torch.mm would)
            ws = weight if isinstance(weight, tuple) else (weight.reshape(weight.shape[0], -1),)
            y = _ColumnProduct.apply(x.to(dtype), group, *(w.to(dtype) for w in ws))  # (B, T, [stack·]out/p)
            if bias is not None:
                y = y + bias.reshape(-1)
            if not isinstance(weight, tuple) and weight.dim() > 2:
                y = y.unflatten(-1, weight.shape[1:])
            return split_segments(self, y)
        x = comm.all_gather(x, group, 1) if self.sp else comm.copy_to_group(x, group)  # (B, T, in)
        return split_segments(self, local_linear(x, weight, bias))


class RowParallelLinear(nn.Module):
    """y = x W + b with W (in, out) split over TP along dim 0 (in); b replicated, added once
    after the sum.

    x: (B, T, in/p) -> (B, T, out) all-reduced (g), or (B, T/p, out) reduce-scattered over T.
    """

    def __init__(self, cfg, ctx, in_features, out_features, bias, sequence_parallel):
        super().__init__()
        self.ctx, self.sp = ctx, sequence_parallel
        # the bias is added to a sequence chunk under sequence parallelism: partial gradients
        register_linear(self, ctx, (out_features,), lambda s: ShardSpec((in_features,) + s, splits=((0, (MeshAxis.TP,)),)),
                        lambda s: ShardSpec(s, grad_sum=(MeshAxis.TP,) if sequence_parallel else ()), bias)

    def forward(self, x):
        group = tp_group(self.ctx)
        partial = x @ self.weight  # (B, T, out): this rank's share of the sum over `in`
        if not self.sp:
            y = comm.all_reduce(partial, group)
            return y if self.bias is None else y + self.bias
        y = comm.reduce_scatter(partial, group, 1)  # (B, T/p, out)
        return y if self.bias is None else y + self.bias


class VocabParallelLMHead(TiedHead):
    """Logits against the (tied) vocab-split table, fused with the vocab-parallel cross-entropy.

    x (B, T, h) replicated, or (B, T/p, h) with sequence parallel (all-gathered over T first).
    """

    def __init__(self, cfg, ctx, embedding, sequence_parallel, async_grad_allreduce, bias: bool = False):
        # every rank scores every token against its vocabulary rows: the bias gradient is whole
        super().__init__(cfg, ctx, embedding, vocab_spec(cfg, ctx),
                         vocab_bias_spec(cfg, (MeshAxis.TP,), ctx.size(MeshAxis.TP)) if bias else None)
        self.ctx, self.sp, self.vocab_size = ctx, sequence_parallel, cfg.vocab_size
        self.async_allreduce = async_grad_allreduce
        self.vocab_start, _ = vocab_range(cfg, ctx)

    def _local_logits(self, x):  # -> (B, T, V_local) of this rank's vocabulary rows
        group = tp_group(self.ctx)
        if self.async_allreduce and not self.sp and group is not None:
            # a column-parallel product: dX's all-reduce beside dTable's product, the step's largest
            dtype = compute_dtype(x)
            return self.add_bias(_TableProduct.apply(x.to(dtype), group, self.table().to(dtype)))
        x = comm.all_gather(x, group, 1) if self.sp else comm.copy_to_group(x, group)
        return self.add_bias(x @ self.table().t())

    def loss(self, x, targets):
        logits = self._local_logits(x)
        per_token = vocab_parallel_cross_entropy(logits.flatten(0, 1), targets.flatten(), tp_group(self.ctx),
                                                 self.vocab_start, self.vocab_size, owned=True)
        return per_token.sum() / labelled_count(targets)

    def logits(self, x):
        """Full (B, T, V) logits, gathered over the vocabulary: for inference and debugging only."""
        full = comm.all_gather(self._local_logits(x), tp_group(self.ctx), 2)
        return full[..., : self.vocab_size]


@register
class Megatron1D(Mode):
    """Megatron 1D tensor parallelism over mesh axis TP, optionally with sequence parallelism."""

    name = "1d"
    options = {"sequence_parallel": Option(False, "split LayerNorm, dropout and the residual along the "
                                                  "sequence (Korthikanti et al.)"),
               "async_grad_allreduce": Option(True, "all-reduce a column-parallel linear's input gradient while "
                                                    "its weight gradient is computed (without sequence parallelism)")}
    peer = "dtensor"  # torch.distributed.tensor.parallel's column/row-wise plan is this layout
    test_layouts = ({"tp": 2}, {"tp": 4, "async_grad_allreduce": False}, {"tp": 2, "sequence_parallel": True},
                    {"tp": 4, "sequence_parallel": True}, {"tp": 2, "dp": 2, "sequence_parallel": True})

    def __init__(self, cfg, ctx):
        self.p = ctx.size(MeshAxis.TP)
        self.sp = bool(ctx.options.get("sequence_parallel", False))
        self.async_grad_allreduce = ctx.options["async_grad_allreduce"]
        # the residual differs per rank under sequence parallelism: dropout then needs the sharded stream
        self.residual_replicated = not self.sp
        super().__init__(cfg, ctx)

    @classmethod
    def mesh_axes(cls, tp, options):
        return ((MeshAxis.TP, tp),)

    @classmethod
    def check_config(cls, cfg, ctx):
        divisible("d_model", cfg.d_model, ctx.size(MeshAxis.TP), "tp")

    @classmethod
    def check_heads(cls, ctx, name, count):
        p = ctx.size(MeshAxis.TP)
        divisible(name, count, p, "tp", f"use a tp that divides {count} or a head count that is a multiple of {p}")

    @classmethod
    def check_batch(cls, ctx, tokens):
        if ctx.options.get("sequence_parallel", False):
            p = ctx.size(MeshAxis.TP)
            divisible("sequence length", tokens.shape[1], p, "tp",
                      f"with sequence_parallel=True use sequences whose length is a multiple of {p}, "
                      f"or turn sequence_parallel off")

    head_axes = (MeshAxis.TP,)

    def embedding(self, *, positions=True, types=0):
        return VocabParallelEmbedding(self.cfg, self.ctx, self.sp, positions, types)

    def norm(self, kind="layer", *, eps, bias):
        return Norm(self.cfg, self.ctx, kind, eps, bias, grad_sum=(MeshAxis.TP,) if self.sp else ())

    def linear(self, in_features, out_features, *, block: Block, position: Position, stack=None, segments=None,
               bias: bool):
        if position == Position.IN:
            return ColumnParallelLinear(self.cfg, self.ctx, in_features, out_features, stack, segments, bias, self.sp,
                                        self.async_grad_allreduce)
        if stack or segments:
            raise ValueError("a row-parallel (Position.OUT) linear cannot be stacked or segmented")
        return RowParallelLinear(self.cfg, self.ctx, in_features, out_features, bias, self.sp)

    def dense(self, in_features, out_features, *, bias=True):
        """Replicated on every rank, as Megatron's BERT head is: every rank holds whole hidden
        vectors; with sequence parallelism other tokens, so the gradients are partial sums."""
        return Linear(self.cfg, self.ctx, in_features, out_features, None, None, bias,
                      grad_sum=(MeshAxis.TP,) if self.sp else ())

    def lm_head(self, embedding, *, bias=False):
        return VocabParallelLMHead(self.cfg, self.ctx, embedding, self.sp, self.async_grad_allreduce, bias)

    def residual_shape(self, batch, seq):
        return (batch, seq // self.p if self.sp else seq, self.cfg.d_model)

    def attention_rows(self, batch):
        return slice(0, batch)  # every sequence, this rank's heads

    expert_split_axis = MeshAxis.TP

    def token_spec(self):
        return {"grad_sum": (MeshAxis.TP,)}

    def cost_expert_tokens(self, b):
        """Without sequence parallelism each rank keeps 1/p of the replicated tokens (backward:
        their gradient all-gathered) and the outputs are all-gathered."""
        if self.sp:
            return super().cost_expert_tokens(b)
        n = -(-b.M // self.p)
        b.add("forward", "all_gather", (MeshAxis.TP,), self.p * n * b.h, 1, "moe", after_saves=True)
        b.add("backward", "all_gather", (MeshAxis.TP,), self.p * n * b.h, 1, "moe")
        return n

    def expert_tokens(self, x, mask):
        """With sequence parallelism this rank's T/p positions are its own; without, every rank
        holds every token and keeps 1/p of them."""
        if self.sp:
            chunk = x.shape[1]
            mine = None if mask is None else mask[:, self.ctx.coord(MeshAxis.TP) * chunk:][:, :chunk]
            return super().expert_tokens(x, mine)
        tokens, flat, back = super().expert_tokens(x, mask)
        mine, mine_mask, gather = split_replicated(tokens, flat, tp_group(self.ctx))
        return mine, mine_mask, lambda y: back(gather(y))

    def pool(self, x, index, batch):
        if not self.sp:
            return x[:, index]  # replicated on every rank already
        chunk = x.shape[1]  # this rank's T/p positions: index lives on rank index // chunk
        here = index // chunk == self.ctx.coord(MeshAxis.TP)
        piece = x[:, index % chunk] if here else x[:0, 0]
        rows = slice(0, batch) if here else slice(0, 0)
        return pool_pieces(piece, rows, slice(0, x.shape[-1]), batch, x.shape[-1], tp_group(self.ctx))

    @classmethod
    def optimus_table1_row(cls, b, s, h, p):
        """Optimus Table 1, 1D: ring all-reduces of b·s·h, 2 forward and 4 backward per layer."""
        return {"forward": 4 * (p - 1) / p * b * s * h, "backward": 8 * (p - 1) / p * b * s * h,
                "forward_mults": (12 * b * s * h * h + 2 * b * s * s * h) / p,
                "backward_mults": (36 * b * s * h * h + 6 * b * s * s * h) / p}

    def padded_vocab(self):
        return vocab_spec(self.cfg, self.ctx).storage_shape[0]

    def cost_shares(self, b):
        return {"replicated": 1 / self.p if self.sp else 1, "dense": 1 / self.p if self.sp else 1}

    # f/g around every column/row pair: forward g = all-reduce of the row linear's [B, T, h]
    # output, backward f = all-reduce of the column linear's input gradient. Sequence
    # parallelism swaps each all-reduce for a reduce-scatter plus an all-gather over T of the same
    # buffer; LayerNorm and row-bias sums come from their specs (grad_sum).
    def cost_dense(self, b, in_features, out_features, bias):
        """Replicated: no collectives (the sequence-parallel gradient sums follow from the specs)."""
        return b.residual, b.residual

    def cost_embedding(self, b, positions, types):
        """Vocab-parallel rows summed (all-reduce; reduce-scatter over T with sequence parallelism,
        whose wpe rows in use are all-reduced in backward). Saves the token ids and the mask."""
        act, TP = b.M * b.h, MeshAxis.TP
        if not self.sp:
            b.add("forward", "all_reduce", (TP,), act)
        else:
            b.add("forward", "reduce_scatter", (TP,), act)
            b.add("backward", "all_gather", (TP,), act)
            if positions:
                b.add("backward", "all_reduce", (TP,), (b.position_rows + types) * b.h)  # wpe (and wtype) over the chunks
        b.save_ints(b.M * (8 + 1))

    def cost_norm(self, b, kind, bias):
        """On the whole residual (a 1/p sequence chunk with sequence parallelism): its input (or
        x̂), and mean and rstd (or rstd) per token."""
        r = self.p if self.sp else 1
        return b.M * b.h / r + (2 if kind == "layer" else 1) * b.M / r

    def cost_linear(self, b, in_features, out_features, *, block, position, bias, input_saved):
        TP = MeshAxis.TP
        if position == "in":  # saves its whole input (a gathered copy with sequence parallelism)
            x = b.M * in_features
            if not self.sp:  # with async_grad_allreduce beside the weight gradient's product
                hidden = ".hidden" if self.async_grad_allreduce else ""
                b.add("backward", "all_reduce", (TP,), x, site="linear" + hidden)
            else:
                b.add("forward", "all_gather", (TP,), x, site="linear")
                b.add("backward", "reduce_scatter", (TP,), x, site="linear")
            return (0 if input_saved and not self.sp else x), b.M * out_features / self.p
        y = b.M * out_features  # the sum over ranks follows the product, which saved the input
        if not self.sp:
            b.add("forward", "all_reduce", (TP,), y, site="linear", after_saves=True)
        else:
            b.add("forward", "reduce_scatter", (TP,), y, site="linear", after_saves=True)
            b.add("backward", "all_gather", (TP,), y, site="linear")
        saved = 0 if input_saved else b.M * in_features / self.p
        return saved, y / (self.p if self.sp else 1)

    def cost_product_output(self, b, out_features, *, block, position, out):
        return b.M * out_features if position == "out" else out  # an OUT linear's partial sums, whole

    def cost_keeps_input(self, block, position):
        return position == "out" or not self.sp  # a sequence-parallel IN linear saves the gathered input

    def cost_lm_head(self, b):
        """The head's f (all-gather over T with sequence parallelism) and the vocab-parallel
        cross-entropy: three per-token values all-reduced (max, then Σe^x and the target logit in
        one call). Saves the whole head input and this rank's softmax columns."""
        act, N, TP = b.M * b.h, b.M, MeshAxis.TP
        if not self.sp:  # with async_grad_allreduce beside the table gradient's product
            b.add("backward", "all_reduce", (TP,), act, site="hidden" if self.async_grad_allreduce else "")
        else:
            b.add("forward", "all_gather", (TP,), act)
            b.add("backward", "reduce_scatter", (TP,), act)
        b.add("forward", "all_reduce", (TP,), 3 * N, 2, "loss", itemsize=max(4, b.c.itemsize))
        b.save_ints(N * (8 + 1))  # target ids, mask
        return act + N * b.vocab_padded / self.p

    def cost_pool(self, b):
        """Without sequence parallelism a view of the (whole) residual; with it, the pooled
        pieces all-reduced over the ranks."""
        if not self.sp:
            return b.residual
        b.add("forward", "all_reduce", (MeshAxis.TP,), b.B * b.h)
        return b.B * b.h
