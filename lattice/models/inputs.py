"""The checks of what a model takes beside its tokens, each one line naming the fix instead of an
index error deep in a kernel."""

from __future__ import annotations

import torch

from lattice.modes.kernels.loss import IGNORE_INDEX
from lattice.parallel.context import LatticeConfigError


def check_ids(name: str, ids: torch.Tensor, vocab: int, *, labels: bool = False) -> None:
    """One line unless every id in `ids` is a token of a vocabulary of `vocab` (with `labels`,
    -100 marks one to ignore), instead of an index error deep in an embedding."""
    if not ids.numel():
        return
    real = ids.masked_fill(ids == IGNORE_INDEX, 0) if labels else ids
    low, high = torch.stack([real.min(), real.max()]).tolist()  # one host sync per check
    if low < 0 or high >= vocab:
        raise LatticeConfigError(f"{name} hold ids outside the vocabulary [0, {vocab})" +
                                 (" (-100 marks an ignored label)" if labels else "") +
                                 "; encode with the model's tokenizer or raise vocab_size")


def check_padding(model, tokens, start: int, attention_mask, token_types, position_ids=None) -> None:
    """One line unless `model`'s padding mask (or packed documents' ids), token types and
    positions fit the tokens (every rank, before any collective)."""
    B, T = tokens.shape
    if position_ids is not None:
        if position_ids.shape != tokens.shape:
            raise LatticeConfigError(f"position_ids has shape {tuple(position_ids.shape)}, the tokens "
                                     f"{tuple(tokens.shape)}: give one position per token")
        check_ids("position_ids", position_ids, model.cfg.seq_len)
    if attention_mask is not None:
        if tuple(attention_mask.shape) != (B, start + T):
            raise LatticeConfigError(f"attention_mask has shape {tuple(attention_mask.shape)}, the tokens need "
                                     f"{(B, start + T)} (batch, positions so far): 1 for a token, 0 for padding")
        if attention_mask.dtype != torch.bool and bool((attention_mask < 0).any()):
            raise LatticeConfigError("attention_mask holds negative values: give 1 for a token and 0 for padding, "
                                     "as transformers does (or number packed documents 1, 2, ...)")
        if not model.packs_documents and attention_mask.dtype != torch.bool and bool((attention_mask > 1).any()):
            raise LatticeConfigError(f"attention_mask holds values above 1, document ids of packed sequences, "
                                     f"which {model.family.name} does not take: give 1 for a token and 0 for padding")
    if token_types is not None:
        if not model.type_count():
            raise LatticeConfigError(f"{model.family.name} has no token types: leave token_types out")
        if token_types.shape != tokens.shape:
            raise LatticeConfigError(f"token_types has shape {tuple(token_types.shape)}, the tokens "
                                     f"{tuple(tokens.shape)}: give one segment id per token")
        check_ids("token_types", token_types, model.type_count())
