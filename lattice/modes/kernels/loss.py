"""Cross-entropy of logits split over the vocabulary, without gathering them (shared by modes).

Targets equal to IGNORE_INDEX (-100, as in PyTorch and transformers: BERT's unmasked positions)
add nothing to the loss or its gradient, and the mean is over the labelled targets alone
(`labelled_count`).
"""

from __future__ import annotations

import torch

from lattice.modes.kernels.layers import upcast
from lattice.parallel import comm

IGNORE_INDEX = -100


def labelled_count(targets: torch.Tensor, clamp: bool = True) -> torch.Tensor:
    """The targets that count towards a mean loss (those not IGNORE_INDEX), as a 0-d tensor (no
    host sync), at least 1 unless `clamp` is off. Every rank holds the whole replica's targets,
    so every rank divides alike."""
    count = (targets != IGNORE_INDEX).sum()
    return count.clamp_min(1) if clamp else count  # none labelled: a loss of 0, not 0/0


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token loss log Σ_v e^{z_v} - z_target, the vocabulary split over `group`.

    Forward: m = max over ranks of max_v z (all-reduce MAX of N values), then [Σ_v e^{z-m},
    z_target - m] summed over ranks in one all-reduce (2N values); every rank returns the same
    per-token loss. Backward: dz = (softmax(z) - onehot(target)) · dloss on this rank's slice, no
    communication. Columns at or past `vocab_size` (padding) are masked out of the softmax; an
    IGNORE_INDEX target has loss 0 and gradient 0.
    """

    @staticmethod
    def forward(ctx, logits, targets, group, vocab_start, vocab_size, owned):  # (N, V_local), (N,) -> (N,)
        # every full-size temporary costs a pass over N·V_local values (and, fresh from the
        # allocator, its pages): z - m is made in place where z is this loss's own (the upcast
        # copy, the padding's fill, or logits the caller hands over: `owned`), else once, and
        # exponentiated in place (a new one cost GPT-2's 1d step at 2 ranks 5.8 of its 259 ms)
        z = upcast(logits)
        n_local = z.shape[1]
        if vocab_start + n_local > vocab_size:  # this rank's slice ends in padding columns
            padding = torch.arange(vocab_start, vocab_start + n_local, device=z.device) >= vocab_size
            z = z.masked_fill(padding, float("-inf"))
        top = comm.raw_all_reduce(z.max(dim=1).values, group, op=torch.distributed.ReduceOp.MAX)  # (N,)
        local_target = targets - vocab_start
        here = (local_target >= 0) & (local_target < n_local)
        local_target = local_target.masked_fill(~here, 0)
        target_logit = z.gather(1, local_target.unsqueeze(1)).squeeze(1) - top
        target_logit = torch.where(here, target_logit, torch.zeros_like(target_logit))  # (N,)
        exp = (z.sub_(top.unsqueeze(1)) if owned or z is not logits else torch.sub(z, top.unsqueeze(1))).exp_()
        sums = comm.raw_all_reduce(torch.stack([exp.sum(dim=1), target_logit]), group)  # (2, N)
        softmax = exp.div_(sums[0].unsqueeze(1))
        labelled = targets != IGNORE_INDEX
        # -1 marks an ignored row, so that no further tensor is saved for backward
        ctx.save_for_backward(softmax, local_target.masked_fill(~labelled, -1), here)
        ctx.dtype = logits.dtype
        return (sums[0].log() - sums[1]).masked_fill(~labelled, 0.0)

    @staticmethod
    def backward(ctx, dloss):
        softmax, local_target, here = ctx.saved_tensors
        dloss = dloss.masked_fill(local_target < 0, 0.0)
        # in place on the saved softmax, the forward's own temporary (a second backward through
        # this graph is refused by autograd's version check on it)
        grad = softmax.mul_(dloss.unsqueeze(1))
        rows = torch.arange(grad.shape[0], device=grad.device)
        grad[rows, local_target.clamp_min(0)] -= here.to(grad.dtype) * dloss
        return grad.to(ctx.dtype), None, None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, group, vocab_start: int,
                                 vocab_size: int, *, owned: bool = False) -> torch.Tensor:
    """Per-token cross-entropy (N,) of logits (N, V_local) holding padded-vocabulary columns
    vocab_start.. of the full V_padded, split over `group`; identical on every rank of it. With
    `owned` the logits are the caller's temporary, made for this loss alone (no other use, not
    saved by the product that made them): they are overwritten, as Megatron's loss does."""
    return _VocabParallelCrossEntropy.apply(logits, targets, group, vocab_start, vocab_size, owned)
