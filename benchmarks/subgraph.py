"""SUPER's own comparison: D&SP and D&SP-cSub beside pure data parallelism on the same ranks and
global batch, and the slice/concat boundary as all-to-all beside all-gather-and-discard.

    python benchmarks/subgraph.py --nproc 4 --model small --batch 16 --steps 6

Starts --nproc gloo processes (CPU). Every layout trains the same global batch: pure data
parallelism is the serial model on dp = nproc replicas (B/nproc sequences each, gradients
averaged by one bucketed all-reduce); sub-graph runs tp = nproc ranks in one replica. Each row
is the median step time (forward, backward, gradient sums) of the slowest rank, with the layouts'
timed steps interleaved round-robin so that load changes on a shared machine fall on all alike,
and the bytes CommMeter counts per step on rank 0.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

from lattice.bench.world import spawn

LAYOUTS = [
    ("data parallel (serial x dp)", "serial", {}),
    ("D&SP g=2", "subgraph", {"subgrids": 2}),
    ("D&SP g=4", "subgraph", {"subgrids": 4}),
    ("D&SP-cSub g=2", "subgraph", {"subgrids": 2, "common": "subgrid"}),
    ("D&SP slice/concat all-to-all", "subgraph", {"subgrids": 2, "projections": "common"}),
    ("D&SP slice/concat all-gather", "subgraph", {"subgrids": 2, "projections": "common",
                                                  "slice_collective": "all_gather"}),
    ("cSub slice/concat scatter/gather", "subgraph", {"subgrids": 2, "common": "subgrid", "projections": "common"}),
    ("cSub slice/concat broadcast", "subgraph", {"subgrids": 2, "common": "subgrid", "projections": "common",
                                                 "slice_collective": "all_gather"}),
]


def _worker(args) -> list:
    import lattice
    from lattice.comm import raw_all_reduce
    from lattice import GPTConfig

    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = GPTConfig.preset(args.model, vocab_size=2048)
    gen = torch.Generator().manual_seed(0)
    tokens, targets = (torch.randint(0, cfg.vocab_size, (args.batch, cfg.seq_len), generator=gen) for _ in range(2))
    runs = []
    for label, mode, options in LAYOUTS:
        if mode == "serial":
            ctx = lattice.init("serial", dp=world)
            rows = slice(rank * args.batch // world, (rank + 1) * args.batch // world)
        else:
            ctx = lattice.init(mode, tp=world, **options)
            rows = slice(0, args.batch)
        model = lattice.build_model(cfg, ctx)
        dp_group = ctx.group(lattice.MeshAxis.DP)

        def step(model=model, rows=rows, dp_group=dp_group):
            model.zero_grad(set_to_none=True)
            model.forward_backward(tokens[rows], targets[rows])
            if dp_group is not None:  # pure data parallelism: one bucket, as DDP averages
                flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
                raw_all_reduce(flat, dp_group, phase="backward")

        step()  # warm up
        with lattice.CommMeter() as meter:
            step()
        runs.append((label, step, meter.total_bytes(), []))
    for i in range(args.steps):
        for label, step, _, times in runs[i % len(runs):] + runs[:i % len(runs)]:  # rotating order
            dist.barrier()
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
    return [(label, nbytes, statistics.median(times)) for label, _, nbytes, times in runs]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--model", default="small")
    ap.add_argument("--batch", type=int, default=16, help="global batch (sequences)")
    ap.add_argument("--steps", type=int, default=6, help="timed steps per layout")
    args = ap.parse_args(argv)
    results = dict(enumerate(spawn(args.nproc, _worker, args)))
    print(f"{args.nproc} gloo processes on {os.cpu_count()} cores, model {args.model}, global batch {args.batch}; "
          f"median step time of the slowest rank over {args.steps} interleaved steps")
    print(f"  {'layout':<36}{'step ms':>10}{'MiB/step (rank 0)':>20}")
    for i, (label, nbytes, _) in enumerate(results[0]):
        slowest = max(results[r][i][2] for r in results)
        print(f"  {label:<36}{slowest * 1e3:>10.1f}{nbytes / 2 ** 20:>20.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
