"""3D (load-balanced cube) mode beyond the conformance suite: the
exact bytes of a step against the algorithm's formula, memory per rank beside 1d and 2d, bf16,
and bad sizes. Exactness in float64 (bias/tied variants, padded vocabulary, checkpointing) is the
conformance suite's (tests/test_conformance.py), which runs 3d at q = 2 on 8 processes.
"""

import pytest
import torch
import torch.distributed as dist
from multiproc import cached_init, run_distributed
from numerics import random_batch as _batch

import lattice
from lattice import LatticeConfigError
from lattice.bench.measure import saved_activation_bytes

CFG = dict(vocab_size=61, seq_len=16, d_model=32, n_heads=4, n_layers=2)


def step_bytes(B, T, h, V, L, q, bias, ckpt, itemsize=4, keep=False, replicated=False, table_rows=CFG["seq_len"]):
    """Bytes CommMeter counts on a rank for one forward + backward, worked out from the algorithm
    (docs/references.md#3d), per collective kind. Per linear X [M, N] W [N, K] (M = B·T): forward
    all-gathers of X (M·N/q² gathered) and W (N·K/q²) and a reduce-scatter of Y (M·K/q²);
    backward all-gathers dY, X, W again and reduce-scatters dX and dW. The four linears of a layer
    have N, K = (h, 3h), (h, h), (h, 4h), (4h, h); the head is X Eᵀ with K = V' (V padded to
    q²); the embedding all-gathers table pieces (V'·h/q²) and reduce-scatters rows (M·h/q²),
    backward the reverse. Vectors: a LayerNorm's weight (and bias) of h/q, the biases of K/q, wpe
    of T·h/q, each broadcast forward and reduced backward. LayerNorm: (Σx, Σx²) of M/q² tokens
    all-reduced forward and backward. Loss: max and (Σe^x, target) of M/q² tokens, and the mean.
    With checkpointing every forward collective of a layer runs once more in backward. With
    `keep` (keep_gathered) backward uses the X and W forward gathered: no all-gathers but dY's. With
    `replicated` vectors no broadcast or reduce: every vector's gradient (the whole position table
    of `table_rows` rows) is all-reduced over its plane after backward."""
    M, Vp = B * T, -(-V // (q * q)) * (q * q)
    out = {}

    def add(phase, op, elements, times=1, size=itemsize):
        if replicated and op in ("broadcast", "reduce"):  # a hosted vector's (replicated: summed below)
            return
        out[(phase, op)] = out.get((phase, op), 0) + elements * times * size

    if replicated:  # per layer two LayerNorms and four biases; the final LayerNorm; the position table
        vectors = L * (2 * (2 if bias else 1) * h + (9 * h if bias else 0)) + (2 if bias else 1) * h + table_rows * h
        add("backward", "all_reduce", vectors / q)

    layer_fwd = []
    for N, K in ((h, 3 * h), (h, h), (h, 4 * h), (4 * h, h)):
        layer_fwd += [("all_gather", M * N / q ** 2), ("all_gather", N * K / q ** 2), ("reduce_scatter", M * K / q ** 2)]
        for op, e in (("all_gather", M * K / q ** 2), ("all_gather", 0 if keep else M * N / q ** 2),
                      ("all_gather", 0 if keep else N * K / q ** 2), ("reduce_scatter", M * N / q ** 2),
                      ("reduce_scatter", N * K / q ** 2)):
            add("backward", op, e, L)
        if bias:
            layer_fwd.append(("broadcast", K / q))
            add("backward", "reduce", K / q, L)
    vec = 2 if bias else 1
    for _ in range(2):
        layer_fwd += [("broadcast", vec * h / q), ("all_reduce", 2 * M / q ** 2)]
        add("backward", "reduce", vec * h / q, L)
        add("backward", "all_reduce", 2 * M / q ** 2, L)
    for op, e in layer_fwd:
        add("forward", op, e, L)
        if ckpt:
            add("backward", op, e, L)
    # embedding, position table, final LayerNorm, head, loss
    add("forward", "all_gather", Vp * h / q ** 2)
    add("forward", "reduce_scatter", M * h / q ** 2)
    add("backward", "all_gather", M * h / q ** 2)
    add("backward", "reduce_scatter", Vp * h / q ** 2)
    add("forward", "broadcast", T * h / q + vec * h / q)
    add("backward", "reduce", T * h / q + vec * h / q)
    add("forward", "all_reduce", 2 * M / q ** 2)
    add("backward", "all_reduce", 2 * M / q ** 2)
    for op, e in (("all_gather", M * h / q ** 2), ("all_gather", Vp * h / q ** 2), ("reduce_scatter", M * Vp / q ** 2)):
        add("forward", op, e)
    for op, e in (("all_gather", M * Vp / q ** 2), ("all_gather", 0 if keep else M * h / q ** 2),
                  ("all_gather", 0 if keep else Vp * h / q ** 2), ("reduce_scatter", M * h / q ** 2),
                  ("reduce_scatter", Vp * h / q ** 2)):
        add("backward", op, e)
    add("forward", "all_reduce", 3 * M / q ** 2 + 1)
    return out


def _check_comm():
    out = []
    for keep, vectors in ((False, "hosted"), (True, "hosted"), (False, "replicated")):
        ctx = cached_init(mode="3d", tp=8, keep_gathered=keep, vectors=vectors)
        for bias in (True, False):
            for ckpt in (False, True):
                cfg = lattice.GPTConfig(**{**CFG, "bias": bias})
                model = lattice.GPT(cfg, ctx, activation_checkpointing=ckpt)
                tokens, targets = _batch(8, 12, cfg.vocab_size, seed=1)
                with lattice.CommMeter() as meter:
                    model.forward_backward(tokens, targets)
                measured = {}
                for (phase, op, _), rec in meter.summary().items():
                    measured[(phase, op)] = measured.get((phase, op), 0) + rec["bytes"]
                measured = {k: v for k, v in measured.items() if v}
                expected = step_bytes(8, 12, 32, 61, 2, 2, bias, ckpt, keep=keep, replicated=vectors == "replicated")
                out.append((bias, ckpt, f"keep_gathered={keep!s:5} vectors={vectors}", measured,
                            {k: v for k, v in expected.items() if v}))
    return out


def test_comm_bytes_per_step_match_the_formula():
    """Catches a gathered operand of the wrong size (a q-fold copy instead of a piece), a missing
    re-gather in backward (or, with keep_gathered, one left in), vectors broadcast over the wrong
    plane, and recomputation that skips or doubles collectives, on every rank."""
    results = run_distributed(8, _check_comm)
    for rank, rank_result in enumerate(results):
        for bias, ckpt, keep, measured, expected in rank_result:
            assert measured == pytest.approx(expected), (rank, bias, ckpt, keep, measured, expected)
    for bias, ckpt, keep, measured, _ in results[0]:
        print(f"3d q=2 bias={bias!s:5} checkpointing={ckpt!s:5} {keep}: "
              f"{sum(measured.values()):,.0f} bytes per step per rank")


MEMORY_CFG = dict(vocab_size=64, seq_len=8, d_model=128, n_heads=8, n_layers=2)


def _check_memory(modes=("3d", "1d"), tp=8):
    """(parameter bytes, saved activation bytes) of this rank in each mode on tp ranks; 2d and 3d
    without keep_gathered (which keeps the q-fold gathered operands by choice)."""
    cfg = lattice.GPTConfig(**MEMORY_CFG)
    tokens, targets = _batch(4, 8, cfg.vocab_size, seed=9)
    out = []
    for mode in modes:
        lean = {"keep_gathered": False} if mode in ("2d", "3d") else {}
        model = lattice.GPT(cfg, cached_init(mode=mode, tp=tp, **lean))
        out.append((sum(p.numel() * p.element_size() for p in model.parameters()),
                    saved_activation_bytes(model, lambda: model(tokens, targets))))
    return out


def test_parameters_and_activations_per_rank_are_a_pth_of_serial():
    """Catches a layout that keeps gathered (q-fold) operands for backward or replicates a weight:
    per rank, parameters and saved activations at most 1.15 x serial / p (printed beside 1d at
    p = 8 and 2d at p = 4 on the same model)."""
    cfg = lattice.GPTConfig(**MEMORY_CFG)
    serial = lattice.GPT(cfg, lattice.context("serial"))
    tokens, targets = _batch(4, 8, cfg.vocab_size, seed=9)
    serial_saved = saved_activation_bytes(serial, lambda: serial(tokens, targets))
    serial_params = sum(p.numel() * p.element_size() for p in serial.parameters())
    results = run_distributed(8, _check_memory)
    params, saved = (max(r[0][k] for r in results) for k in (0, 1))
    params1, saved1 = (max(r[1][k] for r in results) for k in (0, 1))
    params2, saved2 = (max(r[0][k] for r in run_distributed(4, _check_memory, ("2d",), 4)) for k in (0, 1))
    print(f"per rank, x serial/p: parameters 3d (p=8) {params / (serial_params / 8):.3f}, 1d (p=8) "
          f"{params1 / (serial_params / 8):.3f}, 2d (p=4) {params2 / (serial_params / 4):.3f}; saved activations 3d "
          f"{saved / (serial_saved / 8):.3f}, 1d {saved1 / (serial_saved / 8):.3f}, 2d {saved2 / (serial_saved / 4):.3f}")
    assert params <= 1.15 * serial_params / 8
    assert saved <= 1.15 * serial_saved / 8


def _check_bf16():
    ctx = cached_init(mode="3d", tp=8)
    cfg = lattice.GPTConfig(**CFG)
    serial = lattice.GPT(cfg, lattice.context("serial"))
    model = lattice.GPT(cfg, ctx)
    model.load_full_state_dict(serial.full_state_dict())
    tokens, targets = _batch(4, 16, cfg.vocab_size, seed=5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = serial(tokens, targets).item()
        loss = model.forward_backward(tokens, targets)
    grads = model.full_grad_dict()
    return loss, ref, all(torch.isfinite(g).all() for g in grads.values())


def test_bf16_autocast_matches_serial_closely():
    """Catches collectives of mixed dtypes under autocast (a hang or a crash on gloo) and a loss
    computed in bf16 instead of float32."""
    results = run_distributed(8, _check_bf16)
    for loss, ref, finite in results:
        assert finite and loss == results[0][0] and abs(loss - ref) < 2e-2 * abs(ref), (loss, ref)


def _check_bad_sizes():
    ctx = cached_init(mode="3d", tp=8)
    messages = []
    with lattice.CommMeter() as meter:
        for d_model, n_heads in ((30, 6), (24, 3)):
            try:
                lattice.GPT(lattice.GPTConfig(vocab_size=61, seq_len=8, d_model=d_model, n_heads=n_heads, n_layers=1), ctx)
                messages.append(None)
            except LatticeConfigError as e:
                messages.append(str(e))
        model = lattice.GPT(lattice.GPTConfig(**CFG), ctx)
        try:
            model(*_batch(6, 8, 61, seed=0))
            messages.append(None)
        except LatticeConfigError as e:
            messages.append(str(e))
    dist.barrier()  # nobody was left inside a collective
    return messages, meter.count()


def test_sizes_the_cube_does_not_divide_fail_on_every_rank_before_any_collective():
    """Catches a size error raised on some ranks only (a hang), or after a collective."""
    for messages, sent in run_distributed(8, _check_bad_sizes):
        assert sent == 0
        assert messages[0].startswith("d_model = 30 is not divisible by q² (the 3D cube side squared) = 4")
        assert messages[1].startswith("n_heads = 3 is not divisible by the 3D cube side q = 2")
        assert "give each replica a multiple of 4 sequences (for example 4 or 8)" in messages[2]
    with pytest.raises(LatticeConfigError, match=r"tp=9 is not such a cube: use tp=8 \(q=2\) or tp=27 \(q=3\)"):
        lattice.context("3d", tp=9)
