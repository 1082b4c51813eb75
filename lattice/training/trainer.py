"""The trainer: one step (data-parallel gradient sync through DDP, or by buckets under a pipeline;
bf16 autocast; clipping at the global norm; AdamW, warmup + cosine from lattice.training.optim), the loop
(validation, lattice.training.metrics' reports, signals, heartbeat) and exact-resume checkpoints. It
builds from a run that lattice.training.run_spec decided, and validates with
lattice.training.evaluation (which `lattice eval` uses too).

    ctx = lattice.init("1d", tp=2, dp=2)
    result = Trainer(TrainConfig(steps=200, out_dir="runs/x"), ctx).fit()

The trainer never looks at a mode's sharding or a family's layers; it only uses each parameter's
shard spec (for weight decay, the gradient norm and checkpoints) and the model interface every
family (and its pipeline stages) has, so every layout and family trains through the same code.
"""

from __future__ import annotations

import os
import signal
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist

from lattice import checkpoint
from lattice.checkpoint import run_dir
from lattice.checkpoint.run_checkpoints import RunCheckpoints
from lattice.data.corpus import Corpus, unigram_baseline
from lattice.parallel.comm import raw_all_reduce, record
from lattice.parallel.context import Diverged, LatticeConfigError, MeshAxis, ParallelContext
from lattice.parallel.pipeline import microbatch_count, microbatch_rows
from lattice.parallel.zero import ZeroOptimizer
from lattice.training import faults
from lattice.training.config import TrainConfig
from lattice.training.evaluation import autocast, dp_mean, evaluate, replica_weight, task_score, validation_metric
from lattice.training.metrics import Metrics, step_flops
from lattice.training.optim import clip_grads, grad_norm, lr_at, make_optimizer
from lattice.training.run_spec import RunSpec, checked_model_and_batches, init_weights_from, specify_run, schedule_change


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
        `lattice.checkpoint.read`. The run is checked and decided (`specify_run`) before the first
        collective (DDP's constructor is one); `Trainer.from_spec` builds from a run specification made before."""
        corpus = corpus or cfg.corpus()
        self._build(specify_run(cfg, ctx, corpus, resume=resume, allow_config_change=allow_config_change), ctx, corpus)

    @classmethod
    def from_spec(cls, spec: RunSpec, ctx: ParallelContext, corpus: Corpus) -> "Trainer":
        """The trainer of a run `specify_run` decided (as `lattice train` does on every rank before
        creating its process groups), built without checking it again."""
        trainer = cls.__new__(cls)
        trainer._build(spec, ctx, corpus)
        return trainer

    def _build(self, spec: RunSpec, ctx: ParallelContext, corpus: Corpus) -> None:
        cfg, ckpt, where, donor = spec.cfg, spec.resume, spec.resume_from, spec.init_from
        self.cfg, self.ctx, self.corpus, self.model_config = cfg, ctx, corpus, spec.model_config
        self.seq_len = cfg.batch_lengths(spec.model_config)[0]  # the batches' (a checkpoint's model may take longer)
        self.model, self.val_set, self.task = checked_model_and_batches(cfg, ctx, corpus, spec.model_config)
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
                                           overlap_param_gather=cfg.overlap_param_gather is not False,
                                           reshard_after_forward=cfg.reshard_after_forward,
                                           reshard_microbatches=cfg.reshard_microbatches)
        else:
            self.optimizer = make_optimizer(self.model, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                                            weight_decay=cfg.weight_decay)
        self.step, self.elapsed, self.history, self.skipped = 0, 0.0, [], 0
        self.recovery: dict | None = None  # set by a launcher restart: the times the first step reports (`_recovered`)
        self._saved_step = None  # the step of the last checkpoint written or loaded
        self.checkpoints = RunCheckpoints(cfg, ctx, self.model, self.optimizer, self.model_config)
        if ckpt is not None:
            self.step, self.elapsed = self.checkpoints.restore(ckpt)
            self._saved_step = self.step
            if spec.schedule_changes and ctx.rank == 0:
                print(schedule_change(ckpt["train_config"], cfg, self.step, list(spec.schedule_changes)), flush=True)
        if donor is not None:
            if cfg.distributed_optimizer:  # (ZeRO-3's weights whole to be written)
                self.optimizer.gather_params()
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
        # an MoE's experts split over the replicas or cp ranks: each holds its own, which DDP must leave alone
        self.split_over_replicas = [name for name, _ in self.model.named_parameters()
                                    if self.model.specs[name].replica_splits]
        # a rank holding no parameters has nothing to average, and neither has the rest of its dp
        # group, which holds the same pieces (sub-graph's sub-grids but the first with
        # common="subgrid" and projections="common": their branch is attention alone); DDP refuses it
        if self.ddp_averages and any(p.requires_grad for p in self.model.parameters()):
            from torch.nn.parallel import DistributedDataParallel

            DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(self.model, self.split_over_replicas)

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

        params = [p for name, p in self.model.named_parameters()
                  if name not in self.split_over_replicas and self.model.specs[name].trainable]
        for bucket in byte_buckets(params, lambda p: p.numel() * p.element_size()):
            all_reduce_grads(bucket, self.ctx.group(MeshAxis.DP), divide_by=self.ctx.dp)
        self._average_split_over_replicas(seeded=1)

    @torch.no_grad()
    def _average_split_over_replicas(self, seeded: int) -> None:
        """The replicas' average where DDP's would be for the parameters split over the replicas or
        the cp ranks (an MoE's experts): a rank's gradient holds the tokens of every rank along
        those axes routed to its experts already; it is summed over the other one of dp and cp
        (cp here where sync_grads leaves it to the reduction) and divided by dp, each loss having
        been `seeded` times its own."""
        from lattice.parallel.sharding import all_reduce_grads

        params, kinds = dict(self.model.named_parameters()), {}
        for name in self.split_over_replicas:
            kinds.setdefault(self.model.specs[name].replica_splits, []).append(params[name])
        for split, held in kinds.items():  # (one kind, the experts': the same on every rank of a group)
            axes = [a for a in (MeshAxis.DP, MeshAxis.CP) if a not in split and (a == MeshAxis.DP or self.reduces_cp)]
            group = self.ctx.group(*axes) if axes else None
            if group is not None:
                all_reduce_grads(held, group)
            torch._foreach_div_([p.grad for p in held if p.grad is not None], float(self.ctx.dp * seeded))

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
            if not cfg.distributed_optimizer:  # (whose reduction averages them as the rest)
                self._average_split_over_replicas(seeded=self.ctx.cp if self.ddp_averages and self.ctx.cp > 1 else 1)
        if cfg.distributed_optimizer:  # the reductions backward did not start, then every rank's own slices
            self.optimizer.reduce_grads()
            norm = self.optimizer.grad_norm()
        else:
            norm = grad_norm(self.model, self.ctx)
        # the norm is already identical on every rank: every rank takes the same decision
        finite = bool(torch.isfinite(norm))
        if not finite and cfg.on_nan == "stop":
            raise Diverged(
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
        if hasattr(self.model, "after_update"):  # the model's own state (an MoE's expert bias)
            self.model.after_update(finite)
        self.step += 1
        train_loss = dp_mean(loss, self.ctx)
        dt = time.perf_counter() - t0
        return {"step": self.step, "lr": lr, "train_loss": train_loss, "grad_norm": float(norm),
                "tokens_per_s": cfg.batch_size * self.seq_len / dt, "skipped": not finite, **self._model_metrics()}

    def _model_metrics(self) -> dict[str, float]:
        """The model's own metrics of the step (an MoE's balancing loss and loads), which under a
        pipeline each stage computes of its own blocks: summed over the stages, so that every
        rank (rank 0 logs them) has each from the stage that holds it."""
        names = getattr(self.model, "step_metric_names", tuple)()
        if not names:
            return {}
        got = self.model.step_metrics()
        if self.ctx.pipeline is None:
            return got
        buf = torch.tensor([got.get(n, 0.0) for n in names] + [float(n in got) for n in names], dtype=torch.float64,
                           device=self.ctx.device)
        values, held = raw_all_reduce(buf, self.ctx.group(MeshAxis.PP)).view(2, -1).tolist()
        return {n: v for n, v, h in zip(names, values, held) if h}

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
                                   lengths=cfg.batch_lengths(self.model_config), **cfg.recompute)
        metrics = Metrics(out if is_main else None, step=self.step, until=until, show=cfg.progress and is_main,
                          tokens_per_step=tokens, flops=flops, peak_tflops=cfg.peak_tflops, device=self.ctx.device,
                          columns=getattr(self.model, "step_metric_names", tuple)())
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
                    if self.recovery is not None:
                        self._recovered(out)
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
            self._finish_param_gathers(whole=True)  # the weights are whole when fit returns
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

    def _recovered(self, out: Path | None) -> None:
        """After the first step of a restart: how long the job took from the failure to this step,
        and where the time went (`recovery`: the failed rank's last heartbeat, this process's start,
        the process group's, the trainer's built with its checkpoint loaded), printed and kept in
        the run's job record."""
        r, self.recovery = self.recovery, None
        now = time.time()
        parts = {"restart": r["started"] - r["failed_at"], "start-up": r["initialised"] - r["started"],
                 "load": r["loaded"] - r["initialised"], "first step": now - r["loaded"]}
        if self.ctx.rank == 0:
            print(f"recovered: step {self.step} {now - r['failed_at']:.1f} s after the failure ("
                  + ", ".join(f"{k} {v:.1f} s" for k, v in parts.items()) + ")", flush=True)
            if out is not None:
                done = (run_dir.read_job(out) or {}).get("recoveries", [])
                run_dir.write_job(out, recoveries=[*done, {"restart_count": r["restart"], "step": self.step,
                                                           "seconds": now - r["failed_at"], **parts}])

    def _stop_requested(self, stop: faults.StopRequest) -> int:
        """The signal any rank was asked to stop by, or 0 (one tiny all-reduce, so that all ranks
        stop at the same step boundary even when the signal reached only some of them)."""
        flag = torch.tensor([float(stop.signal or 0)], device=self.ctx.device)
        if self.ctx.world_size > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item())

    def _finish_param_gathers(self, whole: bool = False) -> None:
        """Await the all-gathers of updated weights that --overlap-param-gather leaves to the next
        forward, before the weights are read otherwise; `whole`: ZeRO-3's weights gathered too."""
        if isinstance(self.optimizer, ZeroOptimizer):
            self.optimizer.finish_param_gathers()
            if whole:
                self.optimizer.gather_params()

    # ------------------------------------------------------------------ checkpoints
    def save(self, path: str | os.PathLike) -> Path:
        """Write a layout-independent checkpoint of this step (a collective: every rank must call
        it); see lattice.checkpoint.run_checkpoints. Returns where it is (being) written."""
        self._finish_param_gathers()
        where = self.checkpoints.save(path, step=self.step, elapsed=self.elapsed)
        self._saved_step = self.step
        return where
