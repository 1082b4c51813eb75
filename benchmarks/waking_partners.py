"""What a synchronisation costs where few ranks are busy and the others wait, on this machine: the
pattern of sub-graph's common="subgrid" (lattice.modes.subgraph), where sub-grid 0 runs the common
layers while the other sub-grids wait for its scatter, then every rank runs its heads' attention,
then sub-grid 0 waits for the gather.

    python benchmarks/waking_partners.py -o benchmarks/results/waking_partners.txt

In a world of p ranks on `cores` cores, the first `cores` ranks (one per core) compute a stretch
of n matrix products while the others wait; then each sums an activation of (rows, width / 2)
with its partners (one group per busy rank: ranks r, r + cores, ...), every rank computes k
products, and they sum again. The step is timed beside its parts alone: the busy stretch, the
stretch every rank computes, and the sum. What the step takes beyond its parts, per sum, is the
partners' wake, which the cost model prices from the wake curve a world of one rank per core
measures (Machine.wake_curve: a sum of such an activation after a stretch of compute against one
after the shortest); that world's figures are printed beside them, from the same products.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

from lattice.bench.world import spawn

ROWS, WIDTH = 512, 96  # gpt2-deep's rows of a batch of 8 (T = 64) and its width
STRETCHES = ((2, 1), (4, 1), (8, 2), (16, 4), (16, 1), (32, 2))  # (busy products, products on every rank)


def _median_seconds(fns: list, reps: int, calls: list[int]) -> list[float]:
    """Seconds per call of each of `fns`, every rank running it, the slowest rank's median over
    `reps` rounds, the fns in turn (starting one later each round), each sample `calls` calls.
    Not lattice.calibration.timing.timed_in_turn: it sizes a sample by each rank's first call, and a rank
    that idles through a fn (the waiting ranks here) asks for 50,000 calls of it."""
    samples = [[] for _ in fns]
    for r in range(reps):
        for i in [(r + j) % len(fns) for j in range(len(fns))]:
            dist.barrier()
            t = time.perf_counter()
            for _ in range(calls[i]):
                fns[i]()
            dist.barrier()
            samples[i].append((time.perf_counter() - t) / calls[i])
    out = torch.tensor([statistics.median(s) for s in samples], dtype=torch.float64)
    dist.all_reduce(out, op=dist.ReduceOp.MAX)
    return out.tolist()


def _world(cores: int, reps: int) -> list[float]:
    p, rank = dist.get_world_size(), dist.get_rank()
    a, b, one = torch.randn(ROWS, WIDTH), torch.randn(WIDTH, 3 * WIDTH), torch.zeros(ROWS * WIDTH // 2)
    groups = [dist.new_group(list(range(i, p, cores))) for i in range(cores)]
    group, busy = groups[rank % cores], rank < cores

    def products(n):
        for _ in range(n):
            a @ b

    def step(n, k):
        if busy:
            products(n)
        dist.all_reduce(one, group=group)
        products(k)
        dist.all_reduce(one, group=group)

    def busy_alone(n):
        if busy:
            products(n)

    fns, calls = [], []
    for n, k in STRETCHES:
        fns += [lambda n=n, k=k: step(n, k), lambda n=n: busy_alone(n), lambda k=k: products(k)]
        calls += [20, 20, 20]
    fns.append(lambda: dist.all_reduce(one, group=group))
    calls.append(100)
    return _median_seconds(fns, reps, calls)


def _wake_world(reps: int) -> list[float]:
    """In a world of one rank per core: (each stretch alone, with a sum after it) by turns, and the
    sum alone; every rank computes (Machine.wake_curve's loop)."""
    a, b, one = torch.randn(ROWS, WIDTH), torch.randn(WIDTH, 3 * WIDTH), torch.zeros(ROWS * WIDTH // 2)

    def stretch(n, summed):
        for _ in range(n):
            a @ b
        if summed:
            dist.all_reduce(one)

    counts = sorted({n for n, _ in STRETCHES})
    fns = [f for n in counts for f in (lambda n=n: stretch(n, True), lambda n=n: stretch(n, False))]
    fns.append(lambda: dist.all_reduce(one))
    return _median_seconds(fns, reps, [20] * (len(fns) - 1) + [100])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("-o", "--output", help="also write the table here")
    args = parser.parse_args()
    cores = len(os.sched_getaffinity(0))
    lines = [f"{cores} cores; products of ({ROWS}, {WIDTH}) by ({WIDTH}, {3 * WIDTH}); medians of {args.reps} rounds"]
    wake = spawn(cores, _wake_world, args.reps)[0]
    counts = sorted({n for n, _ in STRETCHES})
    first = wake[0] - wake[1]
    lines.append(f"world of {cores} (a core per rank), a sum after a stretch against one after the shortest:")
    for i, n in enumerate(counts):
        lines.append(f"  {n:3d} products, stretch {wake[2 * i + 1] * 1e3:6.2f} ms: "
                     f"{(wake[2 * i] - wake[2 * i + 1] - first) * 1e3:+.2f} ms")
    for p in args.worlds:
        if p <= cores:
            continue
        seconds = spawn(p, _world, cores, args.reps)[0]
        alone = seconds[-1]
        lines.append(f"world of {p} ({cores} busy, the others waiting; a group's sum alone {alone * 1e3:.2f} ms):")
        for j, (n, k) in enumerate(STRETCHES):
            step, busy, every = seconds[3 * j:3 * j + 3]
            beyond = (step - busy - every - 2 * alone) / 2
            lines.append(f"  {n:3d} busy products ({busy * 1e3:6.2f} ms), {k} on every rank ({every * 1e3:5.2f} ms): "
                         f"step {step * 1e3:6.2f} ms, beyond its parts {beyond * 1e3:+.2f} ms per sum")
    text = "\n".join(lines)
    print(text)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
