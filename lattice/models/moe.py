"""Mixtures of experts, written once against the mode interface: a router, dropless dispatch to
SwiGLU experts and the combine (Mixtral's and Qwen2-MoE's MLP), the load-balancing loss as
transformers computes it, and the decoder base the MoE families share.

    y = moe(x, token_mask=mask, balance=stats)     # x, y in the residual layout

At an MoE layer each layout hands over its tokens whole (`Mode.expert_tokens`: a set no other rank
of the replica holds) and takes the outputs back. Every rank holds the router and every expert
whole (`Mode.token_spec`: their gradients summed over the replica's ranks, which saw other
tokens). Per token (n tokens, E experts, top k):

    logits = x Wᵣᵀ                      # (n, E), router `router.weight` (E, h) as transformers keeps it
    probs = softmax(logits)             # at float32 or above, as transformers does
    w, e = topk(probs, k)               # (n, k), highest first
    w = w / Σ w                         # Mixtral always, Qwen2-MoE with norm_topk_prob
    y = Σ_j w_j · down[e_j](silu(gate[e_j] x) · up[e_j] x)

Dispatch sorts the n·k (token, expert) pairs by expert (stable), runs each expert on its rows,
puts the rows back in token order and sums each token's k weighted outputs: no capacity, no token
dropped. Experts are kept as transformers 5 keeps them with the experts' dim folded into the rows:
`experts.gate_up` (E·2I, h) and `experts.down` (E·h, I); with `--ep` they split over a replica's
ranks, the context-parallel ranks, the data-parallel replicas or several (`Experts`). With
`expert_bias_rate`, DeepSeek-V3's expert bias picks the experts instead of the probabilities
alone (`Router`).

The load-balancing loss (Switch Transformer's, over all MoE layers together as transformers'
`load_balancing_loss_func`): with C_e the top-k assignments of expert e and S_e the sum of its
router probabilities over the batch's tokens (padding excluded) and every MoE layer, and R the
tokens times the layers,

    aux = E · Σ_e (C_e / R) · (S_e / R),       loss = cross-entropy + router_aux_loss_coef · aux

C, S and R are summed over the replica's ranks, its context-parallel ranks and the data-parallel
replicas per layer (2E + 2 numbers, with the labelled targets of every replica), so that the loss
is the whole batch's; C is a constant to autograd, so each rank differentiates its own share of S,
scaled by dp over the replica's weight (the Trainer's, dp x its share of the labelled targets):
the replicas' average of the weighted gradients is the batch's, padded replicas or not.
With micro-batches (gradient accumulation) each micro-batch takes its own statistics, as
Megatron-LM does.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from lattice.models.base import DecoderLM
from lattice.modes.kernels.layers import upcast
from lattice.parallel import comm
from lattice.parallel.context import LatticeConfigError, MeshAxis
from lattice.parallel.context_parallel import take_context_chunks
from lattice.parallel.sharding import ShardSpec, register_sharded


class Balance:
    """One forward's router statistics, a row per MoE layer: C (E,), this rank's S (E,) with its
    graph, the whole batch's S (E,) and R, the batch's labelled targets over every replica, and
    with a z-loss Z, the sum of logsumexp(logits)² over the tokens (this rank's with its graph, the
    batch's). `labelled`: this replica's labelled targets of the batch (whole sequences)."""

    def __init__(self, ctx, experts: int, z_loss: bool = False, carried: torch.Tensor | None = None,
                 labelled: float = 0.0):
        self.ctx, self.experts, self.z_loss, self.layers, self.carried = ctx, experts, z_loss, {}, carried
        self.labelled = labelled

    def add(self, layer: int, probs: torch.Tensor, chosen: torch.Tensor, mask: torch.Tensor | None,
            logits: torch.Tensor | None = None) -> torch.Tensor | None:
        """Record one MoE layer's statistics; its assignments per expert over the whole batch (C),
        or None where the layer was recorded already (recomputed under activation checkpointing)."""
        n, E = probs.shape
        valid = probs.new_ones(n) if mask is None else mask.to(probs.dtype)
        counts = probs.new_zeros(E).scatter_add_(0, chosen.reshape(-1), valid.repeat_interleave(chosen.shape[1]))
        mine = (probs * valid[:, None]).sum(0)
        z = (upcast(logits).logsumexp(-1).square() * valid).sum()[None] if self.z_loss else None
        if layer in self.layers:  # recomputed under activation checkpointing: recorded already
            return None
        # (each of the replica's tensor and cp ranks holds its labelled count: their share of it sums to it)
        labelled = probs.new_tensor([self.labelled / (comm.group_size(self.ctx.tensor_group()) * self.ctx.cp)])
        whole = torch.cat([counts, mine.detach(), valid.sum()[None], labelled] + ([z.detach()] if z is not None else []))
        for group in (self.ctx.tensor_group(), self.ctx.group(MeshAxis.DP, MeshAxis.CP)):
            if comm.group_size(group) > 1:
                whole = comm.raw_all_reduce(whole, group)
        self.layers[layer] = (whole[:E], mine, whole[E:2 * E], whole[2 * E:2 * E + 1], z, whole[2 * E + 2:],
                              whole[2 * E + 1:2 * E + 2])
        return whole[:E]

    def report(self, value: torch.Tensor, z: torch.Tensor | None) -> dict[str, float]:
        """The balancing loss (and z-loss) and each MoE layer's most and mean assignments per expert
        (the whole batch's), as `MoEDecoder.step_metrics` reports them."""
        return {"balance_loss": float(value), **({"z_loss": float(z)} if z is not None else {}), **self.loads()}

    def loads(self) -> dict[str, float]:
        """Each of this forward's MoE layers' most and mean assignments per expert (the batch's)."""
        out = {}
        for k in sorted(self.layers):
            counts = self.layers[k][0]
            out[f"moe{k}_load_max"], out[f"moe{k}_load_mean"] = float(counts.max()), float(counts.mean())
        return out

    def totals(self) -> list:
        """[C, this rank's S, the batch's S, R, this rank's z, the batch's z, the labelled targets
        of every replica] over this forward's MoE layers and those a pipeline's earlier stages
        carried here (z: each layer's Z over its R; the targets: any layer's)."""
        E, like = self.experts, self.carried
        if like is None and self.layers:
            like = next(iter(self.layers.values()))[0]
        sizes = (E, E, E, 1, 1, 1, 1)
        zeros = [torch.zeros(n, dtype=torch.float64) if like is None else like.new_zeros(n) for n in sizes]
        out = zeros if self.carried is None else list(self.carried.split(sizes))
        for counts, mine, whole, rows, z, z_whole, labelled in (self.layers[k] for k in sorted(self.layers)):
            out = [out[0] + counts, out[1] + mine, out[2] + whole, out[3] + rows,
                   out[4] + (z / rows if z is not None else 0), out[5] + (z_whole / rows if z is not None else 0),
                   labelled]
        return out

    def carried_out(self, dtype: torch.dtype) -> torch.Tensor:
        """`totals` as one vector (3E + 4) for the next pipeline stage: this rank's S and z with
        their graph, so that the last stage's loss differentiates into every stage."""
        return torch.cat([t.reshape(-1).to(dtype) for t in self.totals()])

    def loss(self, aux_coef: float, z_coef: float = 0.0) -> torch.Tensor:
        """aux_coef x aux + z_coef x z (module docstring): its value the whole batch's, its gradient
        this rank's share, times dp / this replica's weight (the Trainer's, dp x its share of the
        labelled targets, multiplies it back), so that the replicas' average is the batch's."""
        counts, mine, whole, total, z_mine, z, labelled = self.totals()
        E = counts.shape[0]
        aux = E * ((counts / total) * (whole / total)).sum()
        value = aux_coef * aux + z_coef * z.sum()  # z: each layer's mean over its tokens, summed (Megatron-LM's)
        weight = self.ctx.dp * self.labelled / labelled if self.labelled else 1.0  # (labelled: every replica's, > 0)
        share = (aux_coef * E * ((counts / total) * (mine / total)).sum() + z_coef * z_mine.sum()) * self.ctx.dp / weight
        self.reported = self.report(aux.detach(), z.sum() if self.z_loss else None)
        return share + (value - share).detach()


def refuse_expert_bias(cfg, hf_class: str) -> None:
    """Refuse an export to transformers of a model routed with an expert bias, which it has not."""
    if getattr(cfg, "expert_bias_rate", 0.0):
        raise LatticeConfigError(f"expert_bias_rate = {cfg.expert_bias_rate}: this model picks its experts with "
                                 f"DeepSeek-V3's expert bias, which transformers' {hf_class} has not (it would route "
                                 f"its tokens elsewhere); export a model trained with expert_bias_rate = 0")


class Router(nn.Module):
    """logits = x Wᵀ with W (E, h); the top k experts of each token and their weights. With
    `bias_rate` > 0, DeepSeek-V3's aux-loss-free balancing: an expert bias b (E,), the model's own
    state rather than a weight the optimizer trains, picks the experts, top-k of probs + b, while
    the weights stay the probabilities; after each optimizer step (`update_bias`) b moves by
    bias_rate toward balance, b_e += bias_rate · sign(mean(c) - c_e), c the step's assignments per
    expert over the whole batch (every micro-batch and replica), so every rank moves it alike."""

    def __init__(self, mode, d_model: int, experts: int, top_k: int, normalize: bool, bias_rate: float = 0.0):
        super().__init__()
        spec = mode.token_spec()
        register_sharded(self, "weight", ShardSpec((experts, d_model), **spec), mode.ctx)
        self.top_k, self.normalize, self.bias_rate, self.loads = top_k, normalize, bias_rate, None
        if bias_rate:  # held where the router is, whole, no gradient to sum
            register_sharded(self, "expert_bias", ShardSpec((experts,), holders=spec.get("holders", ()),
                                                            trainable=False), mode.ctx)
        else:
            self.expert_bias = None

    def _apply(self, fn, recurse=True):
        out = super()._apply(fn, recurse)
        if self.expert_bias is not None and self.expert_bias.dtype in (torch.bfloat16, torch.float16):
            self.expert_bias.data = self.expert_bias.data.float()  # steps of bias_rate need float32's precision
        return out

    def forward(self, tokens):  # (n, h) -> logits, probs (n, E), weights (n, k), experts (n, k)
        logits = F.linear(tokens, self.weight)
        probs = torch.softmax(upcast(logits), dim=-1)
        if self.expert_bias is None:
            weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        else:
            chosen = torch.topk(probs + self.expert_bias.to(probs.dtype), self.top_k, dim=-1).indices
            weights = probs.gather(-1, chosen)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return logits, probs, weights.to(tokens.dtype), chosen

    @torch.no_grad()
    def update_bias(self) -> None:
        """b += bias_rate · sign(mean(c) - c) by the loads c the step's training forwards counted."""
        self.expert_bias += self.bias_rate * torch.sign(self.loads.mean() - self.loads).to(self.expert_bias.dtype)


class Experts(nn.Module):
    """E SwiGLU MLPs of width I: `gate_up` (E·2I, h), each expert's 2I rows (gate rows first), and
    `down` (E·h, I), each expert's h rows: transformers' (E, 2I, h) and (E, h, I) with the experts'
    dim folded into the rows, so that ZeRO splits an expert's state over the replicas by its rows
    even where a rank holds one expert. With ep > 1 the E experts split over the layout's expert
    axes (`Mode.expert_axes`: a replica's, the cp ranks', the replicas', or several) in blocks of E/ep,
    and each (token, expert) row travels to its expert's rank and back (`comm.exchange`)."""

    def __init__(self, mode, d_model: int, experts: int, width: int):
        super().__init__()
        spec = dict(mode.token_spec())
        layout = mode.ctx.layout
        self.axes = layout.expert_axes if layout is not None else ()
        if self.axes:  # summed over the ranks with the same experts, split over the axes
            spec = {**spec, "grad_sum": tuple(a for a in spec.get("grad_sum", ()) if a not in self.axes),
                    "splits": ((0, self.axes),)}
        register_sharded(self, "gate_up", ShardSpec((experts * 2 * width, d_model), **spec), mode.ctx)
        register_sharded(self, "down", ShardSpec((experts * d_model, width), **spec), mode.ctx)
        self.experts, self.ctx, self.width, self.d_model = experts, mode.ctx, width, d_model

    def _run(self, rows, counts: list[int]):
        """This rank's experts on `rows` grouped by expert, counts[e] rows each."""
        outputs = []
        gate_up = self.gate_up.view(-1, 2 * self.width, self.d_model)  # (E here, 2I, h)
        down = self.down.view(-1, self.d_model, self.width)  # (E here, h, I)
        for e, chunk in enumerate(rows.split(counts)):
            if chunk.shape[0]:
                gate, up = F.linear(chunk, gate_up[e]).chunk(2, dim=-1)
                outputs.append(F.linear(F.silu(gate) * up, down[e]))
        return torch.cat(outputs) if outputs else rows

    def _run_across(self, rows, counts: torch.Tensor, group):
        """The rows (grouped by expert) through their experts on the ranks of `group` and back."""
        n = comm.group_size(group)
        local = self.experts // n
        arriving = comm.raw_all_to_all(counts, group, 0, 0).view(n, local)  # from each rank, for each of my experts
        send, recv = counts.view(n, local).sum(1).tolist(), arriving.sum(1).tolist()
        sizes = arriving.reshape(-1).tolist()  # source-major
        pieces = comm.exchange(rows, send, recv, group).split(sizes)
        by_expert = [s * local + e for e in range(local) for s in range(n)]
        done = self._run(torch.cat([pieces[i] for i in by_expert]), arriving.sum(0).tolist()).split(
            [sizes[i] for i in by_expert])
        back = [None] * len(by_expert)
        for j, i in enumerate(by_expert):
            back[i] = done[j]
        return comm.exchange(torch.cat(back), recv, send, group)

    def forward(self, tokens, weights, chosen):  # (n, h), (n, k), (n, k) -> (n, h)
        n, k = chosen.shape
        flat = chosen.reshape(-1)
        order = flat.argsort(stable=True)  # the (token, expert) pairs by expert
        owner = order // k  # each pair's token
        rows = tokens[owner]
        counts = torch.bincount(flat, minlength=self.experts)
        if not self.axes:
            out = self._run(rows, counts.tolist())
        else:
            out = self._run_across(rows, counts, self.ctx.group(*self.axes))  # (n·k, h) by expert
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        # back in token order, each token's k outputs weighted and summed (index_add would save them)
        return (out[inverse].view(n, k, -1) * weights[..., None]).sum(1)


class SharedExpert(nn.Module):
    """Qwen2-MoE's expert every token goes through, weighted by sigmoid(x W_gᵀ): `gate`, `up` (I, h),
    `down` (h, I) and `weight` (1, h) of the gate, as transformers keeps them."""

    def __init__(self, mode, d_model: int, width: int):
        super().__init__()
        spec = mode.token_spec()
        for name, shape in (("gate", (width, d_model)), ("up", (width, d_model)), ("down", (d_model, width)),
                            ("weight", (1, d_model))):
            register_sharded(self, name, ShardSpec(shape, **spec), mode.ctx)

    def forward(self, tokens):
        hidden = F.silu(F.linear(tokens, self.gate)) * F.linear(tokens, self.up)
        return torch.sigmoid(F.linear(tokens, self.weight)) * F.linear(hidden, self.down)


class SparseMoE(nn.Module):
    """The MoE MLP of one layer (`layer`: its index among the model's MoE layers)."""

    def __init__(self, mode, cfg, layer: int):
        super().__init__()
        self.mode, self.layer, self.n_experts = mode, layer, cfg.n_experts
        self.router = Router(mode, cfg.d_model, cfg.n_experts, cfg.top_k, cfg.normalize_top_k,
                             getattr(cfg, "expert_bias_rate", 0.0))
        self.experts = Experts(mode, cfg.d_model, cfg.n_experts, cfg.expert_size)
        self.shared = SharedExpert(mode, cfg.d_model, cfg.shared_expert_size) if cfg.shared_expert_size else None

    def forward(self, x, token_mask=None, balance: Balance | None = None):
        tokens, mask, back = self.mode.expert_tokens(x, token_mask)
        if self.router.weight is None:  # an idle rank (subgraph's D&SP-cSub): no tokens, no experts
            if balance is not None:
                empty = tokens.new_zeros(0, self.n_experts)
                balance.add(self.layer, empty, tokens.new_zeros(0, 1).long(), None, empty)
            # a product that saves its (empty) operand, as the experts' do on the other ranks: their
            # recomputation under activation checkpointing then stops where the others' does
            return back(tokens * tokens.detach())
        logits, probs, weights, chosen = self.router(tokens)
        if balance is not None:
            loads = balance.add(self.layer, probs, chosen, mask, logits)
            if loads is not None and self.router.expert_bias is not None and self.training:
                self.router.loads = loads if self.router.loads is None else self.router.loads + loads
        y = self.experts(tokens, weights, chosen)
        if self.shared is not None:
            y = y + self.shared(tokens)
        return back(y)


class MoEDecoder(DecoderLM):
    """A decoder whose blocks take `token_mask` and `balance` (SparseMoE's) and whose loss adds
    router_aux_loss_coef times the balancing loss (and router_z_loss_coef times the z-loss; module
    docstring). Under a pipeline each stage sends the next its running statistics beside the
    residual stream, and the last stage's loss of a micro-batch differentiates into every stage."""

    def __init__(self, cfg, ctx, **kwargs):
        super().__init__(cfg, ctx, **kwargs)
        self._balance, self._reported = None, {}

    @classmethod
    def layout_problem(cls, cfg, layout):
        if layout is None:
            return None
        if cfg.n_experts % layout.ep:
            return (f"ep = {layout.ep} does not divide n_experts = {cfg.n_experts}: each expert-parallel rank holds "
                    f"n_experts / ep whole experts; use an ep that divides {cfg.n_experts}")
        return None

    def _new_balance(self, carried=None, labelled: float = 0.0) -> Balance:
        return Balance(self.ctx, self.cfg.n_experts, z_loss=bool(self.cfg.router_z_loss_coef), carried=carried,
                       labelled=labelled)

    def _labelled(self, targets, attention_mask) -> float:
        """The batch's labelled targets on this replica (whole sequences, every rank alike)."""
        return float(self.labelled_count(self.unpadded_targets(targets, attention_mask), clamp=False))

    def forward(self, tokens, targets=None, **kwargs):
        self._balance = None
        if targets is not None and kwargs.get("cache") is None:
            self._balance = self._new_balance(labelled=self._labelled(targets, kwargs.get("attention_mask")))
        try:
            return super().forward(tokens, targets, **kwargs)
        finally:
            self._balance = None

    def block_inputs(self, attention_mask, positions=None):
        out = super().block_inputs(attention_mask, positions)
        if attention_mask is not None:  # this rank's tokens of the mask (under cp: its chunks)
            (mine,) = take_context_chunks(self.ctx, attention_mask)
            out["token_mask"] = mine[self.mode.residual_rows(mine.shape[0])] != 0
        return out

    def run_blocks(self, x, blocks, **inputs):
        if self._balance is not None and "balance" not in inputs:
            inputs["balance"] = self._balance
        return super().run_blocks(x, blocks, **inputs)

    # ---- pipeline stages: the running statistics travel beside the residual stream
    def boundary_shapes(self, after, batch, seq, target_seq):
        return (*super().boundary_shapes(after, batch, seq, target_seq), (3 * self.cfg.n_experts + 4,))

    def microbatch_inputs(self, tokens, targets, attention_mask, token_types, position_ids=None) -> dict:
        return {**super().microbatch_inputs(tokens, targets, attention_mask, token_types, position_ids),
                "labelled": self._labelled(targets, attention_mask)}

    def boundary_dtypes(self, after):
        return (None, torch.promote_types(self.dtype, torch.float32))

    def boundary_scattered(self, after):
        return (True, False)  # every tensor rank's own statistics

    def run_stage(self, values, block_ids, first, last, inputs):
        balance = self._new_balance(None if first else values[1], inputs["labelled"])
        out = super().run_stage(values[:1], block_ids, first, last,
                                {**inputs, "padding": {**inputs.get("padding", {}), "balance": balance}})
        if last:
            self._balance = balance  # the schedule's loss of this micro-batch follows at once
            return out
        if self.training:  # (the last stage reports the loss; this one its layers' loads)
            self._reported = balance.loads()
        return (*out, balance.carried_out(self.boundary_dtypes(0)[1]))

    def with_auxiliary_loss(self, loss):
        cfg = self.cfg
        if self._balance is None or not cfg.sparse_layers():
            return loss
        extra = self._balance.loss(cfg.router_aux_loss_coef, cfg.router_z_loss_coef)
        if self.training:  # (the loads and the balancing statistic are reported at a coefficient of 0 too)
            self._reported = self._balance.reported
        return loss + extra.to(loss.dtype) if cfg.router_aux_loss_coef or cfg.router_z_loss_coef else loss

    def after_update(self, updated: bool = True) -> None:
        """After an optimizer step (`updated`; False: a skipped one) each router's expert bias moves
        toward balance by the step's loads (Router), which then count afresh."""
        for module in self.modules():
            if isinstance(module, Router) and module.loads is not None:
                if updated:
                    module.update_bias()
                module.loads = None

    def step_metric_names(self) -> tuple[str, ...]:
        """The columns `step_metrics` fills: the balancing loss, then each MoE layer's most and mean
        top-k assignments per expert over the batch (a perfectly balanced router: most = mean)."""
        layers = len(self.cfg.sparse_layers())
        return ("balance_loss", *(("z_loss",) if self.cfg.router_z_loss_coef else ()),
                *(f"moe{k}_load_{s}" for k in range(layers) for s in ("max", "mean")))

    def step_metrics(self) -> dict[str, float]:
        """The last training forward's `step_metric_names` (of its last micro-batch; under a
        pipeline a stage's own: its layers' loads, and on the last stage the losses)."""
        return dict(self._reported)
