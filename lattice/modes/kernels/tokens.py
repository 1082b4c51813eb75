"""Whole tokens from a layout's residual stream and back: what a mixture of experts routes.

A router and its experts read every feature of a token, so at an MoE layer each layout turns its
piece of the residual stream into a set of whole tokens (all d_model features) that no other rank
of the replica holds, and back afterwards (`Mode.expert_tokens`). Three ways cover the layouts:
- the residual holds whole tokens, a different set on each rank (serial, 1d with sequence
  parallelism, subgraph's common rows): nothing moves;
- every rank of a group holds the same whole tokens (1d): each keeps its 1/n of them
  (`split_rows`) and the outputs are gathered back (`gather_rows`);
- the ranks of a group hold the same tokens' feature columns (2d's row, 3d's hidden group): one
  all-to-all trades columns for tokens (each rank gets 1/n of the tokens, whole) and one trades
  them back (`columns_to_tokens`, `tokens_to_columns`).
A token count the group does not divide is padded with zero tokens that the padding mask marks as
padding (the balancing statistics skip them) and that are dropped on the way back.
"""

from __future__ import annotations

import torch

from lattice.parallel import comm
from lattice.parallel.comm import group_rank, group_size


class _SplitRows(torch.autograd.Function):
    """Forward: Y = X_r, this rank's 1/n of the rows of a tensor every rank of the group holds
    whole. Backward: dX = [dY_0; ...; dY_{n-1}] (all-gather): the replicated X's gradient is the
    whole one on every rank."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.chunk(group_size(group), dim=0)[group_rank(group)].clone()

    @staticmethod
    def backward(ctx, dy):
        return comm.raw_all_gather(dy, ctx.group, 0), None


class _GatherRows(torch.autograd.Function):
    """Forward: Y = [X_0; ...; X_{n-1}] (all-gather), identical on every rank of the group.
    Backward: dX_r = (dY)_r: every rank differentiates the whole Y identically, so its own rows of
    dY are X_r's whole gradient."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return comm.raw_all_gather(x, group, 0)

    @staticmethod
    def backward(ctx, dy):
        return dy.chunk(group_size(ctx.group), dim=0)[group_rank(ctx.group)].clone(), None


def _padded(tokens: torch.Tensor, mask: torch.Tensor | None, n: int):
    """(tokens, mask, count) with zero tokens appended up to a multiple of n; the mask marks them as
    padding (and exists wherever there are any)."""
    count = tokens.shape[0]
    extra = -count % n
    if extra == 0:
        return tokens, mask, count
    tokens = torch.cat([tokens, tokens.new_zeros(extra, tokens.shape[1])])
    valid = torch.ones(count, dtype=torch.bool, device=tokens.device) if mask is None else mask
    return tokens, torch.cat([valid, valid.new_zeros(extra)]), count


def split_replicated(tokens: torch.Tensor, mask: torch.Tensor | None, group):
    """(this rank's 1/n of `tokens` (N, h), identical on every rank of `group`; their mask; back):
    back((N/n, h)) -> (N, h) on every rank."""
    n = group_size(group)
    if n == 1:
        return tokens, mask, lambda y: y
    tokens, mask, count = _padded(tokens, mask, n)
    mine = _SplitRows.apply(tokens, group)
    mask = None if mask is None else mask.chunk(n)[group_rank(group)]
    return mine, mask, lambda y: _GatherRows.apply(y, group)[:count]


def columns_to_tokens(columns: torch.Tensor, mask: torch.Tensor | None, then, group):
    """(whole tokens, 1/n of them, from `columns` (N, h/n), this rank's feature columns of the N
    tokens the ranks of `group` share, in group-rank order; their mask; back): back((N/n, h)) ->
    then((N, h/n)), the columns again (`then`: to the residual layout)."""
    n = group_size(group)
    if n == 1:
        return columns, mask, then
    columns, mask, count = _padded(columns, mask, n)
    mine = comm.all_to_all(columns, group, 0, 1)  # (N/n, h)
    mask = None if mask is None else mask.chunk(n)[group_rank(group)]
    return mine, mask, lambda y: then(comm.all_to_all(y, group, 1, 0)[:count])


def cost_columns_to_tokens(b, axes: tuple, q: int) -> float:
    """`columns_to_tokens` for the cost model (lattice.cost.builder, site "moe"): one all-to-all
    along the hidden group trades its columns of n tokens for n/q whole ones, one trades them back
    (after the layer's saves), and backward runs both inverses; returns the tokens routed here."""
    n = -(-round(b.residual * q / b.h) // q) * q  # the residual's tokens (h/q columns each), padded to q's multiple
    for phase, after in (("forward", False), ("forward", True), ("backward", False), ("backward", False)):
        b.add(phase, "all_to_all", axes, n * b.h / q, 1, "moe", after_saves=after)
    return n / q

