"""HuggingFace GPT-2 import/export against transformers' own GPT2LMHeadModel (nothing downloaded),
in one process and under every layout."""

import sys

import pytest
import torch
import torch.nn.functional as F
from multiproc import cached_init, run_distributed
from numerics import rel_diff

import lattice
from lattice.models import hf as lhf
from lattice.models.gpt2 import config_from_hf, config_to_hf

transformers = pytest.importorskip("transformers")

B, T = 3, 16


def hf_config(**overrides):
    kw = dict(vocab_size=96, n_positions=T, n_embd=24, n_head=6, n_layer=2, resid_pdrop=0.0,
              embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None, eos_token_id=None)
    return transformers.GPT2Config(**{**kw, **overrides})


@torch.no_grad()
def random_hf_model(seed=0, **overrides):
    """A float64 GPT2LMHeadModel in eval mode with every parameter random: HF's own init leaves
    biases at 0 and LayerNorm weights at 1, which would hide a bias or LayerNorm mix-up."""
    torch.manual_seed(seed)
    model = transformers.GPT2LMHeadModel(hf_config(**overrides)).double().eval()
    for p in model.parameters():
        p.add_(torch.randn_like(p) * 0.1)
    return model


def tokens(seed, batch=B):
    return torch.randint(0, 96, (batch, T), generator=torch.Generator().manual_seed(seed))


def hf_losses(hf, x):
    """HF's own shifted-label loss (transformers computes it in float32) and the float64
    cross-entropy of HF's logits against the next tokens."""
    ref = hf(input_ids=x, labels=x)
    ce64 = F.cross_entropy(ref.logits[:, :-1].flatten(0, 1), x[:, 1:].flatten())
    return ref, ref.loss.item(), ce64.item()


def assert_matches_hf(model, hf, x):
    """Logits on x and the loss equal HF's: to 1e-6 against HF's float32 loss, to 1e-12 against
    the float64 cross-entropy of HF's logits."""
    with torch.no_grad():
        ref, hf_loss, hf_ce64 = hf_losses(hf, x)
        logits = model(x)
        loss = model(x[:, :-1], x[:, 1:]).item()  # HF shifts labels inside; lattice takes them aligned
    assert (logits - ref.logits).abs().max().item() < 1e-6
    assert abs(loss - hf_loss) < 1e-6 and abs(loss - hf_ce64) < 1e-12
    return loss, hf_loss


@pytest.mark.fast
@pytest.mark.parametrize("tied", [True, False])
def test_from_hf_model_matches_transformers(tied):
    """Catches a wrong name map, a transposed or mis-split c_attn (q/k/v or head order), a dropped
    bias, or a wrong lm_head when untied: logits and loss would differ from transformers'."""
    hf = random_hf_model(tie_word_embeddings=tied)
    model = lattice.GPT.from_hf(hf, lattice.init("serial"))
    assert model.dtype == torch.float64 and model.cfg.tie_embeddings is tied
    model.eval()
    assert_matches_hf(model, hf, tokens(1))


def test_from_state_dict_with_config_matches_transformers():
    """Catches the `transformer.` prefix handling or the GPT2Config/GPTConfig paths going wrong:
    a state dict with the prefix, one without it (GPT2Model's) and a bare GPTConfig all import."""
    hf = random_hf_model(seed=2)
    ctx = lattice.init("serial")
    body_only = {k.removeprefix("transformer."): v for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    cfg = config_from_hf(hf.config)
    for sd, config in ((hf.state_dict(), hf.config), (body_only, hf.config), (body_only, cfg)):
        model = lattice.GPT.from_hf(sd, ctx, config=config).eval()
        assert_matches_hf(model, hf, tokens(3))
    model = lattice.GPT.from_hf(hf.transformer, ctx).eval()  # a GPT2Model: tied head, no lm_head
    assert_matches_hf(model, hf, tokens(4))


def test_round_trips_are_exact():
    """Catches any lossy step (a dtype cast, a wrong reshape that happens to keep values close, a
    missing or extra key) in HF -> lattice -> HF and lattice -> HF -> lattice."""
    ctx = lattice.init("serial")
    for tied in (True, False):
        hf = random_hf_model(seed=5, tie_word_embeddings=tied)
        back = lattice.GPT.from_hf(hf, ctx).to_hf_state_dict()
        original = hf.state_dict()
        assert back.keys() == original.keys()
        assert all(torch.equal(back[k], original[k]) for k in original)

    cfg = lattice.GPTConfig(vocab_size=96, seq_len=T, d_model=24, n_heads=6, n_layers=2, tie_embeddings=False)
    model = lattice.GPT(cfg, ctx, dtype=torch.float64)
    with torch.no_grad():
        for p in model.parameters():  # lattice's init also has zero biases
            p.add_(torch.randn_like(p) * 0.1)
    again = lattice.GPT.from_hf(model.to_hf_state_dict(), ctx, config=cfg).full_state_dict()
    original = model.full_state_dict()
    assert again.keys() == original.keys()
    assert all(torch.equal(again[k], original[k]) for k in original)


def test_exported_model_computes_the_same_in_transformers():
    """Catches an export whose names load but whose values mean something else in HF (e.g. the qkv
    reshape done in the wrong order), including the zero biases written for a bias-free model."""
    ctx = lattice.init("serial")
    for bias in (True, False):
        cfg = lattice.GPTConfig(vocab_size=96, seq_len=T, d_model=24, n_heads=6, n_layers=2, bias=bias)
        model = lattice.GPT(cfg, ctx, dtype=torch.float64).eval()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.1)
        hf = lhf.to_hf_model(model)
        assert hf.dtype == torch.float64
        assert_matches_hf(model, hf, tokens(6))


def _import_under_layout(mode, tp, dp):
    import torch.distributed as dist

    ctx = cached_init(mode=mode, tp=tp, dp=dp)
    hf = random_hf_model(seed=7)
    model = lattice.GPT.from_hf(hf, ctx).eval()
    x = tokens(100 + ctx.coords[lattice.MeshAxis.DP])  # each data-parallel replica its own batch
    losses = assert_matches_hf(model, hf, x)
    sd, original = model.to_hf_state_dict(), hf.state_dict()  # a collective: every rank calls it
    assert sd.keys() == original.keys()
    assert all(torch.equal(sd[k], original[k]) for k in original)
    return dist.get_rank(), losses


def test_import_under_data_parallel_layout():
    """Catches from_hf/to_hf_state_dict working only for a single process: on 2 data-parallel
    ranks each replica's logits and loss must equal HF's on its batch, the export HF's weights."""
    results = run_distributed(2, _import_under_layout, "serial", 1, 2)
    assert [r for r, _ in results] == [0, 1]
    assert results[0][1][1] != results[1][1][1]  # the two replicas really saw different batches


def test_import_under_1d_tensor_parallel_layout():
    """Catches from_hf not sharding through the mode's specs (e.g. qkv split over heads in the
    wrong order): under 1d with tp=2 logits and loss must still equal HF's, the export its weights."""
    run_distributed(2, _import_under_layout, "1d", 2, 1)


@pytest.mark.parametrize("overrides, match", [
    (dict(activation_function="gelu"), "activation_function='gelu'"),
    (dict(n_inner=32), "n_inner=32"),
    (dict(scale_attn_weights=False), "scale_attn_weights=False"),
    (dict(scale_attn_by_inverse_layer_idx=True), "scale_attn_by_inverse_layer_idx=True"),
    (dict(reorder_and_upcast_attn=True), "reorder_and_upcast_attn=True"),
    (dict(attn_pdrop=0.1), "one dropout rate"),
])
def test_unsupported_gpt2_variants_are_refused(overrides, match):
    """Catches importing a GPT-2 variant lattice computes differently (silently wrong outputs)."""
    with pytest.raises(lattice.LatticeConfigError, match=match) as e:
        config_from_hf(hf_config(**overrides))
    assert "\n" not in str(e.value)


def test_dropout_rule():
    """Catches the documented dropout rule not holding: equal rates map, dropout= replaces them."""
    assert config_from_hf(hf_config(resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)).dropout == 0.1
    assert config_from_hf(hf_config(attn_pdrop=0.2), dropout=0.05).dropout == 0.05
    back = config_to_hf(config_from_hf(hf_config(resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)))
    assert (back.resid_pdrop, back.embd_pdrop, back.attn_pdrop, back.n_positions, back.n_head) == (0.1, 0.1, 0.1, T, 6)


def test_bad_weights_are_refused_in_one_line():
    """Catches missing/extra keys, wrong shapes, a missing config or an untied head under a tied
    config reaching load (a KeyError, a reshape crash or silently wrong weights)."""
    hf = random_hf_model(seed=8)
    ctx = lattice.init("serial")
    sd = hf.state_dict()
    missing = {k: v for k, v in sd.items() if "h.1.mlp.c_fc.bias" not in k}
    wrong_shape = {**sd, "transformer.h.0.attn.c_attn.weight": torch.zeros(24, 48, dtype=torch.float64)}
    untied = {**sd, "lm_head.weight": sd["lm_head.weight"] + 1}
    extra = {**sd, "transformer.h.0.attn.rotary": torch.zeros(3)}
    cases = [
        (lambda: lattice.GPT.from_hf(sd, ctx), "needs config="),
        (lambda: lattice.GPT.from_hf(missing, ctx, config=hf.config), r"missing 1 keys.*h\.1\.mlp\.c_fc\.bias"),
        (lambda: lattice.GPT.from_hf(extra, ctx, config=hf.config), "unexpected 1 keys"),
        (lambda: lattice.GPT.from_hf(wrong_shape, ctx, config=hf.config), r"c_attn\.weight: expected shape \[24, 72\]"),
        (lambda: lattice.GPT.from_hf(sd, ctx, config=hf_config(n_layer=3)), "missing 12 keys"),
        (lambda: lattice.GPT.from_hf(untied, ctx, config=hf.config), "lm_head.weight differs"),
        (lambda: lattice.GPT.from_hf(hf, ctx, config=config_from_hf(hf_config(n_head=4))), "n_heads"),
        (lambda: lattice.GPT.from_hf(torch.nn.Linear(2, 2), ctx), "not a HuggingFace model"),
    ]
    for fn, match in cases:
        with pytest.raises(lattice.LatticeConfigError, match=match) as e:
            fn()
        assert "\n" not in str(e.value)


def test_missing_transformers_gives_install_hint(monkeypatch):
    """Catches a bare ModuleNotFoundError (no hint) when the optional extra is not installed."""
    monkeypatch.setitem(sys.modules, "transformers", None)
    cfg = lattice.GPTConfig(vocab_size=96, seq_len=T, d_model=24, n_heads=6, n_layers=1)
    with pytest.raises(ImportError, match=r"lattice\[hf\]"):
        config_to_hf(cfg)


def _equals_transformers(layout: dict):
    """lattice.from_hf of a random float64 GPT2LMHeadModel under `layout`: the replica's loss and
    every full gradient, beside transformers' own forward and backward in float64 (the
    cross-entropy of its logits)."""
    ctx = cached_init(**layout)
    hf = random_hf_model(seed=11, tie_word_embeddings=layout.get("tp", 1) != 4)
    x, y = tokens(12, batch=4), tokens(13, batch=4)  # inputs and (aligned) targets
    reference = F.cross_entropy(hf(input_ids=x).logits.flatten(0, 1), y.flatten())
    reference.backward()
    expected = {name: p.grad for name, p in hf.named_parameters()}
    model = lattice.from_hf(hf, ctx)
    loss = model.forward_backward(x, y)
    grads = lhf.to_hf_state_dict(model.family, model.cfg, model.full_grad_dict())
    return abs(loss - reference.item()) / reference.item(), max(rel_diff(grads[k], g) for k, g in expected.items())


@pytest.mark.parametrize("layout", [dict(mode="serial"), dict(mode="1d", tp=2), dict(mode="2d", tp=4), dict(mode="3d", tp=8), dict(mode="subgraph", tp=4, subgrids=2),
                                    dict(mode="serial", pp=2, microbatches=2), dict(mode="1d", tp=2, pp=2, microbatches=2)],
                         ids=lambda layout: "-".join(f"{k}={v}" for k, v in layout.items()))
def test_from_hf_equals_transformers_in_every_mode_and_in_pipeline_stages(layout):
    """Catches an import that is right in serial but not under a layout (a mapped tensor sharded
    along the wrong dim, the tied head's two gradients not summed across stages) or a family
    lookup that picks the wrong model: lattice.from_hf(GPT2LMHeadModel) gives transformers'
    float64 loss and every gradient within 1e-10 on every rank."""
    world = lattice.context(**layout).world_size
    results = run_distributed(world, _equals_transformers, layout)
    for loss, grads in results:
        assert loss < 1e-10 and grads < 1e-10, (loss, grads)
    print(f"{layout}: loss {max(r[0] for r in results):.1e}, worst gradient {max(r[1] for r in results):.1e} "
          f"(relative to transformers, every rank)")


def test_export_carries_the_tokenizer_and_transformers_generates_lattices_text(tmp_path, capsys):
    """Catches an HF export without a loadable tokenizer (AutoTokenizer then falls back to one
    that encodes the prompt differently, or to nothing) or with one that decodes differently:
    transformers alone (AutoTokenizer + AutoModelForCausalLM on the export) must encode as the
    run's tokenizer and print `lattice generate --top-k 1`'s text for the same prompt."""
    from tokenizers import Tokenizer

    from lattice.cli import main as cli

    run, out, prompt = tmp_path / "run", tmp_path / "hf", "import os\nimport"
    assert cli.main(["train", "--model", "tiny", "--vocab-size", "512", "--batch-size", "8", "--steps", "60",
                     "--eval-interval", "60", "--eval-batches", "1", "--no-progress", "--out-dir", str(run)]) == 0
    assert cli.main(["convert", str(run), "--to", "hf", str(out)]) == 0
    capsys.readouterr()
    assert cli.main(["generate", str(run), "--prompt", prompt, "--max-new-tokens", "12", "--top-k", "1"]) == 0
    ours = capsys.readouterr().out[:-1]  # the text as printed (timings go to stderr)
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    text = "def main(args):\n    return 0\n"
    assert tokenizer(text).input_ids == Tokenizer.from_file(str(run / "tokenizer.json")).encode(text).ids
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        generated = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                                   pad_token_id=0)
    theirs = prompt + tokenizer.decode(generated[0, ids.shape[1]:])
    assert ours == theirs and len(theirs) > len(prompt), (ours, theirs)


@pytest.mark.parametrize("direction", [["--from", "hf", "hf_dir", "out"], ["run", "--to", "hf", "out"]],
                         ids=["from-hf", "to-hf"])
def test_hf_conversion_without_its_packages_names_the_extra_and_writes_nothing(direction, tmp_path, capsys,
                                                                                monkeypatch):
    """Catches `lattice convert --to hf` without safetensors ending in ModuleNotFoundError after
    creating an empty destination: one line naming the extra, nothing written."""
    from lattice.cli import main as cli

    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(sys.modules, "safetensors", None)
    assert cli.main(["convert", *direction]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "needs safetensors" in err and "pip install 'lattice[hf]'" in err
    assert not (tmp_path / "out").exists()
