"""Calibration of the cost model's machine (`lattice.cost.Machine`) on the machine at hand, by
micro-benchmarks run in every rank of a gloo world at once; `lattice bench --calibrate` and the
sweeps predict step times with it."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import os
import statistics

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from lattice.calibration.comm import (COLLECTIVE_SIZES, GRAD_SUM_SIZES, LOOP_CALLS, fit_collective_curves,
                                         collective_calls, fit_alpha_beta, gain_per_call, measure_grad_sum_ratios, measure_group_curves,
                                         measure_send_latency, measure_skew, measure_skew_curve)
from lattice.cost.machine import Machine, message_steps, wire_factor
from lattice.calibration.timing import fwd_bwd_once, linear_products, timed_differences, timed_in_turn
from lattice.parallel.sharding import weighted_square_sum
from lattice.parallel.zero import adamw

#: the inputs an elementwise operator is timed on, cycled: more than a core's cache (2 MiB of L2
#: here), as the activations of a step are
COLD_POOL_BYTES = 16 * 2 ** 20


def calibrate(cfg, batch: int, reps: int = 5) -> Machine:
    """Fit the machine of `lattice.cost.Machine` here, every rank of the world running the
    micro-benchmarks at once (so sharing the cores is part of the fit; of the elementwise operators
    on their own, see measure_elementwise_rates): matrix products, causal attention and elementwise
    operators (a mix of LayerNorm, GELU, bias add and cross-entropy, and each operator the cost
    model counts on its own), each forward and backward at this world's per-rank sizes; the
    framework's time per operation on a tiny model of `cfg`'s family; α and β of each collective;
    AdamW's update and the gradient norm and clipping before it."""
    p = dist.get_world_size()
    cores = len(os.sched_getaffinity(0))  # the cores this node's ranks share
    h, M, T, V = cfg.d_model, batch * cfg.seq_len, cfg.seq_len, cfg.vocab_size

    def timed(fn, n=reps):
        return timed_in_turn([fn], n)[0]

    # matrix products of the per-rank shapes a p-way split of one layer gives, on row counts from one
    # sequence's (a pipeline's smallest micro-batch) to the batch's: t = 6·(rows + kernel_rows)·Σ k·n / F
    def products(rows):
        shapes = [(rows, h, max(1, 3 * h // p)), (rows, max(1, h // p), h), (rows, h, max(1, 4 * h // p)),
                  (rows, max(1, 4 * h // p), h)]
        steps = [linear_products(m, k, n) for m, k, n in shapes]
        return (lambda: [f() for f in steps]), 6 * sum(k * n for _, k, n in shapes)

    # the products on one sequence's rows up to the batch's: (rows, seconds) of the slowest rank,
    # the row counts timed in turn after a round untimed: the first work of a process runs slower
    # (timed one after the other, the shortest first, through autograd, the row term fitted 26-84
    # rows at 2 ranks where in turn and warm it gave 6-31; as plain kernels, 7-19)
    row_counts = sorted({T, min(2 * T, M), max(T, M // 2), M})
    runs = [products(rows) for rows in row_counts]
    weights = runs[0][1]

    def products_timed() -> list[float]:
        slowest = torch.tensor(timed_in_turn([run for run, _ in runs], reps, warm_rounds=1), dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
        return slowest.tolist()

    # timed three times, at the start, the middle and the end of the calibration: the first, as the
    # world starts, fitted 70-75 rows for gpt2-deep at 2 ranks where the later two gave 43-56
    # (through autograd)
    bursts = [products_timed()]
    # causal attention of this rank's share of the heads: score elements per second (forward)
    heads = max(1, batch * cfg.n_heads // p)
    q, k, v = (torch.randn(1, heads, T, cfg.head_size) for _ in range(3))
    attn = fwd_bwd_once(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), q, k, v)
    attn_rate = 3 * heads * T * T / timed(attn)
    # and with an additive bias that requires a gradient (T5's position bias): SDPA's math kernel,
    # which materialises the scores (1.4 times the fused kernel's time here at 128 tokens)
    scores_bias = torch.randn(1, heads, T, T)
    biased = fwd_bwd_once(lambda q, k, v, b: F.scaled_dot_product_attention(q, k, v, attn_mask=b), q, k, v, scores_bias)
    biased_rate = 3 * heads * T * T / timed(biased)
    # elementwise operators on a rank's share of the activations and of the logits
    x, bias, logits = torch.randn(M, max(1, h // p)), torch.randn(max(1, h // p)), torch.randn(M, max(1, V // p))
    targets = torch.randint(0, logits.shape[1], (M,))
    ew = fwd_bwd_once(lambda x, b, z: F.layer_norm(x, x.shape[-1:]).sum() + F.gelu(x, approximate="tanh").sum()
                 + (x + b).sum() + F.cross_entropy(z, targets), x, bias, logits)
    elem_rate = 3 * (3 * x.numel() + 2 * logits.numel()) / timed(ew)
    # and each of them on its own, as the cost model counts it (Machine.elementwise_rates)
    operator_rates = measure_elementwise_rates(x, logits, cfg.head_size, T, fwd_bwd_once, reps, cores=cores)
    # the framework's time per operation the family describes: a serial model of it of one and of two
    # blocks at sizes whose work is negligible, the second block's time over its operations (forward,
    # and backward's two per operation)
    op_overhead = measure_op_overhead(
        cfg, lambda fn, baseline: timed_differences([(fn, baseline)], 20, warm_rounds=1)[0][1])
    # collectives over the world, each between two chunks of compute as in a model step (on a
    # shared CPU the ranks must all be scheduled to meet): t = steps(op, p)·α + wire(op, p)·bytes·β
    # by least squares on the time a loop gains from its collectives (gain_per_call); α and β of
    # all-reduce and broadcast together, and each collective's own (Machine.collectives)
    collectives = ()
    if p > 1:
        chunk_a, chunk_b = torch.randn(M, h), torch.randn(h, max(1, 3 * h // p))  # about the compute between
        # two collectives of a step

        def loop(coll):
            for _ in range(LOOP_CALLS):
                chunk_a @ chunk_b
                if coll is not None:
                    coll()

        samples, looped = {}, {}  # op -> [(steps, wire bytes, seconds)]; all-reduce elements -> seconds
        for size in sorted(set(COLLECTIVE_SIZES) | set(GRAD_SUM_SIZES)):
            numel = p * -(-size // p)
            for op, fn in collective_calls(numel, p):
                seconds = gain_per_call(loop, fn, reps)
                samples.setdefault(op, []).append((message_steps(op, p), wire_factor(op, p) * numel * 4, seconds))
                if op == "all_reduce":  # by the size asked: rounded to p's multiple where p does not divide it
                    looped[size] = seconds
        alpha, beta = fit_alpha_beta(samples["all_reduce"] + samples["broadcast"])
        collectives = tuple((op, *fit_alpha_beta(rows)) for op, rows in samples.items())
        # and each one's time beyond its latency steps at each size measured (Machine.collective_curves):
        # the time per byte grows with the message, which one β fitted on relative error misses
        collective_curves = fit_collective_curves(samples, {op: a for op, a, _ in collectives})
        # and the all-reduce over groups smaller than the world, every group at once (Machine.group_curves)
        group_curves = measure_group_curves(loop, reps)
        # and the gradients' sum as a step runs it, against that loop (Machine.grad_sum_ratios)
        grad_sum_ratios = measure_grad_sum_ratios(lambda: [chunk_a @ chunk_b for _ in range(16)], looped, reps)
        # the latency of one point-to-point exchange of a cp ring's step beyond its bytes: from ring
        # attention itself where the ranks pair up (measure_send_latency), else from an exchange
        # between two of the loop's products
        if p % 2 == 0:
            alpha_send = measure_send_latency(cfg, batch, beta, reps)
        else:
            rank, small = dist.get_rank(), torch.randn(4096)
            incoming = torch.empty_like(small)

            def exchange():
                ops = [dist.P2POp(dist.isend, small, (rank + 1) % p),
                       dist.P2POp(dist.irecv, incoming, (rank - 1) % p)]
                for request in dist.batch_isend_irecv(ops):
                    request.wait()

            alpha_send = gain_per_call(loop, exchange, reps) - small.numel() * 4 * beta
        alpha_send = max(alpha_send, alpha)
        # how much of a collective compute beside it hides (a 1d backward's input-gradient all-reduce
        # beside the weight gradient's product): of an activation's all-reduce, the time a loop
        # saves by starting it before the product and awaiting it after, over the most it could
        # save (the shorter of the two); on a CPU whose ranks have no spare core the collective's
        # copies and sums take the core from the product; the message is (M, h/2) elements
        activation = torch.randn(M * max(1, h // 2))

        def after():
            for _ in range(LOOP_CALLS):
                chunk_a @ chunk_b
                dist.all_reduce(activation)

        def beside():
            for _ in range(LOOP_CALLS):
                work = dist.all_reduce(activation, async_op=True)
                chunk_a @ chunk_b
                work.wait()

        if p < cores:
            alone, in_turn, started = timed_in_turn([lambda: loop(None), after, beside], reps)
            overlap = min(max((in_turn - started) / max(min(in_turn - alone, alone), 1e-9), 0.0), 1.0)
        else:  # no core to spare: in a step nothing hides (gpt2-deep's 1d tp=2 at 2 ranks on 2 cores took
            # 86.1 ms with the input gradients' all-reduce beside the products and 79.7 ms after them,
            # where this loop gained 50-100% of the shorter at times: its one product is not a step)
            overlap = 0.0
        # an activation's all-reduce after 1, 4, 16 and 64 of the loop's products: its time against
        # the stretch of compute before it (Machine.wake_curve), where every rank has a core of its
        # own; where they share the cores no core idles and the wait is the skew's (skew_curve)
        # (each point the difference within a round, the points in turn, over three times the rounds:
        # its first point sets the baseline of the others, and a step of gpt2-small's tp=2 makes 16 of them)
        def stretches(products, coll):
            for _ in range(LOOP_CALLS):
                for _ in range(products):
                    chunk_a @ chunk_b
                if coll:
                    dist.all_reduce(activation)

        counts = (1, 4, 16, 64) if p <= cores else ()
        pairs = [(functools.partial(stretches, n, True), functools.partial(stretches, n, False)) for n in counts]
        wake_curve = tuple((without / LOOP_CALLS, max(extra, 0.0) / LOOP_CALLS)
                           for without, extra in (timed_differences(pairs, 3 * reps) if pairs else ()))
    else:
        alpha, beta, alpha_send, overlap, wake_curve, collective_curves, group_curves = 1e-5, 1e-10, 0.0, 1.0, (), (), ()
        grad_sum_ratios = ()
    bursts.append(products_timed())
    skew = measure_skew(cfg, batch) if p > 1 else 0.0
    # the wait per synchronisation, after stretches of the collectives' loop's product
    skew_curve = measure_skew_curve(lambda: chunk_a @ chunk_b) if p > 1 else ()
    # AdamW's update: a per-tensor cost (many small tensors) and a bandwidth (one large one)
    def adam(tensors):
        params = [nn.Parameter(t) for t in tensors]
        for q in params:
            q.grad = torch.randn_like(q)
        return adamw(params, [], lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1).step  # the Trainer's own

    per_tensor = timed(adam([torch.randn(8) for _ in range(32)])) / 32
    # the gradient norm and clipping the Trainer runs before it, per tensor (lattice.training.optim)
    with_grads = [nn.Parameter(torch.randn(8)) for _ in range(32)]
    for q in with_grads:
        q.grad = torch.randn_like(q)

    def norm_and_clip():
        norm = weighted_square_sum([(q.grad, 1) for q in with_grads], torch.float32, None).reshape(()).sqrt()
        nn.utils.clip_grads_with_norm_(with_grads, 1.0, norm, foreach=True)

    norm_per_tensor = timed(norm_and_clip) / 32
    big = max(1, 12 * h * h * cfg.n_layers // p)
    mem_bw = 7 * big * 4 / max(timed(adam([torch.randn(big)])) - per_tensor, 1e-9)
    bursts.append(products_timed())
    kernel_rows, flop_rate = fit_product_rates(row_counts, bursts, weights)  # the same on every rank
    # the slowest rank sets the pace
    operator_rates = [*operator_rates, ("biased_attention", biased_rate)]  # (Machine.biased_attention_rate)
    rates = torch.tensor([flop_rate, elem_rate, attn_rate, mem_bw, *(r for _, r in operator_rates)], dtype=torch.float64)
    dist.all_reduce(rates, op=dist.ReduceOp.MIN)
    elementwise_rates = tuple((op, float(r)) for (op, _), r in zip(operator_rates, rates[4:].tolist()))
    costs = torch.tensor([alpha, beta, per_tensor, op_overhead, alpha_send, norm_per_tensor], dtype=torch.float64)
    dist.all_reduce(costs, op=dist.ReduceOp.MAX)
    alpha, beta, per_tensor, op_overhead, alpha_send, norm_per_tensor = costs.tolist()
    machine = Machine(f"this machine, {p} processes", flop_rate=float(rates[0]), alpha_intra=alpha,
                      beta_intra=beta, alpha_inter=alpha, beta_inter=beta, ranks_per_node=p,
                      elem_rate=float(rates[1]), attn_rate=float(rates[2]), update_per_tensor=per_tensor,
                      mem_bandwidth=float(rates[3]), op_overhead=op_overhead, alpha_send=alpha_send,
                      skew=skew, norm_per_tensor=norm_per_tensor, collectives=collectives,
                      kernel_rows=kernel_rows, overlap=overlap, skew_curve=skew_curve,
                      elementwise_rates=elementwise_rates, wake_curve=wake_curve,
                      collective_curves=collective_curves, group_curves=group_curves,
                      grad_sum_ratios=grad_sum_ratios)
    # a pipeline schedule's own time per chunk beyond its price at these rates (Machine.pipeline_actions)
    return dataclasses.replace(machine, pipeline_actions=measure_pipeline_actions(cfg, machine, reps)) if p > 1 else machine


def measure_elementwise_rates(x: torch.Tensor, logits: torch.Tensor, head_size: int, T: int, fwd_bwd, reps: int,
                       cores: int | None = None):
    """((operator, elements/s), ...) of every operator of lattice.cost.builder.ELEMENTWISE_OPERATORS,
    forward and backward (the work counts 1 + 2), counted as the builder counts it: on x (a rank's
    share of the activations; rotary on x's elements as heads of `head_size` over T positions), the
    cross-entropy on `logits` and T5's position bias on x's heads over T positions, timed in turn
    on every rank at once, each call on the next of a pool of inputs larger than a core's cache
    (COLD_POOL_BYTES), as a step's operators read what
    the operators before them wrote among its other activations: on one input, hot in the cache,
    GELU's forward and backward took half the time (252 against 495 µs on 512 x 96 here) and
    gpt2-deep's operators in a model ran at about half the rates so timed. The rate is the slope
    between half those rows and all of them (a step's tensors are no larger): the time per call
    that does not grow with the elements is the framework's (Machine.op_overhead, which times it
    apart), and at a tensor-parallel rank's share it made up half of a LayerNorm's (1.9 ns per
    element on 512 x 48, 1.1 ns in the model's 512 x 96).

    Where the world's ranks outnumber its `cores`, the first `cores` ranks time the operators while
    the others wait, on the shares of a world of one rank per core (x and logits p / cores times as
    wide), and each rate is shared, times cores / p (the others return inf, for the caller's
    minimum over the ranks). Timed with every rank at once, the slope was the scheduler's: the
    4-rank rates came out 0.01-0.76 of the 2-rank ones and the 8-rank rates of LayerNorm, GELU and
    the add 0.01-0.13, where sharing the cores gives 0.5 and 0.25; and a pipeline's calibrated time per chunk (measure_pipeline_actions), the rest of its
    growth beyond these prices, then came out too short. Timed by the cores' ranks at the world's
    own shares, the slope between half and all of gpt2-deep's 512 x 12 elements was noise: its
    8-rank rates were 0.03 (the add) to 0.73 (LayerNorm) of the 2-rank ones shared, 91 of the
    173 ms its serial layouts were priced to compute, and its three fastest (1F1B pipelines) were
    priced 43-53% over their steps; at the 2-rank rates shared, -6% to +1%."""
    from lattice.cost.builder import ELEMENTWISE_OPERATORS
    from lattice.models.components import ACTIVATIONS, relative_buckets, rotate
    from lattice.modes.kernels.layers import normalize_split_hidden

    cos, sin = torch.randn(T, head_size), torch.randn(T, head_size)
    p = dist.get_world_size() if dist.is_initialized() else 1
    outnumbered = bool(cores) and p > cores
    if outnumbered:  # the shares of a world of a rank per core, p / cores times as wide
        x, logits = (torch.randn(t.shape[0], t.shape[1] * p // cores) for t in (x, logits))
    bias_heads = max(1, x.shape[1] // head_size)  # the heads of x's share of the hidden features

    def pool(*shape) -> list[torch.Tensor]:
        return [torch.randn(*shape) for _ in range(max(2, math.ceil(COLD_POOL_BYTES / (4 * math.prod(shape)))))]

    def cycled(fn, tensors) -> callable:
        steps = itertools.cycle([fwd_bwd(fn, t) for t in tensors])
        return lambda: next(steps)()

    def runs(halves: int):
        a = pool(max(1, halves * x.shape[0] // 2), x.shape[1])
        heads = pool(max(1, halves * x.numel() // (2 * T * head_size)), T, head_size)  # (B·nh, T, hs)
        z = pool(max(1, halves * logits.shape[0] // 2), logits.shape[1])
        targets = torch.randint(0, z[0].shape[1], (z[0].shape[0],))
        w = torch.randn(a[0].shape[1])
        kernels = {"layer_norm": (lambda a: F.layer_norm(a, a.shape[-1:]), a),
                   "rms_norm": (lambda a: normalize_split_hidden(a, None, a.shape[-1], 1e-5, "rms") * w, a),
                   "add": (lambda a: a + w, a),
                   "rotary": (lambda q: rotate(q, cos, sin), heads),
                   "loss": (lambda z: F.cross_entropy(z, targets), z)}
        for name, act in ACTIVATIONS.items():
            kernels[name] = (act, a)
            kernels[f"{name}_gated"] = (lambda a, act=act: act(a) * a, a)
        counted = {op: tensors[0].numel() for op, (_, tensors) in kernels.items()}
        # T5's position bias: this rank's heads of a (buckets, heads) table looked up for T/2 or T
        # queries against T keys; its elements are the output's (its backward sums them by bucket)
        queries = max(1, halves * T // 2)
        buckets = relative_buckets(queries, T, 0, bidirectional=True, buckets=32, max_distance=128)
        tables = [torch.randn(32, bias_heads) for _ in range(2)]  # (its output's gradients fill the cache)
        kernels["position_bias"] = (lambda table: F.embedding(buckets, table).permute(2, 0, 1), tables)
        counted["position_bias"] = queries * T * bias_heads
        return {op: (cycled(fn, tensors), counted[op]) for op, (fn, tensors) in kernels.items()}

    half, whole = runs(1), runs(2)
    fns = [run for run, _ in half.values()] + [run for run, _ in whole.values()]
    share = 1.0
    if outnumbered:
        quiet = dist.new_group(list(range(cores)))
        seconds = timed_in_turn(fns, reps, group=quiet) if dist.get_rank() < cores else None
        dist.barrier()  # the waiting ranks start nothing of their own while the others time
        dist.destroy_process_group(quiet)
        if seconds is None:
            return [(op, math.inf) for op in half]
        share = cores / p
    else:
        seconds = timed_in_turn(fns, reps)
    k = len(half)
    # (where noise makes the whole no slower than the half, the whole call's time bounds it)
    return [(op, share * 3 * ELEMENTWISE_OPERATORS[op] * (whole[op][1] - n) / (t2 - t1 if t2 > t1 else t2))
            for (op, (_, n)), t1, t2 in zip(half.items(), seconds[:k], seconds[k:])]


def fit_product_rates(row_counts: list[int], bursts: list[list[float]], weights: float) -> tuple[float, float]:
    """(Machine.kernel_rows, flop_rate) from the products timed in several bursts, each the seconds
    of each row count (the largest the batch's, weights: 6·Σ k·n): the median of the bursts' row
    terms, and the median over the bursts of the rate that row term gives the batch's products,
    so that one burst timed while the machine was slow or uneven moves neither."""
    kernel_rows = statistics.median(fit_kernel_rows(list(zip(row_counts, seconds))) for seconds in bursts)
    flop_rate = statistics.median(weights * (row_counts[-1] + kernel_rows) / seconds[-1] for seconds in bursts)
    return kernel_rows, flop_rate


def fit_kernel_rows(samples: list[tuple[int, float]]) -> float:
    """Machine.kernel_rows from the same products timed on several row counts, (rows, seconds):
    the median over pairs of counts of the r with t₂ / t₁ = (rows₂ + r) / (rows₁ + r), so that one
    noisy timing moves it little (a single pair, or a least-squares line through all, lets a short
    timing 15% off move r from 20 to 35). A pair whose smaller product runs no slower per row counts
    0 (a larger product that falls out of cache can run slower per row); one whose larger product
    runs no slower in all is noise and left out."""
    solves = []
    for (rows, seconds), (more, more_seconds) in itertools.combinations(sorted(samples), 2):
        ratio = more_seconds / seconds
        if more > rows and ratio > 1:
            solves.append(max(0.0, (more - ratio * rows) / (ratio - 1)))
    return statistics.median(solves) if solves else 0.0


def measure_pipeline_actions(cfg, machine: Machine, reps: int) -> tuple:
    """Machine.pipeline_actions: of each schedule, the seconds per chunk of one micro-batch beyond
    what the cost model prices for it (its operations at `machine`'s rates and its hop), from a
    pipeline of `cfg`'s own width and sequence (a vocabulary of 16), 2 blocks per rank cut into p
    stages, micro-batches of one sequence: the slope of the slowest rank's step over p and 3p
    micro-batches (`timed_differences`), every rank at once, less the slope of its price
    (lattice.planner.pricing.price, no actions), per chunk. On the family's tiny preset the ranks
    idled between their chunks' few operations, which a step's stages do not: at 4 ranks on 2
    cores gpt2-wide's pipeline grew 27.4 ms per micro-batch where its price grew 17.8, and the
    tiny model's grew 5.6."""
    from lattice.planner.pricing import Choice, price
    from lattice.models import build_model
    from lattice.models.registry import arch_of_config
    from lattice.modes.layout import Layout, init
    from lattice.parallel.pipeline_config import SCHEDULES

    if getattr(cfg, "num_labels", 0):  # a classifier trains without a pipeline
        return ()
    p = dist.get_world_size()
    # 2 blocks per rank: an encoder-decoder's p in each stack (n_decoder_layers 0: as many as the encoder)
    stacks = 2 if hasattr(cfg, "n_decoder_layers") else 1
    piped = dataclasses.replace(cfg, vocab_size=16, n_layers=2 * p // stacks,
                                **({"n_decoder_layers": 0} if stacks == 2 else {}))
    counts = (p, 3 * p)
    generator = torch.Generator().manual_seed(0)

    def layout(schedule: str, m: int) -> Layout:
        return Layout("serial", pp=p, microbatches=m, pp_schedule=schedule)

    contexts = []

    def step(schedule: str, m: int):
        ctx = init(layout(schedule, m))
        tokens = torch.randint(0, 16, (m, cfg.seq_len), generator=generator)
        targets = arch_of_config(piped).random_targets(piped, tokens, generator)
        model = build_model(piped, ctx)
        contexts.append(ctx)
        return lambda: model.forward_backward(tokens, targets)

    # the growth from p to 3p micro-batches within each round, over three times the rounds
    pairs = [(step(schedule, counts[1]), step(schedule, counts[0])) for schedule in SCHEDULES]
    growth = torch.tensor([extra for _, extra in timed_differences(pairs, 3 * reps)], dtype=torch.float64)
    dist.all_reduce(growth, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
    for ctx in contexts:
        ctx.destroy_groups()
    unpriced = dataclasses.replace(machine, pipeline_actions=())
    actions = []
    for k, schedule in enumerate(SCHEDULES):
        v = layout(schedule, p).pipeline.v
        priced = [price(piped, Choice(layout(schedule, m)), batch=m, machine=unpriced).step_s for m in counts]
        slope = float(growth[k] - (priced[1] - priced[0])) / (counts[1] - counts[0])
        actions.append((schedule, max(slope / v, 0.0)))  # per chunk of a micro-batch
    return tuple(actions)


def measure_op_overhead(cfg, time_beyond) -> float:
    """Seconds per operation of `Model.cost_layout` (forward; backward counts two), from a serial
    model of `cfg`'s family (its options kept) of one and of two blocks at the family's tiny
    preset's sizes and 4 tokens: `time_beyond(fn, baseline)`, the seconds a forward and backward of
    two blocks takes beyond one's, over the operations the second block adds. Per family, since
    its operations differ in how many framework calls each makes: a Llama block (RMSNorm in three
    products of elements, rotary embeddings on q and k, SwiGLU) took 2.5 times a GPT-2 block's time
    per operation here (31 against 12 us). The two are timed in turn within each round and the
    difference taken there: two medians taken apart gave a T5's 12 to 193 us in repeated
    calibrations at 1 and 2 ranks, the difference within rounds 34 to 45."""
    from lattice.cost.model import estimate
    from lattice.models import build_model
    from lattice.modes.layout import Layout

    steps, ops = [], []
    for blocks in (2, 1):
        tiny = dataclasses.replace(cfg, **{**type(cfg).presets["tiny"], "vocab_size": 16, "seq_len": 4, "n_layers": blocks})
        model = build_model(tiny, Layout("serial").context())
        tokens = torch.randint(0, 16, (1, 4))
        steps.append(lambda model=model, tokens=tokens: model.forward_backward(tokens, tokens))
        c = estimate(tiny, "serial", batch=1)
        ops.append(c.ops["forward"] + c.ops["backward"])
    return max(time_beyond(*steps), 0.0) / (ops[0] - ops[1])
