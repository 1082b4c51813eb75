"""GPT-2, written once. The mode in `ctx` supplies every layout-dependent piece.

    cfg = GPTConfig(vocab_size=2048, seq_len=128, d_model=192, n_heads=12, n_layers=4)
    model = GPT(cfg, lattice.init("serial"))
    loss = model(tokens, targets)          # tokens, targets: (B, T) int64
"""

from __future__ import annotations

import math
import zlib
from dataclasses import asdict, dataclass, fields

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from lattice.context import LatticeConfigError, MeshAxis, ParallelContext
from lattice.modes import Block, Position, get_mode
from lattice.sharding import ShardSpec, check_state_dict_keys, collect_specs, gather_full

# Model presets: "small" is the default that `lattice train` uses; sizes divide by the tensor
# parallel degrees the modes need on up to 9 ranks (d_model by 2, 3, 4; heads by 2, 3, 4).
PRESETS: dict[str, dict] = {
    "tiny": dict(seq_len=64, d_model=48, n_heads=6, n_layers=2),
    "small": dict(seq_len=128, d_model=192, n_heads=12, n_layers=4),
    "medium": dict(seq_len=256, d_model=384, n_heads=12, n_layers=6),
    "gpt2": dict(seq_len=1024, d_model=768, n_heads=12, n_layers=12),
}


@dataclass
class GPTConfig:
    vocab_size: int = 50257
    seq_len: int = 1024
    d_model: int = 768
    n_heads: int = 12
    n_layers: int = 12
    dropout: float = 0.0
    bias: bool = True
    tie_embeddings: bool = True
    layer_norm_eps: float = 1e-5

    def __post_init__(self):
        for f in ("vocab_size", "seq_len", "d_model", "n_heads", "n_layers"):
            if not isinstance(getattr(self, f), int) or getattr(self, f) < 1:
                raise LatticeConfigError(f"GPTConfig.{f} must be a positive integer, got {getattr(self, f)!r}")
        if self.d_model % self.n_heads:
            raise LatticeConfigError(
                f"d_model = {self.d_model} is not divisible by n_heads = {self.n_heads}; choose n_heads "
                f"among the divisors of d_model or a d_model that is a multiple of {self.n_heads}")
        if not 0.0 <= self.dropout < 1.0:
            raise LatticeConfigError(f"dropout must be in [0, 1), got {self.dropout}")

    @property
    def head_size(self) -> int:
        return self.d_model // self.n_heads

    @classmethod
    def preset(cls, name: str, **overrides) -> "GPTConfig":
        if name not in PRESETS:
            raise LatticeConfigError(f"unknown model preset {name!r}; choose one of {', '.join(PRESETS)}")
        return cls(**{**PRESETS[name], **overrides})

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "GPTConfig":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


class DropoutSeeds:
    """Seeds for dropout masks, as Megatron's RNG tracker keeps them, without global state.

    Two streams: "replicated" for activations identical on every rank of a model replica (same
    mask there, so replicas stay identical), "sharded" for activations that differ per rank
    (independent masks). A mask depends only on (seed, stream, forward count, site), so the
    recomputation under activation checkpointing draws exactly the masks of the first pass.
    """

    def __init__(self, ctx: ParallelContext):
        self.base = ctx.seed
        self.stream_ids = {"replicated": ctx.coord(MeshAxis.DP), "sharded": ctx.rank}
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


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig, mode, seeds: DropoutSeeds):
        super().__init__()
        h = cfg.d_model
        self.qkv = mode.linear(h, h, block=Block.ATTENTION, position=Position.IN, stack=3)
        self.proj = mode.linear(h, h, block=Block.ATTENTION, position=Position.OUT)
        self.head_size = cfg.head_size
        self.attn_p = cfg.dropout
        self.seeds, self.site = seeds, seeds.new_site()
        self.resid_drop = Dropout(cfg.dropout, seeds, "replicated" if mode.residual_replicated else "sharded")

    def forward(self, x):
        qkv = self.qkv(x)  # (B_l, T, 3, h_l): this rank's heads
        B, T, _, h_local = qkv.shape
        q, k, v = qkv.view(B, T, 3, h_local // self.head_size, self.head_size).permute(2, 0, 3, 1, 4)  # (B_l, nh_l, T, hs)
        if self.training and self.attn_p > 0:
            # heads differ per rank: the sharded stream, seeded so that recomputation repeats it
            devices = [x.device] if x.device.type == "cuda" else []
            with torch.random.fork_rng(devices=devices, device_type=x.device.type):
                torch.manual_seed(self.seeds.seed("sharded", self.site))
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.attn_p)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).reshape(B, T, h_local)  # (B_l, T, h_l)
        return self.resid_drop(self.proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig, mode, seeds: DropoutSeeds):
        super().__init__()
        self.fc = mode.linear(cfg.d_model, 4 * cfg.d_model, block=Block.MLP, position=Position.IN)
        self.proj = mode.linear(4 * cfg.d_model, cfg.d_model, block=Block.MLP, position=Position.OUT)
        self.drop = Dropout(cfg.dropout, seeds, "replicated" if mode.residual_replicated else "sharded")

    def forward(self, x):
        return self.drop(self.proj(F.gelu(self.fc(x), approximate="tanh")))  # GPT-2's gelu


class TransformerBlock(nn.Module):
    def __init__(self, cfg: GPTConfig, mode, seeds: DropoutSeeds):
        super().__init__()
        self.ln_1 = mode.layer_norm()
        self.attn = CausalSelfAttention(cfg, mode, seeds)
        self.ln_2 = mode.layer_norm()
        self.mlp = MLP(cfg, mode, seeds)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """GPT-2 holding only this rank's shards. Parameter names are the serial model's."""

    def __init__(self, cfg: GPTConfig, ctx: ParallelContext, *, dtype: torch.dtype = torch.float32,
                 activation_checkpointing: bool = False):
        super().__init__()
        self.cfg, self.ctx = cfg, ctx
        self.mode = get_mode(ctx.mode)(cfg, ctx)  # validates sizes on every rank, no collectives
        self.activation_checkpointing = activation_checkpointing
        self.seeds = DropoutSeeds(ctx)
        self.embed = self.mode.embedding()
        self.drop = Dropout(cfg.dropout, self.seeds, "replicated" if self.mode.residual_replicated else "sharded")
        self.blocks = nn.ModuleList(TransformerBlock(cfg, self.mode, self.seeds) for _ in range(cfg.n_layers))
        self.ln_f = self.mode.layer_norm()
        self.head = self.mode.lm_head(self.embed)
        self.specs: dict[str, ShardSpec] = collect_specs(self)
        if not any(p.is_meta for p in self.parameters()):
            self.to(device=ctx.device, dtype=dtype)
            self.reset_parameters()

    # ------------------------------------------------------------------ forward
    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Mean cross-entropy over this replica's batch, or full logits (B, T, V) without targets."""
        self._check_inputs(tokens, targets)
        if self.training:
            self.seeds.forward_count += 1
        x = self.drop(self.embed(tokens))  # residual layout, e.g. (B, T, h) in serial
        for block in self.blocks:
            if self.activation_checkpointing and self.training:
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        x = self.ln_f(x)
        if targets is None:
            return self.head.logits(x)
        return self.head.loss(x, targets)

    def _check_inputs(self, tokens, targets):
        if tokens.dim() != 2 or tokens.dtype != torch.int64:
            raise LatticeConfigError(f"tokens must be a (batch, seq) int64 tensor, got {tuple(tokens.shape)} {tokens.dtype}")
        if tokens.shape[1] > self.cfg.seq_len:
            raise LatticeConfigError(f"sequence length {tokens.shape[1]} exceeds GPTConfig.seq_len = "
                                     f"{self.cfg.seq_len}; shorten the batch or raise seq_len")
        if targets is not None and targets.shape != tokens.shape:
            raise LatticeConfigError(f"targets shape {tuple(targets.shape)} differs from tokens {tuple(tokens.shape)}")
        self.mode.check_batch(tokens)

    # ------------------------------------------------------------------ weights
    def init_full(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """The full initial tensor of one parameter, from the seed and its name alone, so that
        every layout starts from the serial model's weights."""
        if name.endswith(".bias"):
            return torch.zeros(shape)
        if name.split(".")[-2].startswith("ln_") and name.endswith(".weight"):
            return torch.ones(shape)
        gen = torch.Generator().manual_seed(self.ctx.seed * 1_000_003 + zlib.crc32(name.encode()))
        std = 0.02 / math.sqrt(2 * self.cfg.n_layers) if name.endswith("proj.weight") else 0.02
        return torch.randn(shape, generator=gen) * std

    @torch.no_grad()
    def reset_parameters(self):
        params = dict(self.named_parameters())
        for name, spec in self.specs.items():
            if name in params:
                full = self.init_full(name, spec.full_shape)
                params[name].copy_(spec.shard(full, self.ctx.coords, self.ctx.topology))

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    @torch.no_grad()
    def load_full_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load full (serial) tensors; each rank keeps its shard. No communication."""
        check_state_dict_keys(self.specs, state_dict)
        params = dict(self.named_parameters())
        for name, spec in self.specs.items():
            full = state_dict[name]
            if tuple(full.shape) != spec.full_shape:
                raise LatticeConfigError(f"{name}: expected shape {list(spec.full_shape)}, got {list(full.shape)}; "
                                         f"the weights were saved for a different model config")
            if name in params:
                params[name].copy_(spec.shard(full.to(self.dtype), self.ctx.coords, self.ctx.topology))

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full tensors, identical on every rank (a collective: every rank must call it)."""
        params = dict(self.named_parameters())
        return {name: gather_full(params.get(name), spec, self.ctx, dtype=self.dtype)
                for name, spec in self.specs.items()}

    def full_grad_dict(self) -> dict[str, torch.Tensor]:
        """Full gradients of the global mean loss (averaged over data-parallel replicas),
        identical on every rank. A missing gradient counts as zero."""
        params = dict(self.named_parameters())
        return {name: gather_full(params[name].grad if name in params else None, spec, self.ctx,
                                  dtype=self.dtype, average_dp=True)
                for name, spec in self.specs.items()}

    def num_parameters(self) -> int:
        """Parameters of the full model (not this rank's shards)."""
        return sum(math.prod(s.full_shape) for s in self.specs.values())

    # ------------------------------------------------------------------ HuggingFace
    @classmethod
    def from_hf(cls, model_or_state_dict, ctx: ParallelContext, **kwargs) -> "GPT":
        from lattice.hf import from_hf
        return from_hf(model_or_state_dict, ctx, **kwargs)

    def to_hf_state_dict(self) -> dict[str, torch.Tensor]:
        from lattice.hf import to_hf_state_dict
        return to_hf_state_dict(self)
