"""Autograd-aware collectives. Each takes its process group explicitly and reports to CommMeter.

Every function here is a forward/backward pair; the docstrings give the pair in the papers'
notation. With a group of one rank (group is None) each is the identity and sends nothing.

What CommMeter counts, per call on this rank: `elements` is the size of the logical buffer the
collective works on -- the tensor for all-reduce / broadcast / reduce / all-to-all, the gathered
output for all-gather, the full input for reduce-scatter -- and `bytes = elements * itemsize`.
The analytic model in `lattice.cost` counts in the same unit.
"""

from __future__ import annotations

import threading
from collections import Counter, defaultdict
from dataclasses import dataclass

import torch
import torch.distributed as dist

# ----------------------------------------------------------------------------- metering


@dataclass(frozen=True)
class CommRecord:
    op: str
    group_size: int
    elements: int
    bytes: int
    phase: str  # "forward" or "backward" (autograd backward) or "other" (outside autograd)


_active_meters = threading.local()


def _meters() -> list:
    if not hasattr(_active_meters, "stack"):
        _active_meters.stack = []
    return _active_meters.stack


class CommMeter:
    """Records every collective issued through lattice.parallel.comm while active.

        with lattice.CommMeter() as meter:
            loss = model(x, y); loss.backward()
        meter.total_bytes(), meter.summary()
    """

    def __init__(self):
        self.records: list[CommRecord] = []

    def __enter__(self):
        _meters().append(self)
        return self

    def __exit__(self, *exc):
        _meters().remove(self)
        return False

    def total_bytes(self, op: str | None = None, phase: str | None = None) -> int:
        return sum(r.bytes for r in self.records
                   if (op is None or r.op == op) and (phase is None or r.phase == phase))

    def total_elements(self, op: str | None = None, phase: str | None = None) -> int:
        return sum(r.elements for r in self.records
                   if (op is None or r.op == op) and (phase is None or r.phase == phase))

    def count(self, op: str | None = None, phase: str | None = None) -> int:
        return sum(1 for r in self.records
                   if (op is None or r.op == op) and (phase is None or r.phase == phase))

    def summary(self) -> dict[tuple[str, str, int], dict[str, int]]:
        """{(phase, op, group_size): {"calls", "elements", "bytes"}}"""
        out: dict = defaultdict(Counter)
        for r in self.records:
            key = (r.phase, r.op, r.group_size)
            out[key]["calls"] += 1
            out[key]["elements"] += r.elements
            out[key]["bytes"] += r.bytes
        return {k: dict(v) for k, v in out.items()}

    def reset(self):
        self.records.clear()


#: the last collective this process entered, for the message of a timed-out run (diagnostics only)
last_collective: dict = {}


def record(op: str, group, elements: int, dtype: torch.dtype, phase: str | None = None):
    """Report one collective to every active CommMeter (also used by DDP's comm hook)."""
    last_collective.update(op=op, group_size=group_size(group), elements=int(elements))
    stack = _meters()
    if not stack:
        return
    if phase is None:
        phase = "backward" if torch._C._current_graph_task_id() != -1 else "forward"
    itemsize = torch.empty((), dtype=dtype).element_size()
    rec = CommRecord(op, group_size(group), int(elements), int(elements) * itemsize, phase)
    for meter in stack:
        meter.records.append(rec)


def group_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group) -> int:
    return 0 if group is None else dist.get_rank(group)


# ----------------------------------------------------------------------------- raw collectives

# torch renamed the tensor forms of these collectives; use whichever this version has
unmetered_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_native_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class _SummedPieces:
    """The Work of a reduce-scatter run as an all-to-all: wait() awaits the exchange, then sums
    the n pieces received (every rank's piece of this rank's chunk) into the output."""

    def __init__(self, work, pieces: torch.Tensor, out: torch.Tensor):
        self.work, self.pieces, self.out = work, pieces, out

    def wait(self) -> bool:
        if self.work is not None:
            self.work.wait()
        torch.sum(self.pieces.view(-1, *self.out.shape), 0, out=self.out)
        return True


def unmetered_reduce_scatter(out: torch.Tensor, x: torch.Tensor, group=None, async_op: bool = False):
    """`dist.reduce_scatter_tensor(out, x)`, except on gloo, whose reduce-scatter clones x,
    all-reduces all of it and keeps one chunk: twice the bytes a reduce-scatter needs. There the
    chunks are exchanged by one all-to-all ((n-1)/n of x out and in, as a ring's reduce-scatter)
    and each rank sums the n pieces of its own chunk, in rank order."""
    if dist.get_backend(group) != "gloo":
        return _native_reduce_scatter(out, x, group=group, async_op=async_op)
    pieces = torch.empty_like(x)
    summed = _SummedPieces(dist.all_to_all_single(pieces, x, group=group, async_op=async_op), pieces, out)
    if async_op:
        return summed
    summed.wait()
    return None


# Plain (non-autograd) collectives that meter themselves; the autograd Functions below use them.


def raw_all_reduce(x: torch.Tensor, group, op=dist.ReduceOp.SUM, phase: str | None = None) -> torch.Tensor:
    """`phase` overrides the meter's phase (e.g. gradient sums run after autograd's backward)."""
    if group is None:
        return x
    x = x.contiguous()
    record("all_reduce", group, x.numel(), x.dtype, phase=phase)
    dist.all_reduce(x, op=op, group=group)
    return x


def raw_all_gather(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    """Concatenate every rank's x along dim, in group-rank order."""
    n = group_size(group)
    if n == 1:
        return x
    moved = x.movedim(dim, 0).contiguous()
    out = torch.empty((n * moved.shape[0],) + moved.shape[1:], dtype=x.dtype, device=x.device)
    record("all_gather", group, out.numel(), x.dtype)
    unmetered_all_gather(out, moved, group=group)
    return out.movedim(0, dim)


def start_all_gather(x: torch.Tensor, group):
    """raw_all_gather along dim 0, started asynchronously so that other work can run meanwhile;
    returns (output, work): call `work.wait()` (work is None for one rank) before using output."""
    n = group_size(group)
    if n == 1:
        return x, None
    x = x.contiguous()
    out = torch.empty((n * x.shape[0],) + x.shape[1:], dtype=x.dtype, device=x.device)
    record("all_gather", group, out.numel(), x.dtype)
    return out, unmetered_all_gather(out, x, group=group, async_op=True)


def raw_reduce_scatter(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    """Sum x over the group and keep this rank's chunk along dim."""
    n = group_size(group)
    if n == 1:
        return x
    if x.shape[dim] % n:
        raise ValueError(f"reduce-scatter: dim {dim} of size {x.shape[dim]} does not divide by {n} ranks")
    moved = x.movedim(dim, 0).contiguous()
    out = torch.empty((moved.shape[0] // n,) + moved.shape[1:], dtype=x.dtype, device=x.device)
    record("reduce_scatter", group, moved.numel(), x.dtype)
    unmetered_reduce_scatter(out, moved, group=group)
    out = out.movedim(0, dim)
    # scattered along the last dim, the chunk's rows are strided: elementwise kernels on such a
    # view ran up to 8x slower on this CPU (GELU's backward of a 2d MLP block) than on a copy
    return out.contiguous() if x.dim() > 1 and dim % x.dim() == x.dim() - 1 else out


def start_all_reduce(x: torch.Tensor, group):
    """raw_all_reduce (a sum, in place on a contiguous x), started asynchronously; returns (x, work):
    call `work.wait()` (work is None without a group) before using x."""
    if group is None:
        return x, None
    x = x.contiguous()
    record("all_reduce", group, x.numel(), x.dtype)
    return x, dist.all_reduce(x, group=group, async_op=True)


def start_reduce_scatter(x: torch.Tensor, group):
    """raw_reduce_scatter along dim 0, started asynchronously so that other work can run
    meanwhile; returns (output, work): call `work.wait()` (work is None for one rank) before
    using output, and leave x alone until then."""
    n = group_size(group)
    if n == 1:
        return x, None
    if x.shape[0] % n:
        raise ValueError(f"reduce-scatter: dim 0 of size {x.shape[0]} does not divide by {n} ranks")
    x = x.contiguous()
    out = torch.empty((x.shape[0] // n,) + x.shape[1:], dtype=x.dtype, device=x.device)
    record("reduce_scatter", group, x.numel(), x.dtype)
    return out, unmetered_reduce_scatter(out, x, group=group, async_op=True)


def raw_broadcast(x: torch.Tensor, group, src: int) -> torch.Tensor:
    """Broadcast from group rank `src` (in place on a contiguous buffer)."""
    if group is None:
        return x
    x = x.contiguous()
    record("broadcast", group, x.numel(), x.dtype)
    dist.broadcast(x, group_src=src, group=group)
    return x


def raw_reduce(x: torch.Tensor, group, dst: int) -> torch.Tensor:
    """Sum onto group rank `dst`; other ranks' results are not meaningful."""
    if group is None:
        return x
    x = x.contiguous()
    record("reduce", group, x.numel(), x.dtype)
    dist.reduce(x, group_dst=dst, group=group)
    return x


def raw_all_to_all(x: torch.Tensor, group, split_dim: int, concat_dim: int) -> torch.Tensor:
    """Split x into n chunks along split_dim, send chunk k to rank k, concat received along concat_dim."""
    n = group_size(group)
    if n == 1:
        return x
    if x.shape[split_dim] % n:
        raise ValueError(f"all-to-all: dim {split_dim} of size {x.shape[split_dim]} does not divide by {n}")
    send = torch.stack(x.chunk(n, dim=split_dim), dim=0).contiguous()
    recv = torch.empty_like(send)
    record("all_to_all", group, send.numel(), x.dtype)
    dist.all_to_all_single(recv, send, group=group)
    return torch.cat(recv.unbind(0), dim=concat_dim)


def raw_exchange(x: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
    """Rows send[k] of x (in order) to rank k, recv[k] rows from rank k concatenated: an all-to-all
    of uneven splits along dim 0."""
    x = x.contiguous()
    out = x.new_empty((sum(recv), *x.shape[1:]))
    record("all_to_all", group, x.numel(), x.dtype)
    dist.all_to_all_single(out, x, output_split_sizes=recv, input_split_sizes=send, group=group)
    return out


def raw_scatter(chunks: list[torch.Tensor] | None, out: torch.Tensor, group, src: int) -> torch.Tensor:
    """Group rank `src` sends chunks[k] to group rank k (others pass chunks=None); every rank
    receives into `out`. Metered as the whole scattered buffer, on every rank."""
    if group is None:
        return out.copy_(chunks[0])
    record("scatter", group, out.numel() * group_size(group), out.dtype)
    dist.scatter(out, [c.contiguous() for c in chunks] if chunks is not None else None, group_src=src, group=group)
    return out


def raw_gather(x: torch.Tensor, group, dst: int) -> list[torch.Tensor] | None:
    """Every rank's x to group rank `dst` (a list in group-rank order there, None elsewhere).
    Metered as the whole gathered buffer, on every rank."""
    n = group_size(group)
    if n == 1:
        return [x]
    x = x.contiguous()
    record("gather", group, x.numel() * n, x.dtype)
    out = [torch.empty_like(x) for _ in range(n)] if group_rank(group) == dst else None
    dist.gather(x, out, group_dst=dst, group=group)
    return out


# ----------------------------------------------------------------------------- autograd pairs


class _CopyToGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, dy):
        return raw_all_reduce(dy.clone(), ctx.group), None


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return raw_all_reduce(x.clone(), group)

    @staticmethod
    def backward(ctx, dy):
        return dy, None


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return raw_all_gather(x, group, dim)

    @staticmethod
    def backward(ctx, dy):
        return raw_reduce_scatter(dy, ctx.group, ctx.dim), None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return raw_reduce_scatter(x, group, dim)

    @staticmethod
    def backward(ctx, dy):
        return raw_all_gather(dy, ctx.group, ctx.dim), None, None


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, src):
        ctx.group, ctx.src = group, src
        return raw_broadcast(x.clone(), group, src)

    @staticmethod
    def backward(ctx, dy):
        total = raw_reduce(dy.clone(), ctx.group, ctx.src)
        return (total if group_rank(ctx.group) == ctx.src else None), None, None


class _Reduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dst):
        ctx.group, ctx.dst = group, dst
        return raw_reduce(x.clone(), group, dst)

    @staticmethod
    def backward(ctx, dy):
        return raw_broadcast(dy.clone(), ctx.group, ctx.dst), None, None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, split_dim, concat_dim):
        ctx.group, ctx.split_dim, ctx.concat_dim = group, split_dim, concat_dim
        return raw_all_to_all(x, group, split_dim, concat_dim)

    @staticmethod
    def backward(ctx, dy):
        return raw_all_to_all(dy, ctx.group, ctx.concat_dim, ctx.split_dim), None, None, None


class _Exchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, send, recv, group):
        ctx.send, ctx.recv, ctx.group = send, recv, group
        return raw_exchange(x, send, recv, group)

    @staticmethod
    def backward(ctx, dy):
        return raw_exchange(dy, ctx.recv, ctx.send, ctx.group), None, None, None


def copy_to_group(x: torch.Tensor, group) -> torch.Tensor:
    """Megatron's f. Forward: Y = X (identity). Backward: dX = Σ_ranks dY (all-reduce).

    Use where a replicated input feeds rank-local computations whose gradients are partial.
    """
    return x if group is None else _CopyToGroup.apply(x, group)


def all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    """Megatron's g. Forward: Y = Σ_ranks X (all-reduce). Backward: dX = dY (identity).

    Use where partial sums become a replicated value that every rank differentiates in full.
    """
    return x if group is None else _AllReduce.apply(x, group)


def all_gather(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    """Forward: Y = [X_0; X_1; ...] along dim (all-gather).
    Backward: dX_k = (Σ_ranks dY)_k (reduce-scatter), since each rank's dY is a partial gradient."""
    return x if group is None else _AllGather.apply(x, group, dim)


def reduce_scatter(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    """Forward: Y_k = (Σ_ranks X)_k along dim (reduce-scatter). Backward: dX = [dY_0; dY_1; ...] (all-gather)."""
    return x if group is None else _ReduceScatter.apply(x, group, dim)


def broadcast(x: torch.Tensor, group, src: int) -> torch.Tensor:
    """Forward: Y = X_src on every rank (broadcast). Backward: dX_src = Σ_ranks dY (reduce to src).

    Every rank passes a tensor of the output's shape (non-src ranks: a receive buffer). For the
    backward reduce to run on every rank, every rank's input must require grad (non-src ranks may
    pass a buffer with requires_grad=True; it receives no gradient).
    """
    return x if group is None else _Broadcast.apply(x, group, src)


def reduce(x: torch.Tensor, group, dst: int) -> torch.Tensor:
    """Forward: Y_dst = Σ_ranks X (reduce to dst). Backward: dX = dY_dst on every rank (broadcast)."""
    return x if group is None else _Reduce.apply(x, group, dst)


def all_to_all(x: torch.Tensor, group, split_dim: int, concat_dim: int) -> torch.Tensor:
    """Forward: chunk k of X along split_dim goes to rank k; received chunks concat along concat_dim.
    Backward: the inverse all-to-all of dY (split along concat_dim, concat along split_dim)."""
    return x if group is None else _AllToAll.apply(x, group, split_dim, concat_dim)


def exchange(x: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
    """Forward: rows send[k] of X to rank k, recv[k] rows from rank k (an all-to-all of uneven
    splits; an MoE layer's rows to their experts' ranks). Backward: the same of dY the other way
    (send and recv swapped)."""
    return _Exchange.apply(x, send, recv, group)
