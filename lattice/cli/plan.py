"""`lattice plan`: the analytic model's communication, compute and memory for a layout, a
pipeline split or every tp x pp split of N ranks.

    lattice plan --arch llama --model llama3-8b --mode 2d --tp 16 --precision bf16
    lattice plan --arch bert --model bert-base --task classify --mode 1d --tp 4
    lattice plan --auto --arch llama --model llama3-8b --gpus 16 --ranks-per-node 4 --batch 32 --machine h100-node
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

import torch

from lattice.cli.arguments import add_layout_flags, add_size_flags, given_sizes, layout_from_args
from lattice.cli.plan_report import (format_cost, format_pipeline, format_search, format_splits, format_table1,
                                     mode_verdicts)
from lattice.cost.machine import PAPER_CLUSTER
from lattice.cost.machines import MACHINES, PRESET_SOURCES, machine_named, machine_of_device, rates_of
from lattice.cost.model import estimate, model_config
from lattice.data.corpus import DEFAULT_VOCAB
from lattice.models import DEFAULT_ARCH, available_archs, get_arch
from lattice.modes import available_modes, get_mode, parallel_modes
from lattice.modes.layout import PIPELINE_SETTINGS
from lattice.parallel.context import LatticeConfigError
from lattice.parallel.pipeline import batch_problem
from lattice.parallel.zero import ZERO_STAGES
from lattice.planner.pricing import Choice, command_flag, price
from lattice.planner.search import search
from lattice.training.config import PRECISIONS, REDUCE_DTYPES


AUTO_MACHINE = "h100-node"


def add_plan_arguments(p: argparse.ArgumentParser) -> None:
    add_layout_flags(p, mode=parallel_modes()[0], tp=4)
    p.add_argument("--arch", default=DEFAULT_ARCH, choices=available_archs(), help=f"model family (default {DEFAULT_ARCH})")
    p.add_argument("--rank", type=int, default=0, help="which rank's share to show")
    p.add_argument("--model", default=None, metavar="PRESET",
                   help="size preset of the family (default its default preset, e.g. small for gpt2)")
    p.add_argument("--vocab-size", type=int, default=None,
                   help=f"default: the preset's (published models), else the built-in corpus's {DEFAULT_VOCAB}")
    add_size_flags(p)
    p.add_argument("--batch", type=int, default=8,
                   help="global batch: sequences per optimizer step, split over --dp replicas (as in train)")
    p.add_argument("--bf16", action="store_true", help="2-byte activations and parameters")
    p.add_argument("--activation-checkpointing", action="store_true")
    p.add_argument("--selective-checkpointing", action="store_true")
    p.add_argument("--precision", default=None, choices=PRECISIONS,
                   help="bf16: bf16 weights with fp32 master weights, moments and gradient reduction (as in train); "
                        "default fp32, and with --auto every precision the machine has a rate for")
    p.add_argument("--zero", type=int, default=0, choices=ZERO_STAGES,
                   help="distributed optimizer stage over --dp (as in train): its traffic and memory per rank")
    p.add_argument("--grad-reduce-dtype", default="fp32", choices=REDUCE_DTYPES,
                   help="with --precision bf16: the gradients' reduction over dp in bf16 (as in train), priced at 2 "
                        "bytes an element (default fp32)")
    p.add_argument("--overlap-param-gather", action=argparse.BooleanOptionalAction, default=None,
                   help="with --zero 1 or 2: the all-gather of updated weights beside the next forward (as in train; "
                        "default on with --zero)")
    p.add_argument("--machine", default=None, metavar="here|PRESET|JSON",
                   help=f"`here` (this host's rates, calibrated once and cached), a preset ({', '.join(MACHINES)}) or "
                        f"Machine fields as inline JSON or a JSON file (e.g. a calibration from `lattice bench`); "
                        f"default: the papers' 4-GPU-node cluster, with --auto this host's GPU preset, else `here` "
                        f"where this host runs --gpus ranks, else {AUTO_MACHINE}")
    p.add_argument("--recalibrate", action="store_true",
                   help="with --machine here: measure this host's rates again rather than read the cached ones "
                        "(default: off)")
    p.add_argument("--auto", action="store_true",
                   help="search every layout of the model on --gpus ranks (each mode and its options, tp, cp, pp with "
                        "its schedule and micro-batches, dp, ZeRO, precision, activation checkpointing, placement), "
                        "drop those over --memory, and rank the rest by predicted step time")
    p.add_argument("--gpus", type=int, default=None, metavar="N", help="ranks in all (--auto)")
    p.add_argument("--memory", type=float, default=None, metavar="GiB",
                   help="memory per rank (--auto; default 90%% of the machine's device memory, no limit where it has "
                        "none)")
    p.add_argument("--top", type=int, default=5, help="setups --auto lists (default 5)")
    p.add_argument("--modes", default=None, metavar="M,M", help="the modes --auto searches (default every one)")
    p.add_argument("--json", action="store_true", help="--auto's answer as JSON, for scripts")
    p.add_argument("--splits", type=int, default=None, metavar="N",
                   help="project every tp x pp split of N ranks per replica (Megatron-LM Fig. 9) and name the fastest")
    p.add_argument("--table1", action="store_true",
                   help="print Optimus Table 1 for this b, s, h, p beside this model's rows for every mode")
    p.add_argument("--task", default=None, metavar="TASK",
                   help="what the model trains on, as in train (default the family's first: lm, mlm for bert, seq2seq "
                        "for t5); classify prices an encoder's classifier head instead of its masked-LM head")
    p.add_argument("--num-labels", type=int, default=2, help="classes of --task classify (default 2)")


def run_plan(args) -> int:
    """Refusals (LatticeConfigError) reach `lattice.cli.main.main`, which prints them in one line."""
    tasks = get_arch(args.arch).tasks
    task = args.task or tasks[0]
    if task not in tasks:
        raise LatticeConfigError(f"--arch {args.arch} trains on {' or '.join(tasks)}, not --task {task}; pass one of "
                                 f"those (classify and mlm are bert's, seq2seq t5's)")
    if task == "classify" and args.num_labels < 2:
        raise LatticeConfigError(f"--num-labels {args.num_labels}: a classifier needs at least 2 classes")
    head = {"num_labels": args.num_labels} if task == "classify" else {}
    cfg = model_config(args.arch, args.model, vocab_size=args.vocab_size, **given_sizes(args), **head)
    replicas = 1 if args.auto else max(args.dp, 1)  # a --dp below 1 is refused by the layout, in its own words
    if args.auto and args.batch < 1:
        raise LatticeConfigError(f"--batch {args.batch}: give the global batch, the sequences of one step, e.g. --batch 8")
    if args.batch < 1 or args.batch % replicas:
        raise LatticeConfigError(f"--batch {args.batch} is the global batch of one step and must split over --dp "
                                 f"{replicas} replicas; use a positive multiple of {replicas}")
    batch = args.batch // replicas  # per replica, what one replica's ranks compute on
    if args.auto:
        return _run_auto(args, cfg, batch=args.batch)
    if args.precision is None:
        args.precision = "fp32"
    if args.grad_reduce_dtype != "fp32" and args.precision != "bf16":
        raise LatticeConfigError("--grad-reduce-dtype bf16 reduces bf16 gradients; it needs --precision bf16")
    if args.overlap_param_gather and not args.zero:
        raise LatticeConfigError("--overlap-param-gather overlaps the distributed optimizer's all-gather of updated "
                                 "weights with the next forward; it needs --zero 1 or 2")
    if args.table1:
        print(format_table1(batch, cfg.seq_len, cfg.d_model, args.tp))
        return 0
    machine = machine_named(args.machine) if args.machine else PAPER_CLUSTER
    if args.ranks_per_node is None:  # the machine's nodes place the layout's groups
        args.ranks_per_node = machine.ranks_per_node
    elif args.ranks_per_node != machine.ranks_per_node:
        machine = dataclasses.replace(machine, ranks_per_node=args.ranks_per_node)
    # what the planner prices (lattice.planner.pricing.price): the setups that `plan --auto` ranks
    setup = dict(zero=args.zero, precision=args.precision, checkpointing=args.activation_checkpointing,
                 selective=args.selective_checkpointing)
    if args.splits:
        print(format_splits(cfg, args.splits, batch=batch, machine=machine, setup=setup,
                            layout_of=lambda tp, pp: layout_from_args(
                                args, tp=tp, pp=pp, **({} if pp > 1 else dict.fromkeys(PIPELINE_SETTINGS)))))
        return 0
    layout = layout_from_args(args)
    if args.pp > 1:
        print(format_pipeline(cfg, layout, batch=batch, machine=machine, setup=setup))
        return 0
    passes = layout.accumulation  # the table is one pass's
    if passes > 1:
        problem = batch_problem(passes, get_mode(layout.mode), layout.context(), batch, cfg.seq_len)
        if problem:  # as training refuses it
            raise LatticeConfigError(f"{problem}; give --batch a multiple of {passes * replicas} or fewer --microbatches")
        print(f"gradient accumulation: one of {passes} passes of {batch // passes} sequences below; a step runs "
              f"{passes} of them, then one gradient reduction and one update")
    c = estimate(cfg, layout, batch=batch // passes, rank=args.rank, dtype=torch.bfloat16 if args.bf16 else torch.float32,
                 activation_checkpointing=args.activation_checkpointing,
                 selective_checkpointing=args.selective_checkpointing, zero=args.zero,
                 precision=args.precision, grad_reduce_dtype=args.grad_reduce_dtype,
                 overlap_param_gather=args.overlap_param_gather)
    print(format_cost(c, machine))
    if not (args.bf16 or args.grad_reduce_dtype != "fp32" or args.overlap_param_gather):  # what it prices
        step = price(cfg, Choice(layout, **setup), batch=args.batch, machine=machine).step_s
        print(f"  a training step as `plan --auto` prices it (the Trainer's one-number all-reduces and the waits "
              f"for the slowest rank added): {step * 1e3:.3f} ms")
    return 0


def _run_auto(args, cfg, *, batch: int) -> int:
    """`--auto`: the planner's ranking (lattice.planner.search), as text or JSON."""
    if not args.gpus or args.gpus < 1:
        raise LatticeConfigError("--auto needs --gpus N, the ranks to plan for (e.g. --gpus 16)")
    if args.memory is not None and args.memory <= 0:
        raise LatticeConfigError(f"--memory {args.memory}: give the memory per rank in GiB, e.g. --memory 80")
    if args.top < 1:
        raise LatticeConfigError(f"--top {args.top}: list at least one setup")
    modes = None
    if args.modes:
        modes = args.modes.split(",")
        unknown = sorted(set(modes) - set(available_modes()))
        if unknown:
            raise LatticeConfigError(f"--modes {args.modes}: no mode {', '.join(unknown)}; the modes are "
                                     f"{', '.join(available_modes())}")
    machine, rates = auto_machine(args)  # (after the checks that need no machine: `here` may calibrate)
    rpn = args.ranks_per_node or machine.ranks_per_node
    machine = dataclasses.replace(machine, ranks_per_node=rpn)
    if args.precision and args.precision != machine.precision and not machine.other_precision_flop_rate:
        raise LatticeConfigError(f"--precision {args.precision}: {machine.name} has a matrix-product rate for "
                                 f"{machine.precision} only; drop --precision or give a machine with both")
    precisions = (args.precision,) if args.precision else None
    plan = search(cfg, gpus=args.gpus, machine=machine, batch=batch, memory_gib=args.memory, ranks_per_node=rpn,
                  precisions=precisions, modes=modes)
    shown = modes or sorted({p.choice.layout.mode for p in plan.ranked} | set(plan.refused) | set(plan.closest_over))
    command = (_train_command(args, plan.ranked[0].choice.train_flags(), gpus=args.gpus, ranks_per_node=rpn,
                              batch=batch) if plan.ranked else None)  # the first choice as a run
    if args.json:
        print(json.dumps({"model": repr(cfg), "gpus": args.gpus, "ranks_per_node": rpn, "machine": machine.name,
                          "rates": rates,
                          "batch": batch, "seq_len": cfg.seq_len, "memory_limit_bytes": plan.memory_limit, "priced": plan.priced,
                          "fit": len(plan.ranked), "over_memory": plan.over_memory, "seconds": plan.seconds,
                          "refused": plan.refused, "top": [p.as_dict() for p in plan.ranked[:args.top]],
                          "modes": mode_verdicts(plan, shown), "command": command}, indent=1))
        return 0
    print(rates)
    print(format_search(plan, cfg=cfg, gpus=args.gpus, ranks_per_node=rpn, machine=machine, batch=batch, top=args.top,
                        modes=shown, command=command))
    return 0


def auto_machine(args) -> tuple:
    """(`--auto`'s machine, a line saying whose rates they are and how old): `--machine here` this
    host's (lattice.bench.host, calibrated at --gpus ranks once and cached); a preset or JSON as
    named; with none named, on a GPU host its preset, else `here` where this host runs --gpus
    ranks, else AUTO_MACHINE."""
    from lattice.bench import host

    name = args.machine
    if name is None:
        if torch.cuda.is_available():
            machine, preset = machine_of_device(torch.cuda.get_device_name(0))
            return machine, f"rates: {preset}, the preset of this host's GPU ({PRESET_SOURCES[preset.split()[0]]})"
        if args.gpus > host.RANKS_PER_CORE * host.cores():
            return machine_named(AUTO_MACHINE), (f"rates: {rates_of(AUTO_MACHINE)} (--gpus {args.gpus} is more ranks "
                                                 f"than this host runs; --machine names another)")
        name = "here"
    if name == "here":
        machine, rates = host.host_machine([args.gpus], recalibrate=args.recalibrate,
                                           log=lambda line: print(line, file=sys.stderr, flush=True))
        return machine, rates
    if args.recalibrate:
        raise LatticeConfigError(f"--recalibrate measures this host's rates: it goes with --machine here, not "
                                 f"--machine {name[:60]}")
    return machine_named(name), f"rates: {rates_of(name)}"


def _train_command(args, layout_flags: str, *, gpus: int, ranks_per_node: int, batch: int) -> str:
    """`lattice train` of the model `plan --auto` priced in the setup of `layout_flags`, started on
    its ranks: --nproc on one node, torchrun on each of several."""
    flags = [f"--arch {args.arch}"] + ([f"--model {args.model}"] if args.model else [])
    if args.vocab_size is not None:
        flags.append(f"--vocab-size {args.vocab_size}")
    flags += [command_flag(name, value) for name, value in given_sizes(args).items()]
    if args.task:
        flags.append(f"--task {args.task}")
    flags += [f"--batch-size {batch}", layout_flags]
    if gpus <= ranks_per_node:
        start = "lattice train" + (f" --nproc {gpus}" if gpus > 1 else "")
    else:
        nodes, last = -(-gpus // ranks_per_node), gpus % ranks_per_node
        start = (f"torchrun --nnodes {nodes} --nproc-per-node {ranks_per_node} --rdzv-backend c10d "
                 f"--rdzv-endpoint HOST:29500 -m lattice train")
        if last:  # a shell comment, so that the line still runs as it is copied
            flags.append(f"  # on each node; on the last, --nproc-per-node {last}")
    return f"{start} {' '.join(flags)}"
