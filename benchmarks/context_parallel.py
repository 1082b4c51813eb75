"""Context parallelism (lattice.parallel.context_parallel): activation memory per rank and step
time against the sequence length for cp = 1, 2, 4 under one tensor layout, and the causal load
balance of the chunk split.

    python benchmarks/context_parallel.py                         # Llama shape, serial layout, 1024..4096 tokens
    python benchmarks/context_parallel.py --mode 1d --tp 2 --seq 4096
    python benchmarks/context_parallel.py --seq 4096 --cp 1 2 --cp-attention ring all_gather ulysses

For each sequence length and cp it starts tp·cp gloo processes (one thread each), builds the
model in float32, and measures on every rank the bytes autograd saves for backward in one forward
(lattice.bench.measure.saved_activation_bytes, the largest rank shown), the step time (forward
and backward, median of `--steps` after one warm-up, the slowest rank), and the attention work:
the query-key scores each rank's ring attention computes and, of those, the pairs the causal
mask lets through. `× cp / cp=1` is the activation bytes times cp over cp = 1's (1.000 is a
perfect 1/cp split); `work max/min` the most over the least loaded rank. The cost model's
activation figure for the same layout is beside the measurement.
"""

from __future__ import annotations

import argparse
import statistics
import time

from lattice.bench.world import spawn

MIB = 2 ** 20


def _worker(mode: str, tp: int, cp: int, seq: int, batch: int, steps: int, shape: dict, kind: str) -> dict:
    import torch

    import lattice
    from lattice.bench.measure import saved_activation_bytes
    from lattice.models import get_arch
    from lattice.parallel.context import MeshAxis
    from lattice.parallel.context_parallel import RingMasks

    ctx = lattice.init(mode, tp=tp, cp=cp, cp_attention=kind)
    cfg = get_arch("llama").config_class(**{**shape, "seq_len": seq})
    model = lattice.build_model(cfg, ctx)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=g)
    x, y = tokens[:, :-1], tokens[:, 1:]
    saved = saved_activation_bytes(model, lambda: model(x, y))
    model.zero_grad(set_to_none=True)
    times = []
    for _ in range(steps + 1):
        start = time.perf_counter()
        model.forward_backward(x, y)
        times.append(time.perf_counter() - start)
        model.zero_grad(set_to_none=True)
    computed = seen = seq * seq // 2 if cp == 1 else 0  # cp = 1: the fused kernel, half the scores under the mask
    # (ulysses: the fused kernel on whole sequences of 1/cp of the heads, not counted here)
    if cp > 1 and kind != "ulysses":  # the scores this rank's ring attention computes, and the pairs the mask lets through
        class Place:  # RingMasks reads the ring's size and this rank's index alone
            size, index = cp, ctx.coord(MeshAxis.CP)
        masks = RingMasks(Place, seq // cp, seq // cp, causal=True, window=None, keep=None, device="cpu")
        for owner in range(cp):
            rows, cols = masks.region(owner)
            allowed = masks.allowed(owner, rows, cols)
            computed += allowed.numel()
            seen += int(allowed.sum())
    return {"saved": saved, "time": statistics.median(times[1:]), "computed": computed, "seen": seen}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", default="serial")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--seq", type=int, nargs="+", default=[1024, 2048, 4096])
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--cp-attention", nargs="+", default=["ring"], choices=["ring", "all_gather", "ulysses"],
                   help="how attention reads the other ranks' keys (Layout.cp_attention); several: one row each")
    args = p.parse_args(argv)

    import torch

    import lattice.cost
    from lattice.models import get_arch

    shape = dict(vocab_size=2048, d_model=128, n_heads=8, n_kv_heads=4, n_layers=2, intermediate_size=344)
    print(f"Llama shape {shape}, batch {args.batch}, mode {args.mode} tp={args.tp}, float32; per rank:")
    print("| seq | cp | cp_attention | ranks | activations MiB (largest rank) | × cp / cp=1 | cost model MiB | "
          "step ms (slowest) | scores computed per rank (max/min) | causal pairs per rank (max/min) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for seq in args.seq:
        base = None
        for cp in args.cp:
            for kind in args.cp_attention if cp > 1 else ["ring"]:
                rows = spawn(args.tp * cp, _worker, args.mode, args.tp, cp, seq, args.batch, args.steps, shape, kind)
                saved = max(r["saved"] for r in rows)
                base = base or saved
                cfg = get_arch("llama").config_class(**{**shape, "seq_len": seq})
                modelled = lattice.cost.estimate(cfg, args.mode, batch=args.batch, seq=seq, tp=args.tp, cp=cp,
                                                 cp_attention=kind, dtype=torch.float32).memory["activations"]
                work = "— | —"
                if rows[0]["computed"]:
                    computed, seen = [r["computed"] for r in rows], [r["seen"] for r in rows]
                    work = (f"{max(computed)} ({max(computed) / min(computed):.3f}) | "
                            f"{max(seen)} ({max(seen) / min(seen):.3f})")
                print(f"| {seq} | {cp} | {kind if cp > 1 else '—'} | {args.tp * cp} | {saved / MIB:.2f} | "
                      f"{saved * cp / base:.3f} | {modelled / MIB:.2f} | {max(r['time'] for r in rows) * 1e3:.0f} | "
                      f"{work} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
