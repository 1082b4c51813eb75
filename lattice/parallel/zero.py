"""A distributed optimizer over the data-parallel axis (ZeRO stages 1, 2 and 3; Megatron-LM's
distributed optimizer): AdamW whose moments each dp rank keeps for its 1/d of every parameter
(under context parallelism, each of the dp x cp ranks its 1/(d·cp)).

    optimizer = ZeroOptimizer(model, ctx, lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, stage=1)
    loss = model(x, y); loss.backward()        # buckets reduce-scatter as their gradients are ready
    model.sync_grads(); optimizer.reduce_grads()
    norm = optimizer.grad_norm(); optimizer.clip(norm, 1.0); optimizer.step()   # then all-gather

What a dp rank owns: of each parameter's local shard (its tensor-parallel piece), the rows
r·⌈R/d⌉ … (r+1)·⌈R/d⌉ - 1 of dim 0 (R rows, d replicas, r this rank's dp coordinate), so its
piece of every parameter is one rectangle of the full tensor, the same whichever tensor layout
or bucket the parameter is in: checkpoints key the moments by serial name and offset and DCP
reshards them like any other shard.

The pair per bucket of gradients, with g_k replica k's gradient and P_r the rows rank r owns:
    backward:  reduce-scatter  ĝ_r = (1/d) Σ_k P_r g_k            (started by the bucket's last
                                                                   gradient hook, as DDP does)
    step:      AdamW on (w_r, ĝ_r) with w_r = P_r w, then all-gather w = [w_0; …; w_{d-1}]
A bucket is laid out rank-major (every parameter's rows of rank 0, padded to ⌈R/d⌉ rows, then
rank 1's, ...), so reduce-scatter hands each rank exactly its rows; the reduce-scatter and the
all-gather together move the words of the all-reduce they replace (2(d-1)/d per element).

Stage 2 also drops each full gradient once its bucket is reduced, so only the 1/d slices stay
until the step. Parameters whose gradient a later sum completes (`ShardSpec.grad_sum`, the
in-replica sums of sync_grads, a pipeline's sums between stages) sit in buckets that
`reduce_grads` starts after those sums; under context parallelism, whose sums over cp complete
every gradient, every bucket starts there. Under a pipeline schedule, whose micro-batches
accumulate, a bucket starts once each of its gradients accumulated m times: in the last
micro-batch's backward, while the schedule drains.

bf16 weights (`--precision bf16`) get fp32 master rows: gradients are reduced in fp32 (bf16 as
an option), AdamW updates the master rows and their moments, and the updated rows are rounded
into the bf16 weights before the all-gather. Stage 0 is that without ZeRO: one shard, every rank
owns every row and the buckets are all-reduced.

Memory per parameter with fp32 weights (4 weight + 4 gradient + 8 moments = 16 bytes without
ZeRO): stage 1 keeps 8 + 8/d, stage 2 4 + 12/d (the gradient is also split). The fp32 weight
is its own master copy: the piece AdamW updates is a view into the parameter. With bf16 weights:
18, 4 + 16/d, 2 + 16/d (see `memory_per_rank`).

Stage 3 keeps the owned rows alone between uses, as master rows (16/d bytes with fp32 or bf16
weights), and gathers each block's weights around its forward and backward
(lattice.parallel.zero3) instead of all-gathering the updated weights after the step.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from lattice.parallel.comm import unmetered_all_gather, unmetered_reduce_scatter, raw_all_reduce, record
from lattice.parallel.context import LatticeConfigError, MeshAxis
from lattice.parallel.param_gather import ParamGatherOverlap
from lattice.parallel.sharding import GRAD_BUCKET_BYTES, weighted_square_sum
from lattice.parallel.zero3 import ShardedWeights
from lattice.parallel.zero_layout import (Bucket, Piece, block_of, owned_rows, plan_buckets, rows_by_shard, rows_of,
                                          rows_per_shard, sharers, split_order, zero_shards, zero_split)

ZERO_STAGES = (0, 1, 2, 3)  # 0: every replica keeps the whole optimizer state; 3: and the weights are split
LOW_PRECISION = (torch.bfloat16, torch.float16)  # weights that get fp32 master rows in the optimizer


def decays(full_shape) -> bool:
    """AdamW's weight decay applies to matrices only: a tensor whose FULL shape has >= 2 dims (a
    rank's 1-d shard of a matrix still decays; a sharded bias does not)."""
    return len(full_shape) >= 2


def adamw(decay: list, no_decay: list, *, lr: float, betas: tuple[float, float],
          weight_decay: float) -> torch.optim.AdamW:
    """torch's AdamW in its fused form (one operator over all of a group's tensors, on the CPU and
    on CUDA): the same update element by element as the default loop, which on the CPU took 3.6x as
    long for gpt2 `small`'s 52 tensors (7.3 against 2.0 ms) and 5.4x for 100 smaller ones. Plain
    training (lattice.training.optim), the distributed optimizer below and the cost model's
    calibration all step this one. One group each even when empty, so that the learning rate is
    set alike on every rank."""
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=betas, fused=True)


class ZeroOptimizer:
    """AdamW (decay on matrices only, as lattice.training.optim.make_optimizer) with its state split over
    the data-parallel replicas. `stage` 1 splits the moments, 2 also the gradients, 3 also the
    weights (`reshard_after_forward`, `reshard_microbatches`: lattice.parallel.zero3's, where
    `overlap_param_gather` prefetches the next block's weights), 0 nothing (for the fp32 master
    rows of bf16 weights alone). `hooks`: start each bucket's reduction
    from backward, once each of its gradients accumulated `accumulations` times (a pipeline's
    micro-batches: in the last one's backward). `grad_scale`: multiplies the gradients as a
    bucket lays them out (the Trainer's weight of a replica's share of the labelled targets,
    under a pipeline, where it cannot weight the loss).
    `reduce_dtype`: of the gradient reduction (default the master rows'). `overlap_param_gather`:
    the all-gather of updated weights runs beside the next forward (lattice.parallel.param_gather);
    read the weights other than by a forward only after `finish_param_gathers()`."""

    def __init__(self, model, ctx, *, lr: float, betas: tuple[float, float], weight_decay: float, stage: int = 1,
                 hooks: bool = True, bucket_bytes: int = GRAD_BUCKET_BYTES, reduce_dtype: torch.dtype | None = None,
                 cp_summed: bool = True, overlap_param_gather: bool = False, accumulations: int = 1,
                 reshard_after_forward: bool = True, reshard_microbatches: bool = False):
        if stage not in ZERO_STAGES:
            raise LatticeConfigError(f"zero stage must be 0 (nothing split), 1 (optimizer state), 2 (and gradients) or "
                                     f"3 (and weights), got {stage}")
        self.model, self.ctx, self.stage, self.accumulations, self.grad_scale = model, ctx, stage, accumulations, 1.0
        # the ranks that hold the same shards of other tokens: the dp replicas and, under context
        # parallelism, the cp ranks of each (Megatron's data-parallel group with cp); the
        # reduction averages over dp and sums over cp, unless sync_grads summed over cp already
        # (`cp_summed`: model.forward_backward's, a pipeline's; the Trainer's backward leaves it)
        self.dp, self.group, self.cp_summed = ctx.dp, ctx.group(MeshAxis.DP, MeshAxis.CP), cp_summed
        # stage 0 (mixed precision without ZeRO): one shard, every rank owns every row
        self.shards, self.shard = zero_shards(ctx) if stage else (1, 0)
        self.param_dtype = model.dtype
        self.master_dtype = torch.float32 if self.param_dtype in LOW_PRECISION else self.param_dtype
        self.reduce_dtype = reduce_dtype or self.master_dtype
        # (stage 3's master rows are the only copy of the weights between uses)
        self.separate_masters = self.master_dtype != self.param_dtype or stage == 3
        params = dict(model.named_parameters())
        block = block_of(model, params) if stage == 3 else {}
        self.buckets: list[Bucket] = []
        decay, no_decay = [], []
        itemsize = self.reduce_dtype.itemsize  # a bucket's bytes are those of its reduction
        for late, names, segment, split in plan_buckets(model, self.shards, bucket_bytes, itemsize=itemsize,
                                                        cp_summed=cp_summed, by_block=stage == 3):
            # parameters split over replica axes (an MoE's experts): only the others' ranks share them
            shards, shard = zero_split(ctx, split, self.shards, self.shard)
            group = ctx.group(*sharers(split))
            pieces, offset = [], 0
            for name in names:
                p = params[name]
                rows, width = rows_of(p.shape)
                r0, r1 = owned_rows(rows, shards, shard)
                piece = Piece(name, p, r0, r1, rows_per_shard(rows, shards), width, offset)
                offset += piece.per * width
                if piece.numel:
                    piece.master = p.detach().view(rows, width)[r0:r1]
                    if self.master_dtype != self.param_dtype or (stage == 3 and shards > 1):  # fp32 master rows of
                        # bf16 weights; ZeRO-3's rows of weights it frees
                        piece.master = piece.master.to(self.master_dtype, copy=True)
                    (decay if decays(model.specs[name].full_shape) else no_decay).append(piece.master)
                pieces.append(piece)
            self.buckets.append(Bucket(pieces, segment, late, shards, shard, group, split, block.get(names[0], -1)))
        self.pieces = {piece.name: piece for b in self.buckets for piece in b.pieces}
        self.inner = adamw(decay, no_decay, lr=lr, betas=betas, weight_decay=weight_decay)
        if hooks:
            for bucket in self.buckets:
                if not bucket.late:
                    for piece in bucket.pieces:
                        piece.param.register_post_accumulate_grad_hook(
                            lambda p, bucket=bucket: self._grad_ready(bucket, p))
        self._next = 0  # the first bucket not launched yet: buckets start in plan order on every rank
        self._arm()
        self.overlap = self.sharded = None
        if stage == 3:
            def start_gather(bucket, phase):  # every rank's rows of the weights, rounded from the master rows
                return self._start_gather(bucket, lambda piece: piece.master.to(self.param_dtype), self.param_dtype, phase)
            self.sharded = ShardedWeights(model, self.buckets, start_gather, prefetch=overlap_param_gather,
                                          reshard_after_forward=reshard_after_forward,
                                          reshard_microbatches=reshard_microbatches, accumulating=accumulations > 1)
            model.register_state_dict_pre_hook(lambda *_: self.gather_params())
            self.sharded.free_all()  # (the master rows hold the weights now)
        elif overlap_param_gather and self.shards > 1:
            bucket_of = {id(piece.param): i for i, b in enumerate(self.buckets) for piece in b.pieces}
            self.overlap = ParamGatherOverlap(getattr(model, "_model", model), bucket_of, len(self.buckets))
            model.register_state_dict_pre_hook(lambda *_: self.finish_param_gathers())

    # ---- torch.optim.Optimizer's face, for the trainer and checkpoints
    @property
    def param_groups(self):
        return self.inner.param_groups

    @property
    def state(self):
        return self.inner.state

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.model.parameters():
            p.grad = None
        for piece in self.pieces.values():
            if piece.master is not None:
                piece.master.grad = None
        self._arm()

    def _arm(self) -> None:
        for bucket in self.buckets:
            bucket.waiting = {id(piece.param): self.accumulations for piece in bucket.pieces}
            bucket.flat = bucket.reduced = bucket.work = None
            bucket.launched = False
        self._next = 0

    # ---- gradients
    def _grad_ready(self, bucket: Bucket, param) -> None:
        left = bucket.waiting.get(id(param))
        if left is None:  # accumulated after its bucket's reduction started: that gradient would be lost
            name = next(piece.name for piece in bucket.pieces if piece.param is param)
            raise RuntimeError(f"{name}'s gradient accumulated more than accumulations={self.accumulations} times in "
                               f"one step; pass ZeroOptimizer(accumulations=...) the backward passes of a step")
        if left > 1:
            bucket.waiting[id(param)] = left - 1
            if self.sharded is not None:
                self.sharded.accumulated(bucket)
            return
        del bucket.waiting[id(param)]
        while self._next < len(self.buckets):  # launch in plan order, as far as the ready ones go
            nxt = self.buckets[self._next]
            if nxt.late or nxt.waiting:
                break
            self._launch(nxt)
            self._next += 1

    @torch.no_grad()
    def _launch(self, bucket: Bucket) -> None:
        """Lay the bucket's gradients out rank-major, averaged, in the reduction dtype, and start
        their reduce-scatter (an all-reduce with one shard)."""
        dtype = self.reduce_dtype
        flat = torch.zeros(bucket.shards, bucket.segment, dtype=dtype, device=self.ctx.device)
        for piece in bucket.pieces:
            grad = piece.param.grad
            if grad is None:
                continue  # a parameter this step did not use: zeros
            for _, rows, segment in rows_by_shard(grad, piece.width, piece.offset, flat):
                segment.copy_(rows)
            if self.stage != 1:  # stage 2 keeps the slices alone; stage 0 the reduced copy alone
                piece.param.grad = None
        if self.grad_scale != 1.0:
            flat.mul_(self.grad_scale)
        # the average over dp, and over cp where sync_grads summed cp copies (not of experts split over cp)
        divisor = self.dp * (self.ctx.cp if self.cp_summed and MeshAxis.CP not in bucket.split else 1)
        if divisor > 1:
            flat.div_(divisor)
        if bucket.shards > 1:
            bucket.reduced = torch.empty(bucket.segment, dtype=dtype, device=self.ctx.device)
            record("reduce_scatter", bucket.group, flat.numel(), dtype, phase="backward")
            bucket.work = unmetered_reduce_scatter(bucket.reduced, flat.view(-1), group=bucket.group, async_op=True)
            bucket.flat = flat  # alive until the reduction is done
        else:
            bucket.reduced = flat.view(-1)
            if bucket.group is not None:
                record("all_reduce", bucket.group, flat.numel(), dtype, phase="backward")
                bucket.work = dist.all_reduce(bucket.reduced, group=bucket.group, async_op=True)
        bucket.launched = True
        if self.sharded is not None:  # its weights' last reader has run
            self.sharded.free(bucket)

    @torch.no_grad()
    def reduce_grads(self) -> None:
        """Start the buckets backward did not (those sync_grads completes, those with a missing
        gradient, every one under a pipeline), wait for all, and hand each owned piece its
        averaged gradient. Call after backward and `model.sync_grads()`."""
        for bucket in self.buckets:
            if not bucket.launched:
                self._launch(bucket)
        for bucket in self.buckets:
            if bucket.work is not None:
                bucket.work.wait()
            bucket.flat = bucket.work = None
            for piece in bucket.pieces:
                if piece.master is None:
                    continue
                reduced = bucket.reduced[piece.offset:piece.offset + piece.numel].view_as(piece.master)
                if reduced.dtype != self.master_dtype:  # a bf16 reduction for fp32 master rows
                    reduced = reduced.to(self.master_dtype)
                elif self.stage == 1 and not self.separate_masters:
                    # the full gradient stays: its own rows take the average, no second copy
                    p = piece.param
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
                    rows = p.grad.view(-1, piece.width)[piece.r0:piece.r1]
                    rows.copy_(reduced)
                    reduced = rows
                piece.master.grad = reduced
            if self.stage == 1 and not self.separate_masters:
                bucket.reduced = None

    @torch.no_grad()
    def grad_norm(self) -> torch.Tensor:
        """The global L2 norm of the full gradient from the owned pieces, identical on every
        rank: each piece counts 1/(ranks of the replica holding the same shard), a pipeline
        mirror not at all; summed over the dp group (when split over it), then over the model
        replica's. Pieces split over the replicas (an MoE's experts) add up over them too."""
        acc, topo = torch.promote_types(self.model.dtype, torch.float32), self.ctx.topology
        kinds = sorted({spec.replica_splits for spec in self.model.specs.values() if spec.trainable}, key=split_order)
        sums = []
        for split in kinds:  # (the same on every rank: the model's specs)
            sq = weighted_square_sum([(p.master.grad, self.model.specs[p.name].replicas(topo)) for b in self.buckets
                                      if b.split == split for p in b.pieces
                                      if p.master is not None and not self.model.is_mirror(p.name)], acc, self.ctx.device)
            # (with one shard every replica holds every row; a cp rank's rows count 1/cp, the replica's sum has cp)
            sums.append(raw_all_reduce(sq, self.ctx.group(*sharers(split))) if self.shards > 1 else sq)
        if any(MeshAxis.DP in split for split in kinds):  # the replicas' own pieces add up, the rest counts once
            sums = [raw_all_reduce(sum(sq if MeshAxis.DP in split else sq / self.dp for sq, split in zip(sums, kinds)),
                                   self.ctx.group(MeshAxis.DP))]
        return raw_all_reduce(sum(sums), self.ctx.model_group()).reshape(()).sqrt()

    @torch.no_grad()
    def clip(self, norm: torch.Tensor, max_norm: float) -> None:
        """Scale the owned gradients by min(1, max_norm / norm), as lattice.training.optim.clip_grads."""
        torch.nn.utils.clip_grads_with_norm_([piece.master for piece in self.pieces.values() if piece.master is not None],
                                             max_norm, norm, foreach=True)

    # ---- the update
    @torch.no_grad()
    def step(self) -> None:
        """AdamW on the owned rows (fp32 master rows of bf16 weights are then rounded into the
        weights), then every replica gathers every rank's updated rows (beside the next forward
        with `overlap_param_gather`)."""
        self.finish_param_gathers()
        self.inner.step()
        if self.separate_masters:
            self.params_from_masters()
        else:
            self._gather_rows()

    @torch.no_grad()
    def params_from_masters(self) -> None:
        """Round the master rows into the weights and gather every shard's (after an update, or
        after a checkpoint was read into the master rows)."""
        for piece in self.pieces.values():
            if piece.master is not None and piece.alias is None:  # (ZeRO-3's freed weights: gathered where read)
                piece.param.detach().view(-1, piece.width)[piece.r0:piece.r1] = piece.master
        if self.sharded is not None:
            self.sharded.free_all()
        else:
            self._gather_rows()

    @torch.no_grad()
    def _gather_rows(self) -> None:
        if self.shards == 1:
            return
        self.finish_param_gathers()
        for i in (range(len(self.buckets)) if self.overlap is None else self.overlap.issue_order()):
            bucket = self.buckets[i]
            if bucket.shards == 1:  # (experts split over the replicas without cp: every row its own)
                continue
            gathered, work = self._start_gather(
                bucket, lambda piece: piece.param.detach().view(-1, piece.width)[piece.r0:piece.r1], self.param_dtype,
                phase="optimizer")
            finish = functools.partial(self._take_rows, bucket, gathered, work)
            if self.overlap is None:
                finish()
            else:
                self.overlap.start(i, finish)

    @torch.no_grad()
    def _take_rows(self, bucket: Bucket, gathered: torch.Tensor, work) -> None:
        """Copy the other ranks' updated rows of the bucket into the weights, once gathered."""
        if work is not None:
            work.wait()
        for piece in bucket.pieces:
            for r, rows, segment in rows_by_shard(piece.param.detach(), piece.width, piece.offset, gathered):
                if r != bucket.shard:
                    rows.copy_(segment)

    def gather_params(self) -> None:
        """Stage 3: every weight whole, for a reader or writer other than a forward (the next
        reduction frees them again)."""
        if self.sharded is not None:
            self.sharded.gather_all()

    def finish_param_gathers(self) -> None:
        """Await every all-gather of updated weights still running (`overlap_param_gather`),
        for a reader of the weights other than the forward."""
        if self.overlap is not None:
            self.overlap.finish()

    def _gather(self, bucket: Bucket, owned, dtype, phase: str | None = None) -> torch.Tensor:
        """(shards, segment): every dp rank's segment of the bucket, each holding `owned(piece)`
        (this rank's rows of each parameter, or None for zeros); metered when `phase` is given."""
        gathered, work = self._start_gather(bucket, owned, dtype, phase)
        if work is not None:
            work.wait()
        return gathered

    def _start_gather(self, bucket: Bucket, owned, dtype, phase: str | None = None):
        """`_gather`'s all-gather, started: (its output, the work to await before reading it;
        None with one shard)."""
        mine = torch.zeros(bucket.segment, dtype=dtype, device=self.ctx.device)
        for piece in bucket.pieces:
            rows = owned(piece) if piece.master is not None else None
            if rows is not None:
                mine[piece.offset:piece.offset + piece.numel] = rows.reshape(-1)
        if bucket.shards == 1:
            return mine.view(1, -1), None
        gathered = torch.empty(bucket.shards, bucket.segment, dtype=dtype, device=self.ctx.device)
        if phase is not None:
            record("all_gather", bucket.group, gathered.numel(), dtype, phase=phase)
        return gathered, unmetered_all_gather(gathered.view(-1), mine, group=bucket.group, async_op=True)

    @torch.no_grad()
    def masters_from_params(self) -> None:
        """Take the weights as they are now (after weights were loaded into the model) as the
        master rows."""
        self.finish_param_gathers()
        if self.separate_masters:
            for piece in self.pieces.values():
                if piece.master is not None:
                    piece.master.copy_(piece.param.detach().view(-1, piece.width)[piece.r0:piece.r1])

    # ---- the state, for checkpoints
    def checkpoint_tensors(self, with_moments: bool):
        """(key, name, tensor, first row) of what a checkpoint keeps of this rank: the weights
        (under bf16, its fp32 master rows instead), and its rows of both AdamW moments when
        `with_moments`; a tensor holds the rows [first row, first row + len) of the parameter's
        local shard, shaped like them."""
        self.finish_param_gathers()
        for piece in self.pieces.values():
            if not self.separate_masters:
                yield f"model/{piece.name}", piece.name, piece.param.detach(), 0
            if piece.master is None:
                continue
            shape = (piece.r1 - piece.r0,) + tuple(piece.param.shape[1:])
            if self.separate_masters:
                yield f"model/{piece.name}", piece.name, piece.master.view(shape), piece.r0
            state = self.inner.state.get(piece.master)
            if with_moments and state:
                for key in ("exp_avg", "exp_avg_sq"):
                    yield f"optimizer/{key}/{piece.name}", piece.name, state[key].view(shape), piece.r0

    def prepare_moments(self, step: int) -> None:
        """Zero moments at optimizer step `step`, for a checkpoint to be read into."""
        self.inner.state.clear()
        for piece in self.pieces.values():
            if piece.master is not None:
                self.inner.state[piece.master] = {"step": torch.tensor(float(step)),
                                                  "exp_avg": torch.zeros_like(piece.master),
                                                  "exp_avg_sq": torch.zeros_like(piece.master)}

    @torch.no_grad()
    def full_local_moments(self) -> dict[str, dict[str, torch.Tensor | None]]:
        """{key: {name: this rank's whole local shard of the moment}}, gathered over dp (a
        collective over the dp group; None before the first step), for comparisons and export."""
        self.finish_param_gathers()
        out = {"exp_avg": {}, "exp_avg_sq": {}}
        stepped = any(self.inner.state.values())
        for bucket in self.buckets:
            for key in out:
                gathered = self._gather(bucket, lambda piece: (self.inner.state.get(piece.master) or {}).get(key),
                                        self.master_dtype)
                for piece in bucket.pieces:
                    full = torch.empty(piece.param.shape, dtype=self.master_dtype, device=self.ctx.device)
                    for _, rows, segment in rows_by_shard(full, piece.width, piece.offset, gathered):
                        rows.copy_(segment)
                    out[key][piece.name] = full if stepped else None
        return out
