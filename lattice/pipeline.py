"""Pipeline parallelism (Megatron-LM's PTD-P): the GPT split into stages by whole blocks, run
by the schedules of `torch.distributed.pipelining` (GPipe, 1F1B, interleaved 1F1B) on the
process group of the `pp` mesh axis.

    ctx = lattice.init("1d", tp=2, pp=2, microbatches=4, pp_schedule="1f1b")   # 4 processes
    model = lattice.GPT(cfg, ctx)
    loss = model.forward_backward(tokens, targets)   # the replica's mean loss, on every rank

A replica is tp x pp ranks. Stage s holds blocks [a_s, b_s) (an even split, or `pp_layers`);
the first stage also the embedding, the last the final LayerNorm and the LM head (the loss is the
schedule's loss function). With interleaving, the model is cut into pp x v chunks and rank s
holds chunks s, s + pp, ... Every tensor-parallel rank sends its own piece of the residual
stream to the same tensor position of the next stage. With tied embeddings the last stage keeps
a mirror of the token table, updated like the original (its gradient is summed with the first
stage's before the optimizer step, as Megatron does), so both stay equal.

Bubble: a fraction (p - 1) / m of a GPipe or 1F1B step idles, (p - 1) / (v m) interleaved
(Narayanan et al. 2021, papers/002). 1F1B keeps at most p micro-batches' activations in flight
where GPipe keeps all m.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from lattice import comm
from lattice.context import LatticeConfigError, MeshAxis

SCHEDULES = ("gpipe", "1f1b", "interleaved")


@dataclass(frozen=True)
class PipelineConfig:
    """How a replica's pp stages run: `microbatches` per step (default pp), the `schedule`, the
    virtual stages per rank (`virtual`, interleaved only; default 2) and an optional explicit
    split (`layers`: blocks per stage, or per virtual stage with interleaving)."""

    stages: int
    microbatches: int | None = None
    schedule: str = "1f1b"
    virtual: int | None = None
    layers: tuple[int, ...] | None = None
    #: send 1/t of a residual replicated over t tensor ranks and all-gather it on arrival
    scatter_gather: bool = True

    def __post_init__(self):
        if self.schedule not in SCHEDULES:
            raise LatticeConfigError(f"pp_schedule must be one of {list(SCHEDULES)}, got {self.schedule!r}")
        m = self.microbatches
        if m is not None and (not isinstance(m, int) or m < 1):
            raise LatticeConfigError(f"microbatches must be a positive integer, got {m!r}")
        if self.virtual is not None and self.schedule != "interleaved":
            raise LatticeConfigError(f"pp_virtual applies to the interleaved schedule; got pp_schedule "
                                     f"{self.schedule!r}: drop pp_virtual or use pp_schedule='interleaved'")
        if self.schedule == "1f1b" and self.m < self.stages:
            raise LatticeConfigError(f"1F1B needs at least pp = {self.stages} micro-batches, got {self.m}: use "
                                     f"--microbatches {self.stages} or more, or pp_schedule 'gpipe'")
        if self.schedule == "interleaved":
            if self.v < 2:
                raise LatticeConfigError(f"the interleaved schedule needs pp_virtual >= 2 stages per rank, got {self.v}")
            if self.stages < 2:
                raise LatticeConfigError("the interleaved schedule needs pp >= 2")
            if self.m % self.stages:
                raise LatticeConfigError(
                    f"the interleaved schedule needs a multiple of pp = {self.stages} micro-batches (as Megatron-LM), "
                    f"got {self.m}: use --microbatches {max(self.stages, self.m - self.m % self.stages)} or "
                    f"{self.m + self.stages - self.m % self.stages}, or pp_schedule '1f1b'")
        if self.layers is not None and (len(self.layers) != self.stages * self.v or min(self.layers) < 1):
            raise LatticeConfigError(f"pp_layers {list(self.layers)} must give {self.stages * self.v} positive block counts "
                                     f"(one per {'virtual ' if self.v > 1 else ''}stage)")

    @property
    def m(self) -> int:
        return self.microbatches or self.stages

    @property
    def v(self) -> int:
        return (self.virtual or 2) if self.schedule == "interleaved" else 1

    def chunks(self, n_layers: int) -> list[range]:
        """The blocks of each (virtual) stage, in model order; chunk c runs on rank stage c % pp."""
        n = self.stages * self.v
        if self.layers is not None:
            if sum(self.layers) != n_layers:
                raise LatticeConfigError(f"pp_layers {list(self.layers)} add up to {sum(self.layers)} blocks, but the "
                                         f"model has n_layers = {n_layers}")
            counts = list(self.layers)
        else:
            if n_layers < n:
                raise LatticeConfigError(f"n_layers = {n_layers} blocks cannot fill {n} {'virtual ' if self.v > 1 else ''}"
                                         f"stages of at least one block each; use at most {n_layers} stages")
            if n_layers % n:
                raise LatticeConfigError(
                    f"n_layers = {n_layers} blocks do not split evenly into {n} {'virtual ' if self.v > 1 else ''}"
                    f"stages; choose n_layers divisible by {n}, or give the split with pp_layers "
                    f"(e.g. --pp-layers {','.join(map(str, _uneven(n_layers, n)))})")
            counts = [n_layers // n] * n
        starts = [sum(counts[:i]) for i in range(n)]
        return [range(a, a + c) for a, c in zip(starts, counts)]

    def bubble(self) -> float:
        """The idle fraction of a step: (p - 1) / (v m)."""
        return (self.stages - 1) / (self.v * self.m)


def _uneven(n_layers: int, n: int) -> list[int]:
    base, extra = divmod(n_layers, n)
    return [base + (1 if i < extra else 0) for i in range(n)]


# ----------------------------------------------------------------------------- scatter/gather
class _KeepOwnSlice(torch.autograd.Function):
    """Megatron's scatter/gather optimisation, sending side (papers/002 §4.1): the activation X,
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
    """One (virtual) stage of a GPT: its blocks, with the embedding on the first and the final
    LayerNorm on the last. The LM head and loss are the schedule's loss function."""

    def __init__(self, gpt, blocks: range, first: bool, last: bool, scatter_gather_group=None):
        super().__init__()
        self.gpt = [gpt]  # not a submodule: the stage registers only its own layers
        self.first, self.last, self.block_ids = first, last, blocks
        self.blocks = nn.ModuleList(gpt.blocks[i] for i in blocks)
        if first:
            self.embed = gpt.embed
        if last:
            self.ln_f = gpt.ln_f
            self.head = gpt.head
        self.sg_group = scatter_gather_group

    def forward(self, x):
        gpt = self.gpt[0]
        if gpt.training:  # a new micro-batch: new dropout masks (recomputation reuses this count)
            gpt.seeds.forward_count += 1
        if self.first:
            x = gpt.drop(gpt.embed(x))  # tokens (B_mb, T) -> residual layout
        else:
            x = _ContiguousGrad.apply(x)
            if self.sg_group is not None:
                x = _GatherSlices.apply(x, self.sg_group)
        x = gpt.run_blocks(x, self.blocks)
        if self.last:
            return gpt.ln_f(x)
        if self.sg_group is not None:
            x = _KeepOwnSlice.apply(x, self.sg_group)
        return x.contiguous()  # sent as it is to the next stage


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


@torch.no_grad()
def _residual_meta(gpt, microbatch: torch.Tensor) -> tuple[torch.Size, torch.dtype]:
    """This rank's piece of the residual stream for one micro-batch (shape, dtype): the first
    stage runs its embedding once without gradients and sends the result's shape along the pp
    group, whose members share this tensor position. Given to PipelineStage up front, it spares
    the schedule's own inference: a traced forward and backward of micro-batch 0 on every stage
    at the first step, with every collective, a dropout count and saved activations in it."""
    ctx = gpt.ctx
    meta = [None]
    if ctx.stage == 0:
        x = gpt.embed(microbatch)
        meta = [(tuple(x.shape), str(x.dtype).removeprefix("torch."))]
    first = ctx.topology.rank_at({**ctx.coords, MeshAxis.PP: 0})
    dist.broadcast_object_list(meta, src=first, group=ctx.group(MeshAxis.PP))
    shape, dtype = meta[0]
    return torch.Size(shape), getattr(torch, dtype)


def build_schedule(gpt, microbatch_loss, microbatch: torch.Tensor):
    """The torch.distributed.pipelining schedule running this rank's stages of `gpt`, with the
    tensors between stages declared up front (static mode)."""
    from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe,
                                              ScheduleInterleaved1F1B)

    ctx, pcfg = gpt.ctx, gpt.ctx.pipeline
    group = ctx.group(MeshAxis.PP)
    chunks = pcfg.chunks(gpt.cfg.n_layers)
    n = len(chunks)
    shape, dtype = _residual_meta(gpt, microbatch)
    sg = scatter_gather_group(gpt)
    sent = torch.Size((*shape[:-1], shape[-1] // dist.get_world_size(sg))) if sg is not None else shape
    stages = []
    for c in range(ctx.stage, n, pcfg.stages):
        module = StageModule(gpt, chunks[c], first=c == 0, last=c == n - 1, scatter_gather_group=sg)
        # a received activation requires grad: its gradient goes back to the previous stage
        inputs = microbatch if c == 0 else torch.empty(sent, dtype=dtype, device="meta", requires_grad=True)
        outputs = torch.empty(shape if c == n - 1 else sent, dtype=dtype, device="meta")
        stage = PipelineStage(module, c, n, ctx.device, input_args=(inputs.to("meta"),), output_args=(outputs,),
                              input_grads=(None if c == 0 else inputs,), output_grads=(None if c == n - 1 else outputs,),
                              group=group)
        stages.append(_MeteredStage.wrap(stage))
    if pcfg.schedule == "interleaved":
        return ScheduleInterleaved1F1B(stages, n_microbatches=pcfg.m, loss_fn=microbatch_loss, scale_grads=False)
    cls = ScheduleGPipe if pcfg.schedule == "gpipe" else Schedule1F1B
    return cls(stages[0], n_microbatches=pcfg.m, loss_fn=microbatch_loss, scale_grads=False)


def scatter_gather_group(gpt):
    """The tensor ranks of this stage when its residual is replicated over them (1d without
    sequence parallelism) and the optimisation is on; else None."""
    ctx = gpt.ctx
    if not (ctx.pipeline.scatter_gather and gpt.mode.residual_replicated and ctx.tp > 1):
        return None
    return ctx.tensor_group()


def stage_of_module(prefix: str, chunks: list[range], stages: int) -> int:
    """The pipeline stage (rank coordinate on pp) holding a GPT module, given the blocks of each
    chunk (`PipelineConfig.chunks`)."""
    top = prefix.split(".")[0]
    if top == "embed":
        return 0
    if top in ("ln_f", "head"):
        return (len(chunks) - 1) % stages
    if top == "blocks":
        block = int(prefix.split(".")[1])
        return next(c for c, blocks in enumerate(chunks) if block in blocks) % stages
    raise ValueError(f"no pipeline stage for module {prefix!r}")


def check_batch(pcfg: PipelineConfig, mode, tokens: torch.Tensor) -> None:
    """Refuse a replica batch the micro-batch count does not divide, or whose micro-batches the
    tensor layout cannot split (every rank, before any collective)."""
    m = pcfg.m
    if tokens.shape[0] % m:
        raise LatticeConfigError(f"the replica batch of {tokens.shape[0]} sequences does not split into {m} "
                                 f"micro-batches; use a batch divisible by {m} or another --microbatches")
    mode.check_batch(tokens[: tokens.shape[0] // m])  # the layout's own constraints, per micro-batch


def _loss_to_replica(gpt, loss: torch.Tensor | None) -> float:
    """The last stage's loss, broadcast to every stage of the replica."""
    ctx, dtype = gpt.ctx, torch.promote_types(gpt.dtype, torch.float32)
    buf = (loss.detach().reshape(1).to(dtype, copy=True) if loss is not None
           else torch.zeros(1, dtype=dtype, device=ctx.device))
    # group rank = pp coordinate (Topology keeps ranks increasing along every axis)
    return float(comm.raw_broadcast(buf, ctx.group(MeshAxis.PP), src=ctx.pipeline.stages - 1))


def pipeline_forward_backward(gpt, tokens: torch.Tensor, targets: torch.Tensor) -> float:
    """Forward and backward of the replica batch through the schedule; the mean loss."""
    check_batch(gpt.pipeline, gpt.mode, tokens)
    pcfg, ctx = gpt.pipeline, gpt.ctx
    if gpt._schedule is None or gpt._schedule[0] != tuple(tokens.shape):  # the stages' shapes follow the batch's
        schedule = build_schedule(gpt, lambda x, y: gpt.head.loss(x, y) / pcfg.m, tokens[: len(tokens) // pcfg.m])
        gpt._schedule = (tuple(tokens.shape), schedule)
    gpt._grads_pending = True
    first, last = ctx.stage == 0, ctx.stage == pcfg.stages - 1
    losses: list[torch.Tensor] = []
    args = (tokens,) if first else ()
    kwargs = {"target": targets, "losses": losses} if last else {}
    gpt._schedule[1].step(*args, **kwargs)
    return _loss_to_replica(gpt, torch.stack(losses).sum() if last else None)


@torch.no_grad()
def pipeline_evaluate(gpt, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The replica's mean loss without gradients: the whole batch through the stages in turn
    (blocking sends; each message is preceded by its shape). Identical on every rank."""
    ctx, pcfg = gpt.ctx, gpt.pipeline
    chunks = pcfg.chunks(gpt.cfg.n_layers)
    group, n, s = ctx.group(MeshAxis.PP), len(chunks), pcfg.stages

    def rank_of(stage):
        return ctx.topology.rank_at({**ctx.coords, MeshAxis.PP: stage})

    x, loss = None, None
    for c in range(n):
        if c % s != ctx.stage:
            continue
        module = StageModule(gpt, chunks[c], first=c == 0, last=c == n - 1,
                             scatter_gather_group=scatter_gather_group(gpt))
        if c == 0:
            x = tokens
        else:
            shape = torch.zeros(8, dtype=torch.int64)
            dist.recv(shape, src=rank_of((c - 1) % s), group=group)
            x = torch.empty(tuple(shape[1:1 + shape[0]].tolist()), dtype=gpt.dtype, device=ctx.device)
            dist.recv(x, src=rank_of((c - 1) % s), group=group)
        x = module(x)
        if c == n - 1:
            loss = gpt.head.loss(x, targets)
        else:
            shape = torch.zeros(8, dtype=torch.int64)
            shape[0], shape[1:1 + x.dim()] = x.dim(), torch.tensor(x.shape)
            dist.send(shape, dst=rank_of((c + 1) % s), group=group)
            dist.send(x.contiguous(), dst=rank_of((c + 1) % s), group=group)
    return torch.tensor(_loss_to_replica(gpt, loss), dtype=torch.promote_types(gpt.dtype, torch.float32))


@torch.no_grad()
def sum_tied_embedding_grads(gpt) -> None:
    """With tied embeddings, sum the token table's gradient of the first stage (embedding) and
    the last (LM head) on both, so that the table and its mirror take the same step."""
    ctx = gpt.ctx
    if not gpt.cfg.tie_embeddings or ctx.stage not in (0, ctx.pipeline.stages - 1):
        return
    wte = gpt.embed.wte
    if wte is None:
        return  # a tensor rank that holds no part of the table (never the case in the built-in modes)
    group = ctx.group(MeshAxis.PP) if ctx.pipeline.stages == 2 else ctx.embedding_group
    grad = wte.grad if wte.grad is not None else torch.zeros_like(wte)
    wte.grad = comm.raw_all_reduce(grad.contiguous(), group, phase="backward")


# ----------------------------------------------------------------------------- analysis
def p2p_piece(cfg, mode: str, *, tp: int, pcfg: PipelineConfig, batch: int, seq: int | None = None,
              **options) -> float:
    """Elements of one micro-batch's residual piece that a tensor rank sends to the next stage:
    B/m · T · h over the layout's residual split (the cost model's figure), divided by the t
    tensor ranks that replicate it under the scatter/gather optimisation."""
    from lattice import cost
    from lattice.layout import plan
    from lattice.modes import get_mode

    piece = cost.estimate(cfg, mode, batch=batch // pcfg.m, seq=seq, tp=tp, **options).residual_elements
    replicated = get_mode(mode)(cfg, plan(mode, tp=tp, **options)).residual_replicated
    return piece / tp if pcfg.scatter_gather and replicated and tp > 1 else piece


def stage_sends(pcfg: PipelineConfig, stage: int, piece: float) -> dict[str, float]:
    """Elements one rank of `stage` sends point-to-point in one step: forward, each micro-batch's
    piece out of every chunk it holds but the last; backward, the same gradient out of every
    chunk but the first."""
    n = pcfg.stages * pcfg.v
    mine = range(stage, n, pcfg.stages)
    return {"forward": pcfg.m * piece * sum(1 for k in mine if k < n - 1),
            "backward": pcfg.m * piece * sum(1 for k in mine if k > 0)}


def p2p_elements(cfg, mode: str, *, tp: int, pcfg: PipelineConfig, batch: int, stage: int, seq: int | None = None,
                 **options) -> dict[str, float]:
    """What one rank of `stage` sends point-to-point in one step (see p2p_piece, stage_sends)."""
    return stage_sends(pcfg, stage, p2p_piece(cfg, mode, tp=tp, pcfg=pcfg, batch=batch, seq=seq, **options))


def in_flight(pcfg: PipelineConfig, stage: int) -> int:
    """Micro-batches whose activations a stage holds at its peak: all m under GPipe; under 1F1B
    the warm-up depth p - stage (at most m); interleaved, Megatron's warm-up of
    (p - stage - 1) * 2 + (v - 1) * p forwards plus the current one, in chunk-forwards (at most v m)."""
    p, m, v = pcfg.stages, pcfg.m, pcfg.v
    if pcfg.schedule == "gpipe":
        return m
    if pcfg.schedule == "1f1b":
        return min(m, p - stage)
    return min(v * m, (p - stage - 1) * 2 + (v - 1) * p + 1)
