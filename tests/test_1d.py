"""1D (Megatron) tensor parallelism, with and without sequence parallelism, against the serial model.

Every multi-process check builds its reference in the same process: a serial `lattice.GPT` with
perturbed weights (so that biases and LayerNorm weights are not trivially 0 / 1), run on the
whole global batch. Tiny models keep the suite fast on 2 cores.
"""

import pytest
import torch
import torch.distributed as dist
from multiproc import cached_init, run_distributed

import lattice
from lattice import GPT, GPTConfig, LatticeConfigError, MeshAxis

SIZES = dict(seq_len=8, d_model=16, n_heads=4, n_layers=2)
BATCH = 4  # global batch; each of dp replicas takes BATCH // dp rows
# (vocab size, tied embeddings, bias): 64 divides by 1, 2, 4; 61 divides by none of 2, 4
VARIANTS = ((64, True, True), (61, True, True), (61, False, False))


def _serial_reference(cfg, dtype, seed=1):
    model = GPT(cfg, lattice.context("serial"), dtype=dtype)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=gen, dtype=torch.float64).to(dtype))
    return model


def _batch(cfg, seed, batch=BATCH, seq=SIZES["seq_len"]):
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:].contiguous()


def _learnable_batch(cfg, seed, batch=BATCH, seq=SIZES["seq_len"]):
    """Sequences that count up by 7 from a random start: a bigram rule the model can learn."""
    gen = torch.Generator().manual_seed(seed)
    start = torch.randint(0, cfg.vocab_size, (batch, 1), generator=gen)
    tokens = (start + 7 * torch.arange(seq + 1)) % cfg.vocab_size
    return tokens[:, :-1], tokens[:, 1:].contiguous()


def _replica_rows(ctx, batch=BATCH):
    n = batch // ctx.dp
    d = ctx.coord(MeshAxis.DP)
    return slice(d * n, (d + 1) * n)


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-300)).item()


def _dp_mean(x, ctx):
    x = x.detach().clone()
    if ctx.group(MeshAxis.DP) is not None:
        dist.all_reduce(x, group=ctx.group(MeshAxis.DP))
        x /= ctx.dp
    return x


def _check_exact(tp, dp):
    """Float64: loss, every full gradient and full logits against serial, for every variant."""
    results = {}
    for sp in (False, True):
        ctx = cached_init(mode="1d", tp=tp, dp=dp, sequence_parallel=sp)
        for vocab, tied, bias in VARIANTS:
            cfg = GPTConfig(vocab_size=vocab, tie_embeddings=tied, bias=bias, **SIZES)
            serial = _serial_reference(cfg, torch.float64)
            tokens, targets = _batch(cfg, seed=vocab)
            ref_loss = serial(tokens, targets)
            ref_loss.backward()
            ref_grads = {n: p.grad for n, p in serial.named_parameters()}

            model = GPT(cfg, ctx, dtype=torch.float64)
            model.load_full_state_dict(serial.full_state_dict())
            rows = _replica_rows(ctx)
            loss = model(tokens[rows], targets[rows])
            loss.backward()
            grads = model.full_grad_dict()
            assert grads.keys() == ref_grads.keys()
            grad_rel = max(_rel(grads[n], ref_grads[n]) for n in ref_grads)
            loss_rel = _rel(_dp_mean(loss, ctx), ref_loss.detach())

            # the loss is identical (bit for bit) on every rank of a tensor-parallel group
            if tp > 1:
                tp_losses = [torch.empty_like(loss) for _ in range(tp)]
                dist.all_gather(tp_losses, loss.detach(), group=ctx.group(MeshAxis.TP))
                assert all(torch.equal(x, tp_losses[0]) for x in tp_losses)

            with torch.no_grad():
                logits = model(tokens[rows])
                ref_logits = serial(tokens[rows])
            assert logits.shape == (BATCH // dp, SIZES["seq_len"], vocab)
            logits_rel = _rel(logits, ref_logits)

            state = model.full_state_dict()  # the true vocabulary, not the padded one
            assert state["embed.wte"].shape == (vocab, SIZES["d_model"])
            assert torch.equal(state["embed.wte"], serial.embed.wte.detach())
            results[(sp, vocab, tied, bias)] = (loss_rel, grad_rel, logits_rel)
    return results


def _report_and_assert(results, layout):
    for (sp, vocab, tied, bias), (loss_rel, grad_rel, logits_rel) in results.items():
        print(f"{layout} sp={sp!s:5} V={vocab} tied={tied!s:5} bias={bias!s:5}: loss rel {loss_rel:.2e}, "
              f"max grad rel {grad_rel:.2e}, logits rel {logits_rel:.2e}")
        assert loss_rel < 1e-10 and grad_rel < 1e-10 and logits_rel < 1e-10, (layout, sp, vocab)


def test_exact_tp1_in_process():
    """Catches the 1d building blocks differing from serial even with nothing to communicate
    (e.g. a wrong split dim or a vocabulary mask that drops real tokens)."""
    _report_and_assert(_check_exact(1, 1), "tp=1")


# ----------------------------------------------------------------------------- training


# ----------------------------------------------------------------------------- communication


def expected_step_comm(b, s, h, v, p, n_layers, sp, bias):
    """{(phase, op): (calls, elements)} for one forward + backward of one replica's batch (b, s).

    Derived from the layout, not from a run. `elements` follows CommMeter (all-reduce: the tensor;
    all-gather: the gathered output; reduce-scatter: the full input), so each all-gather or
    reduce-scatter of the activation counts b·s·h, as an all-reduce does. Counted as:
    - each transformer layer: 2 collectives of b·s·h forward (g after attention proj and MLP proj)
      and 2 backward (f before qkv and fc); all-reduces, or reduce-scatter forward / all-gather
      backward for g and all-gather forward / reduce-scatter backward for f with sequence parallel;
    - embedding: its vocab-parallel sum, b·s·h forward (all-reduce, or reduce-scatter), plus
      with sequence parallel the all-gather of its backward;
    - LM head + loss: f on its input, b·s·h backward (all-reduce; with sequence parallel an
      all-gather forward and a reduce-scatter backward), and the vocab-parallel cross-entropy's
      two forward all-reduces: the row max (b·s) and [sum of exp, target logit] (2·b·s). The
      vocabulary size v appears nowhere: the logits are never communicated.
    - with sequence parallel only, the backward all-reduces that keep replicated vectors
      identical: wpe rows in use (s·h) inside autograd, and every LayerNorm's weight (and bias)
      and row-parallel bias together in one bucket after backward (GPT.sync_grads).
    With p = 1 nothing is communicated.
    """
    if p == 1:
        return {}
    act = b * s * h
    loss_ar = [(1, b * s), (1, 2 * b * s)]
    if not sp:
        return {("forward", "all_reduce"): _sum([(1, act)] + [(2 * n_layers, 2 * n_layers * act)] + loss_ar),
                ("backward", "all_reduce"): (2 * n_layers + 1, (2 * n_layers + 1) * act)}
    vectors = n_layers * (2 * (1 + bias) + 2 * bias) + (1 + bias)  # ln_1, ln_2, two proj biases; ln_f
    blocks = 2 * n_layers
    return {("forward", "reduce_scatter"): (1 + blocks, (1 + blocks) * act),   # embedding, g's
            ("forward", "all_gather"): (blocks + 1, (blocks + 1) * act),        # f's, LM head input
            ("forward", "all_reduce"): _sum(loss_ar),
            ("backward", "all_gather"): (1 + blocks, (1 + blocks) * act),
            ("backward", "reduce_scatter"): (blocks + 1, (blocks + 1) * act),
            ("backward", "all_reduce"): (2, s * h + vectors * h)}


def _sum(pairs):
    return sum(c for c, _ in pairs), sum(e for _, e in pairs)


def _check_comm(tp, dp, sp, bias, vocab):
    ctx = cached_init(mode="1d", tp=tp, dp=dp, sequence_parallel=sp)
    cfg = GPTConfig(vocab_size=vocab, bias=bias, **SIZES)
    model = GPT(cfg, ctx, dtype=torch.float32)
    tokens, targets = _batch(cfg, seed=5)
    rows = _replica_rows(ctx)
    with lattice.CommMeter() as meter:
        model.forward_backward(tokens[rows], targets[rows])
    measured = {}
    for (phase, op, group_size), rec in meter.summary().items():
        assert group_size == tp, f"{op} over {group_size} ranks: only the TP group may communicate"
        measured[(phase, op)] = (rec["calls"], rec["bytes"])
    b = BATCH // dp
    formula = expected_step_comm(b, SIZES["seq_len"], SIZES["d_model"], vocab, tp, SIZES["n_layers"], sp, bias)
    expected = {k: (calls, 4 * elements) for k, (calls, elements) in formula.items()}  # float32: 4 bytes
    return measured, expected, meter.total_bytes()


def _check_comm_on_4():
    out = {}
    for tp, dp in ((4, 1), (2, 2)):
        for sp in (False, True):
            for bias, vocab in ((True, 61), (False, 64)):
                out[(tp, dp, sp, bias, vocab)] = _check_comm(tp, dp, sp, bias, vocab)
    return out


def test_comm_bytes_per_step_match_the_formula():
    """Catches any extra, missing or oversized collective (e.g. gathering the full logits for the
    loss, an all-reduce where a reduce-scatter belongs, or gradient sync inside the model)."""
    results = run_distributed(4, _check_comm_on_4)
    for rank_result in results:
        for (tp, dp, sp, bias, vocab), (measured, expected, total) in rank_result.items():
            assert measured == expected, (tp, dp, sp, bias, vocab, measured, expected)
    for (tp, dp, sp, bias, vocab), (measured, expected, total) in results[0].items():
        print(f"tp={tp} dp={dp} sp={sp!s:5} bias={bias!s:5} V={vocab}: {total} bytes per step "
              f"(formula {sum(b for _, b in expected.values())})")


def test_tp1_communicates_nothing():
    """Catches a collective issued on a one-rank group (wasted work, and a hang risk)."""
    ctx = lattice.init("1d", tp=1, sequence_parallel=True)
    cfg = GPTConfig(vocab_size=61, **SIZES)
    model = GPT(cfg, ctx)
    tokens, targets = _batch(cfg, seed=0)
    with lattice.CommMeter() as meter:
        model(tokens, targets).backward()
    assert meter.count() == 0 and expected_step_comm(4, 8, 16, 61, 1, 2, True, True) == {}


# ----------------------------------------------------------------------------- layout, errors, dropout


def test_local_shapes_follow_the_megatron_layout():
    """Catches a column split on the wrong dim (q, k, v must each keep whole heads) or a vocabulary
    shard that is not padded to a multiple of p."""
    cfg = GPTConfig(vocab_size=61, **SIZES)
    h = cfg.d_model
    for rank in range(4):
        model = GPT(cfg, lattice.context("1d", tp=4, rank=rank))
        shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
        assert shapes["blocks.0.attn.qkv.weight"] == (h, 3, h // 4)
        assert shapes["blocks.0.attn.qkv.bias"] == (3, h // 4)
        assert shapes["blocks.0.attn.proj.weight"] == (h // 4, h)
        assert shapes["blocks.0.attn.proj.bias"] == (h,)
        assert shapes["blocks.0.mlp.fc.weight"] == (h, h)
        assert shapes["blocks.0.mlp.proj.weight"] == (h, h)
        assert shapes["embed.wte"] == (16, h)  # 61 padded to 64
    # rank 3 holds rows 48..63 of the padded table: 13 real rows, then 3 zero rows
    assert torch.count_nonzero(model.embed.wte[13:]) == 0
    assert torch.count_nonzero(model.embed.wte[:13]) == 13 * h


def _check_bad_sizes():
    messages = []
    ctx = cached_init(mode="1d", tp=4)
    with lattice.CommMeter() as meter:
        for d_model, n_heads in ((30, 6), (24, 6)):
            try:
                GPT(GPTConfig(vocab_size=64, seq_len=8, d_model=d_model, n_heads=n_heads, n_layers=1), ctx)
                messages.append(None)
            except LatticeConfigError as e:
                messages.append(str(e))
        model = GPT(GPTConfig(vocab_size=64, **SIZES), cached_init(mode="1d", tp=4, sequence_parallel=True))
        tokens = torch.zeros(2, 6, dtype=torch.int64)
        try:
            model(tokens, tokens)
            messages.append(None)
        except LatticeConfigError as e:
            messages.append(str(e))
    dist.barrier()  # every rank reaches this: none is left waiting inside a collective
    return messages, meter.count()


def test_sizes_that_do_not_divide_fail_on_every_rank_before_any_collective():
    """Catches a size check that only some ranks run (the others would hang in a collective)
    or that runs after communication has started."""
    results = run_distributed(4, _check_bad_sizes, timeout=60)
    for messages, collectives in results:
        assert collectives == 0
        hidden, heads, seq = messages
        assert hidden.startswith("d_model = 30 is not divisible by tp = 4"), hidden
        assert heads.startswith("n_heads = 6 is not divisible by tp = 4"), heads
        assert seq.startswith("sequence length = 6 is not divisible by tp = 4") and "sequence_parallel" in seq, seq
        assert all("\n" not in m for m in messages)
    with pytest.raises(LatticeConfigError, match="sequence_parallel must be True or False"):
        lattice.context("1d", tp=2, sequence_parallel="yes")


def _check_dropout(sp):
    ctx = cached_init(mode="1d", tp=2, dp=2, sequence_parallel=sp)
    cfg = GPTConfig(vocab_size=61, dropout=0.2, **SIZES)
    model = GPT(cfg, ctx)
    tokens, targets = _batch(cfg, seed=3, batch=2)  # the same batch on both replicas
    loss = model(tokens, targets)
    loss.backward()
    model.sync_grads()
    everyone = [torch.empty_like(loss) for _ in range(ctx.world_size)]
    dist.all_gather(everyone, loss.detach())
    replicated = {}
    for name, p in model.named_parameters():
        if not model.specs[name].splits:
            grads = [torch.empty_like(p) for _ in range(2)]
            dist.all_gather(grads, p.grad, group=ctx.group(MeshAxis.TP))
            replicated[name] = torch.equal(grads[0], grads[1])
    return [x.item() for x in everyone], replicated


def test_dropout_streams_per_region():
    """Catches the replicated residual drawing different masks on tensor-parallel ranks (their
    copies then disagree), replicated-parameter gradients left partial under sequence parallel,
    and data-parallel replicas drawing the same masks."""
    for sp in (False, True):
        results = run_distributed(4, _check_dropout, sp)
        losses, replicated = results[0]
        assert losses[0] == losses[1] and losses[2] == losses[3], losses  # one TP group, one loss
        assert losses[0] != losses[2], losses  # dp replicas, same batch: different masks
        for _, rank_replicated in results:
            assert all(rank_replicated.values()), rank_replicated


def test_vocab_parallel_loss_equals_pytorch_and_refuses_a_second_backward():
    """Catches the loss kernel's backward, which overwrites its saved softmax in place, going
    wrong: on one rank its loss and the logits' gradient equal F.cross_entropy's, with an ignored
    target and two padding columns past the vocabulary (gradient 0 there), and a second backward
    through the same graph raises instead of returning a gradient of the overwritten softmax."""
    import torch.nn.functional as F

    from lattice.modes.kernels.loss import IGNORE_INDEX, vocab_parallel_cross_entropy

    gen = torch.Generator().manual_seed(0)
    z = torch.randn(6, 10, dtype=torch.float64, generator=gen, requires_grad=True)
    targets = torch.tensor([1, 2, 7, IGNORE_INDEX, 0, 5])
    loss = vocab_parallel_cross_entropy(z * 1.0, targets, None, 0, 8)  # columns 8 and 9: padding
    want = F.cross_entropy(z[:, :8], targets, reduction="none", ignore_index=IGNORE_INDEX)
    torch.testing.assert_close(loss, want)
    (grad,) = torch.autograd.grad(loss.sum(), z, retain_graph=True)
    (want_grad,) = torch.autograd.grad(want.sum(), z)
    torch.testing.assert_close(grad, want_grad)
    assert grad[:, 8:].abs().max() == 0
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        torch.autograd.grad(loss.sum(), z)


def test_the_loss_overwrites_only_logits_handed_over_to_it():
    """Catches the loss's in-place z - m reaching logits a caller still holds, or the owned path
    (logits made for the loss alone, overwritten) scoring differently: without padding columns,
    logits not handed over are unchanged, and handed over the loss and the gradient reaching the
    weight through them equal F.cross_entropy's, while their values are gone."""
    import torch.nn.functional as F

    from lattice.modes.kernels.loss import vocab_parallel_cross_entropy

    gen = torch.Generator().manual_seed(1)
    x, w = torch.randn(6, 4, dtype=torch.float64, generator=gen), torch.randn(8, 4, dtype=torch.float64, generator=gen)
    w.requires_grad_(True)
    targets = torch.tensor([1, 2, 7, 3, 0, 5])
    want = F.cross_entropy(x @ w.t(), targets, reduction="none")
    (want_grad,) = torch.autograd.grad(want.sum(), w)
    held = (x @ w.t()).detach()
    kept = held.clone()
    vocab_parallel_cross_entropy(held, targets, None, 0, 8)
    assert torch.equal(held, kept)
    logits = x @ w.t()
    loss = vocab_parallel_cross_entropy(logits, targets, None, 0, 8, owned=True)
    torch.testing.assert_close(loss, want)
    torch.testing.assert_close(torch.autograd.grad(loss.sum(), w)[0], want_grad)
    assert not torch.equal(logits.detach(), kept)
