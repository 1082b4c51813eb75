"""ZeRO-3 (lattice.parallel.zero3): the weights split over the replicas and gathered around each
block, against plain data parallelism and ZeRO-0 in float64 (losses, weights, moments), its
gathers against the cost model, its options, other families, the Trainer's micro-batches and
bf16 master rows, checkpoints resumed across stages and layouts, and the command line."""

import os

import pytest
import torch
from multiproc import cached_init, run_distributed
from test_zero import RUN, _train, _world, _worst, assert_zero_equals_ddp_and_serial

from lattice.parallel.zero_layout import memory_per_rank
from lattice.training.trainer import TrainConfig, Trainer


@pytest.mark.parametrize("family,layout,options", [
    # a block's weights kept from the forward to the reduction: one gather a step
    ("gpt2", {"mode": "serial", "dp": 2}, {"reshard_after_forward": False}),
    # a pipeline's blocks gathered and freed around every micro-batch's forward and backward
    ("gpt2", {"mode": "serial", "dp": 2, "pp": 2, "microbatches": 2}, {"reshard_microbatches": True}),
    ("llama", {"mode": "1d", "tp": 2, "dp": 2, "sequence_parallel": True}, {}),
    ("t5", {"mode": "serial", "dp": 2}, {}),
    # a stage reading a part's tables directly (T5's position bias), its parts freed between uses
    ("t5", {"mode": "serial", "dp": 2, "pp": 2, "microbatches": 1, "pp_schedule": "gpipe"}, {}),
    ("bert", {"mode": "serial", "dp": 2}, {}),  # a tied table and an embedding norm read in backward
    ("qwen2", {"mode": "2d", "tp": 4, "dp": 2}, {}),
    ("mixtral", {"mode": "1d", "tp": 2, "dp": 2}, {}),
], ids=lambda v: v if isinstance(v, str) else "-".join(f"{k}={x}" for k, x in v.items()))
def test_zero3_of_other_families_and_options_equals_plain_data_parallelism(family, layout, options):
    """Catches what the GPT-2 matrix of test_zero cannot: a parameter outside the blocks that a
    block reads (T5's position bias), an encoder-decoder's second stack, an MoE
    block's extra outputs, kept weights that go stale after an update, and a micro-batch's
    weights freed before another micro-batch's backward reads them, or gathered more often than
    the cost model prices: weights, moments and norms after three clipped steps equal plain data
    parallelism's within 1e-12, the collectives the cost model's."""
    assert_zero_equals_ddp_and_serial(layout, family, stages=(3,), options=options)


@pytest.mark.skipif((os.cpu_count() or 1) < 8, reason="16 ranks: 3d at dp = 2 (run by hand on 2 cores)")
def test_zero3_in_3d_equals_plain_data_parallelism():
    """Catches a 3d block's weights (split over the cube's three axes) gathered over the wrong
    ranks: 3d tp = 8 at dp = 2, as the test above."""
    assert_zero_equals_ddp_and_serial({"mode": "3d", "tp": 8, "dp": 2}, stages=(3,))


def _trained(layout: dict, runs: list[dict], steps: int = 3, **config) -> list:
    """(train losses, full weights) of `steps` Trainer steps of each of `runs` (TrainConfig
    fields), from the same seed."""
    ctx = cached_init(**layout)
    out = []
    for run in runs:
        trainer = Trainer(TrainConfig(**{**RUN, "checkpoint_interval": 0, **config, **run}), ctx)
        losses = [trainer.train_step()["train_loss"] for _ in range(steps)]
        trainer._finish_param_gathers(whole=True)  # (as fit ends: the weights whole, ZeRO-3's too)
        out.append((losses, trainer.model.full_state_dict()))
    return out


@pytest.mark.parametrize("layout,config", [
    ({"mode": "serial", "dp": 2, "microbatches": 2}, {}),  # gradient accumulation
    ({"mode": "serial", "dp": 2, "pp": 2, "microbatches": 4, "pp_schedule": "interleaved", "pp_virtual": 2},
     {"n_layers": 4}),
    ({"mode": "1d", "tp": 2, "dp": 2, "cp": 2}, {}),
], ids=["accumulation", "interleaved", "cp"])
def test_the_trainer_at_zero3_follows_zero0(layout, config):
    """Catches ZeRO-3 under the Trainer's micro-batches (kept gathered from the first forward to
    the reduction, or with --reshard-microbatches around each) reducing a bucket before its last
    micro-batch, freeing weights a later micro-batch or an interleaved chunk still reads, or
    summing cp's gradients twice: three steps at --zero 3 (both ways, and without the prefetch)
    follow --zero 0 within 1e-12, losses and weights."""
    runs = [{"zero": 0}, {"zero": 3}, {"zero": 3, "reshard_microbatches": True},
            {"zero": 3, "overlap_param_gather": False, "reshard_after_forward": False}]
    for rank, results in enumerate(run_distributed(_world(layout), _trained, layout, runs, **config)):
        (want_losses, want), *others = results
        for run, (losses, weights) in zip(runs[1:], others):
            worst = max(abs(a - b) / abs(b) for a, b in zip(losses, want_losses))
            assert worst < 1e-12 and _worst(weights, want) < 1e-12, (rank, run, worst, _worst(weights, want))


@pytest.mark.parametrize("arch,layout", [("gpt2", {"mode": "serial", "dp": 2}),
                                         ("mixtral", {"mode": "serial", "dp": 2, "ep": 2})])
def test_bf16_weights_at_zero3_equal_zero1s(arch, layout):
    """Catches ZeRO-3 gathering bf16 weights rounded otherwise than ZeRO-1 rounds its master rows
    into them (or from master rows not yet updated), and weights no rank shares (an MoE's experts
    split over the replicas), which ZeRO-3 never frees, left unrounded from their updated master
    rows: bf16 weights with fp32 master rows, three steps at dp = 2, identical losses and weights
    at stages 1 and 3."""
    runs = [{"zero": 1}, {"zero": 3}]
    for rank, ((l1, w1), (l3, w3)) in enumerate(run_distributed(
            2, _trained, layout, runs, arch=arch, precision="bf16", dtype="float32")):
        assert l1 == l3, (rank, l1, l3)
        assert all(torch.equal(w1[k], w3[k]) for k in w1), rank
        assert next(iter(w3.values())).dtype == torch.bfloat16


def test_a_zero3_checkpoint_resumes_without_zero_in_another_layout_and_back(tmp_path):
    """Catches ZeRO-3 checkpoints that save gathered (or freed) weights instead of the master rows,
    moments under the wrong offsets, and a ZeRO-3 run that cannot take a checkpoint written
    without it: 2d at dp = 2 and --zero 3, stopped at step 2, resumes in 1d without ZeRO; serial
    without ZeRO resumes at dp = 2 and --zero 3; both follow an uninterrupted serial run."""
    straight = _train({"mode": "serial"}, str(tmp_path / "straight"), zero=0)
    first = run_distributed(8, _train, {"mode": "2d", "tp": 4, "dp": 2}, str(tmp_path / "z3"), zero=3, stop_at=2)[0]
    resumed = run_distributed(2, _train, {"mode": "1d", "tp": 2}, str(tmp_path / "1d"), zero=0,
                              resume=str(tmp_path / "z3" / "checkpoints" / "step-00000002"))[0]
    plain = _train({"mode": "serial"}, str(tmp_path / "plain"), zero=0, stop_at=2)
    sharded = run_distributed(2, _train, {"mode": "serial", "dp": 2}, str(tmp_path / "back"), zero=3,
                              resume=str(tmp_path / "plain" / "checkpoints" / "step-00000002"))[0]
    assert len(first) == len(resumed) == len(plain) == len(sharded) == 2
    for got, want in zip(first + resumed, straight):
        assert abs(got - want) <= 1e-12 * abs(want), (first, resumed, straight)
    for got, want in zip(plain + sharded, straight):
        assert abs(got - want) <= 1e-12 * abs(want), (plain, sharded, straight)


def _memory_after_steps(layout: dict) -> dict:
    """Bytes this rank holds after two steps at --zero 0 and --zero 3 (the parameters' storage,
    gradients, the optimizer's master rows and moments, counted from the tensors themselves),
    beside memory_per_rank's."""
    from lattice.parallel.zero_layout import zero_shards

    ctx = cached_init(**layout)
    out = {}
    for zero in (0, 3):
        trainer = Trainer(TrainConfig(**{**RUN, "checkpoint_interval": 0, "dtype": "float32"}, zero=zero), ctx)
        for _ in range(2):
            trainer.train_step()
        params = sum(p.untyped_storage().nbytes() for p in trainer.model.parameters())
        grads = sum(p.grad.numel() * p.grad.element_size() for p in trainer.model.parameters() if p.grad is not None)
        state = sum(t.numel() * t.element_size() for s in trainer.optimizer.state.values() for k, t in s.items()
                    if k != "step")
        if zero == 3:
            masters = [piece.master for piece in trainer.optimizer.pieces.values() if piece.master is not None]
            params += sum(m.numel() * m.element_size() for m in masters)
            grads = sum(b.reduced.numel() * b.reduced.element_size() for b in trainer.optimizer.buckets
                        if b.reduced is not None)  # (the master rows' gradients are views of them)
        shards, shard = zero_shards(ctx)
        out[zero] = {"measured": params + grads + state,
                     "formula": sum(v for k, v in memory_per_rank(trainer.model, shards, shard, zero, 4).items()
                                    if k != "gathered")}
    return out


@pytest.mark.parametrize("dp", [2, 4])
def test_zero3_keeps_a_dp_th_of_the_weights_gradients_and_moments(dp):
    """Catches a ZeRO-3 that leaves weights gathered after the step (a block its reduction did
    not free, the parameters outside the blocks), keeps whole gradients, or a formula that
    disagrees with the tensors: after two steps a rank holds within 5% of 1/dp of ZeRO-0's
    weights, gradients and moments, and exactly memory_per_rank's."""
    for rank, r in enumerate(run_distributed(dp, _memory_after_steps, {"mode": "serial", "dp": dp})):
        assert r[3]["measured"] == r[3]["formula"] and r[0]["measured"] == r[0]["formula"], (rank, r)
        assert abs(r[3]["measured"] / (r[0]["measured"] / dp) - 1) < 0.05, (rank, r)


def _gathered_at_most(arch: str, shape: dict) -> dict:
    """One ZeRO-3 step (prefetch on) of `arch` at `shape` over serial dp = 2, float64: the most
    weight bytes whole at once (gathers in flight counted, sampled as each starts and ends),
    memory_per_rank's `gathered`, and the bytes of its blocks and of its parameters outside them,
    by name, from a serial model."""
    import lattice
    from lattice.bench.measure import most_weight_bytes_whole
    from lattice.models import get_arch
    from lattice.parallel.zero import ZeroOptimizer
    from lattice.parallel.zero_layout import parts_freed, zero_shards

    ctx = cached_init(mode="serial", dp=2)
    cfg = get_arch(arch).config_class(**{**get_arch(arch).test_shapes[0], **shape})
    model = lattice.build_model(cfg, ctx, dtype=torch.float64)
    with most_weight_bytes_whole(model) as most:
        opt = ZeroOptimizer(model, ctx, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, stage=3, overlap_param_gather=True)
        most[0] = 0  # (the step's, not the construction's)
        tokens = torch.randint(0, cfg.vocab_size, (4, 9), generator=torch.Generator().manual_seed(ctx.rank))
        model.forward_backward(tokens[:, :-1], tokens[:, 1:])
        opt.reduce_grads()
        opt.step()
    serial = {n: p.numel() * 8 for n, p in lattice.build_model(cfg, lattice.context("serial")).named_parameters()}
    blocks = [sum(b for n, b in serial.items() if n.startswith(f"blocks.{i}.")) for i in range(cfg.n_layers)]
    return {"measured": most[0], "blocks": blocks, "outside": {n: b for n, b in serial.items() if not n.startswith("blocks.")},
            "cost model": memory_per_rank(model, *zero_shards(ctx), 3, 8, parts_freed=parts_freed(model, 1, True))["gathered"]}


@pytest.mark.parametrize("arch,shape", [("gpt2", {}), ("gpt2", {"vocab_size": 1024}), ("llama", {"vocab_size": 1024})],
                         ids=["gpt2-blocks-larger", "gpt2-tied-table-larger", "llama-untied-tables-larger"])
def test_zero3_gathers_two_blocks_or_one_part_at_once(arch, shape):
    """Catches weights outside the blocks kept gathered through the step (the token table beside
    every block), a tied table not freed between the embedding and the head or after the head's
    backward, a part gathered again for a backward that reads only indices, and a cost model that
    prices the working set otherwise: the most weight bytes whole at once during a ZeRO-3 step are
    the larger of two blocks and each part outside them (the embeddings; the final norm and the
    head, each with a tied table), counted by parameter name, and memory_per_rank's."""
    for rank, r in enumerate(run_distributed(2, _gathered_at_most, arch, shape)):
        table = r["outside"].pop("embed.wte") if arch == "gpt2" else 0  # (tied: read by the embedding and the head)
        first = table + sum(b for n, b in r["outside"].items() if n.startswith("embed."))
        last = table + sum(b for n, b in r["outside"].items() if not n.startswith("embed."))
        expected = max(sum(sorted(r["blocks"])[-2:]), first, last)
        assert r["measured"] == expected == r["cost model"], (rank, r, expected)


def _metered_step(layout: dict) -> dict:
    """One ZeRO-3 step of GPT-2's first test shape (float64, the replica's rows of a fixed batch,
    with and without activation checkpointing): CommMeter's calls and elements beside the cost
    model's."""
    import lattice
    import lattice.cost
    from lattice.models import get_arch
    from lattice.parallel.context import MeshAxis
    from lattice.parallel.zero import ZeroOptimizer

    ctx = cached_init(**layout)
    family = get_arch("gpt2")
    cfg = family.config_class(**family.test_shapes[0])
    tokens = torch.randint(0, cfg.vocab_size, (4 * ctx.dp, 9), generator=torch.Generator().manual_seed(5))
    mine = slice(4 * ctx.coord(MeshAxis.DP), 4 * ctx.coord(MeshAxis.DP) + 4)
    out = []
    for ckpt in (False, True):
        model = lattice.build_model(cfg, ctx, dtype=torch.float64, activation_checkpointing=ckpt)
        leave_cp = ctx.cp > 1 and ctx.pipeline is None
        opt = ZeroOptimizer(model, ctx, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, stage=3, cp_summed=not leave_cp,
                            accumulations=ctx.pipeline.m if ctx.pipeline else 1, overlap_param_gather=True)
        with lattice.CommMeter() as meter:
            if leave_cp:
                model(tokens[mine, :-1], tokens[mine, 1:]).backward()
                model.sync_grads(over_cp=False)
            else:
                model.forward_backward(tokens[mine, :-1], tokens[mine, 1:])
            opt.reduce_grads()
            opt.step()
        analytic = lattice.cost.estimate(cfg, layout["mode"], batch=4, seq=8, dtype=torch.float64, rank=ctx.rank,
                                         zero=3, activation_checkpointing=ckpt,
                                         **{k: v for k, v in layout.items() if k != "mode"})
        out.append(({k: (v["calls"], v["elements"]) for k, v in meter.summary().items() if v["calls"]},
                    {k: (v["calls"], v["elements"]) for k, v in analytic.summary().items() if v["calls"]}))
    return out


def _conformance_layouts() -> list[dict]:
    """GPT-2's layouts of the conformance suite (each mode's declared ones and the pipelines),
    with twice their replicas."""
    from test_conformance import PIPELINE_LAYOUTS, _layouts

    return [{**layout, "dp": 2 * layout.get("dp", 1)} for layout in [*_layouts("gpt2"), *PIPELINE_LAYOUTS]]


@pytest.mark.parametrize("layout", _conformance_layouts(), ids=lambda l: "-".join(f"{k}={v}" for k, v in l.items()))
def test_zero3_communication_of_every_conformance_layout_equals_the_cost_model(layout):
    """Catches a gather or reduce-scatter of ZeRO-3 that the cost model does not price (or the
    reverse) in any layout the conformance suite runs, at twice its replicas: one step's metered
    calls and elements on every rank equal the cost model's, with and without activation
    checkpointing. Layouts of more than 8 ranks run on hosts of 8 cores or more."""
    if _world(layout) > 8 and (os.cpu_count() or 1) < 8:
        pytest.skip(f"{_world(layout)} ranks (run by hand on 2 cores)")
    for rank, cases in enumerate(run_distributed(_world(layout), _metered_step, layout)):
        for ckpt, (measured, modelled) in zip((False, True), cases):
            assert measured == modelled, (rank, ckpt, {k: (measured.get(k), modelled.get(k))
                                                       for k in set(measured) | set(modelled)
                                                       if measured.get(k) != modelled.get(k)})


def _skipping(layout: dict) -> dict:
    trainer = Trainer(TrainConfig(model="tiny", vocab_size=512, batch_size=4, eval_batches=1, progress=False, steps=6,
                                  lr=1e3, warmup=0, on_nan="skip", zero=3), cached_init(**layout))
    rows = [trainer.train_step() for _ in range(6)]
    trainer.optimizer.gather_params()
    return {"skipped": [r["skipped"] for r in rows],
            "finite": all(bool(torch.isfinite(p).all()) for p in trainer.model.parameters())}


def test_skipping_nan_steps_at_zero3_keeps_the_weights_finite():
    """Catches --on-nan skip at ZeRO-3 updating the master rows anyway, or gathering weights a
    skipped step left behind: a run whose learning rate sends the gradients to NaN skips steps on
    both replicas alike and ends with finite weights."""
    results = run_distributed(2, _skipping, {"mode": "serial", "dp": 2})
    assert results[0]["skipped"] == results[1]["skipped"] and any(results[0]["skipped"]), results
    assert all(r["finite"] for r in results), results
