"""The communication and synchronisation micro-benchmarks of the calibration
(`lattice.calibration.calibrate`): each collective at the sizes a step sends, the all-reduce over groups
smaller than the world, a cp ring's exchange, and the wait for the slowest rank after a stretch of
compute."""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lattice.cost.machine import wire_factor
from lattice.calibration.timing import fwd_bwd_once, timed_differences, timed_in_turn


def measure_send_latency(cfg, batch: int, beta: float, reps: int) -> float:
    """Machine.alpha_send from a cp pair's ring attention (lattice.parallel.context_parallel),
    forward and backward, every pair of the world at once, at a cp = 2 rank's share of the batch
    (dp = p/2: 2·batch/p sequences, every head, half of each sequence): its time beyond its blocks'
    attention (its own causal block and half of the other's: 1.5 causal blocks, timed alone) over
    its four sends (one forward; backward the keys and values on and their gradients twice), less
    each send's bytes at β. It holds what the ring does at each send beyond attention (each block
    merged into the output by its log-sum-exp, the Python of each step, the wait for the slower
    rank of the pair): at 2 ranks on 2 cores gpt2-deep's layer took 7.0 ms, its blocks 0.8 ms,
    where an exchange of 16 KB between two products had put a send at 0.7 ms."""
    from lattice.parallel.context_parallel import Ring, ring_attend

    p, rank = dist.get_world_size(), dist.get_rank()
    groups = [dist.new_group([r, r + 1]) for r in range(0, p, 2)]  # every rank creates every group
    ring = Ring.of([rank - rank % 2, rank - rank % 2 + 1], groups[rank // 2])
    heads, kv_heads = cfg.n_heads, getattr(cfg, "n_kv_heads", None) or cfg.n_heads
    B, T, hs = max(1, 2 * batch // p), 2 * max(1, cfg.seq_len // 4), cfg.head_size
    q, k, v = torch.randn(B, heads, T, hs), torch.randn(B, kv_heads, T, hs), torch.randn(B, kv_heads, T, hs)

    expand = heads // kv_heads
    ring_attention = fwd_bwd_once(lambda q, k, v: ring_attend(ring, q, k, v, causal=True), q, k, v)
    block = fwd_bwd_once(lambda q, k, v: F.scaled_dot_product_attention(
        q, k.repeat_interleave(expand, 1), v.repeat_interleave(expand, 1), is_causal=True), q, k, v)
    t_ring, t_block = timed_in_turn([ring_attention, block], reps, warm_rounds=1)
    for group in groups:
        dist.destroy_process_group(group)
    return max(t_ring - 1.5 * t_block, 0.0) / 4 - 2 * k.numel() * k.element_size() * beta


def collective_calls(numel: int, p: int) -> list:
    """(op, call) of each collective the layouts run, on a CommMeter buffer of `numel` elements
    (the gathered output of an all-gather, the whole input of a reduce-scatter)."""
    from lattice.parallel.comm import unmetered_all_gather, unmetered_reduce_scatter

    whole, piece = torch.randn(numel), torch.randn(numel // p)
    return [("all_reduce", lambda: dist.all_reduce(whole)), ("broadcast", lambda: dist.broadcast(whole, 0)),
            ("reduce", lambda: dist.reduce(whole, 0)), ("all_gather", lambda: unmetered_all_gather(whole, piece)),
            ("reduce_scatter", lambda: unmetered_reduce_scatter(piece, whole)),
            ("all_to_all", lambda: dist.all_to_all_single(piece.new_empty(numel), whole))]


#: the CommMeter buffers (elements) the collectives are timed at, up to a gradient bucket's size
COLLECTIVE_SIZES = (16, 4096, 65536, 1 << 18, 1 << 20, 1 << 22)


#: the collectives a calibration loop runs, one after each of its products
LOOP_CALLS = 8


def gain_per_call(loop, coll, reps: int) -> float:
    """Seconds one call of `coll` adds to `loop` (LOOP_CALLS products, `coll` after each, or none):
    the median over rounds of the difference within each (timed_differences), per call, at
    least 1 µs."""
    [(_, extra)] = timed_differences([(lambda: loop(coll), lambda: loop(None))], reps)
    return max(extra, 1e-6) / LOOP_CALLS


def measure_group_curves(loop, reps: int) -> tuple:
    """Machine.group_curves: the all-reduce over groups of each size that divides the world, from 2
    up to half of it (groups of consecutive ranks, every group at once), at the collectives' sizes:
    the time `loop` (8 products with a collective after each) gains from it, per call, against the
    wire bytes of a rank (2 (n - 1)/n of the buffer)."""
    p, rank = dist.get_world_size(), dist.get_rank()
    curves = []
    for n in (n for n in range(2, p // 2 + 1) if p % n == 0):
        groups = [dist.new_group(list(range(first, first + n))) for first in range(0, p, n)]
        mine, points = groups[rank // n], []
        for numel in COLLECTIVE_SIZES:
            buffer = torch.randn(numel)
            gain = gain_per_call(loop, lambda: dist.all_reduce(buffer, group=mine), reps)
            points.append((wire_factor("all_reduce", n) * numel * 4, gain))
        for group in groups:
            dist.destroy_process_group(group)
        curves.append(("all_reduce", n, tuple(points)))
    return tuple(curves)


#: the gradient buffers (elements per rank) the gradient sum is timed at: 1, 4 and 16 MiB
GRAD_SUM_SIZES = (1 << 18, 1 << 20, 1 << 22)


def measure_grad_sum_ratios(stretch, looped: dict[int, float], reps: int) -> tuple:
    """Machine.grad_sum_ratios: the gradients' sum over the world as a step runs it, over the same
    all-reduce timed back to back (`looped`: {elements: seconds per call}, the collectives' loop),
    at each of GRAD_SUM_SIZES, against the wire bytes of a rank. Each call runs as the Trainer's
    averages do (lattice.parallel.sharding.all_reduce_grads): after a stretch of compute (`stretch`,
    as backward ends) and a barrier (the wait for the slowest rank is the skew's), the gradients
    copied into one fresh buffer, summed, divided by the replicas. At 2 ranks on 2 cores that took
    8.5 ms for gpt2-deep's 4.4 MB where the loop's all-reduce of it took 3.8-4.3, and 24.5 ms for
    gpt2-wide's 17.4 MB where it took 15."""
    p = dist.get_world_size()
    ratios = []
    for numel in GRAD_SUM_SIZES:
        pieces = [torch.randn(numel // 64) for _ in range(64)]
        samples = []
        # a call at a time is noisier than the loop's: at 4 MB, 6 calls gave ratios of 0.85 to 1.67
        # between calibrations, 10 gave 1.3 to 1.6
        for _ in range(2 * reps + 1):  # the first untimed
            stretch()
            dist.barrier()
            start = time.perf_counter()
            flat = torch.cat(pieces)
            dist.all_reduce(flat)
            flat.div_(p)
            samples.append(time.perf_counter() - start)
        seconds = torch.tensor(statistics.median(samples[1:]), dtype=torch.float64)
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)  # the slowest rank's
        ratios.append((wire_factor("all_reduce", p) * numel * 4, float(seconds) / max(looped[numel], 1e-9)))
    return tuple(ratios)


def fit_collective_curves(samples: dict, latency: dict) -> tuple:
    """Machine.collective_curves from the collectives' samples ({op: [(steps, wire bytes, seconds)]})
    and each op's fitted α: at each size, the seconds beyond steps x α (never below 0)."""
    return tuple((op, tuple(sorted((wire, max(seconds - steps * latency[op], 0.0)) for steps, wire, seconds in rows)))
                 for op, rows in samples.items())


def fit_alpha_beta(rows: list[tuple[float, float, float]]) -> tuple[float, float]:
    """(α, β) of t = steps·α + bytes·β by least squares on relative error, so that the latency of
    small messages is fitted as closely as the bandwidth of large ones (an unweighted fit gives
    the largest all of the say)."""
    import numpy as np

    a = np.array([r[:2] for r in rows], dtype=float)
    y = np.array([r[2] for r in rows], dtype=float)
    (alpha, beta), *_ = np.linalg.lstsq(a / y[:, None], np.ones_like(y), rcond=None)
    return max(float(alpha), 1e-7), max(float(beta), 1e-12)


def measure_skew(cfg, batch: int, samples: int = 12) -> float:
    """Machine.skew: the median over samples of (the slowest rank's time) / (the mean rank's) - 1
    for one forward and backward of a serial one-block GPT-2 of `cfg`'s width, heads, sequence
    and vocabulary on this rank's share of the batch (batch / p sequences, no communication),
    every rank starting it together after a barrier, as the ranks of a step start each stretch of
    compute after a synchronisation."""
    from lattice.models import build_model
    from lattice.models.gpt2 import GPTConfig
    from lattice.modes.layout import Layout

    p = dist.get_world_size()
    block = GPTConfig(vocab_size=cfg.vocab_size, seq_len=cfg.seq_len, d_model=cfg.d_model, n_heads=cfg.n_heads,
                      n_layers=1)
    model = build_model(block, Layout("serial").context())
    g = torch.Generator().manual_seed(dist.get_rank())
    tokens = torch.randint(0, cfg.vocab_size, (max(1, batch // p), cfg.seq_len + 1), generator=g)
    x, y = tokens[:, :-1], tokens[:, 1:]
    model.forward_backward(x, y)
    ratios = []
    for _ in range(samples):
        dist.barrier()
        t = time.perf_counter()
        model.forward_backward(x, y)
        mine = time.perf_counter() - t
        slowest, total = torch.tensor(mine, dtype=torch.float64), torch.tensor(mine, dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        dist.all_reduce(total)
        ratios.append(float(slowest) / (float(total) / p))
    return max(statistics.median(ratios) - 1, 0.0)


def measure_skew_curve(work, stretches=(0.002, 0.008, 0.032, 0.128), samples: int = 12) -> tuple:
    """Machine.skew_curve: stretches of `work` (a zero-argument callable) repeated to about each of
    `stretches` seconds of the mean rank's time, every rank starting together after a barrier as
    after a synchronisation: the median over samples of the mean rank's time and, for each group
    size g dividing the world (ranks g·i to g·i + g - 1), of the mean over groups of their slowest
    rank's time beyond the mean rank's: ((g, stretch, wait), ...), the same on every rank."""
    p = dist.get_world_size()
    groups = [g for g in range(2, p + 1) if p % g == 0]

    def sample(repeat: int) -> torch.Tensor:  # every rank's seconds for `repeat` calls, started together
        dist.barrier()
        t = time.perf_counter()
        for _ in range(repeat):
            work()
        mine = torch.tensor([time.perf_counter() - t], dtype=torch.float64)
        every = [torch.empty_like(mine) for _ in range(p)]
        dist.all_gather(every, mine)
        return torch.cat(every)

    rows, repeat = [], 1
    for stretch in stretches:
        # a short stretch runs before the other ranks are scheduled, a long one shares the cores:
        # the repeats that give the stretch are found by trying, twice
        for _ in range(2):
            mean = float(sample(repeat).mean())
            repeat = max(1, round(repeat * stretch / max(mean, 1e-9)))
        means, waits = [], {g: [] for g in groups}
        for _ in range(samples):
            times = sample(repeat)
            means.append(float(times.mean()))
            for g in groups:
                waits[g].append(float(times.reshape(p // g, g).amax(1).mean()) - means[-1])
        rows += [(g, statistics.median(means), max(statistics.median(waits[g]), 0.0)) for g in groups]
    return tuple(rows)
