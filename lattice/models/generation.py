"""Generation, written once for every family: `Generation.generate`, which `lattice.models.base.
Model` inherits (an encoder-decoder overrides it), and the choice of each next token."""

from __future__ import annotations

import torch

from lattice.parallel.context import LatticeConfigError
from lattice.parallel.context_parallel import check_context_batch


class Generation:
    """Continuing prompts with the model's own forward (a KV cache in the mode's layout)."""

    def generate(self, prompt: torch.Tensor, max_new_tokens: int, *, temperature: float = 0.0,
                 top_k: int | None = None, seed: int = 0, use_cache: bool = True,
                 attention_mask: torch.Tensor | None = None, eos_token_id: int | None = None,
                 pad_token_id: int | None = None) -> torch.Tensor:
        """Continue (B, T0) prompts, identical on every rank of the replica, by `max_new_tokens`
        tokens: greedy at temperature 0, else sampled from softmax(logits / temperature) over the
        top_k, with a generator seeded alike on every rank (so every rank draws the same tokens).
        With `use_cache` each block keeps its keys and values in the mode's layout and every step
        runs the newest position alone; only the last position's logits are computed. Prompts of
        different lengths are left-padded with an `attention_mask` (B, T0) that is 0 at the
        padding, as for transformers' generate: a token's position counts its sequence's tokens
        before it, and no position attends to padding. With `eos_token_id`, as transformers'
        generate: a sequence that produced it is continued with `pad_token_id` (default: the end
        token), and generation stops once every sequence has (the result is then shorter)."""
        check_context_batch(self.ctx, cached=True)
        if prompt.shape[1] + max_new_tokens > self.cfg.seq_len:
            raise LatticeConfigError(f"prompt length {prompt.shape[1]} + {max_new_tokens} new tokens exceeds seq_len = "
                                     f"{self.cfg.seq_len}; shorten the prompt or ask for fewer tokens")
        was_training = self.training
        self.eval()
        gen = torch.Generator().manual_seed(seed)
        tokens = prompt
        cache = [{} for _ in self.blocks] if use_cache else None
        step_input, start = tokens, 0
        padded = {} if attention_mask is None else {"attention_mask": attention_mask,
                                                    "position_ids": (attention_mask.long().cumsum(-1) - 1).clamp_min(0)}
        finished = torch.zeros(prompt.shape[0], 1, dtype=torch.bool, device=prompt.device)
        for _ in range(max_new_tokens):
            logits = self(step_input, cache=cache, start=start, last_only=True, **padded)[:, -1].float()  # (B, V)
            nxt = next_token(logits, temperature, top_k, gen).to(tokens.device)
            if eos_token_id is not None:  # (the same tokens on every rank: every rank stops alike)
                nxt = torch.where(finished, pad_token_id if pad_token_id is not None else eos_token_id, nxt)
                finished = finished | (nxt == eos_token_id)
            tokens = torch.cat([tokens, nxt], dim=1)
            if eos_token_id is not None and bool(finished.all()):
                break
            if padded:  # the new token is a token, one position after its sequence's last
                mask = torch.cat([padded["attention_mask"], torch.ones_like(nxt)], dim=1)
                after = padded["position_ids"][:, -1:] + 1
                positions = after if use_cache else torch.cat([padded["position_ids"], after], dim=1)
                padded = {"attention_mask": mask, "position_ids": positions}
            if use_cache:
                step_input, start = nxt, tokens.shape[1] - 1
            else:
                step_input = tokens
        self.train(was_training)
        return tokens


def next_token(logits: torch.Tensor, temperature: float, top_k: int | None, gen: torch.Generator) -> torch.Tensor:
    """(B, 1) from (B, V) logits: the argmax at temperature 0, else a draw from
    softmax(logits / temperature) over the top_k, on a CPU generator seeded alike on every rank
    (so that every rank draws the same)."""
    if temperature <= 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits / temperature
    if top_k:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(torch.softmax(logits, dim=-1).cpu(), 1, generator=gen)
