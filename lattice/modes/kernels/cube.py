"""The 3D product on a q x q x q cube (docs/references.md#3d) as an autograd operation:
Y = X W with X, W and Y each stored once over the cube (1/p per rank), the inputs all-gathered
and the product reduce-scattered along three different axes. lattice.modes.cube3d lays every
linear layer, the embedding and the LM head out with it, as lattice.modes.kernels.summa holds SUMMA for 2D.
"""

from __future__ import annotations

import torch

from lattice.modes.kernels.layers import compute_dtype
from lattice.parallel import comm
from lattice.parallel.context import MeshAxis

CI, CJ, CL = MeshAxis.CUBE_I, MeshAxis.CUBE_J, MeshAxis.CUBE_L


def _autocast_pair(x, ws):
    """Under autocast the product runs in the autocast dtype, as torch.mm would; the casts stay
    outside the Function so that their backward returns gradients in the operands' dtypes."""
    dtype = compute_dtype(x)
    return x.to(dtype), tuple(w.to(dtype) for w in ws)


class _Linear3D(torch.autograd.Function):
    """y = x W (or x Wᵀ with transpose_w) on the cube. Forward: X = all-gather(x, gx),
    W = all-gather(w, gw), Y_partial = X W, y = reduce-scatter(Y_partial, gy). Backward:
    dY = all-gather(dy, gy); dx = reduce-scatter(dY Wᵀ, gx) (with overlap, started before Xᵀ dY is
    computed and awaited last); dw = reduce-scatter(Xᵀ dY, gw), with X
    and W gathered again rather than saved, or with `keep` the X and W forward gathered (q times
    the pieces' memory until backward, two all-gathers fewer). All gathers and scatters are along
    dim 0 (rows).

    W may be given as segments W = [W_1 | W_2 | ...] (columns): they are concatenated for the
    product and again in backward, where dW is cut back into them, so that what is saved is
    the segments themselves, not a copy of their concatenation."""

    @staticmethod
    def forward(ctx, x, gx, gw, gy, transpose_w, overlap, keep, *ws):
        ctx.groups, ctx.transpose_w, ctx.overlap, ctx.keep = (gx, gw, gy), transpose_w, overlap, keep
        ctx.widths = [w.shape[-1] for w in ws]
        w = torch.cat(ws, dim=-1) if len(ws) > 1 else ws[0]
        W, work = comm.start_all_gather(w, gw) if overlap else (comm.raw_all_gather(w, gw, 0), None)
        X = comm.raw_all_gather(x, gx, 0)  # while W's gather runs, with overlap
        if work is not None:
            work.wait()
        ctx.save_for_backward(*((X, W) if keep else (x, *ws)))
        return comm.raw_reduce_scatter(X @ (W.t() if transpose_w else W), gy, 0)

    @staticmethod
    def backward(ctx, dy):
        gx, gw, gy = ctx.groups
        if ctx.keep:
            X, W = ctx.saved_tensors
            dY = comm.raw_all_gather(dy.contiguous(), gy, 0)
        else:
            x, *ws = ctx.saved_tensors
            w = torch.cat(ws, dim=-1) if len(ws) > 1 else ws[0]
            W, work = comm.start_all_gather(w, gw) if ctx.overlap else (comm.raw_all_gather(w, gw, 0), None)
            dY = comm.raw_all_gather(dy.contiguous(), gy, 0)
            X = comm.raw_all_gather(x, gx, 0)
            if work is not None:
                work.wait()
        Wm = W.t() if ctx.transpose_w else W
        dX = dY @ Wm.t()
        # with overlap, dX's reduce-scatter runs while the weight gradient's product does
        dx, work = comm.start_reduce_scatter(dX, gx) if ctx.overlap else (comm.raw_reduce_scatter(dX, gx, 0), None)
        dWm = X.t() @ dY
        dw = comm.raw_reduce_scatter((dWm.t() if ctx.transpose_w else dWm).contiguous(), gw, 0)
        if work is not None:
            work.wait()
        return dx, None, None, None, None, None, None, *dw.split(ctx.widths, dim=-1)


def linear_3d(x2d, w2d, gx, gw, gy, transpose_w=False, overlap=True, keep=False):
    """y = x W on the cube (see _Linear3D); `w2d` a tensor or a tuple of column segments; `keep`:
    save forward's gathered X and W for backward instead of gathering them again."""
    x, ws = _autocast_pair(x2d, w2d if isinstance(w2d, tuple) else (w2d,))
    return _Linear3D.apply(x, gx, gw, gy, transpose_w, overlap, keep, *ws)


class CubeEmbed(torch.autograd.Function):
    """x = onehot(tokens) E as the 3D product with the swapped roles (output in the residual
    layout): the table piece (V/q², h/q) is all-gathered along i to vocabulary block j; the rows of
    block i look up their tokens that fall in block j (the one-hot X_ij is local: every rank has
    the tokens); the partial rows are reduce-scattered along j -> piece j of row block i.
    Backward: dY all-gathered along j, scatter-added into the block's rows, reduce-scattered
    along i to the piece."""

    @staticmethod
    def forward(ctx, table, ids, vocab_start, groups):  # table (V/q², h/q), ids (M/q,) -> (M/q², h/q)
        gi, gj = groups
        block = comm.raw_all_gather(table.contiguous(), gi, 0)  # (V/q, h/q): vocabulary block j
        local = ids - vocab_start
        hit = ((local >= 0) & (local < block.shape[0])).unsqueeze(1)
        rows = torch.where(hit, block[local.clamp(0, block.shape[0] - 1)], 0.0)
        ctx.save_for_backward(ids)
        ctx.vocab_start, ctx.groups, ctx.block_rows = vocab_start, groups, block.shape[0]
        return comm.raw_reduce_scatter(rows, gj, 0)

    @staticmethod
    def backward(ctx, dy):
        (ids,) = ctx.saved_tensors
        gi, gj = ctx.groups
        dY = comm.raw_all_gather(dy.contiguous(), gj, 0)  # (M/q, h/q)
        local = ids - ctx.vocab_start
        hit = ((local >= 0) & (local < ctx.block_rows)).unsqueeze(1)
        dblock = dY.new_zeros(ctx.block_rows, dY.shape[1])
        dblock.index_add_(0, local.clamp(0, ctx.block_rows - 1), torch.where(hit, dY, 0.0))
        return comm.raw_reduce_scatter(dblock, gi, 0), None, None, None


class Cube:
    """This rank's coordinates and the groups of the cube (looked up at call time, so that a
    planning context can build the model)."""

    def __init__(self, ctx):
        self.ctx = ctx
        self.q = ctx.size(CI)
        self.replicated = ctx.options["vectors"] == "replicated"
        self.i, self.j, self.l = ctx.coord(CI), ctx.coord(CJ), ctx.coord(CL)

    def group(self, *axes):
        return self.ctx.group(*axes)

    def plane_root(self, axes) -> int:
        """Group rank, in the group over `axes`, of the member whose coordinates on them are 0."""
        topo = self.ctx.topology
        members = topo.group_members(axes, self.ctx.rank)
        return members.index(topo.rank_at({**self.ctx.coords, **{a: 0 for a in axes}}))


def hosted(param, shape, cube: Cube, plane, dtype, device) -> torch.Tensor:
    """A vector block stored once per plane (on its member with both plane coordinates 0) on every
    rank of the plane. Forward: broadcast; backward: the plane's gradients reduced to the holder.
    With vectors="replicated" every rank of the plane holds it (its gradient is summed over the
    plane with the other in-replica sums, after backward): no collective here."""
    if cube.replicated:
        return param.to(dtype)
    # without the parameter: a receive buffer that requires grad, so that the backward reduce runs here too
    src = param.to(dtype) if param is not None else torch.empty(shape, dtype=dtype, device=device).requires_grad_()
    return comm.broadcast(src, cube.group(*plane), cube.plane_root(plane))
