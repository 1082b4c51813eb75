"""The trainer: one step (data-parallel gradient sync through DDP, or by buckets under a pipeline;
bf16 autocast; clipping at the global norm; AdamW, warmup + cosine from lattice.training.optim), the loop
(validation, lattice.training.metrics' reports, signals, heartbeat) and exact-resume checkpoints; and the
free `evaluate` that `lattice eval` uses.

    ctx = lattice.init("1d", tp=2, dp=2)
    result = Trainer(TrainConfig(steps=200, out_dir="runs/x"), ctx).fit()

The trainer never looks at a mode's sharding or a family's layers; it only uses each parameter's
shard spec (for weight decay, the gradient norm and checkpoints) and the model interface every
family (and its pipeline stages) has, so every layout and family trains through the same code.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import time
from contextlib import nullcontext
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lattice import checkpoint
from lattice.checkpoint.run_checkpoints import RunCheckpoints
from lattice.data.corpus import Corpus, unigram_baseline
from lattice.data.seq2seq import Seq2Seq
from lattice.data.tasks import TaskTokens
from lattice.models import build_model, get_arch
from lattice.modes import get_mode
from lattice.parallel.comm import raw_all_reduce, record
from lattice.parallel.context import LatticeConfigError, MeshAxis, ParallelContext, TrainingStopped
from lattice.parallel.context_parallel import check_context_batch
from lattice.parallel.pipeline import batch_problem, microbatch_count, microbatch_rows
from lattice.parallel.zero import ZeroOptimizer
from lattice.training import faults
from lattice.training.config import (DATA_FORMATS, DTYPES, ON_NAN,  # noqa: F401  (lattice.training.trainer's names)
                                     TrainConfig)
from lattice.training.metrics import Metrics, step_flops
from lattice.training.optim import clip_grads, grad_norm, lr_at, make_optimizer


@dataclasses.dataclass(frozen=True)
class RunPlan:
    """Every decision of a training run, each taken once (`plan_run`) before any collective, and
    what the trainer builds from without checking again: the run's config, the model it trains
    (its token table the tokenizer's vocabulary plus the task's special tokens), the checkpoint
    it resumes and the one whose weights it starts from, both read and validated, and the
    schedule changes a resume was allowed to make."""

    cfg: TrainConfig
    model_config: Any
    resume: dict | None = None
    resume_from: str = "checkpoint"  # where `resume` was read, for messages
    init_from: dict | None = None
    schedule_changes: tuple[str, ...] = ()


def plan_run(cfg: TrainConfig, ctx: ParallelContext, corpus: Corpus, *, resume: str | os.PathLike | dict | None = None,
             allow_config_change: bool = False, resume_from: str | os.PathLike | None = None,
             init_from: dict | None = None) -> RunPlan:
    """Check a run whole and decide it (pure: no process group, nothing allocated), so that the
    launcher, with a planned context, and every rank refuse a bad request in the same one line
    before any collective. `resume`: a checkpoint path or run directory, or a checkpoint already
    read (then `resume_from` says where from). A resume that changes the schedule (steps, lr,
    warmup, batch size, seed) is refused unless `allow_config_change`. `init_from`: the
    checkpoint cfg.init_from names, already read."""
    ckpt = resume if isinstance(resume, dict) else checkpoint.read(resume) if resume else None
    if resume_from is None:
        resume_from = "checkpoint" if isinstance(resume, dict) or not resume else checkpoint.resolve(resume)
    model_config = cfg.model_config(corpus.vocab_size, corpus.specials)
    check_run(cfg, model_config, ctx)
    if ckpt is not None:
        checkpoint.check_model_config(ckpt, cfg.arch, model_config.to_dict(), resume_from)
    changed = faults.check_schedule(ckpt.get("train_config", {}), asdict(cfg), allow_config_change,
                                    resume_from) if ckpt is not None else []
    donor = check_init_from(cfg, model_config, init_from) if ckpt is None and cfg.init_from else None
    return RunPlan(cfg, model_config, ckpt, str(resume_from), donor, tuple(changed))


def model_and_batches(cfg: TrainConfig, ctx: ParallelContext, corpus: Corpus, ckpt: dict | None = None,
                      where="checkpoint"):
    """(model config, model, fixed validation batches, task) of a run on `corpus` (`lattice
    eval`'s): every size checked against the layout before any collective; with `ckpt`, a
    checkpoint of another model is refused."""
    model_config = cfg.model_config(corpus.vocab_size, corpus.specials)
    if ckpt is not None:
        checkpoint.check_model_config(ckpt, cfg.arch, model_config.to_dict(), where)
    check_run(cfg, model_config, ctx)
    return (model_config, *_model_and_batches(cfg, ctx, corpus, model_config))


def _model_and_batches(cfg: TrainConfig, ctx: ParallelContext, corpus: Corpus, model_config):
    """(model, fixed validation batches, task) of a checked run: this rank's shards of the model."""
    task = cfg.make_task(corpus, model_config)
    task.check(cfg.batch_size, cfg.batch_lengths(model_config)[0], ctx.dp)
    model = build_model(model_config, ctx, dtype=cfg.param_dtype,
                        activation_checkpointing=cfg.activation_checkpointing)
    val_set = task.val_batches(ctx, batch_size=cfg.batch_size, seq_len=cfg.batch_lengths(model_config)[0],
                               num_batches=cfg.eval_batches)
    return model, val_set, task


def check_run(cfg: TrainConfig, model_config, ctx: ParallelContext) -> None:
    """Every size of a run against its layout: the model against the mode, the blocks over the
    stages, the global batch over the replicas and the replica's batch against the pipeline and
    the mode (a refused batch names the global batch sizes that work, found by trying them).
    Pure (no process group, nothing allocated or changed), so that the launcher (with a planned
    context), every rank and the trainer refuse the same request in the same words."""
    from lattice.parallel.context import nearest_working

    mode = get_mode(ctx.mode)
    mode.check_model(model_config, ctx)  # the layout's size checks, nothing built
    if ctx.pipeline is not None:
        family = get_arch(cfg.arch)
        with torch.device("meta"):
            planned = family(model_config, dataclasses.replace(ctx, pipeline=None))
            if planned.parts() is None:
                raise LatticeConfigError(f"--arch {cfg.arch} cannot be split into pipeline stages; use --pp 1 (any "
                                         f"tensor layout, with --dp for more ranks)")
            counted = "n_layers + n_decoder_layers" if planned.parts().decoder else "n_layers"
            ctx.pipeline.chunks(len(planned.pipeline_blocks()), counted)  # the stage split
        if cfg.task_name == "classify":
            raise LatticeConfigError("--task classify scores the class logits of every validation, which a pipeline "
                                     "does not gather (pp > 1 evaluates losses only); fine-tune with --pp 1")
    # every length a batch has: the sequence, and an encoder-decoder's target
    lengths = [n for n in cfg.batch_lengths(model_config) if n]
    if cfg.task_name == "seq2seq":
        Seq2Seq.check_lengths(cfg.data, *lengths)
    if ctx.cp > 1:  # each length in 2·cp chunks; a class per sequence has none
        if cfg.task_name == "classify":
            raise LatticeConfigError("--task classify has one target per sequence, and context parallelism splits "
                                     "sequences (it takes a target per token); fine-tune with --cp 1")
        check_context_batch(ctx, *(torch.zeros(1, n, dtype=torch.int64) for n in lengths))

    def problem(batch):
        if batch % ctx.dp:
            return f"batch size {batch} is not divisible by dp = {ctx.dp}"
        return next(filter(None, (batch_problem(microbatch_count(ctx), mode, ctx, batch // ctx.dp, n // ctx.cp)
                                  for n in lengths)), None)  # (under cp, each rank's chunks)

    found = problem(cfg.batch_size)
    if found:
        works = nearest_working(cfg.batch_size, lambda b: problem(b) is None, 4 * cfg.batch_size + 64)
        if not works and ctx.cp > 1:  # no batch helps: the chunks' length is what the layout refuses
            n = lengths[0]
            fits = nearest_working(n, lambda t: t % (2 * ctx.cp) == 0 and batch_problem(
                microbatch_count(ctx), mode, ctx, cfg.batch_size // ctx.dp, t // ctx.cp) is None, 4 * n)
            raise LatticeConfigError(f"{found} (with --cp {ctx.cp} each rank holds {n // ctx.cp} of a sequence's {n} "
                                     f"tokens); sequence lengths (--seq-len) that work with everything else as given: "
                                     f"{' or '.join(map(str, fits))}")
        raise LatticeConfigError(f"{found}; global batch sizes (--batch-size) that work with everything else as "
                                 f"given: {' or '.join(map(str, works))}")


def schedule_change(saved: dict, cfg: TrainConfig, step: int, changed: list[str]) -> str:
    """What a resume with a changed schedule does, in one line. The warmup and cosine are those
    of the new settings, evaluated at the resumed step (as Megatron-LM does when --train-iters
    changes: the decay horizon follows the steps), so the learning rate can jump at the resume."""
    def at(c):
        return lr_at(step, lr=c["lr"], warmup=c["warmup"], steps=c["steps"], min_lr_ratio=c.get("min_lr_ratio", 0.1))

    before, after = at(saved), at(asdict(cfg))
    return (f"resuming at step {step} with a changed schedule ({'; '.join(changed)}): warmup {cfg.warmup} steps, peak "
            f"lr {cfg.lr:g}, cosine to {cfg.lr * cfg.min_lr_ratio:g} at step {cfg.steps}; the learning rate at step "
            f"{step} is {after:.3g} (the saved schedule's was {before:.3g})")


def autocast(ctx: ParallelContext, bf16: bool):
    return torch.autocast(device_type=ctx.device.type, dtype=torch.bfloat16) if bf16 else nullcontext()


def dp_mean(value: torch.Tensor, ctx: ParallelContext) -> float:
    """Mean over data-parallel replicas of a per-replica scalar (identical on every rank)."""
    value = value.detach().to(torch.promote_types(value.dtype, torch.float32)).reshape(1)
    if ctx.dp > 1:
        value = raw_all_reduce(value.clone(), ctx.group(MeshAxis.DP)) / ctx.dp
    return float(value)


def replica_weight(model, batch, ctx: ParallelContext) -> float:
    """dp x this replica's labelled targets / the global batch's (lattice.data.corpus.Batch): the
    weight of the replica's mean loss by which the replicas' average is the global batch's mean
    (1 with equal counts, as without padding)."""
    if ctx.dp == 1:
        return 1.0
    mine = model.labelled_count(model.unpadded_targets(batch.targets, batch.inputs.get("attention_mask")))
    return ctx.dp * int(mine) / max(batch.labelled, 1)


@torch.no_grad()
def evaluate(model, batches, ctx: ParallelContext, *, bf16: bool = False) -> float:
    """Mean loss of `model` over `batches` (each this replica's lattice.data.corpus.Batch), each
    batch's the mean over its labelled targets, identical on every rank. No optimizer, no
    data-parallel wrapper: `lattice eval` calls this directly."""
    model.eval()
    with autocast(ctx, bf16):
        total = sum(model(b.tokens, b.targets, **b.inputs).double() * replica_weight(model, b, ctx)
                    for b in batches) / len(batches)  # summed in float64, as the train loss is
    model.train()
    return dp_mean(total, ctx)


def validation_metric(task, ctx: ParallelContext) -> tuple[str | None, str | None]:
    """(the score validation reports beside the loss, or None; why the task's score is left out
    in this layout, or None). A pipeline cannot score (scoring runs every stage at once), and
    context parallelism cannot generate (each new token attends to every position before it)."""
    if not task.metric:
        return None, None
    if ctx.pipeline is not None:
        return None, f"with --pp {ctx.pp} validation reports the loss only"
    if ctx.cp > 1 and getattr(task, "scored_by_generation", False):
        return None, f"with --cp {ctx.cp} validation reports the loss only ({task.metric} is scored by generation, " \
                     f"which runs with cp = 1)"
    return task.metric, None


def task_score(task, model, batches, ctx: ParallelContext, *, bf16: bool = False) -> float:
    """The task's score of `batches` (this replica's) over every replica: the accuracy of a
    classifier, the exact match of an encoder-decoder's greedy outputs."""
    with autocast(ctx, bf16):
        return dp_mean(task.score(model, batches), ctx)


def check_init_from(cfg: TrainConfig, model_config, ckpt: dict | None = None) -> dict:
    """The checkpoint `--init-from` names, read and validated (every rank, before any
    collective): the same family and the same sizes, but for the heads (num_labels) and dropout."""
    where = checkpoint.resolve(cfg.init_from)
    ckpt = ckpt if ckpt is not None else checkpoint.read(cfg.init_from)
    if checkpoint.arch_of(ckpt) != cfg.arch:
        raise LatticeConfigError(f"--init-from {where} holds a {checkpoint.arch_of(ckpt)} model, this run trains "
                                 f"--arch {cfg.arch}; drop --arch (the family is read from the checkpoint) or pass a "
                                 f"{cfg.arch} checkpoint")
    ours = model_config.to_dict()
    theirs = {**ours, **ckpt.get("model_config", {})}
    differ = {k: (theirs[k], ours[k]) for k in ours if k not in ("num_labels", "dropout") and theirs[k] != ours[k]}
    if differ:
        raise LatticeConfigError(f"--init-from {where} holds another model: {differ} (checkpoint, this run); give this "
                                 f"run the checkpoint's sizes (--model, --d-model, ..., --vocab-size: the tokenizer's "
                                 f"vocabulary without the {TaskTokens.of(cfg.task_name, 0).model_vocab} special tokens "
                                 f"lattice appends when the tokenizer has none)")
    return ckpt


@torch.no_grad()
def init_weights_from(ckpt: dict, model, ctx: ParallelContext) -> list[str]:
    """Copy every parameter the checkpoint's model shares with `model` (same name and shape) into
    it: the checkpoint is loaded into its own model under this layout (a collective), whose shards
    are then this rank's. Returns the names of `model`'s parameters it did not have."""
    donor_config = type(model.cfg).from_dict(ckpt["model_config"])
    donor = build_model(donor_config, ctx, dtype=model.dtype)
    checkpoint.load_into(ckpt, donor)
    theirs = dict(donor.named_parameters())
    for name, p in model.named_parameters():
        if name in theirs and theirs[name].shape == p.shape:
            p.copy_(theirs[name])
    return [n for n, s in model.specs.items() if n not in donor.specs or donor.specs[n].full_shape != s.full_shape]


def _metered_allreduce_hook(group, bucket):
    """DDP's averaging all-reduce, reported to CommMeter so measured bytes include dp traffic."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    buf = bucket.buffer()
    record("all_reduce", group, buf.numel(), buf.dtype, phase="backward")
    return allreduce_hook(group, bucket)


class Trainer:
    """Trains a model of any family on the built-in corpus (or a given Corpus) under any layout."""

    def __init__(self, cfg: TrainConfig, ctx: ParallelContext, *, corpus: Corpus | None = None,
                 resume: str | os.PathLike | dict | None = None, allow_config_change: bool = False):
        """`resume`: a sharded checkpoint or run directory, or one already read with
        `lattice.checkpoint.read`. The run is checked and decided (`plan_run`) before the first
        collective (DDP's constructor is one); `Trainer.from_plan` builds from a plan made before."""
        corpus = corpus or cfg.corpus()
        self._build(plan_run(cfg, ctx, corpus, resume=resume, allow_config_change=allow_config_change), ctx, corpus)

    @classmethod
    def from_plan(cls, plan: RunPlan, ctx: ParallelContext, corpus: Corpus) -> "Trainer":
        """The trainer of a run `plan_run` decided (as `lattice train` does on every rank before
        creating its process groups), built without checking it again."""
        trainer = cls.__new__(cls)
        trainer._build(plan, ctx, corpus)
        return trainer

    def _build(self, plan: RunPlan, ctx: ParallelContext, corpus: Corpus) -> None:
        cfg, ckpt, where, donor = plan.cfg, plan.resume, plan.resume_from, plan.init_from
        self.cfg, self.ctx, self.corpus, self.model_config = cfg, ctx, corpus, plan.model_config
        self.seq_len = cfg.batch_lengths(plan.model_config)[0]  # the batches' (a checkpoint's model may take longer)
        self.model, self.val_set, self.task = _model_and_batches(cfg, ctx, corpus, plan.model_config)
        if ckpt is not None and not checkpoint.is_sharded(ckpt):
            raise LatticeConfigError(f"{where} is a single-file checkpoint, and training resumes sharded ones; convert "
                                     f"it (lattice convert {where} RUN_DIR) and resume from RUN_DIR, or let `lattice "
                                     f"train --resume` convert it")
        if cfg.distributed_optimizer:  # ZeRO over the dp replicas, or fp32 master rows of bf16 weights
            self.optimizer = ZeroOptimizer(self.model, ctx, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                                           weight_decay=cfg.weight_decay, stage=cfg.zero,
                                           hooks=cfg.overlap_grad_reduce is not False,
                                           accumulations=microbatch_count(ctx),
                                           reduce_dtype=torch.bfloat16 if cfg.grad_reduce_dtype == "bf16" else None,
                                           cp_summed=ctx.pipeline is not None,
                                           overlap_param_gather=cfg.overlap_param_gather is not False)
        else:
            self.optimizer = make_optimizer(self.model, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                                            weight_decay=cfg.weight_decay)
        self.step, self.elapsed, self.history, self.skipped = 0, 0.0, [], 0
        self._saved_step = None  # the step of the last checkpoint written or loaded
        self.checkpoints = RunCheckpoints(cfg, ctx, self.model, self.optimizer, self.model_config)
        if ckpt is not None:
            self.step, self.elapsed = self.checkpoints.restore(ckpt)
            self._saved_step = self.step
            if plan.schedule_changes and ctx.rank == 0:
                print(schedule_change(ckpt["train_config"], cfg, self.step, list(plan.schedule_changes)), flush=True)
        if donor is not None:
            fresh = init_weights_from(donor, self.model, ctx)
            if cfg.distributed_optimizer:
                self.optimizer.masters_from_params()
            if ctx.rank == 0:
                print(f"initialised from {checkpoint.resolve(cfg.init_from)}" + (f"; starting fresh: {', '.join(fresh)}"
                                                                                  if fresh else ""), flush=True)
        if cfg.async_checkpoint and cfg.out_dir:
            self.checkpoints.start_async()
        self.engine = self.model
        # the reduction over the ranks holding the same shards of other tokens sums over cp too
        # (one collective over dp x cp, as Megatron's); sync_grads then leaves cp alone
        self.reduces_cp = ctx.pipeline is None and (cfg.distributed_optimizer or ctx.dp > 1)
        self.ddp_averages = ctx.dp > 1 and ctx.pipeline is None and not cfg.distributed_optimizer
        # a rank holding no parameters has nothing to average, and neither has the rest of its dp
        # group, which holds the same pieces (sub-graph's sub-grids but the first with
        # common="subgrid" and projections="common": their branch is attention alone); DDP refuses it
        if self.ddp_averages and any(p.requires_grad for p in self.model.parameters()):
            from torch.nn.parallel import DistributedDataParallel

            group = ctx.group(MeshAxis.DP, MeshAxis.CP)  # DDP's average over dp x cp of cp x the loss
            # gradients as views of DDP's buckets: the summed buckets are not copied back into separate
            # gradients (one pass over every gradient byte less a step: 6% of a step at 8 ranks on 2 cores)
            self.engine = DistributedDataParallel(
                self.model, process_group=group, device_ids=[ctx.device] if ctx.device.type == "cuda" else None,
                gradient_as_bucket_view=True)
            self.engine.register_comm_hook(group, _metered_allreduce_hook)

    # ------------------------------------------------------------------ pieces
    @torch.no_grad()
    def _average_over_replicas(self) -> None:
        """Data-parallel gradient averaging where DDP cannot wrap the model (a pipeline schedule
        runs the stages): one flat, metered all-reduce over the dp group per bucket."""
        if self.ctx.dp == 1:
            return
        from lattice.parallel.sharding import all_reduce_grads, byte_buckets

        for bucket in byte_buckets(list(self.model.parameters()), lambda p: p.numel() * p.element_size()):
            all_reduce_grads(bucket, self.ctx.group(MeshAxis.DP), divide_by=self.ctx.dp)

    def _accumulate(self, x, y, inputs: dict, weight: float) -> torch.Tensor:
        """Forward and backward of the replica batch without a pipeline, in its micro-batches in
        turn (gradient accumulation); the replica's mean loss times `weight`. Each micro-batch's
        mean is weighted by its share of the replica's labelled targets, so that the gradients
        summed over them are the whole batch's; DDP reduces in the last backward alone."""
        m = microbatch_count(self.ctx)
        rows = microbatch_rows(len(x), m)
        shares = [1.0]
        if m > 1:
            mask = inputs.get("attention_mask")
            counts = [int(self.model.labelled_count(self.model.unpadded_targets(
                y[r], None if mask is None else mask[r]), clamp=False)) for r in rows]
            shares = [count / max(sum(counts), 1) for count in counts]
        total = None
        for i, (r, share) in enumerate(zip(rows, shares)):
            last = i == m - 1
            quiet = self.engine.no_sync() if not last and self.engine is not self.model else nullcontext()
            with quiet:
                with autocast(self.ctx, self.cfg.bf16):
                    loss = self.engine(x[r], y[r], **{k: v[r] for k, v in inputs.items()})
                    if weight * share != 1.0:  # DDP averages the gradients of the weighted loss
                        loss = loss * (weight * share)
                if self.ddp_averages and self.ctx.cp > 1:  # DDP averages over dp x cp: a sum over cp (every
                    # rank of the replica seeds its backward alike, whether DDP wraps it or it holds no parameters)
                    (loss * self.ctx.cp).backward()
                else:
                    loss.backward()
            total = loss.detach() if total is None else total + loss.detach()
        return total

    # ------------------------------------------------------------------ one step
    def train_step(self) -> dict:
        """One optimizer step on the global batch of `self.step`; returns its metrics."""
        cfg, t0 = self.cfg, time.perf_counter()
        self.model.train()
        batch = self.task.train_batch(self.step, self.ctx, seed=cfg.seed, batch_size=cfg.batch_size,
                                      seq_len=self.seq_len)
        x, y, inputs = batch.tokens, batch.targets, batch.inputs
        weight = replica_weight(self.model, batch, self.ctx)
        lr = lr_at(self.step, lr=cfg.lr, warmup=cfg.warmup, steps=cfg.steps, min_lr_ratio=cfg.min_lr_ratio)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.zero_grad(set_to_none=True)
        if self.ctx.pipeline is not None:  # the schedule runs forward and backward of every micro-batch
            if cfg.distributed_optimizer:  # its buckets start in the last micro-batch's backward: it weights them
                self.optimizer.grad_scale = weight
            with autocast(self.ctx, cfg.bf16):
                loss = torch.tensor(self.model.forward_backward(x, y, **inputs), dtype=torch.float64)
            if weight != 1.0:
                loss = loss * weight
                for p in self.model.parameters():
                    if p.grad is not None and not cfg.distributed_optimizer:
                        p.grad.mul_(weight)
            if not cfg.distributed_optimizer:
                self._average_over_replicas()
        else:
            loss = self._accumulate(x, y, inputs, weight)
            self.model.sync_grads(over_cp=not self.reduces_cp)  # sums inside the replica; DDP averaged in backward
        if cfg.distributed_optimizer:  # the reductions backward did not start, then every rank's own slices
            self.optimizer.reduce_grads()
            norm = self.optimizer.grad_norm()
        else:
            norm = grad_norm(self.model, self.ctx)
        # the norm is already identical on every rank: every rank takes the same decision
        finite = bool(torch.isfinite(norm))
        if not finite and cfg.on_nan == "stop":
            raise TrainingStopped(
                f"step {self.step + 1}: the gradient norm is {float(norm)} (a non-finite loss or gradient); stopped "
                f"before updating the weights, and nothing was saved over the last checkpoint; lower --lr, or pass "
                f"--on-nan skip to skip such steps")
        if finite:
            if cfg.grad_clip > 0:
                if cfg.distributed_optimizer:
                    self.optimizer.clip(norm, cfg.grad_clip)
                else:
                    clip_grads(self.model, norm, cfg.grad_clip)
            self.optimizer.step()
        else:  # --on-nan skip: the batch is consumed, the weights and moments stay as they were
            self.skipped += 1
            self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        train_loss = dp_mean(loss, self.ctx)
        dt = time.perf_counter() - t0
        return {"step": self.step, "lr": lr, "train_loss": train_loss, "grad_norm": float(norm),
                "tokens_per_s": cfg.batch_size * self.seq_len / dt, "skipped": not finite}

    def evaluate(self) -> float:
        """Mean loss over the fixed validation batches, identical on every rank."""
        return evaluate(self.model, self.val_set, self.ctx, bf16=self.cfg.bf16)

    def val_score(self) -> float:
        """The task's score of the validation batches (every rank): see `task_score`."""
        return task_score(self.task, self.model, self.val_set, self.ctx, bf16=self.cfg.bf16)

    # ------------------------------------------------------------------ the loop
    def fit(self) -> dict:
        """Train from the current step up to cfg.steps (or cfg.stop_at), evaluating every
        eval_interval steps and at the end, checkpointing into out_dir. SIGTERM or SIGINT stops
        at the next step boundary with a checkpoint. Returns a summary ("stopped_by" names the
        signal, or "stop_at", when the run stopped before its last step)."""
        cfg, is_main = self.cfg, self.ctx.rank == 0
        until = cfg.stop_at or cfg.steps
        out = Path(cfg.out_dir) if cfg.out_dir else None
        tokens = cfg.batch_size * self.seq_len
        flops = lambda: step_flops(self.model_config, self.ctx, batch_size=cfg.batch_size,  # noqa: E731
                                   activation_checkpointing=cfg.activation_checkpointing,
                                   lengths=cfg.batch_lengths(self.model_config))
        metrics = Metrics(out if is_main else None, step=self.step, until=until, show=cfg.progress and is_main,
                          tokens_per_step=tokens, flops=flops, peak_tflops=cfg.peak_tflops, device=self.ctx.device)
        val_loss, val_score, start, clock, stopped_by = None, None, self.elapsed, time.perf_counter(), None
        metric, _ = validation_metric(self.task, self.ctx)
        heartbeat = faults.Heartbeat(out, self.ctx.rank, self.ctx.world_size, cfg.dist_timeout)
        # (the last checkpoint is written inside it too: the copy of a Ctrl-C that torchrun's agent
        # passes on arrives after the one from the terminal, and must not interrupt that save)
        with faults.StopRequest() as stop:
            try:
                while self.step < until:
                    heartbeat.beat(self.step)
                    row = self.train_step()
                    row["val_loss"] = None
                    if self.step % cfg.eval_interval == 0 or self.step == until:
                        try:
                            row["val_loss"] = val_loss = self.evaluate()
                            scored = ""
                            if metric:
                                val_score = self.val_score()
                                scored = f", val {metric} {val_score:.3f}"
                        except LatticeConfigError:
                            # a refusal is raised alike on every rank (before any collective): the
                            # steps trained so far are saved before it ends the run
                            if out and self._saved_step != self.step:
                                self.save(out)
                                self.checkpoints.wait()
                            raise
                        if is_main:
                            metrics.say(f"step {self.step}: train loss {row['train_loss']:.4f}, val loss "
                                        f"{val_loss:.4f}{scored}")
                    self.elapsed = row["elapsed_s"] = start + time.perf_counter() - clock
                    self.history.append(row)
                    metrics.log(row)
                    if signum := self._stop_requested(stop):
                        stopped_by = signal.Signals(signum).name
                        break
                    if out and cfg.checkpoint_interval and self.step % cfg.checkpoint_interval == 0:
                        self.save(out)
            finally:
                heartbeat.stop()
                metrics.close()
            self._finish_param_gathers()  # the weights are whole when fit returns
            if val_loss is None and stopped_by is None:
                val_loss = self.evaluate()
            if stopped_by is None and self.step < cfg.steps:
                stopped_by = "stop_at"
            if out:
                if self._saved_step != self.step:
                    self.save(out)
                self.checkpoints.wait()  # the last checkpoint is complete when fit returns
        summary = {"step": self.step, "val_loss": val_loss, "history": self.history, "stopped_by": stopped_by,
                   "skipped": self.skipped}
        if metric:
            if val_score is None:  # stopped before the last step's validation
                val_score = self.val_score()
            summary.update(metric=metric, val_score=val_score, trivial=(self.task.trivial_name, self.task.trivial()))
        else:
            summary["unigram_baseline"] = unigram_baseline(self.corpus)
        return summary

    def _stop_requested(self, stop: faults.StopRequest) -> int:
        """The signal any rank was asked to stop by, or 0 (one tiny all-reduce, so that all ranks
        stop at the same step boundary even when the signal reached only some of them)."""
        flag = torch.tensor([float(stop.signal or 0)], device=self.ctx.device)
        if self.ctx.world_size > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item())

    def _finish_param_gathers(self) -> None:
        """Await the all-gathers of updated weights that --overlap-param-gather leaves to the next
        forward, before the weights are read otherwise."""
        if isinstance(self.optimizer, ZeroOptimizer):
            self.optimizer.finish_param_gathers()

    # ------------------------------------------------------------------ checkpoints
    def save(self, path: str | os.PathLike) -> Path:
        """Write a layout-independent checkpoint of this step (a collective: every rank must call
        it); see lattice.checkpoint.run_checkpoints. Returns where it is (being) written."""
        self._finish_param_gathers()
        where = self.checkpoints.save(path, step=self.step, elapsed=self.elapsed)
        self._saved_step = self.step
        return where
