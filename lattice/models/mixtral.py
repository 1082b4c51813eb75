"""Mixtral decoders: Mistral's attention with a mixture of experts for every MLP, written once
against the mode interface from Llama's attention and lattice.models.moe.

    cfg = MixtralConfig.preset("tiny", vocab_size=2048)
    model = lattice.build_model(cfg, lattice.init("2d", tp=4))
    loss = model(tokens, targets)          # cross-entropy + router_aux_loss_coef x balancing loss

Each block: x + attn(ln_1(x)), then + moe(ln_2(x)), where moe routes each token to its top_k of
n_experts SwiGLU experts of width `intermediate_size` (weights renormalised over the k) and adds
their outputs (lattice/models/moe.py: dispatch, the balancing loss, what each layout does).
Attention is Mistral's: grouped-query, rotary, optionally a sliding window. A layer with
`mlp_only` set is a dense SwiGLU MLP of the same width (Mixtral's checkpoints have none; the
families built on this one use it). Dropout is attention's alone (Mixtral trains with none).

HuggingFace (MixtralForCausalLM, transformers 5's fused experts): Llama's names for attention and
norms, `mlp.gate.weight` (E, h), `mlp.experts.gate_up_proj` (E, 2I, h), `mlp.experts.down_proj`
(E, h, I), which lattice keeps with the experts' dim folded into the rows; transformers 4's
per-expert layout is read too. Refused: router_jitter_noise other than 0.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn

from lattice.models.components import MLP, Rotary, SelfAttention, residual_dropout
from lattice.models.hf import HFTensor
from lattice.models.llama import Llama, LlamaConfig
from lattice.models.mistral import MistralConfig, MistralHF
from lattice.models.moe import MoEDecoder, SparseMoE, refuse_expert_bias
from lattice.models.registry import register
from lattice.parallel.context import LatticeConfigError


@dataclass
class MixtralConfig(MistralConfig):
    vocab_size: int = 32000
    intermediate_size: int = 14336  # each expert's width
    sliding_window: int | None = None
    rope_theta: float = 1000000.0
    n_experts: int = 8
    top_k: int = 2
    router_aux_loss_coef: float = 0.001  # transformers' default; Mixtral's checkpoints say 0.02
    router_z_loss_coef: float = 0.0  # ST-MoE's router z-loss (Megatron-LM's --moe-z-loss-coeff; not in transformers)
    # DeepSeek-V3's aux-loss-free balancing: each expert's bias on the routing scores moves by this
    # much a step toward the mean load (Megatron-LM's --moe-router-bias-update-rate; 0: off)
    expert_bias_rate: float = 0.0
    mlp_only: list[int] = field(default_factory=list)  # layers with a dense MLP instead

    presets = {
        "tiny": dict(LlamaConfig.presets["tiny"], intermediate_size=64, n_experts=4, top_k=2),
        "small": dict(LlamaConfig.presets["small"], intermediate_size=256, n_experts=8, top_k=2),
        "mixtral-8x7b": dict(vocab_size=32000, seq_len=32768, d_model=4096, n_heads=32, n_kv_heads=8, n_layers=32,
                             intermediate_size=14336, rope_theta=1000000.0, sliding_window=None, n_experts=8,
                             top_k=2, router_aux_loss_coef=0.02),
    }

    def __post_init__(self):
        super().__post_init__()
        self.check_positive("n_experts", "top_k")
        if self.top_k > self.n_experts:
            raise LatticeConfigError(f"top_k = {self.top_k} exceeds n_experts = {self.n_experts}: a token cannot go to "
                                     f"more experts than there are; choose top_k <= {self.n_experts}")
        for name in ("router_aux_loss_coef", "router_z_loss_coef", "expert_bias_rate"):
            if not getattr(self, name) >= 0:
                raise LatticeConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        self.mlp_only = sorted(set(int(i) for i in self.mlp_only))  # a list, as a saved config holds it
        if any(not 0 <= i < self.n_layers for i in self.mlp_only):
            raise LatticeConfigError(f"mlp_only {list(self.mlp_only)} names layers outside 0..{self.n_layers - 1}")

    # what SparseMoE reads
    normalize_top_k = True
    shared_expert_size = 0

    @property
    def expert_size(self) -> int:
        return self.intermediate_size

    @property
    def dense_size(self) -> int:
        return self.intermediate_size

    def sparse_layers(self) -> list[int]:
        return [i for i in range(self.n_layers) if i not in self.mlp_only]


class MoEBlock(nn.Module):
    """Pre-RMSNorm: x + attn(ln_1(x)), then + mlp(ln_2(x)), the MLP a SparseMoE (`moe_layer`: its
    index among the MoE layers) or, with moe_layer None, a dense SwiGLU MLP."""

    def __init__(self, cfg, mode, seeds, rotary: Rotary, moe_layer: int | None):
        super().__init__()
        self.ln_1 = mode.norm("rms", eps=cfg.norm_eps, bias=False)
        self.attn = SelfAttention(mode, seeds, d_model=cfg.d_model, n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads,
                                  dropout=cfg.dropout, causal=True, rotary=rotary, segmented=True,
                                  **cfg.attention_options())
        self.ln_2 = mode.norm("rms", eps=cfg.norm_eps, bias=False)
        self.sparse = moe_layer is not None
        self.mlp = (SparseMoE(mode, cfg, moe_layer) if self.sparse else
                    MLP(mode, seeds, d_model=cfg.d_model, hidden=cfg.dense_size, activation="silu", gated=True,
                        bias=False))

    def forward(self, x, cache=None, start=0, keep=None, positions=None, token_mask=None, balance=None):
        x = x + self.attn(self.ln_1(x), cache=cache, start=start, keep=keep, positions=positions)
        h = self.ln_2(x)
        return x + (self.mlp(h, token_mask, balance) if self.sparse else self.mlp(h))


class MixtralHF(MistralHF):
    model_type, model_class, label = "mixtral", "MixtralForCausalLM", "Mixtral"
    config_class, hf_config_class = MixtralConfig, "MixtralConfig"
    _DENSE = frozenset(("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"))

    def fields_from_hf(self, c) -> dict:
        if getattr(c, "router_jitter_noise", 0.0):
            raise LatticeConfigError(f"router_jitter_noise={c.router_jitter_noise} is not implemented; set it to 0")
        return {**super().fields_from_hf(c), "n_experts": c.num_local_experts, "top_k": c.num_experts_per_tok,
                "router_aux_loss_coef": float(c.router_aux_loss_coef)}

    def fields_to_hf(self, cfg) -> dict:
        refuse_expert_bias(cfg, self.model_class)
        return {**super().fields_to_hf(cfg), "num_local_experts": cfg.n_experts, "num_experts_per_tok": cfg.top_k,
                "router_aux_loss_coef": cfg.router_aux_loss_coef, "output_router_logits": True,
                "router_jitter_noise": 0.0}

    def check_import(self, cfg) -> None:
        if cfg.mlp_only:
            raise LatticeConfigError(f"mlp_only {list(cfg.mlp_only)}: MixtralForCausalLM has no dense layers")

    def moe_tensors(self, cfg) -> list[tuple[str, str, tuple[int, ...], bool]]:
        h, E, inner = cfg.d_model, cfg.n_experts, cfg.expert_size
        return [("mlp.gate.weight", "mlp.router.weight", (E, h), False),
                ("mlp.experts.gate_up_proj", "mlp.experts.gate_up", (E, 2 * inner, h), False),
                ("mlp.experts.down_proj", "mlp.experts.down", (E, h, inner), False)]

    #: transformers 4's per-expert layout of one MoE layer, which transformers 5 still writes: the
    #: layer's prefix, and the names of an expert's gate, up and down projections
    per_expert = ("block_sparse_moe", "w1", "w3", "w2")

    def assembled(self, cfg, keys):
        """The router and fused experts of a checkpoint in transformers 4's per-expert layout
        (`mlp.experts.{e}.{gate,up,down}` under `per_expert`'s names): gate and up of each expert
        stacked as gate_up (E, 2I, h), the down projections as down (E, h, I)."""
        out = {}
        prefix, gate, up, down = self.per_expert
        h, E, inner = cfg.d_model, cfg.n_experts, cfg.expert_size
        for i in cfg.sparse_layers():
            old = f"model.layers.{i}.{prefix}"
            if f"{old}.experts.0.{gate}.weight" not in keys:
                continue
            new = f"model.layers.{i}.mlp"
            if old != new:
                out[f"{new}.gate.weight"] = ((f"{old}.gate.weight",), ((E, h),), lambda ts: ts[0])
            out[f"{new}.experts.gate_up_proj"] = (
                tuple(f"{old}.experts.{e}.{w}.weight" for e in range(E) for w in (gate, up)), ((inner, h),) * 2 * E,
                lambda ts: torch.stack([torch.cat(ts[2 * e:2 * e + 2]) for e in range(len(ts) // 2)]))
            out[f"{new}.experts.down_proj"] = (tuple(f"{old}.experts.{e}.{down}.weight" for e in range(E)),
                                               ((h, inner),) * E, torch.stack)
        return out

    def tensors(self, cfg):
        """Llama's, with each MoE layer's dense MLP replaced by its router and experts."""
        sparse = set(cfg.sparse_layers())
        out = [t for t in super().tensors(cfg) if not (t.hf.startswith("model.layers.") and int(t.hf.split(".")[2]) in sparse
                                                       and t.hf.split(".", 3)[3] in self._DENSE)]
        for i in sorted(sparse):
            out += [HFTensor(f"model.layers.{i}.{hf}", f"blocks.{i}.{name}", shape)
                    for hf, name, shape, _ in self.moe_tensors(cfg)]
        return out


@register
class Mixtral(MoEDecoder):
    """A Mixtral decoder holding only this rank's shards. Parameter names are the serial model's."""

    name = "mixtral"
    config_class = MixtralConfig
    hf = MixtralHF()
    rotary_positions = True
    # grouped-query, 4 experts of which each token takes 2; V = 61 is padded where a mode splits it
    test_shapes = (dict(vocab_size=61, seq_len=12, d_model=32, n_heads=4, n_kv_heads=2, n_layers=2,
                        intermediate_size=24, rope_theta=500.0, n_experts=4, top_k=2, router_aux_loss_coef=0.1),)

    def build(self):
        cfg, mode = self.cfg, self.mode
        rotary = Rotary(cfg.head_size, cfg.rope_theta, cfg.rope_scaling)
        self.embed = mode.embedding(positions=False)
        self.drop = residual_dropout(cfg.dropout, mode, self.seeds)
        sparse = cfg.sparse_layers()
        self.blocks = nn.ModuleList(MoEBlock(cfg, mode, self.seeds, rotary, sparse.index(i) if i in sparse else None)
                                    for i in range(cfg.n_layers))
        self.ln_f = mode.norm("rms", eps=cfg.norm_eps, bias=False)
        self.head = mode.lm_head(self.embed)

    def init_std(self, name):
        return self.cfg.init_std

    cost_attention, cost_mlp = Llama.cost_attention, Llama.cost_mlp

    def cost_layout(self, b):
        cfg = self.cfg
        if b.first:  # (a pipeline's first stage alone embeds, its last alone runs the head)
            b.embedding(positions=False)
        sparse = len(set(cfg.sparse_layers()) & set(b.blocks_here))  # (this stage's blocks)
        for count, moe in ((len(b.blocks_here) - sparse, False), (sparse, True)):
            if count:
                with b.layer(count):
                    self.cost_attention(b)
                    b.norm("rms", bias=False)
                    if moe:
                        b.moe(cfg.n_experts, cfg.top_k, cfg.expert_size, normalize=cfg.normalize_top_k,
                              shared=cfg.shared_expert_size, z_loss=bool(cfg.router_z_loss_coef))
                    else:
                        self.cost_mlp(b, cfg.dense_size)
        if b.last:
            b.norm("rms", bias=False)
            b.lm_head()
