"""Context parallelism: a cp group of N ranks splits every sequence into 2N equal chunks, and rank
i holds chunks i and 2N-1-i. Under the causal mask a query in chunk c sees c + 1 chunks, so each
rank's two chunks see 2N + 1 chunks between them, the same on every rank (Megatron-core's and
torchtitan's load balancing). Linear layers, norms and the MLP are token-wise and run on the
local chunks unchanged; attention runs around the cp ring:

    forward   O_i = merge_s attn(Q_i, K_(i-s), V_(i-s)),  s = 0 .. N-1      (K, V sent on to i+1)
    backward  dQ_i = Σ_s dS_(i,i-s) K_(i-s);  dK_j, dV_j summed along the ring and sent home

where merge combines the partial softmaxes exactly by their log-sum-exp (as flash attention's
online softmax does), and each step's send to the next rank runs while this step's block is
computed. A block of scores is recomputed in backward from the saved log-sum-exp, so a rank keeps
only its own q, k, v, output and log-sum-exp: activations fall as 1/N.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from lattice.parallel.comm import all_reduce, raw_all_gather, raw_reduce_scatter, record
from lattice.parallel.context import LatticeConfigError, MeshAxis, ParallelContext


def chunk_indices(seq: int, cp: int, index: int) -> torch.Tensor:
    """Positions (in 0 .. seq-1) of the tokens rank `index` of a cp group of `cp` holds: chunks
    index and 2·cp-1-index of 2·cp equal chunks, in that order."""
    c = seq // (2 * cp)
    return torch.cat([torch.arange(index * c, (index + 1) * c),
                      torch.arange((2 * cp - 1 - index) * c, (2 * cp - index) * c)])


def take_chunks(x: torch.Tensor, dim: int, cp: int, index: int) -> torch.Tensor:
    """Rank `index`'s two chunks of x's dimension `dim` (the sequence's), as one tensor."""
    c = x.shape[dim] // (2 * cp)
    return torch.cat([x.narrow(dim, index * c, c), x.narrow(dim, (2 * cp - 1 - index) * c, c)], dim=dim)


def restore_order(gathered: torch.Tensor, dim: int, cp: int) -> torch.Tensor:
    """The whole sequence from every rank's chunks concatenated in cp order along `dim`."""
    pieces = gathered.chunk(2 * cp, dim=dim)  # rank r's chunks are pieces 2r and 2r + 1
    order = [None] * (2 * cp)
    for r in range(cp):
        order[r], order[2 * cp - 1 - r] = pieces[2 * r], pieces[2 * r + 1]
    return torch.cat(order, dim=dim)


class Ring:
    """This rank's place in its cp group: its index, the ranks before and after it, and the
    exchange of one tensor with them (send to the next, receive from the previous)."""

    def __init__(self, ctx: ParallelContext):
        self._join(ctx.topology.group_members(MeshAxis.CP, ctx.rank), ctx.group(MeshAxis.CP), ctx.coord(MeshAxis.CP))

    @classmethod
    def of(cls, members: list[int], group) -> "Ring":
        """The ring of the process group `group` of global ranks `members` (in ring order), this
        rank among them, without a ParallelContext (the calibration's)."""
        ring = cls.__new__(cls)
        ring._join(members, group, members.index(dist.get_rank()))
        return ring

    def _join(self, members: list[int], group, index: int) -> None:
        self.size, self.index, self.group = len(members), index, group
        self.next, self.prev = members[(self.index + 1) % self.size], members[(self.index - 1) % self.size]

    def start(self, x: torch.Tensor, tag: int = 0):
        """Send x to the next rank and receive the previous rank's into a new tensor; returns
        (the tensor being received, the requests). `tag` keeps apart two exchanges in flight at
        once (backward's keys and their gradients)."""
        x = x.contiguous()
        incoming = torch.empty_like(x)
        record("send", self.group, x.numel(), x.dtype)
        ops = [dist.P2POp(dist.isend, x, self.next, self.group, tag),
               dist.P2POp(dist.irecv, incoming, self.prev, self.group, tag)]
        return incoming, dist.batch_isend_irecv(ops)

    @staticmethod
    def finish(incoming: torch.Tensor, requests) -> torch.Tensor:
        for request in requests:
            request.wait()
        return incoming

    def pass_on(self, x: torch.Tensor, tag: int = 0) -> torch.Tensor:
        return self.finish(*self.start(x, tag))

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's x, (N, *x.shape), in one all-gather (the variant without the ring)."""
        return raw_all_gather(x.unsqueeze(0), self.group, 0)


def keys_seen(keep: torch.Tensor, queries: torch.Tensor | None = None) -> torch.Tensor:
    """Which keys each query may see by `keep` alone, bool broadcastable to (B_l, 1, T_q, T_k):
    a padding mask (bool (B_l, T_k), False at padding) hides keys; document ids (int64 (B_l, T_k),
    0 at padding, packed documents numbered from 1) also hide every key of another document than
    the query's (`queries`: the queries' ids, (B_l, T_q))."""
    if keep.dtype == torch.bool:
        return keep[:, None, None, :]
    return (keep != 0)[:, None, None, :] & (queries[:, None, :, None] == keep[:, None, None, :])


class RingMasks:
    """Which key each local query may see, for the keys of any rank's chunks: causal by the
    tokens' places in the whole sequence, a sliding window, padding or packed documents (`keep`
    (B_l, T_k) of the whole sequence, which every rank holds, as `keys_seen` reads it); a query
    that sees no key at all (a left pad under the causal mask) sees every key instead, as
    `attend` does."""

    def __init__(self, ring: Ring, t_q: int, t_k: int, *, causal: bool, window: int | None, keep, device):
        self.ring, self.causal, self.window, self.keep, self.t_k = ring, causal, window, keep, t_k
        self.queries = chunk_indices(t_q * ring.size, ring.size, ring.index).to(device)
        self.blind = None  # (B_l, 1, T_q, 1) the queries that see every key
        if keep is not None and keep.dtype != torch.bool:  # documents: a token sees at least itself
            self.blind = (keep[:, self.queries] == 0)[:, None, :, None]
        elif keep is not None:
            seen = keep.long().cumsum(-1)  # (B_l, T_full): keys up to each place
            if not causal:
                visible = keep.any(-1, keepdim=True).expand(-1, len(self.queries))
            else:
                upto = seen[:, self.queries]
                if window is not None:
                    before = self.queries - window
                    upto = upto - torch.where(before >= 0, seen[:, before.clamp_min(0)], 0)
                visible = upto > 0
            self.blind = ~visible[:, None, :, None]
        # causal, each step's keys lie wholly before one of this rank's query chunks and wholly
        # after the other (or are its own): half the block is all that can be seen, unless a
        # query that sees no key at all must see every key
        self.halves = causal and (self.blind is None or not bool(self.blind.any()))
        # CPU: each block by the fused kernel, which returns the block's log-sum-exp, where no
        # mask but the diagonal block's causal one is needed
        self.fused = torch.device(device).type == "cpu" and keep is None and window is None

    def keys(self, owner: int) -> torch.Tensor:
        return chunk_indices(self.t_k * self.ring.size, self.ring.size, owner).to(self.queries.device)

    def region(self, owner: int) -> tuple[slice, slice]:
        """(query rows, key columns) of the block against rank `owner`'s keys that a query may
        see; the rest of the block is masked. Causal: rank i's own keys, the whole block;
        an earlier rank's (owner < i), its first chunk for both query chunks; a later rank's, its
        both chunks for the second query chunk alone. Every rank then computes 1 + (cp-1)/2 blocks."""
        whole = slice(None)
        if not self.halves or owner == self.ring.index:
            return whole, whole
        if owner < self.ring.index:
            return whole, slice(0, self.t_k // 2)
        return slice(len(self.queries) // 2, None), whole

    def allowed(self, owner: int, rows: slice, cols: slice) -> torch.Tensor | None:
        """bool (.., T_q, T_k) for rank `owner`'s keys in `cols` and the queries in `rows`; None
        when all are seen."""
        if not self.causal and self.keep is None:
            return None
        keys, queries = self.keys(owner)[cols], self.queries[rows]
        allowed = torch.ones(len(queries), len(keys), dtype=torch.bool, device=keys.device)
        if self.causal:
            allowed = allowed & (keys[None, :] <= queries[:, None])
        if self.window is not None:
            allowed = allowed & (keys[None, :] > queries[:, None] - self.window)
        if self.keep is not None:
            documents = None if self.keep.dtype == torch.bool else self.keep[:, queries]  # (cross-attention: none)
            seen = keys_seen(self.keep[:, keys], documents)
            allowed = (allowed & seen) | self.blind[:, :, rows]  # (B_l, 1, T_q, T_k)
        return allowed


def _expand(t: torch.Tensor, heads: int) -> torch.Tensor:
    """Grouped-query keys or values (B, nkv, T, hs) repeated to `heads` (query head i reads kv head
    i // (heads / nkv), as scaled_dot_product_attention's enable_gqa does)."""
    return t if t.shape[1] == heads else t.repeat_interleave(heads // t.shape[1], dim=1)


def _fold(t: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """The gradient of `_expand`: the repeats of each kv head summed."""
    return t if t.shape[1] == kv_heads else t.unflatten(1, (kv_heads, -1)).sum(2)


class RingAttention(torch.autograd.Function):
    """softmax(scale · Q Kᵀ + bias [+ masks]) V with this rank's queries Q (B_l, nh, T_q, hs)
    against the keys and values of every rank of the cp group, K and V (B_l, nkv, T_k, hs) being
    this rank's chunks; `bias` (nh, T_q, T_k · N) against the whole key sequence, or None.

    forward:  each step s computes the block against rank (i - s)'s K, V while they move on, and
              merges it into the running output by the log-sum-exp
    backward: P = exp(S - lse), D = rowsum(dO ∘ O), dS = P ∘ (dO Vᵀ - D);  dQ += scale dS K,
              dK += scale dSᵀ Q and dV += Pᵀ dO travel one step behind K, V (each rank adds its
              part while the sum of the ranks before arrives) and reach their rank at the end
    """

    @staticmethod
    def forward(ctx, q, k, v, bias, ring: Ring, masks: RingMasks, scale: float, gather: bool):
        acc = torch.promote_types(q.dtype, torch.float32)
        qa = q.to(acc)
        heads, fused = q.shape[1], masks.fused and bias is None
        out = torch.zeros_like(qa)
        lse = torch.full(q.shape[:3], float("-inf"), dtype=acc, device=q.device)
        kv = torch.stack([k, v])  # (2, B_l, nkv, T_k, hs): one message per step
        every = ring.gather(kv) if gather else None  # (N, 2, ...): every rank's, in one all-gather
        for step in range(ring.size):
            owner = (ring.index - step) % ring.size
            if every is not None:
                kv = every[owner]
            moving = ring.start(kv) if step < ring.size - 1 and every is None else None
            rows, cols = masks.region(owner)
            if fused:
                block_out, block_lse = _FLASH(q[:, :, rows], _expand(kv[0][:, :, cols], heads),
                                              _expand(kv[1][:, :, cols], heads), 0.0,
                                              masks.causal and owner == ring.index, scale=scale)
                block_out, block_lse = block_out.to(acc), block_lse.to(acc)
            else:
                scores = _scores(qa[:, :, rows], kv[0][:, :, cols], bias, masks, owner, rows, cols, scale)
                block_lse = scores.logsumexp(-1)
                probs = torch.exp(scores - _finite(block_lse)[..., None])
                block_out = probs @ _expand(kv[1][:, :, cols].to(acc), heads)
            before = lse[:, :, rows]
            merged = torch.logaddexp(before, block_lse)
            out[:, :, rows] = (out[:, :, rows] * torch.exp(before - _finite(merged))[..., None]
                               + block_out * torch.exp(block_lse - _finite(merged))[..., None])
            lse[:, :, rows] = merged
            if moving is not None:
                kv = ring.finish(*moving)
        ctx.save_for_backward(q, k, v, bias, out, lse)
        ctx.ring, ctx.masks, ctx.scale, ctx.gather = ring, masks, scale, gather
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, d_out):
        q, k, v, bias, out, lse = ctx.saved_tensors
        ring, masks, scale = ctx.ring, ctx.masks, ctx.scale
        acc, heads, kv_heads = out.dtype, q.shape[1], k.shape[1]
        qa, d_out = q.to(acc), d_out.to(acc)
        row_dot = (d_out * out).sum(-1, keepdim=True)  # D (B_l, nh, T_q, 1)
        dq = torch.zeros_like(qa)
        d_bias = torch.zeros_like(bias, dtype=acc) if bias is not None and ctx.needs_input_grad[3] else None
        kv = torch.stack([k, v])
        every = ring.gather(kv) if ctx.gather else None  # gathered again rather than kept from forward
        d_every = torch.zeros((ring.size, *kv.shape), dtype=acc, device=kv.device) if ctx.gather else None
        fused = masks.fused and bias is None
        if fused:  # the fused kernel's backward of a block takes the whole attention's output and log-sum-exp
            out_q, lse_q, d_out_q = out.to(q.dtype), lse.to(_flash_lse_dtype(q)), d_out.to(q.dtype)
        arriving = None  # the gradients of this step's keys summed by the ranks before, on their way here
        for step in range(ring.size):
            owner = (ring.index - step) % ring.size
            if every is not None:
                kv, d_kv = every[owner], d_every[owner]
            else:
                d_kv = torch.zeros(kv.shape, dtype=acc, device=kv.device)  # this rank's part, while they arrive
            moving = ring.start(kv) if step < ring.size - 1 and every is None else None
            rows, cols = masks.region(owner)
            if fused:
                block_dq, block_dk, block_dv = _FLASH_BACKWARD(
                    d_out_q[:, :, rows], q[:, :, rows], _expand(kv[0][:, :, cols], heads),
                    _expand(kv[1][:, :, cols], heads), out_q[:, :, rows], lse_q[:, :, rows], 0.0,
                    masks.causal and owner == ring.index, scale=scale)
                dq[:, :, rows] += block_dq
                d_kv[0][:, :, cols] += _fold(block_dk.to(acc), kv_heads)
                d_kv[1][:, :, cols] += _fold(block_dv.to(acc), kv_heads)
            else:
                keys, values = _expand(kv[0][:, :, cols].to(acc), heads), _expand(kv[1][:, :, cols].to(acc), heads)
                q_rows, d_out_rows = qa[:, :, rows], d_out[:, :, rows]
                scores = _scores(q_rows, kv[0][:, :, cols], bias, masks, owner, rows, cols, scale)
                probs = torch.exp(scores - lse[:, :, rows, None])  # every query sees some key: lse is finite
                d_scores = probs * (d_out_rows @ values.transpose(-1, -2) - row_dot[:, :, rows])
                dq[:, :, rows] += scale * (d_scores @ keys)
                d_kv[0][:, :, cols] += _fold(scale * (d_scores.transpose(-1, -2) @ q_rows), kv_heads)
                d_kv[1][:, :, cols] += _fold(probs.transpose(-1, -2) @ d_out_rows, kv_heads)
                if d_bias is not None:
                    d_bias[:, rows][..., masks.keys(owner)[cols]] += d_scores.sum(0)
            if every is None:  # with the part of the ranks before, on to the next (after the last step: home)
                if arriving is not None:
                    d_kv += ring.finish(*arriving)
                arriving = ring.start(d_kv, tag=1)
            if moving is not None:
                kv = ring.finish(*moving)
        if every is not None:  # each rank's gradients summed onto it
            d_kv = raw_reduce_scatter(d_every, ring.group, 0)[0]
        else:
            d_kv = ring.finish(*arriving)
        return (dq.to(q.dtype), d_kv[0].to(k.dtype), d_kv[1].to(v.dtype),
                None if d_bias is None else d_bias.to(bias.dtype), None, None, None, None)


_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def _flash_lse_dtype(q: torch.Tensor) -> torch.dtype:
    """The dtype of the fused CPU kernel's log-sum-exp: float32 for half-precision inputs."""
    return torch.float32 if q.dtype in (torch.bfloat16, torch.float16) else q.dtype


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """The log-sum-exp to subtract: 0 where it is -inf (a block with no key to see), so that
    exp(-inf - 0) gives 0 rather than exp(-inf + inf), NaN."""
    return torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)


def _scores(q, k, bias, masks: RingMasks, owner: int, rows: slice, cols: slice, scale: float) -> torch.Tensor:
    """scale · Q Kᵀ (+ bias) with -inf where masked, (B_l, nh, T_q, T_k): the queries in `rows`
    against rank `owner`'s keys in `cols` (q and k already cut to them)."""
    scores = scale * (q @ _expand(k.to(q.dtype), q.shape[1]).transpose(-1, -2))
    if bias is not None:
        scores = scores + bias[:, rows][..., masks.keys(owner)[cols]].to(q.dtype)
    allowed = masks.allowed(owner, rows, cols)
    return scores if allowed is None else scores.masked_fill(~allowed, float("-inf"))


def ring_attend(ring: Ring, q, k, v, bias=None, *, causal: bool, scale: float | None = None,
                window: int | None = None, keep: torch.Tensor | None = None, gather: bool = False) -> torch.Tensor:
    """`lattice.models.components.attend` for a cp group: q (B_l, nh, T_q, hs) this rank's
    queries, k and v (B_l, nkv, T_k, hs) its keys and values (each two chunks of its sequence),
    `keep` (B_l, T_k · N) the padding mask of the whole sequence, `bias` (nh, T_q, T_k · N).
    `gather`: every rank's keys and values in one all-gather (forward, and again in backward,
    whose key gradients one reduce-scatter sums) instead of around the ring."""
    masks = RingMasks(ring, q.shape[2], k.shape[2], causal=causal, window=window, keep=keep, device=q.device)
    return RingAttention.apply(q, k, v, bias, ring, masks, scale if scale is not None else q.shape[-1] ** -0.5,
                               gather)


def sequence_order(seq: int, cp: int) -> torch.Tensor:
    """The positions of a sequence gathered in cp-rank order (rank 0's two chunks, rank 1's, ...)."""
    return torch.cat([chunk_indices(seq, cp, r) for r in range(cp)])


# ----------------------------------------------------------------------------- a model's batch
def check_context_batch(ctx: ParallelContext, *sequences: torch.Tensor | None, start: int = 0,
                        cached: bool = False, logits: bool = False) -> None:
    """One line unless a batch's `sequences` (tokens, targets, ...; (B, T) each, None skipped)
    can each be split over the cp group (every rank, before any collective). `logits`: the call
    returns logits (no targets), which cp gathers for inference alone."""
    cp = ctx.cp
    if cp == 1:
        return
    if cached or start:
        raise LatticeConfigError(f"generation and cached decoding run with cp = 1 (this layout has cp = {cp}); "
                                 f"generate from the checkpoint with a layout without --cp")
    if logits and torch.is_grad_enabled():
        raise LatticeConfigError("under context parallelism a model without targets returns the logits of whole "
                                 "sequences for inference only: call it under torch.no_grad()")
    for seq in (s for s in sequences if s is not None):
        if seq.dim() < 2:
            raise LatticeConfigError("context parallelism splits every sequence, so it takes one target per token "
                                     "(language modelling, masked tokens); sequence-level targets (a class per "
                                     "sequence) need cp = 1")
        n = seq.shape[-1]
        if n % (2 * cp):
            raise LatticeConfigError(f"sequence length {n} does not split into 2·cp = {2 * cp} equal chunks; use a "
                                     f"length that is a multiple of {2 * cp} (for example "
                                     f"{(n // (2 * cp) + 1) * 2 * cp}) or another cp")


def take_context_chunks(ctx: ParallelContext, *sequences: torch.Tensor | None) -> tuple:
    """This rank's chunks of each of a replica's (B, T) `sequences`; None stays None, and
    without cp every tensor stays as it is (a class per sequence included)."""
    cp, index = ctx.cp, ctx.coord(MeshAxis.CP)
    if cp == 1:
        return sequences
    return tuple(None if t is None else take_chunks(t, 1, cp, index) for t in sequences)


def context_positions(ctx: ParallelContext, seq: int, device=None) -> torch.Tensor:
    """The places in a sequence of `seq` tokens of this rank's chunks, (T / cp,)."""
    return chunk_indices(seq, ctx.cp, ctx.coord(MeshAxis.CP)).to(device)


def whole_loss(loss: torch.Tensor, share: torch.Tensor, ctx: ParallelContext) -> torch.Tensor:
    """The replica's mean loss from each rank's mean over its chunks, weighed by its share of the
    labelled targets: summed over the cp group in forward; in backward each rank's gradient is its
    own part's, and the parameters' gradients are summed over cp afterwards (sync_grads)."""
    return all_reduce(loss * share.to(loss.dtype), ctx.group(MeshAxis.CP))


def gather_context(x: torch.Tensor, ctx: ParallelContext, dim: int = 1) -> torch.Tensor:
    """The whole sequences of a tensor whose `dim` holds this rank's chunks (inference: logits)."""
    return restore_order(raw_all_gather(x, ctx.group(MeshAxis.CP), dim), dim, ctx.cp)
