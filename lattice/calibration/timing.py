"""Timing of micro-benchmarks in every rank of a world at once, for the calibration
(`lattice.calibration.calibrate`, `lattice.calibration.comm`)."""

from __future__ import annotations

import math
import statistics
import time

import torch
import torch.distributed as dist

#: the shortest sample of a micro-benchmark, in seconds of one rank's time
SAMPLE_S = 0.05


def fwd_bwd_once(fn, *inputs):
    """One forward and backward of fn on fresh leaves of `inputs` (the work counts 1 + 2), the
    backward from a gradient of the output's own shape, as in a step: from `.sum()` it would be a
    stride-0 expansion, on which the backward's kernels ran a product 10-20% slower here."""
    inputs = [x.detach().requires_grad_() for x in inputs]
    grad = []

    def step():
        out = fn(*inputs)
        if not grad:
            grad.append(torch.randn_like(out))
        torch.autograd.backward(out, grad_tensors=grad[0], inputs=inputs)
    return step


def linear_products(m: int, k: int, n: int):
    """A linear's three products as a step runs them, X (m, k) by W (k, n): Y = X W forward, and
    dX = dY Wᵀ and dW = Xᵀ dY backward, as plain kernels. Through autograd each product would
    add the engine's time per operation, which the cost model prices once, per operation
    (Machine.op_overhead): here about 50 µs per product forward and backward, which a fit of
    t = (rows + kernel_rows) · work / F took as 55-75 more rows at h = 96 where the kernels alone
    fit 7-19."""
    x, w, dy = torch.randn(m, k), torch.randn(k, n), torch.randn(m, n)

    def step():
        torch.mm(x, w)
        torch.mm(dy, w.t())
        torch.mm(x.t(), dy)
    return step


def timed_in_turn(fns: list, n: int, warm_rounds: int = 0, group=None) -> list[float]:
    """Seconds per call of each of `fns` (zero-argument callables), every rank of the world (or of
    `group`) running them together: the median over n rounds of `timed_rounds`."""
    return [statistics.median(s) for s in timed_rounds(fns, n, warm_rounds, group=group)]


def timed_differences(pairs: list[tuple], n: int, warm_rounds: int = 0) -> list[tuple[float, float]]:
    """Of each (fn, baseline) pair, (the baseline's seconds per call, the seconds per call fn takes
    beyond it): the medians over n rounds of `timed_rounds` (every fn of every pair in turn) of the
    baseline and of the difference within each round. Two medians taken apart let each side's
    noise through: the wake of an all-reduce after one product (with the product, less the product
    alone) was timed 1.75 to 2.71 ms in five calibrations of gpt2-small at 2 ranks, and a
    pipeline's time per micro-batch 0.45 to 3.06 ms."""
    rounds = timed_rounds([fn for pair in pairs for fn in pair], n, warm_rounds)
    return [(statistics.median(without), statistics.median(a - b for a, b in zip(with_it, without)))
            for with_it, without in zip(rounds[::2], rounds[1::2])]


def timed_rounds(fns: list, n: int, warm_rounds: int = 0, group=None) -> list[list[float]]:
    """Seconds per call of each of `fns` (zero-argument callables) in each of n rounds, every rank
    of the world (or of `group`, the others elsewhere) running them together, each round one sample
    of every fn in turn (starting one later each round, as the validation interleaves its layouts),
    so that a drift of the machine's speed falls on all of them alike, after `warm_rounds` rounds
    untimed. A sample repeats its fn for at least SAMPLE_S, every rank the same number of times: a
    shorter one fits inside the scheduler's time slice, and where ranks outnumber the cores it
    would time one rank running alone rather than the ranks sharing them as in a step."""
    first = []
    for fn in fns:
        t = time.perf_counter()
        fn()
        first.append(math.ceil(SAMPLE_S / max(time.perf_counter() - t, 1e-6)))
    repeats = torch.tensor(first)
    dist.all_reduce(repeats, op=dist.ReduceOp.MAX, group=group)
    samples = [[] for _ in fns]
    for r in range(warm_rounds + n):
        for k in [(r + i) % len(fns) for i in range(len(fns))]:
            repeat = int(repeats[k])
            dist.barrier(group=group)
            t = time.perf_counter()
            for _ in range(repeat):
                fns[k]()
            if r >= warm_rounds:
                samples[k].append((time.perf_counter() - t) / repeat)
    return samples
