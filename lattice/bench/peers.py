"""The peer of `lattice bench`: PyTorch's own tensor parallelism (DTensor) on the same model.

GPT-2: a plain-PyTorch GPT-2 (nn.Linear, separate q/k/v) loaded with lattice's serial weights
and parallelised over a 1-D DeviceMesh as torchtitan does without sequence parallelism: q, k, v
and fc ColwiseParallel, both output projections RowwiseParallel, the attention input prepared
once as Replicate (one gradient all-reduce for q, k, v together), the token embedding
RowwiseParallel (vocabulary-split, output all-reduced) and the tied LM head ColwiseParallel with
`loss_parallel`, so neither side ever gathers logits; wpe and LayerNorms are replicated.
Llama: transformers' own LlamaForCausalLM under torchtitan's Llama plan (q/k/v and gate/up
ColwiseParallel behind one Replicate input each, o_proj and down_proj RowwiseParallel, the token
table RowwiseParallel and the untied LM head ColwiseParallel into `loss_parallel`).
`DTensorComm` counts the peer's collectives in CommMeter's units.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from lattice.models import arch_of_config
from lattice.parallel.comm import CommMeter, CommRecord
from lattice.parallel.context import LatticeConfigError


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
        from lattice.models import hf

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
