"""What one training setup costs: `price` gives the predicted step time and the fullest rank's
memory of a `Choice` (a layout and what the Trainer adds to it) from `lattice.cost.estimate`.

    priced = price(cfg, Choice(Layout("1d", tp=4, dp=2)), batch=32, machine=MACHINES["h100-node"])

Without a pipeline a setup's step is the estimate's step of rank 0; with one each stage is priced
as the tensor layout running its blocks and the end parts that stage holds. A model deeper than
two blocks is priced at one and two blocks and extrapolated along the depth (every figure is
linear in the blocks a rank holds but for the gradient buckets' count, which is rounded). The
planner (`lattice.planner.search`) ranks the setups by these prices.
"""

from __future__ import annotations

import dataclasses
import math
from collections import OrderedDict
from dataclasses import dataclass

from lattice.cost.machine import Machine
from lattice.cost.model import estimate, grads_beside_backward, kept, meta_model, spans_nodes
from lattice.cost.pipeline import in_flight, p2p_piece
from lattice.modes import get_mode
from lattice.modes.layout import Layout
from lattice.parallel.context import LatticeConfigError, MeshAxis
from lattice.parallel.pipeline import batch_problem, microbatch_count

COMM_GROUPS = ("tensor", "context", "data", "pipeline")
TERMS = ("compute", *COMM_GROUPS, "overlapped", "bubble", "skew", "update")  # a Priced step's terms, in print order


def comm_group(site: str) -> str:
    """Which communication a term is: of the tensor layout, of context parallelism, the gradients'
    reduction over replicas (and the parameters' all-gathers of ZeRO, ZeRO-3's around the blocks
    too: once a step where a step has several micro-batches), or pipeline sends."""
    if site in ("layer.ring", "layer.context") or site.startswith(("layer.ring.", "layer.context.")):
        return "context"
    if site in ("grads", "weights"):
        return "data"
    if site == "pipeline":
        return "pipeline"
    return "tensor"


def command_flag(name: str, value) -> str:
    """A setting as the command line spells it: --name V, or --name / --no-name for a bool."""
    flag = "--" + name.replace("_", "-")
    return flag if value is True else f"--no-{flag[2:]}" if value is False else f"{flag} {value}"


@dataclass(frozen=True)
class Choice:
    """One training setup: the layout and what the Trainer adds to it."""

    layout: Layout
    zero: int = 0
    precision: str = "fp32"
    checkpointing: bool = False  # each block recomputed in backward (`selective`: but its products)
    selective: bool = False
    overlap_grad_reduce: bool = True  # the Trainer's default, the planner's only; False: after backward

    def describe(self) -> str:
        lay = self.layout
        parts = [lay.mode if lay.mode == "serial" else f"{lay.mode} tp={lay.tp}"]
        parts += [f"{k}={v}" for k, v in sorted(lay.options.items()) if v != get_mode(lay.mode).options[k].default]
        if lay.cp > 1:
            parts.append(f"cp={lay.cp}")
        if lay.ep > 1:
            parts.append(f"ep={lay.ep}")
        if lay.accumulation > 1:
            parts.append(f"accumulated m={lay.accumulation}")
        if lay.pp > 1:
            pcfg = lay.pipeline
            parts.append(f"pp={lay.pp} {pcfg.schedule}" + (f" v={pcfg.v}" if pcfg.schedule == "interleaved" else "")
                         + f" m={pcfg.m}" + (f" layers={','.join(map(str, lay.pp_layers))}" if lay.pp_layers else ""))
        parts.append(f"dp={lay.dp}")
        if self.zero:
            parts.append(f"zero={self.zero}")
        parts.append(self.precision)
        parts += ["selective ckpt"] if self.selective else ["ckpt"] if self.checkpointing else []
        parts += [] if self.overlap_grad_reduce else ["reductions after backward"]
        if lay.placement != "natural":
            parts.append(f"{lay.placement} placement")
        return " ".join(parts)

    def train_flags(self) -> str:
        """The `lattice train` flags of this setup."""
        lay, out = self.layout, [f"--mode {self.layout.mode}"]
        for name in ("tp", "cp", "pp", "dp", "ep"):
            if getattr(lay, name) > 1:
                out.append(f"--{name} {getattr(lay, name)}")
        for key, value in sorted(lay.options.items()):  # every one: train would choose those not given
            out.append(command_flag(key, value))
        if lay.accumulation > 1:
            out.append(f"--microbatches {lay.accumulation}")  # gradient accumulation
        if lay.pp > 1:
            out.append(f"--microbatches {lay.pipeline.m} --pp-schedule {lay.pipeline.schedule}")
            if lay.pipeline.schedule == "interleaved":
                out.append(f"--pp-virtual {lay.pipeline.v}")
            if lay.pp_layers:
                out.append(f"--pp-layers {','.join(map(str, lay.pp_layers))}")
        if lay.placement != "natural":
            out.append(f"--placement {lay.placement}")
        if self.zero:
            out.append(f"--zero {self.zero}")
        if self.precision != "fp32":
            out.append(f"--precision {self.precision}")
        if self.checkpointing or self.selective:
            out.append(f"--{'selective' if self.selective else 'activation'}-checkpointing")
        if not self.overlap_grad_reduce and (self.zero or self.precision == "bf16"):  # (DDP's have no flag)
            out.append("--no-overlap-grad-reduce")
        return " ".join(out)


@dataclass
class Priced:
    choice: Choice
    step_s: float
    terms: dict[str, float]  # seconds of one step, by TERMS (overlapped <= 0)
    memory: dict[str, float]  # bytes on the fullest rank: parameters, gradients, optimizer, activations, total

    def as_dict(self) -> dict:
        lay = self.choice.layout
        return {"setup": self.choice.describe(), "train_flags": self.choice.train_flags(), "mode": lay.mode,
                "tp": lay.tp, "cp": lay.cp, "pp": lay.pp, "dp": lay.dp, "options": dict(lay.options),
                "microbatches": lay.pipeline.m if lay.pp > 1 else 1,
                "schedule": lay.pipeline.schedule if lay.pp > 1 else None, "zero": self.choice.zero,
                "precision": self.choice.precision, "activation_checkpointing": self.choice.checkpointing,
                "selective_checkpointing": self.choice.selective,
                "placement": lay.placement, "step_s": self.step_s, "terms_s": self.terms, "memory_bytes": self.memory}


def _figures(c, machine: Machine) -> dict[str, float]:
    """A Cost's figures as one flat dict (seconds and bytes), which extrapolates term by term."""
    t = c.time(machine)
    out = {k: t[k] for k in ("forward_compute", "backward_compute")}
    out["overlapped"] = -(t.get("forward_overlapped", 0.0) + t.get("backward_overlapped", 0.0))
    # ZeRO's all-gather beside the next forward: the update's whole, its hidden part apart (once a step)
    out["update"], out["update_overlapped"] = t["update"] + t["update_overlapped"], -t["update_overlapped"]
    groups = dict.fromkeys(COMM_GROUPS, 0.0)
    out["tensor_loss"] = 0.0  # of the tensor term, the loss's (its one-number sums: `_uneven_ranks`)
    for term, seconds in c.term_times(machine):
        if term.phase in ("forward", "backward"):
            groups[comm_group(term.site)] += seconds
            if term.site == "loss":
                out["tensor_loss"] += seconds
    groups["data"] -= t.get("weights_overlapped", 0.0)  # ZeRO-3's gathers hidden beside the blocks
    out |= {k: t.get(k, 0.0) for k in ("grads_started", "backward_weights_overlapped")}  # hidden by `price`: a min is not linear
    out |= groups | {f"memory_{k}": v for k, v in c.memory.items()}
    # synchronisations (Machine.skew_seconds), the gradients' reductions apart (once a step)
    out.update({f"syncs_{n}": v for n, v in c.syncs(grads=False).items()})
    out.update({f"grad_syncs_{n}": v for n, v in c.grad_syncs().items()})
    out["ring_compute"], out["ring_calls"] = c.ring_waits(machine)
    return out


_PRICED: OrderedDict = OrderedDict()  # priced_blocks' arguments -> its figures, the latest used last
_PRICED_KEPT = 16384


def priced_blocks(cfg, layout: Layout, *, blocks: int, batch: int, machine: Machine, topology, **kw) -> dict[str, float]:
    """`_figures` of rank 0 of `layout` (no pipeline) running `blocks` of the model's blocks with
    its first and last parts, its groups placed on nodes as in `topology`: from the model itself
    when it is that shallow, else from one and two blocks, extrapolated along the depth (every
    figure is linear in the blocks but the gradient buckets' count, which is rounded). Kept for
    the search's later prices of the same stage (a pipeline's schedules of one micro-batch count
    share their stages'): read only."""
    key = (type(cfg), repr(cfg), get_mode(layout.mode), repr(layout), blocks, batch, machine, repr(topology),
           tuple(sorted(kw.items())))
    return kept(_PRICED, _PRICED_KEPT, key, lambda: blocks_figures(cfg, layout, blocks=blocks, batch=batch,
                                                                    machine=machine, topology=topology, **kw))


def blocks_figures(cfg, layout: Layout, *, blocks: int, batch: int, machine: Machine, topology, **kw) -> dict[str, float]:
    """`priced_blocks`, computed."""

    def figures(n):
        c = estimate(dataclasses.replace(cfg, n_layers=n), layout, batch=batch, **kw)
        c.topology = topology  # which groups span nodes, and the world the machine is seen by
        return _figures(c, machine)

    if hasattr(cfg, "n_decoder_layers"):  # an encoder-decoder: its share of both stacks, priced as it is
        share = blocks / cfg.n_layers
        stage_cfg = dataclasses.replace(cfg, n_layers=max(1, math.ceil(cfg.n_layers * share)),
                                        n_decoder_layers=max(1, math.ceil(cfg.n_decoder_layers * share)))
        c = estimate(stage_cfg, layout, batch=batch, **kw)
        c.topology = topology
        return _figures(c, machine)
    if blocks <= 2:
        return figures(blocks)
    one, two = figures(1), figures(2)
    out = {key: one.get(key, 0.0) + (blocks - 1) * (two.get(key, 0.0) - one.get(key, 0.0)) for key in one | two}
    if "memory_gathered" in two and kw.get("reshard_after_forward", True) and layout.accumulation == 1:
        out["memory_gathered"] = two["memory_gathered"]  # ZeRO-3 gathers two blocks at most, however deep
    return out


def price(cfg, choice: Choice, *, batch: int, machine: Machine) -> Priced:
    """Predicted seconds of one step of `choice` on `batch` sequences (global) and the memory of
    its fullest rank. Without a pipeline: the cost model's step. With pp stages (docs/references.md#megatron-lm §2.2):
    a stage is priced as the tensor layout (with its dp and cp) running its blocks of the
    pipeline's split on one micro-batch of B/m sequences, the first stage with the embedding, the
    last with the head (an encoder-decoder's each with both, an upper bound); the slowest stage
    takes m v slots of one chunk's micro-batch, every other stage one more (filling and draining
    the pipeline), each plus the hop of its residual piece to the next stage (activation
    forward, gradient backward; where each rank has a core of its own the slowest stage's hops
    in its steady state wait for none of the latency its lead over the others covers); then the
    gradients' reduction over dp and the update of the stage holding the most. The memory is the
    fullest stage's with its micro-batches in flight."""
    lay = choice.layout
    kw = dict(zero=choice.zero, precision=choice.precision, activation_checkpointing=choice.checkpointing,
              selective_checkpointing=choice.selective, overlap_grad_reduce=choice.overlap_grad_reduce)
    machine = machine.with_precision(choice.precision)
    replica = batch // lay.dp
    if batch % lay.dp:
        raise LatticeConfigError(f"a global batch of {batch} does not split over dp={lay.dp} replicas")
    if getattr(cfg, "num_labels", 0) and (lay.pp > 1 or lay.cp > 1):
        raise LatticeConfigError("a classifier trains with pp = 1 and cp = 1 (one target per sequence, scored whole)")
    # what training refuses (lattice.training.run_spec.check_run): micro-batches of zero sequences, a
    # layout that cannot split a micro-batch (sub-graph's common layers), chunks of cp
    ctx = lay.context()
    for length in (n for n in (cfg.seq_len, getattr(cfg, "target_len", None)) if n):
        if lay.cp > 1 and length % (2 * lay.cp):
            raise LatticeConfigError(f"{length} tokens do not split into 2 cp = {2 * lay.cp} chunks")
        problem = batch_problem(microbatch_count(ctx), get_mode(lay.mode), ctx, replica, length // lay.cp)
        if problem:
            raise LatticeConfigError(problem)
    meeting = machine.at(lay.world_size)  # the rates at which the step's ranks meet
    shares_cores = bool(machine.cores) and lay.world_size > machine.cores
    accumulated = lay.accumulation
    if lay.pp == 1:
        # each pass of a micro-batch computes and runs the tensor and context collectives; the
        # gradients' reduction and the update come once, the activations are one micro-batch's
        f = priced_blocks(cfg, lay, blocks=cfg.n_layers, batch=replica // accumulated, machine=machine,
                           topology=lay.topology, **kw)
        terms = {"compute": accumulated * (f["forward_compute"] + f["backward_compute"]),
                 **{g: f[g] * (accumulated if g in ("tensor", "context") else 1) for g in COMM_GROUPS},
                 "overlapped": accumulated * f["overlapped"], "bubble": 0.0, "update": f["update"]}
        terms["data"] -= grads_beside_backward(f, meeting.overlap)  # beside the last micro-batch's backward
        memory = {k[7:]: v for k, v in f.items() if k.startswith("memory_")}
        if shares_cores and lay.tp > 1:  # as _shared_cores
            where = dict(blocks=cfg.n_layers, batch=replica // accumulated, topology=lay.topology, **kw)
            shared = _uneven_ranks(cfg, lay, machine=machine, **where)
            terms.update({k: shared[k] * (accumulated if k in ("compute", "tensor") else 1)
                          for k in ("compute", "update", "data", "tensor")})
            terms["bubble"] = max(0.0, accumulated * shared["own_core_compute"] - terms["compute"])
            if shared["few_busy"]:  # the others wait in the collectives: none is held up by the scheduler
                meeting = machine.at(machine.cores)
    else:
        pcfg, m, v = lay.pipeline, lay.pipeline.m, lay.pipeline.v
        stage = Layout(lay.mode, tp=lay.tp, dp=lay.dp, cp=lay.cp, ep=lay.ep, cp_attention=lay.cp_attention,
                       options=lay.options, ranks_per_node=lay.ranks_per_node)
        # each stage's blocks with the end parts it holds (an encoder-decoder's stages: both, an upper bound)
        kinds = _stage_parts(cfg, lay)
        if choice.zero == 3:  # a stage's blocks stay gathered from the first micro-batch to the reduction
            kw["reshard_after_forward"] = False
        figures = {(parts, blocks): priced_blocks(cfg, stage, blocks=blocks, batch=replica // m, machine=machine,
                                                   topology=lay.topology, parts=parts, **kw)
                   for parts, blocks in set(kinds)}
        piece = p2p_piece(dataclasses.replace(cfg, n_layers=1), lay, batch=replica)
        itemsize = 2 if choice.precision == "bf16" else 4  # the activations' dtype, as estimate sets it
        here = machine.at(lay.world_size)
        alpha, beta = here.link(spans_nodes(lay.topology, (MeshAxis.PP,)))
        # the activation forward and its gradient backward (latency, wire), and the schedule's own time for the chunk
        own = 2 * piece * itemsize * beta + here.pipeline_action(pcfg.schedule)
        hop = 2 * alpha + own
        chunks = [(figures[k]["forward_compute"] + figures[k]["backward_compute"] + figures[k]["tensor"]
                   + figures[k]["context"] + figures[k]["overlapped"]) / v for k in kinds]
        slowest = max(range(lay.pp), key=lambda s: (chunks[s], s))
        f = figures[kinds[slowest]]
        steady = hop  # a hop of the slowest stage's steady state
        if v == 1 and not shares_cores:
            # each rank on a core of its own: the other stages run ahead of the slowest by the
            # difference of their chunks, and its inputs are there when it asks, up to the hops' latency
            steady = max(own, hop - (chunks[slowest] - max(c for s, c in enumerate(chunks) if s != slowest)))
        # the slowest stage's m v slots of a chunk's micro-batch and its hop, and one chunk and hop of
        # every other stage (the bubble: filling and draining the pipeline); the gradients' reduction
        # over dp and the update of the stage holding the most
        terms = {"compute": m * (f["forward_compute"] + f["backward_compute"]), "tensor": m * f["tensor"],
                 "context": m * f["context"], "pipeline": m * v * steady,  # (reductions beside the last backward)
                 "data": max(g["data"] - grads_beside_backward(g, here.overlap) for g in figures.values()),
                 "overlapped": m * f["overlapped"],
                 "bubble": sum(chunk + hop for s, chunk in enumerate(chunks) if s != slowest),
                 "update": max(g["update"] for g in figures.values())}
        if shares_cores:
            terms["compute"], terms["bubble"] = _shared_cores(cfg, stage, lay, m=m, v=v, machine=machine,
                                                              batch=replica // m, **kw)
            if lay.tp > 1:  # the update of the mean rank too
                terms["update"] = _rank_mean(cfg, stage, blocks=max(b for _, b in kinds), mean=True, batch=replica // m,
                                             machine=machine, topology=lay.topology, **kw)["update"]
        # the memory of the fullest stage, each holding its micro-batches in flight
        memories = []
        for s, kind in enumerate(kinds):
            memory = {k[7:]: val for k, val in figures[kind].items() if k.startswith("memory_")}
            memory["activations"] *= in_flight(pcfg, s) / v
            memories.append(memory)
        memory = max(memories, key=lambda mem: sum(mem.values()))
    # ranks sharing cores: every synchronisation waits for the slowest rank's compute (Machine.skew,
    # skew_curve): a stage's per micro-batch, its hops (a pair each), the gradients' once
    per_step = lay.pipeline.m if lay.pp > 1 else accumulated  # the figures are per micro-batch
    # Where few ranks are busy (_uneven_ranks' few_busy) they meet waiting ones, who hold up none
    # but must be woken: each collective pays the wake after its stretch of a world of a core per
    # rank (meeting's wake_curve). benchmarks/waking_partners.py: 2 of 4 ranks on 2 cores computing
    # 3 to 11 ms, then summing an activation with a waiting partner each, all four computing, and
    # summing again, took 0.2 to 0.9 ms per sum beyond its parts timed alone, where the world of 2
    # gave a sum after such a stretch 0.7 to 1.1 ms more than after the shortest (at 8 ranks, 0.1
    # to 0.4: there an upper bound). Without it sub-graph's common="subgrid" at tp = 4 was priced
    # 7-15% below its measured steps in the planner validation, and the planner chose it first.
    syncs = {int(k[6:]): v * per_step for k, v in f.items() if k.startswith("syncs_")}
    for k, v in f.items():
        if k.startswith("grad_syncs_"):
            syncs[int(k[11:])] = syncs.get(int(k[11:]), 0.0) + v
    collectives = sum(syncs.values())
    if lay.pp > 1:  # and after the schedule the loss's broadcast over the stages, the sums of what
        # every stage holds over them and of a tied table between the first and the last (once each)
        parts = meta_model(dataclasses.replace(cfg, n_layers=1), stage, 0)[1].parts()
        syncs[2] = syncs.get(2, 0.0) + 2 * lay.pipeline.m * lay.pipeline.v + bool(parts.shared)
        syncs[lay.pp] = syncs.get(lay.pp, 0.0) + 1 + bool(parts.everywhere)
        collectives += 1 + bool(parts.everywhere) + bool(parts.shared)  # all but the hops
    # a cp ring's exchanges each after a block of attention
    ring = (per_step * f["ring_compute"], per_step * f["ring_calls"])  # (per pass)
    terms["skew"] = meeting.skew_seconds(terms["compute"], syncs, collectives=collectives, apart=ring)
    terms["update"] += trainer_scalar_seconds(lay, choice, meeting)
    terms["overlapped"] += f["update_overlapped"]
    memory["total"] = sum(memory.values())
    return Priced(choice, sum(terms.values()), terms, memory)


def _stage_parts(cfg, lay: Layout) -> list[tuple]:
    """Of each pipeline stage of `lay`, (the end parts it runs, as `estimate`'s parts (first,
    last), its blocks): the embedding on the first stage, the head on the last, the blocks of its
    chunks in the pipeline's split (which raises where training would refuse it). An
    encoder-decoder's stages: (None, its share of the encoder's blocks), priced as that share of
    both stacks with both ends."""
    pcfg = lay.pipeline
    chunks = pcfg.chunks(cfg.n_layers + getattr(cfg, "n_decoder_layers", 0))
    if hasattr(cfg, "n_decoder_layers"):
        return [(None, math.ceil(cfg.n_layers / lay.pp))] * lay.pp
    return [((s == 0, s == lay.pp - 1), sum(len(c) for c in chunks[s::lay.pp])) for s in range(lay.pp)]


def _rank_mean(cfg, layout: Layout, *, blocks: int, mean: bool, **kw) -> dict[str, float]:
    """{"compute": forward and backward seconds, "update": the update's} of `priced_blocks`: rank
    0's, or with `mean` the mean over the ranks of its tensor group (where its ranks' work differs:
    with common="subgrid" sub-graph's common layers and their parameters are on one sub-grid; dp
    and cp ranks work alike)."""
    topo = layout.topology
    ranks = topo.group_members(topo.tensor_axes, 0) if mean else [0]
    out = {"compute": 0.0, "update": 0.0}
    for rank in ranks:
        f = priced_blocks(cfg, layout, blocks=blocks, rank=rank, **kw)
        out["compute"] += (f["forward_compute"] + f["backward_compute"]) / len(ranks)
        out["update"] += f["update"] / len(ranks)
    return out


def _uneven_ranks(cfg, layout: Layout, *, machine: Machine, **kw) -> dict[str, float]:
    """{"compute", "tensor", "update", "data", "own_core_compute" (rank 0's at a core of its own),
    "few_busy" (whether the uneven work runs on no more ranks than cores, below)} of a layout
    without a pipeline whose ranks outnumber the machine's cores. What every rank of the tensor
    group does (the least compute of its ranks, and the update and gradients' sum where all hold
    parameters) runs with every rank busy, at the world's rates. What only some ranks do (sub-graph
    common="subgrid": its common layers, their parameters' sum and update are sub-grid 0's alone)
    runs while the others wait and leave their cores: where those busy ranks (in every replica)
    are no more than the cores, at the rates of a rank with a core of its own, the slowest of them
    setting the pace; else they share the cores, the tensor group's mean at the world's rates. At
    8 ranks on 2 cores a rank is 5.3 times slower than with a core of its own, not 4 (switching
    between ranks): gpt2-wide's sub-graph (tp 8, 4 sub-grids, common on the first) took 121-125 ms
    of forward and backward, 29-38 ms to sum its gradients and 12-17 ms to update on sub-grid 0's
    two ranks; the world's rates for the mean rank had priced them at 144, 64 and 49 ms. With
    few_busy the step's ranks meet as on a core each (`price`: skew, each collective's wake and
    the Trainer's one-number all-reduces at those rates): the waiting ranks are blocked in the
    collectives, not queued behind the busy ones (its gradient norm took rank 0 2.5 ms, priced
    21 at the world's α); so are the loss's sums in the tensor term."""
    topo = layout.topology
    ranks = topo.group_members(topo.tensor_axes, 0)
    copies = layout.world_size // len(ranks)  # the replicas and cp ranks, which work alike
    own = machine.at(machine.cores)
    world = [priced_blocks(cfg, layout, rank=r, machine=machine, **kw) for r in ranks]
    alone = [priced_blocks(cfg, layout, rank=r, machine=own, **kw) for r in ranks]

    def compute(f):
        return f["forward_compute"] + f["backward_compute"]

    def few_busy(values) -> bool:
        busy = [v for v in values if v > 1e-4 * max(values)]
        return 0 < len(busy) < len(values) and len(busy) * copies <= machine.cores

    common = min(compute(f) for f in world)
    extra = [compute(f) - common for f in world]
    out = {"own_core_compute": compute(alone[0]), "few_busy": few_busy(extra)}
    if out["few_busy"]:
        least = min(compute(f) for f in alone)
        out["compute"] = common + max(compute(f) - least for f in alone)
    else:
        out["compute"] = sum(compute(f) for f in world) / len(ranks)
    out["tensor"] = world[0]["tensor"]
    if out["few_busy"]:  # the loss's sums, which the busy ranks reach last (the others wait in them), as
        # the Trainer's one-number all-reduces: gpt2-small's tp 8 with 4 sub-grids sums one number over
        # its 8 ranks, priced 22.7 ms at the world's α
        out["tensor"] += max(f["tensor_loss"] for f in alone) - world[0]["tensor_loss"]
    for key in ("update", "data"):
        if few_busy([f[key] for f in world]):
            out[key] = max(f[key] for f in alone)
        else:
            out[key] = sum(f[key] for f in world) / len(ranks) if key == "update" else world[0][key]
    return out


def _shared_cores(cfg, stage: Layout, lay: Layout, *, m: int, v: int, machine: Machine, batch: int,
                  **kw) -> tuple[float, float]:
    """(compute, bubble) of a layout whose ranks outnumber the cores they share: a rank that waits
    (a pipeline's stage, a sub-grid without common work) leaves its core to the busy ones, so the
    step's compute is a rank's mean work (each micro-batch through its share of the blocks, and of
    the first and last parts; the mean over the tensor group's ranks) at the rates of every rank
    sharing the cores (the world's calibration), unless the schedule's critical path (the slowest
    stage's m v chunks and one of every other stage's, each with the end parts it holds) at the
    rates of a rank with a core of its own is longer: the difference is the bubble."""
    def block_and_parts(at: Machine, mean: bool, parts=None) -> tuple[float, float]:
        one, two = (_rank_mean(cfg, stage, blocks=k, batch=batch, machine=at, topology=lay.topology, mean=mean,
                               parts=parts, **kw)["compute"] for k in (1, 2))
        return two - one, 2 * one - two

    per_block, parts = block_and_parts(machine.at(lay.world_size), mean=True)
    shared = m * (cfg.n_layers * per_block + parts) / lay.pp
    # the critical path: the slowest stage's m v chunks and one chunk of every other stage
    kinds = _stage_parts(cfg, lay)
    own = {parts: block_and_parts(machine.at(machine.cores), mean=False, parts=parts) for parts, _ in set(kinds)}
    chunks = sorted((blocks * own[parts][0] + own[parts][1]) / v for parts, blocks in kinds)
    critical = m * v * chunks[-1] + sum(chunks[:-1])
    return shared, max(0.0, critical - shared)


def trainer_scalar_seconds(lay: Layout, choice: Choice, machine: Machine) -> float:
    """Seconds of the one-number all-reduces a Trainer step adds to the model's: the gradient norm
    over the replica's ranks (and over dp x cp where ZeRO splits the rows), the loss's mean
    over dp (lattice.training.trainer: grad_norm, dp_mean). Each is its ring's latency steps."""
    here = machine.at(lay.world_size)
    topo = lay.topology
    groups = [tuple(a for a in topo.axis_names if a != MeshAxis.DP)]
    if lay.dp > 1:
        groups.append((MeshAxis.DP,))
    if choice.zero and lay.dp * lay.cp > 1:  # (lattice.parallel.zero: ZeroOptimizer.grad_norm)
        groups.append((MeshAxis.DP, MeshAxis.CP))
    seconds = 0.0
    for axes in groups:
        n = math.prod(topo.size(a) for a in axes)
        if n > 1:
            seconds += 2 * (n - 1) * here.link(spans_nodes(topo, axes), "all_reduce")[0]
    return seconds
