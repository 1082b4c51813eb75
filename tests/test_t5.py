"""The T5 family against transformers' own T5ForConditionalGeneration (built locally from a
T5Config with random weights; nothing downloaded), both feed-forward variants (v1.0's ReLU with
the tied, scaled head; v1.1's gated GELU with an untied head), in every layout; greedy
generation against transformers' generate; the refusals.

The reference's norm: transformers' T5LayerNorm computes the variance in float32 (to protect half
precision); in a float64 model that downcast alone puts the reference ~1e-8 from any float64
computation. The reference therefore runs the same formula at the input's precision when that is
float64 (`_reference_norm`), as tests/test_llama.py does for RMSNorm; everything else is
transformers' code as shipped (its eager attention).
"""

import re

import pytest
import torch
import torch.distributed as dist
from multiproc import cached_init, run_distributed
from numerics import rel_diff
from test_conformance import assert_layout_equals_serial

import lattice
from lattice.models import hf as lhf
from lattice.models.components import relative_buckets
from lattice.models.t5 import T5, T5Config

transformers = pytest.importorskip("transformers")

# 12 source and 6 target positions (no layout's split may assume equal lengths); 8 buckets
# with a maximum distance of 5, so that the logarithmic buckets and the farthest one are in use
BASE = dict(vocab_size=61, seq_len=16, target_len=12, d_model=32, n_heads=4, head_size=8, n_layers=2,
            n_decoder_layers=3, d_ff=48, relative_buckets=8, relative_max_distance=5)
VARIANTS = {"relu-tied": dict(BASE), "gated-gelu-untied": dict(BASE, feed_forward_proj="gated-gelu",
                                                             tie_embeddings=False, head_size=6, n_layers=3)}
SOURCE, TARGET = 12, 6


def _reference_norm(self, x):
    xs = x if x.dtype == torch.float64 else x.float()
    return self.weight * (x * torch.rsqrt(xs.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


@torch.no_grad()
def random_hf_t5(variant: str, seed=0):
    """A float64 T5ForConditionalGeneration in eval mode with every parameter random (its init
    leaves the norm weights at 1, which would hide a norm mix-up); an untied variant gets an LM
    head of its own (transformers 5 ties it in memory otherwise)."""
    from transformers.models.t5 import modeling_t5

    modeling_t5.T5LayerNorm.forward = _reference_norm
    torch.manual_seed(seed)
    cfg = T5Config(**VARIANTS[variant])
    hf_config = T5.hf.config_to_hf(cfg)
    hf_config._attn_implementation = "eager"
    model = transformers.T5ForConditionalGeneration(hf_config).double().eval()
    if not cfg.tie_embeddings:
        model.lm_head.weight = torch.nn.Parameter(torch.randn(cfg.vocab_size, cfg.d_model, dtype=torch.float64))
    for p in model.parameters():
        p.add_(torch.randn_like(p) * 0.1)
    return model


def _pairs(seed, batch=4):
    """Sources (batch, 12) and labels (batch, 6) with two labels per row ignored (-100)."""
    gen = torch.Generator().manual_seed(seed)
    src = torch.randint(2, BASE["vocab_size"], (batch, SOURCE), generator=gen)
    labels = torch.randint(2, BASE["vocab_size"], (batch, TARGET), generator=gen)
    labels[:, 2::3] = -100
    return src, labels


def _equals_transformers(layout: dict, generate: bool) -> dict:
    """Per variant, lattice.from_hf of a random float64 T5 under `layout`: relative differences of
    the loss and the worst gradient from transformers' float64 forward and backward on the same
    global batch (this replica's rows), and (with `generate`) whether greedy generation with
    lattice's caches gives transformers' generate() tokens."""
    ctx = cached_init(**layout)
    out = {}
    for variant in VARIANTS:
        hf = random_hf_t5(variant, seed=5)
        src, labels = _pairs(6, batch=4 * ctx.dp)
        reference = hf(input_ids=src, labels=labels).loss
        reference.backward()
        model = lattice.from_hf(hf, ctx)
        rows = slice(ctx.coord(lattice.MeshAxis.DP) * 4, (ctx.coord(lattice.MeshAxis.DP) + 1) * 4)
        loss = model.forward_backward(src[rows], labels[rows])
        if ctx.dp > 1:  # averaging over replicas by hand (the Trainer's DDP does this); every row has 4 labels
            dp_group = ctx.group(lattice.MeshAxis.DP)
            for p in model.parameters():
                dist.all_reduce(p.grad, group=dp_group)
                p.grad /= ctx.dp
            total = torch.tensor([loss], dtype=torch.float64)
            dist.all_reduce(total, group=dp_group)
            loss = float(total) / ctx.dp
        grads = lhf.to_hf_state_dict(model.family, model.cfg, model.full_grad_dict())
        worst = max(rel_diff(grads[name], p.grad) for name, p in hf.named_parameters())
        same_tokens = None
        if generate:
            prompt = src[:4, :9]  # 3d splits the batch over q² = 4
            # transformers' decoder cache assumes as many decoder as encoder layers: generate without it
            expected = hf.generate(prompt, max_new_tokens=6, do_sample=False, use_cache=False)
            same_tokens = torch.equal(model.generate(prompt, 6), expected)
        out[variant] = (abs(loss - reference.item()) / reference.item(), worst, same_tokens)
    return out


@pytest.mark.fast
def test_serial_equals_transformers_and_generates_its_tokens():
    """Catches any difference from transformers' T5 in either variant: a 1/sqrt(d) left in the
    scores, a bucket computed otherwise (bidirectional in the decoder, the log buckets in float64),
    a bias not shared by the layers or not split by heads, the labels shifted wrong or -100 fed to
    the decoder, a missing d^-0.5 before a tied head (or one before an untied head), the gate and
    linear unit swapped, a transposed or misnamed tensor -- or a cache that drops a position or
    recomputes the memory's keys differently (greedy tokens)."""
    for variant, (loss, grads, same) in _equals_transformers(dict(mode="serial"), True).items():
        print(f"serial {variant}: loss {loss:.1e}, worst gradient {grads:.1e}, generate equal {same}")
        assert loss < 1e-10 and grads < 1e-10 and same, variant


# (sequence parallelism and common projections: against serial, test_t5_layouts_beyond_the_suite...)
LAYOUTS = [dict(mode="1d", tp=2), dict(mode="2d", tp=4), dict(mode="3d", tp=8), dict(mode="subgraph", tp=2, subgrids=2),
           dict(mode="subgraph", tp=2, subgrids=2, common="subgrid"), dict(mode="serial", dp=2)]
GENERATES = (dict(mode="2d", tp=4), dict(mode="3d", tp=8), dict(mode="subgraph", tp=2, subgrids=2, common="subgrid"),
             dict(mode="1d", tp=2))


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lo: "-".join(f"{k}={v}" for k, v in lo.items()))
def test_layout_equals_transformers(layout):
    """Catches a layout that splits the self- and cross-attention heads differently (a query
    head meeting another head's keys), the relative bias split otherwise than the heads or its
    gradient not summed over the ranks holding other sequences, cross-attention entering a
    sub-graph branch from the wrong stream (or D&SP-cSub's idle ranks sizing the memory by the
    target's length), a sequence-parallel gather of the memory over the wrong length, or the
    data-parallel path losing a gradient: every rank's loss and full gradients equal
    transformers' within 1e-10 for both variants, and the listed layouts' greedy tokens its."""
    world = lattice.context(**layout).world_size
    results = run_distributed(world, _equals_transformers, layout, layout in GENERATES)
    for result in results:
        for variant, (loss, grads, same_tokens) in result.items():
            assert loss < 1e-10 and grads < 1e-10, (variant, loss, grads)
            assert same_tokens in (None, True), variant
    for v in VARIANTS:
        print(f"{layout} {v}: loss {max(r[v][0] for r in results):.1e}, worst gradient "
              f"{max(r[v][1] for r in results):.1e}, generate equal {results[0][v][2]}")


def test_buckets_follow_the_t5_rule():
    """Catches a bucket rule that differs from T5's at a boundary: checked against the rule
    written out by hand for 32 buckets, max distance 128 (transformers' defaults) -- exact
    buckets below 8 (bidirectional: 8 each side, the far side offset by 16), then log-spaced
    ones, the farthest distances in the last bucket."""
    def by_hand(distance, bidirectional):
        side = 16 if bidirectional else 32
        base = side if bidirectional and distance > 0 else 0
        n = abs(distance) if bidirectional else max(0, -distance)
        exact = side // 2
        if n < exact:
            return base + n
        import math
        return base + min(side - 1, exact + int(math.log(n / exact) / math.log(128 / exact) * (side - exact)))

    for bidirectional in (True, False):
        got = relative_buckets(1, 400, 200, bidirectional=bidirectional, buckets=32, max_distance=128)[0]
        want = torch.tensor([by_hand(k - 200, bidirectional) for k in range(400)])
        assert torch.equal(got, want), bidirectional


def _refusals(layout: dict) -> list:
    """Each bad input on every rank: (message, elements sent before it)."""
    ctx = cached_init(**layout)
    cfg = T5Config(**BASE)
    model = lattice.build_model(cfg, ctx, dtype=torch.float64)
    src, labels = _pairs(1, batch=4)
    cases = {"long source": (torch.randint(0, 61, (4, 17)), labels),
             "long target": (src, torch.randint(0, 61, (4, 13))),
             "token outside the vocabulary": (src.masked_fill(src == src[0, 0], 61), labels),
             "label outside the vocabulary": (src, labels.masked_fill(labels == labels[0, 0], -5)),
             "targets for other sources": (src, labels[:2]),
             "odd target length": (src, labels[:, :5]),
             "logits of the start token alone": (src, None)}
    out = {}
    for name, (x, y) in cases.items():
        with lattice.CommMeter() as meter:
            try:
                model(x, y)
                out[name] = (None, meter.count())
            except lattice.LatticeConfigError as e:
                out[name] = (str(e), meter.count())
    return out


def test_bad_inputs_are_refused_in_one_line_on_every_rank():
    """Catches an input that reaches a kernel (an index error in the embedding, a shape error in
    cross-attention) or is refused on some ranks only (a hang): lengths beyond seq_len /
    target_len, ids outside the vocabulary, mismatched batches and, under sequence
    parallelism, a target length the ranks cannot split -- each one line on every rank before any
    collective."""
    results = run_distributed(2, _refusals, dict(mode="1d", tp=2, sequence_parallel=True))
    expected = {"long source": "seq_len = 16", "long target": "target_len = 12",
                "token outside the vocabulary": "outside the vocabulary [0, 61)",
                "label outside the vocabulary": "-100 marks an ignored label",
                "targets for other sources": "one target sequence per source",
                "odd target length": "sequence length = 5 is not divisible by tp = 2",
                "logits of the start token alone": "sequence length = 1 is not divisible by tp = 2"}
    for result in results:
        for name, fragment in expected.items():
            message, sent = result[name]
            assert message and fragment in message and "\n" not in message and sent == 0, (name, message, sent)


@pytest.mark.parametrize("change, layout, fragment", [
    (dict(n_heads=3), dict(mode="1d", tp=2), "n_heads = 3 is not divisible by tp = 2"),
    (dict(d_ff=42), dict(mode="3d", tp=8), "dimension 0 of size 42 does not divide into 4 shards"),
    (dict(n_decoder_layers=-1), dict(mode="serial"), "n_decoder_layers must be 0"),
    (dict(feed_forward_proj="swiglu"), dict(mode="serial"), "feed_forward_proj='swiglu' is not implemented"),
    (dict(eos_token_id=61), dict(mode="serial"), "eos_token_id = 61 is not a token of the vocabulary of 61")])
def test_bad_sizes_are_refused_in_one_line_before_anything_is_allocated(change, layout, fragment):
    """Catches a size that fails deep in a kernel instead of one line naming it: heads a layout
    cannot split, a feed-forward width the 3D cube cannot split (refused by the parameter's shard
    spec, naming the dimension and the divisor), and config values T5 cannot take."""
    with pytest.raises(lattice.LatticeConfigError, match=re.escape(fragment)) as e:
        with torch.device("meta"):
            lattice.build_model(T5Config(**{**BASE, **change}), lattice.context(**layout))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("layout", [dict(mode="1d", tp=2, pp=4, microbatches=4, pp_schedule="1f1b"),
                                    dict(mode="serial", pp=4, microbatches=4, pp_schedule="gpipe"),
                                    dict(mode="serial", pp=2, microbatches=2, pp_schedule="interleaved")],
                         ids=["1d-tp2-pp4-1f1b", "serial-pp4-gpipe", "serial-pp2-interleaved"])
def test_pipeline_stages_equal_serial_and_the_cost_model(layout):
    """Catches decoder stages without the encoder's output (or its gradient not carried back
    through every decoder stage to the encoder's), a stack's position bias or the token table
    trained on one stage only (the copies every stage holds must sum their gradients), the
    decoder's stream embedded on the wrong stage, a micro-batch's decoder input or padding mask
    given to another, and the cost model's point-to-point traffic for the two streams: with four
    stages (the encoder ending inside a stage in one test shape and at a stage's end in the
    other), loss, gradients, a step and its moments within 1e-10 of serial, and every metered
    collective equal to the cost model's. (pp = 2 runs in the conformance suite.)"""
    assert_layout_equals_serial("t5", layout)


def test_presets_build_on_meta_with_their_published_sizes():
    """Catches a preset whose shape is not the published model's: T5-Small 60.5 M, T5-Base 223 M,
    T5-Large 738 M parameters (transformers' T5ForConditionalGeneration of the published configs,
    which tie the head), T5 v1.1-Base 248 M (untied), built on the meta device."""
    expected = {"t5-small": 60.51e6, "t5-base": 222.9e6, "t5-large": 737.7e6, "t5-v1_1-base": 247.6e6}
    for preset, count in expected.items():
        with torch.device("meta"):
            model = lattice.build_model(T5Config.preset(preset), lattice.context("serial"))
        assert abs(model.num_parameters() - count) / count < 0.005, (preset, model.num_parameters())


def test_trains_evaluates_and_exports_from_the_command_line(tmp_path, capsys, monkeypatch):
    """Catches the seq2seq task and the encoder-decoder going wrong between the commands: a run
    whose printed exact match `lattice eval` does not reproduce (another validation set, another
    tokenizer or special-token ids), an HF export whose config loses the pad / start / end tokens
    or the untied head (transformers' own generate must give the tokens lattice's generate
    gives), or a generate that prints the start or end token."""
    import re

    from lattice.cli import main as cli

    monkeypatch.chdir(tmp_path)
    run = ["train", "--arch", "t5", "--model", "tiny", "--steps", "30", "--batch-size", "8", "--eval-interval", "30",
           "--eval-batches", "2", "--no-progress", "--out-dir", "run"]
    assert cli.main(run) == 0
    trained = re.search(r"val exact match: ([\d.]+) \(copying the source ([\d.]+)\)", capsys.readouterr().out)
    assert cli.main(["eval", "run"]) == 0
    evaluated = re.search(r"exact match ([\d.]+) \(copying the source ([\d.]+)\)", capsys.readouterr().out)
    assert trained and evaluated and trained.groups() == evaluated.groups()
    assert cli.main(["generate", "run", "--prompt", " the value of the attribute is", "--max-new-tokens", "6"]) == 0
    printed = capsys.readouterr().out.strip()
    assert cli.main(["convert", "run", "--to", "hf", "hf"]) == 0
    hf = transformers.T5ForConditionalGeneration.from_pretrained(tmp_path / "hf", local_files_only=True).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    ids = tokenizer(" the value of the attribute is", return_tensors="pt").input_ids
    out = hf.generate(ids, max_new_tokens=6, do_sample=False)
    assert out[0, 0] == hf.config.decoder_start_token_id == tokenizer.vocab_size  # [PAD] after the vocabulary
    assert printed == tokenizer.decode([t for t in out[0, 1:].tolist() if t < tokenizer.vocab_size])


@pytest.mark.parametrize("layout", [{"mode": "1d", "tp": 2, "sequence_parallel": True},
                                    {"mode": "subgraph", "tp": 2, "subgrids": 2, "common": "subgrid"},
                                    {"mode": "subgraph", "tp": 4, "subgrids": 2, "projections": "common",
                                     "slice_collective": "all_gather"}],
                         ids=["1d-sp", "subgraph-csub", "subgraph-common-projections"])
def test_t5_layouts_beyond_the_suite_equal_serial_and_their_cost_model(layout):
    """Catches cross-attention costed wrong where the layout copies what it reads: the memory
    gathered again by every decoder layer (sequence parallelism), split into the branches
    (D&SP-cSub, whose idle ranks hold none of it) or read by common projections -- against
    serial, with the cost model's bytes and activations, as the conformance suite checks."""
    from test_conformance import assert_layout_equals_serial

    assert_layout_equals_serial("t5", layout)


def test_an_hf_t5_with_transformers_default_ids_continues_on_pairs_and_data_parallel_weighs_its_replicas(
        tmp_path, capfd, monkeypatch):
    """Catches an imported T5 with transformers' ids (pad 0, eos 1) that --resume refused
    ("pad_token_id 0 vs 2048": the task appended its own [PAD] and [EOS] though the tokenizer has
    <pad> and </s>), the import's 512-token sources refused by the task (a resume trains on
    --seq-len batches up to the model's), and data parallelism averaging the replicas' means of
    padded targets (replicas with more padding would count as much): the same run on dp = 2
    prints dp = 1's losses."""
    import json
    import random

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from lattice.cli import main as cli

    monkeypatch.chdir(tmp_path)
    rng, words = random.Random(0), [f"w{i}" for i in range(40)]
    rows = [[rng.choice(words) for _ in range(rng.randint(2, 12))] for _ in range(200)]
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps({"src": " ".join(r), "tgt": " ".join(r[::-1])}) + "\n"
                                                  for r in rows))
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([" ".join(words)], trainers.WordLevelTrainer(special_tokens=["<pad>", "</s>", "<unk>"]))
    (tmp_path / "hf").mkdir()
    tok.save(str(tmp_path / "hf" / "tokenizer.json"))
    config = transformers.T5Config(vocab_size=tok.get_vocab_size(), d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                   num_heads=4, relative_attention_num_buckets=8)  # pad 0, eos 1, start 0
    torch.manual_seed(0)
    transformers.T5ForConditionalGeneration(config).save_pretrained(tmp_path / "hf")
    losses = []
    for dp in (1, 2):
        assert cli.main(["convert", "--from", "hf", "hf", f"run{dp}"]) == 0
        assert cli.main(["train", "--resume", f"run{dp}", "--data", "pairs.jsonl", "--data-format", "jsonl",
                         "--seq-len", "16", "--target-len", "16", "--steps", "2", "--batch-size", "8", "--eval-interval", "1",
                         "--eval-batches", "2", "--no-progress", "--allow-config-change", "--dtype", "float64", "--dp", str(dp), "--nproc",
                         str(dp)]) == 0
        out = capfd.readouterr().out
        assert "special tokens: <pad> 0, </s> 1 (the tokenizer's)" in out
        losses.append(re.findall(r"train loss ([\d.]+), val loss ([\d.]+)", out))
    assert losses[0] and losses[0] == losses[1], losses


@pytest.mark.parametrize("split", [["--pp", "2"], ["--cp", "2"]], ids=["pp", "cp"])
def test_the_train_command_with_stages_or_context_chunks_prints_serial_losses(split, tmp_path, capfd, monkeypatch):
    """Catches a T5 run with pp > 1 or cp > 1 that fails at its first validation (the exact match
    generates, which needs every stage and whole sequences) and so loses every step, or trains
    other weights than serial, and a bare --resume that does not continue the run as it was (it
    took the family's 2000 steps of 32 sequences and refused the change) or does not say where it
    starts: the split run's losses, then those of the run resumed in serial, equal the serial
    run's, the score left to `lattice eval`, which the run names and which refuses cp in one line."""
    from lattice.cli import main as cli

    monkeypatch.chdir(tmp_path)
    common = ["train", "--arch", "t5", "--model", "tiny", "--steps", "4", "--batch-size", "8", "--eval-batches", "1",
              "--seq-len", "16", "--target-len", "20",  # (each a multiple of 2·cp)
              "--eval-interval", "1", "--no-progress", "--dtype", "float64"]
    losses = re.compile(r"train loss ([\d.]+), val loss ([\d.]+)")
    assert cli.main(common + ["--out-dir", "serial"]) == 0
    serial = losses.findall(capfd.readouterr().out)
    assert cli.main(common + [*split, "--nproc", "2", "--stop-at", "2", "--out-dir", "split"]) == 0
    out = capfd.readouterr().out
    assert f"with {' '.join(split)} validation reports the loss only" in out and "`lattice eval split`" in out
    staged = losses.findall(out)
    assert cli.main(["train", "--resume", "split", "--no-progress"]) == 0  # as it was, but in serial
    out = capfd.readouterr().out
    assert "resuming from split/checkpoints/step-00000002 at step 2" in out
    resumed = losses.findall(out)
    assert len(serial) == 4 and serial == staged + resumed, (serial, staged, resumed)
    if split[0] == "--cp":
        assert cli.main(["eval", "split", "--cp", "2", "--nproc", "2"]) == 2
        err = capfd.readouterr().err
        assert err.count("\n") == 1 and "drop --cp 2" in err, err


def test_info_shows_which_stage_holds_which_stack(capsys):
    """Catches `lattice info` failing on an encoder-decoder's stages (it read `model.blocks`) or
    hiding where the encoder ends: the stage of the encoder's last block holds the modules
    between the stacks."""
    from lattice.cli import main as cli

    assert cli.main(["info", "--arch", "t5", "--model", "tiny", "--mode", "serial", "--pp", "4"]) == 0
    out = capsys.readouterr().out
    assert "stage 1: encoder 1-1, encoder_norm, encoder_out_drop, decoder_drop, decoder_bias; ranks [1]" in out
    assert "stage 3: decoder 1-1, decoder_norm, decoder_out_drop, head, loss; ranks [3]" in out
