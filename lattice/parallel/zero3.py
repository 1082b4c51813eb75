"""ZeRO stage 3 (fully sharded data parallelism): between its uses a parameter keeps only this
dp rank's rows, the master rows of lattice.parallel.zero's optimizer; its whole local shard (the
mode's tensor shard) is all-gathered over the ranks holding the same shard just before a block
runs and freed after.

With w_r the rows rank r owns of a block's parameter w and d ranks sharing it:
    forward:   all-gather w = [w_0; …; w_{d-1}]  before the block, freed after it
    backward:  all-gather w again before the block's backward (`reshard_after_forward`), then
               reduce-scatter ĝ_r = (1/d) Σ_k P_r g_k as stages 1 and 2 do, and free w
A block is a unit: `zero_layout.plan_buckets(by_block=True)` never puts two units' parameters
in one bucket, and the hooks here gather every bucket of a unit together. The parameters
outside the blocks are units by the part of the model that reads them (`zero_layout.block_of`):
the first part (embeddings) is gathered as it starts and freed as the first block starts, again
for its backward only where that reads them (a norm's weight; a table's backward needs only the
indices); the last part (final norm, head) from its forward to its backward, which follows at
once; a tied table with each of them, freed as the first block's backward starts. Under
gradient accumulation and pipeline micro-batches the units stay gathered from their first
forward to their reduction, one gather per step (`reshard_microbatches` frees the blocks after
every micro-batch's forward and backward instead).

`prefetch` issues the next block's all-gather as a block starts (the previous block's in
backward), so that it travels while the block computes: at most two blocks are gathered, or
one part outside them.

A freed parameter keeps its shape and its autograd identity: its storage is resized to nothing
and back (what torch's FSDP does), so the tensors forward saved for backward see the gathered
values again; the values are written through an alias of the storage, which leaves the
parameter's version counter (autograd's check of in-place changes) alone.
"""

from __future__ import annotations

import torch

from lattice.parallel.zero_layout import (EVERYWHERE, FIRST, LAST, MIDDLE, SHARED, Bucket, parts_freed,
                                          read_in_backward, rows_by_shard)


class ShardedWeights:
    """The gather-before-use, free-after lifecycle of the parameters in `buckets` (the
    optimizer's, planned by block), with hooks on the blocks of `model` and on the modules
    holding its other parameters. `start_gather(bucket, phase)`: the optimizer's all-gather of
    every rank's rows of the bucket in the weights' dtype (the master rows, rounded), started:
    (the gathered segments, the work), metered under `phase` where one is given.
    `accumulating`: a step runs several forwards before its reduction (micro-batches)."""

    def __init__(self, model, buckets: list[Bucket], start_gather, *, reshard_after_forward: bool = True,
                 reshard_microbatches: bool = False, prefetch: bool = True, accumulating: bool = False):
        self.start_gather, self.prefetch = start_gather, prefetch
        self.reshard_after_forward, self.reshard_microbatches = reshard_after_forward, reshard_microbatches
        self.units: dict[int, list[Bucket]] = {}
        for bucket in buckets:
            if bucket.shards > 1:  # (experts split over every replica axis: nothing is shared)
                self.units.setdefault(bucket.block, []).append(bucket)
        self.order = sorted(u for u in self.units if u >= 0)  # the blocks this rank holds, in running order
        # blocks gathered for (or by) their backward, until freed; parts gathered again for theirs,
        # until their next forward
        self.in_backward: set[int] = set()
        self.accumulating = accumulating  # more than one forward before the reduction (kept gathered)
        for piece in (piece for unit in self.units.values() for b in unit for piece in b.pieces):
            p = piece.param
            if p.untyped_storage().nbytes() != p.numel() * p.element_size() or not p.is_contiguous():
                p.data = p.data.clone()  # a storage of its own, to free and gather alone
            piece.alias = torch.empty(0, dtype=p.dtype, device=p.device).set_(p.untyped_storage(), 0, p.shape)
        root = getattr(model, "_model", model)
        blocks = root.pipeline_blocks()
        for u in self.order:
            blocks[u].register_forward_pre_hook(lambda module, args, u=u: self._before_block(u))
            blocks[u].register_forward_hook(lambda module, args, out, u=u: self._after_block(u, out))
        # the parts outside the blocks: freed between their uses where one pass makes a step
        self.parts_freed = parts_freed(model, 2 if accumulating else 1, reshard_after_forward)
        self.read = {u for u in (FIRST, MIDDLE) if u in self.units and read_in_backward(
            piece.param for b in self.units[u] for piece in b.pieces)}
        parts = root.parts()
        if parts is None:  # (every module holding one gathers them all: FIRST)
            held = {id(piece.param) for b in self.units.get(FIRST, ()) for piece in b.pieces}
            modules = [(m, FIRST) for m in root.modules() if any(id(p) in held for p in m.parameters(recurse=False))]
        else:
            modules = [(root.get_submodule(name), u) for u, names in
                       ((FIRST, parts.first), (MIDDLE, parts.middle), (LAST, parts.last)) for name in names]
        for module, u in modules:
            module.register_forward_pre_hook(lambda module, args, u=u: self._before_part(u))
            if u in self.read:
                module.register_forward_hook(lambda module, args, out, u=u: self._after_part(u, out))

    def accumulated(self, bucket: Bucket) -> None:
        """A gradient of the bucket accumulated, not for the last time this step: once each of
        them has as often (a micro-batch's backward through it is over), with
        `reshard_microbatches` a block's weights are freed until the next micro-batch's forward."""
        if (self.reshard_microbatches and bucket.block >= 0 and len(bucket.waiting) == len(bucket.pieces)
                and len(set(bucket.waiting.values())) == 1):
            self.free(bucket)

    # ---- one bucket
    @torch.no_grad()
    def _start(self, bucket: Bucket, phase: str | None) -> None:
        if not bucket.whole and bucket.gathering is None:
            bucket.gathering = self.start_gather(bucket, phase)

    @torch.no_grad()
    def _finish(self, bucket: Bucket, phase: str | None) -> None:
        self._start(bucket, phase)
        if bucket.gathering is None:
            return
        (gathered, work), bucket.gathering = bucket.gathering, None
        work.wait()
        for piece in bucket.pieces:
            p = piece.param
            p.untyped_storage().resize_(p.numel() * p.element_size())
            for _, rows, segment in rows_by_shard(piece.alias, piece.width, piece.offset, gathered):
                rows.copy_(segment)
        bucket.whole = True

    def free(self, bucket: Bucket) -> None:
        """Drop the bucket's whole parameters (its reduction has started, or its block ran)."""
        if bucket.shards == 1:
            return
        if bucket.gathering is not None:  # a prefetch nothing used
            bucket.gathering[1].wait()
            bucket.gathering = None
        if bucket.whole:
            for piece in bucket.pieces:
                piece.param.untyped_storage().resize_(0)
            bucket.whole = False
        if bucket.block >= 0 and bucket.block in self.in_backward and not any(b.whole for b in self.units[bucket.block]):
            self.in_backward.discard(bucket.block)

    def free_all(self) -> None:
        """Every parameter back to its rows (after the update: the whole ones are stale)."""
        for unit in self.units.values():
            for bucket in unit:
                self.free(bucket)
        self.in_backward.clear()

    def gather_all(self) -> None:
        """Every parameter whole, for readers other than a forward (full_state_dict, export)."""
        for u in self.units:
            self._gather_unit(u, None)

    # ---- one block
    def _gather_unit(self, u: int, phase: str | None) -> None:
        for bucket in self.units.get(u, ()):
            self._start(bucket, phase)
        for bucket in self.units.get(u, ()):
            self._finish(bucket, phase)

    def _prefetch(self, u: int, step: int, phase: str) -> None:
        at = self.order.index(u) + step
        if self.prefetch and 0 <= at < len(self.order):
            for bucket in self.units[self.order[at]]:
                self._start(bucket, phase)

    def _free_parts(self) -> None:
        """The parts outside the blocks but EVERYWHERE's dropped (a block starts, forward or
        backward: the parts before it have run, and the head's backward is over)."""
        if self.parts_freed:
            for u in (FIRST, MIDDLE, LAST, SHARED):
                for bucket in self.units.get(u, ()):
                    self.free(bucket)

    def _before_part(self, u: int) -> None:
        self.in_backward.discard(u)  # (a new pass: its backward comes)
        for unit in (u, SHARED, EVERYWHERE):
            self._gather_unit(unit, "forward")

    def _after_part(self, u: int, out) -> None:
        if self.parts_freed and torch.is_grad_enabled():  # its backward reads it: gathered again then
            self._on_gradient(out, lambda: self._before_part_backward(u))

    def _before_part_backward(self, u: int) -> None:
        if u not in self.in_backward:  # (once: not again after its reduction freed it)
            self.in_backward.add(u)
            self._gather_unit(u, "backward")

    def _before_block(self, u: int) -> None:
        if u in self.in_backward:  # its recomputation under activation checkpointing
            return
        self._free_parts()
        self._gather_unit(u, "forward")
        self._prefetch(u, 1, "forward")

    def _after_block(self, u: int, out) -> None:
        if u in self.in_backward:
            return
        if not torch.is_grad_enabled():  # (no backward follows)
            for bucket in self.units[u]:
                self.free(bucket)
            return
        if self.reshard_microbatches if self.accumulating else self.reshard_after_forward:
            for bucket in self.units[u]:
                self.free(bucket)
        # once the gradient of its output arrives: gathered again (where freed), and a
        # recomputation under activation checkpointing is told from a forward
        self._on_gradient(out, lambda: self._before_backward(u))

    @staticmethod
    def _on_gradient(out, call) -> None:
        """`call()` as the gradient of each of a module's outputs that require one arrives."""
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(lambda grad: call())

    def _before_backward(self, u: int) -> None:
        if u not in self.in_backward:
            self.in_backward.add(u)
            self._free_parts()
            self._gather_unit(u, "backward")
            self._prefetch(u, -1, "backward")
