"""Generation with a KV cache held in each mode's own layout: cached and uncached decoding agree,
serial's greedy tokens equal transformers' generate on the exported model, and every parallel
layout produces serial's tokens."""

import pytest
import torch
from multiproc import cached_init, run_distributed

import lattice
from lattice.models import hf

CFG = dict(vocab_size=61, seq_len=24, d_model=24, n_heads=4, n_layers=2)


def _prompts(batch: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, CFG["vocab_size"], (batch, 5), generator=torch.Generator().manual_seed(seed))


def _serial(dtype=torch.float64):
    return lattice.GPT(lattice.GPTConfig(**CFG), lattice.context("serial"), dtype=dtype)


def test_cached_and_uncached_decoding_give_the_same_logits():
    """Catches a cache that misplaces positions (wrong wpe rows after the prompt), attends
    causally where one new query must see every key, or drops a layer's keys."""
    model = _serial().eval()
    tokens = _prompts(2, seed=1)
    full = torch.cat([tokens, torch.randint(0, 61, (2, 6), generator=torch.Generator().manual_seed(2))], dim=1)
    with torch.no_grad():
        reference = model(full)  # (B, T, V) in one uncached pass
        cache = [{} for _ in model.blocks]
        steps = [model(full[:, :5], cache=cache, start=0)]
        steps += [model(full[:, t:t + 1], cache=cache, start=t) for t in range(5, full.shape[1])]
    cached = torch.cat(steps, dim=1)
    assert (cached - reference).abs().max().item() < 1e-12
    greedy = model.generate(tokens, 8)
    assert torch.equal(greedy, model.generate(tokens, 8, use_cache=False))


def test_serial_greedy_tokens_equal_transformers_generate():
    """Catches a generation loop that differs from HF GPT-2's (position ids, the last position's
    logits, argmax ties aside) on the exported weights, in float64."""
    transformers = pytest.importorskip("transformers")
    model = _serial()
    ours = model.generate(_prompts(2), 10)
    theirs = hf.to_hf_model(model)
    with torch.no_grad():
        out = theirs.generate(_prompts(2), max_new_tokens=10, do_sample=False, pad_token_id=0,
                              attention_mask=torch.ones(2, 5, dtype=torch.long))
    assert isinstance(theirs, transformers.GPT2LMHeadModel) and torch.equal(ours, out)


def test_sampling_is_reproducible_and_respects_top_k():
    """Catches sampling that depends on anything but the seed, or a top-k filter that lets other
    tokens through."""
    model = _serial()
    a = model.generate(_prompts(2), 6, temperature=0.8, top_k=1, seed=3)
    assert torch.equal(a, model.generate(_prompts(2), 6))  # top-1 sampling is greedy
    b = model.generate(_prompts(2), 6, temperature=1.5, top_k=20, seed=3)
    assert torch.equal(b, model.generate(_prompts(2), 6, temperature=1.5, top_k=20, seed=3))


def _check_layout(mode, layout, batch):
    ctx = cached_init(mode=mode, **layout)
    serial = _serial()
    model = lattice.GPT(lattice.GPTConfig(**CFG), ctx, dtype=torch.float64)
    model.load_full_state_dict(serial.full_state_dict())
    prompts = _prompts(batch, seed=4)
    return torch.equal(model.generate(prompts, 8), serial.generate(prompts, 8)), \
        torch.equal(model.generate(prompts, 5, temperature=0.9, top_k=10, seed=1),
                    serial.generate(prompts, 5, temperature=0.9, top_k=10, seed=1))


@pytest.mark.parametrize("mode,layout,world,batch", [("1d", {"tp": 2}, 2, 2), ("2d", {"tp": 4}, 4, 2),
                                                     ("subgraph", {"tp": 4, "subgrids": 2}, 4, 4),
                                                     ("3d", {"tp": 8}, 8, 4)])
def test_every_layout_generates_serials_tokens(mode, layout, world, batch):
    """Catches a KV cache kept in the wrong layout (another rank's heads or sequences), or logits
    gathered from the wrong ranks, in each tensor-parallel layout (greedy and seeded sampling)."""
    for greedy, sampled in run_distributed(world, _check_layout, mode, layout, batch):
        assert greedy and sampled
