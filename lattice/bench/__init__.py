"""`lattice bench`: every applicable mode, and PyTorch's own tensor parallelism as the peer, on the
same model, weights and batch, one after another in one set of processes.

    lattice bench --nproc 4                      # one size: table, JSON and PNG
    lattice bench --sweep all                    # weak + strong scaling over p = 1, 2, 4, 8, 9,
                                                 # calibration and the 16/36/64-GPU projection
    python -m lattice.bench ...                  # the same without the CLI

Per mode it reports the median forward, backward and step (forward + backward + AdamW update)
time, the slowest rank's per step; the communication CommMeter measured in one step next to
`lattice.cost`'s figure; the bytes autograd saved for backward and the parameter bytes (the
largest on any rank). The modes are built first and their timed steps interleaved round-robin,
so that the load of a shared machine falls on all of them alike. A rank is one process with one
thread; serial runs on rank 0 alone.

The peer ("dtensor") is a plain-PyTorch GPT-2 (nn.Linear, separate q/k/v) loaded with lattice's
serial weights and parallelised over a 1-D DeviceMesh as torchtitan does without sequence
parallelism: q, k, v and fc ColwiseParallel, both output projections RowwiseParallel, the
attention input prepared once as Replicate (one gradient all-reduce for q, k, v together), the
token embedding RowwiseParallel (vocabulary-split, output all-reduced) and the tied LM head
ColwiseParallel with `loss_parallel`, so neither side ever gathers logits; wpe and LayerNorms are
replicated. For `--arch llama` the peer is transformers' own LlamaForCausalLM under torchtitan's
Llama plan (q/k/v and gate/up ColwiseParallel behind one Replicate input each, o_proj and
down_proj RowwiseParallel, the token table RowwiseParallel and the untied LM head
ColwiseParallel into `loss_parallel`). Its collectives are counted by a dispatch mode in
CommMeter's units.
"""


from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from lattice.bench.provenance import provenance
from lattice.bench.measure import label_options, variants
from lattice.bench.report import (SIZES, STRONG, STRONG_BATCH, WEAK, crossovers, format_projection, format_table,
                                  machine_info, plot_single, plot_sweeps, prediction_errors, projection, weak_config)
from lattice.bench.world import bench_size
from lattice.checkpoint.files import check_out_dir
from lattice.models import DEFAULT_ARCH, available_archs
from lattice.models.gpt2 import GPTConfig
from lattice.modes import REFERENCE_MODE, parallel_modes
from lattice.parallel.context import LatticeConfigError


def add_bench_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nproc", type=int, default=4, help="processes (ranks per model replica), default 4")
    p.add_argument("--arch", default=DEFAULT_ARCH, choices=available_archs(), help=f"model family (default {DEFAULT_ARCH})")
    p.add_argument("--model", default=None, metavar="PRESET",
                   help="size preset of the family (default its default preset, e.g. small for gpt2)")
    p.add_argument("--vocab-size", type=int, default=2048)
    p.add_argument("--seq-len", type=int, default=None, help="sequence length (default: the preset's)")
    p.add_argument("--n-layers", type=int, default=None)
    p.add_argument("--d-model", type=int, default=None, help="width (default: the preset's)")
    p.add_argument("--n-heads", type=int, default=None, help="attention heads (default: the preset's)")
    p.add_argument("--batch", type=int, default=8,
                   help="global batch: sequences per step of the one replica the --nproc ranks form (default 8)")
    p.add_argument("--modes", default=None,
                   help="comma-separated, from: " + ", ".join([REFERENCE_MODE, *parallel_modes(), *variants(), "dtensor"])
                        + " (default: every registered mode and dtensor)")
    p.add_argument("--steps", type=int, default=8, help="timed steps per mode (median reported)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--activation-checkpointing", action="store_true")
    p.add_argument("--no-serial", action="store_true", help="skip the serial reference on rank 0")
    p.add_argument("--calibrate", action="store_true", help="fit α, β, F here and predict step times")
    p.add_argument("--sweep", choices=("strong", "weak", "all"), default=None,
                   help="scaling sweeps over --sizes (with calibration and the projection)")
    p.add_argument("--sizes", default=",".join(map(str, SIZES)), help="process counts of the sweeps")
    p.add_argument("--out", default="benchmarks/results", help="directory for the JSON and PNG")
    p.add_argument("--name", default=None, help="file name stem (default bench_p<N> or sweeps)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=900, help="seconds per process count")


def check_args(args) -> None:
    """One-line refusals of what cannot run, before any process starts."""
    known = {REFERENCE_MODE, *parallel_modes(), "dtensor", *variants()}
    unknown = [m for m in args.modes or [] if label_options(m) is None]
    if unknown:
        raise LatticeConfigError(f"unknown mode(s) {unknown} in --modes; choose from {', '.join(sorted(known))} "
                                 f"(variants of one mode join with +, e.g. 3d+keep_gathered=True+vectors=replicated)")
    if args.sweep and args.arch != "gpt2":
        raise LatticeConfigError(f"the sweeps scale the papers' GPT-2 shapes; drop --arch {args.arch} or --sweep")
    for name, least in (("nproc", 1), ("batch", 1), ("steps", 1), ("warmup", 0)):
        if getattr(args, name) < least:
            raise LatticeConfigError(f"--{name} must be at least {least}, got {getattr(args, name)}")
    sizes = [s for s in str(args.sizes).split(",") if s.strip()]
    if args.sweep and not all(s.strip().isdigit() and int(s) in WEAK for s in sizes):
        raise LatticeConfigError(f"--sizes must be a comma list drawn from {sorted(WEAK)}, got {args.sizes!r}")
    check_out_dir(args.out, flag="--out")


def run_bench(args) -> int:
    args.modes = [m.strip() for m in args.modes.split(",")] if args.modes else None
    try:
        check_args(args)
    except LatticeConfigError as e:
        print(f"lattice bench: {e}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    command = "lattice bench " + " ".join(sys.argv[2:] if sys.argv[1:2] == ["bench"] else sys.argv[1:])
    report = {"provenance": provenance(command), "machine": machine_info(), "command": command}
    if args.sweep:
        return _run_sweeps(args, out, report)
    from lattice.cost import model_config

    try:
        cfg = model_config(args.arch, args.model, vocab_size=args.vocab_size, seq_len=args.seq_len,
                           n_layers=args.n_layers, d_model=args.d_model, n_heads=args.n_heads)
        result = bench_size(cfg, args.nproc, args.batch, args, serial=not args.no_serial)
    except (RuntimeError, LatticeConfigError) as e:
        print(f"lattice bench: {e}", file=sys.stderr)
        return 1
    print(f"p = {args.nproc}, {cfg}, batch {args.batch}, {args.steps} steps after {args.warmup} warm-up")
    print(format_table(result))
    stem = args.name or f"bench_p{args.nproc}"
    report["result"] = result
    (out / f"{stem}.json").write_text(json.dumps(report, indent=1, default=str))
    plot_single(result, out / f"{stem}.png")
    print(f"wrote {out / stem}.json and .png")
    return 0 if all("error" not in r for r in result["rows"]) else 1


def _run_sweeps(args, out: Path, report: dict) -> int:
    args.calibrate = True
    sizes = [int(s) for s in args.sizes.split(",")]
    families = ("strong", "weak") if args.sweep == "all" else (args.sweep,)
    for family in families:
        report[family] = []
        for p in sizes:
            cfg, batch = (GPTConfig(**STRONG), STRONG_BATCH) if family == "strong" else weak_config(p)
            t = time.perf_counter()
            result = bench_size(cfg, p, batch, args, serial=(p == 1))
            print(f"\n{family} scaling, p = {p}: h = {cfg.d_model}, {cfg.n_heads} heads, batch {batch} "
                  f"({time.perf_counter() - t:.0f} s)")
            print(format_table(result))
            report[family].append(result)
    errors = prediction_errors([r for f in families for r in report[f]])
    if errors:
        report["prediction_error_median_abs"] = statistics.median(abs(e) for e in errors)
        print(f"\ncalibrated model vs measured step time: median |error| = "
              f"{report['prediction_error_median_abs']:.1%} over {len(errors)} runs")
    report["projection"] = projection()
    report["crossovers"] = crossovers(report["projection"])
    print("\n" + format_projection(report["projection"]))
    print("\n".join(report["crossovers"]))
    stem = args.name or "sweeps"
    (out / f"{stem}.json").write_text(json.dumps(report, indent=1, default=str))
    plot_sweeps(report, out / f"{stem}.png")
    print(f"wrote {out / stem}.json and .png")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lattice.bench", description=__doc__.split("\n")[0])
    add_bench_arguments(parser)
    return run_bench(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
