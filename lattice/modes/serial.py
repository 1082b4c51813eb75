"""Serial mode: one rank per model replica, every parameter whole.

Its modules also serve other modes as the replicated building blocks (specs with no splits).
"""

from __future__ import annotations

import torch.nn as nn
import torch.nn.functional as F

from lattice.modes import register
from lattice.modes.base import Block, Mode, Position
from lattice.modes.kernels.layers import (TiedHead, add_position_rows, check_norm_kind, linear_params, local_linear,
                                          normalize_split_hidden, position_rows, position_span, register_linear,
                                          register_position_tables, split_segments, upcast, vocab_bias_spec)
from lattice.modes.kernels.loss import labelled_count
from lattice.parallel.context import LatticeConfigError
from lattice.parallel.sharding import ShardSpec, register_sharded


class Embedding(nn.Module):
    """Token (+ position) embedding, the tables whole on this rank. `whole` (here and below):
    further ShardSpec fields of these unsplit tensors (`holders`, `grad_sum`) for modes that
    reuse the module."""

    def __init__(self, cfg, ctx, positions: bool = True, types: int = 0, **whole):
        super().__init__()
        register_sharded(self, "wte", ShardSpec((cfg.vocab_size, cfg.d_model), **whole), ctx)
        register_position_tables(self, cfg, ctx, positions, types, lambda shape: ShardSpec(shape, **whole))

    def forward(self, tokens, start: int = 0, token_types=None, positions=None):  # (B, T) at start.. -> (B, T, h)
        x = F.embedding(tokens, self.wte)
        if not self.positions:
            return x
        first, count, index = position_span(start, tokens.shape[1], positions)
        return add_position_rows(x, position_rows(self, first, count), count, token_types,
                                 slice(None) if index is None else index)


class Norm(nn.Module):
    """LayerNorm (weight, optional bias) or RMSNorm (weight) with whole (replicated) parameters; a
    `grad_sum` in `whole` names the axes along which ranks see different tokens, so that their
    partial gradients must be summed."""

    def __init__(self, cfg, ctx, kind: str, eps: float, bias: bool, **whole):
        super().__init__()
        check_norm_kind(kind, bias)
        self.kind, self.eps = kind, eps
        register_sharded(self, "weight", ShardSpec((cfg.d_model,), **whole), ctx)
        if bias:
            register_sharded(self, "bias", ShardSpec((cfg.d_model,), **whole), ctx)
        else:
            self.bias = None

    def forward(self, x):
        if self.kind == "layer":
            return F.layer_norm(x, x.shape[-1:], self.weight, self.bias, self.eps)
        return normalize_split_hidden(x, None, x.shape[-1], self.eps, "rms") * self.weight


class Linear(nn.Module):
    """y = x W + b; W (in, [stack,] out) whole, or one W per segment."""

    def __init__(self, cfg, ctx, in_features, out_features, stack=None, segments=None, bias=True, **whole):
        super().__init__()
        out_shape = (stack, out_features) if stack else (out_features,)
        register_linear(self, ctx, out_shape, lambda s: ShardSpec((in_features,) + s, **whole),
                        lambda s: ShardSpec(s, **whole), bias, segments)

    def forward(self, x):  # (B, T, in) -> (B, T, [stack,] out), or a tuple of segments
        return split_segments(self, local_linear(x, *linear_params(self)))


class LMHead(TiedHead):
    """Logits against the (tied) token table, cross-entropy in float32."""

    def __init__(self, cfg, ctx, embedding, bias: bool = False):
        super().__init__(cfg, ctx, embedding, ShardSpec((cfg.vocab_size, cfg.d_model)),
                         vocab_bias_spec(cfg) if bias else None)

    def logits(self, x):  # (B, T, h) -> (B, T, V)
        return self.add_bias(x @ self.table().t())

    def loss(self, x, targets):
        logits = self.logits(x)
        # over labelled_count, as every mode: a batch, micro-batch or cp chunk with none labelled
        # (all padding) has a loss of 0, where a mean over no targets is 0/0
        return F.cross_entropy(upcast(logits).flatten(0, 1), targets.flatten(), reduction="sum") / labelled_count(targets)


@register
class Serial(Mode):
    name = "serial"
    test_layouts = ({"tp": 1}, {"tp": 1, "dp": 2})

    @classmethod
    def mesh_axes(cls, tp, options):
        if tp != 1:
            raise LatticeConfigError(f"mode 'serial' runs one rank per replica; got tp={tp}: use tp=1, "
                                     f"or a parallel mode (1d, 2d, 3d, subgraph)")
        return ()

    def embedding(self, *, positions=True, types=0):
        return Embedding(self.cfg, self.ctx, positions, types)

    def norm(self, kind="layer", *, eps, bias):
        return Norm(self.cfg, self.ctx, kind, eps, bias)

    def linear(self, in_features, out_features, *, block: Block, position: Position, stack=None, segments=None,
               bias: bool):
        return Linear(self.cfg, self.ctx, in_features, out_features, stack, segments,
                      bias)

    def lm_head(self, embedding, *, bias=False):
        return LMHead(self.cfg, self.ctx, embedding, bias)

    def residual_shape(self, batch, seq):
        return (batch, seq, self.cfg.d_model)

    def attention_rows(self, batch):
        return slice(0, batch)

    def pool(self, x, index, batch):
        return x[:, index]

    # ---- cost: the whole model on one rank, no communication
    def cost_embedding(self, b, positions, types):
        b.save_ints(8 * b.M)  # the token ids

    def cost_norm(self, b, kind, bias):
        """LayerNorm saves its input, mean and rstd; RMSNorm x̂ and rstd."""
        return b.M * b.h + (2 if kind == "layer" else 1) * b.M

    def cost_linear(self, b, in_features, out_features, *, block, position, bias, input_saved):
        return (0 if input_saved else b.M * in_features), b.M * out_features

    def cost_lm_head(self, b):
        """Saves the head's input, the log-softmax of the logits, the loss's total weight; the targets."""
        b.save_ints(8 * b.M)
        return b.M * b.h + b.M * b.V + 1

    def cost_pool(self, b):
        """A view of the residual: the classifier's product keeps the residual's storage."""
        return b.residual
