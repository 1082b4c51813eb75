"""Serial mode: one rank per model replica, every parameter whole.

Its modules also serve other modes as the replicated building blocks (specs with no splits).
"""

from __future__ import annotations

import torch.nn as nn
import torch.nn.functional as F

from lattice.modes import register
from lattice.modes.base import Block, Mode, Position
from lattice.layers import TiedHead, register_weight_and_bias, local_linear, upcast  # noqa: F401  (upcast: shared)
from lattice.sharding import ShardSpec, register_sharded


class Embedding(nn.Module):
    """Token + position embedding, both tables whole on this rank. `whole` (here and below):
    further ShardSpec fields of these unsplit tensors (`holders`, `grad_sum`) for modes that
    reuse the module."""

    def __init__(self, cfg, ctx, **whole):
        super().__init__()
        register_sharded(self, "wte", ShardSpec((cfg.vocab_size, cfg.d_model), **whole), ctx)
        register_sharded(self, "wpe", ShardSpec((cfg.seq_len, cfg.d_model), **whole), ctx)

    def forward(self, tokens, start: int = 0):  # (B, T) at positions start.. -> (B, T, h)
        return F.embedding(tokens, self.wte) + self.wpe[start:start + tokens.shape[1]]


class LayerNorm(nn.Module):
    """LayerNorm with whole (replicated) weight and bias; a `grad_sum` in `whole` names the axes
    along which ranks see different tokens, so that their partial gradients must be summed."""

    def __init__(self, cfg, ctx, **whole):
        super().__init__()
        self.eps = cfg.layer_norm_eps
        register_sharded(self, "weight", ShardSpec((cfg.d_model,), **whole), ctx)
        if cfg.bias:
            register_sharded(self, "bias", ShardSpec((cfg.d_model,), **whole), ctx)
        else:
            self.bias = None

    def forward(self, x):
        return F.layer_norm(x, x.shape[-1:], self.weight, self.bias, self.eps)


class Linear(nn.Module):
    """y = x W + b; W (in, [stack,] out) whole."""

    def __init__(self, cfg, ctx, in_features, out_features, stack=None, **whole):
        super().__init__()
        out_shape = (stack, out_features) if stack else (out_features,)
        register_weight_and_bias(self, cfg, ctx, ShardSpec((in_features,) + out_shape, **whole),
                                 ShardSpec(out_shape, **whole))

    def forward(self, x):  # (B, T, in) -> (B, T, [stack,] out)
        return local_linear(x, self.weight, self.bias)


class LMHead(TiedHead):
    """Logits against the (tied) token table, cross-entropy in float32."""

    def __init__(self, cfg, ctx, embedding):
        super().__init__(cfg, ctx, embedding, ShardSpec((cfg.vocab_size, cfg.d_model)))

    def logits(self, x):  # (B, T, h) -> (B, T, V)
        return x @ self.table().t()

    def loss(self, x, targets):
        logits = self.logits(x)
        return F.cross_entropy(upcast(logits).flatten(0, 1), targets.flatten())


@register
class Serial(Mode):
    name = "serial"
    test_layouts = ({"tp": 1}, {"tp": 1, "dp": 2})

    @classmethod
    def mesh_axes(cls, tp, options):
        if tp != 1:
            from lattice.context import LatticeConfigError
            raise LatticeConfigError(f"mode 'serial' runs one rank per replica; got tp={tp}: use tp=1, "
                                     f"or a parallel mode (1d, 2d, 3d, subgraph)")
        return ()

    def embedding(self):
        return Embedding(self.cfg, self.ctx)

    def layer_norm(self):
        return LayerNorm(self.cfg, self.ctx)

    def linear(self, in_features, out_features, *, block: Block, position: Position, stack=None):
        return Linear(self.cfg, self.ctx, in_features, out_features, stack)

    def lm_head(self, embedding):
        return LMHead(self.cfg, self.ctx, embedding)

    def cost_terms(self, b):
        """Whole model on one rank: no communication. Saved per layer: LayerNorm input, output,
        mean, rstd (x2); q, k, v; attention output and log-sum-exp; the MLP's 4h input and output."""
        B, T, h, n = b.B, b.T, b.h, b.n
        b.activations(16 * B * T * h + 4 * B * T + B * n * T, 2 * B * T * h + 2 * B * T + B * T * b.V + 1, 16 * B * T)
