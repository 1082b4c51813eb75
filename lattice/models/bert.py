"""BERT encoders (Devlin et al. 2019), written once against the mode interface: masked-LM
pre-training and the sequence-classification branch of Optimus's Figure 1.

    cfg = BertConfig.preset("tiny", vocab_size=2048)                 # masked LM (num_labels = 0)
    model = lattice.build_model(cfg, lattice.init("2d", tp=4))
    loss = model(tokens, targets)          # tokens (B, T) int64; targets (B, T), -100 where unmasked

    cfg = BertConfig.preset("tiny", vocab_size=2048, num_labels=3)   # classification
    loss = model(tokens, labels)           # labels (B,) class ids

Token, position and token-type tables summed, then LayerNorm and dropout; post-LayerNorm blocks
(x = LN(x + attn(x)), then x = LN(x + mlp(x))) of bidirectional self-attention and an MLP with
the exact (erf) GELU. `token_types` (transformers' token_type_ids) give each token its segment
(a sentence pair's second text: 1); without them every token is of type 0, as transformers
computes with token_type_ids=None. `attention_mask` hides padding from every query.

Heads (`num_labels`):
- 0, masked LM: a transform (dense h -> h, GELU, LayerNorm) on every token, then logits against
  the tied token table plus an output bias per vocabulary entry, cross-entropy over the labelled
  positions only (targets -100 are ignored; the mean is over the replica's labelled targets).
  The transform is `Mode.dense`: in serial, 2d and subgraph the mode's own first MLP linear
  (its output is the residual layout); in 1d replicated on every rank, as Megatron's BERT head is;
  in 3d split by columns over l after an all-gather along l. Its LayerNorm is the mode's norm.
  The output bias is split like the vocabulary of the mode's logits (1d over tp, 2d over the
  columns j, 3d over j) and replicated where other ranks score other tokens (2d rows, the 3d
  (i, l) plane, subgraph's common ranks), whose gradients are summed there.
- n > 0, classification: the first token's vector of every sequence (`Mode.pool`: gathered, so
  that every rank of the replica holds all B of them), then the pooler (dense h -> h, tanh),
  dropout and the classifier (h -> n), run replicated on every rank of the replica. The head is
  h² + h·n + h + n parameters (under 0.6M for BERT-base against its 110M): splitting it would
  cost a collective per step for no memory worth having, and identical inputs on every rank give
  identical gradients, so nothing is summed. Under D&SP-cSub, the idle ranks run it too.

HuggingFace: BertForMaskedLM (num_labels 0) and BertForSequenceClassification (its num_labels);
nn.Linear keeps W[out, in], lattice W[in, out], so every matrix is transposed; query, key and
value are the attention IN linear's segments q, k, v. Importing a BertForMaskedLM's encoder into
a classifier (fine-tuning) is the trainer's `--init-from`, which leaves the pooler and
classifier at their initial values. Refused: an activation other than the exact GELU, relative
position embeddings, a decoder (is_decoder / cross-attention). transformers' two dropout rates
must agree (lattice has one), unless a BertConfig passed beside the model says which to use.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from lattice.models.base import Model, ModelConfig, Parts
from lattice.models.components import MLP, Dropout, ReplicatedLinear, SelfAttention, residual_dropout
from lattice.models.hf import HFMapping, HFTensor, transformers_module
from lattice.models.registry import register
from lattice.modes.kernels.layers import upcast
from lattice.parallel.context import LatticeConfigError


@dataclass
class BertConfig(ModelConfig):
    vocab_size: int = 30522
    seq_len: int = 512  # transformers' max_position_embeddings
    d_model: int = 768
    n_heads: int = 12
    n_layers: int = 12
    intermediate_size: int = 3072
    type_vocab_size: int = 2
    num_labels: int = 0  # 0: masked-LM pre-training; else the classes of a sequence
    layer_norm_eps: float = 1e-12
    dropout: float = 0.0  # on the embeddings, residual branches, attention weights and pooled vector
    init_std: float = 0.02  # transformers' initializer_range
    tie_embeddings: bool = True  # the MLM decoder is the token table (BERT's is always tied)

    # tiny: the tests' and examples'; small: trains on the built-in data in minutes on 2 cores
    # (sizes divide by 2, 3 and 4); the rest: the published shapes (Devlin et al., Table 1 note)
    presets = {
        "tiny": dict(seq_len=64, d_model=64, n_heads=4, n_layers=2, intermediate_size=256),
        "small": dict(seq_len=128, d_model=192, n_heads=12, n_layers=4, intermediate_size=768),
        "bert-base": dict(vocab_size=30522, seq_len=512, d_model=768, n_heads=12, n_layers=12,
                          intermediate_size=3072, dropout=0.1),
        "bert-large": dict(vocab_size=30522, seq_len=512, d_model=1024, n_heads=16, n_layers=24,
                           intermediate_size=4096, dropout=0.1),
    }

    def __post_init__(self):
        self.check_positive("vocab_size", "seq_len", "d_model", "n_heads", "n_layers", "intermediate_size",
                            "type_vocab_size")
        if isinstance(self.num_labels, bool) or not isinstance(self.num_labels, int) or self.num_labels < 0:
            raise LatticeConfigError(f"num_labels must be 0 (masked LM) or a number of classes, got "
                                     f"{self.num_labels!r}")
        if self.num_labels == 1:
            raise LatticeConfigError("num_labels = 1 would be regression, which is not implemented; use 2 or more "
                                     "classes, or 0 for masked-LM pre-training")
        if self.d_model % self.n_heads:
            raise LatticeConfigError(f"d_model = {self.d_model} is not divisible by n_heads = {self.n_heads}; choose "
                                     f"n_heads among the divisors of d_model")
        if not self.tie_embeddings:
            raise LatticeConfigError("BERT's masked-LM decoder is the token table: tie_embeddings must be True")
        if not 0.0 <= self.dropout < 1.0:
            raise LatticeConfigError(f"dropout must be in [0, 1), got {self.dropout}")

    @property
    def head_size(self) -> int:
        return self.d_model // self.n_heads


class BertLayer(nn.Module):
    """Post-LayerNorm: x = ln_1(x + attn(x)), then x = ln_2(x + mlp(x))."""

    def __init__(self, cfg: BertConfig, mode, seeds):
        super().__init__()
        norm = dict(eps=cfg.layer_norm_eps, bias=True)
        self.attn = SelfAttention(mode, seeds, d_model=cfg.d_model, n_heads=cfg.n_heads, dropout=cfg.dropout,
                                  bias=True, causal=False, segmented=True)
        self.ln_1 = mode.norm("layer", **norm)
        self.mlp = MLP(mode, seeds, d_model=cfg.d_model, hidden=cfg.intermediate_size, activation="gelu", bias=True,
                       dropout=cfg.dropout)
        self.ln_2 = mode.norm("layer", **norm)

    def forward(self, x, cache: dict | None = None, start: int = 0, keep=None):
        if cache is not None:
            raise LatticeConfigError("BERT is an encoder: it has no generation cache")
        x = self.ln_1(x + self.attn(x, keep=keep))
        return self.ln_2(x + self.mlp(x))


class BertHF(HFMapping):
    model_type, model_class, label = "bert", "BertForMaskedLM", "BERT"
    CLASSIFIER = "BertForSequenceClassification"
    _LAYER = (("attention.self.query.weight", "attn.qkv.q.weight", True),
              ("attention.self.query.bias", "attn.qkv.q.bias", False),
              ("attention.self.key.weight", "attn.qkv.k.weight", True),
              ("attention.self.key.bias", "attn.qkv.k.bias", False),
              ("attention.self.value.weight", "attn.qkv.v.weight", True),
              ("attention.self.value.bias", "attn.qkv.v.bias", False),
              ("attention.output.dense.weight", "attn.proj.weight", True),
              ("attention.output.dense.bias", "attn.proj.bias", False),
              ("attention.output.LayerNorm.weight", "ln_1.weight", False),
              ("attention.output.LayerNorm.bias", "ln_1.bias", False),
              ("intermediate.dense.weight", "mlp.fc.weight", True), ("intermediate.dense.bias", "mlp.fc.bias", False),
              ("output.dense.weight", "mlp.proj.weight", True), ("output.dense.bias", "mlp.proj.bias", False),
              ("output.LayerNorm.weight", "ln_2.weight", False), ("output.LayerNorm.bias", "ln_2.bias", False))
    _BUFFERS = ("embeddings.position_ids", "embeddings.token_type_ids")

    def class_name(self, cfg) -> str:
        return self.CLASSIFIER if cfg.num_labels else self.model_class

    def exported_classes(self):
        return (self.model_class, self.CLASSIFIER)

    def config_from_hf(self, c, given=None):
        if getattr(c, "model_type", None) != "bert":
            raise LatticeConfigError(f"expected a BERT config (model_type 'bert'), got model_type "
                                     f"{getattr(c, 'model_type', None)!r}")
        if c.hidden_act != "gelu":
            raise LatticeConfigError(f"hidden_act={c.hidden_act!r} is not implemented; lattice's BERT uses the exact "
                                     f"(erf) gelu")
        if getattr(c, "position_embedding_type", "absolute") not in (None, "absolute"):
            raise LatticeConfigError(f"position_embedding_type={c.position_embedding_type!r} is not implemented; "
                                     f"lattice's BERT has absolute positions")
        if getattr(c, "is_decoder", False) or getattr(c, "add_cross_attention", False):
            raise LatticeConfigError("a BERT decoder (is_decoder / add_cross_attention) is not implemented; lattice's "
                                     "BERT is an encoder")
        rates = {"hidden_dropout_prob": c.hidden_dropout_prob,
                 "attention_probs_dropout_prob": c.attention_probs_dropout_prob}
        if getattr(c, "classifier_dropout", None) is not None:
            rates["classifier_dropout"] = c.classifier_dropout
        if given is None and len(set(rates.values())) != 1:
            raise LatticeConfigError(f"lattice has one dropout rate but the BERT config has {rates}; pass a BertConfig "
                                     f"with the rate to use beside the model")
        classifier = self.CLASSIFIER in (getattr(c, "architectures", None) or ())
        cfg = BertConfig(vocab_size=c.vocab_size, seq_len=c.max_position_embeddings, d_model=c.hidden_size,
                         n_heads=c.num_attention_heads, n_layers=c.num_hidden_layers,
                         intermediate_size=c.intermediate_size, type_vocab_size=c.type_vocab_size,
                         num_labels=c.num_labels if classifier else 0, layer_norm_eps=c.layer_norm_eps,
                         dropout=float(given.dropout if given is not None else c.hidden_dropout_prob),
                         init_std=c.initializer_range)
        return self.with_given(cfg, given)

    def config_to_hf(self, cfg):
        return transformers_module().BertConfig(
            vocab_size=cfg.vocab_size, max_position_embeddings=cfg.seq_len, hidden_size=cfg.d_model,
            num_attention_heads=cfg.n_heads, num_hidden_layers=cfg.n_layers, intermediate_size=cfg.intermediate_size,
            type_vocab_size=cfg.type_vocab_size, hidden_act="gelu", hidden_dropout_prob=cfg.dropout,
            attention_probs_dropout_prob=cfg.dropout, layer_norm_eps=cfg.layer_norm_eps,
            initializer_range=cfg.init_std, num_labels=cfg.num_labels or 2, architectures=[self.class_name(cfg)],
            tie_word_embeddings=True, pad_token_id=None)

    def tensors(self, cfg):
        h, v, inner = cfg.d_model, cfg.vocab_size, cfg.intermediate_size
        lattice_shapes = {"attn.qkv.q.weight": (h, h), "attn.qkv.k.weight": (h, h), "attn.qkv.v.weight": (h, h),
                          "attn.proj.weight": (h, h), "mlp.fc.weight": (h, inner), "mlp.proj.weight": (inner, h),
                          "mlp.fc.bias": (inner,)}
        e = "bert.embeddings."
        out = [HFTensor(e + "word_embeddings.weight", "embed.wte", (v, h)),
               HFTensor(e + "position_embeddings.weight", "embed.wpe", (cfg.seq_len, h)),
               HFTensor(e + "token_type_embeddings.weight", "embed.wtype", (cfg.type_vocab_size, h)),
               HFTensor(e + "LayerNorm.weight", "embed_norm.weight", (h,)),
               HFTensor(e + "LayerNorm.bias", "embed_norm.bias", (h,))]
        for i in range(cfg.n_layers):
            for hf_name, name, transpose in self._LAYER:
                shape = lattice_shapes.get(name, (h,))
                out.append(HFTensor(f"bert.encoder.layer.{i}.{hf_name}", f"blocks.{i}.{name}",
                                    tuple(reversed(shape)) if transpose else shape, transpose))
        if cfg.num_labels:
            out += [HFTensor("bert.pooler.dense.weight", "pooler.weight", (h, h), True),
                    HFTensor("bert.pooler.dense.bias", "pooler.bias", (h,)),
                    HFTensor("classifier.weight", "classifier.weight", (cfg.num_labels, h), True),
                    HFTensor("classifier.bias", "classifier.bias", (cfg.num_labels,))]
        else:
            p = "cls.predictions."
            out += [HFTensor(p + "transform.dense.weight", "mlm_dense.weight", (h, h), True),
                    HFTensor(p + "transform.dense.bias", "mlm_dense.bias", (h,)),
                    HFTensor(p + "transform.LayerNorm.weight", "mlm_norm.weight", (h,)),
                    HFTensor(p + "transform.LayerNorm.bias", "mlm_norm.bias", (h,)),
                    HFTensor(p + "bias", "head.bias", (v,))]
        return out

    def tied(self, cfg):
        if cfg.num_labels:
            return []
        return [("cls.predictions.decoder.weight", "bert.embeddings.word_embeddings.weight"),
                ("cls.predictions.decoder.bias", "cls.predictions.bias")]

    def normalize(self, state_dict):
        # index buffers, not weights
        return {k: t for k, t in state_dict.items() if not k.endswith(self._BUFFERS)}


BERT_HF = BertHF()


@register
class Bert(Model):
    """A BERT encoder with its masked-LM head or its classification branch, holding only this
    rank's shards. Parameter names are the serial model's."""

    name = "bert"
    config_class = BertConfig
    hf = BERT_HF
    tasks = ("mlm", "classify")
    # both branches; V = 61 is padded where a mode splits the vocabulary; heads and d_model divide
    # by every degree the test layouts use
    test_shapes = (dict(vocab_size=61, seq_len=12, d_model=24, n_heads=4, n_layers=2, intermediate_size=40),
                   dict(vocab_size=64, seq_len=12, d_model=24, n_heads=4, n_layers=2, intermediate_size=40,
                        num_labels=3))

    def build(self):
        cfg, mode = self.cfg, self.mode
        norm = dict(eps=cfg.layer_norm_eps, bias=True)
        self.embed = mode.embedding(positions=True, types=cfg.type_vocab_size)
        self.embed_norm = mode.norm("layer", **norm)
        self.drop = residual_dropout(cfg.dropout, mode, self.seeds)
        self.blocks = nn.ModuleList(BertLayer(cfg, mode, self.seeds) for _ in range(cfg.n_layers))
        if cfg.num_labels:
            self.pooler = ReplicatedLinear(self.ctx, cfg.d_model, cfg.d_model)
            self.pool_drop = Dropout(cfg.dropout, self.seeds, "replicated")  # the pooled vector is the replica's
            self.classifier = ReplicatedLinear(self.ctx, cfg.d_model, cfg.num_labels)
        else:
            self.mlm_dense = mode.dense(cfg.d_model, cfg.d_model, bias=True)
            self.mlm_norm = mode.norm("layer", **norm)
            self.head = mode.lm_head(self.embed, bias=True)

    def forward(self, tokens, targets=None, **kwargs):
        self._replica_batch = tokens.shape[0]  # the pooled head gathers every sequence of it
        return super().forward(tokens, targets, **kwargs)

    def init_std(self, name):
        return self.cfg.init_std  # transformers' BertPreTrainedModel: one std for every matrix

    def type_count(self):
        return self.cfg.type_vocab_size

    def embed_tokens(self, tokens, start=0, token_types=None, positions=None):
        return self.drop(self.embed_norm(self.embed(tokens, start, token_types, positions)))

    def _transform(self, x):  # the MLM transform, residual layout in and out
        return self.mlm_norm(F.gelu(self.mlm_dense(x)))

    def _class_logits(self, x, batch: int):  # (B, num_labels) on every rank of the replica
        pooled = torch.tanh(self.pooler(self.mode.pool(x, 0, batch)))
        return self.classifier(self.pool_drop(pooled))

    def head_loss(self, x, targets):
        if self.cfg.num_labels:
            return F.cross_entropy(upcast(self._class_logits(x, targets.shape[0])), targets)
        return self.head.loss(self._transform(x), targets)

    def head_logits(self, x):
        """Masked LM: full (B, T, V) logits; classification: (B, num_labels) class logits."""
        if self.cfg.num_labels:
            return self._class_logits(x, self._replica_batch)
        return self.head.logits(self._transform(x))

    def check_targets(self, tokens, targets):
        if not self.cfg.num_labels:
            return super().check_targets(tokens, targets)
        if targets.shape != tokens.shape[:1]:
            raise LatticeConfigError(f"classification targets must be one class id per sequence, shape "
                                     f"({tokens.shape[0]},); got {tuple(targets.shape)}")

    def parts(self):
        last = ("pooler", "pool_drop", "classifier") if self.cfg.num_labels else ("mlm_dense", "mlm_norm", "head")
        return Parts(first=("embed", "embed_norm", "drop"), blocks="blocks", last=last,
                     shared=() if self.cfg.num_labels else ("embed.wte",))

    def cost_layout(self, b):
        cfg = self.cfg
        h, inner = cfg.d_model, cfg.intermediate_size
        if b.first:  # (a pipeline's first stage alone embeds, its last alone runs the head)
            b.embedding(positions=True, types=cfg.type_vocab_size)
            b.norm("layer", bias=True)
        with b.layer():
            b.linear(h, 3 * h, block="attention", position="in", bias=True)
            b.attention(heads=cfg.n_heads, kv_heads=cfg.n_heads, head_size=cfg.head_size, causal=False)
            b.linear(h, h, block="attention", position="out", bias=True, input_from_attention=True)
            b.norm("layer", bias=True)
            b.linear(h, inner, block="mlp", position="in", bias=True)
            b.activation(inner, kind="gelu")
            b.linear(inner, h, block="mlp", position="out", bias=True)
            b.norm("layer", bias=True)
        if not b.last:
            return
        if cfg.num_labels:
            b.classifier(cfg.num_labels, pooler=True)
        else:
            b.dense(h, h, bias=True, activation="gelu")
            b.norm("layer", bias=True)
            b.lm_head()
