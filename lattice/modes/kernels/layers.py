"""Pieces every mode repeats: float32 upcasting, vocabulary padding, the (tied) LM head's table,
linear parameters (whole or in named segments) and the local product, the two norms' arithmetic
over a hidden dim that may be split, and pooling one position of the residual stream. Modes
compose these with their own communication."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from lattice.parallel import comm
from lattice.parallel.sharding import ShardSpec, register_sharded


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


def position_rows(embedding: nn.Module, start: int, length: int) -> torch.Tensor | None:
    """The rows an embedding adds to its tokens at positions start..: its position table's
    (`wpe`, `length` rows) followed by its whole token-type table (`wtype`, BERT's) when it has
    one, (length [+ types], h_local); None on a rank that does not hold the tables (they are
    hosted elsewhere). A mode moves them as one tensor and `add_position_rows` adds them."""
    if embedding.wpe is None:
        return None
    rows = embedding.wpe[start:start + length]
    return torch.cat([rows, embedding.wtype]) if embedding.types else rows


def position_span(start: int, length: int, positions: torch.Tensor | None) -> tuple[int, int, torch.Tensor | None]:
    """(first row, rows, each token's row among them or None) of the position table a batch
    reads: positions start.. for every sequence, or each token's own `positions` (B, T) (a
    left-padded batch's; the replica's whole batch, so that every rank reads the same rows)."""
    if positions is None:
        return start, length, None
    first = int(positions.min())
    return first, int(positions.max()) + 1 - first, positions - first


def add_position_rows(x: torch.Tensor, rows: torch.Tensor, count: int, token_types: torch.Tensor | None,
                      where: slice | torch.Tensor = slice(None)) -> torch.Tensor:
    """x (B_l, T_l, h_l) plus the type row of each token (`token_types` (B_l, T_l) of x's tokens;
    None: every token of type 0), then its position's row: `rows` are position_rows' for `count`
    positions, of which x's tokens read `where`: a slice (the same positions in every sequence),
    or each token's row (B_l, T_l) (`position_span`'s index, x's part of it)."""
    types = rows[count:]
    if types.shape[0]:
        x = x + (types[0] if token_types is None else F.embedding(token_types, types))
    table = rows[:count]
    return x + (table[where] if isinstance(where, slice) else F.embedding(where, table))


def register_position_tables(embedding: nn.Module, cfg, ctx, positions: bool, types: int, spec) -> None:
    """Declare an embedding's position table `wpe` (seq_len, d_model) when `positions`, and its
    token-type table `wtype` (types, d_model) when `types`, each as `spec(full_shape)` says (both
    split and held alike, as `position_rows` adds them together)."""
    if types and not positions:
        raise ValueError("a token-type table is added with the position table: types need positions=True")
    embedding.positions, embedding.types = positions, types
    if positions:
        register_sharded(embedding, "wpe", spec((cfg.seq_len, cfg.d_model)), ctx)
    if types:
        register_sharded(embedding, "wtype", spec((types, cfg.d_model)), ctx)


class TiedHead(nn.Module):
    """An LM head scoring against the token table: the embedding's own (tied) or a separate one
    with the same spec; with `bias_spec`, a bias per vocabulary entry (BERT's output bias) split
    like the vocabulary of the mode's local logits."""

    def __init__(self, cfg, ctx, embedding: nn.Module, table_spec: ShardSpec, bias_spec: ShardSpec | None = None):
        super().__init__()
        self.embedding = [embedding]  # a list, so the tied table is not registered twice
        self.tied = cfg.tie_embeddings
        if not self.tied:
            register_sharded(self, "weight", table_spec, ctx)
        self.has_bias = bias_spec is not None
        if self.has_bias:
            register_sharded(self, "bias", bias_spec, ctx)

    def table(self) -> torch.Tensor:
        return self.embedding[0].wte if self.tied else self.weight

    def add_bias(self, logits: torch.Tensor) -> torch.Tensor:
        """logits (.., V_local) + this rank's bias entries."""
        return logits + self.bias if self.has_bias else logits


def vocab_bias_spec(cfg, axes: tuple = (), multiple: int = 1, **replicated) -> ShardSpec:
    """The (V,) output bias split over `axes` as the mode's local logits split the vocabulary,
    padded to a multiple of `multiple` as its table is; `replicated`: further ShardSpec fields
    (the axes over which the logits hold other tokens sum its gradient)."""
    padded = round_up(cfg.vocab_size, multiple)
    return ShardSpec((cfg.vocab_size,), splits=((0, axes),) if axes else (),
                     padded_shape=(padded,) if padded != cfg.vocab_size else None, **replicated)


def register_weight_and_bias(module: nn.Module, ctx, weight: ShardSpec, bias: ShardSpec | None) -> None:
    """Register `weight` and, given its spec, `bias` (else bias = None)."""
    register_sharded(module, "weight", weight, ctx)
    if bias is not None:
        register_sharded(module, "bias", bias, ctx)
    else:
        module.bias = None


NORM_KINDS = ("layer", "rms")


def check_norm_kind(kind: str, bias: bool) -> None:
    if kind not in NORM_KINDS:
        raise ValueError(f"norm kind must be one of {NORM_KINDS}, got {kind!r}")
    if kind == "rms" and bias:
        raise ValueError("an RMSNorm has no bias; pass bias=False")


def register_linear(module: nn.Module, ctx, out_shape: tuple[int, ...], weight_spec, bias_spec,
                    bias: bool, segments: tuple[tuple[str, int], ...] | None = None) -> None:
    """The parameters of y = x W + b: `weight_spec(out_shape)` and, with `bias`,
    `bias_spec(out_shape)` give their specs. With `segments` ((name, width), ...) the output is
    several tensors of different widths (q with n_heads, k and v with n_kv_heads): each segment
    gets its own W and b in a child module named after it, split like a linear of that width, so
    that every rank holds whole heads of every segment. `linear_params` returns the local
    weight and bias (segments concatenated), `split_segments` cuts the product back."""
    if segments is None:
        register_weight_and_bias(module, ctx, weight_spec(out_shape), bias_spec(out_shape) if bias else None)
        module.segment_names, module.segment_widths = None, None
        return
    if len(out_shape) != 1:
        raise ValueError("a segmented linear has one output dim per segment (no stack)")
    widths = []
    for name, width in segments:
        if hasattr(module, name):
            raise ValueError(f"segment name {name!r} is an attribute of {type(module).__name__}; name it otherwise")
        holder = nn.Module()
        register_weight_and_bias(holder, ctx, weight_spec((width,)), bias_spec((width,)) if bias else None)
        module.add_module(name, holder)
        widths.append(weight_spec((width,)).local_shape(ctx.topology)[-1])
    module.segment_names, module.segment_widths = tuple(n for n, _ in segments), tuple(widths)


def linear_params(module: nn.Module) -> tuple:
    """This rank's W (in, [stack,] out) and b of a linear registered by `register_linear`; with
    segments, W is the tuple of the segments' (in, out_i) (a product keeps them apart, so that
    autograd does not save a copy of their concatenation) and b their biases concatenated (None
    where this rank holds none)."""
    if module.segment_names is None:
        return module.weight, module.bias
    parts = [getattr(module, n) for n in module.segment_names]
    weight = None if parts[0].weight is None else tuple(p.weight for p in parts)
    bias = None if parts[0].bias is None else torch.cat([p.bias for p in parts], dim=-1)
    return weight, bias


def split_segments(module: nn.Module, y: torch.Tensor):
    """A segmented linear's product cut into one tensor per segment (the tensor itself otherwise)."""
    if module.segment_names is None:
        return y
    return tuple(y.split(module.segment_widths, dim=-1))


class _SegmentProduct(torch.autograd.Function):
    """y = x [W_1 | W_2 | ...] for a linear's segments. Forward saves x and the segments (its
    parameters), not their concatenation; backward: dx = dy [W_1 | ...]ᵀ (concatenated again,
    for the moment), dW_i = xᵀ dy_i (the columns of xᵀ dy that are segment i's)."""

    @staticmethod
    def forward(ctx, x, *ws):
        ctx.save_for_backward(x, *ws)
        # one matrix product over every row, as autograd's x @ W folds it (inside a Function, where
        # nothing requires grad, a strided x, as sequence parallelism gathers it, would take bmm
        # over the batch with W expanded, which selective checkpointing does not keep)
        return (x.reshape(-1, x.shape[-1]) @ torch.cat(ws, dim=-1)).unflatten(0, x.shape[:-1])

    @staticmethod
    def backward(ctx, dy):
        x, *ws = ctx.saved_tensors
        dx = dy @ torch.cat(ws, dim=-1).t() if ctx.needs_input_grad[0] else None
        dw = x.reshape(-1, x.shape[-1]).t() @ dy.reshape(-1, dy.shape[-1])
        return dx, *dw.split([w.shape[-1] for w in ws], dim=-1)


def local_linear(x: torch.Tensor, weight, bias: torch.Tensor | None) -> torch.Tensor:
    """y = x W + b on local shards: x (..., in), W (in, [stack,] out) or a tuple of segments
    (in, out_i), b ([stack,] out) -> (..., [stack,] out)."""
    if isinstance(weight, tuple):
        dtype = compute_dtype(x)  # under autocast, the casts outside the Function (as torch.mm would)
        y = _SegmentProduct.apply(x.to(dtype), *(w.to(dtype) for w in weight))
        return y if bias is None else y + bias
    y = x @ weight.reshape(weight.shape[0], -1)
    if bias is not None:
        y = y + bias.reshape(-1)
    return y.unflatten(-1, weight.shape[1:]) if weight.dim() > 2 else y


class _NormalizeSplitHidden(torch.autograd.Function):
    """x̂ = (x - E[x]) / sqrt(Var[x] + eps) over a hidden dim split over `group` (Optimus §3.2.2;
    the 3D LayerNorm the same way). Forward: all-reduce (Σx, Σx²) over the group. Backward: with
    g = dJ/dx̂, all-reduce (Σg, Σg·x̂); dx = rstd · (g - Σg/h - x̂ · Σ(g·x̂)/h).

    RMSNorm (`rms`): x̂ = x / sqrt(E[x²] + eps): forward all-reduces Σx² alone, backward Σg·x̂
    alone; dx = rstd · (g - x̂ · Σ(g·x̂)/h). With a one-rank group nothing is sent."""

    @staticmethod
    def forward(ctx, x, group, h, eps, rms):
        xs = upcast(x)
        if rms:
            sq = comm.raw_all_reduce((xs * xs).sum(-1), group)
            rstd = torch.rsqrt(sq / h + eps)
            xhat = (xs * rstd.unsqueeze(-1)).to(x.dtype)
        else:
            sums = comm.raw_all_reduce(torch.stack([xs.sum(-1), (xs * xs).sum(-1)]), group)
            mean = sums[0] / h
            rstd = torch.rsqrt(sums[1] / h - mean * mean + eps)
            xhat = ((xs - mean.unsqueeze(-1)) * rstd.unsqueeze(-1)).to(x.dtype)
        ctx.group, ctx.h, ctx.rms = group, h, rms
        ctx.save_for_backward(xhat, rstd)
        return xhat

    @staticmethod
    def backward(ctx, g):
        xhat, rstd = ctx.saved_tensors
        gs, xs = upcast(g), upcast(xhat)
        if ctx.rms:
            dot = comm.raw_all_reduce((gs * xs).sum(-1), ctx.group)
            dx = rstd.unsqueeze(-1) * (gs - xs * (dot.unsqueeze(-1) / ctx.h))
        else:
            sums = comm.raw_all_reduce(torch.stack([gs.sum(-1), (gs * xs).sum(-1)]), ctx.group)
            dx = rstd.unsqueeze(-1) * (gs - sums[0].unsqueeze(-1) / ctx.h - xs * (sums[1].unsqueeze(-1) / ctx.h))
        return dx.to(g.dtype), None, None, None, None


def normalize_split_hidden(x: torch.Tensor, group, h: int, eps: float, kind: str = "layer") -> torch.Tensor:
    """LayerNorm's (kind "layer") or RMSNorm's ("rms") normalisation, no affine, of x (..., h/n)
    whose hidden dim of size h is split over the n ranks of `group` (None: whole on this rank)."""
    return _NormalizeSplitHidden.apply(x, group, h, eps, kind == "rms")


def rows_on_every_rank(local: torch.Tensor, rows: slice, batch: int, group) -> torch.Tensor:
    """The (batch, ...) tensor whose `rows` are this rank's `local` (the ranks of `group` holding
    disjoint rows, some none), identical on every rank: each rank's rows placed in zeros and summed
    by one all-reduce, exact since every other rank adds zeros there. No autograd (inference)."""
    pad = [0, 0] * (local.dim() - 1) + [rows.start, batch - rows.stop]
    return comm.raw_all_reduce(F.pad(local, pad), group)


def pool_pieces(piece: torch.Tensor | None, rows: slice, cols: slice, batch: int, width: int, group) -> torch.Tensor:
    """One position of the residual stream, (batch, width), identical on every rank of `group`,
    from each rank's piece of it (rows x cols of the whole, zeros padded around it; `piece` an
    empty-batch tensor where this rank holds none of that position). Forward: an all-reduce (g)
    sums the padded pieces; backward: the identity (every rank computes the same loss from the
    pooled tensor), each piece taking its own region of the gradient."""
    full = F.pad(piece, (cols.start, width - cols.stop, rows.start, batch - rows.stop))
    return comm.all_reduce(full, group)


def idle_output(x: torch.Tensor, feature_shape: tuple[int, ...]) -> torch.Tensor:
    """What a layer returns on a rank that holds none of its parameters (the idle ranks of
    subgraph's D&SP-cSub): an empty (0, T, *features) tensor computed from x, so that it stays in
    the autograd graph and the backward collectives of other layers run on this rank too."""
    lead = x[..., :1].reshape(*x.shape[:-1], *([1] * len(feature_shape)))
    return (lead.expand(*x.shape[:-1], *feature_shape) * 0.0).to(compute_dtype(x))
