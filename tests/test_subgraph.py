"""Sub-graph parallelism (SUPER's D&SP and D&SP-cSub) against serial: exact losses and gradients,
training, segmented-collective bytes, placement message counts, and bad-input errors.

Multi-process checks run on gloo with tiny models; each world size starts once per session and
runs many configurations in one call.
"""

import itertools

import pytest
import torch
import torch.distributed as dist
from multiproc import cached_init, run_distributed
from numerics import random_batch as _batch
from numerics import rel_diff as _rel

import lattice
from lattice import LatticeConfigError, MeshAxis

# V = 29: no mode pads here, but an odd vocabulary catches row/column mix-ups; T = 7 < seq_len
TINY = dict(vocab_size=29, seq_len=8, d_model=16, n_heads=4, n_layers=2)
VARIANTS = [dict(bias=True, tie_embeddings=True), dict(bias=False, tie_embeddings=False)]


def _layouts(p: int):
    """Every (options, checkpointing) the acceptance asks for at p ranks: g in {2, 4}, both
    common variants, with and without checkpointing; plus the slice/concat boundaries
    (projections="common") through both collectives."""
    out = [dict(subgrids=g, common=c) for g, c in itertools.product((2, 4), ("all", "subgrid"))]
    out += [dict(subgrids=2, common=c, projections="common", slice_collective=s)
            for c, s in itertools.product(("all", "subgrid"), ("all_to_all", "all_gather"))]
    return [(o, ckpt) for o in out for ckpt in (False, True)]


def _runs(p: int):
    """(variant, options, checkpointing): every layout with the first variant, and without
    checkpointing with the second (checkpointing does not depend on biases or tying)."""
    return [(VARIANTS[0], o, ckpt) for o, ckpt in _layouts(p)] + [(VARIANTS[1], o, False) for o, ckpt in _layouts(p)
                                                                   if not ckpt]


def _check_equals_serial(p: int, batch: int) -> list[dict]:
    """Float64: loss and every full gradient of each layout against serial on the same weights and
    the same replica batch."""
    out = []
    for variant in VARIANTS:
        cfg = lattice.GPTConfig(**TINY, **variant)
        serial = lattice.GPT(cfg, lattice.context("serial"), dtype=torch.float64)
        weights = serial.full_state_dict()
        tokens, targets = _batch(batch, 7, cfg.vocab_size, seed=p)
        ref_loss = serial(tokens, targets)
        ref_loss.backward()
        ref_grads = {n: q.grad for n, q in serial.named_parameters()}
        for options, ckpt in [(o, c) for v, o, c in _runs(p) if v is variant]:
            ctx = cached_init(mode="subgraph", tp=p, **options)
            model = lattice.GPT(cfg, ctx, dtype=torch.float64, activation_checkpointing=ckpt)
            model.load_full_state_dict(weights)
            loss = model.forward_backward(tokens, targets)
            grads = model.full_grad_dict()
            assert grads.keys() == ref_grads.keys()
            with torch.no_grad():  # full logits (inference) gathered from every rank's common rows
                logits_rel = _rel(model(tokens), serial(tokens))
            out.append(dict(variant=variant, options=options, ckpt=ckpt,
                            loss_rel=abs(loss - ref_loss.item()) / abs(ref_loss.item()),
                            grad_rel=max(_rel(grads[n], ref_grads[n]) for n in grads), logits_rel=logits_rel))
    return out


@pytest.mark.parametrize("p", [8])  # p = 4: the conformance suite's layouts
def test_loss_and_every_gradient_equal_serial(p):
    """Catches a wrong row assignment between common layers and branches (a sequence attended
    by the wrong sub-grid or lost), a branch boundary whose backward is not the conjugate
    collective, a head block on the wrong sub-grid, gradients summed over the wrong ranks
    (branch weights over the sub-grid, common ones over every rank that runs them), and full
    logits assembled from the wrong ranks' rows."""
    results = run_distributed(p, _check_equals_serial, p, 2 * p)
    worst = 0.0
    for rank_results in results:
        for r in rank_results:
            worst = max(worst, r["loss_rel"], r["grad_rel"], r["logits_rel"])
            assert r["loss_rel"] < 1e-10 and r["grad_rel"] < 1e-10 and r["logits_rel"] < 1e-10, r
    for r in results[0]:
        print(f"p={p} {r['options']} ckpt={r['ckpt']!s:5} bias={r['variant']['bias']!s:5}: "
              f"loss rel {r['loss_rel']:.1e}, max grad rel {r['grad_rel']:.1e}")
    print(f"p={p}: {len(results[0])} configurations on {p} ranks, worst relative difference {worst:.1e}")


def expected_bytes(options: dict, p: int, B: int, T: int, cfg, itemsize: int = 8) -> dict:
    """{(phase, op): bytes} of one forward + backward + sync_grads on a rank, derived from the
    layout (not from a run). g sub-grids of n_g = p/g; a rank's branch batch is B/n_g.
    - projections="branch": per layer one split of the attention input and one sum of its
      output, each a (B/n_g, T, h) buffer over the g ranks of a cross-sub-grid group, and their
      conjugates in backward (D&SP: all-gather / reduce-scatter; cSub: broadcast / reduce).
    - projections="common": per layer a slice of qkv and a concatenation of (B/n_g, T, h/g)
      pieces: all-to-all counts the buffer a rank sends, scatter and gather the whole buffer
      of the group, all-gather its output, reduce-scatter its input.
    - the loss: one element all-reduced over the replica.
    - sync_grads: one all-reduce per gradient bucket: the branch weights over the sub-grid's
      members, the common parameters over every rank running them (D&SP: all p; cSub: the n_g
      of sub-grid 0; idle ranks hold none).
    - with activation checkpointing the forward boundaries of each layer run again in backward
      (the recomputation repeats the whole block up to its last saved tensor, which includes the
      MLP after the attention's sum).
    """
    g = options["subgrids"]
    n_g, h, L = p // g, cfg.d_model, cfg.n_layers
    csub = options.get("common", "all") == "subgrid"
    rows_branch = B // n_g
    act = rows_branch * T * h
    out: dict = {}

    def add(phase, op, elements, calls=1):
        key = (phase, op)
        out[key] = out.get(key, 0) + elements * itemsize

    if options.get("projections", "branch") == "branch":
        fwd = [("broadcast" if csub else "all_gather", act), ("reduce" if csub else "reduce_scatter", act)]
        bwd = [("reduce" if csub else "reduce_scatter", act), ("broadcast" if csub else "all_gather", act)]
    else:
        by_gather = options.get("slice_collective") == "all_gather"
        if csub:
            sl = ("broadcast", 3 * act) if by_gather else ("scatter", 3 * act // g * g)
            cat = ("all_gather", act) if by_gather else ("gather", act)
            fwd = [sl, cat]
            bwd = [("reduce", 3 * act) if by_gather else ("gather", 3 * act),
                   ("reduce_scatter", act) if by_gather else ("scatter", act)]
        else:
            common_rows = B // p
            if by_gather:
                fwd = [("all_gather", 3 * act), ("all_gather", act)]
                bwd = [("reduce_scatter", 3 * act), ("reduce_scatter", act)]
            else:  # all-to-all counts the buffer each rank sends: the slice sends its common rows'
                # q, k, v of every head, the concatenation its B/n_g rows of its h/g head columns
                fwd = [("all_to_all", 3 * common_rows * T * h), ("all_to_all", act // g)]
                bwd = [("all_to_all", act // g), ("all_to_all", 3 * common_rows * T * h)]
    for op, n in fwd:
        add("forward", op, L * n)
    for op, n in bwd:
        add("backward", op, L * n)
    if options.get("ckpt"):
        for op, n in fwd:
            add("backward", op, L * n)
    add("forward", "all_reduce", 1)
    k = options["_k"]
    proj_common = options.get("projections", "branch") == "common"
    attn_branch = 0 if proj_common else 4 * h * h // g + (3 * h // g if cfg.bias else 0)
    everything = sum(t for t in (cfg.vocab_size * h, cfg.seq_len * h)) + L * (12 * h * h + (13 * h if cfg.bias else 4 * h)) \
        + (2 * h if cfg.bias else h) + (0 if cfg.tie_embeddings else cfg.vocab_size * h)
    full_attn = 4 * h * h + (3 * h if cfg.bias else 0)  # q, k, v, proj weights and qkv bias
    common = everything - (0 if proj_common else L * full_attn)
    if attn_branch and n_g > 1:
        add("backward", "all_reduce", L * attn_branch)
    runs_common = not csub or k == 0
    if runs_common and (n_g if csub else p) > 1:
        add("backward", "all_reduce", common)
    return out


def _check_comm(layouts):
    cfg = lattice.GPTConfig(**TINY)
    B, T, out = 8, 7, []
    for options in layouts:
        opts = {k: v for k, v in options.items() if k != "ckpt"}
        ctx = cached_init(mode="subgraph", tp=4, **opts)
        model = lattice.GPT(cfg, ctx, dtype=torch.float64, activation_checkpointing=options.get("ckpt", False))
        tokens, targets = _batch(B, T, cfg.vocab_size, seed=3)
        with lattice.CommMeter() as meter:
            model.forward_backward(tokens, targets)
        measured = {}
        for (phase, op, _), rec in meter.summary().items():
            measured[(phase, op)] = measured.get((phase, op), 0) + rec["bytes"]
        expected = expected_bytes({**options, "_k": ctx.coord(MeshAxis.SUBGRID)}, 4, B, T, cfg)
        out.append((options, measured, expected))
    return out


COMM_LAYOUTS = [dict(subgrids=2), dict(subgrids=2, ckpt=True), dict(subgrids=4, common="subgrid"),
                dict(subgrids=2, common="subgrid", ckpt=True),
                dict(subgrids=2, projections="common"), dict(subgrids=2, projections="common", common="subgrid"),
                dict(subgrids=2, projections="common", slice_collective="all_gather"),
                dict(subgrids=2, projections="common", common="subgrid", slice_collective="all_gather")]


def test_comm_bytes_per_step_match_the_formula():
    """Catches an extra, missing or oversized segmented collective (e.g. a boundary over the whole
    replica instead of the cross-sub-grid group, common parameters synchronised on idle ranks,
    or the branch batch moved where only the common rows should be)."""
    for rank, rank_result in enumerate(run_distributed(4, _check_comm, COMM_LAYOUTS)):
        for options, measured, expected in rank_result:
            assert measured == expected, (rank, options, measured, expected)
    for options, measured, _ in run_distributed(4, _check_comm, COMM_LAYOUTS)[0]:
        print(f"{options}: rank 0 {sum(measured.values())} bytes per step "
              + ", ".join(f"{ph} {op} {b}" for (ph, op), b in sorted(measured.items())))


def _check_bad_sizes():
    messages = []
    with lattice.CommMeter() as meter:
        ctx = cached_init(mode="subgraph", tp=4, subgrids=4)
        try:
            lattice.GPT(lattice.GPTConfig(vocab_size=29, seq_len=8, d_model=18, n_heads=6, n_layers=1), ctx)
            messages.append(None)
        except LatticeConfigError as e:
            messages.append(str(e))
        for common in ("all", "subgrid"):
            model = lattice.GPT(lattice.GPTConfig(**TINY), cached_init(mode="subgraph", tp=4, subgrids=2, common=common))
            tokens = torch.zeros(3, 7, dtype=torch.int64)
            try:
                model(tokens, tokens)
                messages.append(None)
            except LatticeConfigError as e:
                messages.append(str(e))
    dist.barrier()  # every rank gets here: nobody is left inside a collective
    return messages, meter.count()


def test_sizes_that_do_not_divide_fail_on_every_rank_before_any_collective():
    """Catches a size error raised on some ranks only (a hang) or deep inside a collective."""
    for messages, sent in run_distributed(4, _check_bad_sizes):
        assert sent == 0
        assert messages[0].startswith("n_heads = 6 is not divisible by subgrids g = 4")
        assert "give each replica a multiple of 4 sequences" in messages[1]  # D&SP: all 4 ranks
        assert "give each replica a multiple of 2 sequences" in messages[2]  # cSub: sub-grid 0's 2
    with pytest.raises(LatticeConfigError, match=r"subgrids = 3 does not divide tp = 4; use subgrids among \[1, 2, 4\]"):
        lattice.context("subgraph", tp=4, subgrids=3)
    with pytest.raises(LatticeConfigError, match=r"option common must be one of \['all', 'subgrid'\]"):
        lattice.context("subgraph", tp=4, common="some")


def test_topology_aware_placement_keeps_segmented_collectives_in_a_node():
    """SUPER Eq. 4-7 counted on the placements lattice builds: catches a round-robin placement
    that does not put a cross-sub-grid group on one node."""
    from lattice.cost import count_messages, super_messages

    for n, g, n_node in ((8, 2, 4), (8, 4, 4), (16, 4, 4), (16, 8, 4), (8, 2, 2)):
        for placement, aware in (("natural", False), ("topology", True)):
            topo = lattice.context("subgraph", tp=n, subgrids=g, ranks_per_node=n_node, placement=placement).topology
            counted = count_messages(topo, (MeshAxis.SUBGRID,))
            assert counted == super_messages(n, g, n_node, aware), (n, g, n_node, placement, counted)


def test_info_prints_the_split_message_counts_of_both_placements(capsys):
    """Catches `lattice info` counting messages on the wrong axis or placement: for n=8, g=2 on
    nodes of 4, Eq. 4-5 give 8 intra / 8 inter-node messages for the natural placement and Eq. 6-7
    give 16 / 0 for the topology-aware one."""
    from lattice.cli.main import main

    assert main(["info", "--mode", "subgraph", "--tp", "8", "--subgrids", "2", "--ranks-per-node", "4",
                 "--model", "tiny"]) == 0
    out = capsys.readouterr().out
    assert "  subgrid: natural placement 8 / 8; topology placement 16 / 0" in out.splitlines()
