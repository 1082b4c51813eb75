"""Pieces every mode repeats: float32 upcasting, vocabulary padding, the (tied) LM head's table,
and the local linear product. Modes compose these with their own communication."""

from __future__ import annotations

import torch
import torch.nn as nn

from lattice import comm
from lattice.sharding import ShardSpec, register_sharded


def upcast(x: torch.Tensor) -> torch.Tensor:
    """Low-precision (bf16/fp16) values to float32 for softmax and loss; float32/64 unchanged."""
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a matmul on x produces: the autocast dtype where autocast is on."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def vocab_table_spec(cfg, splits, multiple: int) -> ShardSpec:
    """The (V, h) token table split by `splits`, V padded with zero rows to a multiple of
    `multiple` so that it divides; state dicts keep the true V (the spec crops the padding)."""
    padded = round_up(cfg.vocab_size, multiple)
    return ShardSpec((cfg.vocab_size, cfg.d_model), splits=splits,
                     padded_shape=(padded, cfg.d_model) if padded != cfg.vocab_size else None)


class TiedHead(nn.Module):
    """An LM head scoring against the token table: the embedding's own (tied) or a separate one
    with the same spec."""

    def __init__(self, cfg, ctx, embedding: nn.Module, table_spec: ShardSpec):
        super().__init__()
        self.embedding = [embedding]  # a list, so the tied table is not registered twice
        self.tied = cfg.tie_embeddings
        if not self.tied:
            register_sharded(self, "weight", table_spec, ctx)

    def table(self) -> torch.Tensor:
        return self.embedding[0].wte if self.tied else self.weight


def register_weight_and_bias(module: nn.Module, cfg, ctx, weight: ShardSpec, bias: ShardSpec) -> None:
    """Register `weight` and, when the model has biases, `bias` (else bias = None)."""
    register_sharded(module, "weight", weight, ctx)
    if cfg.bias:
        register_sharded(module, "bias", bias, ctx)
    else:
        module.bias = None


def local_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """y = x W + b on local shards: x (..., in), W (in, [stack,] out), b ([stack,] out) ->
    (..., [stack,] out)."""
    y = x @ weight.reshape(weight.shape[0], -1)
    if bias is not None:
        y = y + bias.reshape(-1)
    return y.unflatten(-1, weight.shape[1:]) if weight.dim() > 2 else y


class _NormalizeSplitHidden(torch.autograd.Function):
    """x̂ = (x - E[x]) / sqrt(Var[x] + eps) over a hidden dim split over `group` (Optimus §3.2.2;
    the 3D LayerNorm the same way). Forward: all-reduce (Σx, Σx²) over the group. Backward: with
    g = dJ/dx̂, all-reduce (Σg, Σg·x̂); dx = rstd · (g - Σg/h - x̂ · Σ(g·x̂)/h)."""

    @staticmethod
    def forward(ctx, x, group, h, eps):
        xs = upcast(x)
        sums = comm.raw_all_reduce(torch.stack([xs.sum(-1), (xs * xs).sum(-1)]), group)
        mean = sums[0] / h
        rstd = torch.rsqrt(sums[1] / h - mean * mean + eps)
        xhat = ((xs - mean.unsqueeze(-1)) * rstd.unsqueeze(-1)).to(x.dtype)
        ctx.group, ctx.h = group, h
        ctx.save_for_backward(xhat, rstd)
        return xhat

    @staticmethod
    def backward(ctx, g):
        xhat, rstd = ctx.saved_tensors
        gs, xs = upcast(g), upcast(xhat)
        sums = comm.raw_all_reduce(torch.stack([gs.sum(-1), (gs * xs).sum(-1)]), ctx.group)
        dx = rstd.unsqueeze(-1) * (gs - sums[0].unsqueeze(-1) / ctx.h - xs * (sums[1].unsqueeze(-1) / ctx.h))
        return dx.to(g.dtype), None, None, None


def normalize_split_hidden(x: torch.Tensor, group, h: int, eps: float) -> torch.Tensor:
    """LayerNorm's normalisation (no affine) of x (..., h/n) whose hidden dim of size h is split
    over the n ranks of `group`."""
    return _NormalizeSplitHidden.apply(x, group, h, eps)
