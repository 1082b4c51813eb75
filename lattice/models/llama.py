"""Llama-architecture decoders (Llama 2 and 3, and the models sharing their shape), written once
against the mode interface.

    cfg = LlamaConfig.preset("tiny", vocab_size=2048)
    model = lattice.build_model(cfg, lattice.init("2d", tp=4))
    loss = model(tokens, targets)          # tokens, targets: (B, T) int64

A token table (no position table), pre-RMSNorm blocks of causal self-attention with rotary
positions (`rope_theta`, optionally Llama 3's frequency scaling) and grouped-query attention
(`n_kv_heads` key/value heads shared by n_heads / n_kv_heads query heads each; 1 is multi-query),
a SwiGLU MLP of width `intermediate_size`, a final RMSNorm and an LM head, untied by default. No
biases anywhere.

Grouped-query attention under a tensor split: every layout splits the query heads AND the
key/value heads into whole heads per rank, so the split (tp in 1d, q in 2d and 3d, the sub-grid
count in subgraph) must divide n_kv_heads as well as n_heads; otherwise the model is refused in
one line naming the sizes that work. (Megatron instead replicates kv heads when tp exceeds
them; lattice does not, so every parameter has one owner per shard and no replica gradients.)
A rank's KV cache holds only its kv heads.

Numerics as transformers computes them: the rotary angles and their cos/sin in float32 (then
cast to the activations' dtype), RMSNorm as x * rsqrt(mean(x²) + eps) in at least float32.

HuggingFace (LlamaForCausalLM): nn.Linear keeps W[out, in], lattice W[in, out], so every
projection is transposed; q_proj, k_proj, v_proj are the attention IN linear's segments q, k, v,
gate_proj and up_proj the MLP IN linear's segments gate and up. Refused: attention_bias or
mlp_bias, an activation other than silu, rope scaling other than none or "llama3", a head_dim
with head_dim * n_heads != hidden_size. transformers' attention_dropout becomes lattice's one
dropout rate, which lattice also applies to the residual branches (Llama's checkpoints have 0).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn

from lattice.models.base import DecoderLM, ModelConfig
from lattice.models.components import MLP, Rotary, SelfAttention, residual_dropout
from lattice.models.hf import HFMapping, HFTensor, transformers_module
from lattice.models.registry import register
from lattice.parallel.context import LatticeConfigError

# Llama 3.1+'s rope scaling (the 8B/70B of 3.1, all of 3.2), as their config.json spells it
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192}


@dataclass
class LlamaConfig(ModelConfig):
    vocab_size: int = 128256
    seq_len: int = 2048
    d_model: int = 2048
    n_heads: int = 32
    n_kv_heads: int = 8
    n_layers: int = 16
    intermediate_size: int = 8192
    rope_theta: float = 500000.0
    rope_scaling: dict | None = None  # None, or Llama 3's {"rope_type": "llama3", "factor": ..., ...}
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    dropout: float = 0.0  # on the residual branches and the attention weights (Llama trains with none)
    init_std: float = 0.02  # transformers' initializer_range

    # tiny: the tests' and the CLI examples' (divides by 2 and 4: heads, kv heads, d_model);
    # small: trains on the built-in corpus in minutes on 2 cores; the rest: the published shapes
    presets = {
        "tiny": dict(seq_len=64, d_model=64, n_heads=8, n_kv_heads=4, n_layers=2, intermediate_size=160,
                     rope_theta=10000.0),
        "small": dict(seq_len=128, d_model=192, n_heads=12, n_kv_heads=4, n_layers=4, intermediate_size=512,
                      rope_theta=10000.0),
        "llama3.2-1b": dict(vocab_size=128256, seq_len=131072, d_model=2048, n_heads=32, n_kv_heads=8, n_layers=16,
                            intermediate_size=8192, rope_theta=500000.0, rope_scaling=LLAMA3_SCALING,
                            tie_embeddings=True),
        "llama3-8b": dict(vocab_size=128256, seq_len=8192, d_model=4096, n_heads=32, n_kv_heads=8, n_layers=32,
                          intermediate_size=14336, rope_theta=500000.0),
        "llama3-70b": dict(vocab_size=128256, seq_len=8192, d_model=8192, n_heads=64, n_kv_heads=8, n_layers=80,
                           intermediate_size=28672, rope_theta=500000.0),
    }

    def __post_init__(self):
        self.check_positive("vocab_size", "seq_len", "d_model", "n_heads", "n_kv_heads", "n_layers",
                            "intermediate_size")
        if self.d_model % self.n_heads:
            raise LatticeConfigError(f"d_model = {self.d_model} is not divisible by n_heads = {self.n_heads}; choose "
                                     f"n_heads among the divisors of d_model")
        if self.n_heads % self.n_kv_heads:
            raise LatticeConfigError(f"n_kv_heads = {self.n_kv_heads} does not divide n_heads = {self.n_heads}; each kv "
                                     f"head serves a whole group of query heads: choose a divisor of {self.n_heads}")
        if (self.d_model // self.n_heads) % 2:
            raise LatticeConfigError(f"head size d_model / n_heads = {self.d_model // self.n_heads} is odd; rotary "
                                     f"positions rotate pairs of features: choose an even head size")
        if not self.rope_theta > 0:
            raise LatticeConfigError(f"rope_theta must be positive, got {self.rope_theta}")
        if not 0.0 <= self.dropout < 1.0:
            raise LatticeConfigError(f"dropout must be in [0, 1), got {self.dropout}")
        if self.rope_scaling is not None:
            self.rope_scaling = dict(self.rope_scaling)
            Rotary(self.head_size, self.rope_theta, self.rope_scaling)  # refuses an unknown scaling

    @property
    def head_size(self) -> int:
        return self.d_model // self.n_heads

    def head_counts(self):
        return {"n_heads": self.n_heads, "n_kv_heads": self.n_kv_heads}

    def attention_options(self) -> dict:
        """SelfAttention's choices beyond the sizes (the families built on this one change them):
        Llama's projections have no bias, and a query attends to every earlier position."""
        return {"bias": False}


class LlamaBlock(nn.Module):
    """Pre-RMSNorm: x + attn(ln_1(x)), then + mlp(ln_2(x)) with a SwiGLU MLP."""

    def __init__(self, cfg: LlamaConfig, mode, seeds, rotary: Rotary):
        super().__init__()
        self.ln_1 = mode.norm("rms", eps=cfg.norm_eps, bias=False)
        # q, k, v stay three segments with every head too, as the checkpoints hold them
        self.attn = SelfAttention(mode, seeds, d_model=cfg.d_model, n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads,
                                  dropout=cfg.dropout, causal=True, rotary=rotary, segmented=True,
                                  **cfg.attention_options())
        self.ln_2 = mode.norm("rms", eps=cfg.norm_eps, bias=False)
        self.mlp = MLP(mode, seeds, d_model=cfg.d_model, hidden=cfg.intermediate_size, activation="silu", gated=True,
                       bias=False, dropout=cfg.dropout)

    def forward(self, x, cache: dict | None = None, start: int = 0, keep=None, positions=None):
        x = x + self.attn(self.ln_1(x), cache=cache, start=start, keep=keep, positions=positions)
        return x + self.mlp(self.ln_2(x))


class LlamaHF(HFMapping):
    """LlamaForCausalLM's names and config; the families sharing Llama's shape subclass it with
    their own model type, config classes, extra tensors (`layer_tensors`) and config fields
    (`fields_from_hf`, `fields_to_hf`)."""

    model_type, model_class, label = "llama", "LlamaForCausalLM", "Llama"
    config_class, hf_config_class = LlamaConfig, "LlamaConfig"
    _LAYER = (("input_layernorm.weight", "ln_1.weight", False), ("self_attn.q_proj.weight", "attn.qkv.q.weight", True),
              ("self_attn.k_proj.weight", "attn.qkv.k.weight", True),
              ("self_attn.v_proj.weight", "attn.qkv.v.weight", True),
              ("self_attn.o_proj.weight", "attn.proj.weight", True),
              ("post_attention_layernorm.weight", "ln_2.weight", False),
              ("mlp.gate_proj.weight", "mlp.fc.gate.weight", True), ("mlp.up_proj.weight", "mlp.fc.up.weight", True),
              ("mlp.down_proj.weight", "mlp.proj.weight", True))

    def fields_from_hf(self, c) -> dict:
        """The config fields of this family beyond Llama's, from transformers' config `c`, which
        is refused in one line where it asks for what the family does not implement."""
        for flag in ("attention_bias", "mlp_bias"):
            if getattr(c, flag, False):
                raise LatticeConfigError(f"{flag}=True is not implemented; lattice's Llama has no biases")
        return {}

    def fields_to_hf(self, cfg) -> dict:
        return {"attention_bias": False, "mlp_bias": False}

    def layer_tensors(self, cfg) -> list[tuple[str, str, tuple[int, ...], bool]]:
        """(HF name, lattice name, lattice shape, transposed) of one block's tensors."""
        h, hs, inner = cfg.d_model, cfg.head_size, cfg.intermediate_size
        shapes = {"ln_1.weight": (h,), "attn.qkv.q.weight": (h, cfg.n_heads * hs),
                  "attn.qkv.k.weight": (h, cfg.n_kv_heads * hs), "attn.qkv.v.weight": (h, cfg.n_kv_heads * hs),
                  "attn.proj.weight": (cfg.n_heads * hs, h), "ln_2.weight": (h,), "mlp.fc.gate.weight": (h, inner),
                  "mlp.fc.up.weight": (h, inner), "mlp.proj.weight": (inner, h)}
        return [(hf_name, name, shapes[name], transpose) for hf_name, name, transpose in self._LAYER]

    def config_from_hf(self, c, given=None):
        if getattr(c, "model_type", None) != self.model_type:
            raise LatticeConfigError(f"expected a {self.label} config (model_type {self.model_type!r}), got model_type "
                                     f"{getattr(c, 'model_type', None)!r}")
        extra = self.fields_from_hf(c)
        if c.hidden_act != "silu":
            raise LatticeConfigError(f"hidden_act={c.hidden_act!r} is not implemented; {self.label}'s MLP is SwiGLU "
                                     f"(silu)")
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        if head_dim * c.num_attention_heads != c.hidden_size:
            raise LatticeConfigError(f"head_dim={head_dim} with {c.num_attention_heads} heads != hidden_size="
                                     f"{c.hidden_size} is not implemented; lattice's heads split d_model")
        if getattr(c, "pretraining_tp", 1) not in (None, 1):
            raise LatticeConfigError(f"pretraining_tp={c.pretraining_tp} is not implemented; set it to 1")
        rope = dict(getattr(c, "rope_parameters", None) or {})
        theta = rope.pop("rope_theta", getattr(c, "rope_theta", None))
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind not in ("default", "llama3"):
            raise LatticeConfigError(f"rope scaling {kind!r} is not implemented; lattice implements none and 'llama3'")
        scaling = None if kind == "default" else {k: rope[k] for k in LLAMA3_SCALING}
        cfg = self.config_class(
            vocab_size=c.vocab_size, seq_len=c.max_position_embeddings, d_model=c.hidden_size,
            n_heads=c.num_attention_heads, n_kv_heads=c.num_key_value_heads or c.num_attention_heads,
            n_layers=c.num_hidden_layers, intermediate_size=c.intermediate_size, rope_theta=float(theta),
            rope_scaling=scaling, norm_eps=c.rms_norm_eps, tie_embeddings=bool(c.tie_word_embeddings),
            dropout=float(c.attention_dropout), init_std=c.initializer_range, **extra)
        return self.with_given(cfg, given)

    def config_to_hf(self, cfg):
        rope = {"rope_type": "default", "rope_theta": cfg.rope_theta} if cfg.rope_scaling is None else \
            {**cfg.rope_scaling, "rope_type": "llama3", "rope_theta": cfg.rope_theta}
        return getattr(transformers_module(), self.hf_config_class)(
            vocab_size=cfg.vocab_size, max_position_embeddings=cfg.seq_len, hidden_size=cfg.d_model,
            num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads, num_hidden_layers=cfg.n_layers,
            intermediate_size=cfg.intermediate_size, hidden_act="silu", rms_norm_eps=cfg.norm_eps,
            rope_parameters=rope, tie_word_embeddings=cfg.tie_embeddings, **self.fields_to_hf(cfg),
            attention_dropout=cfg.dropout, initializer_range=cfg.init_std, bos_token_id=None, eos_token_id=None,
            pad_token_id=None)

    def tensors(self, cfg):
        h, v = cfg.d_model, cfg.vocab_size
        out = [HFTensor("model.embed_tokens.weight", "embed.wte", (v, h))]
        for i in range(cfg.n_layers):
            for hf_name, name, shape, transpose in self.layer_tensors(cfg):
                out.append(HFTensor(f"model.layers.{i}.{hf_name}", f"blocks.{i}.{name}",
                                    tuple(reversed(shape)) if transpose else shape, transpose))
        out.append(HFTensor("model.norm.weight", "ln_f.weight", (h,)))
        if not cfg.tie_embeddings:
            out.append(HFTensor("lm_head.weight", "head.weight", (v, h)))
        return out

    def tied(self, cfg):
        return [("lm_head.weight", "model.embed_tokens.weight")] if cfg.tie_embeddings else []

    def normalize(self, state_dict):
        # the rotary tables are buffers computed from the config, not weights
        return {k: t for k, t in state_dict.items() if not k.endswith("rotary_emb.inv_freq")}


LLAMA_HF = LlamaHF()


@register
class Llama(DecoderLM):
    """A Llama-architecture decoder holding only this rank's shards. Parameter names are the
    serial model's."""

    name = "llama"
    config_class = LlamaConfig
    hf = LLAMA_HF
    rotary_positions = True
    # grouped-query (n_kv 2 < n_heads 4), a non-default theta with Llama 3's scaling, untied; heads
    # and kv heads split by every degree the test layouts use; V = 61 is padded where a mode splits it
    test_shapes = (dict(vocab_size=61, seq_len=12, d_model=32, n_heads=4, n_kv_heads=2, n_layers=2,
                        intermediate_size=40, rope_theta=500.0,
                        rope_scaling=dict(LLAMA3_SCALING, factor=4.0, original_max_position_embeddings=16)),)

    def build(self):
        cfg, mode = self.cfg, self.mode
        rotary = Rotary(cfg.head_size, cfg.rope_theta, cfg.rope_scaling)
        self.embed = mode.embedding(positions=False)
        self.drop = residual_dropout(cfg.dropout, mode, self.seeds)
        self.blocks = nn.ModuleList(LlamaBlock(cfg, mode, self.seeds, rotary) for _ in range(cfg.n_layers))
        self.ln_f = mode.norm("rms", eps=cfg.norm_eps, bias=False)
        self.head = mode.lm_head(self.embed)

    def init_std(self, name):
        return self.cfg.init_std  # transformers' LlamaPreTrainedModel: one std for every matrix

    def cost_layout(self, b):
        cfg = self.cfg
        if b.first:  # (a pipeline's first stage alone embeds, its last alone runs the head)
            b.embedding(positions=False)
        with b.layer():
            self.cost_attention(b)
            b.norm("rms", bias=False)
            self.cost_mlp(b, cfg.intermediate_size)
        if b.last:
            b.norm("rms", bias=False)
            b.lm_head()

    def cost_attention(self, b):
        """A block's first half: its norm and attention (the families on Llama's blocks share it)."""
        cfg = self.cfg
        hs, options = cfg.head_size, cfg.attention_options()
        b.norm("rms", bias=False)
        b.linear(cfg.d_model, (cfg.n_heads + 2 * cfg.n_kv_heads) * hs, block="attention", position="in",
                 bias=options["bias"])
        b.attention(heads=cfg.n_heads, kv_heads=cfg.n_kv_heads, head_size=hs, causal=True, rotary=True,
                    window=options.get("window") is not None)
        b.linear(cfg.n_heads * hs, cfg.d_model, block="attention", position="out",
                 bias=options.get("out_bias", options["bias"]), input_from_attention=True)

    def cost_mlp(self, b, inner: int):
        """A SwiGLU MLP of `inner` hidden features."""
        b.linear(self.cfg.d_model, 2 * inner, block="mlp", position="in", bias=False)
        b.activation(inner, kind="silu", gated=True)
        b.linear(inner, self.cfg.d_model, block="mlp", position="out", bias=False)
