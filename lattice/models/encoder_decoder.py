"""What every encoder-decoder family shares (T5's today): the decoder's input made from the labels,
the labels checked against the sources, and generation that runs the encoder once and the
decoder token by token. A family subclasses EncoderDecoderLM and provides `encode(tokens,
keep)`, `decode(decoder_tokens, memory, cache=, start=, memory_keep=)`, `_head_input(x)`, a
`head` and a config with target_len, decoder_start_token_id, pad_token_id and eos_token_id."""

from __future__ import annotations

import torch

from lattice.models.base import Model
from lattice.models.inputs import check_ids
from lattice.models.generation import next_token
from lattice.modes.kernels.loss import IGNORE_INDEX, labelled_count
from lattice.parallel.context import LatticeConfigError
from lattice.parallel.context_parallel import check_context_batch, gather_context, take_context_chunks, whole_loss


class EncoderDecoderLM(Model):
    """A model of an encoder stack and a decoder stack that reads the encoder's output."""

    packs_documents = False  # the decoder's cross-attention reads the whole source

    @classmethod
    def random_targets(cls, cfg, tokens, generator):
        """Labels half as long as the source (cross-attention between two lengths)."""
        length = min(cfg.target_len, max(1, tokens.shape[1] // 2))
        return torch.randint(0, cfg.vocab_size, (tokens.shape[0], length), generator=generator)

    def check_inputs(self, tokens, targets=None, decoder_tokens=None):
        """The sources, the labels or the decoder's input against the config and the layout
        (every rank, before any collective): shapes, lengths, token ids."""
        self.check_tokens(tokens, targets)
        if decoder_tokens is not None:
            self.check_targets(tokens, decoder_tokens, name="decoder_tokens", labels=False)
        for sequences in (targets, decoder_tokens, tokens):  # under cp, each rank's chunks
            if sequences is not None:
                self.mode.check_batch(self.ctx, sequences[:, :sequences.shape[1] // self.ctx.cp])

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None, *,
                decoder_tokens: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The mean loss over this replica's labelled targets (-100 marks a padded target), or
        without targets the (B, T, V) logits of `decoder_tokens` (default: the start token
        alone). `attention_mask` (B, S): the sources' padding (1 token, 0 padding), as
        transformers takes it."""
        if targets is None and decoder_tokens is None:
            decoder_tokens = self.start_tokens(tokens.shape[0], tokens.device)
        check_context_batch(self.ctx, tokens, targets, decoder_tokens, logits=targets is None)
        self.check_inputs(tokens, targets, decoder_tokens)
        self.check_padding(tokens, 0, attention_mask, None)
        if targets is not None:
            decoder_tokens = self.shift_right(targets)
        share = None  # under cp: this rank's share of the batch's labelled targets
        if self.ctx.cp > 1:  # this rank's chunks of the sources and the targets; attention reads the whole mask
            whole_targets = targets
            tokens, targets, decoder_tokens = take_context_chunks(self.ctx, tokens, targets, decoder_tokens)
            if targets is not None:
                share = labelled_count(targets, clamp=False).double() / labelled_count(whole_targets)
        self.mode.begin_batch(self, tokens.shape[0], max(tokens.shape[1], decoder_tokens.shape[1]))
        if self.training:
            self.seeds.forward_count += 1
        if torch.is_grad_enabled():
            self._grads_pending = True  # a backward may follow: sync_grads has work again
        keep = self.attention_keep(attention_mask)
        x = self._head_input(self.decode(decoder_tokens, self.encode(tokens, keep), memory_keep=keep))
        if targets is None:
            return self.head.logits(x) if self.ctx.cp == 1 else gather_context(self.head.logits(x), self.ctx)
        loss = self.head.loss(x, targets)
        return loss if share is None else whole_loss(loss, share, self.ctx)

    def shift_right(self, targets: torch.Tensor) -> torch.Tensor:
        """The decoder's input of labels: the start token, then the labels but the last, -100 read
        as the pad token."""
        cfg = self.cfg
        shifted = torch.full_like(targets, cfg.decoder_start_token_id)
        shifted[:, 1:] = targets[:, :-1]
        return shifted.masked_fill(shifted == IGNORE_INDEX, cfg.pad_token_id)

    def start_tokens(self, batch: int, device) -> torch.Tensor:
        return torch.full((batch, 1), self.cfg.decoder_start_token_id, dtype=torch.int64, device=device)

    def check_targets(self, tokens, targets, *, name: str = "targets", labels: bool = True):
        """Labels (or, without `labels`, the decoder's input tokens) for `tokens`' sources."""
        if targets.dim() != 2 or targets.dtype != torch.int64:
            raise LatticeConfigError(f"{name} must be a (batch, seq) int64 tensor, got {tuple(targets.shape)} "
                                     f"{targets.dtype}")
        if targets.shape[0] != tokens.shape[0]:
            raise LatticeConfigError(f"{name} hold {targets.shape[0]} sequences, tokens {tokens.shape[0]}; give one "
                                     f"target sequence per source")
        if targets.shape[1] > self.cfg.target_len:
            raise LatticeConfigError(f"{name} of length {targets.shape[1]} exceed {type(self.cfg).__name__}.target_len = "
                                     f"{self.cfg.target_len}; shorten them or raise target_len")
        check_ids(name, targets, self.cfg.vocab_size, labels=labels)


    @torch.no_grad()
    def generate(self, prompt: torch.Tensor, max_new_tokens: int, *, temperature: float = 0.0,
                 top_k: int | None = None, seed: int = 0, use_cache: bool = True,
                 attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The decoder's tokens for (B, S) sources, identical on every rank of the replica: the
        start token, then up to `max_new_tokens` tokens, greedy at temperature 0 or sampled (as
        `Model.generate`). A sequence that emits eos_token_id continues with the pad token, and
        generation ends early when every sequence has, as transformers' generate does. The
        encoder runs once; with `use_cache` every decoder layer keeps its self-attention keys and
        values and the memory's cross-attention keys and values, and each step runs the newest
        position alone."""
        cfg = self.cfg
        check_context_batch(self.ctx, cached=True)
        if max_new_tokens > cfg.target_len:  # the decoder reads the start token and all but the last new one
            raise LatticeConfigError(f"{max_new_tokens} new tokens exceed target_len = {cfg.target_len}; ask for at "
                                     f"most {cfg.target_len}")
        self.check_inputs(prompt)
        self.check_padding(prompt, 0, attention_mask, None)
        was_training = self.training
        self.eval()
        B = prompt.shape[0]
        self.mode.begin_batch(self, B, max(prompt.shape[1], max_new_tokens))
        gen = torch.Generator().manual_seed(seed)
        keep = self.attention_keep(attention_mask)
        memory = self.encode(prompt, keep)
        out = self.start_tokens(B, prompt.device)
        cache = [{"self": {}, "cross": {}} for _ in self.decoder] if use_cache else None
        done = torch.zeros(B, dtype=torch.bool, device=prompt.device)
        for _ in range(max_new_tokens):
            start = out.shape[1] - 1 if use_cache else 0
            x = self.decode(out[:, start:], memory, cache=cache, start=start, memory_keep=keep)
            logits = self.head.logits(self._head_input(x[:, -1:]))[:, -1].float()  # (B, V)
            nxt = next_token(logits, temperature, top_k, gen).to(out.device)
            if cfg.eos_token_id is not None:
                nxt = nxt.masked_fill(done.unsqueeze(1), cfg.pad_token_id)
                done |= nxt.squeeze(1) == cfg.eos_token_id
            out = torch.cat([out, nxt], dim=1)
            if bool(done.all()):
                break
        self.train(was_training)
        return out
