"""One mode measured inside a world of `lattice bench`: built, its loss checked against serial's,
one step metered (CommMeter against the cost model), saved activations and parameter bytes, then
its timed steps; and which modes (and option variants) apply to a model on p processes."""

from __future__ import annotations

import contextlib
import gc
import math
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from lattice import cost as costmodel
from lattice.bench.peers import PEERS, DTensorComm, peer_backward, peer_loss
from lattice.models import arch_of_config, build_model
from lattice.modes import REFERENCE_MODE, parallel_modes, peer_mode
from lattice.parallel.comm import CommMeter
from lattice.parallel.context import LatticeConfigError


def _local(t):
    """The plain tensor holding t's data: a DTensor's local shard, or the buffer of a collective's
    result that DTensor hands out before waiting on it (an AsyncCollectiveTensor, which has no
    storage of its own)."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    t = t._local_tensor if hasattr(t, "_local_tensor") else t
    return t.elem if isinstance(t, AsyncCollectiveTensor) else t


@contextlib.contextmanager
def most_weight_bytes_whole(model: nn.Module):
    """Under ZeRO-3 (lattice.parallel.zero3.ShardedWeights), the most weight bytes whole at once
    while the `with` body runs: the parameters' storage, and each gather in flight at its weights' bytes
    (not its buffer's rows rounded up), sampled as each gather starts and ends. Yields a list whose
    one item is the most so far (set it to 0 to count afresh, e.g. after the optimizer's setup)."""
    from lattice.parallel.zero3 import ShardedWeights

    most, start, finish = [0], ShardedWeights._start, ShardedWeights._finish

    def whole(self) -> None:
        flight = sum(piece.param.numel() * piece.param.element_size() for unit in self.units.values()
                     for b in unit if b.gathering is not None for piece in b.pieces)
        most[0] = max(most[0], flight + sum(p.untyped_storage().nbytes() for p in model.parameters()))

    ShardedWeights._start = lambda self, bucket, phase: (start(self, bucket, phase), whole(self))
    ShardedWeights._finish = lambda self, bucket, phase: (finish(self, bucket, phase), whole(self))
    try:
        yield most
    finally:
        ShardedWeights._start, ShardedWeights._finish = start, finish


def saved_activation_bytes(model: nn.Module, run) -> int:
    """Bytes of the distinct storages autograd saves for backward while `run()` executes,
    parameters (and views of them) excluded."""
    params = {_local(p).untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        s = _local(t).untyped_storage()
        if s.data_ptr() not in params:
            seen.setdefault(s.data_ptr(), s.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return sum(seen.values())


class _Births(TorchDispatchMode):
    """Every storage an operator's output brings into being, but `known` ones: a weak reference and
    its bytes, by its StorageImpl (which a weak reference keeps from being reused)."""

    def __init__(self, known: set[int]):
        super().__init__()
        self.known, self.born = known, {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and not t.is_meta:
                storage = _local(t).untyped_storage()
                if storage._cdata not in self.known and storage._cdata not in self.born:
                    self.born[storage._cdata] = (StorageWeakRef(storage), storage.nbytes())
        return out


def held_forward_bytes(model: nn.Module, run) -> int:
    """Bytes of the storages that `run()` brings into being and that outlive it, but what it
    returns and the model's parameters: what a forward leaves held for backward, by whatever holds
    it (autograd's saved tensors, activation checkpointing's inputs and kept outputs, a layout's
    buffers), told by weak references rather than by asking the holders."""
    births = _Births({_local(p).untyped_storage()._cdata for p in model.parameters()})
    gc.freeze()  # the objects from before the run are left out of the collection below (which is then quick)
    try:
        with births:
            out = run()
        gc.collect()  # what only a reference cycle of the run still holds is not held for backward
    finally:
        gc.unfreeze()
    returned = {_local(t).untyped_storage()._cdata for t in tree_leaves(out) if isinstance(t, torch.Tensor)}
    return sum(n for key, (ref, n) in births.born.items() if not ref.expired() and key not in returned)


class Prepared:
    """One mode built in this world: its step functions and what was measured before timing
    (loss check, one metered step, saved activations, parameter bytes)."""

    def __init__(self, label, mode, options, model, forward, backward, analytic, solo=False):
        self.label, self.mode, self.options, self.analytic, self.solo = label, mode, options, analytic, solo
        self.forward, self.backward, self.opt = forward, backward, AdamW(model.parameters())
        self.times = {"forward": [], "backward": [], "step": []}
        self.info: dict = {}

    def step(self, record: bool) -> None:
        """One timed step, started together on every rank (a solo mode runs on rank 0 alone)."""
        dist.barrier()
        if self.solo and dist.get_rank() != 0:
            return
        t0 = time.perf_counter()
        loss = self.forward()
        t1 = time.perf_counter()
        self.backward(loss)
        t2 = time.perf_counter()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        t3 = time.perf_counter()
        if record:
            for k, v in (("forward", t1 - t0), ("backward", t2 - t1), ("step", t3 - t0)):
                self.times[k].append(v)


def prepare(label: str, mode: str, options: dict, cfg, sd, tokens, targets, ref_loss: float,
            args) -> Prepared | dict:
    """Collective over the world: build `mode` (or the peer, or serial on rank 0 alone), check its
    loss against serial's, meter one step, measure saved activations and parameters. Returns the
    prepared mode, or an error row."""
    from lattice.modes.layout import init, context

    p, rank = dist.get_world_size(), dist.get_rank()
    ckpt = args.activation_checkpointing
    meter_ctx = _Null
    if mode == "dtensor":
        from torch.distributed.device_mesh import init_device_mesh

        model = PEERS[arch_of_config(cfg).name](cfg, sd, init_device_mesh("cpu", (p,), mesh_dim_names=("tp",)))
        forward, backward, meter_ctx = (lambda: peer_loss(model, tokens, targets)), peer_backward, DTensorComm
        analytic = costmodel.estimate(cfg, peer_mode("dtensor"), batch=args.batch, tp=p, activation_checkpointing=ckpt)
    else:
        ctx = context(REFERENCE_MODE) if mode == REFERENCE_MODE else init(mode, tp=p, **options)
        model = build_model(cfg, ctx, activation_checkpointing=ckpt)
        model.load_full_state_dict(sd)
        forward = lambda: model(tokens, targets)  # noqa: E731
        backward = lambda loss: (loss.backward(), model.sync_grads())  # noqa: E731  (in-replica gradient sums)
        solo = mode == REFERENCE_MODE
        analytic = costmodel.estimate(cfg, mode, batch=args.batch, tp=1 if solo else p,
                                      activation_checkpointing=ckpt, rank=0 if solo else rank, **options)
    run = Prepared(label, mode, options, model, forward, backward, analytic, solo=mode == REFERENCE_MODE)
    if run.solo and rank != 0:
        return run
    loss = forward()
    loss_value = float(_full(loss).detach())
    if not run.solo and not math.isclose(loss_value, ref_loss, rel_tol=1e-4):  # the same on every rank
        return {"label": label, "error": f"loss {loss_value:.6f} != serial {ref_loss:.6f}; not timed"}
    backward(loss)
    run.opt.zero_grad(set_to_none=True)
    meter = CommMeter()
    with meter, meter_ctx(meter):  # one whole step: forward and backward
        backward(forward())
    run.opt.zero_grad(set_to_none=True)
    run.info = {"loss": loss_value, "comm": meter.summary(), "act": saved_activation_bytes(model, forward),
                "params": sum(_local(q).numel() * _local(q).element_size() for q in model.parameters())}
    return run


def report_row(run: Prepared, everyone: list[dict]) -> dict:
    """Rank 0's row from every rank's timings and measurements of one prepared mode."""
    ranks = everyone[:1] if run.solo else everyone
    measured, analytic = ranks[0]["comm"], run.analytic
    elements = sum(v["elements"] for v in measured.values())
    return {"label": run.label, "mode": run.mode, "options": run.options, "loss": ranks[0]["loss"],
            **{k + "_s": v for k, v in _slowest_median([e["times"] for e in ranks]).items()},
            "comm_bytes": sum(v["bytes"] for v in measured.values()), "comm_bytes_analytic": analytic.bytes(),
            "comm_ratio": elements / analytic.elements() if analytic.elements() else 1.0,
            "comm_calls": sum(v["calls"] for v in measured.values()), "comm_calls_analytic": analytic.calls(),
            "comm_by_op_match": _keys_match(measured, analytic.summary()),
            "act_bytes": max(e["act"] for e in ranks), "act_bytes_analytic": analytic.memory["activations"],
            "param_bytes": max(e["params"] for e in ranks), "param_bytes_analytic": analytic.memory["parameters"],
            "flops_per_rank": analytic.flops["forward"] + analytic.flops["backward"]}


def _slowest_median(per_rank: list[dict[str, list[float]]]) -> dict[str, float]:
    """Median over steps of the slowest rank's time in each step."""
    return {k: statistics.median(max(r[k][i] for r in per_rank) for i in range(len(per_rank[0][k])))
            for k in per_rank[0]}


class AdamW:
    """torch's AdamW with foreach=True, as torchtitan builds it; the peer's plain (replicated) and
    DTensor parameters go to separate instances because foreach kernels cannot mix the two."""

    def __init__(self, params):
        groups: dict[bool, list] = {}
        for q in params:
            groups.setdefault(hasattr(q, "_local_tensor"), []).append(q)
        self.opts = [torch.optim.AdamW(g, lr=1e-4, foreach=True) for g in groups.values()]

    def step(self):
        for o in self.opts:
            o.step()

    def zero_grad(self, set_to_none=True):
        for o in self.opts:
            o.zero_grad(set_to_none=set_to_none)


class _Null:
    def __init__(self, meter=None):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _full(loss):
    return loss.full_tensor() if hasattr(loss, "full_tensor") else loss


def _keys_match(measured: dict, analytic: dict) -> bool:
    """Every (phase, op, group size) within 1% in elements, with no collective on one side only."""
    keys = set(measured) | set(analytic)
    for k in keys:
        a, b = measured.get(k, {}).get("elements", 0), analytic.get(k, {}).get("elements", 0)
        if abs(a - b) > 0.01 * max(a, b):
            return False
    return True


# ----------------------------------------------------------------------------- which modes apply

def variants() -> dict[str, tuple[str, dict]]:
    """Labels beyond the mode names: every mode with one option away from its default (a switch
    flipped, or another choice), e.g. "1d+sequence_parallel=True", "subgraph+common=subgrid"."""
    from lattice.modes import get_mode

    out = {}
    for mode in parallel_modes():
        for key, option in get_mode(mode).options.items():
            if option.type is bool:
                out[f"{mode}+{key}={not option.default}"] = (mode, {key: not option.default})
            for choice in option.choices or ():
                if choice != option.default:
                    out[f"{mode}+{key}={choice}"] = (mode, {key: choice})
    return out


def label_options(label: str) -> tuple[str, dict] | None:
    """(mode, options) of a --modes label: a mode name, a variant, or a mode with several of them
    joined ("3d+keep_gathered=True+vectors=replicated"); None for a label that names none."""
    named = variants()
    if label in named:
        return named[label]
    mode, *parts = label.split("+")
    if not parts or mode not in parallel_modes():
        return (label, {}) if label in (REFERENCE_MODE, "dtensor", *parallel_modes()) else None
    options = {}
    for part in parts:
        if f"{mode}+{part}" not in named:
            return None
        options.update(named[f"{mode}+{part}"][1])
    return mode, options


def applicable(cfg, batch: int, p: int, wanted: list[str] | None) -> tuple[list, list]:
    """([(label, mode, options)], [(label, why not)]) for p processes: every registered mode (and
    the peer) whose layout fits p ranks and whose size checks pass this model and batch."""
    from lattice.modes import get_mode
    from lattice.modes.layout import context

    labels = wanted or parallel_modes() + ["dtensor"]
    if p == 1:
        return ([(REFERENCE_MODE, REFERENCE_MODE, {})] if not wanted or REFERENCE_MODE in wanted else []), []
    runs, skipped = [], []
    for label in labels:
        mode, options = label_options(label)
        if mode == REFERENCE_MODE:
            continue
        if mode == "dtensor":
            if arch_of_config(cfg).name not in PEERS:
                skipped.append((label, f"the DTensor peer is a GPT-2 or a Llama; {arch_of_config(cfg).name} has none"))
                continue
            counts = [("vocab_size", cfg.vocab_size), *cfg.head_counts().items()]
            why = [f"{what} = {size} is not divisible by p = {p}" for what, size in counts if size % p]
            if why:
                skipped.append((label, "; ".join(why)))
            else:
                runs.append((label, mode, options))
            continue
        options = {**get_mode(mode).fit_options(cfg, p), **options}
        try:
            ctx = context(mode, tp=p, **options)
            get_mode(mode).check_model(cfg, ctx)
            get_mode(mode).check_batch(ctx, torch.zeros(batch, cfg.seq_len, dtype=torch.int64))
            costmodel.estimate(cfg, mode, batch=batch, tp=p, **options)
        except LatticeConfigError as e:
            skipped.append((label, str(e)))
            continue
        runs.append((label, mode, options))
    return runs, skipped
