"""Qwen2-MoE decoders: Qwen2's attention (biases on q, k and v) with a mixture of experts beside
a shared expert, written once against the mode interface on Mixtral's blocks.

    cfg = Qwen2MoeConfig.preset("tiny", vocab_size=2048)
    model = lattice.build_model(cfg, lattice.init("1d", tp=2))
    loss = model(tokens, targets)          # cross-entropy + router_aux_loss_coef x balancing loss

The MoE MLP routes each token to its top_k of n_experts SwiGLU experts of width `expert_width`,
its weights renormalised over the k only with `normalize_top_k` (off in the published models),
and adds a shared SwiGLU expert of width `shared_width` that every token goes through, scaled by
sigmoid(x W_g) (lattice/models/moe.py). Layer i is an MoE layer when (i + 1) is a multiple of
`sparse_step` and i is not in `mlp_only`; the others have a dense SwiGLU MLP of width
`intermediate_size`.

HuggingFace (Qwen2MoeForCausalLM, transformers 5's fused experts): Qwen2's names for attention,
Mixtral's for the router and experts, `mlp.shared_expert.{gate,up,down}_proj.weight` and
`mlp.shared_expert_gate.weight`. Refused: use_sliding_window, qkv_bias=False.
"""

from __future__ import annotations

from dataclasses import dataclass

from lattice.models.llama import LlamaConfig
from lattice.models.mixtral import Mixtral, MixtralConfig, MixtralHF
from lattice.models.moe import refuse_expert_bias
from lattice.models.qwen2 import Qwen2HF
from lattice.models.registry import register
from lattice.parallel.context import LatticeConfigError


@dataclass
class Qwen2MoeConfig(MixtralConfig):
    vocab_size: int = 151936
    seq_len: int = 32768
    d_model: int = 2048
    n_heads: int = 16
    n_kv_heads: int = 16
    n_layers: int = 24
    intermediate_size: int = 5632  # the dense layers' width
    rope_theta: float = 1000000.0
    norm_eps: float = 1e-6
    n_experts: int = 60
    top_k: int = 4
    expert_width: int = 1408  # transformers' moe_intermediate_size
    shared_width: int = 5632  # shared_expert_intermediate_size (0: no shared expert)
    normalize_top_k: bool = False  # norm_topk_prob
    sparse_step: int = 1  # decoder_sparse_step

    presets = {
        "tiny": dict(LlamaConfig.presets["tiny"], intermediate_size=96, n_experts=4, top_k=2, expert_width=32,
                     shared_width=64),
        "small": dict(LlamaConfig.presets["small"], intermediate_size=512, n_experts=8, top_k=2, expert_width=128,
                      shared_width=256),
        "qwen1.5-moe-a2.7b": dict(vocab_size=151936, seq_len=8192, d_model=2048, n_heads=16, n_kv_heads=16,
                                  n_layers=24, intermediate_size=5632, n_experts=60, top_k=4, expert_width=1408,
                                  shared_width=5632),
        "qwen2-57b-a14b": dict(vocab_size=151936, seq_len=32768, d_model=3584, n_heads=28, n_kv_heads=4,
                               n_layers=28, intermediate_size=18944, n_experts=64, top_k=8, expert_width=2560,
                               shared_width=20480),
    }

    def __post_init__(self):
        super().__post_init__()
        self.check_positive("expert_width", "sparse_step")
        if not isinstance(self.shared_width, int) or self.shared_width < 0:
            raise LatticeConfigError(f"shared_width must be a width >= 0 (0: no shared expert), got {self.shared_width!r}")

    @property
    def expert_size(self) -> int:
        return self.expert_width

    @property
    def shared_expert_size(self) -> int:
        return self.shared_width

    def sparse_layers(self) -> list[int]:
        return [i for i in range(self.n_layers) if i not in self.mlp_only and (i + 1) % self.sparse_step == 0]

    def attention_options(self) -> dict:
        return {"bias": True, "out_bias": False, "window": None}


class Qwen2MoeHF(MixtralHF, Qwen2HF):
    model_type, model_class, label = "qwen2_moe", "Qwen2MoeForCausalLM", "Qwen2-MoE"
    config_class, hf_config_class = Qwen2MoeConfig, "Qwen2MoeConfig"

    def fields_from_hf(self, c) -> dict:
        if getattr(c, "use_sliding_window", False):
            raise LatticeConfigError("use_sliding_window=True is not implemented for Qwen2-MoE; set it to False")
        if not getattr(c, "qkv_bias", True):
            raise LatticeConfigError("qkv_bias=False is not implemented; lattice's Qwen2-MoE has q, k and v biases")
        return {"n_experts": c.num_experts, "top_k": c.num_experts_per_tok, "expert_width": c.moe_intermediate_size,
                "shared_width": c.shared_expert_intermediate_size, "normalize_top_k": bool(c.norm_topk_prob),
                "sparse_step": c.decoder_sparse_step, "mlp_only": list(c.mlp_only_layers or ()),
                "router_aux_loss_coef": float(c.router_aux_loss_coef)}

    def fields_to_hf(self, cfg) -> dict:
        refuse_expert_bias(cfg, self.model_class)
        return {"use_sliding_window": False, "qkv_bias": True, "num_experts": cfg.n_experts,
                "num_experts_per_tok": cfg.top_k, "moe_intermediate_size": cfg.expert_width,
                "shared_expert_intermediate_size": cfg.shared_width, "norm_topk_prob": cfg.normalize_top_k,
                "decoder_sparse_step": cfg.sparse_step, "mlp_only_layers": list(cfg.mlp_only),
                "router_aux_loss_coef": cfg.router_aux_loss_coef, "output_router_logits": True}

    per_expert = ("mlp", "gate_proj", "up_proj", "down_proj")

    def check_import(self, cfg) -> None:
        if not cfg.shared_width:
            raise LatticeConfigError("shared_width = 0: Qwen2MoeForCausalLM always has a shared expert")

    def moe_tensors(self, cfg):
        h, inner = cfg.d_model, cfg.shared_width
        return super().moe_tensors(cfg) + [
            ("mlp.shared_expert.gate_proj.weight", "mlp.shared.gate", (inner, h), False),
            ("mlp.shared_expert.up_proj.weight", "mlp.shared.up", (inner, h), False),
            ("mlp.shared_expert.down_proj.weight", "mlp.shared.down", (h, inner), False),
            ("mlp.shared_expert_gate.weight", "mlp.shared.weight", (1, h), False)]


@register
class Qwen2Moe(Mixtral):
    """A Qwen2-MoE decoder holding only this rank's shards. Parameter names are the serial model's."""

    name = "qwen2_moe"
    config_class = Qwen2MoeConfig
    hf = Qwen2MoeHF()
    # multi-head, 4 experts of which each token takes 2 (not renormalised) beside a shared expert;
    # layer 0 dense (sparse_step 2), layer 1 MoE
    test_shapes = (dict(vocab_size=61, seq_len=12, d_model=32, n_heads=4, n_kv_heads=4, n_layers=2,
                        intermediate_size=40, rope_theta=500.0, n_experts=4, top_k=2, expert_width=16,
                        shared_width=24, sparse_step=2, router_aux_loss_coef=0.1),)
