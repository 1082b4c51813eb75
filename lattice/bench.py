"""`lattice bench`: every applicable mode, and PyTorch's own tensor parallelism as the peer, on the
same model, weights and batch, one after another in one set of processes.

    lattice bench --nproc 4                      # one size: table, JSON and PNG
    lattice bench --sweep all                    # weak + strong scaling over p = 1, 2, 4, 8, 9,
                                                 # calibration and the 16/36/64-GPU projection
    python -m lattice.bench ...                  # the same without the CLI

Per mode it reports the median forward, backward and step (forward + backward + AdamW update)
time, the slowest rank's per step; the communication CommMeter measured in one step next to
`lattice.cost`'s figure; the bytes autograd saved for backward and the parameter bytes (the
largest on any rank). The modes are built first and their timed steps interleaved round-robin,
so that the load of a shared machine falls on all of them alike. A rank is one process with one
thread; serial runs on rank 0 alone.

The peer ("dtensor") is a plain-PyTorch GPT-2 (nn.Linear, separate q/k/v) loaded with lattice's
serial weights and parallelised over a 1-D DeviceMesh as torchtitan does without sequence
parallelism: q, k, v and fc ColwiseParallel, both output projections RowwiseParallel, the
attention input prepared once as Replicate (one gradient all-reduce for q, k, v together), the
token embedding RowwiseParallel (vocabulary-split, output all-reduced) and the tied LM head
ColwiseParallel with `loss_parallel`, so neither side ever gathers logits; wpe and LayerNorms are
replicated. For `--arch llama` the peer is transformers' own LlamaForCausalLM under torchtitan's
Llama plan (q/k/v and gate/up ColwiseParallel behind one Replicate input each, o_proj and
down_proj RowwiseParallel, the token table RowwiseParallel and the untied LM head
ColwiseParallel into `loss_parallel`). Its collectives are counted by a dispatch mode in
CommMeter's units.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import platform
import socket
import statistics
import sys
import time
import traceback
from datetime import datetime, timedelta, timezone
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from lattice import cost as costmodel
from lattice.comm import CommMeter, CommRecord
from lattice.context import LatticeConfigError
from lattice.models import DEFAULT_ARCH, arch_of_config, available_archs, build_model, get_arch
from lattice.models.gpt2 import GPTConfig
from lattice.modes import REFERENCE_MODE, parallel_modes, peer_mode

# ----------------------------------------------------------------------------- the DTensor peer


class _PeerAttention(nn.Module):
    def __init__(self, h, n):
        super().__init__()
        self.head_size = h // n
        self.q, self.k, self.v, self.proj = (nn.Linear(h, h) for _ in range(4))

    def forward(self, x):  # (B, T, h) replicated -> (B, T, h) replicated
        B, T, _ = x.shape
        q, k, v = (lin(x).view(B, T, -1, self.head_size).transpose(1, 2) for lin in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh_local, T, hs)
        return self.proj(y.transpose(1, 2).reshape(B, T, -1))


class _PeerBlock(nn.Module):
    def __init__(self, h, n):
        super().__init__()
        self.ln_1, self.attn, self.ln_2 = nn.LayerNorm(h), _PeerAttention(h, n), nn.LayerNorm(h)
        self.fc, self.fc_proj = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.fc_proj(F.gelu(self.fc(self.ln_2(x)), approximate="tanh"))


class PeerGPT(nn.Module):
    """GPT-2 in plain PyTorch modules, the architecture of lattice.GPT (bias and tied embeddings)."""

    def __init__(self, cfg):
        super().__init__()
        h = cfg.d_model
        self.wte, self.wpe = nn.Embedding(cfg.vocab_size, h), nn.Parameter(torch.zeros(cfg.seq_len, h))
        self.blocks = nn.ModuleList(_PeerBlock(h, cfg.n_heads) for _ in range(cfg.n_layers))
        self.ln_f, self.head = nn.LayerNorm(h), nn.Linear(h, cfg.vocab_size, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, tokens):  # -> logits (B, T, V), a DTensor split over V once parallelised
        x = self.wte(tokens) + self.wpe[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    @torch.no_grad()
    def load_lattice(self, sd: dict[str, torch.Tensor]) -> None:
        """lattice's full state dict: W[in, out] becomes nn.Linear's [out, in]; qkv splits in three."""
        own = {"wte.weight": sd["embed.wte"], "wpe": sd["embed.wpe"],
               "ln_f.weight": sd["ln_f.weight"], "ln_f.bias": sd["ln_f.bias"]}
        for i in range(len(self.blocks)):
            b = f"blocks.{i}."
            for ln in ("ln_1", "ln_2"):
                own[f"{b}{ln}.weight"], own[f"{b}{ln}.bias"] = sd[f"{b}{ln}.weight"], sd[f"{b}{ln}.bias"]
            for k, name in enumerate("qkv"):
                own[f"{b}attn.{name}.weight"] = sd[f"{b}attn.qkv.weight"][:, k].t()
                own[f"{b}attn.{name}.bias"] = sd[f"{b}attn.qkv.bias"][k]
            for ours, theirs in (("attn.proj", "attn.proj"), ("fc", "mlp.fc"), ("fc_proj", "mlp.proj")):
                own[f"{b}{ours}.weight"] = sd[f"{b}{theirs}.weight"].t()
                own[f"{b}{ours}.bias"] = sd[f"{b}{theirs}.bias"]
        self.load_state_dict({**own, "head.weight": own["wte.weight"]})


def parallelize_peer(model: PeerGPT, mesh) -> PeerGPT:
    """torchtitan's tensor-parallel plan on a 1-D mesh, without sequence parallelism."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   parallelize_module)

    plan = {"wte": RowwiseParallel(input_layouts=Replicate()),
            "head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}
    for i in range(len(model.blocks)):
        b = f"blocks.{i}."
        plan[b + "attn"] = PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),))
        for name in ("attn.q", "attn.k", "attn.v", "fc"):
            plan[b + name] = ColwiseParallel()
        for name in ("attn.proj", "fc_proj"):
            plan[b + name] = RowwiseParallel()
    parallelize_module(model, mesh, plan)
    model.head.weight = model.wte.weight  # re-tie: both are now the same vocabulary-split DTensor
    return model


class PeerLlama(nn.Module):
    """transformers' own LlamaForCausalLM (sdpa attention) with lattice's serial weights, returning
    logits like PeerGPT."""

    def __init__(self, cfg, sd: dict[str, torch.Tensor]):
        super().__init__()
        from lattice import hf

        family = arch_of_config(cfg)
        self.hf = hf.hf_model(family, cfg, sd).train()

    def forward(self, tokens):
        return self.hf(input_ids=tokens, use_cache=False).logits


def parallelize_peer_llama(model: PeerLlama, mesh) -> PeerLlama:
    """torchtitan's Llama plan on a 1-D mesh, without sequence parallelism: the token table
    RowwiseParallel, q/k/v and gate/up ColwiseParallel behind one Replicate input each
    (attention, MLP), o_proj and down_proj RowwiseParallel, the untied LM head ColwiseParallel
    into `loss_parallel`; RMSNorms and rotary tables replicated."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   parallelize_module)

    inner = model.hf.model
    if model.hf.config.tie_word_embeddings:
        raise LatticeConfigError("the DTensor Llama peer splits the LM head and the token table differently; "
                                 "bench an untied Llama (tie_embeddings=False)")
    plan = {"model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
            "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}
    for i in range(len(inner.layers)):
        b = f"model.layers.{i}."
        plan[b + "self_attn"] = PrepareModuleInput(input_kwarg_layouts={"hidden_states": Replicate()},
                                                   desired_input_kwarg_layouts={"hidden_states": Replicate()})
        plan[b + "mlp"] = PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),))
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            plan[b + name] = ColwiseParallel()
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            plan[b + name] = RowwiseParallel()
    parallelize_module(model.hf, mesh, plan)  # HF reshapes q/k/v with -1 heads: each rank sees its own
    return model


def _gpt_peer(cfg, sd, mesh) -> PeerGPT:
    model = PeerGPT(cfg)
    model.load_lattice(sd)
    return parallelize_peer(model, mesh)


#: family name -> (cfg, lattice full state dict, 1-D mesh) -> its parallelised DTensor peer
PEERS = {"gpt2": _gpt_peer, "llama": lambda cfg, sd, mesh: parallelize_peer_llama(PeerLlama(cfg, sd), mesh)}


def peer_loss(model, tokens, targets):
    from torch.distributed.tensor.parallel import loss_parallel

    with loss_parallel():
        return F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())


def peer_backward(loss):
    from torch.distributed.tensor.parallel import loss_parallel

    with loss_parallel():
        loss.backward()


class DTensorComm(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the collectives DTensor issues into a CommMeter, in its units. DTensor operations are
    declined (NotImplemented) so that DTensor desugars them first and their collectives come back
    through this mode, as torch's CommDebugMode does."""

    OPS = {"all_reduce": "all_reduce", "all_gather_into_tensor": "all_gather",
           "reduce_scatter_tensor": "reduce_scatter", "all_to_all_single": "all_to_all",
           "broadcast": "broadcast"}

    def __init__(self, meter: CommMeter):
        super().__init__()
        self.meter = meter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor

        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        ns, name = func._overloadpacket._qualified_op_name.split("::")
        if ns == "_c10d_functional" and name in self.OPS:
            x = args[0]
            # the group size is an argument of all-gather and reduce-scatter; the peer's mesh is the world
            group = {"all_gather_into_tensor": 1, "reduce_scatter_tensor": 2}.get(name)
            n = int(args[group]) if group is not None else dist.get_world_size()
            elements = x.numel() * (n if name == "all_gather_into_tensor" else 1)
            phase = "backward" if torch._C._current_graph_task_id() != -1 else "forward"
            self.meter.records.append(CommRecord(self.OPS[name], n, elements, elements * x.element_size(), phase))
        return out


# ----------------------------------------------------------------------------- measuring one mode


def _local(t):
    """The plain tensor holding t's data: a DTensor's local shard, or the buffer of a collective's
    result that DTensor hands out before waiting on it (an AsyncCollectiveTensor, which has no
    storage of its own)."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    t = t._local_tensor if hasattr(t, "_local_tensor") else t
    return t.elem if isinstance(t, AsyncCollectiveTensor) else t


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
    import lattice

    p, rank = dist.get_world_size(), dist.get_rank()
    ckpt = args.activation_checkpointing
    meter_ctx = _Null
    if mode == "dtensor":
        from torch.distributed.device_mesh import init_device_mesh

        model = PEERS[arch_of_config(cfg).name](cfg, sd, init_device_mesh("cpu", (p,), mesh_dim_names=("tp",)))
        forward, backward, meter_ctx = (lambda: peer_loss(model, tokens, targets)), peer_backward, DTensorComm
        analytic = costmodel.estimate(cfg, peer_mode("dtensor"), batch=args.batch, tp=p, activation_checkpointing=ckpt)
    else:
        ctx = lattice.plan(REFERENCE_MODE) if mode == REFERENCE_MODE else lattice.init(mode, tp=p, **options)
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


def applicable(cfg, batch: int, p: int, wanted: list[str] | None) -> tuple[list, list]:
    """([(label, mode, options)], [(label, why not)]) for p processes: every registered mode (and
    the peer) whose layout fits p ranks and whose size checks pass this model and batch."""
    import lattice
    from lattice.modes import get_mode

    labels = wanted or parallel_modes() + ["dtensor"]
    if p == 1:
        return ([(REFERENCE_MODE, REFERENCE_MODE, {})] if not wanted or REFERENCE_MODE in wanted else []), []
    runs, skipped = [], []
    named = variants()
    for label in labels:
        mode, options = named.get(label, (label, {}))
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
            mode_obj = get_mode(mode)(cfg, lattice.plan(mode, tp=p, **options))
            mode_obj.check_batch(torch.zeros(batch, cfg.seq_len, dtype=torch.int64))
            costmodel.estimate(cfg, mode, batch=batch, tp=p, **options)
        except LatticeConfigError as e:
            skipped.append((label, str(e)))
            continue
        runs.append((label, mode, options))
    return runs, skipped


# ----------------------------------------------------------------------------- calibration


def calibrate(cfg, batch: int, reps: int = 5) -> costmodel.Machine:
    """Fit the machine of `lattice.cost.Machine` here, every rank of the world running the
    micro-benchmarks at once (so sharing the cores is part of the fit): matrix products, causal
    attention and elementwise operators (LayerNorm, GELU, bias add, cross-entropy), each forward and
    backward at this world's per-rank sizes; α and β from collectives; AdamW's update."""
    import numpy as np

    p = dist.get_world_size()
    h, M, T, V = cfg.d_model, batch * cfg.seq_len, cfg.seq_len, cfg.vocab_size

    def timed(fn, n=reps):
        fn()
        out = []
        for _ in range(n):
            dist.barrier()
            t = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t)
        return statistics.median(out)

    def fwd_bwd(fn, *inputs):  # one forward and backward of fn; the work counts 1 + 2
        inputs = [x.detach().requires_grad_() for x in inputs]
        return lambda: torch.autograd.backward(fn(*inputs).sum(), inputs=inputs)

    # matrix products of the per-rank shapes a p-way split of one layer gives
    shapes = [(M, h, max(1, 3 * h // p)), (M, max(1, h // p), h), (M, h, max(1, 4 * h // p)), (M, max(1, 4 * h // p), h)]
    mats = [(torch.randn(m, k), torch.randn(k, n)) for m, k, n in shapes]
    products = [fwd_bwd(torch.mm, a, b) for a, b in mats]
    flop_rate = 3 * sum(2 * m * k * n for m, k, n in shapes) / timed(lambda: [f() for f in products])
    # causal attention of this rank's share of the heads: score elements per second (forward)
    heads = max(1, batch * cfg.n_heads // p)
    q, k, v = (torch.randn(1, heads, T, cfg.head_size) for _ in range(3))
    attn = fwd_bwd(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), q, k, v)
    attn_rate = 3 * heads * T * T / timed(attn)
    # elementwise operators on a rank's share of the activations and of the logits
    x, bias, logits = torch.randn(M, max(1, h // p)), torch.randn(max(1, h // p)), torch.randn(M, max(1, V // p))
    targets = torch.randint(0, logits.shape[1], (M,))
    ew = fwd_bwd(lambda x, b, z: F.layer_norm(x, x.shape[-1:]).sum() + F.gelu(x, approximate="tanh").sum()
                 + (x + b).sum() + F.cross_entropy(z, targets), x, bias, logits)
    elem_rate = 3 * (3 * x.numel() + 2 * logits.numel()) / timed(ew)
    # collectives over the world, each between two chunks of compute as in a model step (on a
    # shared CPU the ranks must all be scheduled to meet): t = steps(op, p)·α + wire(op, p)·bytes·β
    # by least squares on the time a loop gains from its collectives
    rows, ys = [], []
    if p > 1:
        chunk_a, chunk_b = mats[0]  # about the compute between two collectives of a step

        def loop(coll, n=8):
            for _ in range(n):
                chunk_a @ chunk_b
                if coll is not None:
                    coll()

        for numel in (16, 4096, 65536):
            x = torch.randn(numel)
            for op, fn in (("all_reduce", lambda: dist.all_reduce(x)), ("broadcast", lambda: dist.broadcast(x, 0))):
                rows.append([costmodel.message_steps(op, p), costmodel.wire_factor(op, p) * numel * 4])
                ys.append(max(timed(lambda: loop(fn)) - timed(lambda: loop(None)), 1e-6) / 8)
        (alpha, beta), *_ = np.linalg.lstsq(np.array(rows), np.array(ys), rcond=None)
        alpha, beta = max(float(alpha), 1e-7), max(float(beta), 1e-12)
    else:
        alpha, beta = 1e-5, 1e-10
    # AdamW's update: a per-tensor cost (many small tensors) and a bandwidth (one large one)
    def adam(tensors):
        params = [nn.Parameter(t) for t in tensors]
        for q in params:
            q.grad = torch.randn_like(q)
        return torch.optim.AdamW(params, lr=1e-4, foreach=True).step

    per_tensor = timed(adam([torch.randn(8) for _ in range(32)])) / 32
    big = max(1, 12 * h * h * cfg.n_layers // p)
    mem_bw = 7 * big * 4 / max(timed(adam([torch.randn(big)])) - per_tensor, 1e-9)
    # the slowest rank sets the pace
    rates = torch.tensor([flop_rate, elem_rate, attn_rate, mem_bw], dtype=torch.float64)
    dist.all_reduce(rates, op=dist.ReduceOp.MIN)
    costs = torch.tensor([alpha, beta, per_tensor], dtype=torch.float64)
    dist.all_reduce(costs, op=dist.ReduceOp.MAX)
    alpha, beta, per_tensor = costs.tolist()
    return costmodel.Machine(f"this machine, {p} processes", flop_rate=float(rates[0]), alpha_intra=alpha,
                             beta_intra=beta, alpha_inter=alpha, beta_inter=beta, ranks_per_node=p,
                             elem_rate=float(rates[1]), attn_rate=float(rates[2]), update_per_tensor=per_tensor,
                             mem_bandwidth=float(rates[3]))


# ----------------------------------------------------------------------------- one world


def _world(payload: dict):
    """Runs in every process of a world: prepare every mode, then time them with their steps
    interleaved round-robin (the order rotating each round), so that a change in the machine's
    load falls on all of them alike; calibrate just before and after the timing."""
    import lattice

    cfg = get_arch(payload["arch"]).config_class(**payload["cfg"])
    args = argparse.Namespace(**payload["args"])
    gen = torch.Generator().manual_seed(args.seed)
    tokens = torch.randint(0, cfg.vocab_size, (args.batch, cfg.seq_len), generator=gen)
    targets = torch.randint(0, cfg.vocab_size, (args.batch, cfg.seq_len), generator=gen)
    serial = build_model(cfg, lattice.plan(REFERENCE_MODE))
    sd = serial.full_state_dict()
    with torch.no_grad():
        ref_loss = float(serial(tokens, targets))
    del serial
    jobs = ([(REFERENCE_MODE, REFERENCE_MODE, {})] if payload["reference"] else []) + list(payload["runs"])
    prepared = [prepare(label, mode, options, cfg, sd, tokens, targets, ref_loss, args) for label, mode, options in jobs]
    runs = [r for r in prepared if isinstance(r, Prepared)]
    machines = [calibrate(cfg, args.batch)] if args.calibrate else []
    for i in range(args.warmup + args.steps):
        for k in range(len(runs)):
            runs[(i + k) % len(runs)].step(record=i >= args.warmup)
    if args.calibrate:
        machines.append(calibrate(cfg, args.batch))
    gathered = []
    for run in runs:
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, {"times": run.times, **run.info})
        gathered.append(everyone)
    if dist.get_rank() != 0:
        return None
    machine = _mean_machine(machines) if machines else None
    rows = []
    for item in prepared:
        if not isinstance(item, Prepared):
            rows.append(item)
            continue
        row = report_row(item, gathered[runs.index(item)])
        # serial runs alone on rank 0 of a larger world, not under the calibration's sharing
        if machine is not None and (item.mode != REFERENCE_MODE or dist.get_world_size() == 1):
            row.update({k + "_pred_s": v for k, v in item.analytic.time(machine).items()})
        rows.append(row)
    return {"p": dist.get_world_size(), "cfg": payload["cfg"], "batch": args.batch, "rows": rows,
            "skipped": payload["skipped"], "calibration": None if machine is None else vars(machine),
            "calibrations": [vars(m) for m in machines]}


def _mean_machine(machines: list[costmodel.Machine]) -> costmodel.Machine:
    """Geometric mean of the calibrations before and after the timed steps."""
    fields = {k: v for k, v in vars(machines[0]).items()}
    for k, v in fields.items():
        if isinstance(v, float):
            fields[k] = math.prod(vars(m)[k] for m in machines) ** (1 / len(machines))
    return costmodel.Machine(**fields)


def _entry(rank, world, port, payload, queue, threads):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(threads)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=payload["timeout"]))
        out = _world(payload)
        if rank == 0:
            queue.put(("ok", out))
        dist.destroy_process_group()
    except BaseException:  # report any failure, with its traceback, to the parent
        queue.put(("error", rank, traceback.format_exc()))
        raise


def run_world(p: int, payload: dict) -> dict:
    """Start p gloo processes on this machine, run the benchmark in them, return rank 0's result."""
    import multiprocessing as mp
    import queue as queue_mod

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # one thread per rank: a rank is one core, the CPU stand-in for one device
    procs = [ctx.Process(target=_entry, args=(r, p, port, payload, results, 1), daemon=True) for r in range(p)]
    for proc in procs:
        proc.start()
    try:
        msg = results.get(timeout=payload["timeout"])
    except queue_mod.Empty:
        msg = ("error", "?", f"no result within {payload['timeout']} s")
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
    if msg[0] != "ok":
        raise RuntimeError(f"benchmark on {p} processes failed on rank {msg[1]}:\n{msg[2]}")
    return msg[1]


def bench_size(cfg, p: int, batch: int, args, *, serial: bool) -> dict:
    """Every applicable mode (and serial on rank 0 if asked) on p processes."""
    runs, skipped = applicable(cfg, batch, p, args.modes)
    if p == 1:
        runs, serial = [], True
    payload = {"arch": arch_of_config(cfg).name, "cfg": cfg.to_dict(), "runs": runs, "skipped": skipped, "reference": serial, "timeout": args.timeout,
               "args": {"batch": batch, **{k: getattr(args, k) for k in ("steps", "warmup", "seed", "calibrate",
                                                                         "activation_checkpointing")}}}
    return run_world(p, payload)


# ----------------------------------------------------------------------------- sweeps and projection

# Scaled down from Optimus Tables 2-3 and the 3D paper's Tables 1-2 (s = 512, 24 layers there):
# strong scaling keeps the problem; weak scaling grows h with √p (parameters per rank fixed) and
# the batch with √p, and keeps 12-wide heads so that the head count grows with the model.
STRONG = dict(vocab_size=1024, seq_len=64, d_model=192, n_heads=24, n_layers=2)
STRONG_BATCH = 12
WEAK = {1: (96, 8, 4), 2: (144, 12, 6), 4: (192, 16, 8), 8: (288, 24, 12), 9: (288, 24, 12)}  # p: (h, n, B)
SIZES = (1, 2, 4, 8, 9)
PROJECTION_SIZES = (4, 8, 16, 27, 36, 64)


def weak_config(p: int) -> tuple[GPTConfig, int]:
    h, n, batch = WEAK[p]
    return GPTConfig(vocab_size=1024, seq_len=64, d_model=h, n_heads=n, n_layers=2), batch


def projection(machine: costmodel.Machine = costmodel.PAPER_CLUSTER) -> dict:
    """The cost model's step time per sequence (the 3D paper's Eq. 6) of the Transformer stem, as
    both papers measure it, at their scale: strong scaling as Optimus Table 3 (b = 24, h = 3072),
    weak as Table 2 (h = 1024·√p, b = 24·√p), s = 512, 24 layers, fp16 activations, activation
    checkpointing, every mode's topology-aware placement (bunched in 2D), 4 GPUs per node."""
    from lattice.modes import get_mode

    out = {"machine": machine.describe(), "strong": {}, "weak": {}}
    for family in ("strong", "weak"):
        for p in PROJECTION_SIZES:
            # weak: h = 1024·√p in 64-wide heads, b = 24·√p
            h, b = (3072, 24) if family == "strong" else (64 * round(16 * p ** 0.5), round(24 * p ** 0.5))
            cfg = GPTConfig(vocab_size=50304, seq_len=512, d_model=h, n_heads=h // 64, n_layers=24)
            row = {}
            for mode in parallel_modes():
                try:
                    c = costmodel.estimate(cfg, mode, batch=b, tp=p, dtype=torch.float16,
                                           activation_checkpointing=True, ranks_per_node=machine.ranks_per_node,
                                           placement="topology", **get_mode(mode).fit_options(cfg, p))
                except LatticeConfigError:
                    continue
                t = c.time(machine, stem=True)
                row[mode] = {"step_per_seq_s": t["step"] / b, "comm_s": t["forward_comm"] + t["backward_comm"],
                             "compute_s": t["forward_compute"] + t["backward_compute"]}
            out[family][p] = {"h": h, "b": b, **row}
    return out


def crossovers(proj: dict) -> list[str]:
    """Where a layout that is slower at the smallest shared size first beats another one."""
    notes = []
    for family in ("strong", "weak"):
        modes = sorted({m for r in proj[family].values() for m in r if isinstance(r[m], dict)})
        for hi, lo in itertools.permutations(modes, 2):
            both = [(p, r[hi]["step_per_seq_s"], r[lo]["step_per_seq_s"]) for p, r in proj[family].items()
                    if hi in r and lo in r]
            if not both or both[0][1] < both[0][2]:
                continue  # hi is not the slower one where they first meet
            wins = [p for p, a, b in both if a < b]
            where = f"first at p = {wins[0]}" if wins else "not within p <= 64"
            notes.append(f"{family}: {hi} faster than {lo} {where} (compared at p = {[p for p, _, _ in both]})")
    return notes


# ----------------------------------------------------------------------------- reporting


def machine_info() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version(),
            "platform": platform.platform(), "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "backend": "gloo (CPU)"}


def _mb(x):
    return f"{x / 2 ** 20:.2f}"


def format_table(result: dict) -> str:
    rows = result["rows"]
    serial_act = next((r["act_bytes"] for r in rows if r["mode"] == REFERENCE_MODE), None)
    p = result["p"]
    head = (f"{'mode':<14}{'fwd ms':>8}{'bwd ms':>8}{'step ms':>9}{'pred ms':>9}{'comm MB':>9}{'model MB':>9}"
            f"{'ratio':>7}{'act MB/rk':>10}{'act·p/ser':>10}{'param MB/rk':>12}")
    lines = [head, "-" * len(head)]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['label']:<14}{r['error']}")
            continue
        rel = "" if serial_act is None else f"{r['act_bytes'] * (p if r['mode'] != REFERENCE_MODE else 1) / serial_act:.3f}"
        pred = f"{r['step_pred_s'] * 1e3:.1f}" if "step_pred_s" in r else "-"
        lines.append(f"{r['label']:<14}{r['forward_s'] * 1e3:8.1f}{r['backward_s'] * 1e3:8.1f}{r['step_s'] * 1e3:9.1f}"
                     f"{pred:>9}{_mb(r['comm_bytes']):>9}{_mb(r['comm_bytes_analytic']):>9}{r['comm_ratio']:7.3f}"
                     f"{_mb(r['act_bytes']):>10}{rel:>10}{_mb(r['param_bytes']):>12}")
    for label, why in result.get("skipped", []):
        lines.append(f"{label:<14}skipped: {why}")
    ratio = _peer_ratio(result)
    if ratio is not None:
        lines.append(f"{peer_mode('dtensor')} step / dtensor step = {ratio:.3f}")
    return "\n".join(lines)


def _peer_ratio(result: dict) -> float | None:
    by = {r["label"]: r for r in result["rows"] if "error" not in r}
    mine = peer_mode("dtensor")
    if mine in by and "dtensor" in by:
        return by[mine]["step_s"] / by["dtensor"]["step_s"]
    return None


def prediction_errors(results: list[dict]) -> list[float]:
    return [(r["step_pred_s"] - r["step_s"]) / r["step_s"] for res in results for r in res["rows"]
            if "step_pred_s" in r and "error" not in r and r["mode"] != "dtensor"]


def plot_single(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["rows"] if "error" not in r]
    labels = [r["label"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    x = range(len(rows))
    axes[0].bar(x, [r["forward_s"] * 1e3 for r in rows], label="forward")
    axes[0].bar(x, [r["backward_s"] * 1e3 for r in rows], bottom=[r["forward_s"] * 1e3 for r in rows], label="backward")
    axes[0].bar(x, [(r["step_s"] - r["forward_s"] - r["backward_s"]) * 1e3 for r in rows],
                bottom=[(r["forward_s"] + r["backward_s"]) * 1e3 for r in rows], label="update")
    axes[0].set_ylabel("median step (ms)")
    axes[1].bar([i - 0.2 for i in x], [r["comm_bytes"] / 2 ** 20 for r in rows], 0.4, label="measured")
    axes[1].bar([i + 0.2 for i in x], [r["comm_bytes_analytic"] / 2 ** 20 for r in rows], 0.4, label="cost model")
    axes[1].set_ylabel("communication per rank per step (MiB)")
    axes[2].bar([i - 0.2 for i in x], [r["act_bytes"] / 2 ** 20 for r in rows], 0.4, label="saved activations")
    axes[2].bar([i + 0.2 for i in x], [r["param_bytes"] / 2 ** 20 for r in rows], 0.4, label="parameters")
    axes[2].set_ylabel("MiB per rank")
    for ax in axes:
        ax.set_xticks(list(x), labels, rotation=20)
        ax.legend()
    fig.suptitle(f"lattice bench, p = {result['p']}: {result['cfg']['d_model']}-wide, {result['cfg']['n_layers']} "
                 f"layers, batch {result['batch']}x{result['cfg']['seq_len']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_sweeps(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(20, 4.5))
    for ax, family in zip(axes[:2], ("strong", "weak")):
        series: dict[str, list] = {}
        for res in report.get(family, []):
            for r in res["rows"]:
                if "error" not in r:
                    series.setdefault(r["label"], []).append((res["p"], r["step_s"] * 1e3, r.get("step_pred_s")))
        for label, pts in series.items():
            line, = ax.plot([p for p, _, _ in pts], [t for _, t, _ in pts], "o-", label=label)
            pred = [(p, t * 1e3) for p, _, t in pts if t is not None]
            if pred:
                ax.plot([p for p, _ in pred], [t for _, t in pred], "x--", color=line.get_color(), alpha=0.6)
        ax.set_xlabel("processes p")
        ax.set_ylabel("median step (ms); x-- calibrated model")
        ax.set_title(f"{family} scaling, measured on this machine")
        ax.legend()
    for ax, family in zip(axes[2:], ("strong", "weak")):
        proj = report["projection"][family]
        for mode in sorted({m for r in proj.values() for m in r if isinstance(r[m], dict)}):
            pts = [(int(p), r[mode]["step_per_seq_s"] * 1e3) for p, r in proj.items() if mode in r]
            ax.plot([p for p, _ in pts], [t for _, t in pts], "o-", label=mode)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("GPUs")
        ax.set_ylabel("model step time per sequence (ms)")
        ax.set_title(f"projection, {family} scaling")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------- command line


def add_bench_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nproc", type=int, default=4, help="processes (ranks per model replica), default 4")
    p.add_argument("--arch", default=DEFAULT_ARCH, choices=available_archs(), help=f"model family (default {DEFAULT_ARCH})")
    p.add_argument("--model", default=None, metavar="PRESET",
                   help="size preset of the family (default its default preset, e.g. small for gpt2)")
    p.add_argument("--vocab-size", type=int, default=2048)
    p.add_argument("--seq-len", type=int, default=None, help="sequence length (default: the preset's)")
    p.add_argument("--n-layers", type=int, default=None)
    p.add_argument("--d-model", type=int, default=None, help="width (default: the preset's)")
    p.add_argument("--n-heads", type=int, default=None, help="attention heads (default: the preset's)")
    p.add_argument("--batch", type=int, default=8, help="sequences per step (default 8)")
    p.add_argument("--modes", default=None,
                   help="comma-separated, from: " + ", ".join([REFERENCE_MODE, *parallel_modes(), *variants(), "dtensor"])
                        + " (default: every registered mode and dtensor)")
    p.add_argument("--steps", type=int, default=8, help="timed steps per mode (median reported)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--activation-checkpointing", action="store_true")
    p.add_argument("--no-serial", action="store_true", help="skip the serial reference on rank 0")
    p.add_argument("--calibrate", action="store_true", help="fit α, β, F here and predict step times")
    p.add_argument("--sweep", choices=("strong", "weak", "all"), default=None,
                   help="scaling sweeps over --sizes (with calibration and the projection)")
    p.add_argument("--sizes", default=",".join(map(str, SIZES)), help="process counts of the sweeps")
    p.add_argument("--out", default="benchmarks/results", help="directory for the JSON and PNG")
    p.add_argument("--name", default=None, help="file name stem (default bench_p<N> or sweeps)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=900, help="seconds per process count")


def check_args(args) -> None:
    """One-line refusals of what cannot run, before any process starts."""
    known = {REFERENCE_MODE, *parallel_modes(), "dtensor", *variants()}
    unknown = [m for m in args.modes or [] if m not in known]
    if unknown:
        raise LatticeConfigError(f"unknown mode(s) {unknown} in --modes; choose from {', '.join(sorted(known))}")
    if args.sweep and args.arch != "gpt2":
        raise LatticeConfigError(f"the sweeps scale the papers' GPT-2 shapes; drop --arch {args.arch} or --sweep")
    for name, least in (("nproc", 1), ("batch", 1), ("steps", 1), ("warmup", 0)):
        if getattr(args, name) < least:
            raise LatticeConfigError(f"--{name} must be at least {least}, got {getattr(args, name)}")
    sizes = [s for s in str(args.sizes).split(",") if s.strip()]
    if args.sweep and not all(s.strip().isdigit() and int(s) in WEAK for s in sizes):
        raise LatticeConfigError(f"--sizes must be a comma list drawn from {sorted(WEAK)}, got {args.sizes!r}")


def run_bench(args) -> int:
    args.modes = [m.strip() for m in args.modes.split(",")] if args.modes else None
    try:
        check_args(args)
    except LatticeConfigError as e:
        print(f"lattice bench: {e}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {"machine": machine_info(), "command": "lattice bench " + " ".join(sys.argv[2:] if
                                                                                 sys.argv[1:2] == ["bench"] else sys.argv[1:])}
    if args.sweep:
        return _run_sweeps(args, out, report)
    from lattice.cost.plan import model_config

    try:
        cfg = model_config(args.arch, args.model, vocab_size=args.vocab_size, seq_len=args.seq_len,
                           n_layers=args.n_layers, d_model=args.d_model, n_heads=args.n_heads)
        result = bench_size(cfg, args.nproc, args.batch, args, serial=not args.no_serial)
    except (RuntimeError, LatticeConfigError) as e:
        print(f"lattice bench: {e}", file=sys.stderr)
        return 1
    print(f"p = {args.nproc}, {cfg}, batch {args.batch}, {args.steps} steps after {args.warmup} warm-up")
    print(format_table(result))
    stem = args.name or f"bench_p{args.nproc}"
    report["result"] = result
    (out / f"{stem}.json").write_text(json.dumps(report, indent=1, default=str))
    plot_single(result, out / f"{stem}.png")
    print(f"wrote {out / stem}.json and .png")
    return 0 if all("error" not in r for r in result["rows"]) else 1


def _run_sweeps(args, out: Path, report: dict) -> int:
    args.calibrate = True
    sizes = [int(s) for s in args.sizes.split(",")]
    families = ("strong", "weak") if args.sweep == "all" else (args.sweep,)
    for family in families:
        report[family] = []
        for p in sizes:
            cfg, batch = (GPTConfig(**STRONG), STRONG_BATCH) if family == "strong" else weak_config(p)
            t = time.perf_counter()
            result = bench_size(cfg, p, batch, args, serial=(p == 1))
            print(f"\n{family} scaling, p = {p}: h = {cfg.d_model}, {cfg.n_heads} heads, batch {batch} "
                  f"({time.perf_counter() - t:.0f} s)")
            print(format_table(result))
            report[family].append(result)
    errors = prediction_errors([r for f in families for r in report[f]])
    if errors:
        report["prediction_error_median_abs"] = statistics.median(abs(e) for e in errors)
        print(f"\ncalibrated model vs measured step time: median |error| = "
              f"{report['prediction_error_median_abs']:.1%} over {len(errors)} runs")
    report["projection"] = projection()
    report["crossovers"] = crossovers(report["projection"])
    print("\n" + format_projection(report["projection"]))
    print("\n".join(report["crossovers"]))
    stem = args.name or "sweeps"
    (out / f"{stem}.json").write_text(json.dumps(report, indent=1, default=str))
    plot_sweeps(report, out / f"{stem}.png")
    print(f"wrote {out / stem}.json and .png")
    return 0


def format_projection(proj: dict) -> str:
    lines = [f"projection ({proj['machine']}), model step time per sequence in ms:"]
    for family in ("strong", "weak"):
        modes = sorted({m for r in proj[family].values() for m in r if isinstance(r[m], dict)})
        lines.append(f"  {family:<7}{'p':>4}{'h':>7}{'b':>6}" + "".join(f"{m:>10}" for m in modes))
        for p, r in proj[family].items():
            cells = "".join(f"{r[m]['step_per_seq_s'] * 1e3:10.2f}" if m in r else f"{'-':>10}" for m in modes)
            lines.append(f"  {'':<7}{p:>4}{r['h']:>7}{r['b']:>6}{cells}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lattice.bench", description=__doc__.split("\n")[0])
    add_bench_arguments(parser)
    return run_bench(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
