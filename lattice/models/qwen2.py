"""Qwen2 decoders: Llama's shape with a bias on the query, key and value projections (none on
the output projection), written once against the mode interface by reusing Llama's blocks.

    cfg = Qwen2Config.preset("tiny", vocab_size=2048)
    model = lattice.build_model(cfg, lattice.init("1d", tp=2))
    loss = model(tokens, targets)          # tokens, targets: (B, T) int64

Grouped-query attention, rotary positions, RMSNorm and the SwiGLU MLP are Llama's (see
lattice/models/llama.py, including what a tensor split requires of the head counts). The q, k
and v biases are split like their projections' output features: whole heads per rank in every
layout. The small published models tie the LM head to the token table, the larger do not; both
are offered.

HuggingFace (Qwen2ForCausalLM): Llama's names plus `self_attn.{q,k,v}_proj.bias`. Refused: a
config with use_sliding_window=True (Qwen2 slides its window only on some layers; lattice's
sliding window is Mistral's, on every layer).
"""

from __future__ import annotations

from dataclasses import dataclass

from lattice.models.llama import Llama, LlamaConfig, LlamaHF
from lattice.models.registry import register
from lattice.parallel.context import LatticeConfigError


@dataclass
class Qwen2Config(LlamaConfig):
    vocab_size: int = 151936
    seq_len: int = 32768
    d_model: int = 896
    n_heads: int = 14
    n_kv_heads: int = 2
    n_layers: int = 24
    intermediate_size: int = 4864
    rope_theta: float = 1000000.0
    norm_eps: float = 1e-6
    tie_embeddings: bool = True

    # tiny and small: Llama's, untied (the tests' and the CLI's); the rest: the published shapes
    presets = {
        "tiny": dict(LlamaConfig.presets["tiny"], tie_embeddings=False),
        "small": dict(LlamaConfig.presets["small"], tie_embeddings=False),
        "qwen2-0.5b": dict(vocab_size=151936, seq_len=32768, d_model=896, n_heads=14, n_kv_heads=2, n_layers=24,
                           intermediate_size=4864, rope_theta=1000000.0, tie_embeddings=True),
        "qwen2-7b": dict(vocab_size=152064, seq_len=32768, d_model=3584, n_heads=28, n_kv_heads=4, n_layers=28,
                         intermediate_size=18944, rope_theta=1000000.0, tie_embeddings=False),
    }

    def attention_options(self) -> dict:
        return {"bias": True, "out_bias": False}


class Qwen2HF(LlamaHF):
    model_type, model_class, label = "qwen2", "Qwen2ForCausalLM", "Qwen2"
    config_class, hf_config_class = Qwen2Config, "Qwen2Config"

    def fields_from_hf(self, c) -> dict:
        if getattr(c, "use_sliding_window", False):
            raise LatticeConfigError("use_sliding_window=True is not implemented for Qwen2 (its window covers only "
                                     "some layers); set it to False, or use a Mistral-architecture model")
        return {}

    def fields_to_hf(self, cfg) -> dict:
        return {"use_sliding_window": False}

    def layer_tensors(self, cfg):
        hs = cfg.head_size
        biases = [(f"self_attn.{s}_proj.bias", f"attn.qkv.{s}.bias", (heads * hs,), False)
                  for s, heads in (("q", cfg.n_heads), ("k", cfg.n_kv_heads), ("v", cfg.n_kv_heads))]
        return super().layer_tensors(cfg) + biases


@register
class Qwen2(Llama):
    """A Qwen2 decoder holding only this rank's shards. Parameter names are the serial model's."""

    name = "qwen2"
    config_class = Qwen2Config
    hf = Qwen2HF()
    # grouped-query (n_kv 2 < n_heads 4) and tied; V = 61 is padded where a mode splits it
    test_shapes = (dict(vocab_size=61, seq_len=12, d_model=32, n_heads=4, n_kv_heads=2, n_layers=2,
                        intermediate_size=40, rope_theta=1000.0, tie_embeddings=True),)
