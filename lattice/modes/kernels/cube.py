"""The 3D product on a q x q x q cube (papers/004; DESIGN.md "3D") as an autograd operation:
Y = X W with X, W and Y each stored once over the cube (1/p per rank), the inputs all-gathered
and the product reduce-scattered along three different axes. lattice.modes.cube3d lays every
linear layer, the embedding and the LM head out with it, as lattice.modes.kernels.summa holds SUMMA for 2D.
"""

from __future__ import annotations

import torch

from lattice.modes.kernels.layers import compute_dtype
from lattice.parallel import comm


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
