"""Mistral decoders: Llama's shape with sliding-window attention, written once against the mode
interface by reusing Llama's blocks.

    cfg = MistralConfig.preset("tiny", vocab_size=2048)
    model = lattice.build_model(cfg, lattice.init("2d", tp=4))
    loss = model(tokens, targets)          # tokens, targets: (B, T) int64

A query at position i attends to the keys at i - sliding_window + 1 .. i (`sliding_window`
positions, itself included; None: every earlier position, as Llama). Every layout keeps whole
sequences of whole heads inside attention, so the window is the same local mask in each; a KV
cache keeps only the last sliding_window - 1 positions of its rank's kv heads. Everything else
(grouped-query attention, rotary positions, RMSNorm, the SwiGLU MLP, no biases) is Llama's: see
lattice/models/llama.py.

HuggingFace (MistralForCausalLM): Llama's tensor names; `sliding_window` carried both ways.
Refused as for Llama, including a head_dim other than hidden_size / num_attention_heads.
"""

from __future__ import annotations

from dataclasses import dataclass

from lattice.models.llama import Llama, LlamaConfig, LlamaHF
from lattice.models.registry import register
from lattice.parallel.context import LatticeConfigError


@dataclass
class MistralConfig(LlamaConfig):
    vocab_size: int = 32000
    seq_len: int = 32768
    d_model: int = 4096
    n_heads: int = 32
    n_kv_heads: int = 8
    n_layers: int = 32
    intermediate_size: int = 14336
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    sliding_window: int | None = 4096

    # tiny and small as Llama's with a window shorter than their sequences; mistral-7b: v0.1's shape
    presets = {
        "tiny": dict(LlamaConfig.presets["tiny"], sliding_window=32),
        "small": dict(LlamaConfig.presets["small"], sliding_window=64),
        "mistral-7b": dict(vocab_size=32000, seq_len=32768, d_model=4096, n_heads=32, n_kv_heads=8, n_layers=32,
                           intermediate_size=14336, rope_theta=10000.0, sliding_window=4096),
    }

    def __post_init__(self):
        super().__post_init__()
        if self.sliding_window is not None:
            self.check_positive("sliding_window")

    def attention_options(self) -> dict:
        return {"bias": False, "window": self.sliding_window}


class MistralHF(LlamaHF):
    model_type, model_class, label = "mistral", "MistralForCausalLM", "Mistral"
    config_class, hf_config_class = MistralConfig, "MistralConfig"

    def fields_from_hf(self, c) -> dict:
        window = getattr(c, "sliding_window", None)
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
            raise LatticeConfigError(f"sliding_window={window!r} is not a positive number of positions; set it to "
                                     f"one, or to null for attention over every earlier position")
        return {"sliding_window": window}

    def fields_to_hf(self, cfg) -> dict:
        return {"sliding_window": cfg.sliding_window, "head_dim": cfg.head_size}


@register
class Mistral(Llama):
    """A Mistral decoder holding only this rank's shards. Parameter names are the serial model's."""

    name = "mistral"
    config_class = MistralConfig
    hf = MistralHF()
    # grouped-query, untied, a window of 5 positions in sequences of 12
    test_shapes = (dict(vocab_size=61, seq_len=12, d_model=32, n_heads=4, n_kv_heads=2, n_layers=2,
                        intermediate_size=40, rope_theta=500.0, sliding_window=5),)
