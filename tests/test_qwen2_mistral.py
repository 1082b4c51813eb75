"""Qwen2 and Mistral, the two families written as one file each on Llama's blocks, against
transformers' own Qwen2ForCausalLM and MistralForCausalLM (built locally from their configs with
random weights; nothing downloaded), in every layout, with pipeline and data parallelism, and
greedy generation past Mistral's window.

The references' RMSNorm casts to float32 before normalising, which alone puts them ~1e-8 from
any float64 computation; as in test_llama the reference runs the same formula at float64 when
its input is float64 (`numerics.rms_norm_at_input_precision`). Everything else is transformers' code as shipped.
"""

import pytest
import torch
from multiproc import cached_init, run_distributed
from numerics import against_transformers, rel_diff, rms_norm_at_input_precision

import lattice
from lattice.models.mistral import Mistral, MistralConfig
from lattice.models.qwen2 import Qwen2, Qwen2Config

transformers = pytest.importorskip("transformers")

V = 61
# Qwen2: grouped-query (8 query heads, 4 kv heads) untied, and multi-head (kv = query heads) tied;
# Mistral: a window of 5 in sequences of 12 and in 4 + 10 generated tokens
CONFIGS = {
    "qwen2-gqa": (Qwen2, Qwen2Config, dict(vocab_size=V, seq_len=16, d_model=32, n_heads=8, n_kv_heads=4, n_layers=2,
                                           intermediate_size=40, rope_theta=1000.0, tie_embeddings=False)),
    "qwen2-mha-tied": (Qwen2, Qwen2Config, dict(vocab_size=V, seq_len=16, d_model=32, n_heads=4, n_kv_heads=4,
                                                n_layers=2, intermediate_size=40, tie_embeddings=True)),
    "mistral": (Mistral, MistralConfig, dict(vocab_size=V, seq_len=16, d_model=32, n_heads=8, n_kv_heads=4, n_layers=2,
                                             intermediate_size=40, rope_theta=500.0, sliding_window=5)),
}


@torch.no_grad()
def random_hf(which: str, seed: int = 0):
    """A float64 transformers model of CONFIGS[which] in eval mode with every parameter random
    (HF's init leaves norm weights at 1 and biases at 0, which would hide a mix-up of either)."""
    from transformers.models.mistral import modeling_mistral
    from transformers.models.qwen2 import modeling_qwen2

    modeling_qwen2.Qwen2RMSNorm.forward = rms_norm_at_input_precision
    modeling_mistral.MistralRMSNorm.forward = rms_norm_at_input_precision
    family, config_class, sizes = CONFIGS[which]
    torch.manual_seed(seed)
    hf_class = getattr(transformers, family.hf.model_class)
    model = hf_class(family.hf.config_to_hf(config_class(**sizes))).double().eval()
    for p in model.parameters():
        p.add_(torch.randn_like(p) * 0.1)
    return model


def _tokens(seed, batch=4, length=12):
    return torch.randint(0, V, (batch, length), generator=torch.Generator().manual_seed(seed))


def _equals_transformers(which: str, layout: dict, generate: bool):
    """lattice.from_hf of the random float64 model under `layout`: relative differences of the
    loss and of the worst gradient from transformers' float64 forward and backward, and (with
    `generate`) whether lattice's greedy tokens with its KV cache are transformers' generate()."""
    ctx = cached_init(**layout)
    hf = random_hf(which, seed=5)
    model = lattice.from_hf(hf, ctx)
    loss, worst = against_transformers(hf, model, _tokens(6), _tokens(7))
    same_tokens = None
    if generate:
        prompt = _tokens(8, batch=4, length=4)  # 3d splits the batch over q² = 4
        expected = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=10, do_sample=False,
                               pad_token_id=V)  # no prompt token is padding
        same_tokens = torch.equal(model.generate(prompt, 10), expected)
    return loss, worst, same_tokens


LAYOUTS = [dict(mode="serial"), dict(mode="1d", tp=2, sequence_parallel=True), dict(mode="2d", tp=4),
           dict(mode="3d", tp=8), dict(mode="subgraph", tp=2, subgrids=2), dict(mode="1d", tp=2, pp=2, microbatches=2),
           dict(mode="serial", dp=2)]
GENERATES = (dict(mode="serial"), dict(mode="2d", tp=4), dict(mode="subgraph", tp=2, subgrids=2))
CASES = [("qwen2-gqa", lo) for lo in LAYOUTS] + [("mistral", lo) for lo in LAYOUTS] + \
        [("qwen2-mha-tied", dict(mode="serial")), ("qwen2-mha-tied", dict(mode="1d", tp=2))]


@pytest.mark.parametrize("which, layout", [
    pytest.param(which, layout, id=f"{which}-" + "-".join(f"{k}={v}" for k, v in layout.items()),
                 marks=[pytest.mark.fast] if layout == dict(mode="serial") else [])
    for which, layout in CASES])
def test_layout_equals_transformers(which, layout):
    """Catches a q/k/v bias split unlike its projection (or a bias given to the output
    projection), a multi-head checkpoint whose q, k, v the model stacks instead of keeping as
    segments, a sliding window off by one or applied in one layout only, a KV cache that keeps
    keys the window no longer reaches (or drops ones it does), and the pipeline or data-parallel
    paths losing a gradient: the loss and every gradient within 1e-10 of transformers' on every
    rank, and greedy tokens past the window equal to its generate()."""
    world = lattice.context(**layout).world_size
    results = run_distributed(world, _equals_transformers, which, layout, layout in GENERATES)
    for loss, grads, same_tokens in results:
        assert loss < 1e-10 and grads < 1e-10, (loss, grads)
        assert same_tokens in (None, True)
    print(f"{which} {layout}: loss {max(r[0] for r in results):.1e}, worst gradient "
          f"{max(r[1] for r in results):.1e}, generate equal {results[0][2]}")


@pytest.mark.fast
def test_the_window_changes_what_mistral_computes():
    """Catches a window that is never applied (the tests above would still pass if transformers
    ignored it too): with the window as long as the sequence Mistral computes Llama's function of
    the same weights, and with a window of 5 a different loss."""
    x, y = _tokens(6), _tokens(7)
    hf = random_hf("mistral", seed=5)
    windowed = lattice.from_hf(hf, lattice.context("serial"))
    sd = windowed.full_state_dict()
    full_cfg = MistralConfig(**{**CONFIGS["mistral"][2], "sliding_window": None})
    full = lattice.build_model(full_cfg, lattice.context("serial"))
    full.load_full_state_dict(sd)
    llama = lattice.build_model(lattice.get_arch("llama").config_class(
        **{k: v for k, v in CONFIGS["mistral"][2].items() if k != "sliding_window"}), lattice.context("serial"))
    llama.load_full_state_dict(sd)
    with torch.no_grad():
        assert abs(full(x, y).item() - llama(x, y).item()) < 1e-12
        assert abs(windowed(x, y).item() - full(x, y).item()) > 1e-3


@pytest.mark.fast
@torch.no_grad()
def test_mistrals_kv_cache_keeps_only_what_the_window_reaches():
    """Catches a KV cache that keeps keys the window no longer reaches (memory that grows with
    the text; attention would still mask them) or drops ones it does (wrong logits): after a
    prompt longer than the window and after each new token, every layer holds window - 1
    positions, and the last position's logits equal a full forward's without a cache."""
    model = lattice.from_hf(random_hf("mistral", seed=5), lattice.context("serial"))
    window = model.cfg.sliding_window
    tokens = _tokens(9, batch=2, length=12)
    cache = [{} for _ in model.blocks]
    model(tokens[:, :8], cache=cache, start=0, last_only=True)
    for position in range(8, 12):
        assert {layer["k"].shape[2] for layer in cache} == {window - 1}  # (B, nkv, positions, hs)
        cached = model(tokens[:, position:position + 1], cache=cache, start=position, last_only=True)[:, -1]
        full = model(tokens[:, :position + 1])[:, -1]
        assert rel_diff(cached, full) < 1e-12


@pytest.mark.fast
@pytest.mark.parametrize("family, change, match", [
    (Mistral, dict(sliding_window=0), "sliding_window must be a positive integer"),
    (Qwen2, dict(n_kv_heads=3), "n_kv_heads = 3 does not divide n_heads = 8"),
])
def test_bad_sizes_are_refused_in_one_line(family, change, match):
    """Catches a window or head count that fails deep in attention instead of one line naming it."""
    sizes = CONFIGS["mistral" if family is Mistral else "qwen2-gqa"][2]
    with pytest.raises(lattice.LatticeConfigError, match=match) as e:
        family.config_class(**{**sizes, **change})
    assert "\n" not in str(e.value)


def test_hf_configs_the_families_do_not_implement_are_refused():
    """Catches a Qwen2 checkpoint with its partial sliding window imported as if it had none."""
    config = Qwen2.hf.config_to_hf(Qwen2Config(**CONFIGS["qwen2-gqa"][2]))
    config.use_sliding_window, config.sliding_window = True, 4
    with pytest.raises(lattice.LatticeConfigError, match="use_sliding_window"):
        Qwen2.hf.config_from_hf(config)
