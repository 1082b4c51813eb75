"""Components the families share, written once against the mode interface: dropout with
layout-independent masks, self-attention (causal or bidirectional; fused or grouped-query
projections; optional rotary positions, an additive per-head bias and a sliding window), cross-attention from one
stream to another (an encoder-decoder's), the MLP variants and a small replicated linear for
heads over pooled tokens.

Every tensor a component sees is in its mode's layout; attention always gets whole heads of
whole sequences, so the softmax, the rotary embedding and a per-head bias are local.
"""

from __future__ import annotations

import math
import zlib

import torch
import torch.nn as nn
import torch.nn.functional as F

from lattice.modes.base import Block, Position
from lattice.parallel.context import LatticeConfigError, MeshAxis, ParallelContext
from lattice.parallel.comm import all_to_all
from lattice.parallel.context_parallel import Ring, keys_seen, ring_attend, sequence_order
from lattice.parallel.sharding import ShardSpec, register_sharded


class DropoutSeeds:
    """Seeds for dropout masks, as Megatron's RNG tracker keeps them, without global state.

    Two streams: "replicated" for activations identical on every rank of a model replica (same
    mask there, so replicas stay identical), "sharded" for activations that differ per rank
    (independent masks). A mask depends only on (seed, stream, forward count, site), so the
    recomputation under activation checkpointing draws exactly the masks of the first pass.
    """

    def __init__(self, ctx: ParallelContext):
        self.base = ctx.seed
        # the ranks of a cp group hold different tokens of the same sequences: their own masks
        replicated = ctx.coord(MeshAxis.DP) if ctx.cp == 1 else f"{ctx.coord(MeshAxis.DP)}.{ctx.coord(MeshAxis.CP)}"
        self.stream_ids = {"replicated": replicated, "sharded": ctx.rank}
        self.forward_count = 0
        self.sites = 0

    def new_site(self) -> int:
        self.sites += 1
        return self.sites

    def seed(self, stream: str, site: int) -> int:
        key = f"{self.base}/{stream}/{self.stream_ids[stream]}/{self.forward_count}/{site}"
        return zlib.crc32(key.encode()) * 7919 + self.forward_count


class Dropout(nn.Module):
    def __init__(self, p: float, seeds: DropoutSeeds, stream: str):
        super().__init__()
        self.p, self.seeds, self.stream = p, seeds, stream
        self.site = seeds.new_site()

    def forward(self, x):
        if not self.training or self.p == 0.0:
            return x
        gen = torch.Generator(device=x.device).manual_seed(self.seeds.seed(self.stream, self.site))
        keep = torch.rand(x.shape, generator=gen, device=x.device, dtype=torch.float32) >= self.p
        return x * keep.to(x.dtype) / (1.0 - self.p)


def residual_dropout(p: float, mode, seeds: DropoutSeeds) -> Dropout:
    """Dropout on the residual stream: the replicated mask stream where every rank of the
    replica holds the same residual, the sharded one where each holds a different piece."""
    return Dropout(p, seeds, "replicated" if mode.residual_replicated else "sharded")


# ----------------------------------------------------------------------------- rotary positions
def rotary_frequencies(head_size: int, theta: float, scaling: dict | None = None) -> torch.Tensor:
    """RoPE's inverse frequencies theta^(-2i/d), i < d/2, in float32 as transformers and Meta's
    reference compute them (so that imported weights compute the same function); with `scaling`
    of type "llama3" (factor, low_freq_factor, high_freq_factor, original_max_position_embeddings),
    Llama 3's: wavelengths longer than original/low divided by factor, shorter than original/high
    kept, those between blended linearly in original/wavelength."""
    inv = 1.0 / (theta ** (torch.arange(0, head_size, 2, dtype=torch.float32, device="cpu") / head_size))
    if not scaling:
        return inv
    if scaling.get("rope_type", scaling.get("type")) != "llama3":
        raise LatticeConfigError(f"rope_scaling {scaling} is not implemented; lattice implements type 'llama3'")
    missing = {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"} - set(scaling)
    if missing:
        raise LatticeConfigError(f"rope_scaling of type 'llama3' needs {sorted(missing)} as well")
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    original = scaling["original_max_position_embeddings"]
    wavelength = 2 * math.pi / inv
    scaled = torch.where(wavelength > original / low, inv / factor, inv)
    smooth = (original / wavelength - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    between = ~(wavelength < original / high) * ~(wavelength > original / low)
    return torch.where(between, blended, scaled)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (.., T, hs) rotated by RoPE in the half-split convention (transformers' rotate_half)."""
    half = x.shape[-1] // 2
    turned = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + turned * sin


class Rotary:
    """cos and sin of RoPE for positions start..start+T, (T, hs), in the activations' dtype and
    device. The angles and their cos/sin are float32 in every dtype, as in transformers (float64
    models included), computed on the CPU (a model is built on the meta device)."""

    def __init__(self, head_size: int, theta: float, scaling: dict | None = None):
        self.inv_freq = rotary_frequencies(head_size, theta, scaling)

    def __call__(self, start: int, length: int, like: torch.Tensor,
                 positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(T, hs) for positions start.., or (B_l, 1, T, hs) for each sequence's own `positions`
        (B_l, T) (a left-padded batch's)."""
        if positions is None:
            positions = torch.arange(start, start + length, device="cpu")
        angles = positions.cpu().float()[..., None] * self.inv_freq  # (.., T, hs/2)
        angles = torch.cat([angles, angles], dim=-1)
        if angles.dim() == 3:
            angles = angles.unsqueeze(1)  # (B_l, 1, T, hs): the same angles for every head
        return angles.cos().to(like.device, like.dtype), angles.sin().to(like.device, like.dtype)


# ----------------------------------------------------------------------------- attention
class SelfAttention(nn.Module):
    """Multi-head self-attention in the mode's layout: an IN linear to q, k, v (one stacked
    (h, 3, h) weight, `qkv.weight`, when k and v have every head; else segments `qkv.q`,
    `qkv.k`, `qkv.v` with n_kv_heads for k and v, grouped-query attention), attention over
    this rank's whole heads of whole sequences, and an OUT linear `proj` back to the residual.

    `segmented` keeps q, k, v as segments even with every head (BERT's and T5's checkpoints hold
    them apart). `causal` masks future positions (decoders) or not (encoders); `rotary` (a Rotary)
    rotates q and k by their positions; `bias(T_q, T_k, start)` (a module returning (nh_local,
    T_q, T_k)) is added to the scores (T5's relative position bias); `scale` multiplies q·k
    (default 1/sqrt(head_size); T5 folds it into its initialisation: 1). `bias` is the q, k, v
    projections' and, unless `out_bias` says otherwise, the output projection's (Qwen2: q, k, v
    only). `window` (causal only) lets a query see itself and the window - 1 positions before it
    (Mistral's sliding window); a KV cache then keeps only those. Dropout on the attention
    weights draws from the sharded stream, on the output from the residual's."""

    def __init__(self, mode, seeds: DropoutSeeds, *, d_model: int, n_heads: int, n_kv_heads: int | None = None,
                 head_size: int | None = None, dropout: float = 0.0, bias: bool = True, causal: bool = True,
                 rotary: Rotary | None = None, segmented: bool = False, scale: float | None = None,
                 out_bias: bool | None = None, window: int | None = None):
        super().__init__()
        if window is not None and not (causal and window >= 1):
            raise LatticeConfigError(f"a sliding window needs causal attention and at least 1 position, got "
                                     f"window={window} with causal={causal}")
        self.head_size = head_size or d_model // n_heads
        n_kv = n_kv_heads or n_heads
        inner, kv_inner = n_heads * self.head_size, n_kv * self.head_size
        if n_kv == n_heads and inner == d_model and not segmented:
            self.qkv = mode.linear(d_model, d_model, block=Block.ATTENTION, position=Position.IN, stack=3, bias=bias)
            self.stacked = True
        else:
            self.qkv = mode.linear(d_model, inner + 2 * kv_inner, block=Block.ATTENTION, position=Position.IN,
                                   segments=(("q", inner), ("k", kv_inner), ("v", kv_inner)), bias=bias)
            self.stacked = False
        self.proj = mode.linear(inner, d_model, block=Block.ATTENTION, position=Position.OUT,
                                bias=bias if out_bias is None else out_bias)
        self.causal, self.rotary, self.scale, self.window = causal, rotary, scale, window
        self.weights_drop = AttentionDropout(dropout, seeds)
        self.resid_drop = residual_dropout(dropout, mode, seeds)
        split = math.prod(mode.ctx.size(a) for a in mode.head_axes)  # ranks the heads are split over
        self.context = ContextParallel(mode.ctx, dropout, (n_heads // split, n_kv // split))

    def forward(self, x, *, cache: dict | None = None, start: int = 0, bias=None, keep=None, positions=None):
        """`cache` (inference): this layer's keys and values so far, in this rank's layout (its
        heads of its sequences); the new positions' are appended, and a query attends to every
        cached key (one new position) or causally (a prompt, into an empty cache). `keep`: the
        padding mask of this rank's sequences (`Mode.attention_rows`), (B_l, positions so far),
        True where a key is a token, False where it is padding; `positions` (B_l, T): each
        sequence's own positions of x's tokens for the rotary angles (a left-padded batch's),
        else start.. for every sequence."""
        hs = self.head_size
        if self.stacked:
            qkv = self.qkv(x)  # (B_l, T, 3, h_l): this rank's heads
            B, T, _, h_local = qkv.shape
            q, k, v = qkv.view(B, T, 3, h_local // hs, hs).permute(2, 0, 3, 1, 4)  # (B_l, nh_l, T, hs)
        else:
            q, k, v = (split_heads(t, hs) for t in self.qkv(x))  # (B_l, nh_l | nkv_l, T, hs)
            B, T = q.shape[0], q.shape[2]
        if self.rotary is not None:
            cos, sin = self.rotary(start, T, q, positions)
            q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        if cache is not None:
            if "k" in cache:
                if T != 1:
                    raise LatticeConfigError("a KV cache extends one position at a time after the prompt")
                k, v = torch.cat([cache["k"], k], dim=2), torch.cat([cache["v"], v], dim=2)  # (B_l, nkv_l, T_all, hs)
            # under a window the next query sees window - 1 of these, so the cache keeps no more
            kept = k.shape[2] - min(k.shape[2], self.window - 1) if self.window else 0
            cache["k"], cache["v"] = k[:, :, kept:], v[:, :, kept:]
        if self.context.ring_size > 1:  # keys of the whole sequence, bias and `keep` over it
            y = self.context.attend(q, k, v, bias(T, k.shape[2], start) if bias is not None else None,
                                    causal=self.causal, scale=self.scale, window=self.window, keep=keep)
        else:
            y = attend(q, k, v, bias(T, k.shape[2], start) if bias is not None else None,
                       causal=self.causal and (cache is None or T > 1), scale=self.scale, window=self.window,
                       keep=None if keep is None else keep[:, -k.shape[2]:],
                       dropout=self.weights_drop if self.training else None)
        y = y.transpose(1, 2).reshape(B, T, -1)  # (B_l, T, nh_l · hs)
        return self.resid_drop(self.proj(y))


def split_heads(t: torch.Tensor, head_size: int) -> torch.Tensor:
    """(B, T, nh · hs) -> (B, nh, T, hs): a projection's features as its heads."""
    return t.unflatten(-1, (-1, head_size)).transpose(1, 2)


class ContextParallel:
    """An attention's cp group and how it reads the other ranks' keys (`Layout.cp_attention`):
    "ring" (lattice.parallel.context_parallel.ring_attend), "all_gather" (the same blocks, every
    rank's keys and values in one all-gather), or "ulysses" (DeepSpeed-Ulysses: all-to-all from
    chunks of every head to whole sequences of 1/cp of the heads, `attend`, and back; needs
    this rank's query and key heads to divide by cp). The ring's process group exists only once
    lattice.init has run, so it is looked up at the first forward, not when the model is built
    on the meta device. Attention dropout is refused under cp > 1: the ring's blocks would need
    masks that agree with the whole sequence's."""

    def __init__(self, ctx: ParallelContext, dropout: float, heads: tuple[int, ...] = ()):
        self.ctx, self.ring_size, self._ring = ctx, ctx.cp, None
        self.kind = ctx.layout.cp_attention if ctx.layout is not None else "ring"
        if self.ring_size > 1 and dropout > 0:
            raise LatticeConfigError(f"attention dropout ({dropout}) is not implemented under context parallelism "
                                     f"(cp = {self.ring_size}); set dropout to 0 or run with cp = 1")
        if self.ring_size > 1 and self.kind == "ulysses" and any(h % self.ring_size for h in heads):
            raise LatticeConfigError(f"cp_attention 'ulysses' splits each rank's heads over cp = {self.ring_size}, "
                                     f"but this rank holds {' and '.join(map(str, heads))} query and key heads; use "
                                     f"cp_attention 'ring' or a cp that divides them")

    def ring(self) -> Ring:
        if self._ring is None:
            self._ring = Ring(self.ctx)
        return self._ring

    def attend(self, q, k, v, bias=None, *, causal: bool, scale: float | None, window: int | None = None, keep=None):
        """`attend` over the whole sequences of which q, k, v (B_l, heads, T/cp, hs) hold this
        rank's chunks; `keep` (B_l, T) and `bias` (nh_l, T/cp, T) as ring_attend takes them."""
        if self.kind != "ulysses":
            return ring_attend(self.ring(), q, k, v, bias, causal=causal, scale=scale, window=window, keep=keep,
                               gather=self.kind == "all_gather")
        if bias is not None:
            raise LatticeConfigError("cp_attention 'ulysses' takes no additive position bias (T5's); use 'ring'")
        group, cp = self.ctx.group(MeshAxis.CP), self.ring_size

        def whole_sequences(t):  # chunks of every head -> whole sequences of 1/cp of the heads
            gathered = all_to_all(t, group, 1, 2)  # (B_l, heads/cp, T, hs), rank 0's chunks first
            return gathered[:, :, torch.argsort(sequence_order(gathered.shape[2], cp)).to(t.device)]

        y = attend(*map(whole_sequences, (q, k, v)), causal=causal, scale=scale, window=window,
                   keep=keep)  # (B_l, nh_l/cp, T, hs)
        in_rank_order = y[:, :, sequence_order(y.shape[2], cp).to(y.device)].contiguous()
        return all_to_all(in_rank_order, group, 2, 1)  # (B_l, nh_l, T/cp, hs)


class AttentionDropout:
    """The dropout rate of attention weights and its seed: the heads differ per rank, so the
    sharded stream, seeded by the forward count so that recomputation draws the same masks."""

    def __init__(self, p: float, seeds: DropoutSeeds):
        self.p, self.seeds, self.site = p, seeds, seeds.new_site()

    def seed(self) -> int:
        return self.seeds.seed("sharded", self.site)


def attend(q, k, v, bias=None, *, causal: bool, scale: float | None = None, window: int | None = None,
           keep: torch.Tensor | None = None, dropout: AttentionDropout | None = None):
    """softmax(scale · q kᵀ + bias [+ masks]) v over this rank's heads: q (B_l, nh_l, T_q, hs), k
    and v (B_l, nkv_l, T_k, hs) (grouped-query when nkv_l < nh_l), `bias` (nh_l, T_q, T_k) or
    None. The queries are the last T_q positions of the keys': the causal mask lets query i see
    keys up to i + T_k - T_q, and a `window` only the last `window` of those (itself included).
    `keep` (B_l, T_k) bool hides the keys where it is False (padding); int64 document ids (0 at
    padding) also hide the keys of other documents than the query's (packed sequences,
    `keys_seen`); a query left with no key to see (a left pad under the causal mask) sees every
    key instead, so that its output, which nothing reads, stays finite (transformers does the
    same). `dropout` (training only) drops attention weights."""
    gqa = {"enable_gqa": True} if k.shape[1] != q.shape[1] else {}
    t_q, t_k = q.shape[2], k.shape[2]
    allowed = None  # bool (.., T_q, T_k), True attends; None: no mask beyond `causal`
    if window is not None or keep is not None or (causal and bias is not None):
        key = torch.arange(t_k, device=q.device)
        query = key[t_k - t_q:, None]  # (T_q, 1) key positions of the queries
        allowed = torch.ones(t_q, t_k, dtype=torch.bool, device=q.device)
        if causal:
            allowed = allowed & (key <= query)
        if window is not None:
            allowed = allowed & (key > query - window)
        if keep is not None:
            documents = None if keep.dtype == torch.bool else keep[:, t_k - t_q:]  # the queries' own
            allowed = allowed & keys_seen(keep, documents)  # (B_l, 1, T_q, T_k)
            allowed = allowed | ~allowed.any(dim=-1, keepdim=True)
        causal = False
    mask = allowed
    if bias is not None:
        mask = bias.to(q.dtype)
        if allowed is not None:
            mask = mask.masked_fill(~allowed, float("-inf"))
        # with a mask that requires grad the math kernel saves v as a (B·nh, T, hs) copy, except
        # for one local sequence, where its view would keep the whole fused q/k/v output alive
        v = v.contiguous()
    if dropout is not None and dropout.p > 0:
        devices = [q.device] if q.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices, device_type=q.device.type):
            torch.manual_seed(dropout.seed())
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, dropout_p=dropout.p,
                                                  scale=scale, **gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale, **gqa)


class CrossAttention(nn.Module):
    """Attention from one stream to another (an encoder-decoder's): queries from x (the decoder's
    residual), keys and values from `memory` (the encoder's output, in the residual layout too,
    of its own length): an IN linear `q` on x, an IN linear `kv` with segments `k`, `v` on the
    memory (whole heads of both per rank, the same heads as q's), attention over this rank's
    heads with no mask, and an OUT linear `proj` back to x's residual."""

    def __init__(self, mode, seeds: DropoutSeeds, *, d_model: int, n_heads: int, head_size: int,
                 dropout: float = 0.0, bias: bool = False, scale: float | None = None):
        super().__init__()
        self.head_size, self.scale = head_size, scale
        inner = n_heads * head_size
        self.q = mode.linear(d_model, inner, block=Block.ATTENTION, position=Position.IN, bias=bias)
        self.kv = mode.linear(d_model, 2 * inner, block=Block.ATTENTION, position=Position.IN,
                              segments=(("k", inner), ("v", inner)), bias=bias)
        self.proj = mode.linear(inner, d_model, block=Block.ATTENTION, position=Position.OUT, bias=bias)
        self.weights_drop = AttentionDropout(dropout, seeds)
        self.resid_drop = residual_dropout(dropout, mode, seeds)
        split = math.prod(mode.ctx.size(a) for a in mode.head_axes)
        self.context = ContextParallel(mode.ctx, dropout, (n_heads // split,))

    def forward(self, x, memory, *, cache: dict | None = None, keep=None):
        """`cache` (inference): the memory's keys and values in this rank's layout, computed at
        the first call and read at every later one (the memory does not change while decoding).
        `keep`: the memory's padding mask of this rank's sequences, (B_l, S), False at padding."""
        hs = self.head_size
        q = split_heads(self.q(x), hs)  # (B_l, nh_l, T, hs)
        if cache is not None and "k" in cache:
            k, v = cache["k"], cache["v"]
        else:
            k, v = (split_heads(t, hs) for t in self.kv(memory))  # (B_l, nh_l, S, hs)
            if cache is not None:
                cache["k"], cache["v"] = k, v
        if self.context.ring_size > 1:  # the memory's chunks around the ring
            y = self.context.attend(q, k, v, causal=False, scale=self.scale, keep=keep)
        else:
            y = attend(q, k, v, causal=False, scale=self.scale, keep=keep,
                       dropout=self.weights_drop if self.training else None)
        y = y.transpose(1, 2).reshape(q.shape[0], q.shape[2], -1)  # (B_l, T, nh_l · hs)
        return self.resid_drop(self.proj(y))


def relative_buckets(t_q: int, t_k: int, start: int, *, bidirectional: bool, buckets: int,
                     max_distance: int, queries: torch.Tensor | None = None) -> torch.Tensor:
    """T5's bucket of every (query, key) pair, (t_q, t_k) int64, for queries at positions
    start.. and keys at 0..: bidirectional, half the buckets for keys after the query; causal,
    every bucket for keys at or before it. Of a side's n buckets, distances below n/2 have one
    each, the rest share the others logarithmically up to `max_distance` (farther ones the last);
    the logarithm in float32, as T5's own code computes it, so that imported weights see the
    same buckets. `queries` (t_q,): the queries' positions instead (a cp rank's chunks)."""
    if queries is None:
        queries = torch.arange(start, start + t_q)
    distance = torch.arange(t_k)[None, :] - queries.cpu()[:, None]  # key - query
    if bidirectional:
        side = buckets // 2
        base = (distance > 0).long() * side
        far = distance.abs()
    else:
        side, base = buckets, 0
        far = (-distance).clamp_min(0)  # how far back; keys ahead share bucket 0 (the causal mask hides them)
    exact = side // 2
    logarithmic = exact + (torch.log(far.float() / exact) / math.log(max_distance / exact)
                           * (side - exact)).long()
    return base + torch.where(far < exact, far, logarithmic.clamp_max(side - 1))


def bucketed_bias(table: nn.Module, t_q: int, t_k: int, start: int, **rule) -> torch.Tensor:
    """T5's relative position bias from this rank's (buckets, nh_local) table (`Mode.per_head`'s
    module): (nh_local, t_q, t_k) for queries at positions start.. and keys at 0..
    (`relative_buckets`'s rule), added to attention's scores."""
    buckets = relative_buckets(t_q, t_k, start, **rule)
    return table(buckets.to(table.weight.device)).permute(2, 0, 1)


# ----------------------------------------------------------------------------- MLP
ACTIVATIONS = {
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),  # GPT-2's
    "gelu": F.gelu,  # the exact erf GELU (BERT; T5 v1.1's gated-gelu is gelu_tanh)
    "relu": F.relu,
    "silu": F.silu,  # SwiGLU's gate (Llama)
}


class MLP(nn.Module):
    """IN linear `fc` to `hidden` features, activation, OUT linear `proj` back to d_model. Gated
    (SwiGLU, gated GELU): `fc` has two segments, `gate` and `up`, and the hidden state is
    act(gate) * up."""

    def __init__(self, mode, seeds: DropoutSeeds, *, d_model: int, hidden: int, activation: str = "gelu_tanh",
                 gated: bool = False, bias: bool = True, dropout: float = 0.0, hidden_dropout: bool = False):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise LatticeConfigError(f"activation {activation!r} is not implemented; choose one of {sorted(ACTIVATIONS)}")
        self.act, self.gated = ACTIVATIONS[activation], gated
        segments = (("gate", hidden), ("up", hidden)) if gated else None
        self.fc = mode.linear(d_model, 2 * hidden if gated else hidden, block=Block.MLP, position=Position.IN,
                              segments=segments, bias=bias)
        self.proj = mode.linear(hidden, d_model, block=Block.MLP, position=Position.OUT, bias=bias)
        self.drop = residual_dropout(dropout, mode, seeds)
        # T5's: dropout on the hidden features too, which every layout splits or gives each rank its own rows of
        self.hidden_drop = Dropout(dropout, seeds, "sharded") if hidden_dropout else None

    def forward(self, x):
        if self.gated:
            gate, up = self.fc(x)
            hidden = self.act(gate) * up
        else:
            hidden = self.act(self.fc(x))
        if self.hidden_drop is not None:
            hidden = self.hidden_drop(hidden)
        return self.drop(self.proj(hidden))


# ----------------------------------------------------------------------------- heads
class ReplicatedLinear(nn.Module):
    """y = x W + b with W (in, out) whole on every rank of the replica: a head small enough to
    run replicated on a pooled tensor that every rank holds (identical inputs give identical
    gradients, so nothing is summed)."""

    def __init__(self, ctx: ParallelContext, in_features: int, out_features: int, bias: bool = True):
        super().__init__()
        register_sharded(self, "weight", ShardSpec((in_features, out_features)), ctx)
        if bias:
            register_sharded(self, "bias", ShardSpec((out_features,)), ctx)
        else:
            self.bias = None

    def forward(self, x):
        y = x @ self.weight
        return y if self.bias is None else y + self.bias
