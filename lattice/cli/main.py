"""The `lattice` command (also `python -m lattice`).

    # train the default model (preset "small", serial) on the built-in corpus, 1-2 minutes on 2 CPU cores
    lattice train
    # data parallel on 2 local processes (this command starts them through torch.distributed.run)
    lattice train --nproc 2 --dp 2 --steps 5
    # the same layout started by torchrun itself
    torchrun --standalone --nproc-per-node 2 -m lattice train --dp 2 --steps 5
    # tensor parallel modes with their options, combined with data parallelism
    lattice train --nproc 4 --mode 1d --tp 2 --dp 2 --sequence-parallel
    lattice train --nproc 4 --mode 2d --tp 4 --bf16 --activation-checkpointing
    # every run gets a new runs/run-N (runs/latest links to the newest); --out-dir names it
    lattice train --out-dir runs/a --steps 400
    # resume, in any layout, continuing in runs/a (every rank wrote its shards; DCP reshards)
    lattice train --steps 400 --resume runs/a --nproc 2 --mode 1d --tp 2
    # convert: sharded <-> one file of full tensors, to a HuggingFace directory, from one
    lattice convert runs/a runs/a.pt
    lattice convert runs/a --to hf runs/a-hf          # GPT2LMHeadModel.from_pretrained("runs/a-hf")
    lattice convert --from hf runs/a-hf runs/b        # then: lattice train --resume runs/b ...
    # which rank holds which slice of every parameter, and the groups of every mesh axis
    lattice info --mode 2d --tp 4 --dp 2
    # which layout: every setup of a model on N ranks ranked by predicted step time, and the command for the first
    lattice plan --auto --arch llama --model llama3-8b --gpus 16 --ranks-per-node 4 --batch 32 --machine h100-node
    lattice plan ...     # the analytic cost model of one layout (lattice.cost)
    lattice bench ...    # measured benchmarks (lattice.bench)
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from lattice.checkpoint.files import check_out_dir
from lattice.cli.arguments import (add_layout_arguments, add_train_arguments, config_toml, layout_from_args, run_config,
                                   train_config, with_config_file)
from lattice.cli.inference import add_inference_arguments, run_inference
from lattice.cli.info import run_info
from lattice.cli.launch import check_process_count, launch_local
from lattice.models import DEFAULT_ARCH
from lattice.modes.layout import Layout
from lattice.parallel.context import LatticeConfigError, TrainingStopped

if TYPE_CHECKING:  # (run_dir reaches torch.distributed.checkpoint: imported when training)
    from lattice.checkpoint.run_dir import RunDir
    from lattice.data.corpus import Corpus
    from lattice.training.run_spec import RunPlan

# subcommands whose arguments and implementation live in another module, imported only when used
# (so that `lattice train` does not import the benchmark's plotting)
DELEGATED = {
    "bench": ("lattice.bench", "add_bench_arguments", "run_bench", "measured benchmarks"),
    "plan": ("lattice.cli.plan", "add_plan_arguments", "run_plan", "analytic communication/compute/memory model"),
    "convert": ("lattice.cli.convert", "add_convert_arguments", "run_convert",
                "convert checkpoints: sharded <-> single file, to and from a HuggingFace model directory"),
}


# ----------------------------------------------------------------------------- train


def print_error(message: str) -> None:
    """`error: message` on stderr in one write. Under torchrun every rank prints its refusal to the
    pipe they share, and `print` writes the newline apart: another rank's line then landed between
    a line and its newline, two refusals on one line ("...run firsterror: --out-dir...")."""
    sys.stderr.write(f"error: {message}\n")
    sys.stderr.flush()


def check_train(args, nproc: int | None = None) -> tuple[Layout, RunPlan, Corpus, RunDir]:
    """A train request checked whole and decided without processes: the layout (and, with
    `nproc`, the processes the launcher is about to start), the checkpoint to resume and its
    family, the run's data and tokenizer (the corpus is built here: the model's vocabulary is the
    tokenizer's), the run plan (lattice.training.run_spec.plan_run: every size, the schedule, the
    --init-from weights), the directory it writes into (lattice.checkpoint.run_dir). Changes
    nothing but the token cache (an explicit out-dir is created if missing, once everything else
    passed, so a refused request leaves no directory behind); the launcher runs it
    before starting processes and every rank before any process group exists, so a bad request
    fails in one line, the same everywhere, and the trainer builds from the plan without checking
    again. Returns (layout, run plan, corpus, run dir)."""
    from lattice import checkpoint
    from lattice.checkpoint import run_dir
    from lattice.data.corpus import check_data
    from lattice.training import faults
    from lattice.training.run_spec import plan_run

    layout = layout_from_args(args)
    ckpt = checkpoint.read(args.resume) if args.resume else None
    where = checkpoint.resolve(args.resume) if ckpt is not None else None
    resumed_run = checkpoint.run_of(where) if ckpt is not None and checkpoint.is_sharded(ckpt) else None
    run = run_dir.choose(args.out_dir, resumed_run, int(ckpt["step"]) if ckpt is not None else None, args.overwrite)
    saved = ckpt.get("train_config", {}) if ckpt is not None else {}
    if ckpt is not None and args.arch is not None and checkpoint.arch_of(ckpt) != args.arch:
        raise LatticeConfigError(f"--resume {where} holds a {checkpoint.arch_of(ckpt)} model, and --arch {args.arch} "
                                 f"asks for another family; drop --arch (a resumed run continues its own family)")
    init = None
    if ckpt is None and args.init_from and Path(args.init_from).exists():
        init = checkpoint.read(args.init_from)  # read once: the plan takes it as it is
    # the family: --arch, else the checkpoint's that the run resumes or starts from
    arch = args.arch or next((checkpoint.arch_of(c) for c in (ckpt, init) if c is not None), DEFAULT_ARCH)
    recorded = {}
    if ckpt is not None:  # the run continues as it was: its data, tokenizer and model
        recorded = {**_recorded_data(args, saved, where), **_resumed_tokenizer(args, where, saved),
                    "model_from": _resumed_model(args, ckpt, arch)}
    if init is not None:
        recorded = _init_from_model(args, init, arch)
    tcfg = train_config(args, saved if ckpt is not None else None, arch=arch, out_dir=str(run.out), **recorded)
    check_data(tcfg.data, tcfg.tokenizer, tcfg.vocab_size)
    corpus = tcfg.corpus()
    plan = plan_run(tcfg, layout.context(), corpus, resume=ckpt, resume_from=where,
                    allow_config_change=args.allow_config_change, init_from=init)
    if nproc is not None:  # after the layout's own refusals, which say more about the request
        check_process_count(layout, nproc, "train")
    # last, as these create directories: a request refused above leaves none behind
    if run.fresh:  # created later, by one process: here only its parent
        check_out_dir(run.out.parent, checkpoint.FILENAME)
    else:
        check_out_dir(run.out, checkpoint.FILENAME)
        faults.RunLock(run.out).probe()
    return layout, plan, corpus, run


def _converted_to_sharded(ckpt: dict, where: Path, out: Path, ctx) -> dict:
    """A single-file checkpoint (`lattice convert`'s export, or OUT/ckpt.pt of runs before
    training wrote only sharded checkpoints) converted by rank 0 into OUT/checkpoints/step-N, as
    `lattice convert` does; every rank then resumes that."""
    import torch.distributed as dist

    from lattice import checkpoint
    from lattice.checkpoint import sharded
    from lattice.checkpoint.convert import import_single

    target = out / sharded.SUBDIR / sharded.step_name(int(ckpt["step"]))
    alone = dist.new_group([0]) if ctx.world_size > 1 else None  # (every rank creates every group)
    if ctx.rank == 0:
        import_single(ckpt, out, group=alone)
        print(f"converted the single-file checkpoint {where} into {target} (as `lattice convert` does); resuming "
              f"from it", flush=True)
    if ctx.world_size > 1:
        dist.barrier()
    return checkpoint.read(target)


def _recorded_data(args, saved: dict, where) -> dict:
    """Without --data, a resumed run continues on the data it was trained on (and refuses it if
    the files changed since): the TrainConfig fields that say so. --data given explicitly trains
    on that instead."""
    from lattice.data.corpus import data_hash
    from lattice.training.config import TrainConfig

    if args.data is not None or not saved.get("data"):
        return {}
    fields = ("data", "data_format", "text_key", "pair_key", "source_key", "target_key", "tokenizer")
    data = {k: saved[k] for k in fields if k in saved}
    now = data_hash(data["data"], saved.get("data_format", "text"), TrainConfig.from_dict(saved).data_keys())
    if saved.get("data_hash") and now != saved["data_hash"]:
        raise LatticeConfigError(f"the data {data['data']} changed since {where} was saved (content hash "
                                 f"{saved['data_hash']} then, {now} now); pass --data {data['data']} to train on it as "
                                 f"it is, or restore the original files")
    return data


def _resumed_model(args, ckpt: dict, arch: str) -> dict:
    """The model a resumed run continues: its checkpoint's whole config (an imported HF model's
    sizes included), with the fields of a --model preset given on this command line (a
    mismatch is then refused by name, as for any size flag)."""
    from lattice.models import get_arch

    model = dict(ckpt["model_config"])
    if args.model is not None:
        config_class = get_arch(arch).config_class
        if args.model not in config_class.presets:
            config_class.preset(args.model)  # refuses the unknown name, listing the family's presets
        model.update(config_class.presets[args.model])
    return model


def _init_from_model(args, init: dict, arch: str) -> dict:
    """A run started --init-from a checkpoint of its family trains the checkpoint's model (its
    whole config, an imported HF model's sizes included; a --model preset or size flags replace
    their fields, and the task sets the heads it adds), reading text as those weights were
    trained to: with the checkpoint run's tokenizer (TrainConfig takes it) and its vocabulary
    size, unless --tokenizer or --vocab-size say otherwise."""
    from lattice import checkpoint
    from lattice.data.corpus import read_tokenizer

    if checkpoint.arch_of(init) != arch or "model_config" not in init:
        return {}  # refused with its reason when the run is planned
    model = {k: v for k, v in _resumed_model(args, init, arch).items() if k not in ("num_labels", "dropout")}
    out = {"model_from": model}
    run_tokenizer = checkpoint.run_of(checkpoint.resolve(args.init_from)) / "tokenizer.json"
    if args.vocab_size is None and args.tokenizer is None and run_tokenizer.is_file():
        saved = init.get("train_config", {}).get("vocab_size")
        out["vocab_size"] = saved or read_tokenizer(run_tokenizer, "the checkpoint's tokenizer",
                                                    "restore its file or pass --tokenizer").get_vocab_size()
    return out


def _resumed_tokenizer(args, where: Path, saved: dict) -> dict:
    """A resumed run reads text with the tokenizer its weights were trained with, the run's
    tokenizer.json, on its recorded data or on new --data alike: the TrainConfig field that says
    so. An explicit --tokenizer is refused when its ids differ from that one's."""
    from lattice import checkpoint
    from lattice.data.corpus import read_tokenizer

    run_tokenizer = checkpoint.run_of(where) / "tokenizer.json"
    if not run_tokenizer.is_file():  # a single file exported elsewhere: the data decide, as before
        return {}
    if args.tokenizer is None:
        size = read_tokenizer(run_tokenizer, "the run's tokenizer", "restore the run's file").get_vocab_size()
        if args.vocab_size is not None and args.vocab_size != size:
            raise LatticeConfigError(f"--vocab-size {args.vocab_size} asks for a new BPE, and {where} reads its text "
                                     f"with its own tokenizer.json of {size} tokens (vocab_size {size} vs "
                                     f"{args.vocab_size}); drop --vocab-size to continue the run, or start a new "
                                     f"one with --init-from {where}")
        # the vocabulary the run counted from (an import records none: its tokenizer's)
        return {"tokenizer": str(run_tokenizer), "vocab_size": saved.get("vocab_size") or size}
    given = Path(args.tokenizer) / "tokenizer.json" if Path(args.tokenizer).is_dir() else Path(args.tokenizer)
    if given.is_file() and given.resolve() != run_tokenizer.resolve():
        theirs = read_tokenizer(run_tokenizer, "the run's tokenizer", "restore the run's file").get_vocab()
        ours = read_tokenizer(given, "--tokenizer", "pass a tokenizer.json, or drop --tokenizer").get_vocab()
        if theirs != ours:
            moved = sum(ours.get(token) != i for token, i in theirs.items())
            raise LatticeConfigError(f"--tokenizer {args.tokenizer} gives {moved} of the {len(theirs)} tokens of "
                                     f"{run_tokenizer} other ids, and the resumed weights were trained on those ids; "
                                     f"drop --tokenizer to keep the run's, or start a new run (--init-from {where})")
    return {}


def cmd_train(args, argv: list[str]) -> int:
    import torch.distributed as dist

    from lattice import checkpoint
    from lattice.checkpoint import run_dir
    from lattice.checkpoint import sharded as sharded_checkpoint
    from lattice.data.corpus import skipped_files, write_specials
    from lattice.modes.layout import init
    from lattice.training import faults
    from lattice.training.evaluation import validation_metric
    from lattice.training.trainer import Trainer

    launched = "WORLD_SIZE" in os.environ  # started by torchrun (ours or the user's)
    if args.nproc is not None and args.nproc < 1:
        raise LatticeConfigError(f"--nproc must be >= 1, got {args.nproc}")
    if args.nproc and args.nproc > 1 and not launched:
        _, _, _, run = check_train(args, nproc=args.nproc)  # builds the tokenizer and token cache once, here
        for line in run_dir.create(run):
            print(line, flush=True)
        # the workers write where this process chose (a fresh runs/run-N now exists, empty)
        return launch_local(args.nproc, [*argv, "--out-dir", str(run.out)],
                            resume_hint=run_dir.resume_command(argv, run.out))
    if launched and args.nproc and args.nproc != int(os.environ["WORLD_SIZE"]):
        raise LatticeConfigError(f"--nproc {args.nproc} but torchrun started {os.environ['WORLD_SIZE']} processes; "
                                 f"drop --nproc when launching with torchrun")
    if launched:
        faults.die_with_parent()  # killing the launcher must not leave this worker training
    # every rank, before any process group exists (torchrun's world is checked against the layout by init)
    layout, plan, corpus, run = check_train(args, nproc=None if launched else 1)
    tcfg, ckpt = plan.cfg, plan.resume
    ctx = init(layout, seed=tcfg.seed, timeout=tcfg.dist_timeout)
    out, lock = run.out, None
    try:
        if ctx.rank == 0:
            print("config: " + ", ".join(f"{k}={v}" for k, v in run_config(layout, tcfg).items()), flush=True)
            skipped = skipped_files(tcfg.data) if tcfg.data else None
            if skipped:
                print(skipped, flush=True)
            for line in run_dir.create(run):  # after init: every rank chose before anything was created
                print(line, flush=True)
            lock = faults.RunLock(out).acquire()
            faults.remove_stale_temps(out, checkpoint.FILENAME)
            sharded_checkpoint.remove_partial(out)
            (out / "config.toml").write_text(config_toml(run_config(layout, tcfg)))
        if ctx.world_size > 1:
            dist.barrier()  # the run directory exists before any rank writes into it
        if ckpt is not None and ctx.rank == 0:
            print(f"resuming from {checkpoint.resolve(args.resume)} at step {ckpt['step']}", flush=True)
        if ckpt is not None and not checkpoint.is_sharded(ckpt):  # training resumes the sharded form
            plan = dataclasses.replace(plan, resume=_converted_to_sharded(ckpt, checkpoint.resolve(args.resume), out, ctx))
        trainer = Trainer.from_plan(plan, ctx, corpus)
        cut = trainer.task.truncation(trainer.seq_len)
        if cut and ctx.rank == 0:
            print(f"--data {tcfg.data}: {cut}", flush=True)
        specials = trainer.task.tokens.describe(trainer.corpus.tokenizer)
        if specials and ctx.rank == 0:
            print(specials, flush=True)
        _, left_out = validation_metric(trainer.task, ctx)
        if left_out and ctx.rank == 0:
            print(f"{left_out}; `lattice eval {out}` (pp = 1, cp = 1, any tensor layout) gives the "
                  f"{trainer.task.metric}", flush=True)
        if ctx.rank == 0:  # the run directory describes itself: tokenizer and data
            kept = tcfg.tokenizer and Path(tcfg.tokenizer).resolve() == (out / "tokenizer.json").resolve()
            if not kept:  # a resumed run's own file stays as it is, byte for byte
                trainer.corpus.tokenizer.save(str(out / "tokenizer.json"))
                write_specials(trainer.corpus, out)
            (out / "data.json").write_text(_data_identity(tcfg, getattr(trainer.task, "label_names", None)))
        result = trainer.fit()
        by = result["stopped_by"]
        if by:
            if ctx.rank == 0:
                print(f"stopped by {'--stop-at' if by == 'stop_at' else by} at step {result['step']}; checkpoint "
                      f"saved in {out}; continue with: {run_dir.resume_command(argv, out)}", flush=True)
            # a signal: 128 + its number, as a shell reports a process it ended (so that `lattice train
            # ... && next` does not go on), once the checkpoint is saved
            return 0 if by == "stop_at" else 128 + int(signal.Signals[by])
        if ctx.rank == 0:
            print(f"final val loss: {result['val_loss']:.4f} nats/{trainer.task.loss_unit} (step {result['step']})")
            if "metric" in result:
                name, trivial = result["trivial"]
                print(f"val {result['metric']}: {result['val_score']:.3f} ({name} {trivial:.3f})", flush=True)
            else:
                print(f"unigram baseline: {result['unigram_baseline']:.4f} nats/token", flush=True)
    except TrainingStopped as e:
        then = ""
        if isinstance(e, sharded_checkpoint.WriteFailed) and sharded_checkpoint.complete(out):
            then = f"; then continue with: {run_dir.resume_command(argv, out)}"
        print_error(f"{e}{then}")
        return 3
    except RuntimeError as e:  # a collective that timed out: name the rank that stopped making progress
        if "timed out" not in str(e).lower() and "timeout" not in str(e).lower():
            raise
        from lattice.parallel.comm import last_collective

        stalled = faults.stalled_ranks(out, ctx.world_size)
        where = (f"{last_collective['op']} over {last_collective['group_size']} ranks" if last_collective
                 else "a collective")
        print_error(f"rank {ctx.rank}: {where} waited more than --dist-timeout {args.dist_timeout:g} s; {stalled} "
                    f"(stack dumps above)")
        return 1
    finally:
        if lock is not None:
            lock.release()
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


# ----------------------------------------------------------------------------- main


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lattice", description="Multi-dimensional tensor parallel training of "
                                                                 "transformer families.",
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    add_train_arguments(sub.add_parser("train", help="train a model (any family, any layout) on the built-in corpus "
                                                       "or your own text"))
    add_layout_arguments(sub.add_parser("info", help="print which rank holds which shard, and the groups"))
    add_inference_arguments(sub.add_parser("generate", help="continue a prompt with a trained model, in any layout"),
                             generate=True)
    add_inference_arguments(sub.add_parser("eval", help="validation loss and perplexity of a trained model, in any "
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
            args = with_config_file(argv, args.config)
            args.command = "train"
        if args.command == "train":
            return cmd_train(args, argv)
        if args.command == "info":
            return run_info(args)
        if args.command in ("generate", "eval"):
            return run_inference(args, argv)
        module_name, _, run_name, _ = DELEGATED[args.command]
        return int(getattr(importlib.import_module(module_name), run_name)(args) or 0)
    except LatticeConfigError as e:
        message = str(e)
        if args.command != "train":  # a checkpoint refusal's way out names a flag only train has
            from lattice.checkpoint.files import START_FRESH

            message = message.replace(f", {START_FRESH}", "")
        print_error(message)
        return 2
    except TrainingStopped as e:  # (train handles its own) a convert whose checkpoint could not be written
        print_error(str(e))
        return 3
    except BrokenPipeError:  # `lattice info | head`: the reader left; stop quietly, as cat does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def _data_identity(tcfg, labels: list[str] | None) -> str:
    import json

    from lattice.data.corpus import data_files

    files = [str(p) for p in data_files(tcfg.data)] if tcfg.data else ["built-in corpus (pydoc_data.topics)"]
    return json.dumps({"data": tcfg.data, "files": files, "format": tcfg.data_format, "text_key": tcfg.text_key,
                       "content_hash": tcfg.data_hash, "tokenizer": tcfg.tokenizer,
                       **({"labels": labels} if labels else {})}, indent=1) + "\n"


