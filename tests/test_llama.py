"""The Llama family against transformers' own LlamaForCausalLM (built locally from a LlamaConfig
with random weights; nothing downloaded), in every layout, with pipeline and data parallelism.

The reference's RMSNorm: transformers casts the input to float32 before normalising (to protect
half precision); in a float64 model that is a downcast which alone puts the reference ~1e-7 from
any float64 computation. The reference therefore runs the same formula at the input's precision
when that is float64 (`numerics.rms_norm_at_input_precision`); everything else is transformers' code as shipped.
"""

import pytest
import torch
from hf_round_trip import lattice_cli, through_lattice
from multiproc import cached_init, run_distributed
from numerics import against_transformers, rel_diff, rms_norm_at_input_precision

import lattice
from lattice.models.llama import LLAMA3_SCALING, Llama, LlamaConfig

transformers = pytest.importorskip("transformers")

# grouped-query (8 query heads share 4 kv heads), a non-default rope_theta with Llama 3's scaling
# (original context 8: every band of the scaling -- kept, blended, divided -- is in use), untied
CFG = dict(vocab_size=61, seq_len=16, d_model=32, n_heads=8, n_kv_heads=4, n_layers=2, intermediate_size=40,
           rope_theta=500.0, rope_scaling=dict(LLAMA3_SCALING, factor=4.0, original_max_position_embeddings=8))


@torch.no_grad()
def random_hf_llama(seed=0, **overrides):
    """A float64 LlamaForCausalLM in eval mode with every parameter random (HF's init leaves the
    norm weights at 1, which would hide a norm mix-up)."""
    from transformers.models.llama import modeling_llama

    modeling_llama.LlamaRMSNorm.forward = rms_norm_at_input_precision
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(Llama.hf.config_to_hf(LlamaConfig(**{**CFG, **overrides}))).double().eval()
    for p in model.parameters():
        p.add_(torch.randn_like(p) * 0.1)
    return model


def _tokens(seed, batch=4, length=12):
    return torch.randint(0, CFG["vocab_size"], (batch, length), generator=torch.Generator().manual_seed(seed))


def _equals_transformers(layout: dict, generate: bool):
    """lattice.from_hf of a random float64 LlamaForCausalLM under `layout`: relative differences
    of the loss and of the worst gradient from transformers' own float64 forward and backward,
    and (with `generate`) whether greedy generation with lattice's KV cache gives
    transformers' generate() tokens."""
    ctx = cached_init(**layout)
    hf = random_hf_llama(seed=5)
    model = lattice.from_hf(hf, ctx)
    loss, worst = against_transformers(hf, model, _tokens(6), _tokens(7))
    same_tokens = None
    if generate:
        prompt = _tokens(8, batch=4, length=4)  # 3d splits the batch over q² = 4
        expected = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=8, do_sample=False,
                               pad_token_id=CFG["vocab_size"])  # no prompt token is padding
        same_tokens = torch.equal(model.generate(prompt, 8), expected)
    return loss, worst, same_tokens


LAYOUTS = [dict(mode="1d", tp=2), dict(mode="1d", tp=2, sequence_parallel=True), dict(mode="1d", tp=4),
           dict(mode="1d", tp=4, sequence_parallel=True), dict(mode="2d", tp=4), dict(mode="3d", tp=8),
           dict(mode="subgraph", tp=2, subgrids=2), dict(mode="subgraph", tp=2, subgrids=2, common="subgrid"),
           dict(mode="1d", tp=2, pp=2, microbatches=2), dict(mode="serial", dp=2)]
GENERATES = ({"mode": "1d", "tp": 2}, {"mode": "2d", "tp": 4}, {"mode": "3d", "tp": 8}, {"mode": "subgraph", "tp": 2, "subgrids": 2})


@pytest.mark.fast
def test_serial_equals_transformers_and_generates_its_tokens():
    """Catches a wrong name map or transpose (q/k/v, gate/up), kv heads expanded in the wrong
    order, rotary frequencies or Llama 3's scaling computed differently, or a KV cache that
    drops or repeats a position: loss, gradients or greedy tokens would differ."""
    loss, grads, same_tokens = _equals_transformers(dict(mode="serial"), True)
    print(f"serial: loss {loss:.1e}, worst gradient {grads:.1e}, generate equal {same_tokens}")
    assert loss < 1e-10 and grads < 1e-10 and same_tokens


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lo: "-".join(f"{k}={v}" for k, v in lo.items()))
def test_layout_equals_transformers(layout):
    """Catches a layout that splits q and k/v heads differently (a query group meeting the
    wrong kv head), a k/v segment sharded along the wrong dim, a cache holding another rank's kv
    heads, or the pipeline/data-parallel paths losing a gradient: every rank's loss and full
    gradients must equal transformers' within 1e-10, and the listed layouts' greedy tokens its."""
    world = lattice.context(**layout).world_size
    results = run_distributed(world, _equals_transformers, layout, layout in GENERATES)
    for loss, grads, same_tokens in results:
        assert loss < 1e-10 and grads < 1e-10, (loss, grads)
        assert same_tokens in (None, True)
    print(f"{layout}: loss {max(r[0] for r in results):.1e}, worst gradient {max(r[1] for r in results):.1e}")


@pytest.mark.parametrize("change, layout, match", [
    (dict(n_kv_heads=3), dict(mode="serial"), "n_kv_heads = 3 does not divide n_heads = 8"),
    (dict(n_heads=6), dict(mode="serial"), "d_model = 32 is not divisible by n_heads = 6"),
    (dict(intermediate_size=0), dict(mode="serial"), "intermediate_size must be a positive integer"),
    (dict(vocab_size=-1), dict(mode="serial"), "vocab_size must be a positive integer"),
    (dict(n_heads=16, n_kv_heads=4, d_model=64), dict(mode="1d", tp=8), "n_kv_heads"),
    (dict(n_kv_heads=1), dict(mode="2d", tp=4), "n_kv_heads"),
    (dict(intermediate_size=41), dict(mode="1d", tp=2), "41"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 2.0}), dict(mode="serial"), "yarn"),
])
def test_bad_sizes_are_refused_in_one_line(change, layout, match):
    """Catches a size that fails deep in a kernel (or splits a kv head between ranks) instead
    of one line naming it: the config or the layout refuses it before anything is allocated.
    (Every layout's refusal runs on every rank before any collective: test_conformance.)"""
    with pytest.raises(lattice.LatticeConfigError, match=match) as e:
        cfg, ctx = LlamaConfig(**{**CFG, **change}), lattice.context(**layout)
        with torch.device("meta"):
            lattice.build_model(cfg, ctx)
    assert "\n" not in str(e.value)


def test_presets_build_on_meta_with_their_published_sizes():
    """Catches a preset whose shape is not the published model's: parameter counts of
    Llama-3.2-1B (1.24 B, tied), Llama-3-8B (8.03 B) and Llama-3-70B (70.6 B), as Meta states
    them, from a meta-device build in the layouts that fit them."""
    expected = {"llama3.2-1b": 1.24e9, "llama3-8b": 8.03e9, "llama3-70b": 70.6e9}
    ctx = lattice.context("1d", tp=8)
    for preset, count in expected.items():
        with torch.device("meta"):
            model = lattice.build_model(LlamaConfig.preset(preset), ctx)
        assert abs(model.num_parameters() - count) / count < 0.005, (preset, model.num_parameters())


def test_hf_directory_trains_in_2d_like_serial_and_exports_what_transformers_loads(tmp_path, capfd, monkeypatch):
    """Catches an import that misreads a sharded safetensors directory (its index, a transposed
    projection), a 2d run that diverges from serial on imported weights, or an export that
    from_pretrained loads into a different function: HF dir (6 files + index) -> convert ->
    5 steps in 2d and in serial (losses equal to 4 decimals) -> --to hf -> from_pretrained,
    whose logits equal the trained lattice model's."""
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    cfg = LlamaConfig.preset("tiny", vocab_size=2048)  # the built-in corpus's vocabulary
    transformers.LlamaForCausalLM(Llama.hf.config_to_hf(cfg)).save_pretrained(tmp_path / "hf", max_shard_size="100KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    lattice_cli(["convert", "--from", "hf", "hf", "imported"], capfd)
    steps = ["--model", "tiny", "--steps", "5", "--eval-interval", "5", "--no-progress", "--batch-size", "8"]
    in_2d = lattice_cli(["train", "--resume", "imported", "--mode", "2d", "--tp", "4", "--nproc", "4", *steps,
                      "--out-dir", "run2d"], capfd)
    serial = lattice_cli(["train", "--resume", "imported", *steps, "--out-dir", "runs"], capfd)
    losses = [[line for line in out.splitlines() if line.startswith("step 5:")] for out in (in_2d, serial)]
    assert losses[0] and losses[0] == losses[1], (in_2d, serial)
    lattice_cli(["convert", "run2d", "--to", "hf", "exported"], capfd)
    lattice_cli(["convert", "run2d", "--to", "single", "trained.pt"], capfd)
    saved = torch.load(tmp_path / "trained.pt", weights_only=False)
    model = lattice.build_model(LlamaConfig.from_dict(saved["model_config"]), lattice.context("serial"))
    model.load_full_state_dict(saved["model"])
    loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "exported", local_files_only=True)
    x = torch.randint(0, 2048, (2, 32), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ours, theirs = model.eval()(x), loaded.eval()(input_ids=x).logits
    assert rel_diff(ours, theirs) < 1e-6
    print(losses[0][0], f"exported logits rel diff {rel_diff(ours, theirs):.1e}")


@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
def test_an_hf_llama_of_sizes_no_preset_has_continues_with_no_size_flag(kv_heads, tmp_path, capfd, monkeypatch):
    """Catches an import of a multi-head Llama (kv heads = heads) failing with KeyError
    'blocks.0.attn.qkv.q.weight' (the model stacked q, k, v), and a resume that asks for sizes
    the import already holds ("saved for a different model"): an HF Llama of d 64, 4 heads,
    d_ff 172, eps 1e-6 and its own 1000-token BPE -> convert -> train --resume in 2d q = 2 with no
    size flag -> convert --to hf, whose greedy tokens transformers generates as `lattice generate`
    does."""
    monkeypatch.chdir(tmp_path)
    hf_config = transformers.LlamaConfig(vocab_size=1000, hidden_size=64, num_attention_heads=4,
                                         num_key_value_heads=kv_heads, intermediate_size=172, num_hidden_layers=2,
                                         rms_norm_eps=1e-6, max_position_embeddings=96, tie_word_embeddings=False)
    torch.manual_seed(0)
    loaded, printed, expected = through_lattice(transformers.LlamaForCausalLM(hf_config), tmp_path, capfd,
                                                ["--steps", "2", "--mode", "2d", "--tp", "4", "--nproc", "4"])  # q = 2
    assert loaded.config.num_key_value_heads == kv_heads and loaded.config.intermediate_size == 172
    assert printed.startswith(expected + "\n"), (printed, expected)
