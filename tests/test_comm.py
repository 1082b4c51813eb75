"""Each autograd collective against the same computation done by hand on gathered data."""

import torch
import torch.distributed as dist
from multiproc import run_distributed


def _check_collectives():
    import lattice
    from lattice.parallel import comm

    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    torch.manual_seed(0)
    xs = [torch.randn(world * 2, 3, dtype=torch.float64) for _ in range(world)]  # every rank's input
    dys = [torch.randn(world * 2, 3, dtype=torch.float64) for _ in range(world)]  # every rank's upstream grad
    total_x, total_dy = sum(xs), sum(dys)
    out = {}

    def run(fn, dy_shape_fn=None):
        x = xs[rank].clone().requires_grad_(True)
        y = fn(x)
        dy = dys[rank] if dy_shape_fn is None else dy_shape_fn(rank)
        y.backward(dy)
        return y.detach(), x.grad

    with lattice.CommMeter() as meter:
        y, dx = run(lambda x: comm.copy_to_group(x, group))
        assert torch.equal(y, xs[rank]) and torch.allclose(dx, total_dy)
        y, dx = run(lambda x: comm.all_reduce(x, group))
        assert torch.allclose(y, total_x) and torch.equal(dx, dys[rank])
        # all-gather along dim 1: output (2w, 3w); upstream grads of that shape
        gdy = [torch.randn(world * 2, 3 * world, dtype=torch.float64, generator=torch.Generator().manual_seed(r))
               for r in range(world)]
        y, dx = run(lambda x: comm.all_gather(x, group, 1), lambda r: gdy[r])
        assert torch.allclose(y, torch.cat(xs, 1))
        assert torch.allclose(dx, sum(gdy)[:, rank * 3:(rank + 1) * 3])
        rdy = [d[:2] for d in dys]
        y, dx = run(lambda x: comm.reduce_scatter(x, group, 0), lambda r: rdy[r])
        assert torch.allclose(y, total_x[rank * 2:(rank + 1) * 2])
        assert torch.allclose(dx, torch.cat(rdy, 0))
        y, dx = run(lambda x: comm.broadcast(x, group, 1))
        assert torch.equal(y, xs[1])
        assert (dx is None) if rank != 1 else torch.allclose(dx, total_dy)
        y, dx = run(lambda x: comm.reduce(x, group, 0))
        if rank == 0:
            assert torch.allclose(y, total_x)
        assert torch.equal(dx, dys[0])
        ady = [g[:2] for g in gdy]  # all-to-all output is (2, 3w)
        y, dx = run(lambda x: comm.all_to_all(x, group, 0, 1), lambda r: ady[r])
        assert torch.equal(y, torch.cat([xs[r].chunk(world, 0)[rank] for r in range(world)], 1))
        expect_dx = torch.cat([ady[r].chunk(world, 1)[rank] for r in range(world)], 0)
        assert torch.allclose(dx, expect_dx)
    # started and awaited later (3d's overlap, ZeRO's buckets); on gloo an all-to-all and a sum
    # here, not gloo's reduce-scatter (lattice.parallel.comm.unmetered_reduce_scatter)
    started, work = comm.start_reduce_scatter(xs[rank].clone(), group)
    work.wait()
    assert torch.allclose(started, total_x[rank * 2:(rank + 1) * 2], rtol=0, atol=1e-14)
    n = world * 2 * 3
    by_op = {op: meter.total_elements(op=op, phase="forward") for op in
             ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "all_to_all")}
    assert by_op == {"all_reduce": n, "all_gather": n * world, "reduce_scatter": n, "broadcast": n,
                     "reduce": n, "all_to_all": n}, by_op
    assert meter.total_bytes() == 8 * meter.total_elements()
    return True


def test_collectives_forward_backward_and_metering_2_ranks():
    """Catches a wrong forward/backward pairing (e.g. all-gather whose backward does not sum the
    partial gradients), a collective that CommMeter miscounts, or a reduce-scatter whose pieces
    are summed into the wrong rank's chunk."""
    assert all(run_distributed(2, _check_collectives))


def test_collectives_forward_backward_and_metering_4_ranks():
    assert all(run_distributed(4, _check_collectives))


def _check_last_dim_scatter():
    from lattice.parallel.comm import raw_reduce_scatter

    rank, world = dist.get_rank(), dist.get_world_size()
    xs = [torch.arange(6.0 * world).reshape(3, 2 * world) * (r + 1) for r in range(world)]
    out = raw_reduce_scatter(xs[rank], dist.group.WORLD, 1)
    middle = raw_reduce_scatter(torch.ones(2, 2 * world, 3), dist.group.WORLD, 1)
    return (torch.equal(out, sum(xs)[:, 2 * rank:2 * rank + 2]) and out.is_contiguous()
            and torch.equal(middle, torch.full((2, 2, 3), float(world))))


def test_a_reduce_scatter_along_the_last_dim_returns_its_chunk_contiguous():
    """Catches the chunk of a reduce-scatter along the last dim returned as a strided view of the
    scattered buffer (2d's SUMMA in the all-gather form scatters its products' columns so): the
    GELU backward of a 2d MLP block ran 8x slower on it on this CPU (issue 39's 2d block: 0.792 of
    Colossal's time with the view, 0.739 with the chunk contiguous). The values are the summed
    columns of this rank, and a middle dim scatters as before."""
    assert all(run_distributed(2, _check_last_dim_scatter))
