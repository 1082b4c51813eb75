"""2D (SUMMA / Optimus) mode against serial: exact losses and gradients, training, communication
volume against the paper's Table 1, activation memory, placement and bad-input errors.

Multi-process checks run on gloo with tiny models (2 shared CPU cores); each world size starts
once per session and runs several configurations.
"""

import math

import pytest
import torch
import torch.distributed as dist
from multiproc import cached_init, run_distributed
from numerics import random_batch as _batch
from numerics import rel_diff as _rel

import lattice
from lattice import LatticeConfigError, MeshAxis
from lattice.modes import get_mode

# vocabulary 29 is padded to 30 (q = 2, 3); T = 7 < seq_len exercises the position-table slice
TINY = dict(vocab_size=29, seq_len=8, d_model=12, n_heads=6, n_layers=2)
VARIANTS = [dict(bias=True, tie_embeddings=True), dict(bias=False, tie_embeddings=False)]


def _serial(cfg, dtype=torch.float64):
    return lattice.GPT(cfg, lattice.context("serial"), dtype=dtype)


def _serial_loss_and_grads(serial, tokens, targets):
    serial.zero_grad()
    loss = serial(tokens, targets)
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in serial.named_parameters()}


def _check_equals_serial(q: int, dp: int, batch: int, layouts: list[dict]) -> list[dict]:
    """Float64: for each model variant, layout and checkpointing on/off, the 2D loss (per replica)
    and every full gradient against the serial model on the same weights and batch."""
    out = []
    for variant in VARIANTS:
        cfg = lattice.GPTConfig(**TINY, **variant)
        serial = _serial(cfg)
        weights = serial.full_state_dict()
        tokens, targets = _batch(batch * dp, 7, cfg.vocab_size, seed=q * 10 + dp)
        ref_loss, ref_grads = _serial_loss_and_grads(serial, tokens, targets)
        for layout in layouts:
            ctx = cached_init(mode="2d", tp=q * q, dp=dp, **layout)
            d = ctx.coord(MeshAxis.DP)
            mine = slice(d * batch, (d + 1) * batch)
            replica_loss = (serial(tokens[mine], targets[mine]).item() if dp > 1 else ref_loss)
            for ckpt in (False, True):
                model = lattice.GPT(cfg, ctx, dtype=torch.float64, activation_checkpointing=ckpt)
                model.load_full_state_dict(weights)
                loss = model(tokens[mine], targets[mine])
                loss.backward()
                if dp > 1:  # data-parallel sync by hand: average local gradients over the replicas
                    for p in model.parameters():
                        dist.all_reduce(p.grad, group=ctx.group(MeshAxis.DP))
                        p.grad /= dp
                grads = model.full_grad_dict()
                assert grads.keys() == ref_grads.keys()
                out.append(dict(variant=variant, layout=layout, ckpt=ckpt,
                                loss_rel=abs(loss.item() - replica_loss) / abs(replica_loss),
                                grad_rel=max(_rel(grads[n], ref_grads[n]) for n in ref_grads),
                                loss=loss.item(), dp=d))
        if dp == 1:  # gathered logits (inference path) against serial
            model.eval()
            with torch.no_grad():
                full = model(tokens)
                assert full.shape == (batch, 7, cfg.vocab_size)
                assert _rel(full, serial(tokens).detach()) < 1e-12
    return out


def _assert_exact(results, world):
    for k, first in enumerate(results[0]):
        loss_rel = max(r[k]["loss_rel"] for r in results)
        grad_rel = max(r[k]["grad_rel"] for r in results)
        print(f"{world} processes {first['variant']} {first['layout'] or 'natural'} ckpt={first['ckpt']}: "
              f"loss rel err {loss_rel:.2e}, max grad rel err {grad_rel:.2e} (worst rank)")
        assert loss_rel < 1e-10 and grad_rel < 1e-10, first
    # the loss is identical (bitwise) on every rank of a replica
    for k in range(len(results[0])):
        by_replica = {}
        for rank_results in results:
            by_replica.setdefault(rank_results[k]["dp"], set()).add(rank_results[k]["loss"])
        assert all(len(v) == 1 for v in by_replica.values()), by_replica


def test_q3_loss_and_gradients_equal_serial_float64():
    """q=3 on 9 processes: catches code that only works for q=2 (e.g. two-step SUMMA loops,
    source ranks hard-wired to the diagonal, padded vocabulary blocks)."""
    _assert_exact(run_distributed(9, _check_equals_serial, 3, 1, 6, [{}]), 9)


# ----------------------------------------------------------------------------- SUMMA products


def _check_summa_products(q: int):
    """Each SUMMA form against torch.matmul on the full matrices, forward and backward."""
    from lattice.modes.kernels.summa import SummaGrid, summa_ab, summa_abt, summa_atb

    ctx = cached_init(mode="2d", tp=q * q)
    gen = torch.Generator().manual_seed(1)
    M, K, N = 4 * q, 3 * q, 2 * q
    cases = {"ab": (summa_ab, (M, K), (K, N), lambda a, b: a @ b),
             "abt": (summa_abt, (M, K), (N, K), lambda a, b: a @ b.t()),
             "atb": (summa_atb, (M, K), (M, N), lambda a, b: a.t() @ b)}
    grids = [SummaGrid(ctx), SummaGrid(ctx, gathered=True), SummaGrid(ctx, gathered=True, keep=True)]
    for (name, (fn, sa, sb, ref)), grid in ((case, g) for case in cases.items() for g in grids):
        name = f"{name} gathered={grid.gathered} keep={grid.keep}"
        a = torch.randn(sa, generator=gen, dtype=torch.float64, requires_grad=True)
        b = torch.randn(sb, generator=gen, dtype=torch.float64, requires_grad=True)
        c = ref(a, b)
        dc = torch.randn(c.shape, generator=gen, dtype=torch.float64)
        c.backward(dc)

        def block(t):
            r, s = t.shape[0] // q, t.shape[1] // q
            return t.detach()[grid.i * r:(grid.i + 1) * r, grid.j * s:(grid.j + 1) * s].clone()

        a_blk, b_blk = block(a).requires_grad_(True), block(b).requires_grad_(True)
        c_blk = fn(a_blk, b_blk, grid)
        c_blk.backward(block(dc))
        assert torch.allclose(c_blk, block(c), rtol=1e-12, atol=1e-12), name
        assert torch.allclose(a_blk.grad, block(a.grad), rtol=1e-12, atol=1e-12), name
        assert torch.allclose(b_blk.grad, block(b.grad), rtol=1e-12, atol=1e-12), name
    for grid in grids:  # a fused weight's column segments, each split in q x q blocks of its own
        a = torch.randn(M, K, generator=gen, dtype=torch.float64, requires_grad=True)
        bs = [torch.randn(K, N, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(2)]
        dcs = [torch.randn(M, N, generator=gen, dtype=torch.float64) for _ in bs]
        sum(((a @ b) * dc).sum() for b, dc in zip(bs, dcs)).backward()
        a_blk, b_blks = block(a).requires_grad_(True), [block(b).requires_grad_(True) for b in bs]
        c_blk = summa_ab(a_blk, tuple(b_blks), grid)
        c_blk.backward(torch.cat([block(dc) for dc in dcs], 1))
        expect = torch.cat([block(a.detach() @ b.detach()) for b in bs], 1)
        name = f"segments gathered={grid.gathered} keep={grid.keep}"
        assert torch.allclose(c_blk, expect, rtol=1e-12, atol=1e-12), name
        assert torch.allclose(a_blk.grad, block(a.grad), rtol=1e-12, atol=1e-12), name
        assert all(torch.allclose(mine.grad, block(b.grad), rtol=1e-12, atol=1e-12) for mine, b in zip(b_blks, bs)), name
    return True


@pytest.mark.parametrize("world", [4, 9])
def test_summa_products_and_their_gradients(world):
    """C=AB, C=ABᵀ, C=AᵀB block by block against full matmuls, with gradients, in the broadcast and
    all-gather forms and with the gathered operands kept: catches a wrong broadcast source, a
    reduce to the wrong rank, a backward that uses the wrong form (Eq. 1-3) or a kept operand
    reduce-scattered along the wrong axis."""
    assert all(run_distributed(world, _check_summa_products, math.isqrt(world)))


# ----------------------------------------------------------------------------- training


def _train_2d(cfg_kwargs, steps, lr, batch, seed):
    ctx = cached_init(mode="2d", tp=4)
    cfg = lattice.GPTConfig(**cfg_kwargs)
    model = lattice.GPT(cfg, ctx)
    model.load_full_state_dict(_serial(cfg, torch.float32).full_state_dict())
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        tokens, targets = _batch(batch, cfg.seq_len, cfg.vocab_size, seed + step % 2)
        loss = model(tokens, targets)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, model.mode.grid.workspace.allocations


def test_the_summa_workspace_is_allocated_once():
    """Catches a SUMMA workspace that is reallocated on every step (memory churn the benchmarks
    would not show as an error): three AdamW steps at q = 2, one allocation. (The 30-step
    trajectory against serial is the conformance suite's.)"""
    cfg_kwargs = dict(vocab_size=32, seq_len=8, d_model=16, n_heads=4, n_layers=2)
    per_rank = run_distributed(4, _train_2d, cfg_kwargs, 3, 3e-3, 4, 100)
    assert [allocations for _, allocations in per_rank] == [1] * 4


def _check_bf16_autocast():
    cfg = lattice.GPTConfig(**TINY)
    serial = _serial(cfg, torch.float32)
    model = lattice.GPT(cfg, cached_init(mode="2d", tp=4), activation_checkpointing=True)
    model.load_full_state_dict(serial.full_state_dict())
    tokens, targets = _batch(4, 7, cfg.vocab_size, seed=3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = serial(tokens, targets)
        loss = model(tokens, targets)
    loss.backward()
    ref.backward()
    grads = model.full_grad_dict()
    return abs(loss.item() - ref.item()), max(_rel(grads[n], p.grad) for n, p in serial.named_parameters())


def test_bf16_autocast_runs_and_tracks_serial():
    """Under bf16 autocast (fp32 parameters) with checkpointing: row-0 broadcasts and SUMMA blocks
    must agree on a dtype on every rank (a mismatch aborts gloo with a size error). Loss and
    gradients track the serial model under the same autocast to bf16 precision."""
    results = run_distributed(4, _check_bf16_autocast)
    loss_diff, grad_rel = max(r[0] for r in results), max(r[1] for r in results)
    print(f"bf16 autocast q=2: |loss diff| {loss_diff:.2e}, max grad rel err {grad_rel:.2e}")
    assert loss_diff < 2e-2 and grad_rel < 0.1


# ----------------------------------------------------------------------------- communication


def table1_optimus(b: int, s: int, h: int, p: int) -> tuple[float, float]:
    """Optimus column of the paper's Table 1, per transformer layer: forward and backward
    communication in scalars; the backward assumes activation checkpointing (one forward is
    recomputed inside it)."""
    f = math.log2(p) / (2 * math.sqrt(p))
    return f * (7 * b * s * h + 12 * h * h), f * (21 * b * s * h + 36 * h * h)


def expected_step_elements(b, s, h, v, q, n_layers, ckpt) -> dict:
    """Elements CommMeter counts on each rank in one forward + backward of the 2D GPT (biases,
    tied embeddings, dp = 1), by (phase, op); every collective runs in a group of q ranks.

    - Transformer layers, SUMMA products (Table 1): CommMeter counts each call's buffer, while
      Table 1 charges log2 q per scalar for a tree broadcast / reduce in a group of q (Eq. 4), so
      the count is Table 1 / log2 q. Forward: broadcasts only. Table 1's backward includes a
      recomputed forward (broadcasts); the rest is dA = dC Bᵀ and dB = Aᵀ dC, which move as much
      by broadcast (weight blocks, activation blocks) as by reduce (partial products).
    - Row-0 vectors (Fig. 5), per layer: two LayerNorms (weight, bias: 4·h/q) and the biases of
      qkv, proj, fc, proj (3h/q + h/q + 4h/q + h/q); final LayerNorm 2·h/q. Broadcast forward,
      reduced backward (and broadcast again when a checkpointed layer is recomputed).
    - LayerNorm statistics (§3.2.2): all-reduce of (Σx, Σx²) forward and of (Σg, Σg·x̂) backward,
      2 values per token of this rank (b·s/q tokens); 2 per layer and the final one.
    - Embedding (onehot [bs, V] x table [V, h] in SUMMA form, the onehot block is local): forward
      broadcast of the table blocks (V·h/q) and of the position rows (s·h/q); backward reduce of both.
    - LM head C = X Eᵀ (X [bs, h], E [V, h]): forward broadcast of E (V·h/q) and reduce of the
      partial logits (bs·V/q); backward dX = dC E broadcasts dC (bs·V/q) and E (V·h/q), dE = dCᵀ X
      broadcasts dC (bs·V/q) and reduces dE (V·h/q).
    - Cross-entropy: all-reduce along the row of the per-token max (bs/q) and of (Σe^x, x_target)
      (2·bs/q), and of the loss along the column (1 value); its backward is local.
    """
    p, m, hq = q * q, b * s // q, h // q
    fwd_layer, bwd_layer = (x / math.log2(q) for x in table1_optimus(b, s, h, p))
    assert abs(fwd_layer - round(fwd_layer)) < 1e-6 and abs(bwd_layer - round(bwd_layer)) < 1e-6
    fwd_layer, bwd_layer = round(fwd_layer), round(bwd_layer)
    proper_bwd = bwd_layer - fwd_layer
    vectors, stats = 13 * hq, 2 * 2 * m  # per layer
    e = {("forward", "broadcast"): n_layers * (fwd_layer + vectors) + 2 * hq + v * hq + s * hq + v * hq,
         ("forward", "reduce"): b * s * v // q,
         ("forward", "all_reduce"): n_layers * stats + 2 * m + m + 2 * m + 1,
         ("backward", "broadcast"): n_layers * proper_bwd // 2 + 2 * (b * s * v // q) + v * hq,
         ("backward", "reduce"): n_layers * (proper_bwd // 2 + vectors) + 2 * hq + v * hq + s * hq + v * hq,
         ("backward", "all_reduce"): n_layers * stats + 2 * m}
    if ckpt:
        e[("backward", "broadcast")] += n_layers * (fwd_layer + vectors)
        e[("backward", "all_reduce")] += n_layers * stats
    return e


def _check_comm_volume(q: int, batch: int, ckpts):
    cfg = lattice.GPTConfig(**TINY)
    ctx = cached_init(mode="2d", tp=q * q, **get_mode("2d").paper_options)  # the form Table 1 counts
    tokens, targets = _batch(batch, 7, cfg.vocab_size, seed=5)
    out = []
    for ckpt in ckpts:
        model = lattice.GPT(cfg, ctx, dtype=torch.float64, activation_checkpointing=ckpt)
        for step in range(2):  # the second step shows a steady state (no extra traffic, no growth)
            with lattice.CommMeter() as meter:
                model(tokens, targets).backward()
        counted = {}
        for (phase, op, size), rec in meter.summary().items():
            assert size == q, (phase, op, size)
            counted[(phase, op)] = counted.get((phase, op), 0) + rec["elements"]
        ws = model.mode.grid.workspace
        out.append(dict(ckpt=ckpt, counted=counted, bytes=meter.total_bytes(),
                        bytes_by_phase={ph: meter.total_bytes(phase=ph) for ph in ("forward", "backward")},
                        allocations=ws.allocations, step_numel=ws.step_numel))
    return out


def _largest_summa_step(b, s, h, v, q):
    """Elements of the two workspace blocks of the largest SUMMA step: a product of A [M, K] and
    B [K, N] (any form) holds one (M/q, K/q) block and one (K/q, N/q) block."""
    m = b * s // q
    products = [(h, 3 * h), (h, h), (h, 4 * h), (4 * h, h), (v, h)]  # qkv, proj, fc, proj; LM head (K = V)
    return max(m * k // q + k * n // q ** 2 for k, n in products)


@pytest.mark.parametrize("world,batch,ckpts", [(4, 4, (False, True)), (9, 6, (False, True))])
def test_comm_bytes_per_step_match_table1(world, batch, ckpts):
    """Exact CommMeter bytes per step against Table 1 plus the itemised non-SUMMA terms. Catches
    redundant or missing collectives (e.g. re-broadcasting a block, reducing with all-reduce,
    gathering logits for the loss) and a workspace that is not sized for the largest step."""
    q = math.isqrt(world)
    cfg = lattice.GPTConfig(**TINY)
    v_pad = -(-cfg.vocab_size // q) * q
    results = run_distributed(world, _check_comm_volume, q, batch, ckpts)
    for rank_results in results:
        for r in rank_results:
            want = expected_step_elements(batch, 7, cfg.d_model, v_pad, q, cfg.n_layers, r["ckpt"])
            assert r["counted"] == want, (r["ckpt"], r["counted"], want)
            assert r["bytes"] == 8 * sum(want.values())
            assert r["allocations"] == 1
            assert r["step_numel"] == _largest_summa_step(batch, 7, cfg.d_model, v_pad, q)
    r0 = results[0]
    for r in r0:
        fwd, bwd = table1_optimus(batch, 7, cfg.d_model, world)
        print(f"q={q} ckpt={r['ckpt']}: CommMeter bytes/step/rank forward {r['bytes_by_phase']['forward']}, "
              f"backward {r['bytes_by_phase']['backward']}; Table 1 stem alone x {cfg.n_layers} layers / log2 q: "
              f"forward {8 * cfg.n_layers * fwd / math.log2(q):.0f}, backward (checkpointed) "
              f"{8 * cfg.n_layers * bwd / math.log2(q):.0f}")


# ----------------------------------------------------------------------------- memory


def _saved_activation_bytes(model, tokens, targets) -> int:
    """Bytes of the unique storages saved for backward during one forward, parameters excluded."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            storages[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(tokens, targets)
    loss.backward()
    return sum(storages.values())


def _check_activation_memory(cfg_kwargs, batch):
    cfg = lattice.GPTConfig(**cfg_kwargs)
    tokens, targets = _batch(batch, cfg.seq_len, cfg.vocab_size, seed=9)
    serial = _saved_activation_bytes(_serial(cfg, torch.float32), tokens, targets)
    two_d = _saved_activation_bytes(lattice.GPT(cfg, cached_init(mode="2d", tp=4, keep_gathered=False)), tokens,
                                    targets)
    one_d = _saved_activation_bytes(lattice.GPT(cfg, cached_init(mode="1d", tp=4)), tokens, targets)
    return serial, two_d, one_d


def test_activations_saved_per_rank_are_one_pth_of_serial():
    """Activations saved for backward per rank at q=2 (p=4), without keep_gathered (which keeps
    the gathered rows by choice), are at most 1.15 x serial / p for a model whose attention is
    not the bulk (d_model >> seq_len). Catches any activation kept whole or replicated along a
    row or column (a gathered input, full logits, unsplit batch)."""
    cfg_kwargs = dict(vocab_size=64, seq_len=8, d_model=128, n_heads=4, n_layers=2)
    results = run_distributed(4, _check_activation_memory, cfg_kwargs, 4)
    serial = results[0][0]
    two_d = max(r[1] for r in results)
    one_d = max(r[2] for r in results)
    print(f"saved activations per rank: serial {serial} B, serial/p {serial / 4:.0f} B, 2d (q=2) {two_d} B "
          f"= {two_d / (serial / 4):.3f} x serial/p; 1d (tp=4) {one_d} B = {one_d / (serial / 4):.3f} x serial/p")
    assert two_d <= 1.15 * serial / 4


# ----------------------------------------------------------------------------- bad input


def _check_bad_input():
    """Every bad request must raise LatticeConfigError here, on every rank, before a collective."""
    messages = []

    def expect_error(fn):
        try:
            fn()
        except LatticeConfigError as err:
            messages.append(str(err))
            return
        raise AssertionError(f"no LatticeConfigError from {fn}")

    expect_error(lambda: lattice.init(mode="2d", tp=2))  # not a square
    expect_error(lambda: lattice.init(mode="2d", tp=9))  # 9 ranks wanted, 4 started
    ctx = cached_init(mode="2d", tp=4)
    sizes = dict(vocab_size=30, seq_len=8, n_layers=1)
    expect_error(lambda: lattice.GPT(lattice.GPTConfig(d_model=15, n_heads=5, **sizes), ctx))  # d_model % 2
    expect_error(lambda: lattice.GPT(lattice.GPTConfig(d_model=18, n_heads=3, **sizes), ctx))  # n_heads % 2
    model = lattice.GPT(lattice.GPTConfig(**TINY), ctx)
    tokens, targets = _batch(3, 7, 29, seed=0)
    expect_error(lambda: model(tokens, targets))  # batch 3 over q = 2 rows
    dist.barrier()  # every rank got here: nobody is stuck in a collective
    return messages


def test_bad_sizes_raise_clear_errors_on_every_rank():
    """Non-square tp, a world of the wrong size, d_model / n_heads / batch that q does not divide:
    a one-line LatticeConfigError on every rank and no hang. Catches validation done on one rank
    only, or after a collective has started, and hints that break another constraint."""
    results = run_distributed(4, _check_bad_input)
    assert all(r == results[0] for r in results)
    not_square, wrong_world, hidden, heads, batch = results[0]
    assert "tp=4 (q=2)" in not_square and "tp=2" in not_square
    assert "needs 9 processes" in wrong_world
    # the values offered are those that work with the other sizes as given (16 or 4, the
    # nearest multiples of q, would break d_model % n_heads)
    assert "d_model = 15" in hidden and hidden.endswith("as given: tp 25")
    assert "n_heads = 3" in heads and heads.endswith("as given: tp 9; n_heads 2 or 6")
    assert "batch size = 3" in batch and "4" in batch
    assert all("\n" not in m for m in results[0])


def test_non_square_tp_is_refused_without_processes():
    """lattice.context refuses tp that is not q*q (q >= 2) and names the nearest squares."""
    with pytest.raises(LatticeConfigError, match=r"tp=4 \(q=2\) or tp=9 \(q=3\)"):
        lattice.context("2d", tp=6)
    with pytest.raises(LatticeConfigError, match=r"tp=4 \(q=2\)"):
        lattice.context("2d", tp=1)
    assert lattice.context("2d", tp=9, dp=2).topology.shape == (2, 3, 3)


def test_keep_gathered_without_the_all_gather_form_is_refused():
    """keep_gathered keeps what the all-gather form gathered; with the broadcast form there is
    nothing to keep, and a silent no-op would leave the user believing it ran. The broadcast form
    asked for alone turns the default keep_gathered off rather than being refused."""
    with pytest.raises(LatticeConfigError, match=r"keep_gathered=True .* summa='all_gather'"):
        lattice.context("2d", tp=4, keep_gathered=True, summa="broadcast")
    assert lattice.context("2d", tp=4, keep_gathered=True, summa="all_gather").options["keep_gathered"]
    assert not lattice.context("2d", tp=4, summa="broadcast").options["keep_gathered"]


# ----------------------------------------------------------------------------- placement


def _nodes(topo, axis):
    groups = topo.all_groups(axis)
    return [len({topo.node_of(r) for r in g}) for g in groups]


@pytest.mark.parametrize("tp,dp,per_node,col_nodes,row_nodes", [
    (16, 1, 4, 2, 2),   # Fig. 8: 4 nodes of 4 GPUs, bunched 2 x 2 tiles
    (16, 1, 8, 1, 2),   # 2 nodes of 8: whole columns inside a node
    (16, 2, 4, 2, 2),   # with data parallelism
    (4, 2, 2, 1, 2),
])
def test_bunched_placement_keeps_columns_in_fewer_nodes(tp, dp, per_node, col_nodes, row_nodes):
    """placement="topology" against natural placement (no processes): column groups touch fewer
    nodes and every node holds exactly ranks_per_node ranks. Catches a permutation that is not
    a permutation, or a tiling that leaves column traffic crossing every node."""
    natural = lattice.context("2d", tp=tp, dp=dp, ranks_per_node=per_node).topology
    bunched = lattice.context("2d", tp=tp, dp=dp, ranks_per_node=per_node, placement="topology").topology
    assert set(_nodes(bunched, MeshAxis.ROW)) == {col_nodes}
    assert set(_nodes(bunched, MeshAxis.COL)) == {row_nodes}
    assert max(_nodes(bunched, MeshAxis.ROW)) < max(_nodes(natural, MeshAxis.ROW))
    # a replica's mesh groups never leave the replica's nodes
    for g in bunched.all_groups(MeshAxis.ROW) + bunched.all_groups(MeshAxis.COL):
        assert len({bunched.coords(r)[MeshAxis.DP] for r in g}) == 1
    # the rank -> node map of both is the same (consecutive ranks per node); only the mesh moved
    assert sorted(bunched.rank_grid) == list(range(tp * dp))
