"""Helpers the equivalence tests share: a relative difference and a random token batch."""

import torch


def rel_diff(a: torch.Tensor, ref: torch.Tensor) -> float:
    """max |a - ref| / max |ref| (0 for two zero tensors)."""
    return ((a - ref).abs().max() / ref.abs().max().clamp_min(1e-300)).item()


def random_batch(n: int, t: int, vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, targets), each (n, t) int64 uniform over the vocabulary, from `seed` alone."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n, t), generator=gen), torch.randint(0, vocab, (n, t), generator=gen)
