"""SUPER's sub-graph collectives (docs/references.md#super, §III-IV): `Segments`, a rank's place
in the sub-grids and the split, sum, slice and concatenation at a branch's edges, and the
segmented collectives of D&SP-cSub, where group rank 0 holds the activation (sub-grid 0) and the
other ranks pass and receive empty (0, ...) tensors. Inputs of idle ranks require grad so that
the backward collective runs on every rank. Each is a forward/backward pair, metered as every
collective of lattice.parallel.comm."""

from __future__ import annotations

import torch

from lattice.parallel import comm
from lattice.parallel.comm import group_rank, group_size, raw_broadcast, raw_gather, raw_reduce, raw_scatter
from lattice.parallel.context import MeshAxis


class SegmentedBroadcast(torch.autograd.Function):
    """Forward: Y = X_0 on every rank of the group (broadcast). Backward: dX_0 = Σ_ranks dY
    (reduce to rank 0); the others' (empty) inputs get empty gradients."""

    @staticmethod
    def forward(ctx, x, shape, group):
        ctx.group, ctx.empty = group, x.shape
        out = x.clone() if group_rank(group) == 0 else x.new_empty(shape)
        return raw_broadcast(out, group, 0)

    @staticmethod
    def backward(ctx, dy):
        total = raw_reduce(dy.clone(), ctx.group, 0)
        return (total if group_rank(ctx.group) == 0 else dy.new_zeros(ctx.empty)), None, None


class SegmentedReduce(torch.autograd.Function):
    """Forward: Y_0 = Σ_ranks X on rank 0 (reduce); the others return empty. Backward: dX = dY_0
    on every rank (broadcast)."""

    @staticmethod
    def forward(ctx, y, group):
        ctx.group, ctx.shape = group, y.shape
        total = raw_reduce(y.clone(), group, 0)
        return total if group_rank(group) == 0 else total[:0].clone()

    @staticmethod
    def backward(ctx, dy):
        grad = dy.contiguous() if group_rank(ctx.group) == 0 else dy.new_empty(ctx.shape)
        return raw_broadcast(grad, ctx.group, 0), None


class SegmentedScatter(torch.autograd.Function):
    """Forward: rank 0's X cut along the last dim, piece k to rank k (scatter). Backward: the
    pieces of dY gathered back to rank 0 (gather)."""

    @staticmethod
    def forward(ctx, x, shape, group):
        ctx.group, ctx.empty = group, x.shape
        n = group_size(group)
        chunks = list(x.chunk(n, dim=-1)) if group_rank(group) == 0 else None
        return raw_scatter(chunks, x.new_empty(shape), group, 0)

    @staticmethod
    def backward(ctx, dy):
        parts = raw_gather(dy, ctx.group, 0)
        return (torch.cat(parts, dim=-1) if parts is not None else dy.new_zeros(ctx.empty)), None, None


class SegmentedGather(torch.autograd.Function):
    """Forward: every rank's Y joined along the last dim on rank 0 (gather); the others return
    empty. Backward: rank 0's dY cut along the last dim, piece k to rank k (scatter)."""

    @staticmethod
    def forward(ctx, y, group):
        ctx.group, ctx.shape = group, y.shape
        parts = raw_gather(y, group, 0)
        if parts is None:
            return y.new_empty((0,) + tuple(y.shape[1:-1]) + (y.shape[-1] * group_size(group),))
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, dy):
        n = group_size(ctx.group)
        chunks = list(dy.chunk(n, dim=-1)) if group_rank(ctx.group) == 0 else None
        return raw_scatter(chunks, dy.new_empty(ctx.shape), ctx.group, 0), None


SUB, MEM = MeshAxis.SUBGRID, MeshAxis.MEMBER


class Segments:
    """This rank's place in the sub-grids, its rows of the replica batch, and the segmented
    collectives over its cross-sub-grid group (along SUBGRID; group rank = k). `batch`: the step's
    replica batch (SubGraph.begin_batch), which sizes what an idle rank of D&SP-cSub receives."""

    def __init__(self, mode):
        self.ctx = mode.ctx
        self.g, self.n_g = mode.g, mode.n_g
        self.k, self.m = self.ctx.coord(SUB), self.ctx.coord(MEM)
        self.common_all = mode.common_all
        self.by_all_gather = mode.slice_collective == "all_gather"
        self.runs_common = self.common_all or self.k == 0
        self.batch = 0

    @property
    def cross(self):
        return self.ctx.group(SUB)  # looked up at call time: a planning context has no groups

    def common_rows(self, batch: int, k: int | None = None, m: int | None = None) -> slice:
        """Rows of the replica batch that the common layers of rank (k, m) process (this rank's
        by default; empty on idle ranks)."""
        k, m = (self.k if k is None else k), (self.m if m is None else m)
        if self.common_all:
            rows = batch // (self.g * self.n_g)
            start = (m * self.g + k) * rows
        else:
            rows = batch // self.n_g if k == 0 else 0
            start = m * (batch // self.n_g)
        return slice(start, start + rows)

    def branch_rows(self, batch: int) -> int:
        return batch // self.n_g

    # ---- split and sum: (common rows, T, h) <-> (B/n_g, T, h)
    def split(self, x: torch.Tensor) -> torch.Tensor:
        """Copy the common activation into every branch: member m of each sub-grid gets its
        B/n_g sequences."""
        if self.common_all:  # rows m·g+k of every k, concatenated in k order: B/n_g rows
            return comm.all_gather(x, self.cross, 0)
        return SegmentedBroadcast.apply(x, (self.branch_rows(self.batch),) + tuple(x.shape[1:]), self.cross)

    def sum(self, y: torch.Tensor) -> torch.Tensor:
        """Add the branches' partial outputs and return each common rank its rows."""
        if self.common_all:
            return comm.reduce_scatter(y, self.cross, 0)
        return SegmentedReduce.apply(y, self.cross)

    # ---- slice and concat: heads leave / join the last dim
    def slice(self, x: torch.Tensor) -> torch.Tensor:
        """(common rows, T, .., h) -> (B/n_g, T, .., h/g): sub-grid k keeps head block k."""
        width = x.shape[-1] // self.g
        if self.common_all and not self.by_all_gather:
            return comm.all_to_all(x, self.cross, -1, 0)
        if self.common_all:
            full = comm.all_gather(x, self.cross, 0)
        elif not self.by_all_gather:
            shape = (self.branch_rows(self.batch),) + tuple(x.shape[1:-1]) + (width,)
            return SegmentedScatter.apply(x, shape, self.cross)
        else:
            full = SegmentedBroadcast.apply(x, (self.branch_rows(self.batch),) + tuple(x.shape[1:]), self.cross)
        return full.narrow(-1, self.k * width, width)

    def concat(self, y: torch.Tensor) -> torch.Tensor:
        """(B/n_g, T, h/g) of head block k -> (common rows, T, h) with every head."""
        if self.common_all and not self.by_all_gather:
            return comm.all_to_all(y, self.cross, 0, -1)
        if not self.common_all and not self.by_all_gather:
            return SegmentedGather.apply(y, self.cross)
        full = comm.all_gather(y, self.cross, y.dim() - 1)  # (B/n_g, T, h) on every rank
        if self.common_all:
            rows = y.shape[0] // self.g
            return full.narrow(0, self.k * rows, rows)
        return full if self.k == 0 else full[:0]
