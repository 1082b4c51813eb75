"""The `lattice` command (also `python -m lattice`).

    # train the default model (preset "small", serial) on the built-in corpus, ~3 min on 2 CPU cores
    lattice train
    # data parallel on 2 local processes (this command starts them through torch.distributed.run)
    lattice train --nproc 2 --dp 2 --steps 5
    # the same layout started by torchrun itself
    torchrun --standalone --nproc-per-node 2 -m lattice train --dp 2 --steps 5
    # tensor parallel modes with their options, combined with data parallelism
    lattice train --nproc 4 --mode 1d --tp 2 --dp 2 --sequence-parallel
    lattice train --nproc 4 --mode 2d --tp 4 --bf16 --activation-checkpointing
    # resume, in any layout (every rank wrote its shards into runs/a/checkpoints/step-N; DCP reshards)
    lattice train --out-dir runs/a --steps 400 --resume runs/a
    # convert: sharded <-> one file of full tensors, to a HuggingFace directory, from one
    lattice convert runs/a runs/a.pt
    lattice convert runs/a --to hf runs/a-hf          # GPT2LMHeadModel.from_pretrained("runs/a-hf")
    lattice convert --from hf runs/a-hf runs/b        # then: lattice train --resume runs/b ...
    # which rank holds which slice of every parameter, and the groups of every mesh axis
    lattice info --mode 2d --tp 4 --dp 2
    lattice plan ...     # analytic cost model (lattice.cost)
    lattice bench ...    # measured benchmarks (lattice.bench)
"""

from __future__ import annotations

import argparse
import importlib
import math
import os
import sys
from dataclasses import asdict
from pathlib import Path

from lattice.context import LatticeConfigError
from lattice.layout import PIPELINE_OPTIONS, make_topology
from lattice.models import DEFAULT_ARCH, available_archs, get_arch
from lattice.modes import REFERENCE_MODE, available_modes
from lattice.options import add_mode_option_flags, given_mode_options
from lattice.pipeline import SCHEDULES

# subcommands whose arguments and implementation live in another module, imported only when used
# (so that `lattice train` does not import the benchmark's plotting)
DELEGATED = {
    "bench": ("lattice.bench", "add_bench_arguments", "run_bench", "measured benchmarks"),
    "plan": ("lattice.cost.plan", "add_plan_arguments", "run_plan", "analytic communication/compute/memory model"),
    "convert": ("lattice.convert", "add_convert_arguments", "run_convert",
                "convert checkpoints: sharded <-> single file, to and from a HuggingFace model directory"),
}


# ----------------------------------------------------------------------------- arguments
def _add_layout_arguments(p: argparse.ArgumentParser, arch_from_run: bool = False) -> None:
    p.add_argument("--arch", default=None, choices=available_archs(),
                   help="model family (default: the run's)" if arch_from_run else
                        f"model family (default {DEFAULT_ARCH}; with --resume, the run's)")
    p.add_argument("--mode", default=REFERENCE_MODE, choices=available_modes(),
                   help=f"parallel layout (default {REFERENCE_MODE})")
    p.add_argument("--tp", type=int, default=1, help="ranks per model replica (tensor parallel degree)")
    p.add_argument("--dp", type=int, default=1, help="data-parallel replicas")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages (a model replica is tp x pp ranks)")
    p.add_argument("--microbatches", type=int, default=None, help="micro-batches per step with --pp (default pp)")
    p.add_argument("--pp-schedule", choices=SCHEDULES, default=None,
                   help="pipeline schedule (default 1f1b)")
    p.add_argument("--pp-virtual", type=int, default=None, help="virtual stages per rank, interleaved (default 2)")
    p.add_argument("--pp-layers", default=None, metavar="N,N,...",
                   help="blocks per (virtual) stage (default: an even split)")
    p.add_argument("--pp-scatter-gather", action=argparse.BooleanOptionalAction, default=None,
                   help="send 1/tp of a replicated residual between stages and all-gather it (default on)")
    add_mode_option_flags(p)
    p.add_argument("--ranks-per-node", type=int, default=None, help="ranks per node for placement")
    p.add_argument("--placement", choices=("natural", "topology"), default="natural")
    p.add_argument("--model", default=None, metavar="PRESET",
                   help="size preset of the family (default its default, e.g. small for gpt2; " +
                        "; ".join(f"{a}: {', '.join(get_arch(a).config_class.presets)}" for a in available_archs()) + ")")
    for flag, what in (("--d-model", "width"), ("--n-layers", "transformer blocks"), ("--n-heads", "attention heads"),
                       ("--seq-len", "context length")):
        p.add_argument(flag, type=int, default=None, help=f"{what} (default: the preset's)")
    p.add_argument("--vocab-size", type=int, default=None, help="BPE vocabulary of the built-in corpus")


def _add_train_arguments(p: argparse.ArgumentParser) -> None:
    from lattice.train import TrainConfig

    d = TrainConfig()
    _add_layout_arguments(p)
    p.add_argument("--nproc", type=int, default=None,
                   help="start this many local processes through torch.distributed.run")
    p.add_argument("--data", default=None, metavar="PATH",
                   help="train on your own text: a file, a directory of files or a glob (default: the built-in corpus)")
    p.add_argument("--data-format", choices=("text", "jsonl"), default=d.data_format)
    p.add_argument("--text-key", default=d.text_key, help="the field of each JSON line (--data-format jsonl)")
    p.add_argument("--tokenizer", default=None, metavar="PATH",
                   help="a tokenizer.json or a directory holding one (default: a byte-level BPE trained on the data)")
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--batch-size", "--batch", type=int, default=d.batch_size, help="global batch (sequences)")
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--warmup", type=int, default=d.warmup)
    p.add_argument("--weight-decay", type=float, default=d.weight_decay)
    p.add_argument("--grad-clip", type=float, default=d.grad_clip)
    p.add_argument("--dropout", type=float, default=d.dropout)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--eval-interval", type=int, default=d.eval_interval)
    p.add_argument("--eval-batches", type=int, default=d.eval_batches)
    p.add_argument("--out-dir", "--checkpoint-dir", default="runs/latest",
                   help="where checkpoints and metrics.csv go (default runs/latest)")
    p.add_argument("--checkpoint-interval", type=int, default=d.checkpoint_interval,
                   help="steps between checkpoints (0: only at the end)")
    p.add_argument("--checkpoint-format", choices=("sharded", "single"), default=d.checkpoint_format,
                   help="sharded (default): every rank writes its own shards into OUT/checkpoints/step-N "
                        "(torch.distributed.checkpoint); single: rank 0 writes OUT/ckpt.pt of full tensors")
    p.add_argument("--keep", type=int, default=d.keep, metavar="K",
                   help=f"keep the newest K sharded checkpoints (default {d.keep}; 0 keeps all)")
    p.add_argument("--async-checkpoint", action="store_true",
                   help="write sharded checkpoints on a background thread while training goes on")
    p.add_argument("--dtype", choices=("float32", "float64"), default=d.dtype,
                   help="weights and optimizer state (float64 for exact comparisons; --bf16 is autocast)")
    p.add_argument("--resume", default=None, metavar="CKPT",
                   help="a run directory (its newest complete checkpoint), a checkpoint directory or a ckpt.pt")
    p.add_argument("--on-nan", choices=("stop", "skip"), default=d.on_nan,
                   help="a non-finite loss or gradient norm stops the run (default) or skips the step")
    p.add_argument("--dist-timeout", type=float, default=d.dist_timeout,
                   help="seconds a collective waits for the other ranks before the run fails and names the stalled "
                        f"rank (default {d.dist_timeout:.0f})")
    p.add_argument("--allow-config-change", action="store_true",
                   help="with --resume: allow a different --steps/--lr/--warmup/--batch-size/--seed")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="peak TFLOP/s of one device, for the model FLOP utilisation logged to TensorBoard")
    p.add_argument("--bf16", action="store_true", help="bf16 autocast")
    p.add_argument("--activation-checkpointing", action="store_true")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--config", default=None, metavar="TOML",
                   help="a TOML file of train flags (e.g. steps = 500, mode = \"1d\"); flags given here override it")


def _layout_kwargs(args) -> dict:
    kw = dict(tp=args.tp, dp=args.dp, placement=args.placement, **given_mode_options(args))
    kw.update(pp=args.pp, **{k: getattr(args, k) for k in PIPELINE_OPTIONS if getattr(args, k) is not None})
    if args.ranks_per_node:
        kw["ranks_per_node"] = args.ranks_per_node
    return kw


def _train_config(args):
    from lattice.data import DEFAULT_VOCAB
    from lattice.train import TrainConfig

    return TrainConfig(data=args.data, data_format=args.data_format, text_key=args.text_key, tokenizer=args.tokenizer,
                       arch=args.arch or DEFAULT_ARCH, model=args.model, d_model=args.d_model, n_layers=args.n_layers, n_heads=args.n_heads,
                       seq_len=args.seq_len, vocab_size=args.vocab_size or DEFAULT_VOCAB, dropout=args.dropout,
                       steps=args.steps, batch_size=args.batch_size, lr=args.lr, warmup=args.warmup,
                       weight_decay=args.weight_decay, grad_clip=args.grad_clip, seed=args.seed,
                       eval_interval=args.eval_interval, eval_batches=args.eval_batches, bf16=args.bf16,
                       activation_checkpointing=args.activation_checkpointing, out_dir=args.out_dir,
                       checkpoint_interval=args.checkpoint_interval, checkpoint_format=args.checkpoint_format,
                       keep=args.keep, async_checkpoint=args.async_checkpoint, dtype=args.dtype,
                       progress=not args.no_progress,
                       on_nan=args.on_nan, dist_timeout=args.dist_timeout, peak_tflops=args.peak_tflops)


# ----------------------------------------------------------------------------- train
def _check_before_launch(args) -> None:
    """Everything that can be refused without processes, so a bad request fails once, in one
    line, instead of in every child's traceback."""
    import torch

    from lattice.context import MeshAxis
    from lattice.layout import plan
    from lattice.modes import get_mode
    from lattice.pipeline import check_batch as check_pipeline_batch

    topo, _ = make_topology(args.mode, **_layout_kwargs(args))
    if args.nproc != topo.world_size:
        axes = " x ".join(f"{a.value}={s}" for a, s in topo.axes)
        raise LatticeConfigError(f"--nproc {args.nproc} does not match the layout: mode {args.mode!r} with {axes} "
                                 f"has {topo.world_size} ranks; use --nproc {topo.world_size} or change --tp/--dp/--pp")
    ckpt = _resume_checkpoint(args)
    tcfg = _train_config(args)
    cfg = tcfg.model_config()
    ctx = plan(args.mode, **_layout_kwargs(args))
    mode = get_mode(args.mode)(cfg, ctx)  # the mode's size checks
    if ctx.pipeline is not None:
        ctx.pipeline.chunks(cfg.n_layers)  # the stage split
    if tcfg.batch_size % topo.size(MeshAxis.DP) == 0:  # (the trainer words the other case)
        replica = torch.zeros(tcfg.batch_size // topo.size(MeshAxis.DP), cfg.seq_len, dtype=torch.int64)
        mode.check_batch(replica)
        if ctx.pipeline is not None:
            check_pipeline_batch(ctx.pipeline, mode, replica)
    _check_out_dir_and_resume(args, tcfg, cfg, ckpt)


def _resume_checkpoint(args) -> dict | None:
    """The checkpoint --resume names (validated), and the family: --arch, else the run's, else
    the default."""
    from lattice import checkpoint

    ckpt = checkpoint.read(args.resume) if args.resume else None
    if args.arch is None:
        args.arch = checkpoint.arch_of(ckpt) if ckpt is not None else DEFAULT_ARCH
    return ckpt


def _check_out_dir_and_resume(args, tcfg, cfg, ckpt) -> None:
    """The out-dir (usable, not in use by another run) and the checkpoint to resume, if any. On
    every rank before any process group exists, and in the launcher before any process starts."""
    from lattice import checkpoint, faults

    if args.out_dir:
        out = faults.check_out_dir(args.out_dir, checkpoint.FILENAME)
        faults.RunLock(out).probe()
    if ckpt is not None:
        where = checkpoint.resolve(args.resume)
        checkpoint.check_model_config(ckpt, tcfg.arch, cfg.to_dict(), where)
        faults.check_schedule(ckpt.get("train_config", {}), asdict(tcfg), args.allow_config_change, where)
        _continue_on_recorded_data(args, ckpt.get("train_config", {}), where)


def _continue_on_recorded_data(args, saved: dict, where) -> None:
    """Without --data, a resumed run continues on the data it was trained on (and refuses it if
    the files changed since); --data given explicitly trains on that instead."""
    from lattice.data import data_hash

    if args.data is not None or not saved.get("data"):
        return
    args.data, args.data_format = saved["data"], saved.get("data_format", "text")
    args.text_key, args.tokenizer = saved.get("text_key", "text"), saved.get("tokenizer")
    now = data_hash(args.data, args.data_format, args.text_key)
    if saved.get("data_hash") and now != saved["data_hash"]:
        raise LatticeConfigError(f"the data {args.data} changed since {where} was saved (content hash "
                                 f"{saved['data_hash']} then, {now} now); pass --data {args.data} to train on it as "
                                 f"it is, or restore the original files")


def _launch(args, argv: list[str]) -> int:
    """Re-run this command line on --nproc local processes through torchrun's Python API
    (`elastic_launch`; its command-line parser would mistake our --nproc for --nproc-per-node)."""
    import uuid

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    if args.command == "train":
        _check_before_launch(args)
        _train_config(args).corpus()  # build the tokenizer and token cache once, here, not on every rank
    else:  # generate / eval: the checkpoint and the layout, before any process starts
        _load_for_inference(args, plan_only=True)
    # as torchrun does: N processes with all the cores' threads each would oversubscribe the CPU
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // args.nproc)))
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=args.nproc, run_id=str(uuid.uuid4()),
                          rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0)
    try:
        elastic_launch(config, sys.executable)("-m", "lattice", *argv)
    except ChildFailedError as e:
        print(f"error: {len(e.failures)} of {args.nproc} processes failed (their messages are above)", file=sys.stderr)
        return 1
    except SignalException as e:  # the agent passed the signal on; the workers saved at a step boundary
        print(f"stopped by {e.sigval.name}: the workers checkpointed in {args.out_dir} (continue with --resume "
              f"{args.out_dir})", file=sys.stderr)
        return 128 + int(e.sigval)
    return 0


def cmd_train(args, argv: list[str]) -> int:
    import torch.distributed as dist

    import lattice
    from lattice import checkpoint, faults, sharded_checkpoint
    from lattice.train import Trainer

    launched = "WORLD_SIZE" in os.environ  # started by torchrun (ours or the user's)
    if args.nproc is not None and args.nproc < 1:
        raise LatticeConfigError(f"--nproc must be >= 1, got {args.nproc}")
    if args.nproc and args.nproc > 1 and not launched:
        return _launch(args, argv)
    if launched and args.nproc and args.nproc != int(os.environ["WORLD_SIZE"]):
        raise LatticeConfigError(f"--nproc {args.nproc} but torchrun started {os.environ['WORLD_SIZE']} processes; "
                                 f"drop --nproc when launching with torchrun")
    if launched:
        faults.die_with_parent()  # killing the launcher must not leave this worker training
    ckpt = _resume_checkpoint(args)
    tcfg = _train_config(args)
    cfg = tcfg.model_config()
    _check_out_dir_and_resume(args, tcfg, cfg, ckpt)  # every rank, before any process group exists
    tcfg = _train_config(args)  # with the recorded data of a resumed run
    ctx = lattice.init(args.mode, seed=args.seed, timeout=args.dist_timeout, **_layout_kwargs(args))
    lock = None
    try:
        if ctx.rank == 0:
            print("config: " + ", ".join(f"{k}={v}" for k, v in _resolved_config(args).items()), flush=True)
        if ctx.rank == 0 and args.out_dir:
            out = Path(args.out_dir)
            lock = faults.RunLock(out).acquire()
            faults.remove_stale_temps(out, checkpoint.FILENAME)
            sharded_checkpoint.remove_partial(out)
            (out / "config.toml").write_text(_config_toml(args))
        trainer = Trainer(tcfg, ctx, resume=ckpt, allow_config_change=args.allow_config_change)
        if ctx.rank == 0 and args.out_dir:  # the run directory describes itself: tokenizer and data
            trainer.corpus.tokenizer.save(str(out / "tokenizer.json"))
            (out / "data.json").write_text(_data_identity(tcfg))
        result = trainer.fit()
        if ctx.rank == 0:
            if result["stopped_by"]:
                print(f"stopped by {result['stopped_by']} at step {result['step']}; checkpoint saved in {args.out_dir}; "
                      f"continue with --resume {args.out_dir}", flush=True)
                return 0
            print(f"final val loss: {result['val_loss']:.4f} nats/token (step {result['step']})")
            print(f"unigram baseline: {result['unigram_baseline']:.4f} nats/token", flush=True)
    except faults.TrainingStopped as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 3
    except RuntimeError as e:  # a collective that timed out: name the rank that stopped making progress
        if "timed out" not in str(e).lower() and "timeout" not in str(e).lower():
            raise
        from lattice.comm import last_collective

        stalled = faults.stalled_ranks(Path(args.out_dir) if args.out_dir else None, ctx.world_size)
        where = (f"{last_collective['op']} over {last_collective['group_size']} ranks" if last_collective
                 else "a collective")
        print(f"error: rank {ctx.rank}: {where} waited more than --dist-timeout {args.dist_timeout:g} s; {stalled} "
              f"(stack dumps above)", file=sys.stderr, flush=True)
        return 1
    finally:
        if lock is not None:
            lock.release()
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


# ----------------------------------------------------------------------------- generate, eval
def _add_inference_arguments(p: argparse.ArgumentParser, generate: bool) -> None:
    p.add_argument("run", metavar="DIR", help="a run directory written by `lattice train` (or a checkpoint in it)")
    _add_layout_arguments(p, arch_from_run=True)
    p.add_argument("--nproc", type=int, default=None, help="start this many local processes")
    p.add_argument("--seed", type=int, default=0)
    if generate:
        p.add_argument("--prompt", required=True, help="the text to continue")
        p.add_argument("--max-new-tokens", type=int, default=50)
        p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
        p.add_argument("--top-k", type=int, default=None)
    else:
        p.add_argument("--eval-batches", type=int, default=None, help="validation batches (default: the run's)")
        p.add_argument("--data", default=None, metavar="PATH",
                       help="evaluate on this text instead (its last 10%%, tokenized with the run's tokenizer)")
        p.add_argument("--data-format", choices=("text", "jsonl"), default="text")
        p.add_argument("--text-key", default="text")


def _load_for_inference(args, plan_only: bool = False):
    """The checkpoint, its model config and the layout; with plan_only, only validate them."""
    from lattice import checkpoint
    from lattice.layout import plan
    from lattice.modes import get_mode

    ckpt = checkpoint.read(args.run)
    arch = checkpoint.arch_of(ckpt)
    if args.arch is not None and args.arch != arch:
        raise LatticeConfigError(f"{args.run} holds a {arch} model, not {args.arch}; drop --arch (the run's family is "
                                 f"read from it) or pass another run")
    cfg = get_arch(arch).config_class.from_dict(ckpt["model_config"])
    get_mode(args.mode)(cfg, plan(args.mode, **_layout_kwargs(args)))  # the mode's size checks
    if plan_only:
        topo, _ = make_topology(args.mode, **_layout_kwargs(args))
        if args.nproc != topo.world_size:
            raise LatticeConfigError(f"--nproc {args.nproc} does not match the layout: it has {topo.world_size} ranks; "
                                     f"use --nproc {topo.world_size}")
    return ckpt, cfg


def _smallest_batch(model) -> int:
    """The fewest copies of one prompt that the layout can split (2d: q, 3d: q², ...)."""
    import torch

    for b in range(1, 513):
        try:
            model.mode.check_batch(torch.zeros(b, 1, dtype=torch.int64))
            return b
        except LatticeConfigError:
            continue
    raise LatticeConfigError(f"mode {model.ctx.mode!r} accepts no batch of up to 512 sequences")


def cmd_inference(args, argv: list[str]) -> int:
    """`lattice generate` and `lattice eval`: load any checkpoint into any layout."""
    import time

    import torch
    import torch.distributed as dist

    import lattice
    from lattice import checkpoint
    from lattice.data import load_corpus

    launched = "WORLD_SIZE" in os.environ
    if args.nproc and args.nproc > 1 and not launched:
        return _launch(args, argv)
    ckpt, cfg = _load_for_inference(args)
    ctx = lattice.init(args.mode, seed=args.seed, **_layout_kwargs(args))
    try:
        if args.command == "eval":
            from lattice.train import TrainConfig, Trainer

            saved = ckpt.get("train_config", {})
            other = {}
            if args.data:  # other text, read with the tokenizer the run was trained with
                run_dir = checkpoint.run_dir(args.run)
                other = {"data": args.data, "data_format": args.data_format, "text_key": args.text_key,
                         "tokenizer": str(run_dir / "tokenizer.json") if (run_dir / "tokenizer.json").exists()
                         else saved.get("tokenizer")}
            tcfg = TrainConfig.from_dict({**saved, "arch": checkpoint.arch_of(ckpt), "out_dir": None, "progress": False,
                                          **other,
                                          **({"eval_batches": args.eval_batches} if args.eval_batches else {})})
            loss = Trainer(tcfg, ctx, resume=ckpt, allow_config_change=True).evaluate()
            if ctx.rank == 0:
                print(f"val loss {loss:.4f} nats/token, perplexity {math.exp(loss):.2f} "
                      f"({tcfg.eval_batches} batches of {tcfg.batch_size} x {cfg.seq_len} tokens of "
                      f"{tcfg.data or 'the built-in corpus'}, step {ckpt['step']})")
            return 0
        run_dir = checkpoint.run_dir(args.run)
        saved_tokenizer = run_dir / "tokenizer.json"
        if saved_tokenizer.is_file():  # the tokenizer the run was trained with
            from tokenizers import Tokenizer

            tokenizer = Tokenizer.from_file(str(saved_tokenizer))
            encode, decode = (lambda text: tokenizer.encode(text).ids), tokenizer.decode
        else:
            corpus = load_corpus(ckpt.get("train_config", {}).get("vocab_size", cfg.vocab_size))
            encode, decode = corpus.encode, corpus.decode
        model = lattice.build_model(cfg, ctx)
        checkpoint.load_into(ckpt, model)  # weights only
        ids = encode(args.prompt)
        if not ids:
            raise LatticeConfigError("--prompt encodes to no tokens; give some text")
        copies = _smallest_batch(model)
        prompt = torch.tensor([ids] * copies, dtype=torch.int64, device=ctx.device)
        t0 = time.perf_counter()
        out = model.generate(prompt, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k, seed=args.seed)
        dt = time.perf_counter() - t0
        if ctx.rank == 0:
            print(args.prompt + decode(out[0, len(ids):].tolist()))
            print(f"{args.max_new_tokens} tokens in {dt:.2f} s: {copies / dt:.2f} sequences/s, "
                  f"{copies * args.max_new_tokens / dt:.1f} tokens/s (batch {copies}, {args.mode} on "
                  f"{ctx.world_size} ranks)", file=sys.stderr)
        return 0
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


# ----------------------------------------------------------------------------- info
def _fmt_slice(slices, shape) -> str:
    return "[" + ", ".join(f"{s.start}:{s.stop}" if (s.start, s.stop) != (0, n) else ":"
                           for s, n in zip(slices, shape)) + "]"


def cmd_info(args) -> int:
    """Print a layout from the shard specs alone: no processes, no weights (a meta model)."""
    import torch

    from lattice.cost.plan import model_config
    from lattice.layout import plan
    from lattice.models import build_model

    kw = _layout_kwargs(args)
    ctx = plan(args.mode, **kw)
    topo = ctx.topology
    arch = args.arch or DEFAULT_ARCH
    cfg = model_config(arch, args.model, vocab_size=args.vocab_size, d_model=args.d_model,
                       n_layers=args.n_layers, n_heads=args.n_heads, seq_len=args.seq_len)
    with torch.device("meta"):
        model = build_model(cfg, ctx)
    axes = " x ".join(f"{a.value}={s}" for a, s in topo.axes)
    print(f"layout: mode {args.mode}, {topo.world_size} ranks, mesh {axes}, options {dict(ctx.options)}")
    print(f"model: {arch} {args.model or type(cfg).default_preset} {cfg.to_dict()}, {model.num_parameters():,} parameters")
    if ctx.pipeline is not None:
        _print_stages(model)
    print("ranks (mesh coordinates, node):")
    for r in range(topo.world_size):
        coords = ", ".join(f"{a.value}={c}" for a, c in topo.coords(r).items())
        print(f"  rank {r}: {coords}; node {topo.node_of(r)}")
    print("groups per mesh axis:")
    for axis in topo.axis_names:
        print(f"  {axis.value}: " + " ".join(str(g) for g in topo.all_groups(axis)))
    _print_message_counts(args, topo)
    print("parameters: full shape, spec; then each distinct slice and the ranks holding it")
    for name, spec in model.specs.items():
        held: dict[str, list[int]] = {}
        for r in range(topo.world_size):
            coords = topo.coords(r)
            key = _fmt_slice(spec.slices(coords, topo), spec.storage_shape) if spec.holds(coords) else "none"
            held.setdefault(key, []).append(r)
        pad = f" padded to {list(spec.padded_shape)}" if spec.padded_shape else ""
        print(f"  {name} {list(spec.full_shape)}{pad}: {spec.describe(topo)}")
        print("      " + "; ".join(f"{k} on ranks {v}" for k, v in held.items()))
    return 0


def _print_stages(model) -> None:
    """Which (virtual) stage holds which of the model's parts, and on which ranks."""
    from lattice.context import MeshAxis

    ctx, parts = model.ctx, model.parts_
    pcfg, topo = ctx.pipeline, ctx.topology
    chunks = pcfg.chunks(len(model.blocks))
    virtual = f", {pcfg.v} virtual stages per rank" if pcfg.v > 1 else ""
    print(f"pipeline: {pcfg.stages} stages, schedule {pcfg.schedule}, {pcfg.m} micro-batches{virtual}; bubble "
          f"(p-1)/(v m) = {pcfg.bubble():.3f}")
    for c, blocks in enumerate(chunks):
        stage = c % pcfg.stages
        ranks = [r for r in range(topo.world_size) if topo.coords(r)[MeshAxis.PP] == stage]
        held = (list(parts.first) if c == 0 else []) + [f"{parts.blocks} {blocks.start}-{blocks.stop - 1}"]
        held += list(parts.last) + ["loss"] if c == len(chunks) - 1 else []
        label = f"stage {stage}" + (f" (chunk {c})" if pcfg.v > 1 else "")
        print(f"  {label}: {', '.join(held)}; ranks {ranks}")


def _print_message_counts(args, topo) -> None:
    """SUPER Eq. 3 counted on the layout: one collective over each mesh axis, every rank one
    message to each member of its group, split into intra- and inter-node messages, for this
    placement and the other one."""
    from lattice.cost import count_messages

    kw = _layout_kwargs(args)
    layouts = {}
    for placement in ("natural", "topology") if topo.pp_size == 1 else ("natural",):
        layouts[placement], _ = make_topology(args.mode, **{**kw, "placement": placement})
    print(f"messages of one collective over each axis, {topo.ranks_per_node} ranks per node "
          f"(intra-node / inter-node; SUPER Eq. 3):")
    for axis in topo.model_axes:
        counts = "; ".join(f"{placement} placement {'%d / %d' % count_messages(t, (axis,))}"
                           for placement, t in layouts.items())
        print(f"  {axis.value}: {counts}")


# ----------------------------------------------------------------------------- main
def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lattice", description="Multi-dimensional tensor parallel training of "
                                                                 "transformer families.",
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_train_arguments(sub.add_parser("train", help="train a model (any family, any layout) on the built-in corpus "
                                                       "or your own text"))
    _add_layout_arguments(sub.add_parser("info", help="print which rank holds which shard, and the groups"))
    _add_inference_arguments(sub.add_parser("generate", help="continue a prompt with a trained model, in any layout"),
                             generate=True)
    _add_inference_arguments(sub.add_parser("eval", help="validation loss and perplexity of a trained model, in any "
                                                         "layout"), generate=False)
    for name, (module_name, add_name, _, help_text) in DELEGATED.items():
        p = sub.add_parser(name, help=help_text)
        if name == command:
            getattr(importlib.import_module(module_name), add_name)(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    args = build_parser(command).parse_args(argv)
    try:
        if getattr(args, "config", None):
            args = _with_config_file(build_parser(command), argv, args.config)
        if args.command == "train":
            return cmd_train(args, argv)
        if args.command == "info":
            return cmd_info(args)
        if args.command in ("generate", "eval"):
            return cmd_inference(args, argv)
        module_name, _, run_name, _ = DELEGATED[args.command]
        return int(getattr(importlib.import_module(module_name), run_name)(args) or 0)
    except LatticeConfigError as e:
        message = str(e)
        if args.command != "train":  # a checkpoint refusal's way out names a flag only train has
            from lattice.checkpoint_files import START_FRESH

            message = message.replace(f", {START_FRESH}", "")
        print(f"error: {message}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `lattice info | head`: the reader left; stop quietly, as cat does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def _data_identity(tcfg) -> str:
    import json

    from lattice.data import data_files

    files = [str(p) for p in data_files(tcfg.data)] if tcfg.data else ["built-in corpus (pydoc_data.topics)"]
    return json.dumps({"data": tcfg.data, "files": files, "format": tcfg.data_format, "text_key": tcfg.text_key,
                       "content_hash": tcfg.data_hash, "tokenizer": tcfg.tokenizer}, indent=1) + "\n"


def _resolved_config(args) -> dict:
    """Every train flag's value for this run (defaults, config file and command line resolved)."""
    skip = {"command", "config", "nproc"}
    return {k: v for k, v in sorted(vars(args).items()) if k not in skip and v is not None and v != []}


def _config_toml(args) -> str:
    """The resolved config as a TOML file that `--config` reads back (JSON scalars, strings and
    lists are valid TOML values)."""
    import json

    return "".join(f"{k} = {json.dumps(v)}\n" for k, v in _resolved_config(args).items())


def _with_config_file(parser: argparse.ArgumentParser, argv: list[str], path: str) -> argparse.Namespace:
    """Parse again with a TOML file's keys (train flags without the dashes, `-` or `_` alike)
    as defaults, so that flags given on the command line override the file."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        raise LatticeConfigError("--config needs Python 3.11 or newer (tomllib)") from None
    try:
        with open(path, "rb") as f:
            values = tomllib.load(f)
    except OSError as e:
        raise LatticeConfigError(f"--config {path} cannot be read ({e.strerror}); pass a TOML file") from None
    except tomllib.TOMLDecodeError as e:
        raise LatticeConfigError(f"--config {path} is not valid TOML ({e}); fix the file") from None
    sub = next(a for a in parser._subparsers._group_actions[0].choices.values() if a.prog.endswith(argv[0]))
    known = {a.dest: a for a in sub._actions if a.dest not in ("help", "config")}
    given = {k.replace("-", "_"): v for k, v in values.items()}
    unknown = sorted(set(given) - set(known))
    if unknown:
        raise LatticeConfigError(f"--config {path} has unknown keys {unknown}; use the names of `lattice {argv[0]}` "
                                 f"flags, e.g. {', '.join(sorted(known)[:6])}")
    sub.set_defaults(**given)
    return parser.parse_args(argv)
    sys.exit(main())
