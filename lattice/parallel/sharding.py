"""Shard specs: how a parameter's local shard relates to the full (serial) tensor.

A `ShardSpec` says which tensor dims are split over which mesh axes (several axes on one dim
split it mixed-radix, the first axis major), which ranks hold the parameter at all (`holders`,
e.g. 2D biases live on row 0 only), an optional padded full shape (a vocabulary padded so
that it divides), and the axes its gradient is summed over inside a model replica (`grad_sum`:
ranks along them hold the same shard but each computes a partial gradient, as sub-graph
parallelism's data-parallel common layers do; `GPT.sync_grads` sums them). Every axis not named
in `splits` holds replicas.

From the spec alone come: the local shape, the slice of the full tensor a rank holds, scattering
a full tensor to shards without communication, and gathering shards (or their gradients) back
to the full tensor on every rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Mapping

import torch
import torch.distributed as dist
import torch.nn as nn

from lattice.parallel.comm import unmetered_all_gather, raw_all_reduce
from lattice.parallel.context import LatticeConfigError, MeshAxis, ParallelContext, Topology


@dataclass(frozen=True)
class ShardSpec:
    full_shape: tuple[int, ...]
    splits: tuple[tuple[int, tuple[MeshAxis, ...]], ...] = ()
    holders: tuple[tuple[MeshAxis, int], ...] = ()
    padded_shape: tuple[int, ...] | None = None
    grad_sum: tuple[MeshAxis, ...] = ()
    trainable: bool = True  # False: state the model updates itself (an MoE's expert bias), no gradient or optimizer

    def __post_init__(self):
        dims = [d for d, _ in self.splits]
        if len(set(dims)) != len(dims):
            raise ValueError(f"a tensor dim is split twice in {self.splits}")
        split_axes = {a for _, axes in self.splits for a in axes} | {a for a, _ in self.holders}
        if split_axes & set(self.grad_sum) or MeshAxis.DP in self.grad_sum:
            raise ValueError(f"grad_sum {self.grad_sum} must name replicated axes of the model replica; "
                             f"the shard is split or hosted along {sorted(a.value for a in split_axes)}")
        if self.padded_shape is not None and len(self.padded_shape) != len(self.full_shape):
            raise ValueError("padded_shape must have the rank of full_shape")

    @property
    def storage_shape(self) -> tuple[int, ...]:
        return self.padded_shape or self.full_shape

    def split_sizes(self, topo: Topology) -> dict[int, int]:
        return {d: math.prod(topo.size(a) for a in axes) for d, axes in self.splits}

    def local_shape(self, topo: Topology) -> tuple[int, ...]:
        shape = list(self.storage_shape)
        for d, n in self.split_sizes(topo).items():
            if shape[d] % n:
                axes = " x ".join(a.value for dim, split in self.splits if dim == d for a in split)
                raise LatticeConfigError(
                    f"a parameter of shape {list(self.full_shape)} does not split over this layout: its dimension {d} "
                    f"of size {shape[d]} does not divide into {n} shards (mesh axes {axes}); choose model sizes that "
                    f"make it a multiple of {n} (the MLP's hidden width, the head size or the head counts)")
            shape[d] //= n
        return tuple(shape)

    def holds(self, coords: Mapping[MeshAxis, int]) -> bool:
        return all(coords.get(axis, 0) == c for axis, c in self.holders)

    def chunk_index(self, coords: Mapping[MeshAxis, int], topo: Topology) -> tuple[int, ...]:
        """Per split dim, which chunk this rank holds (mixed radix over the dim's axes)."""
        out = []
        for _, axes in self.splits:
            k = 0
            for a in axes:
                k = k * topo.size(a) + coords.get(a, 0)
            out.append(k)
        return tuple(out)

    def slices(self, coords: Mapping[MeshAxis, int], topo: Topology) -> tuple[slice, ...]:
        """The region of the (padded) full tensor held at `coords`."""
        return self.region(self.chunk_index(coords, topo), self.local_shape(topo))

    def region(self, chunk: tuple[int, ...], local: tuple[int, ...]) -> tuple[slice, ...]:
        """The region of the (padded) full tensor that chunk index `chunk` names, for shards of
        shape `local` (`slices`, for a caller that knows both already)."""
        sl = [slice(0, n) for n in self.storage_shape]
        for (d, _), k in zip(self.splits, chunk):
            sl[d] = slice(k * local[d], (k + 1) * local[d])
        return tuple(sl)

    @property
    def replica_splits(self) -> tuple[MeshAxis, ...]:
        """Of the axes whose ranks hold other tokens of the same shards (dp, cp), those this one is
        split over (an MoE's experts), which then hold different pieces rather than copies: its
        gradient is neither averaged nor summed over them, and the norm adds the pieces up."""
        return tuple(a for a in (MeshAxis.DP, MeshAxis.CP) if any(a in axes for _, axes in self.splits))

    @property
    def split_over_dp(self) -> bool:
        return MeshAxis.DP in self.replica_splits

    def replicas(self, topo: Topology) -> int:
        """How many ranks of one model replica (all axes but DP) hold each distinct shard."""
        holders_in_replica = topo.replica_size
        for axis, _ in self.holders:
            if axis != MeshAxis.DP:
                holders_in_replica //= topo.size(axis)
        shards = math.prod(topo.size(a) for _, axes in self.splits for a in axes if a != MeshAxis.DP)
        return holders_in_replica // shards

    def pad(self, full: torch.Tensor) -> torch.Tensor:
        if self.padded_shape is None or tuple(full.shape) == self.padded_shape:
            return full
        out = full.new_zeros(self.padded_shape)
        out[tuple(slice(0, n) for n in full.shape)] = full
        return out

    def crop(self, padded: torch.Tensor) -> torch.Tensor:
        return padded[tuple(slice(0, n) for n in self.full_shape)]

    def shard(self, full: torch.Tensor, coords: Mapping[MeshAxis, int], topo: Topology) -> torch.Tensor:
        """This rank's shard of a full tensor (no communication); padding rows are zeros. Only
        the shard is allocated (no padded copy of the full tensor)."""
        if tuple(full.shape) != self.full_shape:
            raise LatticeConfigError(f"expected a tensor of shape {list(self.full_shape)}, got {list(full.shape)}")
        out = full.new_zeros(self.local_shape(topo))
        src, dst = [], []
        for sl, n in zip(self.slices(coords, topo), self.full_shape):
            lo, hi = min(sl.start, n), min(sl.stop, n)  # the part of this slice inside the true size
            src.append(slice(lo, hi))
            dst.append(slice(0, hi - lo))
        out[tuple(dst)] = full[tuple(src)]
        return out

    def describe(self, topo: Topology) -> str:
        parts = [f"dim {d} over {'x'.join(a.value for a in axes)}" for d, axes in self.splits]
        if self.holders:
            parts.append("held where " + ", ".join(f"{a.value}={c}" for a, c in self.holders))
        if not self.splits:
            parts.insert(0, "replicated")
        if self.grad_sum:
            parts.append("gradient summed over " + " x ".join(a.value for a in self.grad_sum))
        return "; ".join(parts)


def register_sharded(module: nn.Module, name: str, spec: ShardSpec, ctx: ParallelContext,
                     dtype: torch.dtype | None = None) -> nn.Parameter | None:
    """Declare a parameter by its spec. Ranks that hold it get an (uninitialised) local shard;
    others register None. The spec is kept either way so that every rank knows every parameter."""
    if not hasattr(module, "_lattice_specs"):
        module._lattice_specs = {}
    module._lattice_specs[name] = spec
    if spec.holds(ctx.coords):
        param = nn.Parameter(torch.empty(spec.local_shape(ctx.topology), dtype=dtype), requires_grad=spec.trainable)
        module.register_parameter(name, param)
        return param
    module.register_parameter(name, None)
    return None


def collect_specs(model: nn.Module) -> dict[str, ShardSpec]:
    """Every declared parameter of the model by its serial (state-dict) name, in module order."""
    out = {}
    for prefix, mod in model.named_modules():
        for name, spec in getattr(mod, "_lattice_specs", {}).items():
            out[f"{prefix}.{name}" if prefix else name] = spec
    return out


#: bytes a bucket of `gather_full_many` assembles at once on a rank (every rank's shards of the
#: bucket's tensors): one collective per bucket rather than one per tensor, which at 8 ranks on
#: 2 cores made gathering a small model's state take most of a conformance check
GATHER_BUCKET_BYTES = 64 * 2 ** 20


def gather_full(local: torch.Tensor | None, spec: ShardSpec, ctx: ParallelContext, *,
                dtype: torch.dtype, average_dp: bool = False, dst: int | None = None) -> torch.Tensor | None:
    """Assemble the full tensor from every rank's shard (a collective over the world).

    `local` is this rank's shard (None where it holds none, or a missing gradient counts as 0).
    With average_dp, the average over the data-parallel replicas (for gradients: each replica's
    assembly, or a shard split over them, which holds every replica's part, divided by dp); otherwise
    replica 0's is returned. The result is identical on every rank, or with `dst` (a global rank)
    built there alone while the other ranks send their shard and return None.
    """
    return gather_full_many([(local, spec)], ctx, dtype=dtype, average_dp=average_dp, dst=dst)[0]


def gather_full_many(shards: list[tuple[torch.Tensor | None, ShardSpec]], ctx: ParallelContext, *,
                     dtype: torch.dtype, average_dp: bool = False, dst: int | None = None,
                     bucket_bytes: int = GATHER_BUCKET_BYTES) -> list[torch.Tensor | None]:
    """`gather_full` of each (local shard, spec) pair, in order, with one collective per bucket:
    consecutive tensors whose shards from every rank take at most `bucket_bytes` (a larger one
    alone), so that a rank never holds more than one bucket beyond its shards and the results."""
    topo = ctx.topology
    local_shapes = [spec.local_shape(topo) for _, spec in shards]
    itemsize = torch.empty((), dtype=dtype).element_size()

    def gathered_bytes(k: int) -> int:
        return math.prod(local_shapes[k]) * itemsize * topo.world_size

    out: list[torch.Tensor | None] = []
    for bucket in byte_buckets(list(range(len(shards))), gathered_bytes, bucket_bytes):
        bufs = [(shards[k][0] if shards[k][0] is not None else
                 torch.zeros(local_shapes[k], dtype=dtype, device=ctx.device)).detach().to(dtype).reshape(-1)
                for k in bucket]
        buf = torch.cat(bufs) if len(bufs) > 1 else bufs[0].contiguous()
        if topo.world_size > 1:
            everyone = None
            if dst is None or ctx.rank == dst:
                everyone = torch.empty(topo.world_size * buf.numel(), dtype=dtype, device=buf.device)
            if dst is None:
                unmetered_all_gather(everyone, buf)
            else:
                dist.gather(buf, list(everyone.chunk(topo.world_size)) if everyone is not None else None, dst=dst)
                if everyone is None:
                    out.extend(None for _ in bucket)
                    continue
            per_rank_rows = everyone.view(topo.world_size, -1)
        else:
            per_rank_rows = buf.view(1, -1)
        pieces = per_rank_rows.split([b.numel() for b in bufs], dim=1)
        for k, piece in zip(bucket, pieces):
            out.append(_assemble(piece.reshape(-1, *local_shapes[k]), shards[k][1], topo, dtype, average_dp))
    return out


def _assemble(chunks: torch.Tensor, spec: ShardSpec, topo: Topology, dtype: torch.dtype,
              average_dp: bool) -> torch.Tensor:
    """The full tensor from `chunks[rank]`, every rank's shard of it."""
    # a shard split over the replicas is held by one of them alone: its gradient there is every
    # replica's tokens' at once, which the average divides like the others'
    replicas = topo.size(MeshAxis.DP) if average_dp and not spec.split_over_dp else 1
    local = chunks.shape[1:]
    full = torch.zeros(spec.storage_shape, dtype=dtype, device=chunks.device)
    for d in range(replicas):
        filled = set()
        for rank in range(chunks.shape[0]):
            coords = topo.coords(rank)
            if (coords.get(MeshAxis.DP, 0) != d and not spec.split_over_dp) or not spec.holds(coords):
                continue
            key = spec.chunk_index(coords, topo)
            if key in filled:
                continue
            filled.add(key)
            full[spec.region(key, local)] += chunks[rank]
    if average_dp and topo.size(MeshAxis.DP) > 1:
        full /= topo.size(MeshAxis.DP)
    return spec.crop(full).contiguous()


#: gradient bytes per all-reduce of `sum_replica_grads` (DDP's default bucket)
GRAD_BUCKET_BYTES = 25 * 2 ** 20


def byte_buckets(items: list, nbytes, max_bytes: int = GRAD_BUCKET_BYTES) -> list[list]:
    """Consecutive items in groups of at most max_bytes (`nbytes(item)` each; an item larger
    than max_bytes gets a group of its own)."""
    buckets, size = [], 0
    for item in items:
        n = nbytes(item)
        if not buckets or size + n > max_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(item)
        size += n
    return buckets


@torch.no_grad()
def all_reduce_grads(params: list[nn.Parameter], group, divide_by: int = 1) -> None:
    """Sum the gradients of `params` over `group` in one flat all-reduce (metered as backward
    traffic), divided by `divide_by` (the replica count, for an average). A missing gradient
    joins as zeros."""
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = raw_all_reduce(torch.cat([g.reshape(-1) for g in grads]), group, phase="backward")
    if divide_by != 1:
        flat.div_(divide_by)
    # the gradients become views of the summed buffer: a copy back (and a division into a new
    # buffer) would each move every byte again, which at 8 ranks on 2 cores cost as much as the sum
    for p, part in zip(params, flat.split([g.numel() for g in grads])):
        p.grad = part.view_as(p)


@torch.no_grad()
def weighted_square_sum(grads: list[tuple[torch.Tensor, int]], acc: torch.dtype, device) -> torch.Tensor:
    """Σ ||g||² / replicas over (gradient, replicas) pairs, in `acc`, shape (1,): one fused norm
    per group of equal replica count (torch._foreach_norm, as torch.nn.utils.get_total_norm) rather
    than a handful of kernels per tensor, which dominate for a model of many small tensors."""
    groups: dict[int, list[torch.Tensor]] = {}
    for g, replicas in grads:
        groups.setdefault(replicas, []).append(g)
    sq = torch.zeros(1, dtype=acc, device=device)
    for replicas, tensors in groups.items():
        norms = torch.stack(torch._foreach_norm(tensors, 2, dtype=acc))
        sq += norms.pow(2).sum() / replicas
    return sq


def grad_sum_buckets(model: nn.Module, params: dict | None = None) -> list[tuple[tuple, list[str]]]:
    """The parameters this rank holds whose spec declares `grad_sum`, as (axes, names) buckets
    of at most GRAD_BUCKET_BYTES, in spec order (the same on every rank of a group). `params`: the
    model's named parameters, where the caller has walked them."""
    topo = model.ctx.topology
    params = dict(model.named_parameters()) if params is None else params
    by_axes: dict[tuple, list[str]] = {}
    for name, spec in model.specs.items():
        if spec.grad_sum and name in params:
            by_axes.setdefault(topo.canonical_axes(spec.grad_sum), []).append(name)
    return [(axes, bucket) for axes, names in by_axes.items()
            for bucket in byte_buckets(names, lambda n: params[n].numel() * params[n].element_size())]


@torch.no_grad()
def sum_replica_grads(model: nn.Module, over_cp: bool = True) -> None:
    """Sum each declared partial gradient over its `grad_sum` axes: one flat all-reduce per
    bucket (metered as backward traffic). A missing gradient joins as zeros. Under context
    parallelism, `over_cp`: then every gradient over cp too (the Trainer leaves that to its
    reduction over dp x cp)."""
    params = dict(model.named_parameters())
    for axes, names in grad_sum_buckets(model):
        group = model.ctx.group(*axes)
        if group is not None:
            all_reduce_grads([params[n] for n in names], group)
    if model.ctx.cp > 1 and over_cp:  # each rank of a cp group holds every parameter's gradient of its chunks alone
        held = [n for n in model.specs if n in params and MeshAxis.CP not in model.specs[n].replica_splits]
        for bucket in byte_buckets(held, lambda n: params[n].numel() * params[n].element_size()):
            all_reduce_grads([params[n] for n in bucket], model.ctx.group(MeshAxis.CP))


def check_state_dict_keys(expected: Iterable[str], given: Iterable[str], what: str = "state dict"):
    expected, given = list(expected), set(given)
    missing = [k for k in expected if k not in given]
    unexpected = sorted(given - set(expected))
    if missing or unexpected:
        msg = [f"{what} does not match this model:"]
        if missing:
            msg.append(f"missing {len(missing)} keys (first: {missing[:3]})")
        if unexpected:
            msg.append(f"unexpected {len(unexpected)} keys (first: {unexpected[:3]})")
        msg.append("check that the model config matches the one the weights were saved with")
        raise LatticeConfigError(" ".join(msg))
