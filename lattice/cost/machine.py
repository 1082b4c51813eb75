"""The α-β-F machine of the cost model: how many point-to-point steps and wire words one collective
costs under ring and tree algorithms (Optimus Eqs. 4-5), and the machine's rates; `Term`, one
kind of collective at one site of a step, the unit in which the cost model lists communication."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from lattice.parallel.context import MeshAxis


@dataclass(frozen=True)
class Term:
    """`calls` collectives of one kind at one site of the model, per rank, moving `elements` in all."""

    phase: str  # "forward" | "backward"
    op: str  # CommMeter op name
    axes: tuple[MeshAxis, ...]  # the group: ranks that differ only along these mesh axes
    calls: float
    elements: float
    site: str  # embedding | layer.linear | layer.bias | layer.norm | layer.branch | layer.ring | layer.context |
    #  head | loss | grads | pipeline (layer.ring: a cp ring's keys and values or their gradients, sent while a block
    #  computes; layer.context: cp's all-gather or all-to-all; a ".hidden" suffix: run beside the weight gradients' products)
    itemsize: int = 4
    ranks: int | None = None  # the group's size where it is not the product of `axes` (a first + last stage pair)
    # a gradients' reduction started in backward as its bucket completes (DDP's, the distributed
    # optimizer's hooks): it travels beside the rest of backward's compute
    beside_backward: bool = False

    @property
    def bytes(self) -> float:
        return self.elements * self.itemsize


# ----------------------------------------------------------------------------- collective algorithms


def wire_factor(op: str, n: int) -> float:
    """Per-rank words on the wire per element of the CommMeter buffer: ring algorithms for
    all-reduce (Optimus Eq. 5), all-gather, reduce-scatter and all-to-all; a binomial tree for
    broadcast and reduce (Optimus Eq. 4); scatter and gather move every rank's piece of the
    group's buffer through the root ((n - 1)/n of it); a point-to-point send moves its tensor."""
    if op == "send":
        return 1.0
    if n <= 1:
        return 0.0
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "all_to_all", "scatter", "gather"):
        return (n - 1) / n
    if op in ("broadcast", "reduce"):
        return math.log2(n)
    raise ValueError(f"unknown collective {op!r}")


def message_steps(op: str, n: int) -> int:
    """Sequential point-to-point steps (latency terms α) of one call under the same algorithms."""
    if op == "send":
        return 1
    if n <= 1:
        return 0
    if op == "all_reduce":
        return 2 * (n - 1)
    if op in ("all_gather", "reduce_scatter", "all_to_all", "scatter", "gather"):
        return n - 1
    if op in ("broadcast", "reduce"):
        return math.ceil(math.log2(n))
    raise ValueError(f"unknown collective {op!r}")


def algorithm(op: str, n: int, pipelined: bool) -> tuple[float, float]:
    """(latency steps, wire words per element) of one call. A pipelined broadcast / reduce (NCCL's
    ring) moves each element once per rank, over n - 1 steps, instead of a tree's log2 n times."""
    if pipelined and op in ("broadcast", "reduce") and n > 1:
        return n - 1, 1.0
    return message_steps(op, n), wire_factor(op, n)


def _along(points: list[tuple[float, float]], x: float, *, rising_beyond: bool) -> float:
    """y at x (at or above the first point's) on the line through `points` (sorted by x, at least
    two): linear between the two around x, never below 0; beyond the last, the last y, rising
    along the slope of the last two where `rising_beyond` and that slope rises."""
    (x0, y0), (x1, y1) = next(((a, b) for a, b in zip(points, points[1:]) if x <= b[0]), points[-2:])
    slope = (y1 - y0) / max(x1 - x0, 1e-12)
    if x > x1:
        return y1 + ((x - x1) * max(slope, 0.0) if rising_beyond else 0.0)
    return max(0.0, y0 + (x - x0) * slope)


BY_WORLD_FIELDS = ("ranks", "flop_rate", "elem_rate", "attn_rate", "alpha_intra", "beta_intra", "update_per_tensor",
                   "mem_bandwidth", "op_overhead", "alpha_send", "skew", "norm_per_tensor", "collectives",
                   "kernel_rows", "overlap", "skew_curve", "elementwise_rates", "wake_curve",
                   "collective_curves", "pipeline_actions", "group_curves", "grad_sum_ratios")


@dataclass(frozen=True)
class Machine:
    """α-β-F machine: latency α (s per message) and inverse bandwidth β (s per byte) inside a node
    and between nodes, and per rank: the matrix-product rate F (FLOP/s), the rate of elementwise
    operators (LayerNorm, GELU, bias and residual adds, softmax: elements/s), of causal attention
    (score elements B·n·T² per second, forward), and the optimizer update's cost per parameter
    tensor (s) and memory bandwidth (bytes/s). Backward runs at the same rates (twice the work).

    The fields come in three groups, each listed in a tuple below the class: the papers' model
    itself (PAPER_FIELDS), a device's measured departures from it (MEASURED_FIELDS), and the waits
    of ranks that share a CPU's cores (SHARED_CORE_FIELDS)."""

    # The papers' α-β-F model (PAPER_FIELDS).
    name: str
    flop_rate: float
    alpha_intra: float
    beta_intra: float
    alpha_inter: float
    beta_inter: float
    ranks_per_node: int
    elem_rate: float = 1e9
    attn_rate: float = 1e9
    update_per_tensor: float = 0.0
    mem_bandwidth: float = 10e9
    # the Trainer's gradient norm and clipping (lattice.training.optim: grad_norm, clip_grads), per
    # gradient tensor; beyond it each reads every gradient twice and writes it once at mem_bandwidth
    norm_per_tensor: float = 0.0
    pipelined_broadcast: bool = False  # True: broadcast / reduce as pipelined rings (NCCL), else trees
    precision: str = "fp32"  # the precision flop_rate is for ("bf16": bf16 weights with fp32 masters)
    other_precision_flop_rate: float = 0.0  # F under the other precision (0: unknown, not planned)
    memory_gib: float = 0.0  # device memory per rank (0: unknown)

    # Where a device's kernels and collectives depart from the α-β-F model (MEASURED_FIELDS), each
    # fitted to micro-benchmarks or published curves by lattice.calibration, never to the step
    # times the planner is judged on; a field left at its default adds nothing.
    # a matrix product of f FLOPs runs at F·f/(f + kernel_flops) (a GPU's efficiency at small
    # per-kernel work: launch and tail), i.e. each product costs kernel_flops/F more
    kernel_flops: float = 0.0
    # and each product of a weight piece K x N on M rows takes the time of M + kernel_rows rows (a
    # CPU's: packing the weight into its kernel's blocks is fixed per product, amortised over its
    # rows): a pipeline's micro-batch of one sequence runs its products at M/(M + kernel_rows) of F
    kernel_rows: float = 0.0
    # the fraction of a collective's time that compute beside it hides (a layer's collective started
    # before the weight gradients' products, a cp ring's exchange beside attention, ZeRO's gather
    # beside the next forward), up to that compute's time: 1 where copies and sums have engines of
    # their own; on a CPU whose ranks have no spare core they take it from the compute (calibrated)
    overlap: float = 1.0
    # the framework's time per operation a family describes (a norm, a linear, attention: each a
    # handful of calls through Python, autograd and the dispatcher), forward; backward twice
    op_overhead: float = 0.0
    # the latency of one send of a cp ring's step, where it exceeds α (0: α): what a ring's
    # attention takes beyond its blocks, per send (calibrate: on a cp pair's ring attention). Both
    # ends must be scheduled, and each step merges its block into the output and runs its Python:
    # at 2 ranks on 2 cores 1.3-1.6 ms where α is 0.2-0.7 ms
    alpha_send: float = 0.0
    # a collective's own time against the stretch of compute before it, where every rank has a core
    # of its own: ((stretch s, seconds per collective), ...), the first at the stretch the
    # collectives' α and β were fitted after (one product of the loop). The longer the ranks compute
    # apart, the longer gloo's threads take to meet: at 2 ranks on 2 cores an all-reduce of 196 KB
    # took 0.74 ms after 0.08 ms of products, 0.94 after 0.32 and 1.09 after 1.27, and a 1d step of
    # gpt2-deep makes 37 of them; each collective after a longer stretch pays the difference
    # (skew_seconds), a pipeline's point-to-point hop none. Empty where ranks share cores (none idles)
    wake_curve: tuple = ()
    # each collective's own (α, β) inside a node, where they differ from one another: ((op, α, β), ...).
    # gloo's all-reduce of a few bytes between two ranks takes six times a broadcast's latency and
    # its all-gather moves a byte at a third of a broadcast's rate, which one α and one β fitted to
    # all of them misprice by up to 3x; an op not listed (a point-to-point send) uses alpha_intra, beta_intra
    collectives: tuple = ()
    # each collective's time per call beyond its latency steps (steps x its α) against the bytes a rank
    # puts on the wire, where measured: ((op, ((wire bytes, seconds), ...)), ...), read between the
    # points in place of bytes x β. On gloo the time per byte grows with the message: at 4 ranks on 2
    # cores an all-reduce of 16.8 MB (25.2 MB on each rank's wire) took 29-31 ms where the α and β
    # fitted over 64 B to 16.8 MB (on relative error, for the small messages' sake) say 21-26 ms,
    # and a data-parallel step's gradient buckets are that size
    collective_curves: tuple = ()
    # a pipeline schedule's own time per chunk of one micro-batch (its forward and backward, the
    # stage's receives and sends around them) beyond what the rest of the model prices for the chunk
    # (its operations and its hop): ((schedule, seconds), ...). torch.distributed.pipelining runs
    # each action through Python, and where ranks share cores a stage that waits for its neighbour
    # waits for the scheduler too: at 4 ranks on 2 cores gpt2-wide's pipeline grew 27.4 ms per
    # micro-batch where its price grew 17.8; a schedule not listed costs its hop only
    pipeline_actions: tuple = ()
    # the gradients' sum over replicas as a step runs it (after backward, every rank's gradients
    # copied into one buffer, summed, divided) over the same all-reduce timed back to back, which
    # `collectives` and the curves above are: ((wire bytes, ratio), ...), read between the points
    # (flat beyond them) for every gradient all-reduce (site "grads"). At 2 ranks on 2 cores the sum
    # of gpt2-deep's 4.4 MB of gradients took 8.5 ms where the loop's all-reduce of it took 3.8-4.3
    grad_sum_ratios: tuple = ()
    # each elementwise operator's own rate, where measured: ((operator, elements/s), ...), the
    # elements as the cost model counts them (lattice.cost.builder.ELEMENTWISE_OPERATORS). On a CPU
    # they differ by up to 5x (tanh GELU 1.7-2.3 ns per element, a residual add 0.4-0.9 ns), and
    # elem_rate's mix, mostly the cross-entropy over the vocabulary, priced a GPT-2 block's GELU and
    # LayerNorm at a quarter to a half of their time; an operator not listed runs at elem_rate
    elementwise_rates: tuple = ()

    # Ranks sharing a node's cores (SHARED_CORE_FIELDS): a CPU running more ranks than it has
    # cores; a GPU machine, one rank per device, leaves them all at their defaults.
    # cores a node's ranks share (0: each rank has a device of its own); with more ranks than cores a
    # pipeline's waiting stages leave theirs to the busy ones (lattice.planner.pricing prices that)
    cores: int = 0
    # where ranks share cores, the scheduler does not share them evenly over tens of milliseconds
    # and every synchronisation waits for the slowest rank: how much longer the slowest rank's ~30 ms
    # segment of compute takes than the mean rank's, started together (0: a device per rank); the
    # step's forward and backward take that fraction more
    skew: float = 0.0
    # the same wait measured per synchronisation, against the stretch of compute before it and the
    # ranks it joins: ((group ranks, stretch s, slowest of the group beyond the mean rank, s), ...).
    # Where ranks outnumber cores the wait is about a scheduler's slice, whatever the stretch
    # (6-18 ms at 8 ranks on 2 cores after stretches of 8 to 320 ms: 77% to 6% of them), so a
    # fixed fraction of compute overcharges a step of few long stretches and undercharges one of
    # many short ones; with a curve, the step's skew is that of its synchronisations
    # (skew_seconds), else skew x compute
    skew_curve: tuple = ()
    # an all-reduce over groups smaller than the world, every group at once (a dp = 2 or tp = 2 group
    # at 4 or 8 ranks): ((op, group ranks, ((wire bytes, seconds per call), ...)), ...), read in place
    # of the world's α and curve. Where ranks share cores, the other groups' copies and sums take the
    # cores too: at 4 ranks on 2 cores two pairs' all-reduces of 4.2 MB each took 7.1 ms, where the
    # world's α and curve at a pair's wire bytes said 3.6; a group size not listed reads the world's
    group_curves: tuple = ()
    # calibrations at other world sizes on this node, rows of BY_WORLD_FIELDS (a prefix of them):
    # where ranks outnumber cores they share them, and every collective waits for its ranks
    by_world: tuple = ()

    def at(self, world: int) -> "Machine":
        """This machine as `world` ranks on it see it: the calibration of the nearest world size
        (by ratio) where `by_world` has some, else itself."""
        if not self.by_world:
            return self
        row = dict(zip(BY_WORLD_FIELDS, min(self.by_world, key=lambda r: (abs(math.log(r[0] / max(world, 1))), -r[0]))))
        del row["ranks"]
        return dataclasses.replace(self, **row, alpha_inter=max(row["alpha_intra"], self.alpha_inter),
                                   beta_inter=max(row["beta_intra"], self.beta_inter), by_world=())

    def elementwise_rate(self, operator: str) -> float:
        """Elements per second of one elementwise `operator` (Machine.elementwise_rates), else elem_rate."""
        return dict(self.elementwise_rates).get(operator, self.elem_rate)

    def biased_attention_rate(self) -> float:
        """Score elements per second (forward) of attention with an additive bias that requires a
        gradient (T5's position bias), the `elementwise_rates` entry "biased_attention" that
        `calibrate` measures: on a CPU SDPA's math kernel runs it. Where none was measured (the
        GPU presets, whose memory-efficient kernel takes such a bias and its gradient), the fused
        kernel's attn_rate."""
        return dict(self.elementwise_rates).get("biased_attention", self.attn_rate)

    def skew_seconds(self, compute: float, syncs: dict[int, float], *, collectives: float,
                     apart: tuple[float, float] = (0.0, 0.0)) -> float:
        """Seconds a step waits for its slowest ranks: with `skew_curve`, each of its `syncs`
        ({group ranks: synchronisations per step}) after an equal share of the step's `compute`,
        at the curve of the nearest group size (by ratio), linear in the stretch between its
        measured points (through zero below the first, along the last two beyond); else
        skew x compute. Of the syncs, `collectives` (the collective calls, not a pipeline's hops)
        each also take longer after their stretch than α says (wake_seconds). `apart` (seconds of
        the compute, collectives) are collectives that each follow their share of that compute
        alone (a cp ring's exchanges, between its blocks of attention), the rest the rest's."""
        count = sum(syncs.values())
        if not self.skew_curve:
            return self.skew * compute
        if count <= 0:  # ranks that never meet wait for none
            return 0.0
        stretch = compute / count
        apart_compute, apart_calls = apart if 0 < apart[1] < count else (0.0, 0.0)
        seconds = ((collectives - apart_calls) * self.wake_seconds((compute - apart_compute) / (count - apart_calls))
                   + (apart_calls * self.wake_seconds(apart_compute / apart_calls) if apart_calls else 0.0))
        for ranks, n in syncs.items():
            near = min({row[0] for row in self.skew_curve}, key=lambda g: (abs(math.log(g / max(ranks, 1))), -g))
            points = [(0.0, 0.0)] + sorted((s, e) for g, s, e in self.skew_curve if g == near)
            # beyond the longest stretch measured the wait is no less than there
            seconds += n * _along(points, stretch, rising_beyond=True)
        return seconds

    def wake_seconds(self, stretch: float) -> float:
        """What one collective after `stretch` seconds of compute takes beyond one after the
        stretch `wake_curve` starts at (which α and β include): linear between its points, flat
        beyond the last, none below the first or without a curve."""
        if len(self.wake_curve) < 2:
            return 0.0
        points = sorted(self.wake_curve)
        if stretch <= points[0][0]:
            return 0.0
        return max(0.0, _along(points, stretch, rising_beyond=False) - points[0][1])

    def link(self, across_nodes: bool, op: str = "") -> tuple[float, float]:
        """(α, β) of a message of `op` inside a node (the collective's own where `collectives` has
        it) or between nodes ("send": a ring's point-to-point exchange between compute, at
        alpha_send where that is larger)."""
        if across_nodes:
            alpha, beta = self.alpha_inter, self.beta_inter
        else:
            alpha, beta = next(((a, b) for name, a, b in self.collectives if name == op),
                               (self.alpha_intra, self.beta_intra))
        return (max(alpha, self.alpha_send) if op == "send" else alpha), beta

    def wire_seconds(self, op: str, wire_bytes: float, beta: float) -> float:
        """Seconds one call of `op` takes for `wire_bytes` on each rank's wire beyond its latency
        steps: on `collective_curves` where it has the op (linear between its points, along the
        last two beyond them), else at `beta` per byte."""
        points = dict(self.collective_curves).get(op)
        if not points or len(points) < 2:
            return wire_bytes * beta
        return _along(points, wire_bytes, rising_beyond=True)

    def group_seconds(self, op: str, ranks: int, wire_bytes: float) -> float | None:
        """Seconds one call of `op` over groups of `ranks` takes for `wire_bytes` on each rank's
        wire, every group at once (Machine.group_curves: linear between its points, along the
        last two beyond them); None where that group size is not calibrated."""
        points = next((pts for name, n, pts in self.group_curves if name == op and n == ranks), None)
        if not points or len(points) < 2:
            return None
        return _along(sorted(points), wire_bytes, rising_beyond=True)

    def grad_sum_ratio(self, wire_bytes: float) -> float:
        """What a gradient all-reduce of `wire_bytes` takes over its collective's time
        (Machine.grad_sum_ratios: linear between its points, flat beyond them; 1 without)."""
        if len(self.grad_sum_ratios) < 2:
            return 1.0
        points = sorted(self.grad_sum_ratios)
        return _along(points, min(max(wire_bytes, points[0][0]), points[-1][0]), rising_beyond=False)

    def pipeline_action(self, schedule: str) -> float:
        """Seconds `schedule` takes per chunk of one micro-batch beyond the chunk's price
        (Machine.pipeline_actions; 0 where not measured)."""
        return dict(self.pipeline_actions).get(schedule, 0.0)

    def with_precision(self, precision: str) -> "Machine":
        """This machine's rates for `precision` (refused where it has none)."""
        if precision == self.precision:
            return self
        if not self.other_precision_flop_rate:
            raise ValueError(f"{self.name} has no matrix-product rate for {precision}")
        return dataclasses.replace(self, precision=precision, flop_rate=self.other_precision_flop_rate,
                                   other_precision_flop_rate=self.flop_rate)

    def describe(self) -> str:
        return (f"{self.name}: F = {self.flop_rate / 1e9:.3g} GFLOP/s"
                + (f" (a product of M rows at M/(M + {self.kernel_rows:.3g}) of it)" if self.kernel_rows else "")
                + f", elementwise {self.elem_rate / 1e9:.3g} "
                f"G elements/s, attention {self.attn_rate / 1e9:.3g} G scores/s, update {self.update_per_tensor * 1e6:.3g} µs per tensor + "
                f"norm and clip {self.norm_per_tensor * 1e6:.3g} µs per tensor + "
                f"{self.mem_bandwidth / 1e9:.3g} GB/s (per rank); intra-node α = {self.alpha_intra * 1e6:.3g} µs, "
                f"β = 1/({1e-9 / self.beta_intra:.3g} GB/s); inter-node α = {self.alpha_inter * 1e6:.3g} µs, "
                f"β = 1/({1e-9 / self.beta_inter:.3g} GB/s); {self.ranks_per_node} ranks per node; "
                f"{'pipelined' if self.pipelined_broadcast else 'tree'} broadcast / reduce"
                + (f"; compute hides {self.overlap:.0%} of a collective beside it" if self.overlap < 1 else "")
                + "".join(f"; {op} α = {a * 1e6:.3g} µs, β = 1/({1e-9 / b:.3g} GB/s)" for op, a, b in self.collectives))


PAPER_FIELDS = ("name", "flop_rate", "alpha_intra", "beta_intra", "alpha_inter", "beta_inter", "ranks_per_node",
                "elem_rate", "attn_rate", "update_per_tensor", "mem_bandwidth", "norm_per_tensor",
                "pipelined_broadcast", "precision", "other_precision_flop_rate", "memory_gib")
MEASURED_FIELDS = ("kernel_flops", "kernel_rows", "overlap", "op_overhead", "alpha_send", "wake_curve", "collectives",
                   "collective_curves", "pipeline_actions", "grad_sum_ratios", "elementwise_rates")
SHARED_CORE_FIELDS = ("cores", "skew", "skew_curve", "group_curves", "by_world")


# A GPU cluster like the papers' (4 GPUs per node: Frontera RTX, Longhorn V100), for projections.
PAPER_CLUSTER = Machine("4-GPU nodes, InfiniBand EDR", flop_rate=30e12, alpha_intra=10e-6,
                        beta_intra=1 / 40e9, alpha_inter=20e-6, beta_inter=1 / 10e9, ranks_per_node=4,
                        elem_rate=60e9, attn_rate=60e9, update_per_tensor=10e-6, mem_bandwidth=700e9, pipelined_broadcast=True)
