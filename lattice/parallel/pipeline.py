"""Pipeline parallelism (Megatron-LM's PTD-P) around any model: its declared parts split into
stages by whole blocks, run by the schedules of `torch.distributed.pipelining` (GPipe, 1F1B,
interleaved 1F1B) on the process group of the `pp` mesh axis.

    ctx = lattice.init("1d", tp=2, pp=2, microbatches=4, pp_schedule="1f1b")   # 4 processes
    model = lattice.build_model(cfg, ctx)            # a PipelineModel: this rank's stages
    loss = model.forward_backward(tokens, targets)   # the replica's mean loss, on every rank

A model knows nothing of this: it declares its modules in order (`Model.parts()`: the first
part, the blocks, the last part; torchtitan's model_parts), and `PipelineModel` keeps the
parameters of this rank's stages and drops the others. A replica is tp x pp ranks. Stage s holds
blocks [a_s, b_s) (an even split, or `pp_layers`); the first stage also the first part (the
embedding), the last the last part (final norm and head; the loss is the schedule's loss
function). With interleaving, the model is cut into pp x v chunks and rank s holds chunks s, s +
pp, ... Every tensor-parallel rank sends its own piece of the residual stream to the same
tensor position of the next stage. A parameter of the first part that the last part uses too
(`Parts.shared`: a tied token table) is kept on the last stage as a mirror, updated like the
original (its gradient is summed with the first stage's before the optimizer step, as
Megatron does), so both stay equal.

Bubble: a fraction (p - 1) / m of a GPipe or 1F1B step idles, (p - 1) / (v m) interleaved
(Narayanan et al. 2021, docs/references.md#megatron-lm). 1F1B keeps at most p micro-batches' activations in flight
where GPipe keeps all m. The point-to-point traffic and the activations in flight are the cost
model's (lattice.cost).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.nn as nn

from lattice.parallel import comm
from lattice.parallel.context import LatticeConfigError, MeshAxis, ParallelContext, nearest_working
from lattice.parallel.context_parallel import check_context_batch, take_context_chunks
from lattice.parallel.sharding import collect_specs, sum_replica_grads

class _KeepOwnSlice(torch.autograd.Function):
    """Megatron's scatter/gather optimisation, sending side (docs/references.md#megatron-lm §4.1): the activation X,
    replicated over the t tensor ranks, leaves the stage as X_i, this rank's 1/t of the hidden
    dim. Forward: X -> X_i. Backward: all-gather the dX_i into dX (every rank then holds the
    whole gradient of the replicated X)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        t, i = dist.get_world_size(group), dist.get_rank(group)
        return x.chunk(t, dim=-1)[i].contiguous()

    @staticmethod
    def backward(ctx, g):
        return comm.raw_all_gather(g.contiguous(), ctx.group, dim=-1), None


class _GatherSlices(torch.autograd.Function):
    """Receiving side: X = [X_1 ... X_t] by an all-gather over the tensor ranks. Backward: keep
    this rank's slice dX_i of the (replicated) gradient."""

    @staticmethod
    def forward(ctx, x_slice, group):
        ctx.group = group
        return comm.raw_all_gather(x_slice.contiguous(), group, dim=-1)

    @staticmethod
    def backward(ctx, g):
        t, i = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        return g.chunk(t, dim=-1)[i].contiguous(), None


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the gradient contiguous: the schedule sends the gradient of a
    stage's input to the previous stage as it is, and point-to-point sends need contiguous
    tensors (sequence parallelism's layout produces strided ones)."""

    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, g):
        return g.contiguous()


# ----------------------------------------------------------------------------- stages
class StageModule(nn.Module):
    """One (virtual) stage of a model: its blocks, with the first part on the first stage and the
    last part's norm on the last (the head and loss are the schedule's loss function)."""

    def __init__(self, model, blocks: range, first: bool, last: bool, scatter_gather_group=None):
        super().__init__()
        self.model = [model]  # not a submodule: the stage registers only its own layers
        self.first, self.last, self.block_ids = first, last, blocks
        every = model.pipeline_blocks()
        self.blocks = nn.ModuleList(every[i] for i in blocks)
        self.sg_group = scatter_gather_group
        self.begin_step([])

    def begin_step(self, inputs: list[dict]) -> None:
        """What each micro-batch of the coming step takes beside its activation (its padding
        mask as attention reads it, its token types), in micro-batch order: every rank holds the
        replica's whole batch, and every schedule runs a stage's forwards in micro-batch order,
        so nothing of it travels between stages."""
        self.inputs, self.calls = inputs, 0

    def forward(self, *values):
        model = self.model[0]
        if model.training:  # a new micro-batch: new dropout masks (recomputation reuses this count)
            model.seeds.forward_count += 1
        inputs = self.inputs[self.calls] if self.inputs else {}
        self.calls += 1
        if not self.first:  # received activations (an encoder-decoder's decoder stages: and the memory)
            values = tuple(_ContiguousGrad.apply(v) for v in values)
            if self.sg_group is not None:
                scattered = model.boundary_scattered(self.block_ids[0] - 1)
                values = tuple(_GatherSlices.apply(v, self.sg_group) if s else v for v, s in zip(values, scattered))
        out = model.run_stage(values, self.block_ids, self.first, self.last, inputs)
        if self.last:
            return out[0]
        if self.sg_group is not None:
            scattered = model.boundary_scattered(self.block_ids[-1])
            out = tuple(_KeepOwnSlice.apply(v, self.sg_group) if s else v for v, s in zip(out, scattered))
        out = tuple(v.contiguous() for v in out)  # sent as they are to the next stage
        return out[0] if len(out) == 1 else out


class _MeteredStage:
    """Counts the point-to-point traffic the schedule issues for this stage (the tensors of its
    send operations), as CommMeter counts collectives."""

    @staticmethod
    def wrap(stage):
        for name, phase in (("get_fwd_send_ops", "forward"), ("get_bwd_send_ops", "backward")):
            original = getattr(stage, name)

            def metered(*args, _original=original, _phase=phase, **kwargs):
                ops = _original(*args, **kwargs)
                for op in ops:
                    comm.record("send", stage.group, op.tensor.numel(), op.tensor.dtype, phase=_phase)
                return ops

            setattr(stage, name, metered)
        return stage


def build_schedule(model, ctx, microbatch_loss, microbatch: torch.Tensor, target_len: int):
    """The torch.distributed.pipelining schedule running this rank's stages of `model`, with the
    tensors between stages declared up front (static mode): this rank's piece of the residual
    stream, whose shape the mode states (`Mode.residual_shape`), so nothing runs to infer it;
    and this rank's StageModules."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    pcfg = ctx.pipeline
    group = ctx.group(MeshAxis.PP)
    chunks = pcfg.chunks(len(model.pipeline_blocks()))
    n = len(chunks)
    dtype = model.dtype
    sg = scatter_gather_group(model.mode, ctx)
    parts = 1 if sg is None else dist.get_world_size(sg)

    def boundary(after: int, sent: bool) -> tuple[torch.Tensor, ...]:
        """The tensors crossing the stage boundary after block `after` (as sent: the scatter/
        gather slices), on the meta device; received ones require grad (their gradients go back)."""
        shapes = model.boundary_shapes(after, microbatch.shape[0], microbatch.shape[1], target_len)
        dtypes, scattered = model.boundary_dtypes(after), model.boundary_scattered(after)
        return tuple(torch.empty((*s[:-1], s[-1] // parts) if sent and cut else s, dtype=d or dtype, device="meta",
                                 requires_grad=True) for s, d, cut in zip(shapes, dtypes, scattered))

    stages, modules = [], []
    for c in range(ctx.stage, n, pcfg.stages):
        module = StageModule(model, chunks[c], first=c == 0, last=c == n - 1, scatter_gather_group=sg)
        inputs = (microbatch.to("meta"),) if c == 0 else boundary(chunks[c][0] - 1, True)
        outputs = boundary(chunks[c][-1], c < n - 1)
        outputs = tuple(t.detach() for t in (outputs[:1] if c == n - 1 else outputs))  # the last: the finished stream
        stage = PipelineStage(module, c, n, ctx.device, input_args=inputs, output_args=outputs,
                              input_grads=(None,) if c == 0 else inputs, output_grads=(None,) if c == n - 1 else outputs,
                              group=group)
        stages.append(_MeteredStage.wrap(stage))
        modules.append(module)
    if pcfg.schedule == "interleaved":
        schedule = ScheduleInterleaved1F1B(stages, n_microbatches=pcfg.m, loss_fn=microbatch_loss, scale_grads=False)
        return schedule, modules
    cls = ScheduleGPipe if pcfg.schedule == "gpipe" else Schedule1F1B
    return cls(stages[0], n_microbatches=pcfg.m, loss_fn=microbatch_loss, scale_grads=False), modules


def scatter_gather_group(mode, ctx):
    """The tensor ranks of this stage when its residual is replicated over them (1d without
    sequence parallelism) and the optimisation is on; else None."""
    if not (ctx.pipeline.scatter_gather and mode.residual_replicated and ctx.tp > 1):
        return None
    return ctx.tensor_group()


def microbatch_count(ctx: ParallelContext) -> int:
    """The micro-batches of a step: a pipeline's m, or without one those of gradient accumulation
    (`microbatches` with pp = 1: the replica batch in m forward and backward passes, one update)."""
    if ctx.pipeline is not None:
        return ctx.pipeline.m
    return ctx.layout.accumulation if ctx.layout is not None else 1


def microbatch_rows(n: int, m: int) -> list[slice]:
    """The rows of each of m micro-batches of a batch of n sequences (m divides n), in order."""
    size = n // m
    return [slice(i * size, (i + 1) * size) for i in range(m)]


def batch_problem(m: int, mode, ctx: ParallelContext, batch: int, seq: int) -> str | None:
    """Why a replica batch of `batch` sequences does not fit: the micro-batch count m does not
    divide it, or the tensor layout (`mode`, a Mode class, on `ctx`) cannot split its
    micro-batches; None when it fits."""
    if batch % m:
        return f"the replica batch of {batch} sequences does not split into {m} micro-batches"
    try:
        # the layout's own constraints, which read the tokens' shape alone (meta: nothing allocated, as
        # the planner asks this of thousands of candidates)
        mode.check_batch(ctx, torch.empty(batch // m, seq, dtype=torch.int64, device="meta"))
    except LatticeConfigError as e:
        problem = str(e).split("; ")[0]
        return f"its micro-batches of {batch // m}: {problem}" if m > 1 else problem
    return None


def check_batch(m: int, mode, ctx: ParallelContext, tokens: torch.Tensor) -> None:
    """Refuse a replica batch the micro-batch count does not divide, or whose micro-batches the
    tensor layout cannot split (every rank, before any collective), naming the replica batch
    sizes that work with everything else as given (found by trying them)."""

    b, seq = tokens.shape
    problem = batch_problem(m, mode, ctx, b, seq)
    if problem:
        works = nearest_working(b, lambda n: batch_problem(m, mode, ctx, n, seq) is None, 4 * b + 64)
        raise LatticeConfigError(f"{problem}; replica batches that work with everything else as given: "
                                 f"{' or '.join(map(str, works))}")


class PipelineModel(nn.Module):
    """This rank's pipeline stages of a model of `family`, with the model's interface:
    `forward_backward(tokens, targets)` runs the schedule (the replica's mean loss on every
    rank), `model(tokens, targets)` under torch.no_grad() evaluates through the stages, and
    loading, gathering and exporting full tensors work as on the whole model (each rank holds the
    parameters of its stages; `is_mirror` names the last stage's copies of shared ones)."""

    def __init__(self, family, cfg, ctx, *, dtype: torch.dtype = torch.float32, **recompute):
        super().__init__()
        planning = torch.empty(()).is_meta
        stage_ctx = dataclasses.replace(ctx, pipeline=None)  # the model sees its tensor layout only
        with torch.device("meta"):
            model = family(cfg, stage_ctx, dtype=dtype, **recompute)  # the model's recomputation flags
        parts = model.parts()
        if parts is None:
            raise LatticeConfigError(f"family {family.name!r} cannot be split into pipeline stages; use pp = 1 (any "
                                     f"tensor layout, with dp for more ranks)")
        self.ctx, self.pcfg, self.parts_ = ctx, ctx.pipeline, parts
        object.__setattr__(self, "_model", model)  # not a submodule: parameter names stay the model's
        self._keep_this_stage(model, parts)
        model.specs = collect_specs(model)
        self._schedules: dict[tuple, object] = {}
        self._grads_pending = False
        if not planning:
            model.materialize()

    def _keep_this_stage(self, model, parts) -> None:
        """Give every parameter its stage (the first part: the first; blocks: by the split; the
        last part: the last) as a holder along the pp axis, and drop the parameters of other
        stages from this rank, but for the last stage's mirrors of `parts.shared`."""
        ctx, pcfg = self.ctx, self.pcfg
        blocks = model.pipeline_blocks()
        chunks = pcfg.chunks(len(blocks))
        last = (len(chunks) - 1) % pcfg.stages
        stage_of: dict[int, int] = {}
        owners = [(model.get_submodule(name), 0) for name in parts.first]
        owners += [(blocks[i], c % pcfg.stages) for c, ids in enumerate(chunks) for i in ids]
        # an encoder-decoder's modules between the stacks: on the stage of the encoder's last block
        encoder_end = len(getattr(model, parts.blocks)) - 1
        middle = next(c for c, ids in enumerate(chunks) if encoder_end in ids) % pcfg.stages
        owners += [(model.get_submodule(name), middle) for name in parts.middle]
        owners += [(model.get_submodule(name), last) for name in parts.last]
        for owner, stage in owners:
            for module in owner.modules():
                if id(module) in stage_of:
                    raise ValueError(f"{model.name}.parts() names a module twice (under {type(owner).__name__})")
                stage_of[id(module)] = stage
        for prefix, module in model.named_modules():
            specs = getattr(module, "_lattice_specs", None)
            if not specs:
                continue
            if id(module) not in stage_of:
                raise ValueError(f"{model.name}.parts() leaves out the module {prefix!r}, which holds parameters")
            for name, spec in specs.items():
                staged = dataclasses.replace(spec, holders=spec.holders + ((MeshAxis.PP, stage_of[id(module)]),))
                specs[name] = staged
                full = f"{prefix}.{name}" if prefix else name
                mirror = spec.holds(ctx.coords) and ((full in parts.shared and ctx.stage == last) or
                                                     full in parts.everywhere)
                if not staged.holds(ctx.coords) and not mirror and module._parameters.get(name) is not None:
                    module._parameters[name] = None

    # ---- the model's interface
    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.__dict__["_model"], name)

    @property
    def family(self):
        return type(self._model)

    def named_parameters(self, *args, **kwargs):
        return self._model.named_parameters(*args, **kwargs)

    def parameters(self, recurse: bool = True):
        return self._model.parameters(recurse)

    def train(self, mode: bool = True):
        super().train(mode)
        self._model.train(mode)
        return self

    @property
    def summed_between_stages(self) -> tuple[str, ...]:
        """The parameters whose gradients `sync_grads` sums over the stages (a shared table and
        its mirror, copies on every stage): complete only after the schedule."""
        return tuple(self.parts_.shared) + tuple(self.parts_.everywhere)

    def is_mirror(self, name: str) -> bool:
        """A parameter this rank keeps as a copy of another stage's (the tied table on the last
        stage): it trains like the original but counts only once."""
        return not self._model.specs[name].holds(self.ctx.coords)

    def forward(self, tokens, targets=None, *, attention_mask=None, token_types=None, position_ids=None, cache=None,
                **_):
        if cache is not None:
            raise LatticeConfigError("generation runs without pipeline parallelism: load the checkpoint with pp = 1 "
                                     "(any tensor layout) to generate")
        if torch.is_grad_enabled():
            raise LatticeConfigError("with pipeline parallelism a training step is model.forward_backward(tokens, "
                                     "targets); model(tokens, targets) evaluates, under torch.no_grad()")
        if targets is None:
            raise LatticeConfigError("with pipeline parallelism model(tokens, targets) returns the loss only; full "
                                     "logits need pp = 1")
        loss = self._run(tokens, targets, train=False, attention_mask=attention_mask, token_types=token_types,
                         position_ids=position_ids)
        return torch.tensor(loss, dtype=torch.promote_types(self._model.dtype, torch.float32))

    def generate(self, *args, **kwargs):
        raise LatticeConfigError("generation runs without pipeline parallelism: load the checkpoint with pp = 1 "
                                 "(any tensor layout) to generate")

    def forward_backward(self, tokens: torch.Tensor, targets: torch.Tensor, *, attention_mask=None,
                         token_types=None, position_ids=None) -> float:
        """Forward and backward of the replica batch through the schedule, with the in-replica
        gradient sums; the mean loss over its labelled targets, identical on every rank of the
        replica (`attention_mask`, `token_types`, `position_ids`: as Model.forward takes them)."""
        loss = self._run(tokens, targets, train=True, attention_mask=attention_mask, token_types=token_types,
                         position_ids=position_ids)
        self._grads_pending = True
        self.sync_grads()
        return loss

    def _run(self, tokens, targets, *, train: bool, attention_mask=None, token_types=None, position_ids=None) -> float:
        model, pcfg, ctx = self._model, self.pcfg, self.ctx
        check_context_batch(ctx, tokens, targets)
        model.check_inputs(tokens, targets)
        model.check_padding(tokens, 0, attention_mask, token_types, position_ids)
        check_batch(pcfg.m, model.mode, model.mode.ctx, tokens[:, :tokens.shape[1] // ctx.cp])
        size = len(tokens) // pcfg.m
        target_len = targets.shape[1] if targets.dim() == 2 else tokens.shape[1]  # an encoder-decoder's differs
        model.mode.begin_batch(model, size, max(tokens.shape[1], target_len) // ctx.cp)
        key = (*tokens.shape, target_len)  # the stages' shapes follow the batch's
        if key not in self._schedules:
            self._schedules[key] = build_schedule(model, ctx, self._microbatch_loss,
                                                  tokens[:size, :tokens.shape[1] // ctx.cp], target_len // ctx.cp)
        schedule, modules = self._schedules[key]
        targets = model.unpadded_targets(targets, attention_mask)
        # each micro-batch's mean weighted by its share of the labelled targets: the replica's mean
        # (under cp, of the whole sequences: the ranks' parts are summed over cp below)
        self._labelled = int(model.labelled_count(targets))
        rows = microbatch_rows(len(tokens), pcfg.m)
        inputs = [model.microbatch_inputs(tokens[r], targets[r], *(None if t is None else t[r]
                                                                   for t in (attention_mask, token_types, position_ids)))
                  for r in rows]
        # each micro-batch's share over all its chunks, for what the family adds to its loss (in order:
        # micro-batches reach the last stage's loss one after the other)
        self._whole_shares = [int(model.labelled_count(targets[r])) / self._labelled for r in rows]
        tokens, targets = take_context_chunks(ctx, tokens, targets)  # under cp, this rank's chunks
        for module in modules:
            module.begin_step(inputs)
        first, last = ctx.stage == 0, ctx.stage == pcfg.stages - 1
        losses: list[torch.Tensor] = []
        args = (tokens,) if first else ()
        kwargs = {"target": targets, "losses": losses} if last else {}
        (schedule.step if train else schedule.eval)(*args, **kwargs)
        return self._loss_to_replica(torch.stack(losses).sum() if last else None)

    def _microbatch_loss(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        model, whole = self._model, self._whole_shares.pop(0)
        head = model.head_loss(x, targets)
        share = model.labelled_count(targets).to(head.dtype) / self._labelled  # (under cp: of this rank's chunks)
        if self.ctx.cp == 1:
            return model.with_auxiliary_loss(head) * share
        # under cp the family's term (a balancing loss) is the whole micro-batch's: each rank's value
        # counts its chunks' share of it, its gradient (of this rank's own part) the micro-batch's
        extra = model.with_auxiliary_loss(head) - head
        return head * share + extra * whole + (extra * (share - whole)).detach()

    def _loss_to_replica(self, loss: torch.Tensor | None) -> float:
        """The last stage's loss, broadcast to every stage of the replica."""
        ctx, dtype = self.ctx, torch.promote_types(self._model.dtype, torch.float32)
        buf = (loss.detach().reshape(1).to(dtype, copy=True) if loss is not None
               else torch.zeros(1, dtype=dtype, device=ctx.device))
        # group rank = pp coordinate (Topology keeps ranks increasing along every axis)
        buf = comm.raw_broadcast(buf, ctx.group(MeshAxis.PP), src=self.pcfg.stages - 1)
        return float(comm.raw_all_reduce(buf, ctx.group(MeshAxis.CP)))  # under cp, each rank's part of the mean

    def sync_grads(self) -> None:
        """The model's in-replica gradient sums over its tensor axes, and the gradients of shared
        parameters summed between the first stage and the last, so that the table and its
        mirror take the same step."""
        if self._grads_pending:
            sum_replica_grads(self._model)
            self._sum_shared_grads()
            self._grads_pending = False

    def full_grad_dict(self) -> dict[str, torch.Tensor]:
        self.sync_grads()
        return self._model.gather_grads()

    @torch.no_grad()
    def _sum_shared_grads(self) -> None:
        ctx = self.ctx
        params = dict(self._model.named_parameters())
        for name in self.parts_.everywhere:  # a copy on every stage: the sum over the pipeline
            p = params.get(name)
            if p is not None:
                grad = p.grad if p.grad is not None else torch.zeros_like(p)
                p.grad = comm.raw_all_reduce(grad.contiguous(), ctx.group(MeshAxis.PP), phase="backward")
        if not self.parts_.shared or ctx.stage not in (0, self.pcfg.stages - 1):
            return
        group = ctx.group(MeshAxis.PP) if self.pcfg.stages == 2 else ctx.embedding_group
        for name in self.parts_.shared:
            p = params.get(name)
            if p is None:
                continue  # a tensor rank that holds no part of the table (never the case in the built-in modes)
            grad = p.grad if p.grad is not None else torch.zeros_like(p)
            p.grad = comm.raw_all_reduce(grad.contiguous(), group, phase="backward")
