"""T5 (Raffel et al. 2020): encoder-decoder Transformers, written once against the mode interface.

    cfg = T5Config.preset("tiny", vocab_size=2048)
    model = lattice.build_model(cfg, lattice.init("2d", tp=4))
    loss = model(tokens, targets)      # tokens: the encoder input (B, S); targets: transformers' labels (B, T)
    out = model.generate(tokens, 16)   # greedy: the decoder's tokens (B, <= 1 + 16), the start token first

An encoder stack and a decoder stack of pre-norm blocks with T5's scale-only norm (RMSNorm, no
bias): the encoder's blocks are bidirectional self-attention and a feed-forward block; the
decoder's are causal self-attention, cross-attention (queries from the decoder, keys and values
from the encoder's output: `components.CrossAttention`) and a feed-forward block. No biases
anywhere, and no 1/sqrt(d) in attention (T5 folds it into its initialisation). Positions enter
only as a relative position bias: a learned (buckets, n_heads) table per stack, computed once
per forward and shared by the stack's layers, split over the ranks like the heads
(`Mode.per_head`); bidirectional buckets in the encoder, causal ones in the decoder. The
feed-forward block is T5 v1.0's ReLU (`feed_forward_proj="relu"`) or v1.1's gated GELU
("gated-gelu": the tanh GELU of the gate times a linear unit); its hidden features have dropout
too. One token table feeds both stacks; the LM head is that table scaled by d_model^-0.5
(`tie_embeddings`, v1.0) or a table of its own, unscaled (v1.1).

`model(tokens, targets)` is transformers' `T5ForConditionalGeneration(input_ids=tokens,
labels=targets).loss`: the decoder reads the labels shifted right behind the decoder start token
(-100 read as the pad token) and the loss is the mean cross-entropy over the labels that are not
-100. Without targets, `model(tokens, decoder_tokens=d)` returns the (B, T, V) logits of
decoder input d (default: the start token alone). `attention_mask` (B, S) is the sources'
padding, as transformers' T5 takes it: neither the encoder nor the decoder's cross-attention
reads a padded source position (padded labels are -100).

Every mode splits the heads of self- and cross-attention alike (sub-graph parallelism enters a
branch from the decoder's stream for q, from the encoder's output for k and v). Pipeline stages
cut the encoder's blocks, then the decoder's (`parts`): the stage that runs the encoder's last
block finishes it (its norm: the memory) and embeds the decoder's tokens, and from there every
stage sends the decoder's stream and the memory on, the memory's gradient flowing back through
every decoder stage to the encoder's; the token table and each stack's position bias have a copy
on every stage, their gradients summed over the pipeline (GPipe and 1F1B; the cost model counts
both streams' traffic).

HuggingFace (T5ForConditionalGeneration): nn.Linear keeps W[out, in], lattice W[in, out], so
every projection is transposed; q, k, v are the self-attention IN linear's segments, k and v the
cross-attention `kv` linear's; wi (or wi_0, wi_1: gate and up) and wo the feed-forward block's.
transformers 5 always ties its `lm_head` in memory and says untied by `scale_decoder_outputs` =
False (an lm_head that differs from the table is then loaded as its own); transformers 4 by
tie_word_embeddings. Refused: a feed-forward activation lattice does not implement.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from lattice.models.base import ModelConfig, Parts
from lattice.models.components import MLP, CrossAttention, SelfAttention, bucketed_bias, residual_dropout
from lattice.models.encoder_decoder import EncoderDecoderLM
from lattice.models.hf import HFMapping, HFTensor, transformers_module
from lattice.models.registry import register
from lattice.parallel.context import LatticeConfigError
from lattice.parallel.context_parallel import context_positions, take_context_chunks

# transformers' feed_forward_proj -> (lattice activation, gated); "gated-gelu" is the tanh GELU there
FEED_FORWARD = {"relu": ("relu", False), "gated-gelu": ("gelu_tanh", True), "gelu": ("gelu", False),
                "gated-relu": ("relu", True), "silu": ("silu", False), "gated-silu": ("silu", True)}


@dataclass
class T5Config(ModelConfig):
    vocab_size: int = 32128
    seq_len: int = 512  # the longest source (encoder input)
    target_len: int = 128  # the longest target (decoder input and labels)
    d_model: int = 512
    n_heads: int = 8
    head_size: int = 64  # transformers' d_kv; n_heads * head_size need not be d_model
    n_layers: int = 6  # encoder blocks
    n_decoder_layers: int = 0  # 0: as many as the encoder
    d_ff: int = 2048
    feed_forward_proj: str = "relu"  # "relu" (T5 v1.0) or "gated-gelu" (v1.1); see FEED_FORWARD
    relative_buckets: int = 32
    relative_max_distance: int = 128
    norm_eps: float = 1e-6
    dropout: float = 0.0  # everywhere T5 applies its dropout_rate
    tie_embeddings: bool = True  # the LM head is the token table times d_model^-0.5 (v1.0); v1.1: its own
    pad_token_id: int = 0
    decoder_start_token_id: int = 0
    eos_token_id: int | None = 1  # generation stops a sequence there (None: never)
    init_factor: float = 1.0  # transformers' initializer_factor

    # tiny: the tests'; small: learns the built-in pair task (reversing windows of seq_len tokens)
    # in minutes on 2 cores; both: sources of 8, targets of 10 (8 tokens, [EOS] and one ignored
    # label, lengths a sequence-parallel tp = 2 divides); the rest: the published shapes (T5 1.0
    # and 1.1) and SUPER's T5-Large-Mod (§V-E: T5-Large with 32 heads; head size 32 assumed)
    presets = {
        "tiny": dict(seq_len=8, target_len=10, d_model=64, n_heads=4, head_size=16, n_layers=2, d_ff=128),
        "small": dict(seq_len=8, target_len=10, d_model=128, n_heads=4, head_size=32, n_layers=2, d_ff=512),
        # the published sizes, with their vocabulary (32128 rows) and context (512 source tokens)
        "t5-small": dict(vocab_size=32128, seq_len=512, d_model=512, n_heads=8, head_size=64, n_layers=6, d_ff=2048,
                         dropout=0.1),
        "t5-base": dict(vocab_size=32128, seq_len=512, d_model=768, n_heads=12, head_size=64, n_layers=12, d_ff=3072,
                        dropout=0.1),
        "t5-large": dict(vocab_size=32128, seq_len=512, d_model=1024, n_heads=16, head_size=64, n_layers=24,
                         d_ff=4096, dropout=0.1),
        "t5-large-mod": dict(vocab_size=32128, seq_len=512, d_model=1024, n_heads=32, head_size=32, n_layers=24,
                             d_ff=4096, dropout=0.1),
        "t5-v1_1-base": dict(vocab_size=32128, seq_len=512, d_model=768, n_heads=12, head_size=64, n_layers=12,
                             d_ff=2048, dropout=0.1, feed_forward_proj="gated-gelu", tie_embeddings=False),
    }
    default_preset = "small"

    def __post_init__(self):
        self.check_positive("vocab_size", "seq_len", "target_len", "d_model", "n_heads", "head_size", "n_layers",
                            "d_ff", "relative_buckets", "relative_max_distance")
        if isinstance(self.n_decoder_layers, bool) or not isinstance(self.n_decoder_layers, int) \
                or self.n_decoder_layers < 0:
            raise LatticeConfigError(f"n_decoder_layers must be 0 (as many as n_layers) or a positive integer, got "
                                     f"{self.n_decoder_layers!r}")
        self.n_decoder_layers = self.n_decoder_layers or self.n_layers
        if self.feed_forward_proj not in FEED_FORWARD:
            raise LatticeConfigError(f"feed_forward_proj={self.feed_forward_proj!r} is not implemented; choose one of "
                                     f"{', '.join(FEED_FORWARD)}")
        if self.relative_buckets < 4:
            raise LatticeConfigError(f"relative_buckets = {self.relative_buckets} leaves no logarithmic buckets; use "
                                     f"at least 4 (T5 uses 32)")
        if not 0.0 <= self.dropout < 1.0:
            raise LatticeConfigError(f"dropout must be in [0, 1), got {self.dropout}")
        for name in ("pad_token_id", "decoder_start_token_id", "eos_token_id"):
            value = getattr(self, name)
            if value is not None and not 0 <= value < self.vocab_size:
                raise LatticeConfigError(f"{name} = {value} is not a token of the vocabulary of {self.vocab_size}; use "
                                         f"an id below vocab_size")

    @property
    def inner(self) -> int:
        """Width of attention's heads together (n_heads * head_size)."""
        return self.n_heads * self.head_size


class T5Block(nn.Module):
    """x + attn(ln_1(x)) with the stack's position bias (causal in the decoder), in the decoder
    then + cross(ln_cross(x), memory), then + ff(ln_2(x))."""

    def __init__(self, cfg: T5Config, mode, seeds, decoder: bool):
        super().__init__()
        activation, gated = FEED_FORWARD[cfg.feed_forward_proj]
        heads = dict(d_model=cfg.d_model, n_heads=cfg.n_heads, head_size=cfg.head_size, dropout=cfg.dropout,
                     bias=False, scale=1.0)
        self.ln_1 = mode.norm("rms", eps=cfg.norm_eps, bias=False)
        self.attn = SelfAttention(mode, seeds, **heads, causal=decoder, segmented=True)
        if decoder:
            self.ln_cross = mode.norm("rms", eps=cfg.norm_eps, bias=False)
            self.cross = CrossAttention(mode, seeds, **heads)
        self.ln_2 = mode.norm("rms", eps=cfg.norm_eps, bias=False)
        self.mlp = MLP(mode, seeds, d_model=cfg.d_model, hidden=cfg.d_ff, activation=activation, gated=gated,
                       bias=False, dropout=cfg.dropout, hidden_dropout=True)

    def forward(self, x, position_bias, memory=None, cache: dict | None = None, start: int = 0, keep=None,
                memory_keep=None):
        """`cache` (the decoder's generation): {"self": .., "cross": ..}, this layer's keys and
        values. `keep`, `memory_keep`: this rank's padding masks of x and of the memory."""
        x = x + self.attn(self.ln_1(x), cache=None if cache is None else cache["self"], start=start,
                          bias=lambda *_: position_bias, keep=keep)
        if memory is not None:
            x = x + self.cross(self.ln_cross(x), memory, cache=None if cache is None else cache["cross"],
                               keep=memory_keep)
        return x + self.mlp(self.ln_2(x))


class T5HF(HFMapping):
    model_type, model_class, label = "t5", "T5ForConditionalGeneration", "T5"
    # (HF layer, HF module, lattice module, its q / k / v / o) of a decoder block's attentions
    _ATTENTIONS = ((0, "SelfAttention", "attn", ("qkv.q", "qkv.k", "qkv.v", "proj")),
                   (1, "EncDecAttention", "cross", ("q", "kv.k", "kv.v", "proj")))

    def config_from_hf(self, c, given=None):
        if getattr(c, "model_type", None) != "t5":
            raise LatticeConfigError(f"expected a T5 config (model_type 't5'), got model_type "
                                     f"{getattr(c, 'model_type', None)!r}")
        proj = c.feed_forward_proj
        if proj not in FEED_FORWARD:
            raise LatticeConfigError(f"feed_forward_proj={c.feed_forward_proj!r} is not implemented; lattice "
                                     f"implements {', '.join(FEED_FORWARD)}")
        scaled = getattr(c, "scale_decoder_outputs", None)  # transformers 5 says "untied" by not scaling
        tied = bool(c.tie_word_embeddings if scaled is None else scaled)
        start, eos = getattr(c, "decoder_start_token_id", None), c.eos_token_id
        cfg = T5Config(vocab_size=c.vocab_size, seq_len=given.seq_len if given else 512,
                       target_len=given.target_len if given else 128, d_model=c.d_model, n_heads=c.num_heads,
                       head_size=c.d_kv, n_layers=c.num_layers, n_decoder_layers=c.num_decoder_layers or c.num_layers,
                       d_ff=c.d_ff, feed_forward_proj=proj, relative_buckets=c.relative_attention_num_buckets,
                       relative_max_distance=c.relative_attention_max_distance, norm_eps=c.layer_norm_epsilon,
                       dropout=float(c.dropout_rate), tie_embeddings=tied, pad_token_id=c.pad_token_id or 0,
                       decoder_start_token_id=(c.pad_token_id or 0) if start is None else start,
                       eos_token_id=eos[0] if isinstance(eos, (list, tuple)) else eos,
                       init_factor=c.initializer_factor)
        return self.with_given(cfg, given)

    def config_to_hf(self, cfg):
        return transformers_module().T5Config(
            vocab_size=cfg.vocab_size, d_model=cfg.d_model, d_kv=cfg.head_size, d_ff=cfg.d_ff,
            num_layers=cfg.n_layers, num_decoder_layers=cfg.n_decoder_layers, num_heads=cfg.n_heads,
            relative_attention_num_buckets=cfg.relative_buckets,
            relative_attention_max_distance=cfg.relative_max_distance, dropout_rate=cfg.dropout,
            layer_norm_epsilon=cfg.norm_eps, initializer_factor=cfg.init_factor,
            feed_forward_proj=cfg.feed_forward_proj, tie_word_embeddings=cfg.tie_embeddings,
            pad_token_id=cfg.pad_token_id, eos_token_id=cfg.eos_token_id,
            decoder_start_token_id=cfg.decoder_start_token_id)

    def tensors(self, cfg):
        h, inner, ff, v = cfg.d_model, cfg.inner, cfg.d_ff, cfg.vocab_size
        gated = FEED_FORWARD[cfg.feed_forward_proj][1]
        ffn = ((("wi_0", "fc.gate", (ff, h)), ("wi_1", "fc.up", (ff, h))) if gated else (("wi", "fc", (ff, h)),))
        ffn += (("wo", "proj", (h, ff)),)
        out = [HFTensor("shared.weight", "embed.wte", (v, h))]
        for stack, layers in (("encoder", cfg.n_layers), ("decoder", cfg.n_decoder_layers)):
            out.append(HFTensor(f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
                                f"{stack}_bias.weight", (cfg.relative_buckets, cfg.n_heads)))
            attentions = self._ATTENTIONS if stack == "decoder" else self._ATTENTIONS[:1]
            for i in range(layers):
                hf, ours = f"{stack}.block.{i}.layer.", f"{stack}.{i}."
                for layer, module, mine, names in attentions:
                    for name, lattice_name in zip("qkvo", names):
                        out.append(HFTensor(f"{hf}{layer}.{module}.{name}.weight", f"{ours}{mine}.{lattice_name}.weight",
                                            (h, inner) if name == "o" else (inner, h), True))
                    out.append(HFTensor(f"{hf}{layer}.layer_norm.weight",
                                        f"{ours}{'ln_1' if mine == 'attn' else 'ln_cross'}.weight", (h,)))
                ff_layer = len(attentions)
                for name, lattice_name, shape in ffn:
                    out.append(HFTensor(f"{hf}{ff_layer}.DenseReluDense.{name}.weight", f"{ours}mlp.{lattice_name}.weight",
                                        shape, True))
                out.append(HFTensor(f"{hf}{ff_layer}.layer_norm.weight", f"{ours}ln_2.weight", (h,)))
            out.append(HFTensor(f"{stack}.final_layer_norm.weight", f"{stack}_norm.weight", (h,)))
        if not cfg.tie_embeddings:
            out.append(HFTensor("lm_head.weight", "head.weight", (v, h)))
        return out

    def tied(self, cfg):
        copies = [("encoder.embed_tokens.weight", "shared.weight"), ("decoder.embed_tokens.weight", "shared.weight")]
        return copies + ([("lm_head.weight", "shared.weight")] if cfg.tie_embeddings else [])


T5_HF = T5HF()


@register
class T5(EncoderDecoderLM):
    """A T5 encoder-decoder holding only this rank's shards. Parameter names are the serial
    model's."""

    name = "t5"
    config_class = T5Config
    hf = T5_HF
    tasks = ("seq2seq",)
    # the built-in pair task at the small preset: exact match ~0.5 after 2000 steps (2 min on 2 cores)
    train_defaults = {"steps": 2000, "batch_size": 32, "warmup": 100}
    # both feed-forward variants, tied and untied; more decoder than encoder layers; T = 8 sources
    # with shorter targets (the conformance batch: cross-attention between lengths); V = 61 padded
    # where a mode splits the vocabulary; 8 buckets with a maximum distance inside the sequence
    test_shapes = (dict(vocab_size=61, seq_len=12, target_len=10, d_model=24, n_heads=4, head_size=6, n_layers=1,
                        n_decoder_layers=3, d_ff=40, relative_buckets=8, relative_max_distance=6),
                   dict(vocab_size=64, seq_len=12, target_len=10, d_model=24, n_heads=4, head_size=8, n_layers=2,
                        d_ff=32, feed_forward_proj="gated-gelu", tie_embeddings=False, relative_buckets=8,
                        relative_max_distance=6))

    def build(self):
        cfg, mode, seeds = self.cfg, self.mode, self.seeds
        layout = self.ctx.layout
        if self.ctx.cp > 1 and layout is not None and layout.cp_attention == "ulysses":
            raise LatticeConfigError("cp_attention 'ulysses' takes no additive position bias (T5's relative one); "
                                     "use cp_attention 'ring' or 'all_gather'")
        self.embed = mode.embedding(positions=False)
        self.encoder_drop = residual_dropout(cfg.dropout, mode, seeds)
        self.encoder_bias = mode.per_head((cfg.relative_buckets, cfg.n_heads), 1)
        self.encoder = nn.ModuleList(T5Block(cfg, mode, seeds, False) for _ in range(cfg.n_layers))
        self.encoder_norm = mode.norm("rms", eps=cfg.norm_eps, bias=False)
        self.encoder_out_drop = residual_dropout(cfg.dropout, mode, seeds)
        self.decoder_drop = residual_dropout(cfg.dropout, mode, seeds)
        self.decoder_bias = mode.per_head((cfg.relative_buckets, cfg.n_heads), 1)
        self.decoder = nn.ModuleList(T5Block(cfg, mode, seeds, True) for _ in range(cfg.n_decoder_layers))
        self.decoder_norm = mode.norm("rms", eps=cfg.norm_eps, bias=False)
        self.decoder_out_drop = residual_dropout(cfg.dropout, mode, seeds)
        self.head = mode.lm_head(self.embed)

    def init_std(self, name):
        """transformers' T5 initialisation (factor f): the token table and an own LM head f; q
        f·(d·d_kv)^-0.5; k, v, wi and the relative bias f·d^-0.5; o f·(n_heads·d_kv)^-0.5; wo
        f·d_ff^-0.5."""
        cfg, f = self.cfg, self.cfg.init_factor
        if name in ("embed.wte", "head.weight"):
            return f
        if name.endswith(("qkv.q.weight", "cross.q.weight")):
            return f * (cfg.d_model * cfg.head_size) ** -0.5
        if name.endswith("attn.proj.weight") or name.endswith("cross.proj.weight"):
            return f * cfg.inner ** -0.5
        if name.endswith("mlp.proj.weight"):
            return f * cfg.d_ff ** -0.5
        return f * cfg.d_model ** -0.5  # k, v, wi (gate, up), the relative biases

    # ---- inputs
    # ---- forward
    def position_bias(self, table: nn.Module, t_q: int, t_k: int, start: int, bidirectional: bool) -> torch.Tensor:
        """(nh_local, t_q, t_k): this rank's heads of a stack's bias for queries at start..; under
        cp, for this rank's chunks of t_q · cp queries against all t_k · cp keys."""
        queries = None
        if self.ctx.cp > 1:
            queries, t_k = context_positions(self.ctx, t_q * self.ctx.cp), t_k * self.ctx.cp
        return bucketed_bias(table, t_q, t_k, start, bidirectional=bidirectional, queries=queries,
                             buckets=self.cfg.relative_buckets, max_distance=self.cfg.relative_max_distance)

    def encode(self, tokens: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
        """The encoder's output (the memory), in the residual layout; `keep`: this rank's
        padding mask of the sources (Model.attention_keep)."""
        S = tokens.shape[1]
        x = self.encoder_drop(self.embed(tokens))
        x = self.run_blocks(x, self.encoder, position_bias=self.position_bias(self.encoder_bias, S, S, 0, True),
                            keep=keep)
        return self.encoder_out_drop(self.encoder_norm(x))

    def decode(self, decoder_tokens: torch.Tensor, memory: torch.Tensor, *, cache: list[dict] | None = None,
               start: int = 0, memory_keep: torch.Tensor | None = None) -> torch.Tensor:
        """The decoder's output for its input at positions start.. (after `start` cached ones);
        `memory_keep`: the sources' padding mask, which cross-attention never reads past."""
        T = decoder_tokens.shape[1]
        x = self.decoder_drop(self.embed(decoder_tokens))
        bias = self.position_bias(self.decoder_bias, T, start + T, start, False)
        if cache is None:
            x = self.run_blocks(x, self.decoder, memory=memory, position_bias=bias, memory_keep=memory_keep)
        else:
            for block, layer_cache in zip(self.decoder, cache):
                x = block(x, bias, memory, cache=layer_cache, start=start, memory_keep=memory_keep)
        return self.decoder_out_drop(self.decoder_norm(x))

    def _head_input(self, x):
        return x * self.cfg.d_model ** -0.5 if self.cfg.tie_embeddings else x

    # ---- pipeline stages: the encoder's blocks, then the decoder's, each stage carrying the
    # encoder's output (the memory) on from the stage that finishes the encoder
    def parts(self):
        return Parts(first=("embed", "encoder_drop", "encoder_bias"), blocks="encoder", decoder="decoder",
                     middle=("encoder_norm", "encoder_out_drop", "decoder_drop", "decoder_bias"),
                     last=("decoder_norm", "decoder_out_drop", "head"),
                     everywhere=("embed.wte", "encoder_bias.weight", "decoder_bias.weight"))

    def boundary_shapes(self, after, batch, seq, target_seq):
        """The source's stream inside the encoder; after its last block, the target's stream and
        the memory (the source's length)."""
        source = tuple(self.mode.residual_shape(batch, seq))
        return (source,) if after < self.cfg.n_layers - 1 else (tuple(self.mode.residual_shape(batch, target_seq)),
                                                                 source)

    def microbatch_inputs(self, tokens, targets, attention_mask, token_types, position_ids=None):
        (decoder_tokens,) = take_context_chunks(self.ctx, self.shift_right(targets))  # under cp, this rank's chunks
        return {"keep": None if attention_mask is None else self.attention_keep(attention_mask),
                "decoder_tokens": decoder_tokens, "source_len": tokens.shape[1] // self.ctx.cp}

    def run_stage(self, values, block_ids, first, last, inputs):
        L, keep, decoder_tokens = self.cfg.n_layers, inputs["keep"], inputs["decoder_tokens"]
        if first:
            x, memory = self.encoder_drop(self.embed(values[0])), None
        else:
            x, memory = values[0], (values[1] if len(values) > 1 else None)
        encoder = [i for i in block_ids if i < L]
        decoder = [i - L for i in block_ids if i >= L]
        if encoder:
            S = inputs["source_len"]
            bias = self.position_bias(self.encoder_bias, S, S, 0, True)
            x = self.run_blocks(x, [self.encoder[i] for i in encoder], position_bias=bias, keep=keep)
            if encoder[-1] == L - 1:  # the memory, and the decoder's stream starts
                memory = self.encoder_out_drop(self.encoder_norm(x))
                x = self.decoder_drop(self.embed(decoder_tokens))
        if decoder:
            T = decoder_tokens.shape[1]
            bias = self.position_bias(self.decoder_bias, T, T, 0, False)
            x = self.run_blocks(x, [self.decoder[j] for j in decoder], memory=memory, position_bias=bias,
                                memory_keep=keep)
        if last:
            return (self._head_input(self.decoder_out_drop(self.decoder_norm(x))),)
        return (x,) if memory is None else (x, memory)

    def head_loss(self, x, targets):
        return self.head.loss(x, targets)

    @staticmethod
    def unpadded_targets(targets, attention_mask):
        """The labels as they are: the mask is the sources', and padded labels are -100 already."""
        return targets

    def cost_layout(self, b):
        """The encoder over the source's b.T tokens, the decoder over the targets' (b.target_T):
        each stack's embedding and position bias, its layers, its final norm; the decoder's
        cross-attention reads the memory (b.T tokens) in every layer; the LM head."""
        cfg = self.cfg
        h, inner, hs, n = cfg.d_model, cfg.inner, cfg.head_size, cfg.n_heads
        activation, gated = FEED_FORWARD[cfg.feed_forward_proj]
        source, target = b.T, b.target_T

        def feed_forward():
            b.norm("rms", bias=False)
            b.linear(h, (2 if gated else 1) * cfg.d_ff, block="mlp", position="in", bias=False)
            b.activation(cfg.d_ff, kind=activation, gated=gated)
            b.linear(cfg.d_ff, h, block="mlp", position="out", bias=False)

        def self_attention(causal):
            b.norm("rms", bias=False)
            b.linear(h, 3 * inner, block="attention", position="in", bias=False)
            # a padded batch's mask is the sources': the encoder's (the decoder reads its own positions)
            b.attention(heads=n, kv_heads=n, head_size=hs, causal=causal, bias=True, shared_bias=True, padding=not causal)
            b.linear(inner, h, block="attention", position="out", bias=False, input_from_attention=True)

        # under a pipeline, this stage's blocks (the encoder's, then the decoder's) and parts
        encoder = sum(1 for i in b.blocks_here if i < cfg.n_layers)
        decoder = sum(1 for i in b.blocks_here if i >= cfg.n_layers)
        middle = cfg.n_layers - 1 in b.blocks_here  # finishes the encoder, embeds the decoder's tokens
        with b.sequence(source):
            if b.first:
                b.embedding(positions=False)
            if encoder:
                b.position_bias()
                with b.layer(count=encoder):
                    self_attention(causal=False)
                    feed_forward()
            if middle:
                with b.on_this_stage():
                    b.norm("rms", bias=False)
            if middle or decoder:
                b.memory()  # computed here, or received with the decoder's stream
        with b.sequence(target):
            if middle:
                with b.on_this_stage():
                    b.embedding(positions=False)
            if not decoder:
                return
            b.position_bias()
            with b.layer(count=decoder):
                self_attention(causal=True)
                b.norm("rms", bias=False)
                b.linear(h, inner, block="attention", position="in", bias=False)
                b.linear(h, 2 * inner, block="attention", position="in", bias=False, from_memory=True)
                b.cross_attention(heads=n, head_size=hs)
                b.linear(inner, h, block="attention", position="out", bias=False, input_from_attention=True)
                feed_forward()
            if b.last:
                b.norm("rms", bias=False)
                b.lm_head()
