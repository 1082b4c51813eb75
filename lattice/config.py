"""GPTConfig and the model presets: plain data, imported by the model, HF conversion and CLI."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from lattice.context import LatticeConfigError

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
