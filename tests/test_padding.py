"""Padded batches (`attention_mask`, transformers' meaning: 1 token, 0 padding) and token types
against transformers' own models with the same masks, in every layout: GPT-2 and Llama (causal,
right padding, targets at padding ignored), BERT (masked LM and classification, bidirectional,
padding anywhere, random token types) and T5 (padded sources read by the encoder and by every
decoder layer's cross-attention, padded targets as -100).

The batch's lengths are random, so the replicas of dp = 2 and the micro-batches of pp = 2 hold
different numbers of labelled targets: the loss is the mean over the whole batch's labelled
targets, which the pipeline weighs per micro-batch and data parallelism per replica
(`replica_weight`, as the Trainer does).
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from multiproc import cached_init, run_distributed
from numerics import rel_diff
from test_bert import _worst_grad, random_hf_bert
from test_gpt2 import random_hf_model
from test_llama import random_hf_llama
from test_t5 import random_hf_t5

import lattice
from lattice.bench.measure import saved_activation_bytes
from lattice.models import hf as lhf

transformers = pytest.importorskip("transformers")

B, T = 8, 12  # 3d splits the batch over q² = 4, dp = 2 then pp = 2 halves it twice


def lengths_mask(batch: int, length: int, seed: int, shortest: int = 2) -> torch.Tensor:
    """(batch, length) int64: 1 on each row's first n tokens (n random in [shortest, length]), 0 after."""
    n = torch.randint(shortest, length + 1, (batch,), generator=torch.Generator().manual_seed(seed))
    n[0] = length  # one full row: every layout must also take a row without padding
    return (torch.arange(length)[None] < n[:, None]).long()


def _reference_and_batch(family: str):
    """(transformers model, tokens, targets, lattice inputs, the reference's loss) of a padded
    batch; the reference's gradients are in its .grad."""
    gen = torch.Generator().manual_seed(11)
    if family in ("gpt2", "llama"):
        hf = random_hf_model() if family == "gpt2" else random_hf_llama()
        V = hf.config.vocab_size
        x, y = torch.randint(0, V, (B, T), generator=gen), torch.randint(0, V, (B, T), generator=gen)
        mask = lengths_mask(B, T, 2)
        logits = hf(input_ids=x, attention_mask=mask).logits
        reference = F.cross_entropy(logits.flatten(0, 1), y.masked_fill(mask == 0, -100).flatten())
        inputs = {"attention_mask": mask}
    elif family.startswith("bert"):
        labels = 3 if family == "bert-classify" else 0
        hf = random_hf_bert(labels)
        V = hf.config.vocab_size
        x, types = torch.randint(0, V, (B, T), generator=gen), torch.randint(0, 2, (B, T), generator=gen)
        mask = (torch.rand(B, T, generator=gen) > 0.3).long()  # padding anywhere: the encoder is bidirectional
        mask[:, 0] = 1
        y = torch.randint(0, labels, (B,), generator=gen) if labels else torch.randint(0, V, (B, T), generator=gen)
        reference = hf(input_ids=x, attention_mask=mask, token_type_ids=types,
                       labels=y if labels else y.masked_fill(mask == 0, -100)).loss
        inputs = {"attention_mask": mask, "token_types": types}
    else:
        hf = random_hf_t5("relu-tied")
        x, y = torch.randint(2, 61, (B, 12), generator=gen), torch.randint(2, 61, (B, 6), generator=gen)
        mask = lengths_mask(B, 12, 4)
        y = y.masked_fill(lengths_mask(B, 6, 5, shortest=1) == 0, -100)
        reference = hf(input_ids=x, attention_mask=mask, labels=y).loss
        inputs = {"attention_mask": mask}
    reference.backward()
    return hf, x, y, inputs, reference.item()


def replica_weight(targets: torch.Tensor, rows: slice, dp: int) -> float:
    """dp · (this replica's labelled targets) / (the global batch's): the replicas' weighted mean
    losses average to the global batch's mean."""
    labelled = targets != -100
    return dp * float(labelled[rows].sum()) / float(labelled.sum())


def _padded_equals_transformers(layout: dict, families: list[str]) -> dict:
    ctx = cached_init(**layout)
    dp_rank, per = ctx.coord(lattice.MeshAxis.DP), B // ctx.dp
    rows = slice(dp_rank * per, (dp_rank + 1) * per)
    out = {}
    for family in families:
        hf, x, y, inputs, reference = _reference_and_batch(family)
        model = lattice.from_hf(hf, ctx)
        loss = model.forward_backward(x[rows], y[rows], **{k: v[rows] for k, v in inputs.items()})
        if ctx.dp > 1:  # each replica weighed by its labelled targets, then averaged (the Trainer's DDP)
            weight = replica_weight(model.unpadded_targets(y, inputs["attention_mask"]), rows, ctx.dp)
            group = ctx.group(lattice.MeshAxis.DP)
            for p in model.parameters():
                p.grad *= weight
                dist.all_reduce(p.grad, group=group)
                p.grad /= ctx.dp
            total = torch.tensor([loss * weight], dtype=torch.float64)
            dist.all_reduce(total, group=group)
            loss = float(total) / ctx.dp
        ours = lhf.to_hf_state_dict(model.family, model.cfg, model.full_grad_dict())
        theirs = {name: p.grad for name, p in hf.named_parameters()}
        worst = (_worst_grad(ours, theirs) if family.startswith("bert")
                 else max(rel_diff(ours[name], g) for name, g in theirs.items()))
        if ctx.pipeline is None:  # the activations it saves, with the masks' copies, as the cost model counts
            mine = {k: v[rows] for k, v in inputs.items()}
            saved = saved_activation_bytes(model, lambda: model(x[rows], y[rows], **mine))
            modelled = lattice.cost.estimate(
                model.cfg, layout["mode"], batch=per, seq=T if family != "t5" else x.shape[1],
                target_seq=y.shape[1] if family == "t5" else None, dtype=torch.float64, padded=True,
                rank=ctx.topology.rank_at({**ctx.coords, lattice.MeshAxis.DP: 0}),
                **{**{k: v for k, v in layout.items() if k != "mode"}, "dp": 1}).memory["activations"]
            assert saved == pytest.approx(modelled, rel=0.02), (family, saved, modelled)
        same = None
        if family in ("gpt2", "llama") and ctx.pipeline is None and not layout.get("sequence_parallel"):
            prompt, mask = left_padded_prompts(hf.config.vocab_size)
            expected = hf.generate(prompt, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
            same = torch.equal(model.generate(prompt, 6, attention_mask=mask), expected)
        out[family] = (abs(loss - reference) / reference, worst, same)
    return out


def left_padded_prompts(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(4, 6) prompts of 6, 4, 2 and 5 tokens, left-padded with token 0, and their mask."""
    prompt = torch.randint(1, vocab, (4, 6), generator=torch.Generator().manual_seed(3))
    mask = (torch.arange(6)[None] >= torch.tensor([[0], [2], [4], [1]])).long()
    return prompt.masked_fill(mask == 0, 0), mask


ALL = ["gpt2", "llama", "bert-mlm", "bert-classify", "t5"]
NO_T5 = ["gpt2", "llama", "bert-mlm", "bert-classify"]
LAYOUTS = [(dict(mode="serial"), ALL),
           (dict(mode="1d", tp=2, sequence_parallel=True), ALL),
           (dict(mode="2d", tp=4), ALL),
           (dict(mode="3d", tp=8), ALL),
           (dict(mode="subgraph", tp=2, subgrids=2), ALL),
           (dict(mode="subgraph", tp=4, subgrids=2, common="subgrid"), ALL),
           (dict(mode="1d", tp=2, pp=2, microbatches=2), NO_T5),
           (dict(mode="1d", tp=2, pp=2, microbatches=2, pp_layers=(3, 2)), ["t5"]),  # its 2 + 3 blocks
           (dict(mode="serial", dp=2), ALL)]


@pytest.mark.parametrize("layout, families", [
    pytest.param(layout, families, id="-".join(f"{k}={v}" for k, v in layout.items()),
                 marks=[pytest.mark.fast] if layout == dict(mode="serial") else [])
    for layout, families in LAYOUTS])
def test_padded_batches_equal_transformers(layout, families):
    """Catches padding attended to (in self-attention, in T5's cross-attention, or in one layout's
    rows only: a mask sliced for the residual's rows instead of attention's), targets at padding
    counted, token types dropped or split unlike the tokens, a micro-batch's or a replica's mean
    weighed by its size instead of its labelled targets, and a query with nothing to see (NaN):
    the loss and every gradient within 1e-10 of transformers' with the same attention_mask (and
    the activations saved, the masks' copies included, within 2% of the cost model's); and
    left-padded prompts generated with positions that count the padding (GPT-2's table rows,
    Llama's rotary angles) or attending to it: greedy tokens equal to transformers' generate."""
    world = lattice.context(**layout).world_size
    results = run_distributed(world, _padded_equals_transformers, layout, families)
    for rank_result in results:
        for family, (loss, grads, same_tokens) in rank_result.items():
            assert loss < 1e-10 and grads < 1e-10, (family, loss, grads)
            assert same_tokens in (None, True), family
    print(layout, {f: f"loss {loss:.1e}, grad {g:.1e}" + ("" if same is None else f", generate equal {same}")
                   for f, (loss, g, same) in results[0].items()})
