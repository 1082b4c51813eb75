"""Topology, shard specs, init validation and the serial model's data-parallel semantics."""

import math

import pytest
import torch
import torch.distributed as dist
from multiproc import cached_init, run_distributed

import lattice
from lattice.parallel.context import MeshAxis, ParallelContext, Topology
from lattice.parallel.sharding import ShardSpec, gather_full, gather_full_many


def test_topology_coords_round_trip_with_permuted_placement():
    """Catches coords/rank_at disagreeing when the rank placement is not the identity."""
    grid = (0, 2, 1, 3, 4, 6, 5, 7)  # (dp, row, col) with row and col transposed inside each replica
    topo = Topology("x", ((MeshAxis.DP, 2), (MeshAxis.ROW, 2), (MeshAxis.COL, 2)), grid, ranks_per_node=4)
    for rank in range(8):
        assert topo.rank_at(topo.coords(rank)) == rank
    assert topo.coords(2) == {MeshAxis.DP: 0, MeshAxis.ROW: 0, MeshAxis.COL: 1}
    assert topo.group_members(MeshAxis.ROW, 2) == [2, 3]
    assert topo.group_members(MeshAxis.COL, 2) == [0, 2]
    assert sorted(sum(topo.all_groups(MeshAxis.COL), [])) == list(range(8))


def test_placement_that_reorders_group_members_is_refused():
    """Catches a placement under which torch's group-rank order (sorted by global rank) would differ
    from the mesh coordinate order that shard specs use: shards would silently land on wrong ranks."""
    with pytest.raises(lattice.LatticeConfigError, match="must increase along every mesh axis"):
        Topology("x", ((MeshAxis.ROW, 2), (MeshAxis.COL, 2)), (2, 0, 3, 1), ranks_per_node=4)


def test_bad_layout_requests_are_refused_with_the_fix():
    """Catches unknown modes/options or a non-positive size slipping through to a later crash."""
    with pytest.raises(lattice.LatticeConfigError, match="unknown mode '4d'"):
        lattice.context("4d")
    with pytest.raises(lattice.LatticeConfigError, match="does not take option"):
        lattice.context("serial", sequence_parallel=True)
    with pytest.raises(lattice.LatticeConfigError, match="dp must be a positive integer"):
        lattice.context("serial", dp=0)
    with pytest.raises(lattice.LatticeConfigError, match="tp=1"):
        lattice.context("serial", tp=2)
    with pytest.raises(lattice.LatticeConfigError, match="n_heads = 5"):
        lattice.GPTConfig(d_model=64, n_heads=5)


def test_init_in_single_process_rejects_multi_rank_layout(monkeypatch):
    """Catches lattice.init starting a layout for more processes than were launched (a hang later)."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(lattice.LatticeConfigError, match="needs 2 processes but 1 were started"):
        lattice.init("serial", dp=2)


def _wrong_world_size():
    try:
        lattice.init("serial", dp=4)
    except lattice.LatticeConfigError as e:
        return str(e)
    return None


def test_wrong_world_size_errors_on_every_rank():
    """Catches a world-size mismatch raised on only some ranks (the others would hang)."""
    messages = run_distributed(2, _wrong_world_size)
    assert all(m and "needs 4 processes but 2 were started" in m for m in messages)
    assert all("\n" not in m for m in messages)


def _scatter_gather_specs():
    """A synthetic 2 (dp) x 2 (row) x 2 (col) mesh with a permuted placement."""
    from torch.distributed.device_mesh import DeviceMesh

    grid = (0, 2, 1, 3, 4, 6, 5, 7)
    axes = ((MeshAxis.DP, 2), (MeshAxis.ROW, 2), (MeshAxis.COL, 2))
    topo = Topology("synthetic", axes, grid, ranks_per_node=8)
    mesh = DeviceMesh("cpu", torch.tensor(grid).reshape(2, 2, 2), mesh_dim_names=("dp", "row", "col"))
    ctx = ParallelContext(topology=topo, rank=dist.get_rank(), mesh=mesh)
    full = torch.arange(5 * 6, dtype=torch.float64).reshape(5, 6)
    specs = [
        ShardSpec((5, 6)),  # replicated everywhere
        ShardSpec((5, 6), splits=((1, (MeshAxis.COL, MeshAxis.ROW)),), padded_shape=(5, 8)),
        ShardSpec((5, 6), splits=((0, (MeshAxis.ROW,)), (1, (MeshAxis.COL,))), padded_shape=(6, 6)),
        ShardSpec((5, 6), splits=((1, (MeshAxis.COL,)),), holders=((MeshAxis.ROW, 0),)),
    ]
    for spec in specs:
        local = spec.shard(full, ctx.coords, topo) if spec.holds(ctx.coords) else None
        back = gather_full(local, spec, ctx, dtype=torch.float64)
        assert torch.equal(back, full), spec
    # gradients: each dp replica contributes its own values; the result is their mean
    spec = specs[2]
    mine = spec.shard(full * (1 + ctx.coord(MeshAxis.DP)), ctx.coords, topo)
    assert torch.equal(gather_full(mine, spec, ctx, dtype=torch.float64, average_dp=True), full * 1.5)
    assert specs[3].replicas(topo) == 1 and specs[0].replicas(topo) == 4 and specs[1].replicas(topo) == 1
    # all four at once, in buckets of one tensor, two (8 ranks x 24 elements x 8 bytes each) and all
    fulls = [full * (k + 1) for k in range(len(specs))]
    shards = [(s.shard(f, ctx.coords, topo) if s.holds(ctx.coords) else None, s) for s, f in zip(specs, fulls)]
    for bucket_bytes in (1, 2 * 8 * 24 * 8, 2 ** 30):
        together = gather_full_many(shards, ctx, dtype=torch.float64, bucket_bytes=bucket_bytes)
        assert all(torch.equal(a, b) for a, b in zip(together, fulls, strict=True)), bucket_bytes
        onto_5 = gather_full_many(shards, ctx, dtype=torch.float64, bucket_bytes=bucket_bytes, dst=5)
        assert (all(torch.equal(a, b) for a, b in zip(onto_5, fulls, strict=True)) if ctx.rank == 5
                else onto_5 == [None] * len(specs)), bucket_bytes
    return True


def test_shard_then_gather_is_identity_for_splits_padding_and_holders():
    """Catches a wrong mixed-radix chunk index, lost padding crop, or a non-holder overwriting data,
    and a bucketed gather that pairs a tensor with another's piece or drops one at a bucket's edge."""
    assert all(run_distributed(8, _scatter_gather_specs))


CFG = dict(vocab_size=50, seq_len=8, d_model=16, n_heads=4, n_layers=2)


def _serial_dp_grads():
    ctx = cached_init(mode="serial", dp=2)
    cfg = lattice.GPTConfig(**CFG)
    torch.manual_seed(0)
    tokens = torch.randint(0, 50, (4, 8))
    model = lattice.GPT(cfg, ctx, dtype=torch.float64)
    half = tokens.chunk(2)[ctx.coord(MeshAxis.DP)]
    model(half[:, :-1], half[:, 1:]).backward()
    grads = model.full_grad_dict()
    reference = lattice.GPT(cfg, lattice.context("serial"), dtype=torch.float64)
    reference(tokens[:, :-1], tokens[:, 1:]).backward()
    worst = max(((grads[k] - p.grad).norm() / p.grad.norm()).item() for k, p in reference.named_parameters())
    return worst


def test_full_grad_dict_averages_data_parallel_replicas():
    """Catches full_grad_dict returning one replica's gradient instead of the global-batch gradient."""
    assert max(run_distributed(2, _serial_dp_grads)) < 1e-12


def test_dropout_masks_repeat_under_activation_checkpointing():
    """Catches recomputation drawing new dropout masks (then gradients silently differ)."""
    cfg = lattice.GPTConfig(**{**CFG, "dropout": 0.3})
    tokens = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(1))
    grads = []
    for checkpointing in (False, True):
        model = lattice.GPT(cfg, lattice.context("serial"), dtype=torch.float64,
                            activation_checkpointing=checkpointing)
        model.train()
        loss = model(tokens, tokens)
        loss.backward()
        grads.append((loss.item(), {k: p.grad.clone() for k, p in model.named_parameters()}))
    assert grads[0][0] == grads[1][0]
    for k in grads[0][1]:
        assert torch.allclose(grads[0][1][k], grads[1][1][k], rtol=1e-12, atol=1e-15), k
    # and dropout is really active: eval mode changes the loss
    model.eval()
    assert not math.isclose(model(tokens, tokens).item(), grads[0][0])


def test_dropout_draws_new_masks_every_step():
    """Catches dropout masks that repeat every step (the forward count left out of the mask
    seed: every step would drop the same units). The same batch through the same weights twice
    in training mode must give two different losses; with the forward count set back, the first
    loss again (masks are a function of seed, count and site, not of global RNG)."""
    cfg = lattice.GPTConfig(**{**CFG, "dropout": 0.3})
    tokens = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(1))
    model = lattice.GPT(cfg, lattice.context("serial"), dtype=torch.float64)
    model.train()
    with torch.no_grad():
        first, second = model(tokens, tokens).item(), model(tokens, tokens).item()
        model.seeds.forward_count = 0
        torch.manual_seed(999)  # global RNG plays no part
        again = model(tokens, tokens).item()
    assert first != second
    assert again == first


def test_initial_weights_depend_on_seed_not_on_construction():
    """Catches initialisation that depends on module order or global RNG (layouts would start apart)."""
    cfg = lattice.GPTConfig(**CFG)
    torch.manual_seed(123)
    a = lattice.GPT(cfg, lattice.context("serial")).full_state_dict()
    torch.manual_seed(456)
    b = lattice.GPT(cfg, lattice.context("serial")).full_state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert a["blocks.0.ln_1.weight"].eq(1).all() and a["blocks.0.attn.qkv.bias"].eq(0).all()
    std = a["blocks.0.mlp.fc.weight"].std().item()
    assert 0.015 < std < 0.025


def _hang_on_rank_1():
    import torch.distributed as dist

    if dist.get_rank() == 1:
        import time
        time.sleep(30)  # never joins the barrier within the check's timeout
    dist.barrier()


def test_a_hung_check_reports_every_stuck_ranks_stack():
    """Catches a harness that, on a deadlock, only says "timeout" without showing where each rank
    was stuck (the faulthandler dump before the deadline)."""
    from multiproc import DistributedCheckFailed, run_distributed

    with pytest.raises(DistributedCheckFailed) as failure:
        run_distributed(2, _hang_on_rank_1, timeout=6)
    report = str(failure.value)
    assert "no answer within 6s" in report
    stacks = report.split("--- rank ")[1:]
    assert [s.split(" ")[0] for s in stacks] == ["0", "1"]
    for rank_stack in stacks:  # each rank's own dump, showing the line it is stuck on
        assert "in _hang_on_rank_1" in rank_stack, report


def _cache_layouts_and_stray_groups(layouts: list[dict], stray: int) -> None:
    for layout in layouts:
        cached_init(**layout)
    for _ in range(stray):
        dist.new_group([0, 1])


def _groups_alive() -> int:
    """Process groups this rank holds besides the world (torch's own registry)."""
    import multiproc

    return len(multiproc._live_groups())


def _groups_one_init_makes(layout: dict) -> int:
    before = _groups_alive()
    lattice.init(**layout)
    return _groups_alive() - before


def _tp_all_reduce(layout: dict) -> float:
    x = torch.ones(1)
    dist.all_reduce(x, group=cached_init(**layout).group(MeshAxis.TP))
    return x.item()


def test_test_workers_give_back_the_groups_of_old_layouts_and_of_a_check():
    """Catches the test harness keeping every layout's (or every check's own) process groups:
    each idle gloo group owns a thread that wakes 100 times a second, and ~20 workers holding
    dozens each made the suite 40% slower. After six layouts and five stray groups a worker holds
    the groups of its two latest layouts (as many as two plain inits make), and they still work."""
    layouts = [dict(mode="1d", tp=2, sequence_parallel=sp, seed=seed) for sp in (False, True) for seed in (1, 2, 3)]
    run_distributed(2, _cache_layouts_and_stray_groups, layouts, 5)
    expected = [a + b for a, b in zip(*(run_distributed(2, _groups_one_init_makes, lo) for lo in layouts[-2:]))]
    assert run_distributed(2, _groups_alive) == expected and min(expected) > 0
    assert run_distributed(2, _tp_all_reduce, layouts[-1]) == [2.0, 2.0]
    assert run_distributed(2, _groups_alive) == expected  # reused, not made again


def _check_groups_and_gather_to_one_rank():
    import torch.distributed as dist
    from multiproc import cached_init

    ctx = cached_init(mode="2d", tp=4)
    summed = torch.tensor([float(ctx.rank)])
    assert ctx.model_group() is ctx.group(MeshAxis.ROW, MeshAxis.COL)
    dist.all_reduce(summed, group=ctx.model_group())
    members = ctx.topology.group_members((MeshAxis.ROW, MeshAxis.COL), ctx.rank)
    cfg = lattice.GPTConfig(vocab_size=61, seq_len=8, d_model=8, n_heads=2, n_layers=1)
    model = lattice.GPT(cfg, ctx)
    everywhere = model.full_state_dict()
    on_one = model.full_state_dict(to_rank=1)
    same = ctx.rank != 1 or all(torch.equal(on_one[k], v) for k, v in everywhere.items())
    return float(summed), members, len(on_one), len(everywhere), same


def test_multi_axis_groups_and_gathering_to_one_rank():
    """Catches a model-parallel group that is missing or spans the wrong ranks (the gradient norm
    sums over it), full_state_dict(to_rank=) building tensors on ranks other than the target or
    differing from the all-gathered result."""
    from multiproc import run_distributed

    for rank, (summed, members, n_one, n_all, same) in enumerate(run_distributed(4, _check_groups_and_gather_to_one_rank)):
        assert summed == 0 + 1 + 2 + 3 and members == [0, 1, 2, 3]
        assert n_one == (n_all if rank == 1 else 0) and same


def test_undeclared_multi_axis_group_is_refused_by_name():
    """Catches ctx.group silently returning a wrong (single-axis or world) group for a combination
    of axes that lattice.init never created."""
    topo = Topology("2d", ((MeshAxis.DP, 2), (MeshAxis.ROW, 2), (MeshAxis.COL, 2)), tuple(range(8)), 8)
    ctx = ParallelContext(topology=topo, rank=0, mesh=object(), multi_axis_groups={})
    with pytest.raises(KeyError, match=r"no process group over axes \['dp', 'row'\].*declare it in its `groups`"):
        ctx.group(MeshAxis.ROW, MeshAxis.DP)
    # rank 3 is (dp 0, row 1, col 1): its group over col and dp is row 1 of both replicas
    assert topo.group_members((MeshAxis.COL, MeshAxis.DP), 3) == [2, 3, 6, 7]


def _join(pieces: dict[tuple[int, ...], torch.Tensor], dims: list[int]) -> torch.Tensor:
    """The tensor whose piece k along dims[0] (then k' along dims[1], ...) is pieces[(k, k', ...)]:
    the test's own reading of a split, with torch.cat."""
    if not dims:
        return pieces[()]
    firsts = sorted({key[0] for key in pieces})
    assert firsts == list(range(len(firsts))), f"pieces {firsts} along dim {dims[0]} leave a gap"
    return torch.cat([_join({key[1:]: t for key, t in pieces.items() if key[0] == k}, dims[1:]) for k in firsts],
                     dim=dims[0])


@pytest.mark.parametrize("mode", lattice.available_modes())
def test_every_rank_starts_from_its_shard_of_serials_initial_weights(mode):
    """Catches layout-dependent initialisation (a shard drawn from its own seed, padding rows
    that are not zero, an uninitialised shard left by the meta-device construction) on every
    rank of every layout a mode declares, without processes: each rank is built from a planning
    context, and every parameter's shards, joined by the test's own reading of the declared
    splits (piece index mixed-radix over the split axes, first axis major; torch.cat; padding cut
    off and required zero), rebuild the serial model's freshly initialised tensor, while the
    ranks holding the same piece hold the same values. (ShardSpec.shard and .slices, which
    initialisation itself uses, are not consulted.)"""
    from lattice.modes import get_mode

    cfg = lattice.GPTConfig(vocab_size=61, seq_len=8, d_model=24, n_heads=4, n_layers=2, bias=True,
                            tie_embeddings=False)
    serial = {k: p.detach() for k, p in lattice.GPT(cfg, lattice.context("serial")).named_parameters()}
    layouts = get_mode(mode).test_layouts
    assert layouts, f"mode {mode!r} declares no test_layouts"
    for layout in layouts:
        pieces: dict[str, dict] = {}
        for rank in range(lattice.context(mode, **layout).topology.world_size):
            ctx = lattice.context(mode, rank=rank, **layout)
            model = lattice.GPT(cfg, ctx)
            for name, shard in model.named_parameters():
                key = tuple(_mixed_radix(ctx, axes) for _, axes in model.specs[name].splits)
                first = pieces.setdefault(name, {}).setdefault(key, shard.detach())
                assert torch.equal(first, shard.detach()), (mode, layout, rank, name, "copies differ")
            held = sum(1 for spec in model.specs.values() if spec.holds(ctx.coords))
            assert held == len(dict(model.named_parameters())), (mode, layout, rank, "allocates what it does not hold")
        assert sorted(pieces) == sorted(serial), (mode, layout)
        for name, by_piece in pieces.items():
            spec = model.specs[name]
            whole = _join(by_piece, [d for d, _ in spec.splits])
            true = tuple(slice(0, n) for n in spec.full_shape)
            padding = whole.clone()
            padding[true] = 0
            assert not padding.any(), (mode, layout, name, "padding is not zero")
            assert torch.equal(whole[true], serial[name]), (mode, layout, name)


def _mixed_radix(ctx, axes) -> int:
    k = 0
    for axis in axes:
        k = k * ctx.topology.size(axis) + ctx.coords.get(axis, 0)
    return k


@pytest.mark.fast
@pytest.mark.parametrize("mode", lattice.available_modes())
def test_building_a_model_leaves_its_mode_unchanged(mode):
    """Catches a mode whose factories record what they build (the 2D mode appended every
    linear's product to lists its workspace was sized from): every attribute of the mode is the
    same before and after a whole model's pieces are built from it, in its first test layout."""
    from lattice.modes import get_mode

    layout = get_mode(mode).test_layouts[0] if get_mode(mode).test_layouts else {}
    cfg = lattice.GPTConfig(vocab_size=96, seq_len=16, d_model=32, n_heads=4, n_layers=2)
    ctx = lattice.context(mode, **layout)
    built = get_mode(mode)(cfg, ctx)
    before = {name: repr(value) for name, value in vars(built).items()}
    with torch.device("meta"):
        model = lattice.GPT(cfg, ctx)
    model.mode = built  # (the model built its own; build the same pieces from this one)
    with torch.device("meta"):
        type(model).build(model)
    assert {name: repr(value) for name, value in vars(built).items()} == before
