"""Where ZeRO's split puts each parameter's rows (lattice.parallel.zero): which rows a dp rank
owns, the gradient buckets, and the bytes a rank keeps at each stage. Pure functions of a model's
shard specs and shapes (the cost model plans a meta model with them, the optimizer a real one),
and the optimizer's record of each bucket and of its pieces."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from lattice.parallel.context import MeshAxis
from lattice.parallel.sharding import GRAD_BUCKET_BYTES, byte_buckets


@dataclass
class Piece:
    """This dp rank's rows [r0, r1) of one parameter, at `offset` in its bucket's segment."""

    name: str
    param: nn.Parameter
    r0: int
    r1: int
    per: int  # rows per dp rank (the bucket reserves this many for every rank)
    width: int  # elements per row
    offset: int
    master: torch.Tensor | None = None  # the rows AdamW updates (a view into the parameter below stage 3)
    alias: torch.Tensor | None = None  # stage 3: the parameter's storage, written without bumping its version

    @property
    def numel(self) -> int:
        return (self.r1 - self.r0) * self.width


@dataclass
class Bucket:
    pieces: list[Piece]
    segment: int
    late: bool
    shards: int  # the ranks its rows are split over, this rank's `shard` of them, in `group`
    shard: int
    group: object
    split: tuple  # the replica axes its parameters are split over (an MoE's experts), else ()
    block: int = -1  # stage 3: its parameters' unit (`block_of`): a block, or < 0 a part outside them
    waiting: dict = field(default_factory=dict)  # id(parameter) -> accumulations its gradient still awaits
    flat: torch.Tensor | None = None  # the rank-major gradients being reduced
    reduced: torch.Tensor | None = None  # this rank's segment of their average
    work: object = None
    launched: bool = False
    whole: bool = True  # stage 3: whether its parameters hold their whole local shards
    gathering: tuple | None = None  # stage 3: (the gathered segments, the work) of a gather under way


# ZeRO-3's units outside the blocks (`block_of`), by the part of the model that reads them
FIRST, MIDDLE, LAST = -1, -2, -3  # the first part (embeddings), an encoder-decoder's middle, the last (norm, head)
SHARED = -4  # a table the first and last parts both read (`Parts.shared`: a tied token table)
EVERYWHERE = -5  # read by several parts and stages (`Parts.everywhere`): kept from its first use to its reduction


def block_of(model, params: dict) -> dict[str, int]:
    """Each parameter's unit: its block (its index in `pipeline_blocks()`, the model's order of
    running them), or for those outside every block the part that reads them (FIRST, MIDDLE,
    LAST, SHARED, EVERYWHERE; FIRST for all of them where the family has no `parts()`): what
    ZeRO-3 gathers and frees together."""
    root = getattr(model, "_model", model)  # (a pipeline's stages: the model they cut)
    unit = {id(p): i for i, block in enumerate(root.pipeline_blocks()) for p in block.parameters()}
    parts = root.parts()
    if parts is not None:
        for kind, names in ((FIRST, parts.first), (MIDDLE, parts.middle), (LAST, parts.last)):
            for name in names:
                for p in root.get_submodule(name).parameters():
                    unit.setdefault(id(p), kind)
    return {name: (SHARED if parts and name in parts.shared else EVERYWHERE if parts and name in parts.everywhere
                   else unit.get(id(p), FIRST)) for name, p in params.items()}


def parts_freed(model, microbatches: int, reshard_after_forward: bool) -> bool:
    """Whether ZeRO-3 frees the units outside the blocks between their uses (one pass a step,
    resharding after the forward, a family with `parts()`); else they stay gathered from their
    first use to their reduction."""
    return microbatches == 1 and reshard_after_forward and getattr(model, "_model", model).parts() is not None


def read_in_backward(params) -> bool:
    """Whether the backward of the part holding `params` reads them, so that a part freed after
    its forward is gathered again: vectors (a norm's weight and bias) are; tables (token,
    position and bias tables) are read by index, whose backward needs only the indices."""
    return any(p.dim() == 1 for p in params)


def weight_gathers(model, params: dict, microbatches: int, reshard_after_forward: bool = True,
                   reshard_microbatches: bool = False) -> dict[str, dict[str, int]]:
    """ZeRO-3 (lattice.parallel.zero3): {parameter: {phase: all-gathers of its bucket a step}}. A
    block's weights are gathered for each forward and again for each backward when freed after the
    forward; over several micro-batches they stay from the first forward to the reduction
    (`reshard_microbatches`: around each). A part outside the blocks freed after its forward
    (`parts_freed`) is gathered for it and, where `read_in_backward`, for its backward; a shared
    table by the first and by the last part (the head keeps it for its backward); the last part,
    whose backward follows at once, and EVERYWHERE's once. Otherwise they stay gathered from the
    first forward to the reduction."""
    passes = microbatches if reshard_microbatches else 1
    again = passes if reshard_microbatches else int(microbatches == 1 and reshard_after_forward)
    units = block_of(model, params)
    freed = parts_freed(model, microbatches, reshard_after_forward)
    read = {u for u in (FIRST, MIDDLE) if read_in_backward(params[n] for n, v in units.items() if v == u)}
    both_ends = 2 if getattr(model, "_model", model) is model else 1  # (a pipeline's stages: one of them each)
    out = {}
    for name, u in units.items():
        if u >= 0:
            out[name] = {"forward": passes, "backward": again}
        else:
            out[name] = {"forward": both_ends if freed and u == SHARED else 1, "backward": int(freed and u in read)}
    return out


def rows_of(shape) -> tuple[int, int]:
    """(rows, elements per row) of a tensor split along dim 0."""
    if len(shape) == 0:
        return 1, 1
    return shape[0], math.prod(shape[1:])


def rows_per_shard(rows: int, dp: int) -> int:
    """⌈rows/dp⌉: the rows every dp rank's segment reserves for a parameter."""
    return -(-rows // dp)


def owned_rows(rows: int, dp: int, r: int) -> tuple[int, int]:
    """[r0, r1): the rows of dim 0 dp rank r owns (⌈rows/dp⌉ each, the last ones fewer or none)."""
    per = rows_per_shard(rows, dp)
    r0 = min(r * per, rows)
    return r0, min(r0 + per, rows)


def rows_by_shard(tensor, width: int, offset: int, segments):
    """(shard r, its rows of `tensor` (a parameter's local shard, `width` elements a row), the
    matching (rows, width) view of segments[r] from `offset`) for every shard that owns rows: a
    bucket's layout, shard-major, each of its `segments.shape[0]` shards ⌈rows/shards⌉ rows."""
    rows = tensor.view(-1, width)
    shards = segments.shape[0]
    for r in range(shards):
        r0, r1 = owned_rows(rows.shape[0], shards, r)
        if r1 > r0:
            yield r, rows[r0:r1], segments[r, offset:offset + (r1 - r0) * width].view(-1, width)


def plan_buckets(model, dp: int, max_bytes: int = GRAD_BUCKET_BYTES, itemsize: int | None = None,
                 cp_summed: bool = True, params: dict | None = None,
                 by_block: bool = False) -> list[tuple[bool, list[str], int, tuple]]:
    """The gradient buckets of this rank's parameters: (late, names, segment, split), where
    `segment` is the elements each of the bucket's shards receives (the bucket holds shards ×
    segment: `dp` of them (dp x cp, or 1), or `zero_split`'s of a bucket of parameters `split` over
    some of the replica axes, an MoE's experts), and `late` marks parameters whose gradient
    sync_grads completes. Parameters in reverse order (roughly
    the order backward produces their gradients), at most `max_bytes` of them per bucket
    (`itemsize` bytes per element, default the parameters'). `cp_summed`: under context
    parallelism sync_grads sums every gradient over cp, which makes every bucket late; a
    pipeline's sums between stages make their parameters late. `by_block` (ZeRO-3): no bucket
    holds parameters of two blocks (`block_of`). Pure: the cost model plans a meta model with it
    (`params`: its named parameters, where the caller has walked them)."""
    params = dict(model.named_parameters()) if params is None else params
    params = {name: p for name, p in params.items() if model.specs[name].trainable}
    kinds = {}  # (late, the replica axes split over) -> names
    every_late = model.ctx.cp > 1 and cp_summed
    between_stages = set(getattr(model, "summed_between_stages", ()))
    for name in reversed(list(params)):
        spec = model.specs[name]
        late = every_late or bool(spec.grad_sum) or name in between_stages
        kinds.setdefault((late, spec.replica_splits), []).append(name)
    blocks = block_of(model, params) if by_block else {}
    out = []
    for is_late, split in sorted(kinds, key=lambda kind: (kind[0], split_order(kind[1]))):
        names = kinds[(is_late, split)]
        shards = zero_split(model.ctx, split, dp, 0)[0]
        runs = [[]]  # runs of parameters of one block
        for name in names:
            if runs[-1] and blocks.get(name) != blocks.get(runs[-1][-1]):
                runs.append([])
            runs[-1].append(name)
        for names_ in (bucket for run in runs for bucket in byte_buckets(
                run, lambda n: params[n].numel() * (itemsize or params[n].element_size()), max_bytes)):
            segment = 0
            for n in names_:
                rows, width = rows_of(params[n].shape)
                segment += rows_per_shard(rows, shards) * width
            out.append((is_late, names_, segment, split))
    return out


def zero_shards(ctx) -> tuple[int, int]:
    """(shards, this rank's shard) of ZeRO's split: over dp x cp, in group-rank order."""
    return ctx.dp * ctx.cp, ctx.coord(MeshAxis.DP) * ctx.cp + ctx.coord(MeshAxis.CP)


def split_order(split: tuple) -> tuple:
    """A sort key of replica splits that every rank computes alike (enum hashes, and so a set's
    order, differ between processes): the fewest axes first, then by name."""
    return len(split), [a.value for a in split]


def sharers(split: tuple) -> tuple:
    """The replica axes (dp, cp) whose ranks hold the same shard of a parameter split over `split`
    of them (an MoE's experts; () for every other parameter), in mesh order."""
    return tuple(a for a in (MeshAxis.DP, MeshAxis.CP) if a not in split)


def zero_split(ctx, split: tuple, shards: int, shard: int) -> tuple[int, int]:
    """ZeRO's (shards, this rank's shard) of a parameter split over the replica axes `split`, over
    its `sharers` in group-rank order, from every other parameter's (`shards` dp x cp or 1, and
    `shard`, `zero_shards`' index)."""
    if shards == 1 or not split:
        return shards, shard
    coords = dict(zip((MeshAxis.DP, MeshAxis.CP), divmod(shard, ctx.cp)))
    n, k = 1, 0
    for axis in sharers(split):
        n, k = n * ctx.size(axis), k * ctx.size(axis) + coords[axis]
    return n, k


def memory_per_rank(model, dp: int, dp_rank: int, stage: int, itemsize: int,
                    master_itemsize: int | None = None, params: dict | None = None,
                    gathered_blocks: int | None = 2, parts_freed: bool = False) -> dict[str, int]:
    """Bytes of weights, gradients and optimizer state this rank keeps between steps (`model`:
    its shards, a meta model will do) for ZeRO `stage` 0 to 3 over `dp` replicas, with
    `itemsize`-byte weights (under cp: dp x cp shards, `zero_shards`) and, given `master_itemsize`
    (bf16 weights: 4), master rows, moments
    and reduced gradients of that size. Per parameter, up to rows that do not divide by d:
    fp32 16 without ZeRO, 8 + 8/d (stage 1), 4 + 12/d (stage 2), 16/d (stage 3); bf16 weights with
    fp32 masters 18 (2 + 4 reduced + 12), 4 + 16/d (stage 1 keeps the bf16 gradient), 2 + 16/d
    (stage 2), 16/d (stage 3). Stage 3 adds `gathered`: the most weights whole at once during a
    step, those outside the blocks and the `gathered_blocks` largest blocks' (2: one running and
    the next one's prefetch; None: every block, kept from the forward to the reduction), and with
    `parts_freed` (zero_layout.parts_freed) the largest of them and each part outside the blocks."""
    state = master_itemsize or itemsize
    mixed = master_itemsize is not None and master_itemsize != itemsize
    shards, shard = (dp, dp_rank) if stage else (1, 0)
    params = dict(model.named_parameters()) if params is None else params  # as plan_buckets
    numel = sum(p.numel() for p in params.values())
    trained = sum(p.numel() for name, p in params.items() if model.specs[name].trainable)
    owned, shared, blocks = 0, {}, block_of(model, params) if stage == 3 else {}
    owned_shared = 0  # stage 3: the rows of weights it frees (fp32: their master rows are the weights)
    for name, p in params.items():
        if not model.specs[name].trainable:  # (no gradient, no optimizer state)
            continue
        rows, width = rows_of(p.shape)
        n, k = zero_split(model.ctx, model.specs[name].replica_splits, shards, shard)
        r0, r1 = owned_rows(rows, n, k)
        owned += (r1 - r0) * width
        if n > 1 and stage == 3:  # (gathered where used; with nothing to share, whole throughout)
            shared[blocks[name]] = shared.get(blocks[name], 0) + p.numel()
            owned_shared += (r1 - r0) * width
    reduced = sum(bucket[2] for bucket in plan_buckets(model, shards, itemsize=state, params=params))
    if mixed:  # the reduced fp32 gradient (all of it at stage 0, the slice otherwise), stage 1 also the bf16 one
        grads = state * reduced + (itemsize * trained if stage == 1 else 0)
    else:  # the gradient itself, or (stages 2 and 3) only the reduced slice
        grads = itemsize * (reduced if stage >= 2 else trained)
    out = {"parameters": itemsize * numel, "gradients": grads, "optimizer": (3 if mixed else 2) * state * owned}
    if stage == 3:  # the weights kept are those nothing shares and the master rows (fp32: the weights themselves)
        out["parameters"] = itemsize * (numel - sum(shared.values())) + (0 if mixed else state * owned_shared)
        blocks_at_once = sum(sorted((n for u, n in shared.items() if u >= 0), reverse=True)[:gathered_blocks])
        if parts_freed:  # a part outside the blocks is whole alone (with a shared table), or two blocks are
            table = shared.get(SHARED, 0)
            at_once = max(blocks_at_once, shared.get(FIRST, 0) + table, shared.get(LAST, 0) + table, shared.get(MIDDLE, 0))
            out["gathered"] = itemsize * (shared.get(EVERYWHERE, 0) + at_once)
        else:  # those outside the blocks, gathered from their first use to their reduction, and the blocks
            out["gathered"] = itemsize * (sum(n for u, n in shared.items() if u < 0) + blocks_at_once)
    return out
