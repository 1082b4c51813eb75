"""Timing of micro-benchmarks in every rank of a world at once, for the calibration
(`lattice.cost.calibrate`, `lattice.cost.calibrate_comm`)."""

from __future__ import annotations

import math
import statistics
import time

import torch
import torch.distributed as dist

#: the shortest sample of a micro-benchmark, in seconds of one rank's time
SAMPLE_S = 0.05


def _fwd_bwd(fn, *inputs):
    """One forward and backward of fn on fresh leaves of `inputs` (the work counts 1 + 2)."""
    inputs = [x.detach().requires_grad_() for x in inputs]
    return lambda: torch.autograd.backward(fn(*inputs).sum(), inputs=inputs)


def timed_in_turn(fns: list, n: int, warm_rounds: int = 0) -> list[float]:
    """Seconds per call of each of `fns` (zero-argument callables), every rank of the world running
    them together: the median over n rounds, each round one sample of every fn in turn (starting
    one later each round, as the validation interleaves its layouts), so that a drift of the
    machine's speed falls on all of them alike, after `warm_rounds` rounds untimed. A sample
    repeats its fn for at least SAMPLE_S, every rank the same number of times: a shorter one fits
    inside the scheduler's time slice, and where ranks outnumber the cores it would time one rank
    running alone rather than the ranks sharing them as in a step."""
    first = []
    for fn in fns:
        t = time.perf_counter()
        fn()
        first.append(math.ceil(SAMPLE_S / max(time.perf_counter() - t, 1e-6)))
    repeats = torch.tensor(first)
    dist.all_reduce(repeats, op=dist.ReduceOp.MAX)
    samples = [[] for _ in fns]
    for r in range(warm_rounds + n):
        for k in [(r + i) % len(fns) for i in range(len(fns))]:
            repeat = int(repeats[k])
            dist.barrier()
            t = time.perf_counter()
            for _ in range(repeat):
                fns[k]()
            if r >= warm_rounds:
                samples[k].append((time.perf_counter() - t) / repeat)
    return [statistics.median(s) for s in samples]
