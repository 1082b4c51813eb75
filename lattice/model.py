"""GPT-2, written once. The mode in `ctx` supplies every layout-dependent piece.

    cfg = GPTConfig(vocab_size=2048, seq_len=128, d_model=192, n_heads=12, n_layers=4)
    model = GPT(cfg, lattice.init("serial"))
    loss = model(tokens, targets)          # tokens, targets: (B, T) int64
"""

from __future__ import annotations

import math
import zlib

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from lattice import hf
from lattice.config import PRESETS, GPTConfig  # noqa: F401  (lattice.model.PRESETS and .GPTConfig stay importable)
from lattice.context import LatticeConfigError, MeshAxis, ParallelContext
from lattice.modes import Block, Position, get_mode
from lattice.sharding import ShardSpec, check_state_dict_keys, collect_specs, gather_full, sum_replica_grads

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

    def forward(self, x, cache: dict | None = None):
        """`cache` (inference): this layer's keys and values so far, in this rank's layout (its
        heads of its sequences); the new positions' are appended, and a query attends to every
        cached key (one new position) or causally (a prompt, into an empty cache)."""
        qkv = self.qkv(x)  # (B_l, T, 3, h_l): this rank's heads
        B, T, _, h_local = qkv.shape
        q, k, v = qkv.view(B, T, 3, h_local // self.head_size, self.head_size).permute(2, 0, 3, 1, 4)  # (B_l, nh_l, T, hs)
        if cache is not None:
            if "k" in cache:
                if T != 1:
                    raise LatticeConfigError("a KV cache extends one position at a time after the prompt")
                k, v = torch.cat([cache["k"], k], dim=2), torch.cat([cache["v"], v], dim=2)  # (B_l, nh_l, T_all, hs)
            cache["k"], cache["v"] = k, v
            y = F.scaled_dot_product_attention(q, k, v, is_causal=T > 1)
        elif self.training and self.attn_p > 0:
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

    def forward(self, x, cache: dict | None = None):
        x = x + self.attn(self.ln_1(x), cache)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """GPT-2 holding only this rank's shards. Parameter names are the serial model's."""

    def __init__(self, cfg: GPTConfig, ctx: ParallelContext, *, dtype: torch.dtype = torch.float32,
                 activation_checkpointing: bool = False):
        """Allocates only this rank's shards and fills them with the serial model's initial
        values. Under `with torch.device("meta")` nothing is allocated (for planning)."""
        super().__init__()
        self.cfg, self.ctx = cfg, ctx
        self.mode = get_mode(ctx.mode)(cfg, ctx)  # validates sizes on every rank, no collectives
        self.activation_checkpointing = activation_checkpointing
        self.seeds = DropoutSeeds(ctx)
        planning = torch.empty(()).is_meta  # the caller's default device is meta
        with torch.device("meta"):  # declare shards without memory; allocated once below
            self.embed = self.mode.embedding()
            self.drop = Dropout(cfg.dropout, self.seeds, "replicated" if self.mode.residual_replicated else "sharded")
            self.blocks = nn.ModuleList(TransformerBlock(cfg, self.mode, self.seeds) for _ in range(cfg.n_layers))
            self.ln_f = self.mode.layer_norm()
            self.head = self.mode.lm_head(self.embed)
        self.pipeline = ctx.pipeline  # lattice.pipeline.PipelineConfig, or None
        if self.pipeline is not None:
            self._keep_this_stage()
        self.specs: dict[str, ShardSpec] = collect_specs(self)
        self._grads_pending = False
        self._schedule = None
        self._built_dtype = dtype
        if not planning:
            self.to_empty(device=ctx.device)
            self.to(dtype=dtype)
            self.reset_parameters()

    # ------------------------------------------------------------------ forward
    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None, *,
                cache: list[dict] | None = None, start: int = 0, last_only: bool = False) -> torch.Tensor:
        """Mean cross-entropy over this replica's batch, or full logits (B, T, V) without targets
        (of the last position alone, (B, 1, V), with last_only). Inference: `cache` holds one dict
        per block (see generate) and `start` is the position of tokens[:, 0]."""
        self._check_inputs(tokens, targets, start)
        if self.pipeline is not None:
            return self._pipeline_forward(tokens, targets, cache)
        if self.training:
            self.seeds.forward_count += 1
        if torch.is_grad_enabled():
            self._grads_pending = True  # a backward may follow: sync_grads has work again
        x = self.drop(self.embed(tokens, start))  # residual layout, e.g. (B, T, h) in serial
        if cache is not None:
            for i, block in enumerate(self.blocks):
                x = block(x, cache[i])
        else:
            x = self.run_blocks(x, self.blocks)
        x = self.ln_f(x)
        if targets is None:
            return self.head.logits(x[:, -1:] if last_only else x)
        return self.head.loss(x, targets)

    def run_blocks(self, x: torch.Tensor, blocks) -> torch.Tensor:
        """x through `blocks` (residual layout in and out), checkpointed when asked. A
        recomputed block draws its dropout masks at the forward count of its first pass (under a
        pipeline schedule other micro-batches run in between)."""
        count = self.seeds.forward_count
        for block in blocks:
            if self.activation_checkpointing and self.training:
                x = checkpoint(self._block_at_count, block, x, count, use_reentrant=False)
            else:
                x = block(x)
        return x

    def _block_at_count(self, block, x, count: int):
        now, self.seeds.forward_count = self.seeds.forward_count, count
        try:
            return block(x)
        finally:
            self.seeds.forward_count = now

    @torch.no_grad()
    def generate(self, prompt: torch.Tensor, max_new_tokens: int, *, temperature: float = 0.0,
                 top_k: int | None = None, seed: int = 0, use_cache: bool = True) -> torch.Tensor:
        """Continue (B, T0) prompts, identical on every rank of the replica, by `max_new_tokens`
        tokens: greedy at temperature 0, else sampled from softmax(logits / temperature) over the
        top_k, with a generator seeded alike on every rank (so every rank draws the same tokens).
        With `use_cache` each block keeps its keys and values in the mode's layout and every step
        runs the newest position alone; only the last position's logits are computed."""
        if prompt.shape[1] + max_new_tokens > self.cfg.seq_len:
            raise LatticeConfigError(f"prompt length {prompt.shape[1]} + {max_new_tokens} new tokens exceeds seq_len = "
                                     f"{self.cfg.seq_len}; shorten the prompt or ask for fewer tokens")
        was_training = self.training
        self.eval()
        gen = torch.Generator().manual_seed(seed)
        tokens = prompt
        cache = [{} for _ in self.blocks] if use_cache else None
        step_input, start = tokens, 0
        for _ in range(max_new_tokens):
            logits = self(step_input, cache=cache, start=start, last_only=True)[:, -1].float()  # (B, V)
            if temperature <= 0:
                nxt = logits.argmax(dim=-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k:
                    kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                nxt = torch.multinomial(torch.softmax(logits, dim=-1).cpu(), 1, generator=gen).to(tokens.device)
            tokens = torch.cat([tokens, nxt], dim=1)
            if use_cache:
                step_input, start = nxt, tokens.shape[1] - 1
            else:
                step_input = tokens
        self.train(was_training)
        return tokens

    def _check_inputs(self, tokens, targets, start=0):
        if tokens.dim() != 2 or tokens.dtype != torch.int64:
            raise LatticeConfigError(f"tokens must be a (batch, seq) int64 tensor, got {tuple(tokens.shape)} {tokens.dtype}")
        if start + tokens.shape[1] > self.cfg.seq_len:
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
        return torch.randn(shape, generator=gen).mul_(std)  # in place: one full tensor alive

    @torch.no_grad()
    def reset_parameters(self):
        """Serial's initial weights: one full tensor at a time, of which this rank keeps its shard
        (so a rank's peak is its shards plus the largest single full tensor)."""
        params = dict(self.named_parameters())
        for name, spec in self.specs.items():
            if name in params:
                full = self.init_full(name, spec.full_shape)
                params[name].copy_(spec.shard(full, self.ctx.coords, self.ctx.topology))
                del full

    @property
    def dtype(self) -> torch.dtype:
        """The parameters' dtype (a rank may hold none: an idle rank of D&SP-cSub's common
        layers with projections in the common layers too; then the dtype it was built with)."""
        first = next(self.parameters(), None)
        return self._built_dtype if first is None else first.dtype

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

    def full_state_dict(self, to_rank: int | None = None) -> dict[str, torch.Tensor]:
        """Full tensors (a collective: every rank must call it). By default identical on every
        rank; with `to_rank`, gathered one tensor at a time onto that global rank alone, the
        others returning {} and holding no more than their own shards."""
        params = dict(self.named_parameters())
        out = {}
        for name, spec in self.specs.items():
            full = gather_full(params.get(name), spec, self.ctx, dtype=self.dtype, dst=to_rank)
            if full is not None:
                out[name] = full
        return out

    def full_grad_dict(self) -> dict[str, torch.Tensor]:
        """Full gradients of the global mean loss (averaged over data-parallel replicas),
        identical on every rank (a collective). Runs `sync_grads` first if a backward has not been
        synced yet. A missing gradient counts as zero."""
        self.sync_grads()
        params = dict(self.named_parameters())
        return {name: gather_full(params[name].grad if name in params else None, spec, self.ctx,
                                  dtype=self.dtype, average_dp=True)
                for name, spec in self.specs.items()}

    # ------------------------------------------------------------------ one training step
    def sync_grads(self) -> None:
        """Sum the partial gradients that the shard specs declare (`ShardSpec.grad_sum`) over
        their axes inside the model replica, in bucketed, metered all-reduces. Every rank of a
        replica must call it after backward; a second call before the next forward does nothing.
        (Data-parallel averaging across replicas is DDP's, in the Trainer.)"""
        if self._grads_pending:
            sum_replica_grads(self)
            if self.pipeline is not None:
                from lattice.pipeline import sum_tied_embedding_grads

                sum_tied_embedding_grads(self)
            self._grads_pending = False

    def forward_backward(self, tokens: torch.Tensor, targets: torch.Tensor) -> float:
        """Forward and backward of this replica's batch, with the in-replica gradient sums; the
        replica's mean loss as a float, identical on every rank of the replica. With pipeline
        parallelism, the schedule runs the micro-batches through the stages."""
        if self.pipeline is not None:
            from lattice.pipeline import pipeline_forward_backward

            loss = pipeline_forward_backward(self, tokens, targets)
            self.sync_grads()
            return loss
        loss = self(tokens, targets)
        loss.backward()
        self.sync_grads()
        return float(loss.detach())

    # ------------------------------------------------------------------ pipeline stages
    def _keep_this_stage(self) -> None:
        """Give every parameter its stage (embedding: the first, blocks: by the split, final
        LayerNorm and head: the last) as a holder along the pp axis, and drop the parameters of
        other stages from this rank. With tied embeddings the last stage keeps a mirror of the
        token table (not its holder: checkpoints and the gradient norm count the first stage's)."""
        from dataclasses import replace

        from lattice.pipeline import stage_of_module

        last = self.pipeline.stages - 1
        chunks = self.pipeline.chunks(self.cfg.n_layers)
        for prefix, module in self.named_modules():
            specs = getattr(module, "_lattice_specs", None)
            if not specs:
                continue
            stage = stage_of_module(prefix, chunks, self.pipeline.stages)
            for name, spec in specs.items():
                staged = replace(spec, holders=spec.holders + ((MeshAxis.PP, stage),))
                specs[name] = staged
                mirror = (self.cfg.tie_embeddings and prefix == "embed" and name == "wte" and self.ctx.stage == last
                          and spec.holds(self.ctx.coords))
                if not staged.holds(self.ctx.coords) and not mirror and module._parameters.get(name) is not None:
                    module._parameters[name] = None

    def is_mirror(self, name: str) -> bool:
        """A parameter this rank keeps as a copy of another stage's (the tied table on the last
        stage): it trains like the original but counts only once."""
        return self.pipeline is not None and not self.specs[name].holds(self.ctx.coords)

    def _pipeline_forward(self, tokens, targets, cache):
        if cache is not None:
            raise LatticeConfigError("generation runs without pipeline parallelism: load the checkpoint with pp = 1 "
                                     "(any tensor layout) to generate")
        if torch.is_grad_enabled():
            raise LatticeConfigError("with pipeline parallelism a training step is model.forward_backward(tokens, "
                                     "targets); model(tokens, targets) evaluates, under torch.no_grad()")
        if targets is None:
            raise LatticeConfigError("with pipeline parallelism model(tokens, targets) returns the loss only; full "
                                     "logits need pp = 1")
        from lattice.pipeline import pipeline_evaluate

        return pipeline_evaluate(self, tokens, targets)

    def num_parameters(self) -> int:
        """Parameters of the full model (not this rank's shards)."""
        return sum(math.prod(s.full_shape) for s in self.specs.values())

    # ------------------------------------------------------------------ HuggingFace
    @classmethod
    def from_hf(cls, model_or_state_dict, ctx: ParallelContext, *, config=None,
                dtype: torch.dtype | None = None) -> "GPT":
        """A GPT (this rank's shards, under ctx's layout) with a GPT-2's weights: a
        GPT2LMHeadModel or GPT2Model, or a state dict with config= (see lattice.hf). dtype
        defaults to that of the weights. No communication: every rank passes the same weights."""
        cfg, full = hf.read_hf(model_or_state_dict, config=config)
        model = cls(cfg, ctx, dtype=dtype or full["embed.wte"].dtype)
        model.load_full_state_dict(full)
        return model

    def to_hf_state_dict(self) -> dict[str, torch.Tensor]:
        """Full tensors under GPT2LMHeadModel's names (a collective: every rank calls it)."""
        return hf.to_hf_state_dict(self.cfg, self.full_state_dict())
