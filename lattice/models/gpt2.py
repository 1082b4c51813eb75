"""GPT-2 (Radford et al. 2019), written once against the mode interface.

    cfg = GPTConfig(vocab_size=2048, seq_len=128, d_model=192, n_heads=12, n_layers=4)
    model = lattice.GPT(cfg, lattice.init("serial"))
    loss = model(tokens, targets)          # tokens, targets: (B, T) int64

Learned token and position tables, pre-LayerNorm blocks of causal self-attention (one fused
(h, 3, h) q/k/v weight) and a tanh-GELU MLP of width 4h, a final LayerNorm and an LM head tied
to the token table (or not).

HuggingFace (GPT2LMHeadModel): both keep linear weights as W[in, out] (HF's Conv1D), so only
names change, except the fused c_attn (h, 3h) / (3h,), which lattice keeps as (h, 3, h) / (3, h):
both put q, k, v in that order with heads contiguous, so a reshape is exact. Refused variants:
an activation other than the tanh GELU ("gelu_new", "gelu_pytorch_tanh"); n_inner other than
4 * n_embd; scale_attn_weights=False; scale_attn_by_inverse_layer_idx; reorder_and_upcast_attn;
add_cross_attention. Dropout: lattice has one rate; equal resid/embd/attn_pdrop map to it,
different ones are refused unless a GPTConfig passed beside the model says which rate to use.
A tied config whose lm_head.weight differs from wte.weight is refused. A bias-free lattice model
exports zero biases (GPT-2 always has them), so it re-imports as a bias=True model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn

from lattice.models.base import DecoderLM, ModelConfig
from lattice.models.components import MLP, SelfAttention, residual_dropout
from lattice.models.hf import HFMapping, HFTensor, transformers_module
from lattice.models.registry import register
from lattice.parallel.context import LatticeConfigError


@dataclass
class GPTConfig(ModelConfig):
    vocab_size: int = 50257
    seq_len: int = 1024
    d_model: int = 768
    n_heads: int = 12
    n_layers: int = 12
    dropout: float = 0.0
    bias: bool = True
    tie_embeddings: bool = True
    layer_norm_eps: float = 1e-5

    # "small" is the default that `lattice train` uses; sizes divide by the tensor-parallel
    # degrees the modes need on up to 9 ranks (d_model by 2, 3, 4; heads by 2, 3, 4)
    presets = {
        "tiny": dict(seq_len=64, d_model=48, n_heads=6, n_layers=2),
        "small": dict(seq_len=128, d_model=192, n_heads=12, n_layers=4),
        "medium": dict(seq_len=256, d_model=384, n_heads=12, n_layers=6),
        # the published GPT-2 sizes (124M, 355M, 774M, 1.5B), with their vocabulary and context
        "gpt2": dict(vocab_size=50257, seq_len=1024, d_model=768, n_heads=12, n_layers=12),
        "gpt2-medium": dict(vocab_size=50257, seq_len=1024, d_model=1024, n_heads=16, n_layers=24),
        "gpt2-large": dict(vocab_size=50257, seq_len=1024, d_model=1280, n_heads=20, n_layers=36),
        "gpt2-xl": dict(vocab_size=50257, seq_len=1024, d_model=1600, n_heads=25, n_layers=48),
    }

    def __post_init__(self):
        self.check_positive("vocab_size", "seq_len", "d_model", "n_heads", "n_layers")
        if self.d_model % self.n_heads:
            raise LatticeConfigError(
                f"d_model = {self.d_model} is not divisible by n_heads = {self.n_heads}; choose n_heads "
                f"among the divisors of d_model or a d_model that is a multiple of {self.n_heads}")
        if not 0.0 <= self.dropout < 1.0:
            raise LatticeConfigError(f"dropout must be in [0, 1), got {self.dropout}")

    @property
    def head_size(self) -> int:
        return self.d_model // self.n_heads


class TransformerBlock(nn.Module):
    """Pre-LayerNorm: x + attn(ln_1(x)), then + mlp(ln_2(x))."""

    def __init__(self, cfg: GPTConfig, mode, seeds):
        super().__init__()
        norm = dict(eps=cfg.layer_norm_eps, bias=cfg.bias)
        self.ln_1 = mode.norm("layer", **norm)
        self.attn = SelfAttention(mode, seeds, d_model=cfg.d_model, n_heads=cfg.n_heads, dropout=cfg.dropout,
                                  bias=cfg.bias, causal=True)
        self.ln_2 = mode.norm("layer", **norm)
        self.mlp = MLP(mode, seeds, d_model=cfg.d_model, hidden=4 * cfg.d_model, activation="gelu_tanh",
                       bias=cfg.bias, dropout=cfg.dropout)

    def forward(self, x, cache: dict | None = None, start: int = 0, keep=None):
        x = x + self.attn(self.ln_1(x), cache=cache, start=start, keep=keep)
        return x + self.mlp(self.ln_2(x))


class GPT2HF(HFMapping):
    model_type, model_class, label = "gpt2", "GPT2LMHeadModel", "GPT-2"
    _TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh")
    _BUFFERS = (".attn.bias", ".attn.masked_bias")  # causal-mask buffers of older GPT-2 checkpoints
    _RENAMES = (("attn.c_attn.", "attn.qkv."), ("attn.c_proj.", "attn.proj."), ("mlp.c_fc.", "mlp.fc."),
                ("mlp.c_proj.", "mlp.proj."))

    def config_from_hf(self, c, given=None):
        # a given rate also settles GPT-2's three rates, which config() refuses to merge when they differ
        return self.with_given(self.config(c, dropout=given.dropout if given is not None else None), given)

    def config(self, c, *, dropout: float | None = None) -> GPTConfig:
        """The GPTConfig of a GPT2Config (`dropout` replaces its rates); refuses the GPT-2
        variants lattice does not implement."""
        if getattr(c, "model_type", None) != "gpt2":
            raise LatticeConfigError(f"expected a GPT-2 config (model_type 'gpt2'), got model_type "
                                     f"{getattr(c, 'model_type', None)!r}")
        if c.activation_function not in self._TANH_GELUS:
            raise LatticeConfigError(f"activation_function={c.activation_function!r} is not implemented; "
                                     f"lattice uses the tanh gelu ({' or '.join(self._TANH_GELUS)})")
        if c.n_inner not in (None, 4 * c.n_embd):
            raise LatticeConfigError(f"n_inner={c.n_inner} is not implemented; lattice's MLP width is "
                                     f"4 * n_embd = {4 * c.n_embd} (set n_inner=None)")
        for flag, want in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                           ("reorder_and_upcast_attn", False), ("add_cross_attention", False)):
            if bool(getattr(c, flag, want)) != want:
                raise LatticeConfigError(f"{flag}={getattr(c, flag)} is not implemented; lattice needs {flag}={want}")
        rates = {"resid_pdrop": c.resid_pdrop, "embd_pdrop": c.embd_pdrop, "attn_pdrop": c.attn_pdrop}
        if dropout is None:
            if len(set(rates.values())) != 1:
                raise LatticeConfigError(f"lattice has one dropout rate but the GPT-2 config has {rates}; "
                                         f"pass dropout=p to config_from_hf (or a GPTConfig to from_hf)")
            dropout = c.resid_pdrop
        return GPTConfig(vocab_size=c.vocab_size, seq_len=c.n_positions, d_model=c.n_embd, n_heads=c.n_head,
                         n_layers=c.n_layer, dropout=float(dropout), bias=True,
                         tie_embeddings=bool(c.tie_word_embeddings), layer_norm_eps=c.layer_norm_epsilon)

    def config_to_hf(self, cfg):
        special = 50256 if cfg.vocab_size > 50256 else None  # GPT-2's <|endoftext|> only if it exists
        return transformers_module().GPT2Config(
            vocab_size=cfg.vocab_size, n_positions=cfg.seq_len, n_embd=cfg.d_model, n_head=cfg.n_heads,
            n_layer=cfg.n_layers, n_inner=None, activation_function="gelu_new",
            resid_pdrop=cfg.dropout, embd_pdrop=cfg.dropout, attn_pdrop=cfg.dropout,
            layer_norm_epsilon=cfg.layer_norm_eps, tie_word_embeddings=cfg.tie_embeddings,
            bos_token_id=special, eos_token_id=special)

    def tensors(self, cfg):
        h, v = cfg.d_model, cfg.vocab_size
        out = [HFTensor("wte.weight", "embed.wte", (v, h)), HFTensor("wpe.weight", "embed.wpe", (cfg.seq_len, h))]
        per_layer = (("ln_1.weight", (h,)), ("ln_1.bias", (h,)), ("attn.c_attn.weight", (h, 3 * h)),
                     ("attn.c_attn.bias", (3 * h,)), ("attn.c_proj.weight", (h, h)), ("attn.c_proj.bias", (h,)),
                     ("ln_2.weight", (h,)), ("ln_2.bias", (h,)), ("mlp.c_fc.weight", (h, 4 * h)),
                     ("mlp.c_fc.bias", (4 * h,)), ("mlp.c_proj.weight", (4 * h, h)), ("mlp.c_proj.bias", (h,)))
        for i in range(cfg.n_layers):
            for name, shape in per_layer:
                lattice_name = name
                for old, new in self._RENAMES:
                    lattice_name = lattice_name.replace(old, new)
                out.append(HFTensor(f"h.{i}.{name}", f"blocks.{i}.{lattice_name}", shape))
        out += [HFTensor("ln_f.weight", "ln_f.weight", (h,)), HFTensor("ln_f.bias", "ln_f.bias", (h,))]
        if not cfg.tie_embeddings:
            out.append(HFTensor("lm_head.weight", "head.weight", (v, h)))
        return out

    def tied(self, cfg):
        return [("lm_head.weight", "wte.weight")] if cfg.tie_embeddings else []

    def normalize(self, state_dict):
        """Keys as GPT2Model names them (no `transformer.` prefix), without the mask buffers."""
        return {k.removeprefix("transformer."): t for k, t in state_dict.items() if not k.endswith(self._BUFFERS)}

    def export_name(self, name):
        return name if name == "lm_head.weight" else "transformer." + name

    def check_import(self, cfg):
        if not cfg.bias:
            raise LatticeConfigError("GPT-2 weights always have biases; import them into a GPTConfig with bias=True")


GPT2_HF = GPT2HF()


def config_from_hf(hf_config, *, dropout: float | None = None) -> GPTConfig:
    """The GPTConfig of a GPT2Config (`dropout` replaces its rates); refuses the GPT-2 variants
    lattice does not implement."""
    return GPT2_HF.config(hf_config, dropout=dropout)


def config_to_hf(cfg: GPTConfig):
    """The transformers.GPT2Config computing the same function as `cfg`."""
    return GPT2_HF.config_to_hf(cfg)


@register
class GPT(DecoderLM):
    """GPT-2 holding only this rank's shards. Parameter names are the serial model's."""

    name = "gpt2"
    config_class = GPTConfig
    hf = GPT2_HF
    # d_model and heads divide by every tensor-parallel degree the test layouts use; V = 61 is
    # padded wherever a mode splits the vocabulary; seq_len 12 > the suite's T = 8 exercises wpe
    # slicing
    test_shapes = (dict(vocab_size=61, seq_len=12, d_model=24, n_heads=4, n_layers=2, bias=True, tie_embeddings=True),
                   dict(vocab_size=64, seq_len=12, d_model=24, n_heads=4, n_layers=2, bias=False,
                        tie_embeddings=False))

    def build(self):
        cfg, mode = self.cfg, self.mode
        self.embed = mode.embedding()
        self.drop = residual_dropout(cfg.dropout, mode, self.seeds)
        self.blocks = nn.ModuleList(TransformerBlock(cfg, mode, self.seeds) for _ in range(cfg.n_layers))
        self.ln_f = mode.norm("layer", eps=cfg.layer_norm_eps, bias=cfg.bias)
        self.head = mode.lm_head(self.embed)

    def cost_layout(self, b):
        cfg = self.cfg
        if b.first:  # (a pipeline's first stage alone embeds, its last alone runs the head)
            b.embedding(positions=True)
        with b.layer():
            b.norm("layer", bias=cfg.bias)
            b.linear(cfg.d_model, 3 * cfg.d_model, block="attention", position="in", bias=cfg.bias)
            b.attention(heads=cfg.n_heads, kv_heads=cfg.n_heads, head_size=cfg.head_size, causal=True)
            b.linear(cfg.d_model, cfg.d_model, block="attention", position="out", bias=cfg.bias,
                     input_from_attention=True)
            b.norm("layer", bias=cfg.bias)
            b.linear(cfg.d_model, 4 * cfg.d_model, block="mlp", position="in", bias=cfg.bias)
            b.activation(4 * cfg.d_model, kind="gelu_tanh")
            b.linear(4 * cfg.d_model, cfg.d_model, block="mlp", position="out", bias=cfg.bias)
        if b.last:
            b.norm("layer", bias=cfg.bias)
            b.lm_head()
