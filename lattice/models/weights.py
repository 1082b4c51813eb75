"""Full tensors in and out of a model that holds only this rank's shards, written once for every
family: serial's initial weights, loading and gathering full weights and gradients, and
HuggingFace import and export. `lattice.models.base.Model` inherits `FullWeights`; each
parameter's `ShardSpec` (`self.specs`) says how it is split."""

from __future__ import annotations

import math
import zlib

import torch

from lattice.models.registry import build_model
from lattice.parallel.context import LatticeConfigError, ParallelContext
from lattice.parallel.sharding import check_state_dict_keys, gather_full_many


class FullWeights:
    """Full (serial) tensors to and from this rank's shards."""

    def init_full(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """The full initial tensor of one parameter, from the seed and its name alone, so that
        every layout starts from the serial model's weights: biases zero, norm weights one,
        matrices normal with `init_std`."""
        if name.endswith("bias"):
            return torch.zeros(shape)
        if len(shape) == 1 and name.endswith(".weight"):  # a norm's scale
            return torch.ones(shape)
        gen = torch.Generator().manual_seed(self.ctx.seed * 1_000_003 + zlib.crc32(name.encode()))
        return torch.randn(shape, generator=gen).mul_(self.init_std(name))  # in place: one full tensor alive

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

    def is_mirror(self, name: str) -> bool:
        """Whether this rank's `name` is a copy of a parameter another rank holds (it trains like
        the original but counts once); see lattice.parallel.pipeline."""
        return False

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
        rank; with `to_rank`, gathered a bucket of tensors at a time onto that global rank alone, the
        others returning {} and holding no more than their own shards and one bucket's copy of them."""
        params = dict(self.named_parameters())
        fulls = gather_full_many([(params.get(name), spec) for name, spec in self.specs.items()], self.ctx,
                                 dtype=self.dtype, dst=to_rank)
        return {name: full for name, full in zip(self.specs, fulls) if full is not None}

    def gather_grads(self) -> dict[str, torch.Tensor]:
        """Full gradients of the synced local ones, averaged over data-parallel replicas (a
        collective); a missing gradient counts as zero."""
        params = dict(self.named_parameters())
        fulls = gather_full_many([(params[name].grad if name in params else None, spec)
                                  for name, spec in self.specs.items()], self.ctx, dtype=self.dtype, average_dp=True)
        return dict(zip(self.specs, fulls))

    def full_grad_dict(self) -> dict[str, torch.Tensor]:
        """Full gradients of the global mean loss (averaged over data-parallel replicas),
        identical on every rank (a collective). Runs `sync_grads` first if a backward has not been
        synced yet."""
        self.sync_grads()
        return self.gather_grads()

    def num_parameters(self) -> int:
        """Parameters of the full model (not this rank's shards)."""
        return sum(math.prod(s.full_shape) for s in self.specs.values())

    # ---- HuggingFace
    @classmethod
    def from_hf(cls, model_or_state_dict, ctx: ParallelContext, *, config=None, dtype: torch.dtype | None = None):
        """This family's model (this rank's shards, under ctx's layout; its pipeline stages with
        pp > 1) with a HuggingFace model's weights: a transformers model, or a state dict with
        config= (see lattice.models.hf). dtype defaults to that of the weights. No communication: every
        rank passes the same weights."""
        from lattice.models import hf

        cfg, full = hf.read_hf(cls, model_or_state_dict, config=config)
        model = build_model(cfg, ctx, dtype=dtype or next(iter(full.values())).dtype)
        model.load_full_state_dict(full)
        return model

    def to_hf_state_dict(self) -> dict[str, torch.Tensor]:
        """Full tensors under the HuggingFace model's names (a collective: every rank calls it)."""
        from lattice.models import hf

        return hf.to_hf_state_dict(self.family, self.cfg, self.full_state_dict())
