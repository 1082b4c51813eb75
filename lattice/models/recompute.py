"""Activation recomputation of a model's blocks in backward (torch.utils.checkpoint, non-reentrant).

"full": a block keeps its input alone; backward runs its whole forward again, collectives included.
"selective": a block also keeps what its matrix products and fused attention kernels return
(torch's selective checkpointing, `create_selective_checkpoint_contexts`); backward runs again only
the work between them (norms, activations, rotary, the residual adds but the block's last, dropout
masks, the collectives), not a product. What a block keeps is then its input, each product's
output and each attention's output and log-sum-exp: the cost model's `CostBuilder.build` counts
the same. Attention written out in products (a per-head bias: the math kernel's bmm and softmax)
runs again whole, as under "full".
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from lattice.parallel.context import LatticeConfigError

#: the operators whose outputs a selectively recomputed block keeps: linear layers' products
#: (with and without a bias) and the fused attention kernels of every device
_KEPT_NAMES = ("mm", "addmm", "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
               "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention")
KEPT_OPERATORS = frozenset(getattr(torch.ops.aten, name).default for name in _KEPT_NAMES)


def _keep_products(ctx, func, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if func in KEPT_OPERATORS else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_contexts():
    return create_selective_checkpoint_contexts(_keep_products)


def recomputed(kind: str, fn, *args, **kwargs):
    """fn(*args, **kwargs) with its activations recomputed in backward, "full" or "selective"."""
    extra = {"context_fn": _selective_contexts} if kind == "selective" else {}
    return checkpoint(fn, *args, use_reentrant=False, **extra, **kwargs)


def recompute_kind(activation_checkpointing: bool, selective_checkpointing: bool) -> str | None:
    """The recomputation two training flags ask for (None: none); both at once is refused."""
    if activation_checkpointing and selective_checkpointing:
        raise LatticeConfigError("--activation-checkpointing recomputes whole blocks and --selective-checkpointing "
                                 "all but their products: give one of them")
    return "full" if activation_checkpointing else "selective" if selective_checkpointing else None
