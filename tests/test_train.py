"""The trainer against plain computations and against itself under other layouts: exact resume,
data parallelism (and any tensor-parallel mode present) following the serial trajectory,
gradient clipping, the schedule, weight decay groups, bf16 and activation checkpointing."""

import csv
import math

import pytest
import torch
from multiproc import cached_init, run_distributed

import lattice
from lattice import checkpoint
from lattice.checkpoint import convert
from lattice.training.metrics import METRIC_COLUMNS
from lattice.training.optim import grad_norm, lr_at
from lattice.training.trainer import TrainConfig, Trainer

# tiny model, small vocabulary; grad_clip low enough that clipping is active on most steps
TINY = dict(model="tiny", vocab_size=512, batch_size=4, lr=3e-3, warmup=3, grad_clip=0.3,
            eval_interval=5, eval_batches=2, progress=False)


def serial():
    return lattice.init("serial")


@pytest.mark.parametrize("form", ["sharded", "through_one_file", "async"])
def test_resume_is_bitwise_exact(tmp_path, form):
    """Catches any state a checkpoint forgets (optimizer moments, step count, schedule position,
    dropout stream, data position), with a background save (which must write the weights of its
    step, not ones training changed meanwhile), and any the conversion to one file and back
    loses (`lattice convert` export, and the import `--resume` does of a single file): 10 steps
    + save + resume 10 must equal 20 straight steps."""
    cfg = TrainConfig(**{**TINY, "dropout": 0.1}, steps=20)
    straight = Trainer(cfg, serial())
    done = straight.fit()
    run = dict(**{**TINY, "dropout": 0.1}, steps=20, out_dir=str(tmp_path), checkpoint_interval=3,
               async_checkpoint=form == "async")
    first = Trainer(TrainConfig(**run, stop_at=10), serial())
    assert first.fit()["stopped_by"] == "stop_at" and first.step == 10
    resume = tmp_path
    if form == "through_one_file":
        single = convert.export_single(checkpoint.read(tmp_path), tmp_path.parent / "exported.pt")
        resume = convert.import_single(checkpoint.read(single), tmp_path.parent / "imported")
    second = Trainer(TrainConfig(**run), serial(), resume=resume)
    assert second.step == 10
    resumed = second.fit()
    split = [r["train_loss"] for r in first.history + second.history]
    assert split == [r["train_loss"] for r in done["history"]]
    assert resumed["val_loss"] == done["val_loss"]
    for (name, a), b in zip(straight.model.named_parameters(), second.model.parameters()):
        assert torch.equal(a, b), name
    rows = list(csv.DictReader(open(tmp_path / "metrics.csv")))  # the resumed run appended
    assert [int(r["step"]) for r in rows] == list(range(1, 21))


def _layout_run(mode: str, tp: int, dp: int, steps: int, **options):
    ctx = cached_init(mode=mode, tp=tp, dp=dp, **options)
    trainer = Trainer(TrainConfig(**TINY, steps=steps), ctx)
    with lattice.CommMeter() as meter:
        rows = [trainer.train_step()]
    dp_elements = meter.total_elements(op="all_reduce", phase="backward") if mode == "serial" else None
    rows += [trainer.train_step() for _ in range(steps - 1)]
    return {"rows": rows, "val": trainer.evaluate(), "params": trainer.model.full_state_dict(),
            "dp_elements": dp_elements, "numel": sum(p.numel() for p in trainer.model.parameters())}


def _compare_with_serial(results, steps):
    ref = Trainer(TrainConfig(**TINY, steps=steps), serial())
    ref_rows = [ref.train_step() for _ in range(steps)]
    ref_val, ref_params = ref.evaluate(), ref.model.full_state_dict()
    assert any(r["grad_norm"] > TINY["grad_clip"] for r in ref_rows)  # clipping was exercised
    for res in results:
        for got, want in zip(res["rows"], ref_rows):
            assert abs(got["train_loss"] - want["train_loss"]) < 1e-5, (got, want)
            assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5)
        assert abs(res["val"] - ref_val) < 1e-5
        for name, want in ref_params.items():
            torch.testing.assert_close(res["params"][name], want, rtol=0, atol=2e-5, msg=name)
    return results


def test_data_parallel_follows_serial_trajectory():
    """Catches a dp gradient sync that sums instead of averaging, replicas training on the same
    rows, a gradient norm that counts each replica's copy, and DDP traffic CommMeter misses."""
    steps = 6
    results = _compare_with_serial(run_distributed(2, _layout_run, "serial", 1, 2, steps), steps)
    for res in results:  # DDP's hook reported one all-reduce of every gradient element
        assert res["dp_elements"] == res["numel"]


@pytest.mark.parametrize("mode,tp", [("1d", 2), ("2d", 4)])
def test_tensor_parallel_mode_follows_serial_trajectory(mode, tp):
    """Catches a sharded gradient norm that counts replicated shards more than once (clipping is
    active, so a wrong norm changes the trajectory) and layout-dependent training."""
    _compare_with_serial(run_distributed(tp, _layout_run, mode, tp, 1, 3), 3)


def test_data_parallel_ranks_holding_no_parameters_follow_serial_trajectory():
    """Catches the Trainer wrapping a rank that holds no parameters in DDP, which refuses it (the
    planner's validation crashed on such a layout): with common="subgrid" and projections="common"
    sub-graph's second sub-grid runs attention alone, and with dp = 2 both its ranks hold nothing
    while the first sub-grid's are averaged as usual."""
    _compare_with_serial(run_distributed(4, _layout_run, "subgraph", 2, 2, 3, common="subgrid",
                                         projections="common"), 3)


def _accumulated_steps(layout: dict, zero: int) -> dict:
    """Two float64 steps of the Trainer with the replica batch whole and in 2 micro-batches, the
    first half of every replica's rows with most targets unlabelled (so the micro-batches weigh 1:4
    or so, not 1:1); the losses, the weights after them and what the step's collectives moved."""
    from lattice.data.batches import Batch
    from lattice.modes.kernels.loss import IGNORE_INDEX

    out = {}
    for m in (1, 2):
        ctx = cached_init(**layout, **({"microbatches": m} if m > 1 else {}))
        trainer = Trainer(TrainConfig(**TINY, steps=2, dtype="float64", zero=zero), ctx)
        whole = trainer.task.train_batch

        def unevenly_labelled(*args, **kwargs):
            b = whole(*args, **kwargs)
            targets = b.targets.clone()
            targets[:len(targets) // 2, 3:] = IGNORE_INDEX  # each replica alike: the global count is dp x its own
            return Batch(b.tokens, targets, b.inputs, ctx.dp * int((targets != IGNORE_INDEX).sum()))

        trainer.task.train_batch = unevenly_labelled
        with lattice.CommMeter() as meter:
            losses = [trainer.train_step()["train_loss"]]
        losses.append(trainer.train_step()["train_loss"])
        trainer.model.state_dict()  # (awaits ZeRO's last gathers)
        out[m] = {"losses": losses, "params": trainer.model.full_state_dict(), "calls": meter.summary()}
    return out


@pytest.mark.parametrize("layout,zero", [({"mode": "serial", "dp": 2}, 0), ({"mode": "serial", "dp": 2}, 1),
                                         ({"mode": "1d", "tp": 2}, 0), ({"mode": "serial", "cp": 2}, 0)],
                         ids=["ddp", "zero1", "1d", "cp"])
def test_gradient_accumulation_equals_the_whole_batch(layout, zero):
    """Catches gradient accumulation (--microbatches without --pp) that averages its micro-batches'
    means alike where their labelled targets differ, lets DDP reduce in every pass (no no_sync),
    starts ZeRO's reductions before the last pass's gradients arrive, or runs the batch whole:
    two micro-batches give the whole batch's losses and weights in float64, the data-parallel
    gradient reduction moves the same elements once, and 1d's forward all-reduces run in both passes."""
    for rank, r in enumerate(run_distributed(2, _accumulated_steps, layout, zero)):
        for a, b in zip(r[1]["losses"], r[2]["losses"]):
            assert abs(a - b) < 1e-12 * abs(a), (rank, a, b)
        for name, want in r[1]["params"].items():
            torch.testing.assert_close(r[2]["params"][name], want, rtol=0, atol=1e-12, msg=name)
        reduced = {m: {k: v["elements"] for k, v in r[m]["calls"].items()
                       if k[0] == "backward" and k[1] in ("all_reduce", "reduce_scatter") and k[2] == 2
                       and layout.get("dp", 1) == 2} for m in (1, 2)}
        assert reduced[1] == reduced[2], reduced
        if layout["mode"] == "1d":
            fwd = {m: r[m]["calls"][("forward", "all_reduce", 2)]["calls"] for m in (1, 2)}
            assert fwd[2] > fwd[1], fwd  # (a pass's all-reduces twice, the step's own once)


def test_grad_norm_and_clipping_match_plain_pytorch():
    """Catches a norm over the wrong set of tensors or a clip that scales by the wrong factor."""
    trainer = Trainer(TrainConfig(**TINY, steps=5), serial())
    x, y, _, _ = trainer.val_set[0]
    trainer.model(x, y).backward()
    grads = [p.grad for p in trainer.model.parameters()]
    assert float(grad_norm(trainer.model, trainer.ctx)) == pytest.approx(float(torch.cat([g.flatten() for g in grads]).norm()), rel=1e-6)
    row = trainer.train_step()  # the clipped gradients stay in .grad after the step
    clipped = float(torch.cat([p.grad.flatten() for p in trainer.model.parameters()]).norm())
    assert row["grad_norm"] > TINY["grad_clip"] and clipped == pytest.approx(TINY["grad_clip"], rel=1e-4)


def test_schedule_warms_up_linearly_then_follows_a_cosine():
    """Catches an off-by-one warmup, a cosine that ends elsewhere than lr * min_lr_ratio, or a
    schedule not at lr at the end of warmup."""
    def at(step):
        return lr_at(step, lr=1.0, warmup=4, steps=104, min_lr_ratio=0.1)

    assert [at(s) for s in range(4)] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert at(4) == pytest.approx(1.0)
    assert at(54) == pytest.approx(0.55)  # halfway: mean of 1.0 and 0.1
    assert at(4 + 25) == pytest.approx(0.1 + 0.9 * (1 + math.cos(math.pi / 4)) / 2)
    assert at(104) == pytest.approx(0.1)


def test_weight_decay_only_on_matrices():
    """Catches decay on biases / LayerNorm gains (or none on the weight matrices)."""
    trainer = Trainer(TrainConfig(**TINY, steps=1), serial())
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    decay, no_decay = trainer.optimizer.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert {names[id(p)] for p in decay["params"]} == {
        n for n, p in trainer.model.named_parameters() if p.dim() >= 2}
    assert "embed.wte" in {names[id(p)] for p in decay["params"]}
    assert "blocks.0.ln_1.weight" in {names[id(p)] for p in no_decay["params"]}


def test_bf16_autocast_changes_the_matmuls_only_slightly():
    """Catches a bf16 flag that does nothing (identical loss) or breaks the loss."""
    fp32 = Trainer(TrainConfig(**TINY, steps=2), serial()).train_step()["train_loss"]
    bf16 = Trainer(TrainConfig(**TINY, steps=2, bf16=True), serial()).train_step()["train_loss"]
    assert bf16 != fp32 and bf16 == pytest.approx(fp32, rel=2e-2)


@pytest.mark.parametrize("kind", ["full", "selective"])
def test_activation_checkpointing_gives_the_same_training(kind):
    """Catches recomputation (whole blocks, or all but their products) that draws different
    dropout masks or changes gradients."""
    plain = Trainer(TrainConfig(**{**TINY, "dropout": 0.1}, steps=3), serial())
    ckpt = Trainer(TrainConfig(**{**TINY, "dropout": 0.1}, steps=3, activation_checkpointing=kind == "full",
                               selective_checkpointing=kind == "selective"), serial())
    assert ckpt.model.recompute == kind
    for _ in range(3):
        assert plain.train_step()["train_loss"] == ckpt.train_step()["train_loss"]
    for a, b in zip(plain.model.parameters(), ckpt.model.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_metrics_csv_rows(tmp_path):
    """Catches a metrics file with missing columns, a row per eval instead of per step, or
    validation losses that disagree with the trainer's."""
    trainer = Trainer(TrainConfig(**TINY, steps=7, out_dir=str(tmp_path)), serial())
    result = trainer.fit()
    rows = list(csv.DictReader(open(tmp_path / "metrics.csv")))
    assert tuple(rows[0]) == METRIC_COLUMNS
    assert [int(r["step"]) for r in rows] == list(range(1, 8))
    assert [r["step"] for r in rows if r["val_loss"]] == ["5", "7"]
    assert float(rows[-1]["val_loss"]) == pytest.approx(result["val_loss"])
    assert all(float(r["tokens_per_s"]) > 0 for r in rows)
    assert float(rows[0]["lr"]) == pytest.approx(TINY["lr"] / TINY["warmup"])


def test_tensorboard_logs_the_metrics_csv_numbers(tmp_path):
    """Catches TensorBoard scalars that disagree with metrics.csv (or are missing), and a FLOP
    rate that is not the cost model's FLOPs over the step time."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from lattice import cost

    trainer = Trainer(TrainConfig(**{**TINY, "eval_interval": 3}, steps=3, out_dir=str(tmp_path), peak_tflops=1.0), serial())
    trainer.fit()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    rows = list(csv.DictReader(open(tmp_path / "metrics.csv")))
    for key in ("train_loss", "grad_norm", "lr"):
        logged = [e.value for e in events.Scalars(f"train/{key}")]
        assert logged == pytest.approx([float(r[key]) for r in rows], rel=1e-6), key
    assert [e.value for e in events.Scalars("train/val_loss")] == pytest.approx([float(rows[-1]["val_loss"])], rel=1e-6)
    c = cost.estimate(trainer.model_config, "serial", batch=TINY["batch_size"])
    flops = c.flops["forward"] + c.flops["backward"]
    for e, r in zip(events.Scalars("perf/tflops_per_rank"), rows):
        seconds = TINY["batch_size"] * trainer.model_config.seq_len / float(r["tokens_per_s"])
        assert e.value == pytest.approx(flops / seconds / 1e12, rel=1e-4)
    assert [e.value for e in events.Scalars("perf/mfu")] == pytest.approx(
        [e.value for e in events.Scalars("perf/tflops_per_rank")], rel=1e-6)  # peak 1 TFLOP/s
    assert events.Scalars("perf/peak_memory_mib")[-1].value > 0
