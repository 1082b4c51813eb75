"""The cost builder's attention operations (lattice.cost.builder.CostBuilder): self-attention in
its kernels (fused, or the math kernel where an additive bias needs it), a context-parallel ring
of it, an encoder-decoder's position bias, memory and cross-attention. Each saves what its
kernel saves and adds its work; the mode prices the collectives around it."""

from __future__ import annotations

import math

from lattice.parallel.context import MeshAxis

CP = MeshAxis.CP


class AttentionTerms:
    """The attention half of CostBuilder (the state it reads and writes is the builder's)."""

    def attention(self, *, heads: int, kv_heads: int, head_size: int, causal: bool = True, rotary: bool = False,
                  bias: bool = False, shared_bias: bool = False, window: bool = False, padding: bool = True) -> None:
        """Scaled dot-product attention of q (heads), k and v (kv_heads) of `head_size`, which
        the preceding IN linear produced in one storage (`current`). Without an additive bias the
        fused kernel runs: it saves q, k, v (views of that storage, or rotated copies of q and k
        with `rotary`, whose cos and sin are saved too), the output and the log-sum-exp per head
        and token, with k and v at kv_heads. With a per-head bias (a mask that requires grad)
        the math kernel runs: it saves q, k and v expanded to every head and the attention
        weights, and the bias's distance indices (and the causal mask); its output is not saved,
        so the next linear saves its own copy. `shared_bias`: the bias is the stack's, computed
        once (`position_bias`), so its indices are not this layer's. A sliding `window` is a
        boolean mask that needs no gradient: the fused kernel still runs, and saves the mask as a
        (T, T) tensor of the activations' dtype, whole on every rank. `padding`: whether a padded
        batch's mask reaches this attention (`estimate(padded=True)`; T5's decoder reads its own
        positions unmasked), see `_save_mask`."""
        self._next()
        share = self.share.get("attention", self.share["split"])
        q = self.M * heads * head_size * share
        kv = self.M * kv_heads * head_size * share
        T = self.T
        if rotary and self.cp == 1:
            self.save(2 * T * head_size)  # cos and sin of the positions
        if rotary:
            self._elementwise("rotary", q + kv)
        masked = self.c.padded and padding
        if self.cp > 1:
            self._ring(q, kv, heads, rotary, head_size, masked=masked, window=window, causal=causal, bias=bias)
        elif bias:
            self.save(3 * q + self.B * heads * T * T * share)
            self.save_ints((0 if shared_bias else 8 * T * T) + (T * T if causal else 0))
            self.output_saved = False
        else:
            self.save(self.current + (q + kv if rotary else 0) + q + self.B * heads * T * share
                      + (T * T if window and not masked else 0))  # a padding mask takes the window's place
            self.keep(q + self.B * heads * T * share)  # the kernel's output and log-sum-exp
            self.output_saved = True
        if masked and self.cp == 1:
            self._save_mask(T, T, additive=bias)
        halves = causal and self.cp > 1 and self.cp_attention != "ulysses"  # the ring's halves (RingMasks.region)
        blocks = (self.cp + 1) / 2 if halves else self.cp
        self._score_work(self.B * heads * T * T * blocks * share, head_size, biased=bias and self.cp == 1)
        self.current = q

    def _ring(self, q: float, kv: float, heads: int, rotary: bool, head_size: int, *, masked: bool = False,
              window: bool = False, keys: int | None = None, causal: bool = False, bias: bool = False) -> None:
        """Attention over a cp group (lattice.models.components.ContextParallel) of this rank's
        q against every rank's k and v of `kv` elements. "ring": forward sends them on cp - 1
        times; backward sends them on as often again and their gradients cp times (the last
        brings them home). "all_gather": one all-gather of them in forward, again in backward,
        and one reduce-scatter of their gradients. Either saves q, k, v (views of the IN linear's
        storage, or rotated copies; each token's cos and sin of its own position), its output
        and the log-sum-exp per head and query; masks and bias are read again in backward, not
        saved. "ulysses": all-to-all of q, k, v and back of the output, each way; the fused
        kernel on whole sequences of 1/cp of the heads saves q, k, v as the all-to-all
        delivered them, its output and log-sum-exp, a padding (`masked`) or `window` mask over
        the whole sequences as `attention` describes, and the next linear its own input. `keys`:
        the tokens of the keys' sequence per rank (the memory's), default the queries'. Selective
        checkpointing keeps each fused kernel's output and log-sum-exp: ulysses' one; the ring's (and
        all_gather's) of every block, on CPU without a mask or bias (elsewhere the blocks run in products):
        rank i of a causal ring computes its own block, i earlier ranks' and half of each later one's."""
        cp, share = self.cp, self.share.get("attention", self.share["split"])
        rows = self.mode.attention_rows(self.B)
        cos_sin = 2 * (rows.stop - rows.start) * self.T * head_size if rotary else 0
        lse = self.B * heads * self.T * share
        grads_itemsize = max(self.c.itemsize, 4)
        if self.cp_attention == "ulysses":
            self.save(cos_sin + 2 * q + 2 * kv + lse)
            t_q, t_k = self.T * cp, (keys or self.T) * cp
            if masked:
                self._save_mask(t_q, t_k, additive=False)
            elif window:
                self.save(t_q * t_k)
            self.output_saved = False
            self.keep(q + lse)
            for phase in ("forward", "backward"):
                self.add(phase, "all_to_all", (CP,), 2 * q + 2 * kv, 4, "context")
            return
        self.save(self.current + (q + kv + cos_sin if rotary else 0) + q + lse)
        if not (masked or window or bias):
            i = self.topo.coords(self.c.rank).get(CP, 0)
            self.keep((q + lse) * (1 + i + (cp - 1 - i) / 2 if causal else cp))
        self.output_saved = True
        if self.cp_attention == "all_gather":
            self.add("forward", "all_gather", (CP,), 2 * kv * cp, 1, "context")
            self.add("backward", "all_gather", (CP,), 2 * kv * cp, 1, "context")
            self.add("backward", "reduce_scatter", (CP,), 2 * kv * cp, 1, "context", itemsize=grads_itemsize)
            return
        self.add("forward", "send", (CP,), 2 * kv * (cp - 1), cp - 1, "ring")  # beside each block's compute
        self.add("backward", "send", (CP,), 2 * kv * (cp - 1), cp - 1, "ring")
        self.add("backward", "send", (CP,), 2 * kv * cp, cp, "ring", itemsize=grads_itemsize)  # one step behind

    def _score_work(self, scores: float, head_size: int, biased: bool = False) -> None:
        """q kᵀ and the weights times v: 2·head_size multiply-adds per score, each; `biased`: in
        the kernel an additive bias that requires a gradient takes (Machine.biased_attention_rate)."""
        self._work("biased_scores" if biased else "scores", scores)
        self._work("attention_flops", 4 * head_size * scores)
        self._work("flops", 4 * head_size * scores)
        if biased:  # the math kernel's products, which selective checkpointing runs again (lattice.models.recompute)
            self._work("again:attention_flops", 4 * head_size * scores)
            self._work("again:flops", 4 * head_size * scores)

    def position_bias(self) -> None:
        """A stack's relative position bias (T5's): the (T, T) bucket indices of the table
        lookup, saved once for the stack's layers; under cp, (T/cp, T), and ring attention keeps
        the bias of this rank's heads (one storage for the stack). Its work, once a pass: the
        lookup of this rank's heads' bias for every pair of positions, whose backward sums each
        pair's gradient into the table's row of its bucket (operator "position_bias")."""
        self._next()
        heads = self.cfg.n_heads // math.prod(self.topo.size(a) for a in self.mode.head_axes)
        self.save_ints(8 * self.T * self.T * self.cp)
        if self.cp > 1:
            self.save(heads * self.T * self.T * self.cp)
        self._elementwise("position_bias", heads * self.T * self.T * self.cp)

    def memory(self) -> None:
        """The stream is now the encoder's output, which the decoder's cross-attention reads (in
        every layer, `linear(..., from_memory=True)`)."""
        self.memory_tokens, self.memory_elements = self.T, self.residual

    def _save_mask(self, t_q: int, t_k: int, additive: bool) -> None:
        """The padding mask (rows, 1, t_q, t_k) of the sequences this rank's attention computes
        (`Mode.attention_rows`), which attention saves: the fused kernel a copy in the
        activations' dtype; beside an additive bias, the masked fill its boolean mask."""
        rows = self.mode.attention_rows(self.B)
        elements = (rows.stop - rows.start) * t_q * t_k
        if additive:
            self.save_ints(elements)
        else:
            self.save(elements)

    def cross_attention(self, *, heads: int, head_size: int) -> None:
        """Attention of the current stream's queries (the IN linear before last) to the memory's
        keys and values (the last IN linear's one storage), no mask: the fused kernel saves q, k
        and v (views of those two storages), its output and the log-sum-exp per head and query."""
        self._next()
        share = self.share.get("attention", self.share["split"])
        out = self.M * heads * head_size * share
        if self.cp > 1:  # the memory's keys and values around the ring
            self.current = self.previous + self.current  # q and the memory's k, v: two storages
            self._ring(out, self.B * self.memory_tokens * heads * head_size * share, heads, False, head_size,
                       masked=self.c.padded, keys=self.memory_tokens)
        else:
            self.save(self.previous + self.current + out + self.B * heads * self.T * share)
            self.keep(out + self.B * heads * self.T * share)  # the kernel's output and log-sum-exp
            if self.c.padded:  # the sources' mask
                self._save_mask(self.T, self.memory_tokens, additive=False)
        self.output_saved = True
        self._score_work(self.B * heads * self.T * self.memory_tokens * self.cp * share, head_size)
        self.current = out
