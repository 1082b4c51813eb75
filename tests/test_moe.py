"""Mixtral and Qwen2-MoE, the mixture-of-experts families, against transformers' own
MixtralForCausalLM and Qwen2MoeForCausalLM (built locally from their configs with random weights
and the eager experts; nothing downloaded), in every layout and with data parallelism, on plain
and padded batches: the loss (cross-entropy + router_aux_loss_coef x the load-balancing loss, as
transformers adds it with output_router_logits=True) and every gradient.

The references compute in float32 in three places, which alone puts them ~1e-8 from any float64
computation: RMSNorm, the router's softmax and the balancing loss's accumulators. Each is run at
the input's precision when that is float64 (the same formulas; `numerics.rms_norm_at_input_precision`,
`_router_at_input_precision`, `_balancing_loss_at_input_precision`); everything else is
transformers' code as shipped.
"""

import dataclasses
import os
import re

import pytest
import torch
import torch.nn.functional as F
from hf_round_trip import lattice_cli, through_lattice
from multiproc import cached_init, run_distributed
from numerics import rel_diff, rms_norm_at_input_precision

import lattice
import lattice.cost
from lattice import LatticeConfigError, MeshAxis
from lattice.models import hf as lattice_hf
from lattice.models.mixtral import Mixtral, MixtralConfig
from lattice.models.qwen2_moe import Qwen2Moe, Qwen2MoeConfig

transformers = pytest.importorskip("transformers")

V = 61
# Mixtral: grouped-query, 4 experts, top 2 renormalised, both layers MoE; Qwen2-MoE: multi-head with
# q, k, v biases, 4 experts, top 2 not renormalised, a shared expert, layer 1 dense (mlp_only) and
# layers 0, 2 and 3 MoE; sizes no preset has
CONFIGS = {
    "mixtral": (Mixtral, MixtralConfig, dict(vocab_size=V, seq_len=16, d_model=32, n_heads=8, n_kv_heads=4,
                                             n_layers=2, intermediate_size=24, rope_theta=500.0, n_experts=4,
                                             top_k=2, router_aux_loss_coef=0.1)),
    "qwen2_moe": (Qwen2Moe, Qwen2MoeConfig, dict(vocab_size=V, seq_len=16, d_model=32, n_heads=4, n_kv_heads=4,
                                                 n_layers=4, intermediate_size=40, rope_theta=500.0, n_experts=4,
                                                 top_k=2, expert_width=16, shared_width=24, mlp_only=[1],
                                                 router_aux_loss_coef=0.1)),
}


def _router_at_input_precision(self, hidden_states):
    """transformers' top-k router (Mixtral's and Qwen2-MoE's), its softmax at float64 for float64 input."""
    logits = F.linear(hidden_states.reshape(-1, self.hidden_dim), self.weight)
    probs = torch.softmax(logits if logits.dtype == torch.float64 else logits.float(), dim=-1)
    top, chosen = torch.topk(probs, self.top_k, dim=-1)
    if getattr(self, "norm_topk_prob", True):
        top = top / top.sum(dim=-1, keepdim=True)
    return logits, top.to(logits.dtype), chosen


def _router_with_expert_bias(self, hidden_states):
    """DeepSeek-V3's selection as its paper writes it, on transformers' router: the top k of the
    probabilities plus the layer's expert bias (`self.expert_bias`) pick the experts, whose weights
    are the probabilities alone (then renormalised where the family does)."""
    logits = F.linear(hidden_states.reshape(-1, self.hidden_dim), self.weight)
    probs = torch.softmax(logits, dim=-1)
    chosen = torch.topk(probs + self.expert_bias, self.top_k, dim=-1).indices
    top = probs.gather(-1, chosen)
    if getattr(self, "norm_topk_prob", True):
        top = top / top.sum(dim=-1, keepdim=True)
    return logits, top, chosen


def _with_expert_bias(hf, biases: list, rate: float):
    """(transformers' model routing with `biases` (one per MoE layer) and no balancing loss, lattice's
    config and full weights of it with expert_bias_rate `rate` and those biases)."""
    import types

    family = Mixtral if hf.config.model_type == "mixtral" else Qwen2Moe
    cfg, weights = lattice_hf.read_hf(family, hf)
    cfg = dataclasses.replace(cfg, expert_bias_rate=rate, router_aux_loss_coef=0.0)
    hf.config.router_aux_loss_coef = 0.0
    for layer, bias in zip(cfg.sparse_layers(), biases):
        weights[f"blocks.{layer}.mlp.router.expert_bias"] = bias
        router = hf.model.layers[layer].mlp.gate
        router.expert_bias, router.forward = bias, types.MethodType(_router_with_expert_bias, router)
    return hf, cfg, weights


def _biases(which: str, scale: float = 0.3) -> list:
    layers = len(CONFIGS[which][1](**CONFIGS[which][2]).sparse_layers())
    gen = torch.Generator().manual_seed(11)
    return [torch.randn(CONFIGS[which][2]["n_experts"], generator=gen, dtype=torch.float64) * scale
            for _ in range(layers)]


def _biased_equals_transformers(which: str, layout: dict):
    """(relative difference of the loss, worst of a gradient) against transformers routing with the
    expert biases, on one padded batch."""
    ctx = cached_init(**layout)
    hf, cfg, weights = _with_expert_bias(random_hf(which, seed=5), _biases(which), 0.01)
    model = lattice.build_model(cfg, ctx, dtype=torch.float64)
    model.load_full_state_dict(weights)
    tokens, targets, mask = _batch(6, padded=True)
    reference = _reference(hf, tokens, targets, mask, ctx.pipeline.m if ctx.pipeline is not None else 1)
    reference.backward()
    loss = model.forward_backward(tokens, targets, attention_mask=mask)
    full = model.full_grad_dict()
    grads = lattice_hf.to_hf_state_dict(model.family, dataclasses.replace(cfg, expert_bias_rate=0.0),
                                        {k: v for k, v in full.items() if "expert_bias" not in k})
    worst = max(rel_diff(grads[name], p.grad) for name, p in hf.named_parameters())
    return abs(loss - reference.item()) / reference.item(), worst


def _balancing_loss_at_input_precision(gate_logits, num_experts=None, top_k=2, attention_mask=None):
    """transformers' load_balancing_loss_func, its float32 accumulators at the logits' precision."""
    dtype = gate_logits[0].dtype if gate_logits[0].dtype == torch.float64 else torch.float32
    counts, probs_sum, rows = torch.zeros(num_experts, dtype=dtype), torch.zeros(num_experts, dtype=dtype), 0.0
    mask = None if attention_mask is None else attention_mask.reshape(-1).to(dtype)
    for layer in gate_logits:
        probs = torch.softmax(layer, dim=-1)
        _, chosen = torch.topk(probs, top_k, dim=-1)
        if mask is None:
            counts = counts + torch.histc(chosen.reshape(-1).to(dtype), bins=num_experts, min=0, max=num_experts)
            probs_sum, rows = probs_sum + probs.sum(0), rows + probs.shape[0]
        else:
            counts = counts + torch.zeros_like(counts).scatter_add_(0, chosen.reshape(-1), mask.repeat_interleave(top_k))
            probs_sum, rows = probs_sum + (probs * mask[:, None]).sum(0), rows + mask.sum()
    return torch.sum((counts / rows) * (probs_sum / rows).unsqueeze(0)) * num_experts


@torch.no_grad()
def random_hf(which: str, seed: int = 0):
    """A float64 transformers model of CONFIGS[which], eager experts, eval mode, every parameter random."""
    from transformers.models.mixtral import modeling_mixtral
    from transformers.models.qwen2_moe import modeling_qwen2_moe

    for module, prefix in ((modeling_mixtral, "Mixtral"), (modeling_qwen2_moe, "Qwen2Moe")):
        getattr(module, f"{prefix}RMSNorm").forward = rms_norm_at_input_precision
        getattr(module, f"{prefix}TopKRouter").forward = _router_at_input_precision
        module.load_balancing_loss_func = _balancing_loss_at_input_precision
    family, config_class, sizes = CONFIGS[which]
    config = family.hf.config_to_hf(config_class(**sizes))
    config._experts_implementation = "eager"
    torch.manual_seed(seed)
    model = getattr(transformers, family.hf.model_class)(config).double().eval()
    for p in model.parameters():
        p.add_(torch.randn_like(p) * 0.1)
    return model


def _batch(seed, batch=4, length=12, padded=False):
    """(tokens, targets, attention_mask or None): padded batches are left-padded by 3 and 5 in two rows."""
    g = torch.Generator().manual_seed(seed)
    tokens, targets = torch.randint(0, V, (batch, length), generator=g), torch.randint(0, V, (batch, length), generator=g)
    mask = None
    if padded:
        mask = torch.ones(batch, length, dtype=torch.long)
        mask[1, :3], mask[-1, :5] = 0, 0
    return tokens, targets, mask


def _reference(hf, tokens, targets, mask, microbatches: int = 1):
    """transformers' loss with output_router_logits=True (its own sum, its own balancing loss); of
    m micro-batches, each one's weighted by its share of the labelled targets, as lattice defines
    a micro-batched step's loss (each micro-batch's balancing term over its own tokens)."""
    labels = targets if mask is None else targets.masked_fill(mask == 0, -100)
    rows = [slice(i * len(tokens) // microbatches, (i + 1) * len(tokens) // microbatches) for i in range(microbatches)]
    total = 0.0
    for r in rows:
        out = hf(input_ids=tokens[r], attention_mask=None if mask is None else mask[r], output_router_logits=True)
        ce = F.cross_entropy(out.logits.flatten(0, 1), labels[r].flatten())
        share = (labels[r] != -100).sum().double() / (labels != -100).sum().double()
        total = total + share * (ce + hf.config.router_aux_loss_coef * out.aux_loss)
    return total


def _equals_transformers(which: str, layout: dict, padded: bool):
    """(relative difference of the loss, worst of a gradient) against transformers on one batch.
    Padded batches are 11 tokens long where the layout allows (not under sequence parallelism): a
    count of tokens that 3d's hidden group does not divide, which it pads (12 under context
    parallelism, whose 2 cp chunks must divide the sequence)."""
    ctx = cached_init(**layout)
    hf = random_hf(which, seed=5)
    model = lattice.from_hf(hf, ctx)
    length = 11 if padded and not layout.get("sequence_parallel") and layout.get("cp", 1) == 1 else 12
    tokens, targets, mask = _batch(6, length=length, padded=padded)
    reference = _reference(hf, tokens, targets, mask, ctx.pipeline.m if ctx.pipeline is not None else 1)
    reference.backward()
    loss = model.forward_backward(tokens, targets, **({} if mask is None else {"attention_mask": mask}))
    grads = lattice_hf.to_hf_state_dict(model.family, model.cfg, model.full_grad_dict())
    worst = max(rel_diff(grads[name], p.grad) for name, p in hf.named_parameters())
    return abs(loss - reference.item()) / reference.item(), worst


def _whole_batch_over_replicas(which: str, layout: dict, padded: bool):
    """The same, each data-parallel replica on its half of the batch, its loss weighted as the
    Trainer weighs it (dp x its share of the labelled targets: padded halves hold different
    counts) and the gradients averaged over the replicas (as DDP does), against transformers on the
    whole batch."""
    import torch.distributed as dist

    ctx = cached_init(**layout)
    hf = random_hf(which, seed=5)
    model = lattice.from_hf(hf, ctx)
    tokens, targets, mask = _batch(6, padded=padded)
    reference = _reference(hf, tokens, targets, mask)
    reference.backward()
    rows = slice(ctx.coord(MeshAxis.DP) * 2, ctx.coord(MeshAxis.DP) * 2 + 2)

    def labelled(r):
        return int(model.labelled_count(model.unpadded_targets(targets[r], None if mask is None else mask[r])))

    inputs = {} if mask is None else {"attention_mask": mask[rows]}
    loss = model(tokens[rows], targets[rows], **inputs) * (ctx.dp * labelled(rows) / labelled(slice(None)))
    loss.backward()
    loss = loss.detach()
    full = model.full_grad_dict()
    for t in [loss, *full.values()]:
        dist.all_reduce(t, group=ctx.group(MeshAxis.DP))
        t.div_(ctx.dp)
    grads = lattice_hf.to_hf_state_dict(model.family, model.cfg, full)
    worst = max(rel_diff(grads[name], p.grad) for name, p in hf.named_parameters())
    return abs(loss.item() - reference.item()) / reference.item(), worst


LAYOUTS = [dict(mode="serial"), dict(mode="1d", tp=2), dict(mode="1d", tp=2, sequence_parallel=True),
           dict(mode="2d", tp=4), dict(mode="3d", tp=8), dict(mode="subgraph", tp=2, subgrids=2),
           dict(mode="subgraph", tp=4, subgrids=2, common="subgrid"), dict(mode="serial", dp=2),
           dict(mode="1d", tp=2, dp=2), dict(mode="1d", tp=2, ep=2), dict(mode="1d", tp=4, ep=4, sequence_parallel=True),
           dict(mode="2d", tp=4, ep=2), dict(mode="3d", tp=8, ep=2), dict(mode="subgraph", tp=4, subgrids=2, ep=2),
           dict(mode="serial", pp=2, microbatches=2), dict(mode="1d", tp=2, pp=2, microbatches=2),
           dict(mode="2d", tp=4, ep=2, pp=2, microbatches=2, pp_schedule="gpipe"), dict(mode="serial", cp=2),
           dict(mode="1d", tp=2, cp=2, sequence_parallel=True), dict(mode="2d", tp=4, ep=2, cp=2),
           dict(mode="subgraph", tp=2, subgrids=2, common="subgrid", dp=2, ep=2),
           dict(mode="serial", cp=2, pp=2, microbatches=2), dict(mode="serial", cp=2, ep=2),
           dict(mode="1d", tp=2, cp=2, ep=4, sequence_parallel=True), dict(mode="serial", dp=2, cp=2, ep=4),
           dict(mode="1d", tp=2, ep=2, sequence_parallel=True), dict(mode="subgraph", tp=4, subgrids=2, dp=2, ep=4)]


@pytest.mark.parametrize("which, layout, padded", [
    pytest.param(which, layout, padded, id=f"{which}-" + "-".join(f"{k}={v}" for k, v in layout.items())
                 + ("-padded" if padded else ""), marks=[pytest.mark.fast] if layout == dict(mode="serial") else [])
    for which in CONFIGS for layout in LAYOUTS for padded in (False, True)])
def test_moe_layout_equals_transformers(which, layout, padded):
    """Catches tokens routed on a piece of their features, a layout that hands the experts tokens
    another rank also routes (or drops some), a router or expert gradient not summed over the ranks
    that saw other tokens, balancing statistics taken over one rank's tokens, over padding, or per
    layer instead of over all layers, top-k weights renormalised where Qwen2-MoE does not, a shared
    expert or its gate mapped wrong, a dense layer between MoE layers, and pipeline stages that
    drop the statistics of the layers before them (or cut them like the residual under 1d's
    scatter/gather), and context-parallel ranks that route their chunks with another chunk's
    padding mask or count the balancing loss once per rank: the loss and every gradient within
    1e-10 of transformers' on every rank (of
    a pipeline's micro-batches, each one's loss, weighted by its labelled targets)."""
    world = lattice.context(**layout).world_size
    results = run_distributed(world, _equals_transformers, which, layout, padded)
    for loss, grads in results:
        assert loss < 1e-10 and grads < 1e-10, (loss, grads)
    print(f"{which} {layout} padded={padded}: loss {max(r[0] for r in results):.1e}, worst gradient "
          f"{max(r[1] for r in results):.1e}")


@pytest.mark.skipif((os.cpu_count() or 1) < 8, reason="16 ranks on fewer than 8 cores take over a minute of the "
                                                      "suite's 15; run it on a larger host")
def test_3d_with_its_experts_over_the_hidden_group_and_the_replicas_equals_transformers():
    """Catches the cube's experts split over its hidden group and the replicas together (ep = 4, 16
    ranks) sending rows to the wrong block of experts: the loss and every gradient within 1e-10 of
    transformers' on a padded batch, on every rank."""
    for loss, grads in run_distributed(16, _equals_transformers, "mixtral", dict(mode="3d", tp=8, dp=2, ep=4), True):
        assert loss < 1e-10 and grads < 1e-10, (loss, grads)


@pytest.mark.parametrize("which, layout, padded", [(which, layout, padded) for which in CONFIGS for layout in (
    dict(mode="serial", dp=2), dict(mode="2d", tp=4, dp=2), dict(mode="2d", tp=4, ep=2, dp=2),
    dict(mode="serial", dp=2, ep=2), dict(mode="1d", tp=2, sequence_parallel=True, dp=2, ep=4),
    dict(mode="2d", tp=4, dp=2, ep=2 * 2)) for padded in (False, True)])
def test_moe_over_replicas_equals_transformers_on_the_whole_batch(which, layout, padded):
    """Catches balancing statistics taken over one replica's tokens (each replica's aux loss is then
    its own half's), a balancing gradient that the data-parallel average shrinks by dp, or one that
    the Trainer's weight of a replica with more or fewer labelled targets scales: two replicas on
    the two halves of a batch (padded: of different counts), each loss weighted as the Trainer
    does, gradients averaged, equal transformers on the whole."""
    results = run_distributed(lattice.context(**layout).world_size, _whole_batch_over_replicas, which, layout,
                              padded)
    for loss, grads in results:
        assert loss < 1e-10 and grads < 1e-10, (loss, grads)


def _metered_against_cost_model(which: str, layout: dict, length: int, checkpointing: bool, **changes):
    """CommMeter's calls and elements of one training step against lattice.cost.estimate's."""
    ctx = cached_init(**layout)
    _, config_class, sizes = CONFIGS[which]
    cfg = config_class(**{**sizes, **changes})
    model = lattice.build_model(cfg, ctx, dtype=torch.float64, activation_checkpointing=checkpointing)
    tokens, targets, _ = _batch(3, length=length)
    with lattice.CommMeter() as meter:
        model.forward_backward(tokens, targets)
    options = {k: v for k, v in layout.items() if k != "mode"}
    analytic = lattice.cost.estimate(cfg, layout["mode"], batch=4, seq=length, dtype=torch.float64,
                                     activation_checkpointing=checkpointing, rank=ctx.rank, **options)
    # the gradients' data-parallel average is the Trainer's (DDP), which forward_backward leaves out
    analytic.terms = [t for t in analytic.terms if not (t.site == "grads" and MeshAxis.DP in t.axes)]
    measured = {k: (v["calls"], v["elements"]) for k, v in meter.summary().items()}
    modelled = {k: (v["calls"], v["elements"]) for k, v in analytic.summary().items() if v["calls"]}
    return measured, modelled


@pytest.mark.parametrize("layout, length", [
    (dict(mode="1d", tp=2), 12), (dict(mode="1d", tp=2, sequence_parallel=True), 12), (dict(mode="2d", tp=4), 11),
    (dict(mode="3d", tp=8), 11), (dict(mode="subgraph", tp=4, subgrids=2, common="subgrid"), 12),
    (dict(mode="2d", tp=4, dp=2), 12), (dict(mode="1d", tp=2, cp=2), 12),
    (dict(mode="serial", cp=2, pp=2, microbatches=2), 12)])
def test_moe_communication_equals_the_cost_model(layout, length):
    """Catches an MoE collective the cost model does not price (or prices wrong): the exchange of
    columns for whole tokens and back, 1d's split and gather, the padding of a token count the
    hidden group does not divide (11 tokens a row), the balancing statistics' all-reduces over the
    replica and over the replicas and cp ranks (with a z-loss, one number more), and what recomputation under activation checkpointing repeats --
    CommMeter's calls and elements of a step equal lattice.cost.estimate's on every rank."""
    from numerics import assert_comm_equal

    for which, changes in [(which, {}) for which in CONFIGS] + [("mixtral", {"router_z_loss_coef": 0.1})]:
        for checkpointing in (False, True):
            results = run_distributed(lattice.context(**layout).world_size, _metered_against_cost_model, which,
                                      layout, length, checkpointing, **changes)
            for rank, (measured, modelled) in enumerate(results):
                assert_comm_equal(measured, modelled, (which, layout, checkpointing, rank))


@pytest.mark.parametrize("layout", [dict(mode="1d", tp=2, ep=2), dict(mode="2d", tp=4, ep=2),
                                    dict(mode="serial", dp=2, ep=2), dict(mode="1d", tp=2, dp=2, ep=4)])
def test_expert_parallel_communication_equals_the_cost_model_over_the_group(layout):
    """Catches an expert-parallel exchange the cost model does not price: the counts and the rows to
    their experts' ranks and back, in forward, backward and recomputation. A rank receives as many
    rows as its tokens chose its experts (the model prices balanced routing), so the elements are
    compared summed over the ranks, where what one rank receives another sent."""
    from numerics import assert_comm_equal

    for checkpointing in (False, True):
        results = run_distributed(lattice.context(**layout).world_size, _metered_against_cost_model, "mixtral",
                                  layout, 12, checkpointing)
        totals = []
        for side in (0, 1):
            summed = {}
            for result in results:
                for key, (calls, elements) in result[side].items():
                    before = summed.get(key, (0, 0))
                    summed[key] = (calls, before[1] + elements)
            totals.append(summed)
        assert_comm_equal(*totals, (layout, checkpointing))


@pytest.mark.parametrize("which, layout", [
    pytest.param(which, layout, id=f"{which}-" + "-".join(f"{k}={v}" for k, v in layout.items()),
                 marks=[pytest.mark.fast] if layout == dict(mode="serial") else [])
    for which in CONFIGS for layout in (
        dict(mode="serial"), dict(mode="1d", tp=2, sequence_parallel=True, ep=2), dict(mode="2d", tp=4, ep=2),
        dict(mode="serial", dp=2, ep=2), dict(mode="1d", tp=2, pp=2, microbatches=2),
        dict(mode="subgraph", tp=2, subgrids=2))])
def test_an_expert_bias_routes_as_deepseek_v3_writes_it(which, layout):
    """Catches an expert bias that does not change which experts a token takes, or that leaks into
    their weights or the gradients (DeepSeek-V3: top-k of probabilities plus bias selects, the
    probabilities weigh), or that a layout applies to another layer's router: the loss and every
    gradient within 1e-10 of transformers' with its routers choosing by the same biases (plain
    PyTorch here), on a padded batch."""
    results = run_distributed(lattice.context(**layout).world_size, _biased_equals_transformers, which, layout)
    for loss, grads in results:
        assert loss < 1e-10 and grads < 1e-10, (loss, grads)


@pytest.mark.fast
def test_the_expert_biases_route_other_experts():
    """Catches a reference in which the biases pick the same experts as none (the test above would
    then prove nothing): some token's experts differ."""
    hf = random_hf("mixtral", seed=5)
    tokens, _, _ = _batch(6)
    with torch.no_grad():
        plain = [torch.topk(torch.softmax(x, -1), 2).indices for x in hf(input_ids=tokens,
                                                                          output_router_logits=True).router_logits]
        hf, _, _ = _with_expert_bias(hf, _biases("mixtral"), 0.01)
        logits = hf(input_ids=tokens, output_router_logits=True).router_logits
    biased = [torch.topk(torch.softmax(x, -1) + b, 2).indices for x, b in zip(logits, _biases("mixtral"))]
    assert any(not torch.equal(a.sort(-1).values, b.sort(-1).values) for a, b in zip(plain, biased))


def _biases_after_steps(layout: dict, steps: int, rate: float) -> list:
    """lattice's expert biases after `steps` training passes (each replica on its rows of the batch,
    then `after_update`), from zero."""
    ctx = cached_init(**layout)
    hf, cfg, weights = _with_expert_bias(random_hf("mixtral", seed=5), [torch.zeros(4, dtype=torch.float64)] * 2, rate)
    model = lattice.build_model(cfg, ctx, dtype=torch.float64)
    model.load_full_state_dict(weights)
    tokens, targets, mask = _batch(6, padded=True)
    rows = slice(ctx.coord(MeshAxis.DP) * 4 // ctx.dp, (ctx.coord(MeshAxis.DP) + 1) * 4 // ctx.dp)
    model.train()
    for _ in range(steps):
        model.forward_backward(tokens[rows], targets[rows], attention_mask=mask[rows])
        model.after_update(True)
        model.zero_grad(set_to_none=True)
    full = model.full_state_dict()
    return [full[f"blocks.{i}.mlp.router.expert_bias"] for i in range(2)]


@pytest.mark.parametrize("layout", [dict(mode="serial"), dict(mode="serial", dp=2, ep=2),
                                    dict(mode="2d", tp=4, ep=2, dp=2), dict(mode="1d", tp=2, pp=2, microbatches=2)],
                         ids=lambda d: "-".join(f"{k}={v}" for k, v in d.items()))
def test_the_expert_bias_moves_toward_balance_by_the_whole_batch(layout):
    """Catches a bias update by one rank's or one replica's loads (the ranks would then disagree),
    counting padding or counting a layer twice, a step of another size or sign, and loads not
    cleared between steps: after each of 3 passes every bias moved by rate · sign(mean - load),
    the loads counted from transformers' router logits on the whole batch (padding excluded) with
    the biases so far, equal on every rank."""
    rate, steps = 0.05, 3
    hf, _, _ = _with_expert_bias(random_hf("mixtral", seed=5), [torch.zeros(4, dtype=torch.float64)] * 2, rate)
    tokens, _, mask = _batch(6, padded=True)
    biases = [torch.zeros(4, dtype=torch.float64) for _ in range(2)]
    for _ in range(steps):
        for layer, bias in enumerate(biases):
            hf.model.layers[layer].mlp.gate.expert_bias = bias
        with torch.no_grad():
            logits = hf(input_ids=tokens, attention_mask=mask, output_router_logits=True).router_logits
        for layer, (x, bias) in enumerate(zip(logits, biases)):
            chosen = torch.topk(torch.softmax(x, -1) + bias, 2).indices[mask.reshape(-1) != 0]
            loads = torch.bincount(chosen.reshape(-1), minlength=4).double()
            biases[layer] = bias + rate * torch.sign(loads.mean() - loads)
    assert any(b.abs().sum() > 0 for b in biases)
    for rank, got in enumerate(run_distributed(lattice.context(**layout).world_size, _biases_after_steps, layout, steps,
                                               rate)):
        for a, b in zip(got, biases):
            assert torch.allclose(a, b, rtol=0, atol=1e-12), (rank, a, b)


@pytest.mark.parametrize("layout, zero", [(dict(mode="serial", dp=2, ep=2), 1), (dict(mode="1d", tp=2, ep=2), 0),
                                          (dict(mode="serial", pp=2, microbatches=2), 0)],
                         ids=["dp2-ep2-zero1", "1d-ep2", "pp2"])
def test_training_with_an_expert_bias_follows_serial_and_resumes(layout, zero, tmp_path):
    """Catches an expert bias that the optimizer steps (weight decay, a zero gradient's moments),
    that a checkpoint drops or a resume resets, that ZeRO's master rows overwrite, or that moves
    differently in another layout: 4 Trainer steps with expert_bias_rate, 2 then 2 resumed, follow
    serial's uninterrupted losses and gradient norms (float64)."""
    sizes = dict(expert_bias_rate=0.05, router_aux_loss_coef=0.0)
    serial = run_distributed(1, _trained, dict(mode="serial"), 0, 4, **sizes)[0]
    plain = run_distributed(1, _trained, dict(mode="serial"), 0, 4, router_aux_loss_coef=0.0)[0]
    assert any(abs(a[0] - b[0]) > 1e-6 for a, b in zip(serial, plain))  # the bias changed the routing
    world = lattice.context(**layout).world_size
    first = run_distributed(world, _trained, layout, zero, 4, str(tmp_path), 2, **sizes)[-1]
    second = run_distributed(world, _trained, layout, zero, 4, str(tmp_path), None, str(tmp_path), **sizes)[-1]
    for a, b in zip(first + second, serial):  # (a pipeline's balancing statistic is its micro-batches')
        assert max(abs(x - y) / abs(y) for x, y in zip(a[:2], b[:2])) < 1e-10, (a, b)


@pytest.mark.fast
def test_the_balancing_loss_is_transformers_own_and_moves_the_router():
    """Catches a balancing loss that is never added (the layout tests would still pass with a
    coefficient the reference ignored too), or added without reaching the router: the loss exceeds
    the cross-entropy alone by router_aux_loss_coef x transformers' aux_loss, and with the
    coefficient at 0 the router's gradient changes."""
    hf = random_hf("mixtral", seed=5)
    tokens, targets, _ = _batch(6)
    with torch.no_grad():
        out = hf(input_ids=tokens, output_router_logits=True)
    model = lattice.from_hf(hf, lattice.context("serial"))
    with torch.no_grad():
        ce = F.cross_entropy(out.logits.flatten(0, 1), targets.flatten()).item()
        assert abs(model(tokens, targets).item() - ce - 0.1 * out.aux_loss.item()) < 1e-12
        assert out.aux_loss.item() > 1.0  # E · Σ f·P is 1 at perfect balance and above it otherwise
    model.forward_backward(tokens, targets)
    with_aux = model.blocks[0].mlp.router.weight.grad.clone()
    model.zero_grad()
    model.cfg.router_aux_loss_coef = 0.0
    model.forward_backward(tokens, targets)
    assert rel_diff(model.blocks[0].mlp.router.weight.grad, with_aux) > 1e-6


def _z_loss_against_transformers(layout: dict, padded: bool):
    """The loss and gradients with a router z-loss (which transformers has not) against transformers'
    loss plus z_coef x, per MoE layer, the mean over its tokens of logsumexp(router logits)², summed
    over the layers, computed here from transformers' own router logits."""
    ctx = cached_init(**layout)
    hf = random_hf("mixtral", seed=5)
    cfg, weights = lattice_hf.read_hf(Mixtral, hf)
    model = lattice.build_model(dataclasses.replace(cfg, router_z_loss_coef=0.3), ctx, dtype=torch.float64)
    model.load_full_state_dict(weights)
    tokens, targets, mask = _batch(6, padded=padded)
    out = hf(input_ids=tokens, attention_mask=mask, output_router_logits=True)
    labels = targets if mask is None else targets.masked_fill(mask == 0, -100)
    valid = torch.ones(tokens.numel(), dtype=torch.float64) if mask is None else mask.reshape(-1).double()
    z = sum((layer.logsumexp(-1).square() * valid).sum() / valid.sum() for layer in out.router_logits)
    reference = (F.cross_entropy(out.logits.flatten(0, 1), labels.flatten()) + hf.config.router_aux_loss_coef * out.aux_loss
                 + 0.3 * z)
    reference.backward()
    loss = model.forward_backward(tokens, targets, **({} if mask is None else {"attention_mask": mask}))
    grads = lattice_hf.to_hf_state_dict(model.family, model.cfg, model.full_grad_dict())
    worst = max(rel_diff(grads[name], p.grad) for name, p in hf.named_parameters())
    return abs(loss - reference.item()) / reference.item(), worst, model.step_metrics().get("z_loss") is not None


@pytest.mark.parametrize("layout, padded", [(dict(mode="serial"), True), (dict(mode="2d", tp=4, ep=2), False),
                                            (dict(mode="1d", tp=2, dp=2), True)])
def test_the_router_z_loss_equals_an_independent_computation(layout, padded):
    """Catches a z-loss over padding, over one rank's tokens, averaged over the layers rather than
    summed, or whose gradient misses the router: the loss and every gradient within 1e-10 of
    transformers' plus the z-loss computed from its router logits."""
    for loss, grads, _ in run_distributed(lattice.context(**layout).world_size, _z_loss_against_transformers,
                                          layout, padded):
        assert loss < 1e-10 and grads < 1e-10, (loss, grads)


@pytest.mark.fast
def test_bad_moe_configs_are_refused_in_one_line():
    """Catches a top-k above the experts, a transformers option lattice does not implement, an ep
    that does not divide the experts or fit the layout's expert axis, ep asked of a dense model, a
    negative expert-bias rate, or an export to transformers of a model routed with an expert bias
    reaching a shape error, a hang or a wrong model."""
    with pytest.raises(LatticeConfigError, match="top_k = 5 exceeds n_experts = 4"):
        MixtralConfig(**{**CONFIGS["mixtral"][2], "top_k": 5})
    config = Mixtral.hf.config_to_hf(MixtralConfig(**CONFIGS["mixtral"][2]))
    config.router_jitter_noise = 0.1
    with pytest.raises(LatticeConfigError, match="router_jitter_noise=0.1 is not implemented"):
        Mixtral.hf.config_from_hf(config)
    with pytest.raises(LatticeConfigError, match="ep = 3 does not divide n_experts = 4"):
        lattice.build_model(MixtralConfig(**{**CONFIGS["mixtral"][2], "n_experts": 4}),
                            lattice.context("subgraph", tp=6, subgrids=2, ep=3))
    with pytest.raises(LatticeConfigError, match="ep = 4 does not fit mode '2d' with tp = 4"):
        lattice.context("2d", tp=4, ep=4)
    with pytest.raises(LatticeConfigError, match="expert_bias_rate must be >= 0"):
        MixtralConfig(**{**CONFIGS["mixtral"][2], "expert_bias_rate": -0.1})
    for family, config_class, sizes in CONFIGS.values():  # transformers' routers have no expert bias
        with pytest.raises(LatticeConfigError, match="expert_bias_rate = 0.01: this model picks its experts with"):
            family.hf.config_to_hf(config_class(**{**sizes, "expert_bias_rate": 0.01}))
    with pytest.raises(LatticeConfigError, match="ep = 2 splits a mixture of experts, which gpt2 is not"):
        lattice.build_model(lattice.get_arch("gpt2").config_class.preset("tiny"), lattice.context("1d", tp=2, ep=2))


@pytest.mark.fast
def test_the_planner_offers_every_ep_the_layout_takes():
    """Catches a planner that searches ep inside a replica alone, or offers an ep that does not
    divide the experts or that the layout refuses: 1, the mode's expert axis (1d: tp; 2d: q), the
    replicas and their product, each where it divides the experts."""
    from lattice.planner.search import expert_sizes

    def sizes(experts, mode, tp, dp, **options):
        cfg = MixtralConfig(**{**CONFIGS["mixtral"][2], "n_experts": experts, "top_k": 2})
        return expert_sizes(cfg, mode, tp, dp, get_mode(mode).resolve_options(options))

    from lattice.modes import get_mode

    assert sizes(8, "1d", 2, 4) == [1, 2, 4, 8]
    assert sizes(6, "1d", 2, 4) == [1, 2]  # 4 and 8 do not divide 6 experts
    assert sizes(8, "2d", 4, 2) == [1, 2, 4]  # q = 2, the replicas 2, both 4
    assert sizes(8, "serial", 1, 4) == [1, 4]
    assert sizes(8, "subgraph", 4, 2, subgrids=2, common="subgrid") == [1, 2]  # the members take none
    assert expert_sizes(lattice.get_arch("llama").config_class.preset("tiny"), "1d", 2, 4, {}) == [1]


def test_plan_auto_for_mixtral_8x7b_searches_ep(capfd):
    """Catches `plan --auto` for an MoE model that leaves ep out of its setups or prints a command
    without the first one's: Mixtral-8x7B on 64 H100s ranks setups with ep (over cp or the replicas too)
    and the first one's command carries its --ep, if it has one."""
    out = lattice_cli(["plan", "--auto", "--arch", "mixtral", "--model", "mixtral-8x7b", "--gpus", "64",
                       "--ranks-per-node", "8", "--machine", "h100-node"], capfd)
    ranked = [line for line in out.splitlines() if re.match(r"\s+\d+\s+[\d,]+\.\d", line)]
    eps = [re.search(r" ep=(\d+)", line) for line in ranked]
    # (serial has no expert axis: its ep folds over the cp ranks or the replicas; its best, ranked or on its line)
    serial = [line for line in out.splitlines() if line.strip().startswith("serial: best ")] + ranked
    assert any(eps) and any(" serial " in line and int(e.group(1)) > 1 for e, line in
                            zip([re.search(r" ep=(\d+)", line) for line in serial], serial) if e), out
    command = next(line for line in out.splitlines() if line.startswith("the first as a run"))
    assert (f"--ep {eps[0].group(1)}" in command) if eps[0] else "--ep" not in command, (ranked[0], command)


# the Trainer on the built-in corpus, float64: the tiny preset at a small vocabulary
RUN = dict(arch="mixtral", model="tiny", vocab_size=512, batch_size=4, lr=3e-3, warmup=2, eval_interval=100,
           eval_batches=1, progress=False, dtype="float64")


def _trained(layout: dict, zero: int, steps: int, out: str | None = None, stop_at: int | None = None,
             resume: str | None = None, **sizes) -> list[float]:
    from lattice.training.trainer import TrainConfig, Trainer

    ctx = cached_init(**layout)
    trainer = Trainer(TrainConfig(**RUN, steps=steps, zero=zero, out_dir=out, checkpoint_interval=2, stop_at=stop_at,
                                  model_sizes=sizes), ctx, resume=resume)
    trainer.fit()
    return [tuple(r[k] for k in ("train_loss", "grad_norm", "balance_loss")) for r in trainer.history]


def test_training_with_experts_split_and_zero_follows_serial():
    """Catches expert gradients averaged over the ranks that hold other experts (or summed over
    replicas that hold the same ones twice), a gradient norm that counts an expert shard once per
    rank or misses the other ranks' experts, ZeRO-1 leaving an expert's optimizer state on one dp
    rank or stepping it twice, and the balancing loss of one replica's tokens: 1d tp = 2 with the
    experts split (ep = 2) over 2 replicas with ZeRO-1 follows serial's losses, gradient norms and
    balancing losses for 3 steps of the Trainer (float64, the built-in corpus)."""
    serial = run_distributed(1, _trained, dict(mode="serial"), 0, 3)[0]
    for rank, rows in enumerate(run_distributed(4, _trained, dict(mode="1d", tp=2, ep=2, dp=2), 1, 3)):
        for a, b in zip(rows, serial):
            assert max(abs(x - y) / abs(y) for x, y in zip(a, b)) < 1e-10, (rank, a, b)


@pytest.mark.parametrize("layout", [
    dict(mode="serial", dp=2, ep=2), dict(mode="1d", tp=2, dp=2, ep=4, sequence_parallel=True),
    dict(mode="serial", dp=2, ep=2, cp=2), dict(mode="serial", dp=2, cp=2, ep=4),
    dict(mode="serial", dp=2, ep=2, pp=2, microbatches=2),
    dict(mode="serial", dp=2, ep=2, microbatches=2)], ids=lambda d: "-".join(f"{k}={v}" for k, v in d.items()))
@pytest.mark.parametrize("zero", [0, 1, 2])
def test_training_with_experts_split_over_the_replicas_follows_serial(layout, zero):
    """Catches expert gradients of experts split over the data-parallel replicas averaged by DDP
    with another replica's experts, left as the sum of every replica's tokens (not their mean), not
    summed over context-parallel ranks or over a pipeline's micro-batches and accumulation, and a
    gradient norm that leaves out the other replicas' experts: 3 steps of the Trainer follow
    serial's losses, gradient norms and balancing losses (float64, the built-in corpus; a pipeline's
    first stage reports its last stage's); with micro-batches, whose balancing losses are each their
    own, those of the same layout with every expert on every rank."""
    world = lattice.context(**layout).world_size
    if layout.get("microbatches"):
        reference = run_distributed(world, _trained, {**layout, "ep": 1}, 0, 3)[-1]
    else:
        reference = run_distributed(1, _trained, dict(mode="serial"), 0, 3)[0]
    for rank, rows in enumerate(run_distributed(world, _trained, layout, zero, 3)):
        for a, b in zip(rows, reference):
            assert max(abs(x - y) / abs(y) for x, y in zip(a, b)) < 1e-10, (rank, a, b)


def _trainer_step_metered(layout: dict, zero: int):
    """CommMeter's calls and elements of one Trainer step, less the gradient norm's and the loss
    mean's scalars (which the cost model leaves to the planner), and lattice.cost.estimate's."""
    from lattice.training import trainer as trainer_module
    from lattice.training.trainer import TrainConfig, Trainer

    ctx = cached_init(**layout)
    trainer = Trainer(TrainConfig(**RUN, steps=1, zero=zero), ctx)
    aside = []

    def metered_aside(fn):
        def wrapped(*args, **kwargs):
            with lattice.CommMeter() as meter:
                out = fn(*args, **kwargs)
            aside.append(meter.summary())
            return out
        return wrapped

    saved = trainer_module.grad_norm, trainer_module.dp_mean
    trainer_module.grad_norm, trainer_module.dp_mean = map(metered_aside, saved)
    if zero:
        trainer.optimizer.grad_norm = metered_aside(trainer.optimizer.grad_norm)
    try:
        with lattice.CommMeter() as meter:
            trainer.train_step()
    finally:
        trainer_module.grad_norm, trainer_module.dp_mean = saved
    measured = {k: [v["calls"], v["elements"]] for k, v in meter.summary().items()}
    for summary in aside:
        for k, v in summary.items():
            measured[k][0] -= v["calls"]
            measured[k][1] -= v["elements"]
    analytic = lattice.cost.estimate(trainer.model_config, layout["mode"], batch=RUN["batch_size"] // ctx.dp,
                                     seq=trainer.seq_len, dtype=torch.float64, rank=ctx.rank, zero=zero,
                                     **{k: v for k, v in layout.items() if k != "mode"})
    modelled = {k: (v["calls"], v["elements"]) for k, v in analytic.summary().items() if v["calls"]}
    return {k: tuple(v) for k, v in measured.items() if v[0]}, modelled


@pytest.mark.parametrize("layout", [dict(mode="serial", dp=2, ep=2), dict(mode="serial", dp=2, ep=2, cp=2),
                                    dict(mode="serial", dp=2, cp=2, ep=4), dict(mode="1d", tp=2, dp=2, ep=4)],
                         ids=lambda d: "-".join(map(str, d.values())))
@pytest.mark.parametrize("zero", [0, 1])
def test_a_step_with_experts_split_over_the_replicas_communicates_as_the_cost_model(layout, zero):
    """Catches the experts split over the replicas averaged over them by DDP (or ZeRO over dp x cp)
    as though each held a copy, or their sum over context-parallel ranks unpriced: a Trainer step's
    collectives but the exchange (whose rows follow the routing) equal lattice.cost.estimate's on
    every rank, their calls and elements."""
    from numerics import assert_comm_equal

    for rank, (measured, modelled) in enumerate(run_distributed(lattice.context(**layout).world_size,
                                                                _trainer_step_metered, layout, zero)):
        exchange = {k for k in measured if k[1] == "all_to_all"}
        assert exchange == {k for k in modelled if k[1] == "all_to_all"}, (rank, measured, modelled)
        assert_comm_equal({k: v for k, v in measured.items() if k not in exchange},
                          {k: v for k, v in modelled.items() if k not in exchange}, (layout, zero, rank))


def _metrics_row(layout: dict) -> dict:
    from lattice.training.trainer import TrainConfig, Trainer

    trainer = Trainer(TrainConfig(**RUN, steps=1), cached_init(**layout))
    return {k: v for k, v in trainer.train_step().items() if k == "balance_loss" or k.startswith("moe")}


def test_every_stage_of_a_pipeline_reports_every_moe_layer():
    """Catches a pipeline whose rank 0 (which writes metrics.csv) logs no balancing loss or loads,
    or only its own stage's layers: every rank of a 2-stage pipeline reports the balancing loss
    and both MoE layers' loads, each the value of the rank that computed it (serial's, as gradient
    accumulation over the same 2 micro-batches reports them)."""
    reference = run_distributed(1, _metrics_row, dict(mode="serial", microbatches=2))[0]
    assert set(reference) == {"balance_loss", "moe0_load_max", "moe0_load_mean", "moe1_load_max", "moe1_load_mean"}
    for rank, row in enumerate(run_distributed(2, _metrics_row, dict(mode="serial", pp=2, microbatches=2))):
        assert row.keys() == reference.keys() and all(abs(row[k] - reference[k]) < 1e-9 for k in row), (rank, row)


def _bf16_expert_updates(layout: dict, zero: int) -> dict:
    """How far 3 steps of the Trainer with bf16 weights and fp32 master rows move each expert tensor."""
    from lattice.training.trainer import TrainConfig, Trainer

    trainer = Trainer(TrainConfig(**{**RUN, "dtype": "float32"}, steps=3, zero=zero, precision="bf16"),
                      cached_init(**layout))
    before = {k: v.double() for k, v in trainer.model.full_state_dict().items() if ".experts." in k}
    trainer.fit()
    after = trainer.model.full_state_dict()
    return {k: after[k].double() - v for k, v in before.items()}


@pytest.mark.parametrize("layout, zero", [(dict(mode="serial", dp=2, ep=2), 0), (dict(mode="serial", dp=2, ep=2), 1),
                                          (dict(mode="1d", tp=2, dp=2, ep=4), 2)],
                         ids=["dp2-ep2", "dp2-ep2-zero1", "1d-dp2-ep4-zero2"])
def test_bf16_master_rows_train_experts_split_over_the_replicas(layout, zero):
    """Catches experts split over the replicas whose fp32 master rows are never stepped, stepped
    twice, or rounded back into another expert's rows: with --precision bf16 each expert tensor
    moves in 3 steps as it does in the same layout with every expert on every rank (bf16 sums in
    another order: within 5% in norm)."""
    world = lattice.context(**layout).world_size
    reference = run_distributed(world, _bf16_expert_updates, {**layout, "ep": 1}, zero)[0]
    for rank, moved in enumerate(run_distributed(world, _bf16_expert_updates, layout, zero)):
        for k, v in moved.items():
            assert float((v - reference[k]).norm() / reference[k].norm()) < 0.05, (rank, k)


@pytest.mark.parametrize("before, zero, after", [
    (dict(mode="1d", tp=2, ep=2), 0, dict(mode="2d", tp=4, ep=2)),
    (dict(mode="1d", tp=2, ep=2), 0, dict(mode="2d", tp=4, dp=2, ep=4)),
    (dict(mode="serial", dp=2, cp=2, ep=2), 1, dict(mode="1d", tp=2, ep=2))],
    ids=["1d-ep2-to-2d-ep2", "1d-ep2-to-2d-dp2-ep4", "serial-dp2-cp2-ep2-zero1-to-1d-ep2"])
def test_a_checkpoint_at_one_ep_resumes_at_another(before, zero, after, tmp_path):
    """Catches an expert shard (or, under ZeRO, its moments' rows) saved or loaded in the wrong block
    of experts when the split changes: 2 steps in one layout, then steps 3 and 4 resumed in another
    (the experts split over 2d's rows, over them and the replicas, or from the replicas to 1d's
    ranks) equal 4 uninterrupted steps (float64)."""
    world = lattice.context(**before).world_size
    straight = run_distributed(world, _trained, before, zero, 4)[-1]
    first = run_distributed(world, _trained, before, zero, 4, str(tmp_path), 2)[-1]
    second = run_distributed(lattice.context(**after).world_size, _trained, after, 0, 4, str(tmp_path), None,
                             str(tmp_path))[-1]
    for a, b in zip(first + second, straight):
        assert max(abs(x - y) / abs(y) for x, y in zip(a, b)) < 1e-10, (a, b)


def test_an_hf_mixtral_of_sizes_no_preset_has_trains_with_experts_split_and_exports(tmp_path, capfd, monkeypatch):
    """Catches an import or export that maps the router or the fused experts wrong (transposed,
    gate and up swapped), a resume that asks for sizes the import holds, and an export transformers
    loads into another function: an HF Mixtral of d 48, 6 heads (3 kv), 6 experts of width 40 (top
    2) and its own 1000-token BPE -> convert --from hf -> train --resume in 2d tp = 4 with ep = 2 and
    no size flag -> convert --to hf, whose greedy tokens transformers generates as `lattice generate`
    does."""
    monkeypatch.chdir(tmp_path)
    hf_config = transformers.MixtralConfig(vocab_size=1000, hidden_size=48, num_attention_heads=6, num_key_value_heads=2,
                                           intermediate_size=40, num_hidden_layers=2, num_local_experts=6,
                                           num_experts_per_tok=2, max_position_embeddings=96, rms_norm_eps=1e-6)
    torch.manual_seed(0)
    loaded, printed, expected = through_lattice(transformers.MixtralForCausalLM(hf_config), tmp_path, capfd,
                                                ["--steps", "3", "--mode", "2d", "--tp", "4", "--ep", "2", "--nproc", "4"])
    assert loaded.config.num_local_experts == 6 and loaded.config.intermediate_size == 40
    assert printed.startswith(expected + "\n"), (printed, expected)


def test_a_new_user_trains_a_mixtral_with_its_experts_over_two_processes(tmp_path, capfd, monkeypatch):
    """Catches the first command a new user tries refused or trained without splitting the experts
    (--nproc 2 and --ep 2 with no --dp: the experts over the two replicas), metrics without each
    MoE layer's load, and eval, generate or info failing on the run: `lattice train --arch mixtral
    --model tiny --ep 2 --nproc 2` trains at dp = 2, metrics.csv holds the balancing loss and each
    layer's most and mean assignments per expert (mean = tokens x top_k / n_experts, most at least
    that), and generate prints the same text in one process and at --ep 2 --nproc 2."""
    import csv

    monkeypatch.chdir(tmp_path)
    out = lattice_cli(["train", "--arch", "mixtral", "--model", "tiny", "--ep", "2", "--nproc", "2", "--steps", "3",
                       "--batch-size", "4", "--vocab-size", "512", "--eval-batches", "1", "--no-progress",
                       "--out-dir", "run"], capfd)
    assert "dp=2" in out and "ep=2" in out, out
    rows = list(csv.DictReader(open(tmp_path / "run" / "metrics.csv")))
    cfg = MixtralConfig.preset("tiny")
    assert len(rows) == 3 and all(float(r["balance_loss"]) >= 1.0 for r in rows)  # 1 at perfect balance
    for layer in range(cfg.n_layers):
        for r in rows:
            mean, most = float(r[f"moe{layer}_load_mean"]), float(r[f"moe{layer}_load_max"])
            assert mean == 4 * cfg.seq_len * cfg.top_k / cfg.n_experts and most >= mean, r
    assert "val loss" in lattice_cli(["eval", "run"], capfd)
    alone = lattice_cli(["generate", "run", "--prompt", "def f(x):", "--max-new-tokens", "8"], capfd)
    split = lattice_cli(["generate", "run", "--prompt", "def f(x):", "--max-new-tokens", "8", "--ep", "2", "--nproc",
                         "2"], capfd)
    assert alone == split and alone.startswith("def f(x):"), (alone, split)
    assert "dim 0 over dp" in lattice_cli(["info", "--arch", "mixtral", "--model", "tiny", "--dp", "2", "--ep", "2"],
                                          capfd)


@pytest.mark.parametrize("which", list(CONFIGS))
def test_a_saved_checkpoint_in_the_per_expert_layout_imports(which, tmp_path, capfd):
    """Catches an import that reads only transformers 5's fused experts: save_pretrained writes
    transformers 4's per-expert layout (Mixtral's block_sparse_moe.experts.N.w1/w2/w3, Qwen2-MoE's
    mlp.experts.N.gate_proj/up_proj/down_proj), which `convert --from hf` must stack into the fused
    tensors in their order (gate before up, expert by expert); the imported model's logits equal
    transformers' own on the directory it loads back."""
    from safetensors import safe_open

    hf = random_hf(which, seed=3).float()
    hf.save_pretrained(tmp_path / "hf")
    with safe_open(tmp_path / "hf" / "model.safetensors", "pt") as f:
        assert any(".experts.0." in k for k in f.keys())  # the per-expert layout on disk
    lattice_cli(["convert", "--from", "hf", str(tmp_path / "hf"), str(tmp_path / "run")], capfd)
    lattice_cli(["convert", str(tmp_path / "run"), "--to", "single", str(tmp_path / "one.pt")], capfd)
    saved = torch.load(tmp_path / "one.pt", weights_only=False)
    family, config_class, _ = CONFIGS[which]
    model = lattice.build_model(config_class.from_dict(saved["model_config"]), lattice.context("serial"))
    model.load_full_state_dict(saved["model"])
    loaded = getattr(transformers, family.hf.model_class).from_pretrained(tmp_path / "hf", local_files_only=True)
    tokens, _, _ = _batch(4)
    with torch.no_grad():
        assert rel_diff(model.eval()(tokens), loaded.eval()(input_ids=tokens).logits) < 1e-5


@pytest.mark.fast
def test_a_checkpoint_saved_before_a_config_field_existed_resumes():
    """Catches a resume that refuses a run saved before its family gained a field ("saved None vs
    0.0"), or that stops refusing a field that differs: the saved config without
    router_z_loss_coef matches this run's default, and a different value is still refused."""
    from lattice.checkpoint import check_model_config

    cfg = MixtralConfig(**CONFIGS["mixtral"][2]).to_dict()
    older = {k: v for k, v in cfg.items() if k != "router_z_loss_coef"}
    check_model_config({"arch": "mixtral", "model_config": older}, "mixtral", cfg)
    with pytest.raises(LatticeConfigError, match="router_z_loss_coef 0.0 vs 0.1"):
        check_model_config({"arch": "mixtral", "model_config": older}, "mixtral", {**cfg, "router_z_loss_coef": 0.1})


def _generates_as_transformers(which: str, layout: dict) -> bool:
    ctx = cached_init(**layout)
    hf = random_hf(which, seed=5)
    model = lattice.from_hf(hf, ctx)
    prompt = _batch(8, batch=4, length=4)[0]
    expected = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=8, do_sample=False,
                           pad_token_id=V)
    return torch.equal(model.generate(prompt, 8), expected)


@pytest.mark.parametrize("layout", [dict(mode="serial"), dict(mode="2d", tp=4, ep=2),
                                    dict(mode="1d", tp=2, ep=2)])
def test_greedy_generation_with_the_kv_cache_is_transformers(layout):
    """Catches a decoding step whose one new token per sequence the layout cannot hand its experts
    (2d pads 2 tokens a row to whole ones, ep sends a handful of rows), or a KV cache that an MoE
    block forgets: lattice's greedy tokens equal transformers' generate() for both families."""
    for which in CONFIGS:
        assert all(run_distributed(lattice.context(**layout).world_size, _generates_as_transformers, which, layout))
