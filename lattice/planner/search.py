"""The planner behind `lattice plan --auto`: every layout of a model on N ranks that the modes,
the model and the memory allow, priced by the cost model and ranked by predicted step time.

    best = search(cfg, gpus=16, machine=MACHINES["h100-node"], batch=32).ranked[0]

A candidate is a whole training setup: the mode and its options, tp, cp, pp with its schedule,
virtual stages and micro-batches, dp, the ZeRO stage, precision, activation checkpointing and
the rank placement. Each is priced by `lattice.planner.pricing.price` (without a pipeline the
estimate's step of rank 0, with one each stage priced as the tensor layout running its blocks
and the end parts that stage holds). What training refuses is never priced (the Trainer's own
checks). Pruning: each (mode, tp) keeps its fastest option setting and its smallest in memory;
ZeRO stages and checkpointing are tried in the order of the time they add, and the first that
fits the memory is kept; without a pipeline, gradient accumulation where it can bring a setup under.
"""
from __future__ import annotations

import itertools
import math
import time
from collections import Counter
from dataclasses import dataclass, field

from lattice.cost.machine import Machine
from lattice.planner.pricing import Choice, Priced, price
from lattice.modes import available_modes, get_mode
from lattice.models.registry import arch_of_config
from lattice.modes.layout import Layout
from lattice.parallel.context import LatticeConfigError

MAX_CP = 8  # context parallelism beyond this many ranks per sequence is not searched
MAX_MICROBATCH_CHOICES = 2  # micro-batch counts per pipeline depth: the largest ones
USABLE_MEMORY = 0.9  # of a device's memory: the rest for the runtime, workspaces and fragmentation


@dataclass
class Ranking:
    memory_limit: float | None  # bytes per rank (None: no limit)
    gpus: int  # the ranks searched
    ranked: list[Priced] = field(default_factory=list)  # every candidate that fits, fastest first
    priced: int = 0  # candidates the cost model priced
    over_memory: int = 0  # of them, over the memory limit at every ZeRO stage, with checkpointing and accumulation
    refused: dict[str, Counter] = field(default_factory=dict)  # mode -> {reason: layouts}
    closest_over: dict[str, Priced] = field(default_factory=dict)  # mode -> its least-memory candidate, over the limit
    tensor_groups: set[str] = field(default_factory=set)  # the modes with a tp among the divisors of the ranks
    smallest_groups: dict[str, list[int]] = field(default_factory=dict)  # the others -> their smallest tp
    seconds: float = 0.0

    def best_of(self, mode: str) -> Priced | None:
        return next((p for p in self.ranked if p.choice.layout.mode == mode), None)

    def refuse(self, mode: str, reason: str) -> None:
        self.refused.setdefault(mode, Counter())[_short(reason)] += 1

    def fits(self, priced: Priced) -> bool:
        return self.memory_limit is None or priced.memory["total"] <= self.memory_limit


# ----------------------------------------------------------------------------- the space


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def option_settings(mode: str, tp: int) -> list[dict]:
    """Every setting of the mode's options (an integer option, such as subgraph's sub-grid count,
    over the divisors of tp from 2)."""
    names, values = [], []
    for key, option in get_mode(mode).options.items():
        names.append(key)
        if option.type is bool:
            values.append((False, True))
        elif option.choices:
            values.append(tuple(option.choices))
        elif option.type is int:
            values.append(tuple(d for d in divisors(tp) if d >= 2) or (option.default,))
        else:
            values.append((option.default,))
    return [dict(zip(names, combo)) for combo in itertools.product(*values)]


def _tensor_group_problem(mode: str, tp: int, rpn: int) -> str | None:
    """Why no setting of the mode's options makes a layout of tp tensor ranks (the refusal of its
    default setting), or None: subgraph's default sub-grids (2) refuse tp = 3, where 3 sub-grids
    of one rank each are a layout."""
    try:
        Layout(mode, tp=tp, ranks_per_node=rpn)
        return None
    except LatticeConfigError as e:
        problem = str(e)
    for options in option_settings(mode, tp):
        try:
            Layout(mode, tp=tp, options=options, ranks_per_node=rpn)
            return None
        except LatticeConfigError:
            continue
    return problem


def _smallest_tensor_groups(mode: str, rpn: int, count: int = 2, largest: int = 4096) -> list[int]:
    """The `count` smallest tp (from 2) of which the mode makes a layout (a 2d square, a 3d cube)."""
    found = []
    for tp in range(2, largest + 1):
        if _tensor_group_problem(mode, tp, rpn) is None:
            found.append(tp)
            if len(found) == count:
                break
    return found


def _microbatch_counts(pp: int, replica: int, layers: int) -> list[tuple[int, str, int | None]]:
    """(m, schedule, virtual) for pp stages on `replica` sequences: 1F1B at the largest counts of
    at least pp micro-batches that divide the replica's batch, and interleaved (v = 2) where the
    blocks split into 2 pp chunks and m is a multiple of pp."""
    if pp == 1:
        return [(1, "1f1b", None)]
    counts = [m for m in divisors(replica) if m >= pp][-MAX_MICROBATCH_CHOICES:]
    out = [(m, "1f1b", None) for m in counts]
    interleaved = [m for m in counts if m % pp == 0]
    if layers % (2 * pp) == 0 and interleaved:
        out.append((interleaved[-1], "interleaved", 2))
    return out


def uneven_split(cfg, pp: int) -> tuple[int, ...] | None:
    """The blocks of each of pp stages where the model's do not split evenly (training then needs
    them as pp_layers), else None: the extra blocks on the middle stages first, then on the first
    (beside the embedding), the last stage (beside the LM head) last."""
    blocks = cfg.n_layers + getattr(cfg, "n_decoder_layers", 0)  # an encoder-decoder's two stacks
    base, extra = divmod(blocks, pp)
    if not extra:
        return None
    order = list(range(1, pp - 1)) + [0, pp - 1]
    return tuple(base + (order.index(s) < extra) for s in range(pp))


def _setups(lay: Layout, precision: str) -> list[Choice]:
    """ZeRO stages and activation checkpointing (none, selective, full), least added time first
    (under the cost model each only adds time): the first whose memory fits is the layout's price."""
    zeros = (0, 1, 2, 3) if lay.dp * lay.cp > 1 else (0,)
    return [Choice(lay, zero=zero, precision=precision, checkpointing=ckpt, selective=selective)
            for ckpt, selective in ((False, False), (False, True), (True, False)) for zero in zeros]


def search(cfg, *, gpus: int, machine: Machine, batch: int, memory_gib: float | None = None,
           ranks_per_node: int | None = None, precisions: tuple[str, ...] | None = None,
           modes: list[str] | None = None, placements: tuple[str, ...] = ("natural", "topology")) -> Ranking:
    """Every feasible setup of `cfg` on `gpus` ranks for a global batch of `batch` sequences,
    priced on `machine` (`ranks_per_node` default the machine's) and ranked; setups whose fullest
    rank needs more than `memory_gib` (default: USABLE_MEMORY of the machine's memory, no limit where
    it has none) are dropped and counted."""
    start = time.perf_counter()
    rpn = ranks_per_node or machine.ranks_per_node
    limit = (memory_gib * 2 ** 30 if memory_gib else
             USABLE_MEMORY * machine.memory_gib * 2 ** 30 if machine.memory_gib else None)
    precisions = precisions or tuple(p for p in (machine.precision, "bf16" if machine.precision == "fp32" else "fp32")
                                     if p == machine.precision or machine.other_precision_flop_rate)
    plan = Ranking(limit, gpus)
    multi_node = gpus > rpn
    for mode in modes or available_modes():
        for tp in divisors(gpus):
            if (mode == "serial") != (tp == 1):
                continue  # a parallel mode on one tensor rank is the serial layout
            problem = _tensor_group_problem(mode, tp, rpn)
            if problem:  # tp itself (a square, a cube): no setting of the options helps
                plan.refuse(mode, problem)
                continue
            plan.tensor_groups.add(mode)
            # the mode's option settings at pp = 1, cp = 1: its fastest and its smallest in memory go on
            trials = []
            for options in option_settings(mode, tp):
                try:  # on one replica, with its share of the batch
                    lay = Layout(mode, tp=tp, options=options, ranks_per_node=rpn)
                    problem = get_mode(mode).size_problem(cfg, lay.context())  # (without the refusal's hint search)
                    if problem:
                        plan.refuse(mode, problem)
                        continue
                    trials.append(price(cfg, Choice(lay, precision=precisions[0]), batch=max(1, batch * tp // gpus),
                                        machine=machine))
                    plan.priced += 1
                except LatticeConfigError as e:
                    plan.refuse(mode, str(e))
            if not trials:
                continue
            kept = (min(trials, key=lambda p: p.step_s), min(trials, key=lambda p: p.memory["total"]))
            for options in {tuple(sorted(p.choice.layout.options.items())): p.choice.layout.options for p in kept}.values():
                _search_tensor_layout(cfg, plan, mode, tp, options, gpus=gpus, rpn=rpn, batch=batch, machine=machine,
                                      precisions=precisions, placements=placements if multi_node else ("natural",))
    for mode in set(modes or available_modes()) - plan.tensor_groups - {"serial"}:
        plan.smallest_groups[mode] = _smallest_tensor_groups(mode, rpn)
    plan.ranked.sort(key=lambda p: p.step_s)
    plan.seconds = time.perf_counter() - start
    return plan


def expert_sizes(cfg, mode: str, tp: int, dp: int, options, cp: int = 1) -> list[int]:
    """The ep a mixture of experts may take in this layout (1, the size of the mode's expert axis,
    of the cp ranks, of the replicas and the products of these, each where it divides the experts);
    [1] for a dense model."""
    experts = getattr(cfg, "n_experts", 0)
    if not experts:
        return [1]
    axis = get_mode(mode).usable_expert_axis(options)
    size = dict(get_mode(mode).mesh_axes(tp, options)).get(axis, 1) if axis is not None else 1
    out = []
    for ep in sorted({a * c * d for a in (1, size) for c in (1, cp) for d in (1, dp)}):
        try:
            get_mode(mode).expert_axes(ep, tp, dp, options, cp)
        except LatticeConfigError:
            continue
        if experts % ep == 0:
            out.append(ep)
    return out


def _search_tensor_layout(cfg, plan: Ranking, mode, tp, options, *, gpus, rpn, batch, machine, precisions, placements):
    rest = gpus // tp
    for cp in [c for c in divisors(rest) if c <= MAX_CP]:
        for pp in [p for p in divisors(rest // cp) if p <= cfg.n_layers]:
            dp = rest // (cp * pp)
            if batch % dp:
                plan.refuse(mode, f"a global batch of {batch} does not split over dp={dp} replicas")
                continue
            for (m, schedule, virtual), ep, placement in itertools.product(
                    _microbatch_counts(pp, batch // dp, cfg.n_layers), expert_sizes(cfg, mode, tp, dp, options, cp), placements):
                if placement != "natural" and (pp > 1 or cp > 1):
                    continue  # the topology-aware grids are of one replica's tensor ranks
                pipe = dict(microbatches=m, pp_schedule=schedule, pp_virtual=virtual,
                            pp_layers=uneven_split(cfg, pp)) if pp > 1 else {}
                try:
                    lay = Layout(mode, tp=tp, cp=cp, pp=pp, dp=dp, ep=ep, options=options, placement=placement,
                                 ranks_per_node=rpn, **pipe)
                except LatticeConfigError as e:
                    plan.refuse(mode, str(e))
                    continue
                if placement != "natural" and lay.topology.rank_grid == lay.replace(placement="natural").topology.rank_grid:
                    continue  # the same ranks in the same places
                problem = arch_of_config(cfg).layout_problem(cfg, lay)
                if problem:
                    plan.refuse(mode, problem)
                    continue
                for precision in precisions:
                    try:
                        fitted, smallest = _fitting_or_accumulated(cfg, plan, lay, precision, batch=batch,
                                                                   machine=machine)
                    except LatticeConfigError as e:
                        plan.refuse(mode, str(e))
                        continue
                    if fitted is not None:
                        plan.ranked.append(fitted)
                    else:
                        plan.over_memory += 1
                        best = plan.closest_over.get(mode)
                        if best is None or smallest.memory["total"] < best.memory["total"]:
                            plan.closest_over[mode] = smallest


def _fitting_or_accumulated(cfg, plan: Ranking, lay: Layout, precision: str, *, batch: int,
                            machine: Machine) -> tuple[Priced | None, Priced]:
    """`_fitting` of the layout's setups; without a pipeline, where its fastest is over the memory
    limit and activations are what a smaller pass could save, also gradient accumulation over
    2, 4, 8, ... passes (the fewest that fit): the faster of the two, and the setup that saves the
    most memory of all."""
    setups = _setups(lay, precision)
    fitted, smallest = _fitting(cfg, plan, setups, batch=batch, machine=machine)
    if lay.pp > 1 or (fitted is not None and fitted.choice == setups[0]):
        return fitted, smallest
    rest = smallest.memory["total"] - smallest.memory["activations"]
    if plan.memory_limit is None or rest > plan.memory_limit:
        return fitted, smallest  # the weights and optimizer alone are over: no pass is small enough
    # activations shrink about as 1/m: start at the fewest passes that could fit, a power of two
    needed = smallest.memory["activations"] / max(plan.memory_limit - rest, 1.0)
    m, replica = 2 ** max(1, math.ceil(math.log2(max(needed, 2.0)))), batch // lay.dp
    while m <= replica:
        if replica % m == 0:
            try:
                got, least = _fitting(cfg, plan, _setups(lay.replace(microbatches=m), precision), batch=batch,
                                      machine=machine)
            except LatticeConfigError:  # the mode cannot split a micro-batch of replica/m sequences
                got = least = None
            if least is not None and least.memory["total"] < smallest.memory["total"]:
                smallest = least
            if got is not None:
                return (got if fitted is None or got.step_s < fitted.step_s else fitted), smallest
        m *= 2
    return fitted, smallest


def _fitting(cfg, plan: Ranking, setups: list[Choice], *, batch: int, machine: Machine) -> tuple[Priced | None, Priced]:
    """(the fastest of `setups` (`_setups`' order) that fits the plan's memory limit or None, the one
    that saves the most memory): the fastest first; else the last (where it does not fit, none
    does); else the others in the order of their time, but where one known to take no more memory
    is over the limit. Less memory: a recomputation that keeps less at the same ZeRO stage (full
    keeps the least, selective the next), or ZeRO-2 against stages 0 and 1 of the same
    recomputation, priced first (ZeRO-3's gathered weights can outweigh ZeRO-2's whole ones)."""
    priced: dict[int, Priced] = {}  # by the setup's place in `setups`
    kinds = list(dict.fromkeys((c.checkpointing, c.selective) for c in setups))  # the least recomputation first
    place = {(c.checkpointing, c.selective, c.zero): k for k, c in enumerate(setups)}

    def fits(k: int) -> bool:
        if k not in priced:
            priced[k] = price(cfg, setups[k], batch=batch, machine=machine)
            plan.priced += 1
        return plan.fits(priced[k])

    def leaner_over(k: int) -> bool:
        c = setups[k]
        kind = (c.checkpointing, c.selective)
        stage_2 = place.get((*kind, 2))
        if c.zero < 2 and stage_2 is not None and not fits(stage_2):
            return True
        leaner = [place[(*other, c.zero)] for other in kinds[kinds.index(kind) + 1:]]
        return any(j in priced and not plan.fits(priced[j]) for j in leaner)

    last = len(setups) - 1
    if fits(0):
        return priced[0], priced[0]
    if not fits(last):
        return None, priced[last]
    for k in range(1, last):
        if not leaner_over(k) and fits(k):
            return priced[k], priced[last]
    return priced[last], priced[last]


def _short(reason: str, limit: int = 160) -> str:
    """A refusal cut at a word boundary (the reasons are grouped and counted)."""
    if len(reason) <= limit:
        return reason
    return reason[:limit].rsplit(" ", 1)[0] + " ..."
