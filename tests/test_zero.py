"""The distributed optimizer (lattice.parallel.zero) against plain data parallelism: float64 weights and
both AdamW moments after three clipped steps, in serial, 1d, 2d, sub-graph and pipeline layouts
at dp = 2 and 4, stages 1 and 2; its collectives against the cost model; its checkpoint resumed
in other layouts without it; and its memory per rank against the formula."""

import math

import pytest
import torch
import torch.distributed as dist
from multiproc import cached_init, run_distributed

import lattice
import lattice.cost
from lattice import LatticeConfigError, MeshAxis, checkpoint
from lattice.models import get_arch
from lattice.parallel.zero import ZeroOptimizer
from lattice.parallel.zero_layout import memory_per_rank, owned_rows, zero_shards
from lattice.training.optim import clip_grads, grad_norm, make_optimizer
from lattice.training.trainer import TrainConfig, Trainer

T, REPLICA_BATCH, STEPS, CLIP = 8, 4, 3, 0.05  # CLIP: low enough that every step is clipped


def _batch(cfg, rows: int, step: int):
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, cfg.vocab_size, (rows, T + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _worst(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).abs().max() / b[k].abs().max().clamp(min=1e-300)) for k in b)


def _replicas(layout: dict, dtype, family: str = "gpt2"):
    """(ctx, the full serial weights in `dtype`, replica_step(model, step)): the family's (GPT-2's)
    first test shape, and a step's forward and backward of this replica's rows of the global batch."""
    ctx = cached_init(**layout)
    family = get_arch(family)
    cfg = family.config_class(**family.test_shapes[0])
    weights = lattice.build_model(cfg, lattice.context("serial"), dtype=dtype).full_state_dict()
    d = ctx.coord(MeshAxis.DP)
    mine = slice(d * REPLICA_BATCH, (d + 1) * REPLICA_BATCH)

    def replica_step(model, step, leave_cp: bool = False):
        """`leave_cp`: as the Trainer steps under context parallelism, sync_grads leaving the
        sum over cp to the optimizer's reduction over dp x cp."""
        tokens, targets = _batch(cfg, REPLICA_BATCH * ctx.dp, step)
        if not leave_cp:
            return model.forward_backward(tokens[mine], targets[mine])
        loss = model(tokens[mine], targets[mine])
        loss.backward()
        model.sync_grads(over_cp=False)
        return float(loss.detach())

    return ctx, cfg, weights, replica_step


def _zero_against_ddp(layout: dict, stages=(1, 2), family: str = "gpt2", options: dict | None = None) -> dict:
    """Three AdamW steps of the same float64 model: plain data parallelism (gradients averaged
    by hand with torch.distributed, lattice.training.optim's norm and clip, torch's AdamW) and the
    distributed optimizer at each stage (ZeRO-3 with `options`); full weights and moments of both, and the distributed
    optimizer's collectives of its first step beside the cost model's (stage 2 recomputes each
    block in backward and gathers the updated weights beside the next forward). The plain run's first loss and gradients are checked against the serial
    model's on the whole global batch."""
    ctx, cfg, weights, replica_step = _replicas(layout, torch.float64, family)
    dp, d = ctx.dp, ctx.coord(MeshAxis.DP)
    serial = lattice.build_model(cfg, lattice.context("serial"), dtype=torch.float64)
    serial.load_full_state_dict(weights)
    serial_loss = serial.forward_backward(*_batch(cfg, REPLICA_BATCH * dp, 0))
    serial_grads = {n: p.grad.clone() for n, p in serial.named_parameters()}

    ref = lattice.build_model(cfg, ctx, dtype=torch.float64)
    ref.load_full_state_dict(weights)
    ref_opt = make_optimizer(ref, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    ref_norms = []
    for step in range(STEPS):
        ref_opt.zero_grad(set_to_none=True)
        loss = torch.tensor(replica_step(ref, step), dtype=torch.float64)
        if dp > 1:
            dist.all_reduce(loss, group=ctx.group(MeshAxis.DP))  # replicas of equal rows, none ignored
            for p in ref.parameters():
                dist.all_reduce(p.grad, group=ctx.group(MeshAxis.DP))
                p.grad /= dp
        if step == 0:
            to_serial = max(abs(float(loss) / dp - serial_loss) / abs(serial_loss),
                            _worst(ref.gather_grads(), serial_grads))
        norm = grad_norm(ref, ctx)
        ref_norms.append(float(norm))
        clip_grads(ref, norm, CLIP)
        ref_opt.step()
    ref_weights, ref_moments = ref.full_state_dict(), checkpoint.gather_optimizer(ref, ref_opt)
    out = {"clipped": min(ref_norms) > CLIP, "to_serial": to_serial}
    # stages 2 and 3 with activation checkpointing: its recomputation must not re-fire a bucket
    # (nor, at stage 3, free a block its backward still reads); and with overlap_param_gather: a
    # forward that reads a weight before its bucket's gather is awaited (a loss head's, a pipeline
    # stage's mirror of the table) steps from stale rows (at stage 3: the next block's prefetch)
    for stage in stages:
        model = lattice.build_model(cfg, ctx, dtype=torch.float64, activation_checkpointing=stage >= 2)
        model.load_full_state_dict(weights)
        leave_cp = ctx.cp > 1 and ctx.pipeline is None  # the Trainer's way: one reduction over dp x cp
        opt = ZeroOptimizer(model, ctx, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, stage=stage,
                            accumulations=ctx.pipeline.m if ctx.pipeline else 1, cp_summed=not leave_cp,
                            overlap_param_gather=stage >= 2, **(options or {}) if stage == 3 else {})
        norms = []
        for step in range(STEPS):
            opt.zero_grad()
            with lattice.CommMeter() as meter:
                replica_step(model, step, leave_cp)
                opt.reduce_grads()
                with lattice.CommMeter() as norm_meter:  # (not part of the cost model's step)
                    norm = opt.grad_norm()
                opt.clip(norm, CLIP)
                opt.step()
            norms.append(float(norm))
            if step == 0:
                measured = {k: (v["calls"], v["elements"]) for k, v in meter.summary().items()}
                for k, v in norm_meter.summary().items():
                    calls, elements = measured[k]
                    measured[k] = (calls - v["calls"], elements - v["elements"])
                measured = {k: v for k, v in measured.items() if v[0]}
        opt.finish_param_gathers()  # (the last step's gathers: full_state_dict reads the weights directly)
        opt.gather_params()  # (stage 3's weights are each rank's rows until gathered)
        moments = checkpoint.gather_optimizer(model, opt)
        owned = sum(t.numel() for key, _, t, _ in opt.checkpoint_tensors(True)
                    if key.startswith("optimizer/exp_avg/"))
        analytic = lattice.cost.estimate(cfg, layout["mode"], batch=REPLICA_BATCH, seq=T, target_seq=T,
                                         dtype=torch.float64,
                                         rank=ctx.rank, zero=stage, activation_checkpointing=stage >= 2,
                                         **(options or {}) if stage == 3 else {},
                                         **{k: v for k, v in layout.items() if k != "mode"})
        modelled = {k: (v["calls"], v["elements"]) for k, v in analytic.summary().items() if v["calls"]}
        out[stage] = {"weights": _worst(model.full_state_dict(), ref_weights),
                      "moments": max(_worst(moments[k], ref_moments[k]) for k in ("exp_avg", "exp_avg_sq")),
                      "norms": max(abs(a - b) / b for a, b in zip(norms, ref_norms)),
                      "owned": owned, "local": sum(p.numel() for p in model.parameters()),
                      "expected_owned": sum((r1 - r0) * p[0].numel() for p in model.parameters()
                                            for r0, r1 in [owned_rows(p.shape[0], *zero_shards(ctx))]),
                      "measured": measured, "modelled": modelled, "steps": moments["step"]}
    return out


ZERO_LAYOUTS = [
    {"mode": "serial", "dp": 2},
    {"mode": "serial", "dp": 4},
    {"mode": "1d", "tp": 2, "dp": 2, "sequence_parallel": True},
    {"mode": "serial", "dp": 2, "pp": 2, "microbatches": 2},
    {"mode": "subgraph", "tp": 2, "dp": 2, "subgrids": 2},
    {"mode": "2d", "tp": 4, "dp": 2},
    # rows split over dp x cp, the reduction summing over cp; buckets of SP's partial gradients apart
    {"mode": "1d", "tp": 2, "dp": 2, "cp": 2, "sequence_parallel": True},
]


def _world(layout: dict) -> int:
    return layout.get("tp", 1) * layout["dp"] * layout.get("pp", 1) * layout.get("cp", 1)


@pytest.mark.parametrize("layout", ZERO_LAYOUTS, ids=lambda l: "-".join(f"{k}={v}" for k, v in l.items()))
def test_zero_equals_plain_data_parallelism_and_its_cost_model(layout):
    """Catches a reduce-scatter that sums instead of averaging or hands a rank another rank's
    rows, an all-gather that leaves stale rows, a gradient norm over the slices that counts
    replicated or mirrored shards wrongly (every step is clipped, so a wrong norm changes the
    weights), a pipeline's bucket started before its last micro-batch or before the stages' sum
    of the tied table, weight decay on the wrong slices, a rank keeping more than its rows of the
    moments, a bucket started before sync_grads completed its gradients, and collectives the
    cost model does not describe (or the reverse); at stage 3 also a block's weights freed
    before its backward (or its recomputation) reads them, gathered from stale master rows, or
    gathered more or less often than the cost model prices: weights and both moments after three
    steps equal plain data parallelism's within 1e-12."""
    assert_zero_equals_ddp_and_serial(layout, stages=(1, 2, 3))


def assert_zero_equals_ddp_and_serial(layout: dict, family: str = "gpt2", stages=(1, 2),
                                      options: dict | None = None) -> None:
    """The checks of the test above, for `family` (also run by test_context_parallel's matrix):
    plain data parallelism's first loss and gradients equal serial's within 1e-10, ZeRO's weights,
    moments and norms plain data parallelism's within 1e-12, its collectives the cost model's."""
    results = run_distributed(_world(layout), _zero_against_ddp, layout, stages=stages, family=family,
                              options=options)
    for rank, result in enumerate(results):
        assert result["clipped"], rank
        assert result["to_serial"] < 1e-10, (rank, result["to_serial"])
        for stage in stages:
            r = result[stage]
            assert r["steps"] == STEPS, (rank, stage)
            assert max(r["weights"], r["moments"], r["norms"]) < 1e-12, (rank, stage, r)
            shards = layout["dp"] * layout.get("cp", 1)  # ZeRO splits over dp x cp
            assert r["owned"] == r["expected_owned"] and r["owned"] <= math.ceil(r["local"] / shards) * 1.1
            assert set(r["measured"]) == set(r["modelled"]), (rank, stage, set(r["measured"]) ^ set(r["modelled"]))
            assert r["measured"] == r["modelled"], (rank, stage)
            dp = shards  # the gradients' reduce-scatter runs in backward, the weights' all-gather after
            assert ("backward", "reduce_scatter", dp) in r["measured"]  # (stage 3: before the forward)
            assert ("forward" if stage == 3 else "optimizer", "all_gather", dp) in r["measured"]
    worst = max(max(result[stage][k] for stage in stages for k in ("weights", "moments", "norms"))
                for result in results)
    print(f"\n{family} {layout} zero {stages}: {len(results)} ranks; first loss and gradients to serial "
          f"{max(r['to_serial'] for r in results):.1e}; weights, moments, norms after {STEPS} steps to plain "
          f"data parallelism {worst:.1e}; rank 0's first step metered "
          f"{sum(e for _, e in results[0][stages[0]]['measured'].values()):,} elements = cost model")


def _overlapped_against_waited(layout: dict, family: str) -> dict:
    """Three AdamW steps of the same float64 model, one bucket per parameter, with the all-gather
    of updated weights awaited in the step and overlapped with the next forward: the largest
    difference of the full weights, the buckets, and those no module's forward read."""
    ctx, cfg, weights, replica_step = _replicas(layout, torch.float64, family)
    full = {}
    for overlap in (False, True):
        model = lattice.build_model(cfg, ctx, dtype=torch.float64)
        model.load_full_state_dict(weights)
        opt = ZeroOptimizer(model, ctx, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, stage=1, bucket_bytes=1,
                            accumulations=ctx.pipeline.m if ctx.pipeline else 1, overlap_param_gather=overlap)
        for step in range(STEPS):
            opt.zero_grad()
            replica_step(model, step)
            opt.reduce_grads()
            opt.step()
        model.state_dict()  # whose pre-hook awaits the last step's gathers (full_state_dict reads the weights)
        full[overlap] = model.full_state_dict()
    order = opt.overlap.issue_order()
    return {"diff": max(float((full[True][k] - full[False][k]).abs().max()) for k in full[False]),
            "buckets": len(order), "unread": len(order) - len(dict.fromkeys(opt.overlap.seen))}


@pytest.mark.parametrize("family,layout", [("gpt2", {"mode": "serial", "dp": 2, "pp": 2, "microbatches": 2}),
                                           ("llama", {"mode": "1d", "tp": 2, "dp": 2})],
                         ids=["gpt2-pp2-dp2", "llama-1d-dp2"])
def test_overlapped_param_gather_equals_the_gather_in_the_step(family, layout):
    """Catches a forward that reads a weight before its bucket's all-gather is awaited: a bucket
    awaited after the first module reading it, or one read other than by a module's forward
    (the last stage's mirror of the tied table, a loss head) left to the end. Weights after three
    steps with overlap_param_gather equal those with the gather awaited in the step, exactly;
    each parameter its own bucket."""
    results = run_distributed(_world(layout), _overlapped_against_waited, layout, family)
    for rank, r in enumerate(results):
        assert r["diff"] == 0.0, (rank, r)
        assert r["buckets"] > 4, (rank, r)
    if layout.get("pp", 1) > 1:  # the last stage's mirror of the table is read by the head alone
        assert any(r["unread"] for r in results), results


@pytest.mark.parametrize("family", ["bert", "llama", "t5"])
def test_every_weight_a_forward_reads_is_awaited_by_a_module_that_runs(family):
    """The overlapped all-gather of updated weights is awaited by forward pre-hooks: each weight a
    forward reads must belong to a module whose hook runs before the read. Catches a segmented
    linear (q, k and v apart: BERT's and T5's attention, grouped-query attention) whose segments'
    child modules never run: their bucket was awaited only with a module after them, and a BERT
    pipeline at ZeRO-1 or 2 failed in backward ("modified by an inplace operation", a 192 x 192
    weight) where the gather wrote it after a micro-batch's forward had saved it."""
    from lattice.parallel.param_gather import ParamGatherOverlap

    cfg = lattice.cost.model_config(family, "tiny", vocab_size=64)
    model = lattice.build_model(cfg, lattice.context("serial"), dtype=torch.float64)
    names = {id(p): name for name, p in model.named_parameters()}
    overlap = ParamGatherOverlap(model, {id(p): i for i, p in enumerate(model.parameters())}, len(names))
    tokens = torch.randint(0, 64, (2, 8))
    model.forward_backward(tokens, tokens)
    seen = set(overlap.seen)
    read = [names[id(p)] for i, p in enumerate(model.parameters()) if p.grad is not None and i not in seen]
    # (the loss head reads its weights outside a forward: no module records them, so they are
    # issued first and awaited before the first module runs)
    assert all(name.startswith("head.") for name in read), read


RUN = dict(model="tiny", vocab_size=512, batch_size=8, lr=3e-3, warmup=2, grad_clip=0.3, eval_interval=100,
           eval_batches=1, progress=False, dtype="float64", steps=4, checkpoint_interval=2)


def _train(layout: dict, out_dir: str, *, zero: int, stop_at=None, resume=None) -> list[float]:
    trainer = Trainer(TrainConfig(**RUN, zero=zero, out_dir=out_dir, stop_at=stop_at), cached_init(**layout),
                      resume=resume)
    trainer.fit()
    return [row["train_loss"] for row in trainer.history]


def test_the_trainer_reduces_over_dp_x_cp_and_its_zero_checkpoint_resumes_without_cp(tmp_path):
    """Catches a Trainer under context parallelism that sums the cp ranks' gradients twice or not
    at all (sync_grads leaves cp to the one reduction over dp x cp: DDP's average of cp x the
    loss, or ZeRO's reduce-scatter), ZeRO rows split over dp alone where dp x cp ranks hold them,
    and moments a resume without cp cannot place: dp = 2 x cp = 2 with DDP, and with ZeRO-1
    stopped at step 2 and resumed in serial, follow an uninterrupted serial run."""
    straight = _train({"mode": "serial"}, str(tmp_path / "straight"), zero=0)
    ddp = run_distributed(4, _train, {"mode": "serial", "dp": 2, "cp": 2}, str(tmp_path / "ddp"), zero=0)[0]
    first = run_distributed(4, _train, {"mode": "serial", "dp": 2, "cp": 2}, str(tmp_path / "zero"), zero=1,
                            stop_at=2)[0]
    resumed = _train({"mode": "serial"}, str(tmp_path / "serial"), zero=0,
                     resume=str(tmp_path / "zero" / "checkpoints" / "step-00000002"))
    assert len(ddp) == 4 and len(first) == len(resumed) == 2
    for got, want in zip(ddp, straight):
        assert abs(got - want) <= 1e-12 * abs(want), (ddp, straight)
    for got, want in zip(first + resumed, straight):
        assert abs(got - want) <= 1e-12 * abs(want), (first, resumed, straight)


def test_a_zero_checkpoint_resumes_without_zero_and_in_another_layout(tmp_path):
    """Catches moments saved under the wrong serial name or offset (a dp rank's rows placed as
    another's), moments a resume without ZeRO cannot find, and a trainer that steps the
    distributed optimizer differently from plain data parallelism: a run at dp = 4 with ZeRO-1,
    stopped at step 2, resumes at dp = 2 without ZeRO and in 2d (q = 2), and both follow an
    uninterrupted serial run."""
    straight = _train({"mode": "serial"}, str(tmp_path / "straight"), zero=0)
    first = run_distributed(4, _train, {"mode": "serial", "dp": 4}, str(tmp_path / "zero"), zero=1, stop_at=2)[0]
    saved = tmp_path / "zero" / "checkpoints" / "step-00000002"
    assert saved.is_dir()
    data_parallel = run_distributed(2, _train, {"mode": "serial", "dp": 2}, str(tmp_path / "dp2"), zero=0,
                                    resume=str(saved))[0]
    summa = run_distributed(4, _train, {"mode": "2d", "tp": 4}, str(tmp_path / "2d"), zero=0, resume=str(saved))[0]
    assert len(first) == 2 and len(data_parallel) == len(summa) == 2
    for got, want in zip(first + data_parallel, straight):
        assert abs(got - want) <= 1e-12 * abs(want), (first, data_parallel, straight)
    for got, want in zip(first + summa, straight):
        assert abs(got - want) <= 1e-12 * abs(want), (first, summa, straight)


def _weighted_pipeline_steps(layout: dict) -> dict:
    """Three Trainer steps under a pipeline at dp = 2 whose replicas weigh 0.75 and 1.25 (as
    padded batches with unequal labelled targets do), without ZeRO (the Trainer weights the
    accumulated gradients) and with ZeRO-1 (its buckets, started in the last micro-batch's
    backward, weight them): the largest difference of the losses and of the weights."""
    import lattice.training.trainer as trainer_module

    ctx = cached_init(**layout)
    unweighted = trainer_module.replica_weight
    trainer_module.replica_weight = lambda model, batch, ctx: (0.75, 1.25)[ctx.coord(MeshAxis.DP)]
    runs = {}
    try:
        for zero in (0, 1):
            trainer = Trainer(TrainConfig(**{**RUN, "checkpoint_interval": 0}, zero=zero), ctx)
            losses = [trainer.train_step()["train_loss"] for _ in range(3)]
            trainer.model.state_dict()  # (awaits ZeRO's last gathers)
            runs[zero] = losses, trainer.model.full_state_dict()
    finally:
        trainer_module.replica_weight = unweighted
    (loss0, w0), (loss1, w1) = runs[0], runs[1]
    return {"losses": max(abs(a - b) / abs(a) for a, b in zip(loss0, loss1)), "weights": _worst(w1, w0)}


def test_zero_weights_a_pipelines_replicas_as_the_trainer_does_without_it():
    """Catches ZeRO's buckets, started during a pipeline's last micro-batch, reducing gradients
    the Trainer has not yet weighted by the replica's share of the labelled targets (or weighting
    them twice): with replicas weighing 0.75 and 1.25, ZeRO-1 at pp = 2 x dp = 2 follows the
    Trainer without ZeRO within 1e-12 over three steps."""
    for rank, r in enumerate(run_distributed(4, _weighted_pipeline_steps,
                                             {"mode": "serial", "dp": 2, "pp": 2, "microbatches": 2})):
        assert max(r.values()) < 1e-12, (rank, r)


def _mixed_against_the_recipe(layout: dict) -> dict:
    """bf16 weights with fp32 master rows, by the textbook recipe written out here (fp32 copies
    of every weight, gradients cast to fp32 and averaged over dp with torch.distributed, torch's
    AdamW on the copies, the copies rounded into the weights) and by lattice.parallel.zero at stages 0, 1
    and 2; each rank's owned master and moment rows against the recipe's."""
    ctx, cfg, weights, replica_step = _replicas(layout, torch.float32)
    dp = ctx.dp

    ref = lattice.build_model(cfg, ctx, dtype=torch.bfloat16)
    ref.load_full_state_dict(weights)
    masters = {n: p.detach().float().clone() for n, p in ref.named_parameters()}
    decay = [masters[n] for n in masters if len(ref.specs[n].full_shape) >= 2]
    ref_opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                 {"params": [m for m in masters.values() if all(m is not x for x in decay)],
                                  "weight_decay": 0.0}], lr=1e-2, betas=(0.9, 0.95))
    for step in range(STEPS):
        for p in ref.parameters():
            p.grad = None
        replica_step(ref, step)
        for n, p in ref.named_parameters():
            masters[n].grad = p.grad.float()
            if dp > 1:
                dist.all_reduce(masters[n].grad, group=ctx.group(MeshAxis.DP))
                masters[n].grad /= dp
        norm = torch.stack([m.grad.pow(2).sum() for m in masters.values()]).sum().sqrt()
        for m in masters.values():
            m.grad *= torch.clamp(CLIP / (norm + 1e-6), max=1.0)
        ref_opt.step()
        with torch.no_grad():
            for n, p in ref.named_parameters():
                p.copy_(masters[n])
    out = {}
    for stage in (0, 1, 2):
        model = lattice.build_model(cfg, ctx, dtype=torch.bfloat16)
        model.load_full_state_dict(weights)
        opt = ZeroOptimizer(model, ctx, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, stage=stage)
        for step in range(STEPS):
            opt.zero_grad()
            with lattice.CommMeter() as meter:
                replica_step(model, step)
                opt.reduce_grads()
            norm = opt.grad_norm()
            opt.clip(norm, CLIP)
            opt.step()
        owned_masters = [(n, t, r) for _, n, t, r in opt.checkpoint_tensors(False)]  # (bf16: the master rows)
        rel = lambda a, b: float((a - b).abs().max() / b.abs().max())  # noqa: E731
        state = {k: {n: opt.state[p.master][k] for n, p in opt.pieces.items() if p.master is not None}
                 for k in ("exp_avg", "exp_avg_sq")}
        out[stage] = {
            "weights_bf16": all(p.dtype == torch.bfloat16 for p in model.parameters()),
            "weights": max(rel(p.detach().float(), ref_p.detach().float())
                           for p, ref_p in zip(model.parameters(), ref.parameters())),
            "masters": max(rel(t, masters[n][r:r + len(t)]) for n, t, r in owned_masters),
            "master_dtype": {t.dtype for _, t, _ in owned_masters},
            "moments": max(rel(state[k][n].view(-1), ref_opt.state[masters[n]][k][r:r + len(t)].reshape(-1))
                           for n, t, r in owned_masters for k in state),
            "reduced": {(op, dtype_bytes) for (phase, op, n), v in meter.summary().items() if phase == "backward"
                        and n == dp and op in ("reduce_scatter", "all_reduce")
                        for dtype_bytes in [v["bytes"] // v["elements"]]},
        }
    return out


def test_bf16_weights_with_fp32_master_rows_follow_the_textbook_recipe():
    """Catches master rows that are not fp32 (or weights that are not bf16), a gradient reduced
    in bf16 by default, masters not rounded into the weights after a step (or from stale
    copies), a stage 0 that splits anything, and moments kept for the wrong rows: every owned
    master row and moment equals the recipe's within fp32 rounding of the sums, and the bf16
    weights within one bf16 rounding."""
    results = run_distributed(2, _mixed_against_the_recipe, {"mode": "serial", "dp": 2})
    for rank, result in enumerate(results):
        for stage, r in result.items():
            assert r["weights_bf16"] and r["master_dtype"] == {torch.float32}, (rank, stage, r)
            assert r["masters"] < 1e-5 and r["moments"] < 1e-4, (rank, stage, r)
            assert r["weights"] <= 2 ** -8, (rank, stage, r)
            assert r["reduced"] == {("all_reduce" if stage == 0 else "reduce_scatter", 4)}, (rank, stage, r)


def _bf16_reduction_metered(layout: dict) -> dict:
    """One step of bf16 weights whose gradients are reduced in bf16 (--grad-reduce-dtype bf16),
    ZeRO-1: the collectives' calls and bytes, metered and from the cost model."""
    ctx, cfg, weights, replica_step = _replicas(layout, torch.float32)
    model = lattice.build_model(cfg, ctx, dtype=torch.bfloat16)
    model.load_full_state_dict(weights)
    opt = ZeroOptimizer(model, ctx, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, stage=1, reduce_dtype=torch.bfloat16)
    with lattice.CommMeter() as meter:
        replica_step(model, 0)
        opt.reduce_grads()
        opt.step()
    analytic = lattice.cost.estimate(cfg, layout["mode"], batch=REPLICA_BATCH, seq=T, rank=ctx.rank, zero=1,
                                     precision="bf16", grad_reduce_dtype="bf16",
                                     **{k: v for k, v in layout.items() if k != "mode"})
    return {"measured": {k: (v["calls"], v["elements"], v["bytes"]) for k, v in meter.summary().items() if v["calls"]},
            "modelled": {k: (v["calls"], v["elements"], v["bytes"]) for k, v in analytic.summary().items() if v["calls"]}}


def test_a_bf16_gradient_reduction_is_priced_at_its_own_bytes():
    """Catches a cost model that prices --grad-reduce-dtype bf16's reduce-scatter at the fp32
    master rows' 4 bytes (or buckets it by them): ZeRO-1 of bf16 weights at dp = 2, the metered
    calls and bytes of one step equal the cost model's, the reduce-scatter at 2 bytes an element."""
    for rank, r in enumerate(run_distributed(2, _bf16_reduction_metered, {"mode": "serial", "dp": 2})):
        assert r["measured"] == r["modelled"], (rank, r)
        calls, elements, nbytes = r["measured"][("backward", "reduce_scatter", 2)]
        assert calls >= 1 and nbytes == 2 * elements > 0, (rank, r)


@pytest.mark.parametrize("given,named", [
    ({"precision": "bf16", "dtype": "float64"}, "--dtype float64"),
    ({"precision": "bf16", "bf16": True}, "--bf16"),
    ({"grad_reduce_dtype": "bf16"}, "--precision bf16"),
    ({"zero": 4}, "zero must be one of"),
    ({"overlap_param_gather": True}, "--zero 1, 2 or 3"),
    ({"zero": 2, "reshard_after_forward": False}, "--zero 3"),
    ({"reshard_microbatches": True}, "--zero 3"),
    ({"overlap_grad_reduce": False}, "DDP always overlaps"),
])
def test_refuses_what_the_optimizer_cannot_do(given, named):
    """Catches a bf16 run silently combined with float64 weights or with autocast, a bf16
    gradient reduction asked of fp32 gradients, a ZeRO stage that does not exist, and ZeRO's
    overlaps asked of a run without it: each is one line naming the flag, before any process
    group."""
    with pytest.raises(LatticeConfigError, match=named.replace("-", r"\-")):
        TrainConfig(**given)
