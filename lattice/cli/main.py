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
import importlib
import os
import signal
import sys
import time

from lattice.cli.arguments import add_layout_arguments, add_train_arguments, train_request, with_config_file
from lattice.cli.inference import add_inference_arguments, run_inference
from lattice.cli.info import run_info
from lattice.cli.launch import SHARED_STORE, launch_local
from lattice.parallel.context import Diverged, LatticeConfigError, TrainingStopped

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


def cmd_train(args, argv: list[str]) -> int:
    import torch.distributed as dist

    from lattice import checkpoint
    from lattice.checkpoint import run_dir
    from lattice.checkpoint import sharded as sharded_checkpoint
    from lattice.data.corpus import sources_of
    from lattice.data.text_files import skipped_files
    from lattice.modes.layout import init
    from lattice.training import faults
    from lattice.training.config import config_toml, run_config
    from lattice.training.evaluation import validation_metric
    from lattice.training.request import JobOver, prepare_run, sharded_resume, write_run_config, write_run_files
    from lattice.training.trainer import Trainer

    started = faults.process_start_time()
    launched = "WORLD_SIZE" in os.environ  # started by torchrun (ours or the user's)
    if args.nproc is not None and args.nproc < 1:
        raise LatticeConfigError(f"--nproc must be >= 1, got {args.nproc}")
    if args.max_restarts < 0:
        raise LatticeConfigError(f"--max-restarts must be >= 0, got {args.max_restarts}")
    if launched and args.max_restarts:
        raise LatticeConfigError("--max-restarts is lattice's own launcher's; under torchrun pass it to torchrun "
                                 f"(torchrun --max-restarts {args.max_restarts} ... -m lattice train ...)")
    if (args.nproc and args.nproc > 1 or args.max_restarts) and not launched:
        nproc = args.nproc or 1
        import torch

        # builds the tokenizer and token cache once, here; on a GPU the workers choose the mode's
        # options (the launcher leaves CUDA uninitialised for the processes it forks)
        spec = prepare_run(train_request(args), nproc=nproc, choose_options=not torch.cuda.is_available())
        run = spec.run
        if spec.options is not None:
            print(spec.options.describe(), flush=True)
        for line in run_dir.create(run):
            print(line, flush=True)
        # the workers write where this process chose (a fresh runs/run-N now exists, empty), with the
        # options it chose
        workers = run_dir.without_flags(argv, {"--max-restarts": 1})  # the restarts are the launcher's
        chosen = [f"-o{k}={spec.options.options[k]}" for k in spec.options.chosen] if spec.options else []
        status = launch_local(nproc, [*workers, *chosen, "--out-dir", str(run.out)], max_restarts=args.max_restarts,
                              resume_hint=run_dir.resume_command(argv, run.out))
        job = run_dir.read_job(run.out) or {}
        if status == 0 and job.get("state") == "stopped":  # the workers ended the job rather than restart it
            print_error(job.get("reason", "the run stopped"))
            return 3
        return status
    if launched and args.nproc and args.nproc != int(os.environ["WORLD_SIZE"]):
        raise LatticeConfigError(f"--nproc {args.nproc} but torchrun started {os.environ['WORLD_SIZE']} processes; "
                                 f"drop --nproc when launching with torchrun")
    if launched:
        faults.die_with_parent()  # killing the launcher must not leave this worker training
    # every rank, before any process group exists (torchrun's world is checked against the layout by init)
    try:
        spec = prepare_run(train_request(args), nproc=None if launched else 1)
    except JobOver as e:  # a launcher's restart after the run ended: exiting 0 ends the job
        if int(os.environ.get("RANK", "0")) == 0:
            print(e, flush=True)
        return 0
    layout, tcfg, ckpt, restart = spec.layout, spec.cfg, spec.resume, spec.restart
    ctx = init(layout, seed=tcfg.seed, timeout=tcfg.dist_timeout)
    out, lock = spec.run.out, None
    try:
        if ctx.rank == 0:
            if spec.options is not None:
                print(spec.options.describe(), flush=True)
            print("config: " + ", ".join(f"{k}={v}" for k, v in run_config(layout, tcfg).items()), flush=True)
            texts = sources_of(tcfg.data) if tcfg.data and tcfg.data_format in ("text", "jsonl") else []
            skipped = [line for line in (skipped_files(path) for _, path in texts) if line]
            for line in skipped + spec.corpus.about:
                print(line, flush=True)
            for line in run_dir.create(spec.run):  # after init: every rank chose before anything was created
                print(line, flush=True)
            lock = faults.RunLock(out).acquire()
            if restart is not None:
                for line in run_dir.set_aside(out, list(restart.skipped)):
                    print(line, flush=True)
                at = (f"resuming from {restart.resume}" if restart.resume else
                      "no intact checkpoint in the run yet: starting as the command asks")
                print(f"restart {restart.count} of job {restart.run_id} (the launcher's restarts of this node's "
                      f"workers): {at}", flush=True)
            run_dir.write_job(out, new=restart is None, run_id=os.environ.get("TORCHELASTIC_RUN_ID"), state="running",
                              restarts=restart.count if restart else 0)
            if os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") != "0" and \
                    os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
                print("note: torchrun shares its rendezvous store with the workers' process group, where restarted "
                      "workers can read the addresses of the ones before them (pytorch#135712) and fail once more; "
                      f"start torchrun with {SHARED_STORE}=1", flush=True)
            faults.remove_stale_temps(out, checkpoint.FILENAME)
            write_run_config(spec, config_toml(run_config(layout, tcfg)))
            sharded_checkpoint.remove_partial(out)
        if ctx.world_size > 1:
            dist.barrier()  # the run directory exists before any rank writes into it
        if ckpt is not None and ctx.rank == 0:
            print(f"resuming from {spec.resume_path} at step {ckpt['step']}", flush=True)
        initialised = time.time()
        trainer = Trainer.from_spec(sharded_resume(spec, ctx), ctx, spec.corpus)
        if restart is not None and restart.failed_at is not None:
            trainer.recovery = {"failed_at": restart.failed_at, "started": started, "initialised": initialised,
                                "loaded": time.time(), "restart": restart.count}
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
        if ctx.rank == 0:  # the run directory describes itself: its tokenizer and data
            write_run_files(spec, trainer.corpus, getattr(trainer.task, "label_names", None))
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
            run_dir.write_job(out, state="finished", step=result["step"])
            print(f"final val loss: {result['val_loss']:.4f} nats/{trainer.task.loss_unit} (step {result['step']})")
            if "metric" in result:
                name, trivial = result["trivial"]
                print(f"val {result['metric']}: {result['val_score']:.3f} ({name} {trivial:.3f})", flush=True)
            else:
                print(f"unigram baseline: {result['unigram_baseline']:.4f} nats/token", flush=True)
    except Diverged as e:  # a restart from the last checkpoint would diverge again: the job ends here
        if ctx.rank == 0:
            run_dir.write_job(out, state="stopped", reason=str(e))
        if os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") != "0":
            if ctx.rank == 0:
                print(f"{e}; not restarted: a restart would reach the same step (recorded in "
                      f"{out / run_dir.JOB_FILE}); ending the job", flush=True)
            return 0  # any other status would have the launcher restart it
        print_error(str(e))
        return 3
    except TrainingStopped as e:
        then = ""
        if isinstance(e, sharded_checkpoint.WriteFailed) and sharded_checkpoint.complete(out):
            then = f"; then continue with: {run_dir.resume_command(argv, out)}"
        print_error(f"{e}{then}")
        return 3
    except RuntimeError as e:  # a collective that timed out: name the rank that stopped making progress
        if "timed out" not in str(e).lower() and "timeout" not in str(e).lower():
            if os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") == "0":
                raise
            # a peer died mid-collective: the launcher restarts the workers, which resume on their own
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
            print_error(f"rank {ctx.rank}: a collective failed ({first}); the launcher starts the workers again")
            return 1
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
