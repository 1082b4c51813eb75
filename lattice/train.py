"""The trainer: AdamW, warmup + cosine schedule, sharded gradient clipping, data-parallel
gradient sync through DDP, bf16 autocast, validation, metrics CSV and exact-resume checkpoints.

    ctx = lattice.init("1d", tp=2, dp=2)
    result = Trainer(TrainConfig(steps=200, out_dir="runs/x"), ctx).fit()

The trainer never looks at a mode's sharding or a family's layers; it only uses each parameter's
shard spec (for weight decay, the gradient norm and checkpoints) and the model interface every
family (and its pipeline stages) has, so every layout and family trains through the same code.
"""

from __future__ import annotations

import csv
import math
import os
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
import torch.distributed as dist

from lattice import checkpoint, faults
from lattice.comm import raw_all_reduce, record
from lattice.context import LatticeConfigError, MeshAxis, ParallelContext
from lattice.data import (DEFAULT_VOCAB, Corpus, check_batch_size, load_corpus, load_data_corpus,
                          train_batch, unigram_baseline, val_batches)
from lattice.models import DEFAULT_ARCH, build_model, get_arch
from lattice.pipeline import check_batch as check_pipeline_batch

METRICS_FILE = "metrics.csv"
METRIC_COLUMNS = ("step", "lr", "train_loss", "val_loss", "grad_norm", "tokens_per_s", "elapsed_s")


@dataclass
class TrainConfig:
    """Everything about a run except the layout (which is the ParallelContext's)."""

    arch: str = DEFAULT_ARCH  # the model family (lattice.available_archs())
    model: str | None = None  # a size preset of the family (None: the family's default preset)
    d_model: int | None = None  # shape overrides of the preset (None: the preset's)
    n_layers: int | None = None
    n_heads: int | None = None
    seq_len: int | None = None
    vocab_size: int = DEFAULT_VOCAB
    data: str | None = None  # own text: a file, a directory or a glob (None: the built-in corpus)
    data_format: str = "text"  # or "jsonl"
    text_key: str = "text"  # the field of each JSON line
    tokenizer: str | None = None  # a tokenizer.json (or a directory holding one); None: train a BPE
    data_hash: str | None = None  # identity of the text trained on (set by the trainer)
    dropout: float = 0.0
    steps: int = 300
    batch_size: int = 16  # global: split over data-parallel replicas
    lr: float = 2e-3
    min_lr_ratio: float = 0.1  # the cosine decays to lr * min_lr_ratio
    warmup: int = 30
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0  # max global gradient norm; 0 turns clipping off
    seed: int = 0
    eval_interval: int = 100
    eval_batches: int = 8
    bf16: bool = False
    activation_checkpointing: bool = False
    out_dir: str | None = None  # checkpoint and metrics.csv go here (rank 0 writes)
    checkpoint_interval: int = 100  # steps between checkpoints; 0 = only at the end
    checkpoint_format: str = "sharded"  # every rank writes its shards (DCP), or "single": one file of full tensors
    keep: int = 3  # sharded checkpoints kept in out_dir/checkpoints (the newest); 0 keeps all
    async_checkpoint: bool = False  # write sharded checkpoints on a background thread while training goes on
    dtype: str = "float32"  # of the weights and optimizer state ("float64" for exact comparisons); see bf16
    progress: bool = True
    on_nan: str = "stop"  # a non-finite gradient norm: "stop" the run, or "skip" the step
    dist_timeout: float = 300.0  # seconds a collective may wait before the run fails
    peak_tflops: float | None = None  # per rank, for the MFU in TensorBoard (None: FLOP rate only)

    def __post_init__(self):
        for name in ("steps", "batch_size", "eval_interval", "eval_batches"):
            if getattr(self, name) < 1:
                raise LatticeConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("warmup", "checkpoint_interval", "keep"):
            if getattr(self, name) < 0:
                raise LatticeConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.lr <= 0:
            raise LatticeConfigError(f"lr must be positive, got {self.lr}")
        if self.data_format not in ("text", "jsonl"):
            raise LatticeConfigError(f"data_format must be 'text' or 'jsonl', got {self.data_format!r}")
        if self.on_nan not in ("stop", "skip"):
            raise LatticeConfigError(f"on_nan must be 'stop' or 'skip', got {self.on_nan!r}")
        if self.checkpoint_format not in ("sharded", "single"):
            raise LatticeConfigError(f"checkpoint_format must be 'sharded' or 'single', got {self.checkpoint_format!r}")
        if self.async_checkpoint and self.checkpoint_format != "sharded":
            raise LatticeConfigError("async checkpoints are sharded: drop --async-checkpoint or use "
                                     "--checkpoint-format sharded")
        if self.dtype not in ("float32", "float64"):
            raise LatticeConfigError(f"dtype must be 'float32' or 'float64' (bf16 is --bf16 autocast), got {self.dtype!r}")

    @classmethod
    def from_dict(cls, d: dict) -> "TrainConfig":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    def corpus(self) -> Corpus:
        """The training text (own data or the built-in corpus), tokenized; records its hash."""
        if self.data is None:
            return load_corpus(self.vocab_size, tokenizer_path=self.tokenizer)
        corpus = load_data_corpus(self.data, self.vocab_size, data_format=self.data_format, text_key=self.text_key,
                                  tokenizer_path=self.tokenizer)
        self.data_hash = corpus.content_hash  # hashed once, while finding the token cache
        return corpus

    def model_config(self, vocab_size: int | None = None):
        """The model this run trains: the family's preset with the shape overrides."""
        config_class = get_arch(self.arch).config_class
        shape = {k: getattr(self, k) for k in ("d_model", "n_layers", "n_heads", "seq_len") if getattr(self, k)}
        return config_class.preset(self.model or config_class.default_preset, vocab_size=vocab_size or self.vocab_size,
                                   dropout=self.dropout, **shape)


def _tensorboard(out: Path):
    """A TensorBoard writer in OUT/tensorboard when the optional `tensorboard` package is
    installed (pip install 'lattice[tb]'); None otherwise (metrics.csv has the same numbers)."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # tensorboard is optional
        return None
    return SummaryWriter(log_dir=str(out / "tensorboard"))


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
        """`resume`: a checkpoint file or run directory, or a checkpoint already validated with
        `lattice.checkpoint.read` (as the CLI does before creating process groups). A resume that
        changes the schedule (steps, lr, warmup, batch size, seed) is refused unless
        `allow_config_change`."""
        self.cfg, self.ctx = cfg, ctx
        # Validate everything that can fail before the first collective (DDP's constructor is one).
        ckpt = resume if isinstance(resume, dict) else checkpoint.read(resume) if resume else None
        self.corpus = corpus or cfg.corpus()
        self.model_config = cfg.model_config(self.corpus.vocab_size)
        if ckpt is not None:
            where = "checkpoint" if isinstance(resume, dict) else checkpoint.resolve(resume)
            checkpoint.check_model_config(ckpt, cfg.arch, self.model_config.to_dict(), where)
            faults.check_schedule(ckpt.get("train_config", {}), asdict(cfg), allow_config_change, where)
        check_batch_size(self.corpus, cfg.batch_size, self.model_config.seq_len, ctx.dp)
        self.model = build_model(self.model_config, ctx, dtype=getattr(torch, cfg.dtype),
                                 activation_checkpointing=cfg.activation_checkpointing)
        self.val_set = val_batches(self.corpus, ctx, batch_size=cfg.batch_size,
                                   seq_len=self.model_config.seq_len, num_batches=cfg.eval_batches)
        self.model.mode.check_batch(self.val_set[0][0])  # the mode's own constraints (e.g. b % q)
        if ctx.pipeline is not None:
            check_pipeline_batch(ctx.pipeline, self.model.mode, self.val_set[0][0])
        self.optimizer = self._make_optimizer()
        self.step, self.elapsed, self.history, self.skipped = 0, 0.0, [], 0
        self._saved_step = None  # the step of the last checkpoint written or loaded
        if ckpt is not None:
            self._load(ckpt)
        self.async_writer = None
        if cfg.async_checkpoint and cfg.out_dir:
            from lattice.sharded_checkpoint import AsyncWriter

            self.async_writer = AsyncWriter()  # a collective: its own process group
        self.engine = self.model
        if ctx.dp > 1 and ctx.pipeline is None:
            from torch.nn.parallel import DistributedDataParallel

            group = ctx.group(MeshAxis.DP)
            self.engine = DistributedDataParallel(
                self.model, process_group=group, device_ids=[ctx.device] if ctx.device.type == "cuda" else None)
            self.engine.register_comm_hook(group, _metered_allreduce_hook)

    # ------------------------------------------------------------------ pieces
    def _make_optimizer(self) -> torch.optim.AdamW:
        """Decay only matrices: a tensor decays when its FULL shape has >= 2 dims (a rank's 1-d
        shard of a matrix still decays; a sharded bias does not)."""
        decay, no_decay = [], []
        for name, p in self.model.named_parameters():
            (decay if len(self.model.specs[name].full_shape) >= 2 else no_decay).append(p)
        groups = [{"params": decay, "weight_decay": self.cfg.weight_decay},
                  {"params": no_decay, "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=self.cfg.lr, betas=(self.cfg.beta1, self.cfg.beta2))

    def lr_at(self, step: int) -> float:
        """Linear warmup over `warmup` steps, then cosine from lr to lr * min_lr_ratio."""
        cfg = self.cfg
        if step < cfg.warmup:
            return cfg.lr * (step + 1) / cfg.warmup
        progress = min(1.0, (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup))
        low = cfg.lr * cfg.min_lr_ratio
        return low + 0.5 * (1.0 + math.cos(math.pi * progress)) * (cfg.lr - low)

    def _autocast(self):
        if not self.cfg.bf16:
            return nullcontext()
        return torch.autocast(device_type=self.ctx.device.type, dtype=torch.bfloat16)

    def _dp_mean(self, value: torch.Tensor) -> float:
        """Mean over data-parallel replicas of a per-replica scalar (identical on every rank)."""
        value = value.detach().to(torch.promote_types(value.dtype, torch.float32)).reshape(1)
        if self.ctx.dp > 1:
            value = raw_all_reduce(value.clone(), self.ctx.group(MeshAxis.DP)) / self.ctx.dp
        return float(value)

    @torch.no_grad()
    def _average_over_replicas(self) -> None:
        """Data-parallel gradient averaging where DDP cannot wrap the model (a pipeline schedule
        runs the stages): one flat, metered all-reduce over the dp group per bucket."""
        if self.ctx.dp == 1:
            return
        from lattice.sharding import all_reduce_grads, byte_buckets

        for bucket in byte_buckets(list(self.model.parameters()), lambda p: p.numel() * p.element_size()):
            all_reduce_grads(bucket, self.ctx.group(MeshAxis.DP), divide_by=self.ctx.dp)

    @torch.no_grad()
    def grad_norm(self) -> torch.Tensor:
        """Global L2 norm of the full gradient, identical on every rank.

        Each rank sums its shards' squares divided by the number of ranks in its model replica
        that hold the same shard, so replicated copies count once, and the sum is all-reduced over
        the model replica's group. After the DDP sync every replica holds the same gradients, so
        one replica's norm is the global one."""
        topo = self.ctx.topology
        acc = torch.promote_types(self.model.dtype, torch.float32)
        sq = torch.zeros((), dtype=acc, device=self.ctx.device)
        for name, p in self.model.named_parameters():
            if p.grad is not None and not self.model.is_mirror(name):
                sq += p.grad.detach().to(acc).pow(2).sum() / self.model.specs[name].replicas(topo)
        return raw_all_reduce(sq.reshape(1), self.ctx.model_group()).reshape(()).sqrt()

    # ------------------------------------------------------------------ one step
    def train_step(self) -> dict:
        """One optimizer step on the global batch of `self.step`; returns its metrics."""
        cfg, t0 = self.cfg, time.perf_counter()
        self.model.train()
        x, y = train_batch(self.corpus, self.step, self.ctx, seed=cfg.seed, batch_size=cfg.batch_size,
                           seq_len=self.model_config.seq_len)
        lr = self.lr_at(self.step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.zero_grad(set_to_none=True)
        if self.ctx.pipeline is not None:  # the schedule runs forward and backward of every micro-batch
            with self._autocast():
                loss = torch.tensor(self.model.forward_backward(x, y), dtype=torch.float64)
            self._average_over_replicas()
        else:
            with self._autocast():
                loss = self.engine(x, y)
            loss.backward()
            self.model.sync_grads()  # sums inside the replica; DDP averaged over replicas in backward
        norm = self.grad_norm()
        # the norm is already identical on every rank: every rank takes the same decision
        finite = bool(torch.isfinite(norm))
        if not finite and cfg.on_nan == "stop":
            raise faults.TrainingStopped(
                f"step {self.step + 1}: the gradient norm is {float(norm)} (a non-finite loss or gradient); stopped "
                f"before updating the weights, and nothing was saved over the last checkpoint; lower --lr, or pass "
                f"--on-nan skip to skip such steps")
        if finite:
            if cfg.grad_clip > 0:
                scale = torch.clamp(cfg.grad_clip / (norm + 1e-6), max=1.0)
                for p in self.model.parameters():
                    if p.grad is not None:
                        p.grad.mul_(scale)
            self.optimizer.step()
        else:  # --on-nan skip: the batch is consumed, the weights and moments stay as they were
            self.skipped += 1
            self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        train_loss = self._dp_mean(loss)
        dt = time.perf_counter() - t0
        return {"step": self.step, "lr": lr, "train_loss": train_loss, "grad_norm": float(norm),
                "tokens_per_s": cfg.batch_size * self.model_config.seq_len / dt, "skipped": not finite}

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean loss over the fixed validation batches, identical on every rank."""
        self.model.eval()
        with self._autocast():
            total = sum(self.model(x, y).float() for x, y in self.val_set) / len(self.val_set)
        self.model.train()
        return self._dp_mean(total)

    # ------------------------------------------------------------------ the loop
    def fit(self, until: int | None = None) -> dict:
        """Train from the current step up to `until` (default: cfg.steps), evaluating every
        eval_interval steps and at the end, checkpointing into out_dir. SIGTERM or SIGINT stops
        at the next step boundary with a checkpoint. Returns a summary ("stopped_by" names the
        signal when one stopped the run)."""
        cfg, is_main = self.cfg, self.ctx.rank == 0
        until = cfg.steps if until is None else until
        out = Path(cfg.out_dir) if cfg.out_dir else None
        metrics = self._open_metrics(out) if (out and is_main) else None
        writer = metrics and csv.DictWriter(metrics, fieldnames=METRIC_COLUMNS)
        from tqdm.auto import tqdm

        bar = tqdm(total=until, initial=self.step, disable=not (cfg.progress and is_main), unit="step",
                   dynamic_ncols=True)
        val_loss, start, clock, stopped_by = None, self.elapsed, time.perf_counter(), None
        heartbeat = faults.Heartbeat(out, self.ctx.rank, self.ctx.world_size, cfg.dist_timeout)
        board = _tensorboard(out) if (out and is_main) else None
        try:
            with faults.StopRequest() as stop:
                while self.step < until:
                    heartbeat.beat(self.step)
                    row = self.train_step()
                    row["val_loss"] = None
                    if self.step % cfg.eval_interval == 0 or self.step == until:
                        row["val_loss"] = val_loss = self.evaluate()
                        if is_main:  # tqdm.write prints even where the bar is disabled
                            bar.write(f"step {self.step}: train loss {row['train_loss']:.4f}, val loss {val_loss:.4f}")
                            sys.stdout.flush()
                    self.elapsed = row["elapsed_s"] = start + time.perf_counter() - clock
                    self.history.append(row)
                    if writer:
                        writer.writerow({k: ("" if row[k] is None else row[k]) for k in METRIC_COLUMNS})
                    if board:
                        self._log_scalars(board, row)
                    bar.set_postfix(loss=f"{row['train_loss']:.3f}", tok_s=f"{row['tokens_per_s']:.0f}")
                    bar.update(1)
                    if self._stop_requested(stop):
                        stopped_by = stop.name or "a signal on another rank"
                        break
                    if out and cfg.checkpoint_interval and self.step % cfg.checkpoint_interval == 0:
                        self.save(out)
        finally:
            heartbeat.stop()
            bar.close()
            if board:
                board.close()
            if metrics:
                metrics.close()
        if val_loss is None and stopped_by is None:
            val_loss = self.evaluate()
        if out:
            if self._saved_step != self.step:
                self.save(out)
            if self.async_writer:
                self.async_writer.wait()  # the last checkpoint is complete when fit returns
        return {"step": self.step, "val_loss": val_loss, "unigram_baseline": unigram_baseline(self.corpus),
                "history": self.history, "stopped_by": stopped_by, "skipped": self.skipped}

    def _log_scalars(self, board, row: dict) -> None:
        """TensorBoard: loss, validation loss, learning rate, gradient norm, tokens/s, the FLOP
        rate per rank (the cost model's FLOPs of one step over its time; with cfg.peak_tflops, the
        model FLOP utilisation) and this rank's peak memory."""
        step = row["step"]
        for key in ("train_loss", "val_loss", "lr", "grad_norm", "tokens_per_s"):
            if row.get(key) is not None:
                board.add_scalar(f"train/{key}", row[key], step)
        flops = self._step_flops()
        seconds = self.cfg.batch_size * self.model_config.seq_len / row["tokens_per_s"]
        board.add_scalar("perf/tflops_per_rank", flops / seconds / 1e12, step)
        if self.cfg.peak_tflops:
            board.add_scalar("perf/mfu", flops / seconds / (self.cfg.peak_tflops * 1e12), step)
        if self.ctx.device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(self.ctx.device)
        else:
            import resource
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        board.add_scalar("perf/peak_memory_mib", peak / 2 ** 20, step)

    def _step_flops(self) -> float:
        """Matrix-product FLOPs of one training step on this rank (its stages with pp > 1), from
        the cost model."""
        if getattr(self, "_flops", None) is None:
            from lattice.cost import estimate

            ctx, pcfg = self.ctx, self.ctx.pipeline
            stages = {} if pcfg is None else dict(
                pp=ctx.pp, microbatches=pcfg.microbatches, pp_schedule=pcfg.schedule, pp_virtual=pcfg.virtual,
                pp_layers=pcfg.layers, pp_scatter_gather=pcfg.scatter_gather)
            c = estimate(self.model_config, ctx.mode, batch=self.cfg.batch_size // ctx.dp, tp=ctx.tp, dp=ctx.dp,
                         rank=ctx.rank, activation_checkpointing=self.cfg.activation_checkpointing, **stages,
                         **ctx.options)
            self._flops = c.flops["forward"] + c.flops["backward"]
        return self._flops

    def _stop_requested(self, stop: faults.StopRequest) -> bool:
        """Whether any rank was asked to stop (one tiny all-reduce, so that all ranks stop at the
        same step boundary even when the signal reached only some of them)."""
        flag = torch.tensor([1.0 if stop.signal else 0.0], device=self.ctx.device)
        if self.ctx.world_size > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def _open_metrics(self, out: Path):
        """metrics.csv, line-buffered; a resumed run appends to the rows written before."""
        out.mkdir(parents=True, exist_ok=True)
        path = out / METRICS_FILE
        append = self.step > 0 and path.exists()
        if append:  # rows after the checkpoint belong to a run that did not reach its next save
            faults.truncate_metrics(path, self.step)
        f = open(path, "a" if append else "w", newline="", buffering=1)
        if not append:
            f.write(",".join(METRIC_COLUMNS) + "\n")
        return f

    # ------------------------------------------------------------------ checkpoints
    def save(self, path: str | os.PathLike) -> Path:
        """Write a layout-independent checkpoint of this step (a collective: every rank must call
        it): sharded (every rank writes its own shards into PATH/checkpoints/step-N, keeping the
        newest `keep`; on a background thread with `async_checkpoint`) or, with checkpoint_format
        "single", one file of full tensors written by rank 0 (PATH/ckpt.pt for a directory). Weights
        or moments holding NaN or infinity anywhere are refused on every rank and nothing is written.
        Returns where the checkpoint is (being) written."""
        moments = [t for state in self.optimizer.state.values() for k, t in state.items() if k != "step"]
        bad = torch.tensor([float(any(not torch.isfinite(t).all() for t in [*self.model.parameters(), *moments]))],
                           device=self.ctx.device)
        if self.ctx.world_size > 1:
            dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        if bad.item():
            raise faults.TrainingStopped(f"step {self.step}: the weights or optimizer moments hold NaN or infinity; "
                                         f"refusing to save over the last checkpoint in {path}")
        self._saved_step = self.step
        meta = {
            "step": self.step,
            "elapsed_s": self.elapsed,
            "arch": self.cfg.arch,
            "model_config": self.model_config.to_dict(),
            "train_config": asdict(self.cfg),
            "layout": {"mode": self.ctx.mode, "tp": self.ctx.tp, "dp": self.ctx.dp, "pp": self.ctx.pp,
                       **self.ctx.options},
            "forward_count": self.model.seeds.forward_count,
        }
        if self.cfg.checkpoint_format == "single":
            return self._save_single(path, meta)
        from lattice import sharded_checkpoint as sharded

        steps = [int(state["step"]) for state in self.optimizer.state.values() if "step" in state]
        meta.update(optimizer_step=max(steps, default=0), rng={"torch": sharded.encode_rng(torch.get_rng_state())})
        if self.async_writer is not None:  # copy now; the thread writes the copy while training goes on
            state = sharded.training_state(self.model, self.optimizer, with_moments=bool(steps), staged=True)
            self.async_writer.submit(Path(path), meta, state, keep=self.cfg.keep)
            return Path(path) / sharded.SUBDIR / sharded.step_name(self.step)
        state = sharded.training_state(self.model, self.optimizer, with_moments=bool(steps))
        return sharded.write(Path(path), meta, state, keep=self.cfg.keep)

    def _save_single(self, path, meta: dict) -> Path:
        payload = {**meta, "model": self.model.full_state_dict(),
                   "optimizer": checkpoint.gather_optimizer(self.model, self.optimizer),
                   "rng": {"torch": torch.get_rng_state()}}
        target = checkpoint.single_file(path)
        if self.ctx.rank == 0:
            checkpoint.save(payload, target)
        if self.ctx.world_size > 1:
            dist.barrier()  # the file exists for every rank once save returns
        return target

    def _load(self, ckpt: dict) -> None:
        """This rank's shard of every saved tensor: sliced from full tensors (a single-file
        checkpoint, no communication) or read by DCP (sharded, a collective)."""
        checkpoint.load_into(ckpt, self.model, self.optimizer)
        self.step = self._saved_step = int(ckpt["step"])
        self.elapsed = float(ckpt.get("elapsed_s", 0.0))
        self.model.seeds.forward_count = int(ckpt.get("forward_count", self.step))
        rng = ckpt.get("rng", {}).get("torch")
        if rng is not None:
            from lattice.sharded_checkpoint import decode_rng

            torch.set_rng_state(decode_rng(rng) if isinstance(rng, str) else rng)
