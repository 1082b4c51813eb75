"""1D tensor parallelism (Megatron-LM, papers/002), with optional sequence parallelism.

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

import torch.nn as nn
import torch.nn.functional as F

from lattice import comm
from lattice.context import MeshAxis
from lattice.loss import vocab_parallel_cross_entropy
from lattice.modes import register
from lattice.modes.base import Block, Mode, Option, Position, divisible
from lattice.modes.serial import LayerNorm
from lattice.layers import TiedHead, register_weight_and_bias, local_linear, vocab_table_spec
from lattice.sharding import ShardSpec, register_sharded


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

    def __init__(self, cfg, ctx, sequence_parallel: bool):
        super().__init__()
        self.ctx, self.sp = ctx, sequence_parallel
        self.vocab_start, self.vocab_local = vocab_range(cfg, ctx)
        register_sharded(self, "wte", vocab_spec(cfg, ctx), ctx)
        register_sharded(self, "wpe", ShardSpec((cfg.seq_len, cfg.d_model)), ctx)

    def forward(self, tokens, start: int = 0):
        group = tp_group(self.ctx)
        T = tokens.shape[1]
        positions = self.wpe[start:start + T]
        local = tokens - self.vocab_start
        elsewhere = (local < 0) | (local >= self.vocab_local)  # another rank owns these rows
        part = F.embedding(local.masked_fill(elsewhere, 0), self.wte)  # (B, T, h), zero-filled below
        part = part.masked_fill(elsewhere.unsqueeze(-1), 0.0)
        if not self.sp:
            return comm.all_reduce(part, group) + positions
        x_seq = comm.reduce_scatter(part, group, 1)  # (B, T/p, h)
        t_local = x_seq.shape[1]
        wpe = comm.copy_to_group(positions, group)  # each rank's rows are a partial gradient
        first = comm.group_rank(group) * t_local
        return x_seq + wpe[first:first + t_local]


class ColumnParallelLinear(nn.Module):
    """y = x W + b with W (in, [stack,] out) split over TP along its last dim (out).

    x: (B, T, in) replicated (through f), or (B, T/p, in) all-gathered over T with sequence
    parallel -> (B, T, [stack,] out/p).
    """

    def __init__(self, cfg, ctx, in_features, out_features, stack, sequence_parallel):
        super().__init__()
        self.ctx, self.sp = ctx, sequence_parallel
        out_shape = (stack, out_features) if stack else (out_features,)
        last = len(out_shape)
        register_weight_and_bias(self, cfg, ctx, ShardSpec((in_features,) + out_shape, splits=((last, (MeshAxis.TP,)),)),
                       ShardSpec(out_shape, splits=((last - 1, (MeshAxis.TP,)),)))

    def forward(self, x):
        group = tp_group(self.ctx)
        x = comm.all_gather(x, group, 1) if self.sp else comm.copy_to_group(x, group)  # (B, T, in)
        return local_linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """y = x W + b with W (in, out) split over TP along dim 0 (in); b replicated, added once
    after the sum.

    x: (B, T, in/p) -> (B, T, out) all-reduced (g), or (B, T/p, out) reduce-scattered over T.
    """

    def __init__(self, cfg, ctx, in_features, out_features, sequence_parallel):
        super().__init__()
        self.ctx, self.sp = ctx, sequence_parallel
        # the bias is added to a sequence chunk under sequence parallelism: partial gradients
        register_weight_and_bias(self, cfg, ctx, ShardSpec((in_features, out_features), splits=((0, (MeshAxis.TP,)),)),
                       ShardSpec((out_features,), grad_sum=(MeshAxis.TP,) if sequence_parallel else ()))

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

    def __init__(self, cfg, ctx, embedding, sequence_parallel):
        super().__init__(cfg, ctx, embedding, vocab_spec(cfg, ctx))
        self.ctx, self.sp, self.vocab_size = ctx, sequence_parallel, cfg.vocab_size
        self.vocab_start, _ = vocab_range(cfg, ctx)

    def _local_logits(self, x):  # -> (B, T, V_local) of this rank's vocabulary rows
        group = tp_group(self.ctx)
        x = comm.all_gather(x, group, 1) if self.sp else comm.copy_to_group(x, group)
        return x @ self.table().t()

    def loss(self, x, targets):
        logits = self._local_logits(x)
        per_token = vocab_parallel_cross_entropy(logits.flatten(0, 1), targets.flatten(), tp_group(self.ctx),
                                                 self.vocab_start, self.vocab_size)
        return per_token.mean()

    def logits(self, x):
        """Full (B, T, V) logits, gathered over the vocabulary: for inference and debugging only."""
        full = comm.all_gather(self._local_logits(x), tp_group(self.ctx), 2)
        return full[..., : self.vocab_size]


@register
class Megatron1D(Mode):
    """Megatron 1D tensor parallelism over mesh axis TP, optionally with sequence parallelism."""

    name = "1d"
    options = {"sequence_parallel": Option(False, "split LayerNorm, dropout and the residual along the "
                                                  "sequence (Korthikanti et al.)")}
    peer = "dtensor"  # torch.distributed.tensor.parallel's column/row-wise plan is this layout
    test_layouts = ({"tp": 2}, {"tp": 4}, {"tp": 2, "sequence_parallel": True},
                    {"tp": 4, "sequence_parallel": True}, {"tp": 2, "dp": 2, "sequence_parallel": True})

    def __init__(self, cfg, ctx):
        self.p = ctx.size(MeshAxis.TP)
        self.sp = bool(ctx.options.get("sequence_parallel", False))
        # the residual differs per rank under sequence parallelism: dropout then needs the sharded stream
        self.residual_replicated = not self.sp
        super().__init__(cfg, ctx)

    @classmethod
    def mesh_axes(cls, tp, options):
        return ((MeshAxis.TP, tp),)

    def check_config(self, cfg):
        divisible("d_model", cfg.d_model, self.p, "tp")
        divisible("n_heads", cfg.n_heads, self.p, "tp",
                  f"use a tp that divides {cfg.n_heads} or a head count that is a multiple of {self.p}")

    def check_batch(self, tokens):
        if self.sp:
            divisible("sequence length", tokens.shape[1], self.p, "tp",
                      f"with sequence_parallel=True use sequences whose length is a multiple of {self.p}, "
                      f"or turn sequence_parallel off")

    def embedding(self):
        return VocabParallelEmbedding(self.cfg, self.ctx, self.sp)

    def layer_norm(self):
        return LayerNorm(self.cfg, self.ctx, grad_sum=(MeshAxis.TP,) if self.sp else ())

    def linear(self, in_features, out_features, *, block: Block, position: Position, stack=None):
        if position == Position.IN:
            return ColumnParallelLinear(self.cfg, self.ctx, in_features, out_features, stack, self.sp)
        if stack:
            raise ValueError("a row-parallel (Position.OUT) linear cannot be stacked")
        return RowParallelLinear(self.cfg, self.ctx, in_features, out_features, self.sp)

    def lm_head(self, embedding):
        return VocabParallelLMHead(self.cfg, self.ctx, embedding, self.sp)

    @classmethod
    def optimus_table1_row(cls, b, s, h, p):
        """Optimus Table 1, 1D: ring all-reduces of b·s·h, 2 forward and 4 backward per layer."""
        return {"forward": 4 * (p - 1) / p * b * s * h, "backward": 8 * (p - 1) / p * b * s * h,
                "forward_mults": (12 * b * s * h * h + 2 * b * s * s * h) / p,
                "backward_mults": (36 * b * s * h * h + 6 * b * s * s * h) / p}

    def cost_terms(self, b):
        """f/g around every column/row pair: forward g = all-reduce of [B, T, h] after the
        attention and MLP output linears, backward f = all-reduce of the input gradient before qkv
        and fc. Vocab-parallel embedding (forward all-reduce) and head fused with the
        cross-entropy: three per-token values all-reduced (max, then Σe^x and the target logit in
        one call), and the head's f in backward. Sequence parallelism swaps each all-reduce for a
        reduce-scatter plus an all-gather over T of the same buffer, and all-reduces the wpe rows
        in use; the LayerNorm and row-bias sums come from their specs (grad_sum)."""
        B, T, h, n, p, V = b.B, b.T, b.h, b.n, b.p, b.vocab_padded
        TP = MeshAxis.TP
        act = B * T * h
        N = B * T  # tokens
        if not self.sp:
            b.add("forward", "all_reduce", (TP,), act, 1, "embedding")
            for _ in range(2):  # attention, MLP
                b.add("forward", "all_reduce", (TP,), act, 1, "layer.linear", layer=True)
                b.add("backward", "all_reduce", (TP,), act, 1, "layer.linear", layer=True)
            # recomputation stops at the MLP's last saved input: its g is not repeated
            b.recompute.pop()
            b.add("backward", "all_reduce", (TP,), act, 1, "head")
        else:
            b.add("forward", "reduce_scatter", (TP,), act, 1, "embedding")
            b.add("backward", "all_gather", (TP,), act, 1, "embedding")
            b.add("backward", "all_reduce", (TP,), T * h, 1, "embedding")  # wpe over the chunks
            for _ in range(2):
                b.add("forward", "all_gather", (TP,), act, 1, "layer.linear", layer=True)
                b.add("backward", "reduce_scatter", (TP,), act, 1, "layer.linear", layer=True)
                b.add("forward", "reduce_scatter", (TP,), act, 1, "layer.linear", layer=True)
                b.add("backward", "all_gather", (TP,), act, 1, "layer.linear", layer=True)
            b.recompute.pop()  # the MLP's reduce-scatter follows its last saved input
            b.add("forward", "all_gather", (TP,), act, 1, "head")
            b.add("backward", "reduce_scatter", (TP,), act, 1, "head")
        b.add("forward", "all_reduce", (TP,), 3 * N, 2, "loss", itemsize=max(4, b.c.itemsize))
        b.share = {"split": 1 / p, "replicated": 1 / p if self.sp else 1}
        # saved: LayerNorm inputs whole (a 1/p chunk under sequence parallelism) and outputs whole
        # (all-gathered there), q, k, v, attention output and the MLP's 4h tensors at 1/p
        r = p if self.sp else 1
        b.residual_split = r
        per_layer = 2 * act / r + 2 * act + 12 * act / p + 4 * N / r + B * n * T / p
        head = act / r + act + N * V / p + 2 * N / r
        ints = N * (8 + 1) + N * (8 + 1)  # token ids, mask; target ids, mask
        b.activations(per_layer, head, ints)
