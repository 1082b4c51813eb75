"""The distributed optimizer's two overlaps, each on and off, measured: step time (medians of
alternating rounds of Trainer steps) and the bytes a rank holds at most while its gradients
are reduced (from backward to the last reduction's start) and after the update.

    python benchmarks/zero_overlap.py                       # gpt2 small: dp = 2, dp = 4, pp = 2 x dp = 2
    python benchmarks/zero_overlap.py --model tiny --rounds 4

--overlap-param-gather: each bucket's all-gather of updated weights runs beside the next
forward, awaited before the first module reading it (its buffers are alive until then).
--overlap-grad-reduce: each bucket's reduce-scatter starts in backward once its gradients are
complete (under a pipeline in the last micro-batch's backward; ZeRO-2 then drops the full
gradients bucket by bucket), rather than after backward. With --zero 3, --overlap-param-gather is
the next block's all-gather started as a block starts (forward and backward). Each row turns one
off with the other at its default (on); ZeRO-1, 2 and 3, fp32, serial tensor layout, 1 thread per
rank. Memory:
distinct storages of the weights, gradients (full and reduced), optimizer state and the
buffers of the reductions and gathers in flight.
"""

from __future__ import annotations

import argparse
import statistics
import time

from lattice.bench.world import spawn

MIB = 2 ** 20
LEVERS = ("overlap_param_gather", "overlap_grad_reduce")


def _held(model, opt) -> int:
    """zero_memory's count, with the buffers of the reductions and gathers in flight."""
    from zero_memory import _held_bytes

    buffers = [t for bucket in opt.buckets for t in (bucket.flat, bucket.reduced) if t is not None]
    buffers += [bucket.gathering[0] for bucket in opt.buckets if bucket.gathering is not None]  # (ZeRO-3's prefetch)
    if opt.overlap is not None:
        buffers += [finish.args[1] for finish in opt.overlap.pending.values()]  # (bucket, gathered, work)
    return sum(_held_bytes(model, opt, buffers).values())


def _world(layout: dict, model: str, zero: int, rounds: int, steps: int) -> dict:
    import torch
    import torch.distributed as dist

    import lattice
    from lattice.parallel.zero import ZeroOptimizer
    from lattice.training.config import TrainConfig
    from lattice.training.trainer import Trainer

    ctx = lattice.init(**layout)
    settings = [{}] + [{lever: False} for lever in LEVERS]
    held: dict[int, dict[str, int]] = {}
    current = [None]
    launch, step = ZeroOptimizer._launch, ZeroOptimizer.step

    def launched(self, bucket):  # the most held from backward to the reductions' start
        launch(self, bucket)
        held[current[0]]["backward"] = max(held[current[0]].get("backward", 0), _held(self.model, self))

    def after_update(self):
        step(self)
        held[current[0]]["update"] = max(held[current[0]].get("update", 0), _held(self.model, self))

    ZeroOptimizer._launch, ZeroOptimizer.step = launched, after_update
    trainers = []
    for k, setting in enumerate(settings):
        cfg = TrainConfig(arch="gpt2", model=model, vocab_size=2048, batch_size=8, steps=10 ** 6, warmup=1,
                          eval_interval=10 ** 6, checkpoint_interval=0, zero=zero, progress=False, **setting)
        held[k], current[0] = {}, k
        trainer = Trainer(cfg, ctx)
        for _ in range(2):
            trainer.train_step()
        trainers.append(trainer)
    times = [[] for _ in trainers]
    for r in range(rounds):
        order = list(range(len(trainers)))
        for k in order[r % len(order):] + order[:r % len(order)]:
            current[0] = k
            dist.barrier()
            t = time.perf_counter()
            for _ in range(steps):
                trainers[k].train_step()
            mean = torch.tensor((time.perf_counter() - t) / steps, dtype=torch.float64)
            dist.all_reduce(mean, op=dist.ReduceOp.MAX)
            times[k].append(float(mean))
    return {"settings": settings, "times": times, "held": held}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="small", help="gpt2 preset (default small)")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--steps", type=int, default=4, help="steps per round")
    args = p.parse_args(argv)
    layouts = [{"mode": "serial", "dp": 2}, {"mode": "serial", "dp": 4},
               {"mode": "serial", "dp": 2, "pp": 2, "microbatches": 4}]
    print(f"gpt2 {args.model}, batch 8, fp32, gloo, 1 thread per rank; step ms (median of {args.rounds} alternating "
          f"rounds of {args.steps}); MiB held by the fullest rank at most while the gradients are reduced / after the update:")
    print("| layout | zero | setting | step ms | / both on | MiB reducing | MiB after update |")
    print("|---|---|---|---|---|---|---|")
    for layout in layouts:
        world = layout["dp"] * layout.get("pp", 1)
        for zero in (1, 2, 3):
            rows = spawn(world, _world, layout, args.model, zero, args.rounds, args.steps, timeout=3600)
            base = statistics.median(rows[0]["times"][0])
            name = " ".join(f"{k}={v}" for k, v in layout.items() if k != "mode")
            for k, setting in enumerate(rows[0]["settings"]):
                step = statistics.median(rows[0]["times"][k])
                label = ", ".join(f"{lever.replace('_', '-')} off" for lever in setting) or "both on (default)"
                backward = max(r["held"][k].get("backward", 0) for r in rows) / MIB
                update = max(r["held"][k].get("update", 0) for r in rows) / MIB
                print(f"| {name} | {zero} | {label} | {step * 1e3:.1f} | {step / base:.3f} | {backward:.1f} | "
                      f"{update:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
