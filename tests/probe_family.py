"""A model family made for the conformance suite: it uses every piece of the mode interface that
GPT-2 does not, so that each is checked in every mode before the families that need it land --
RMSNorm; grouped-query attention through a segmented IN linear (n_kv_heads < n_heads, k and v
narrower than q); no position table (rotary positions); an additive bias per head, split like
the heads (`Mode.per_head`); a gated (SwiGLU) MLP; an untied LM head; and, with num_labels > 0,
a classification head over the pooled first token (`Mode.pool`), run replicated.

Importing this module registers it as the family "probe".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from lattice.models import Model, ModelConfig, Parts, register
from lattice.models.components import MLP, ReplicatedLinear, Rotary, SelfAttention
from lattice.parallel.context import LatticeConfigError


@dataclass
class ProbeConfig(ModelConfig):
    vocab_size: int = 61
    seq_len: int = 12
    d_model: int = 24
    n_heads: int = 4
    n_kv_heads: int = 2
    n_layers: int = 2
    hidden: int = 40
    num_labels: int = 0  # 0: language modelling; else classes of the pooled first token
    rope_theta: float = 500.0
    norm_eps: float = 1e-6
    dropout: float = 0.0
    tie_embeddings: bool = False
    bias: bool = False

    presets = {"tiny": dict(vocab_size=61, seq_len=12, d_model=24, n_heads=4, n_kv_heads=2, n_layers=2, hidden=40)}
    default_preset = "tiny"

    def __post_init__(self):
        self.check_positive("vocab_size", "seq_len", "d_model", "n_heads", "n_kv_heads", "n_layers", "hidden")
        if self.d_model % self.n_heads or self.n_heads % self.n_kv_heads:
            raise LatticeConfigError("probe: n_heads must divide d_model and n_kv_heads n_heads")

    def head_counts(self):
        return {"n_heads": self.n_heads, "n_kv_heads": self.n_kv_heads}


class RelativeBias(nn.Module):
    """scores[h, i, j] += table[j - i + T - 1, h]: a learned bias per head and distance."""

    def __init__(self, mode, seq_len: int, n_heads: int):
        super().__init__()
        self.seq_len = seq_len
        self.table = mode.per_head((2 * seq_len - 1, n_heads), 1)

    def forward(self, t_q: int, t_k: int, start: int):
        rows = torch.arange(start, start + t_q).unsqueeze(1)
        distance = torch.arange(t_k).unsqueeze(0) - rows + self.seq_len - 1  # (T_q, T_k)
        return self.table.weight[distance.to(self.table.weight.device)].permute(2, 0, 1)  # (nh_local, T_q, T_k)


class Block(nn.Module):
    def __init__(self, cfg: ProbeConfig, mode, seeds):
        super().__init__()
        self.ln_1 = mode.norm("rms", eps=cfg.norm_eps, bias=False)
        self.rel = RelativeBias(mode, cfg.seq_len, cfg.n_heads)
        self.attn = SelfAttention(mode, seeds, d_model=cfg.d_model, n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads,
                                  bias=False, causal=cfg.num_labels == 0,
                                  rotary=Rotary(cfg.d_model // cfg.n_heads, cfg.rope_theta))
        self.ln_2 = mode.norm("rms", eps=cfg.norm_eps, bias=False)
        self.mlp = MLP(mode, seeds, d_model=cfg.d_model, hidden=cfg.hidden, activation="silu", gated=True, bias=False)

    def forward(self, x, cache=None, start=0):
        x = x + self.attn(self.ln_1(x), cache=cache, start=start, bias=self.rel)
        return x + self.mlp(self.ln_2(x))


@register
class Probe(Model):
    name = "probe"
    config_class = ProbeConfig
    # classification only: the language-model pieces (RMSNorm, GQA, rotary, SwiGLU, untied head)
    # run in every mode as the Llama family; what Llama lacks -- a per-head bias, bidirectional
    # attention, pooling and a replicated head -- runs here
    test_shapes = (dict(num_labels=3, vocab_size=64),)

    def build(self):
        cfg, mode = self.cfg, self.mode
        self.embed = mode.embedding(positions=False)
        self.blocks = nn.ModuleList(Block(cfg, mode, self.seeds) for _ in range(cfg.n_layers))
        self.ln_f = mode.norm("rms", eps=cfg.norm_eps, bias=False)
        if cfg.num_labels:
            self.classifier = ReplicatedLinear(self.ctx, cfg.d_model, cfg.num_labels)
        else:
            self.head = mode.lm_head(self.embed)

    def embed_tokens(self, tokens, start=0):
        return self.embed(tokens, start)

    def finish(self, x):
        return self.ln_f(x)

    def head_loss(self, x, targets):
        if not self.cfg.num_labels:
            return self.head.loss(x, targets)
        logits = self.classifier(self.mode.pool(x, 0, targets.shape[0]))  # (B, num_labels), on every rank
        return F.cross_entropy(logits.float() if logits.dtype != torch.float64 else logits, targets)

    def head_logits(self, x):
        return self.head.logits(x)

    def check_targets(self, tokens, targets):
        if self.cfg.num_labels and targets.shape != tokens.shape[:1]:
            raise LatticeConfigError(f"classification targets must be (batch,), got {tuple(targets.shape)}")
        if not self.cfg.num_labels:
            super().check_targets(tokens, targets)

    def parts(self):
        return Parts(first=("embed",), blocks="blocks", last=("ln_f", "classifier" if self.cfg.num_labels else "head"))

    def cost_layout(self, b):
        cfg = self.cfg
        hs = cfg.d_model // cfg.n_heads
        b.embedding(positions=False)
        with b.layer():
            b.norm("rms", bias=False)
            b.linear(cfg.d_model, (cfg.n_heads + 2 * cfg.n_kv_heads) * hs, block="attention", position="in", bias=False)
            b.attention(heads=cfg.n_heads, kv_heads=cfg.n_kv_heads, head_size=hs, causal=cfg.num_labels == 0,
                        rotary=True, bias=True)
            b.linear(cfg.n_heads * hs, cfg.d_model, block="attention", position="out", bias=False,
                     input_from_attention=True)
            b.norm("rms", bias=False)
            b.linear(cfg.d_model, 2 * cfg.hidden, block="mlp", position="in", bias=False)
            b.activation(cfg.hidden, kind="silu", gated=True)
            b.linear(cfg.hidden, cfg.d_model, block="mlp", position="out", bias=False)
        b.norm("rms", bias=False)
        if cfg.num_labels:
            b.classifier(cfg.num_labels)
        else:
            b.lm_head()
