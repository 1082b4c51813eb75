"""What a training run is, decided once before any collective: the run's config, the model it
trains, the checkpoint it resumes or starts from (read and validated) and the schedule changes a
resume may make (`specify_run` -> `RunSpec`); every size checked against the layout (`check_run`),
so that the launcher, every rank and the trainer refuse a bad request in the same one line."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from lattice import checkpoint
from lattice.data.batches import check_batch_size
from lattice.data.corpus import Corpus
from lattice.data.seq2seq import Seq2Seq
from lattice.data.tasks import TaskTokens, check_documents
from lattice.models import build_model, get_arch
from lattice.modes import get_mode
from lattice.parallel.context import LatticeConfigError, ParallelContext
from lattice.parallel.context_parallel import check_context_batch
from lattice.parallel.pipeline import batch_problem, microbatch_count
from lattice.training import faults
from lattice.training.config import TrainConfig
from lattice.training.optim import lr_at


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """Every decision of a training run, each taken once (`specify_run`) before any collective, and
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
    # what a command-line request adds (lattice.training.request.prepare_run): its layout, the
    # corpus it reads, the directory it writes, where its checkpoint was read and whether that
    # is a single file to convert to the sharded form first
    layout: Any = None
    corpus: Corpus | None = None
    run: Any = None
    resume_path: Path | None = None
    single_file: bool = False
    restart: Any = None  # lattice.training.request.Restart: a launcher's restart of this run's job
    options: Any = None  # lattice.planner.options.OptionChoice: the mode's options chosen for the run


def specify_run(cfg: TrainConfig, ctx: ParallelContext, corpus: Corpus, *, resume: str | os.PathLike | dict | None = None,
             allow_config_change: bool = False, resume_from: str | os.PathLike | None = None,
             init_from: dict | None = None) -> RunSpec:
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
    if cfg.task_name in ("lm", "mlm"):  # the corpus's windows against the batch (the other tasks read examples)
        check_batch_size(corpus, cfg.batch_size, cfg.batch_lengths(model_config)[0], ctx.dp)
    if cfg.pack_documents:
        check_documents(corpus)
    if ckpt is not None:
        checkpoint.check_model_config(ckpt, cfg.arch, model_config.to_dict(), resume_from)
    changed = faults.check_schedule(ckpt.get("train_config", {}), asdict(cfg), allow_config_change,
                                    resume_from) if ckpt is not None else []
    donor = check_init_from(cfg, model_config, init_from) if ckpt is None and cfg.init_from else None
    return RunSpec(cfg, model_config, ckpt, str(resume_from), donor, tuple(changed))


def model_and_batches(cfg: TrainConfig, ctx: ParallelContext, corpus: Corpus, ckpt: dict | None = None,
                      where="checkpoint"):
    """(model config, model, fixed validation batches, task) of a run on `corpus` (`lattice
    eval`'s): every size checked against the layout before any collective; with `ckpt`, a
    checkpoint of another model is refused."""
    model_config = cfg.model_config(corpus.vocab_size, corpus.specials)
    if ckpt is not None:
        checkpoint.check_model_config(ckpt, cfg.arch, model_config.to_dict(), where)
    check_run(cfg, model_config, ctx)
    return (model_config, *checked_model_and_batches(cfg, ctx, corpus, model_config))


def checked_model_and_batches(cfg: TrainConfig, ctx: ParallelContext, corpus: Corpus, model_config):
    """(model, fixed validation batches, task) of a checked run: this rank's shards of the model."""
    task = cfg.make_task(corpus, model_config)
    task.check(cfg.batch_size, cfg.batch_lengths(model_config)[0], ctx.dp)
    model = build_model(model_config, ctx, dtype=cfg.param_dtype, **cfg.recompute)
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
    with torch.device("meta"):  # what the model's constructors refuse (attention dropout under cp, ...)
        planned = get_arch(cfg.arch)(model_config, dataclasses.replace(ctx, pipeline=None))
    if ctx.pipeline is not None:
        with torch.device("meta"):
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
