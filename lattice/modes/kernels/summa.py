"""SUMMA on a q x q mesh (Optimus, docs/references.md#optimus §2.4, Algorithms 1-3) as autograd operations.

Rank (i, j) holds block (i, j) of every matrix: rows block i, columns block j. "Row i" is the q
ranks (i, 0..q-1) -- the process group along `MeshAxis.COL`; "column j" is the q ranks
(0..q-1, j) -- the group along `MeshAxis.ROW`.

    form       step l = 0 .. q-1 on rank (i, j)                                 result C_ij
    C = A B    bcast A_il along row i, B_lj along column j; C_ij += A_il B_lj     Σ_l A_il B_lj
    C = A Bᵀ   bcast B_lj along column j; reduce A_ij B_ljᵀ along row i to (i, l)  Σ_l A_il B_jlᵀ
    C = Aᵀ B   bcast A_il along row i; reduce A_ilᵀ B_ij along column j to (l, j)  Σ_l A_liᵀ B_lj

The three forms are closed under differentiation (Eq. 1-3), so each backward is two SUMMA
products of the other forms. Per rank and per product, C = A B with A [M, K], B [K, N] moves
(M·K + K·N)/q elements forward and twice that backward (Table 1 counts the same, times the
log q depth of a tree broadcast).

The receive buffers of every broadcast and the partial products of every reduce come from one
`Workspace` (§3.2.3): products run one after another, so one region sized for the largest step
serves all of them, instead of fresh allocations at every step.
"""

from __future__ import annotations

import torch

from lattice.parallel.comm import raw_all_gather, raw_broadcast, raw_reduce, raw_reduce_scatter
from lattice.parallel.context import MeshAxis, ParallelContext


class Workspace:
    """One preallocated buffer per (dtype, device): [vector receive buffers | slot 0 | slot 1].

    `reserve` sets the sizes from the model's largest step before the first product; a request
    beyond them (a plan that was too small) grows the buffer, which `allocations` counts.
    """

    def __init__(self):
        self.recv_numel = 0
        self.step_numel = 0
        self.allocations = 0
        self._flat: dict = {}

    def reserve(self, recv_numel: int, step_numel: int) -> None:
        self.recv_numel = max(self.recv_numel, recv_numel)
        self.step_numel = max(self.step_numel, step_numel)

    def _buffer(self, dtype, device) -> torch.Tensor:
        need = self.recv_numel + self.step_numel
        flat = self._flat.get((dtype, device))
        if flat is None or flat.numel() < need:
            flat = torch.empty(need, dtype=dtype, device=device)
            self._flat[(dtype, device)] = flat
            self.allocations += 1
        return flat

    def receive(self, shape, dtype, device) -> torch.Tensor:
        """A receive buffer for `lattice.parallel.comm.broadcast` on a non-source rank. It requires grad so
        that the backward reduce runs on every rank; broadcast copies it, so it is never written."""
        numel = int(torch.Size(shape).numel())
        self.reserve(numel, 0)
        return self._buffer(dtype, device)[:numel].view(shape).detach().requires_grad_()

    def pair(self, n0: int, n1: int, dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
        """Two disjoint flat buffers of one SUMMA step (a broadcast block and a second block)."""
        self.reserve(0, n0 + n1)
        flat = self._buffer(dtype, device)
        start = self.recv_numel
        return flat[start:start + n0], flat[start + n0:start + n0 + n1]


class SummaGrid:
    """This rank's place on its replica's q x q mesh, the row / column groups, and the workspace.

    Groups are looked up on first use, so a model can be built from a planning context.
    """

    def __init__(self, ctx: ParallelContext, replicated_vectors: bool = False, gathered: bool = False,
                 keep: bool = False):
        self.ctx = ctx
        self.replicated = replicated_vectors  # row-0 vectors on every row instead (Summa2D's option vectors)
        self.gathered = gathered  # the products' all-gather form (Summa2D's option summa="all_gather")
        # C = A B in the all-gather form saves the gathered A_i· and B_·j for backward (Summa2D's
        # option keep_gathered)
        self.keep = keep
        if keep and not gathered:
            raise ValueError("keep applies to the all-gather form (gathered=True)")
        self.q = ctx.size(MeshAxis.ROW)
        self.i = ctx.coord(MeshAxis.ROW)
        self.j = ctx.coord(MeshAxis.COL)
        self.workspace = Workspace()
        self._groups = None

    def _setup(self):
        # group rank k is mesh coordinate k: Topology only accepts placements increasing along
        # every axis, and torch orders group members by global rank
        self._groups = (self.ctx.group(MeshAxis.COL), self.ctx.group(MeshAxis.ROW))

    @property
    def row(self):
        """The group of ranks (i, 0..q-1); group rank = column coordinate."""
        if self._groups is None:
            self._setup()
        return self._groups[0]

    @property
    def col(self):
        """The group of ranks (0..q-1, j); group rank = row coordinate."""
        if self._groups is None:
            self._setup()
        return self._groups[1]

    def bcast_row(self, block: torch.Tensor, l: int, buf: torch.Tensor) -> torch.Tensor:
        """Block (i, l) on every rank of row i: rank (i, l) sends its own, the others receive."""
        return raw_broadcast(block if self.j == l else buf.view(block.shape), self.row, l)

    def bcast_col(self, block: torch.Tensor, l: int, buf: torch.Tensor) -> torch.Tensor:
        """Block (l, j) on every rank of column j."""
        return raw_broadcast(block if self.i == l else buf.view(block.shape), self.col, l)


# ----------------------------------------------------------------------------- Algorithms 1-3


# The all-gather form (g.gathered) runs each algorithm's q broadcasts of a block as one all-gather
# of the q blocks and its q reduces as one reduce-scatter of the q partial products, with one
# matrix product between: the same elements move, in two collectives instead of 2q, and the
# gathered operand (q blocks) lives until the product is done.


def summa_ab_raw(a: torch.Tensor, b: torch.Tensor, g: SummaGrid) -> torch.Tensor:
    """Algorithm 1. a = A_ij (m, k), b = B_ij (k, n) -> C_ij (m, n) = Σ_l A_il B_lj. Gathered:
    [A_i0 .. A_i,q-1] (the row's blocks side by side) times [B_0j; ..; B_q-1,j] (the column's)."""
    a, b = a.contiguous(), b.contiguous()
    if g.gathered:
        return _gathered_ab(a, b, g)[0]
    a_buf, b_buf = g.workspace.pair(a.numel(), b.numel(), a.dtype, a.device)
    c = torch.empty(a.shape[0], b.shape[1], dtype=a.dtype, device=a.device)
    for l in range(g.q):
        a_l = g.bcast_row(a, l, a_buf)
        b_l = g.bcast_col(b, l, b_buf)
        # (into C in place: selective checkpointing keeps what a product returns, never a sum still growing)
        torch.mm(a_l, b_l, out=c) if l == 0 else c.addmm_(a_l, b_l)
    return c


def summa_abt_raw(a: torch.Tensor, b: torch.Tensor, g: SummaGrid) -> torch.Tensor:
    """Algorithm 2. a = A_ij (m, n), b = B_ij (k, n) -> C_ij (m, k) = Σ_l A_il B_jlᵀ. Gathered:
    A_ij [B_0j; ..; B_q-1,j]ᵀ holds rank (i, l)'s term of every l, reduce-scattered along the row."""
    a, b = a.contiguous(), b.contiguous()
    if g.gathered:
        return raw_reduce_scatter(torch.mm(a, raw_all_gather(b, g.col, 0).t()), g.row, 1)
    m, k = a.shape[0], b.shape[0]
    b_buf, t_buf = g.workspace.pair(b.numel(), m * k, a.dtype, a.device)
    c = torch.empty(m, k, dtype=a.dtype, device=a.device)
    for l in range(g.q):
        b_l = g.bcast_col(b, l, b_buf)
        part = c if g.j == l else t_buf.view(m, k)  # the destination reduces straight into C
        torch.mm(a, b_l.t(), out=part)
        raw_reduce(part, g.row, l)
    return c


def summa_atb_raw(a: torch.Tensor, b: torch.Tensor, g: SummaGrid) -> torch.Tensor:
    """Algorithm 3. a = A_ij (m, k), b = B_ij (m, n) -> C_ij (k, n) = Σ_l A_liᵀ B_lj. Gathered:
    [A_i0 .. A_i,q-1]ᵀ B_ij holds rank (l, j)'s term of every l, reduce-scattered down the column."""
    a, b = a.contiguous(), b.contiguous()
    if g.gathered:
        return raw_reduce_scatter(torch.mm(raw_all_gather(a, g.row, 1).t(), b), g.col, 0)
    k, n = a.shape[1], b.shape[1]
    a_buf, t_buf = g.workspace.pair(a.numel(), k * n, a.dtype, a.device)
    c = torch.empty(k, n, dtype=a.dtype, device=a.device)
    for l in range(g.q):
        a_l = g.bcast_row(a, l, a_buf)
        part = c if g.i == l else t_buf.view(k, n)
        torch.mm(a_l.t(), b, out=part)
        raw_reduce(part, g.col, l)
    return c


def _gathered_ab(a: torch.Tensor, b: torch.Tensor, g: SummaGrid):
    """Algorithm 1 in the all-gather form, with what it gathered: (C_ij, A_i·, B_·j)."""
    A, B = raw_all_gather(a.contiguous(), g.row, 1), raw_all_gather(b.contiguous(), g.col, 0)
    return torch.mm(A, B), A, B


def _kept_ab_grads(dc: torch.Tensor, A: torch.Tensor, B: torch.Tensor, g: SummaGrid, need_a: bool, need_b: bool):
    """C = A B's gradients from forward's gathered A_i· and B_·j, without gathering them again:
    dA = dC_ij B_·jᵀ holds rank (i, l)'s term of every l, reduce-scattered along the row (Alg. 2's
    all-gather form); dB = A_i·ᵀ dC_ij, rank (l, j)'s, reduce-scattered down the column (Alg. 3's).
    One reduce-scatter each, in the order every rank runs them (A's first)."""
    da = raw_reduce_scatter(torch.mm(dc, B.t()), g.row, 1) if need_a else None
    db = raw_reduce_scatter(torch.mm(A.t(), dc), g.col, 0) if need_b else None
    return da, db


# Each form's backward is two products of the other forms (Eq. 1-3), listed as (form, first
# operand, second operand) over the names a, b (the forward's operands) and dc (C's gradient):
#   C = A B:   dA = dC Bᵀ,  dB = Aᵀ dC
#   C = A Bᵀ:  dA = dC B,   dB = dCᵀ A
#   C = Aᵀ B:  dA = B dCᵀ,  dB = A dC
_FORWARD = {"ab": summa_ab_raw, "abt": summa_abt_raw, "atb": summa_atb_raw}
_BACKWARD = {"ab": (("abt", "dc", "b"), ("atb", "a", "dc")),
             "abt": (("ab", "dc", "b"), ("atb", "dc", "a")),
             "atb": (("abt", "b", "dc"), ("ab", "a", "dc"))}


class _Summa(torch.autograd.Function):
    """One SUMMA product of the given form, its backward from the table above. Backward passes
    run the same products on every rank in the same order (A's gradient first), which the
    collectives inside them require; `needs_input_grad` is the same on every rank because every
    rank holds a block of each operand."""

    @staticmethod
    def forward(ctx, form, a, b, grid):
        ctx.form, ctx.grid = form, grid
        ctx.kept = form == "ab" and grid.keep
        if ctx.kept:
            c, A, B = _gathered_ab(a, b, grid)
            ctx.save_for_backward(A, B)
            return c
        ctx.save_for_backward(a, b)
        return _FORWARD[form](a, b, grid)

    @staticmethod
    def backward(ctx, dc):
        if ctx.kept:
            return None, *_kept_ab_grads(dc, *ctx.saved_tensors, ctx.grid, *ctx.needs_input_grad[1:3]), None
        a, b = ctx.saved_tensors
        operands = {"a": a, "b": b, "dc": dc}
        grads = [_FORWARD[form](operands[x], operands[y], ctx.grid) if ctx.needs_input_grad[k + 1] else None
                 for k, (form, x, y) in enumerate(_BACKWARD[ctx.form])]
        return None, *grads, None


class _SummaSegments(torch.autograd.Function):
    """C = A [B_1 | B_2 | ...] (Alg. 1) with the segments' blocks side by side (SUMMA's columns
    are independent), saving the segments rather than a copy of their concatenation. Backward:
    dA = dC [B_1 | ...]ᵀ (Alg. 2), dB_i = the columns of Aᵀ dC (Alg. 3) that are segment i's."""

    @staticmethod
    def forward(ctx, a, grid, *bs):
        ctx.grid, ctx.widths = grid, [b.shape[-1] for b in bs]
        if grid.keep:  # the gathered operands instead (the segments' columns side by side in B_·j)
            c, A, B = _gathered_ab(a, torch.cat(bs, dim=-1), grid)
            ctx.save_for_backward(A, B)
            return c
        ctx.save_for_backward(a, *bs)
        return summa_ab_raw(a, torch.cat(bs, dim=-1), grid)

    @staticmethod
    def backward(ctx, dc):
        if ctx.grid.keep:
            da, db = _kept_ab_grads(dc, *ctx.saved_tensors, ctx.grid, ctx.needs_input_grad[0], True)
            return da, None, *db.split(ctx.widths, dim=-1)
        a, *bs = ctx.saved_tensors
        da = summa_abt_raw(dc, torch.cat(bs, dim=-1), ctx.grid) if ctx.needs_input_grad[0] else None
        db = summa_atb_raw(a, dc, ctx.grid)
        return da, None, *db.split([b.shape[-1] for b in bs], dim=-1)


def _autocast(a: torch.Tensor, b: torch.Tensor):
    """Under autocast a product runs in the autocast dtype, as torch.mm would (the casts stay
    outside the Function, so their backward returns gradients in the operands' dtypes)."""
    device = a.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        return a.to(dtype), b.to(dtype)
    return a, b


def summa_ab(a: torch.Tensor, b, grid: SummaGrid) -> torch.Tensor:
    """C = A B (Alg. 1). Backward (Eq. 1): dA = dC Bᵀ (Alg. 2), dB = Aᵀ dC (Alg. 3). `b` may be a
    tuple of column segments (see _SummaSegments)."""
    if isinstance(b, tuple):
        device = a.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else a.dtype
        return _SummaSegments.apply(a.to(dtype), grid, *(x.to(dtype) for x in b))
    return _Summa.apply("ab", *_autocast(a, b), grid)


def summa_abt(a: torch.Tensor, b: torch.Tensor, grid: SummaGrid) -> torch.Tensor:
    """C = A Bᵀ (Alg. 2). Backward (Eq. 3): dA = dC B (Alg. 1), dB = dCᵀ A (Alg. 3)."""
    return _Summa.apply("abt", *_autocast(a, b), grid)


def summa_atb(a: torch.Tensor, b: torch.Tensor, grid: SummaGrid) -> torch.Tensor:
    """C = Aᵀ B (Alg. 3). Backward (Eq. 2): dA = B dCᵀ (Alg. 2), dB = A dC (Alg. 1)."""
    return _Summa.apply("atb", *_autocast(a, b), grid)


class SummaEmbed(torch.autograd.Function):
    """x = onehot(tokens) E as SUMMA C = A B with A = onehot [B·T, V] never built: row i holds
    the tokens of batch block i, so A_il is local. Step l: bcast E_lj along column j; tokens in
    vocab block l take their rows. Backward dE = Aᵀ dx (Alg. 3): scatter-add dx rows into block
    l, reduce along column j to (l, j)."""

    @staticmethod
    def forward(ctx, table, ids, grid):  # table (V_pad/q, h/q), ids (m,) -> (m, h/q)
        ctx.grid = grid
        table = table.contiguous()
        vb = table.shape[0]
        buf, _ = grid.workspace.pair(table.numel(), 0, table.dtype, table.device)
        out = torch.zeros(ids.shape[0], table.shape[1], dtype=table.dtype, device=table.device)
        for l in range(grid.q):
            block = grid.bcast_col(table, l, buf)
            local = ids - l * vb
            hit = ((local >= 0) & (local < vb)).unsqueeze(1)
            # a select, not a masked copy: exact, and no host sync on GPU
            out = torch.where(hit, block[local.clamp(0, vb - 1)], out)
        ctx.save_for_backward(ids)
        ctx.table_shape = table.shape
        return out

    @staticmethod
    def backward(ctx, dx):
        (ids,) = ctx.saved_tensors
        grid, (vb, hq) = ctx.grid, ctx.table_shape
        _, buf = grid.workspace.pair(0, vb * hq, dx.dtype, dx.device)
        dtable = torch.empty(vb, hq, dtype=dx.dtype, device=dx.device)
        for l in range(grid.q):
            part = dtable if grid.i == l else buf.view(vb, hq)
            part.zero_()
            local = ids - l * vb
            hit = ((local >= 0) & (local < vb)).unsqueeze(1)
            part.index_add_(0, local.clamp(0, vb - 1), torch.where(hit, dx, 0.0))  # misses add exact zeros
            raw_reduce(part, grid.col, l)
        return dtable, None, None
