"""The pipeline bubble and the activations each stage keeps, measured on lattice's own pipeline.

    python benchmarks/pipeline_bubble.py            # pp = 4, m in 4, 8, 16; about 3 minutes

Part 1, the bubble. Four processes run `GPT.forward_backward` at pp = 4 (serial stages, 8
blocks) under GPipe, 1F1B and interleaved 1F1B (v = 2). Each block also spends emulated device
time (sleeping 20 ms in forward and 40 ms in backward, far more than its real work on this tiny
model), so that the four stages overlap as on four devices even though this machine has two
cores. With micro-batches of a fixed size, the ideal step is m x (one micro-batch through one
rank's blocks); the measured bubble is (step - ideal) / ideal, beside docs/references.md#megatron-lm's
(p - 1)/m and, interleaved, (p - 1)/(v m).

Part 2, activations. At m = 8, the peak bytes of tensors autograd holds for backward on each
stage (weights excluded), counted by saved-tensor hooks during one step, for GPipe (every
micro-batch's forward before any backward) and 1F1B (at most p - stage in flight).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from lattice.bench.provenance import provenance
from lattice.bench.world import spawn

FWD_S, BWD_S = 0.020, 0.040


def _worker(args) -> dict:
    import torch
    import torch.nn as nn

    import lattice
    from lattice import GPTConfig

    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()

    class _SleepInBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, g):
            time.sleep(BWD_S)
            return g

    class Delayed(nn.Module):
        """A block that also takes emulated device time."""

        def __init__(self, block):
            super().__init__()
            self.block = block

        def forward(self, x):
            time.sleep(FWD_S)
            return _SleepInBackward.apply(self.block(x))

    cfg = GPTConfig(vocab_size=256, seq_len=32, d_model=64, n_heads=4, n_layers=8)
    rows = []
    for schedule, m in [(s, m) for s in ("gpipe", "1f1b", "interleaved") for m in (4, 8, 16)]:
        ctx = lattice.init("serial", pp=world, microbatches=m, pp_schedule=schedule)
        model = lattice.build_model(cfg, ctx)
        for i, block in enumerate(model.blocks):
            model.blocks[i] = Delayed(block)
        x = torch.randint(0, 256, (2 * m, 32))  # micro-batches of 2 sequences
        times = []
        for step in range(args.steps + 1):
            torch.distributed.barrier()
            t0 = time.perf_counter()
            model.forward_backward(x, x)
            torch.distributed.barrier()
            times.append(time.perf_counter() - t0)
            model.zero_grad(set_to_none=True)
        step_s = sorted(times[1:])[len(times[1:]) // 2]
        ideal = m * (cfg.n_layers // world) * (FWD_S + BWD_S)
        rows.append({"schedule": schedule, "m": m, "v": ctx.pipeline.v, "step_s": step_s, "ideal_s": ideal,
                     "bubble": (step_s - ideal) / ideal, "formula": ctx.pipeline.bubble()})
    saved = {}
    for schedule in ("gpipe", "1f1b"):
        ctx = lattice.init("serial", pp=world, microbatches=8, pp_schedule=schedule)
        model = lattice.build_model(cfg, ctx)
        x = torch.randint(0, 256, (16, 32))
        live, peak = [0], [0]
        weights = {id(p) for p in model.parameters()}

        class Held:
            def __init__(self, t):
                self.t, self.n = t, (0 if id(t) in weights else t.numel() * t.element_size())
                live[0] += self.n
                peak[0] = max(peak[0], live[0])

            def __del__(self):
                live[0] -= self.n

        with torch.autograd.graph.saved_tensors_hooks(Held, lambda h: h.t):
            model.forward_backward(x, x)
        saved[schedule] = peak[0]
    return {"rank": rank, "stage": ctx.stage, "rows": rows, "saved": saved}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pp", type=int, default=4)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    out = spawn(args.pp, _worker, args)
    print(f"pp = {args.pp}, serial stages of 2 blocks (20 ms forward + 40 ms backward of emulated device time each), "
          f"micro-batches of 2 sequences; median of {args.steps} steps, rank 0's clock")
    print(f"  {'schedule':<12}{'m':>4}{'v':>3}{'step ms':>10}{'ideal ms':>10}{'bubble':>9}{'(p-1)/(v m)':>13}")
    for r in out[0]["rows"]:
        print(f"  {r['schedule']:<12}{r['m']:>4}{r['v']:>3}{r['step_s'] * 1e3:>10.1f}{r['ideal_s'] * 1e3:>10.1f}"
              f"{r['bubble']:>9.3f}{r['formula']:>13.3f}")
    print("activations autograd keeps for backward at the peak of one step, m = 8 (KiB per stage):")
    print("  " + f"{'stage':<7}" + "".join(f"{s:>10}" for s in ("gpipe", "1f1b")) + f"{'1f1b/gpipe':>12}")
    for r in out:
        g, f = r["saved"]["gpipe"], r["saved"]["1f1b"]
        print(f"  {r['stage']:<7}{g / 1024:>10.1f}{f / 1024:>10.1f}{f / g:>12.3f}   (1F1B bound: "
              f"{min(8, args.pp - r['stage'])}/8 = {min(8, args.pp - r['stage']) / 8:.3f})")
    if args.json:
        Path(args.json).write_text(json.dumps({"provenance": provenance(), "rows": out}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
