"""SUPER's own experiment (docs/references.md#super §V): D&SP and D&SP-cSub beside pure data parallelism on the
same ranks and global batch, measured here; both placements' message counts; and the cost
model's projection to the paper's scale beside the speedups it reports.

    python benchmarks/subgraph.py --arch t5 --nproc 4 --batch 16 --steps 8    # T5, as §V-E
    python benchmarks/subgraph.py --nproc 4 --model small --batch 16 --steps 6  # GPT-2

1. Measured: --nproc gloo processes (CPU). Every layout trains the same global batch: pure data
   parallelism is the serial model on dp = nproc replicas (B/nproc sequences each, gradients
   averaged by one bucketed all-reduce); sub-graph runs tp = nproc ranks in one replica (D&SP:
   common layers on all ranks, B/p rows each; D&SP-cSub: on sub-grid 0). Each row is the median
   step time (forward, backward, gradient sums) of the slowest rank, the layouts' timed steps
   interleaved round-robin so that load changes on a shared machine fall on all alike, its
   speedup over data parallelism, and the bytes CommMeter counts per step on rank 0.
2. Placements (SUPER Eq. 3-7): the intra- and inter-node messages of one segmented collective of
   each D&SP layout of the paper's 8 GPUs on 2 nodes, natural beside topology-aware, counted on
   the layout, and per step (times the segmented collectives of a step, from the cost model).
3. Projection: the cost model's step time of T5-Large-Mod (§V-E: T5-Large with 32 heads; a head
   size of 32 assumed, keeping n_heads x head_size = d_model; sources and targets of --paper-seq
   tokens, the paper states none for WMT14) on Lassen (4 V100 per node, NVLink inside a node,
   InfiniBand EDR between nodes; fp32), per-GPU mini-batch 1 and 4, data parallelism beside
   topology-aware 2-, 4- and 8-way D&SP, without overlap and with the gradient all-reduce hidden
   behind the backward (the paper: "gradient all-reduces can be almost fully overlapped"), beside
   the speedups the paper reports.
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
    ("D&SP-cSub g=4", "subgraph", {"subgrids": 4, "common": "subgrid"}),
    ("D&SP slice/concat all-to-all", "subgraph", {"subgrids": 2, "projections": "common"}),
    ("D&SP slice/concat all-gather", "subgraph", {"subgrids": 2, "projections": "common",
                                                  "slice_collective": "all_gather"}),
    ("cSub slice/concat scatter/gather", "subgraph", {"subgrids": 2, "common": "subgrid", "projections": "common"}),
    ("cSub slice/concat broadcast", "subgraph", {"subgrids": 2, "common": "subgrid", "projections": "common",
                                                 "slice_collective": "all_gather"}),
]

# §V-E, Fig. 15: D&SP's speedup over data parallelism with topology-aware placement, by (GPUs,
# per-GPU mini-batch, sub-grids); for 8 GPUs at mini-batch 4 the paper gives no figure ("about the
# same performance as 4-way D&SP")
PAPER_SPEEDUPS = {(4, 1, 4): 2.22, (4, 4, 4): 2.17, (8, 1, 8): 3.05}

# Lassen (§V): a node of 4 V100 (15.7 TFLOP/s fp32 peak, 900 GB/s HBM2), NVLink 2.0 between the
# GPUs of a node (2 links of 25 GB/s), InfiniBand EDR (100 Gb/s) between nodes; NCCL's pipelined
# rings; the rates are the peaks (no efficiency factor: the model has none for small batches)
LASSEN = dict(name="Lassen: 4 V100 per node (NVLink 2.0), InfiniBand EDR", flop_rate=15.7e12, alpha_intra=10e-6,
              beta_intra=1 / 50e9, alpha_inter=20e-6, beta_inter=1 / 12.5e9, ranks_per_node=4, elem_rate=112e9,
              attn_rate=112e9, update_per_tensor=10e-6, mem_bandwidth=900e9, pipelined_broadcast=True)
T5_LARGE_MOD = dict(d_model=1024, n_heads=32, head_size=32, n_layers=24, d_ff=4096, vocab_size=32128)


def model_config(args):
    from lattice.models import get_arch

    family = get_arch(args.arch)
    shape = {k: v for k, v in (("seq_len", args.seq_len), ("target_len", args.target_len)) if v}
    return family.config_class.preset(args.model or family.config_class.default_preset, vocab_size=2048, **shape)


def _worker(args) -> list:
    import lattice
    from lattice.parallel.comm import raw_all_reduce

    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = model_config(args)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (args.batch, cfg.seq_len), generator=gen)
    # next tokens of a decoder, or an encoder-decoder's labels of its own length
    targets = torch.randint(0, cfg.vocab_size, (args.batch, getattr(cfg, "target_len", cfg.seq_len)), generator=gen)
    runs = []
    for label, mode, options in LAYOUTS:
        if mode == "serial":
            ctx = lattice.init("serial", dp=world)
            rows = slice(rank * args.batch // world, (rank + 1) * args.batch // world)
        else:
            if world % options["subgrids"] or cfg.n_heads % options["subgrids"]:
                continue
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


def measured(args) -> None:
    results = dict(enumerate(spawn(args.nproc, _worker, args)))
    cfg = model_config(args)
    lengths = f"{cfg.seq_len} -> {cfg.target_len} tokens" if hasattr(cfg, "target_len") else f"{cfg.seq_len} tokens"
    print(f"1. measured: {args.arch} {args.model or 'default preset'} ({cfg.n_heads} heads, {lengths}), "
          f"{args.nproc} gloo processes on {os.cpu_count()} cores, global batch {args.batch}; median step time of the "
          f"slowest rank over {args.steps} interleaved steps")
    print(f"  {'layout':<36}{'step ms':>10}{'vs DP':>8}{'MiB/step (rank 0)':>20}")
    base = None
    for i, (label, nbytes, _) in enumerate(results[0]):
        slowest = max(results[r][i][2] for r in results)
        base = base or slowest
        print(f"  {label:<36}{slowest * 1e3:>10.1f}{base / slowest:>7.2f}x{nbytes / 2 ** 20:>20.2f}")


def _t5_large_mod(seq: int):
    from lattice.models.t5 import T5Config

    return T5Config(**T5_LARGE_MOD, seq_len=seq, target_len=seq)


def placements() -> None:
    """SUPER Eq. 4-7 counted on the layouts of 8 GPUs on 2 nodes of 4."""
    import lattice
    from lattice.cost import count_messages, estimate, super_messages
    from lattice.parallel.context import MeshAxis

    cfg = _t5_large_mod(128)
    print("\n2. placements: messages of one segmented collective (intra / inter-node, over all ranks; SUPER Eq. 3-7 "
          "counted on the layout) and per step of T5-Large-Mod at per-GPU mini-batch 1, 8 GPUs on 2 nodes of 4")
    print(f"  {'layout':<14}{'natural':>16}{'topology-aware':>18}{'Eq. 4-7 (topo)':>16}{'per step: natural':>22}"
          f"{'topology-aware':>18}")
    for g in (2, 4, 8):
        counts, per_step = {}, {}
        for placement in ("natural", "topology"):
            layout = lattice.Layout("subgraph", tp=8, options={"subgrids": g}, ranks_per_node=4, placement=placement)
            counts[placement] = count_messages(layout.topology, (MeshAxis.SUBGRID,))
            calls = estimate(cfg, layout, batch=8).calls(site="layer.branch")
            per_step[placement] = tuple(round(calls * n) for n in counts[placement])  # each call is one such collective
        eq = super_messages(8, g, 4, topology_aware=True)
        print(f"  D&SP g={g:<6}{'%d / %d' % counts['natural']:>16}{'%d / %d' % counts['topology']:>18}"
              f"{'%d / %d' % eq:>16}{'%d / %d' % per_step['natural']:>22}{'%d / %d' % per_step['topology']:>18}")


def projection(seq: int) -> None:
    import lattice
    from lattice.cost import Machine, estimate

    machine = Machine(**LASSEN)
    cfg = _t5_large_mod(seq)
    print(f"\n3. projection: T5-Large-Mod (d 1024, 32 heads of 32, 24 + 24 layers, d_ff 4096; {seq} -> {seq} "
          f"tokens), fp32, on {machine.name}; step time of one rank, topology-aware D&SP; speedup over data parallelism")
    print(f"  {'GPUs':>4}{'mini-batch':>11}{'layout':>10}{'step ms':>10}{'comm ms':>9}{'speedup':>9}"
          f"{'overlapped':>12}{'paper':>8}")
    for p in (4, 8):
        for b in (1, 4):
            rows = [("DP", estimate(cfg, "serial", batch=b, dp=p, ranks_per_node=4))]
            for g in (2, 4, 8):
                if g <= p:
                    layout = lattice.Layout("subgraph", tp=p, options={"subgrids": g}, ranks_per_node=4,
                                            placement="topology")
                    rows.append((f"D&SP {g}", estimate(cfg, layout, batch=p * b)))
            times = {}
            for label, c in rows:
                t = c.time(machine)
                grads = c.comm_time(machine, "backward", site="grads")
                hidden = t["step"] - min(grads, t["backward_compute"])  # the gradient all-reduce behind the backward
                times[label] = (t["step"], t["forward_comm"] + t["backward_comm"], hidden)
            for label, (step, comm, hidden) in times.items():
                paper = PAPER_SPEEDUPS.get((p, b, int(label.split()[-1]))) if label != "DP" else None
                print(f"  {p:>4}{b:>11}{label:>10}{step * 1e3:>10.1f}{comm * 1e3:>9.1f}"
                      f"{times['DP'][0] / step:>8.2f}x{times['DP'][2] / hidden:>11.2f}x"
                      f"{f'{paper:.2f}x' if paper else '':>8}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="gpt2", help="model family (gpt2, t5, ...)")
    ap.add_argument("--model", default=None, help="size preset (default: the family's)")
    ap.add_argument("--seq-len", type=int, default=None, help="sequence (T5: source) length (default: the preset's)")
    ap.add_argument("--target-len", type=int, default=None, help="T5's target length (default: the preset's)")
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--batch", type=int, default=16, help="global batch (sequences)")
    ap.add_argument("--steps", type=int, default=6, help="timed steps per layout")
    ap.add_argument("--paper-seq", type=int, default=128, help="source and target length of the projection")
    ap.add_argument("--skip-measured", action="store_true", help="only the placements and the projection")
    args = ap.parse_args(argv)
    if not args.skip_measured:
        measured(args)
    if args.arch == "t5":
        placements()
        projection(args.paper_seq)
    return 0


if __name__ == "__main__":
    sys.exit(main())
