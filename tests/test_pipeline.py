"""Pipeline parallelism: stages of whole blocks under GPipe, 1F1B and interleaved 1F1B, alone and
with every tensor layout inside a stage and data parallelism, equal to serial in float64; the
point-to-point traffic equal to its formula; bad requests refused in one line on every rank."""

import math

import pytest
import torch
from multiproc import cached_init, run_distributed
from numerics import random_batch, rel_diff

import lattice
from lattice import GPTConfig, checkpoint
from lattice.cli import main as cli
from lattice.cost import p2p_elements
from lattice.parallel.comm import CommMeter
from lattice.parallel.context import LatticeConfigError, MeshAxis
from lattice.training.trainer import TrainConfig, Trainer

BATCH, T = 8, 16


def _cfg(**overrides) -> GPTConfig:
    return GPTConfig(**{**dict(vocab_size=61, seq_len=T, d_model=32, n_heads=4, n_layers=4), **overrides})


def _batch(cfg):
    return random_batch(BATCH, T, cfg.vocab_size, seed=7)


def _serial_reference(cfg):
    serial = lattice.GPT(cfg, lattice.context("serial"), dtype=torch.float64)
    x, y = _batch(cfg)
    loss = serial(x, y)
    loss.backward()
    return serial, float(loss.detach()), {n: p.grad for n, p in serial.named_parameters()}


def _pipelined_step(layout: dict, cfg_overrides: dict):
    """Float64 weights from the serial model, the same global batch split over dp: the replica's
    loss from forward_backward, the full gradients, and the no-grad evaluation loss."""
    cfg = _cfg(**cfg_overrides)
    serial, _, _ = _serial_reference(cfg)
    ctx = cached_init(**layout)
    model = lattice.build_model(cfg, ctx, dtype=torch.float64)
    model.load_full_state_dict(serial.full_state_dict())
    x, y = _batch(cfg)
    rows = BATCH // ctx.dp
    d = ctx.coord(MeshAxis.DP)
    mine = slice(d * rows, (d + 1) * rows)
    loss = model.forward_backward(x[mine], y[mine])
    grads = model.full_grad_dict()
    model.eval()
    with torch.no_grad():
        evaluated = float(model(x[mine], y[mine]))
    return loss, grads, evaluated, d


LAYOUTS = [  # (lattice.init keywords, model overrides)
    (dict(mode="serial", pp=2, microbatches=2, pp_schedule="1f1b"), {}),
    (dict(mode="serial", pp=2, microbatches=4, pp_schedule="gpipe"), dict(tie_embeddings=False)),
    (dict(mode="serial", pp=2, microbatches=1, pp_schedule="gpipe"), {}),
    (dict(mode="serial", pp=2, microbatches=4, pp_schedule="1f1b"), dict(tie_embeddings=False, bias=False)),
    (dict(mode="serial", pp=2, microbatches=4, pp_schedule="interleaved"), {}),
    (dict(mode="serial", pp=2, microbatches=2, pp_schedule="interleaved"), dict(tie_embeddings=False)),
    (dict(mode="serial", pp=4, microbatches=4, pp_schedule="1f1b"), {}),
    (dict(mode="serial", pp=4, microbatches=4, pp_schedule="interleaved"), dict(n_layers=8)),
    (dict(mode="serial", pp=2, microbatches=2, pp_layers="1,3"), {}),
    (dict(mode="1d", tp=2, pp=2, microbatches=4), {}),
    (dict(mode="1d", tp=2, pp=2, microbatches=4, pp_scatter_gather=False), dict(tie_embeddings=False)),
    (dict(mode="1d", tp=2, pp=2, microbatches=2, sequence_parallel=True), {}),
    (dict(mode="2d", tp=4, pp=2, microbatches=2), {}),
    (dict(mode="subgraph", tp=2, pp=2, microbatches=2, subgrids=2), {}),
    (dict(mode="subgraph", tp=2, pp=2, microbatches=2, subgrids=2, common="subgrid"), dict(tie_embeddings=False)),
    (dict(mode="serial", pp=2, dp=2, microbatches=2), {}),
]


def _label(layout, overrides):
    parts = [f"{k}={v}" for k, v in layout.items()] + [f"{k}={v}" for k, v in overrides.items()]
    return ",".join(parts)


@pytest.mark.parametrize("layout,overrides", LAYOUTS, ids=[_label(*a) for a in LAYOUTS])
def test_pipeline_equals_serial_in_float64(layout, overrides):
    """Catches a stage that runs the wrong blocks, a micro-batch loss not scaled by 1/m (the
    gradients m times too large), a tied table whose two halves of the gradient are not summed
    (or summed twice), scatter/gather slicing the wrong piece, and schedules that drop or repeat a
    micro-batch: loss, every full gradient and the evaluation loss equal serial to 1e-10."""
    cfg = _cfg(**overrides)
    _, serial_loss, serial_grads = _serial_reference(cfg)
    world = layout.get("tp", 1) * layout["pp"] * layout.get("dp", 1)
    results = run_distributed(world, _pipelined_step, layout, overrides)
    x, y = _batch(cfg)
    for loss, grads, evaluated, d in results:
        if layout.get("dp", 1) == 1:
            assert abs(loss - serial_loss) <= 1e-10 * abs(serial_loss)
            assert abs(evaluated - serial_loss) <= 1e-10 * abs(serial_loss)
        else:  # each replica's own half of the batch
            rows = BATCH // layout["dp"]
            ref = lattice.GPT(cfg, lattice.context("serial"), dtype=torch.float64)
            ref.load_full_state_dict(_serial_reference(cfg)[0].full_state_dict())
            with torch.no_grad():
                half = float(ref(x[d * rows:(d + 1) * rows], y[d * rows:(d + 1) * rows]))
            assert abs(loss - half) <= 1e-10 * abs(half) and abs(evaluated - half) <= 1e-10 * abs(half)
        for name, g in serial_grads.items():
            assert rel_diff(grads[name], g) < 1e-10, name


# ----------------------------------------------------------------------------- training
TRAIN = dict(model="tiny", vocab_size=512, batch_size=8, lr=3e-3, warmup=5, grad_clip=0.5, eval_interval=100,
             eval_batches=1, progress=False, steps=30)


def _save_pipelined(root: str, steps: int):
    trainer = Trainer(TrainConfig(**TRAIN, dtype="float64"), cached_init(mode="1d", tp=2, pp=2, microbatches=2))
    losses = [trainer.train_step()["train_loss"] for _ in range(steps)]
    trainer.save(root)
    return losses


def _resume_pipelined(root: str, steps: int):
    trainer = Trainer(TrainConfig(**TRAIN, dtype="float64"), cached_init(mode="serial", pp=2, microbatches=4),
                      resume=root)
    return trainer.step, [trainer.train_step()["train_loss"] for _ in range(steps)]


def test_a_checkpoint_moves_between_pipeline_layouts(tmp_path):
    """Catches stage-local parameters or moments missing from a checkpoint (or the tied mirror
    written instead of the table), so that a run cannot continue under another pp: float64, 3
    steps at pp=2 x 1d tp=2, a sharded save, 3 steps in serial, then 3 more at pp=2 (serial
    stages) from serial's checkpoint; all equal 9 serial steps to 1e-10."""
    straight = Trainer(TrainConfig(**TRAIN, dtype="float64"), lattice.init("serial"))
    expect = [straight.train_step()["train_loss"] for _ in range(9)]
    first = run_distributed(4, _save_pipelined, str(tmp_path / "a"), 3)[0]
    middle = Trainer(TrainConfig(**TRAIN, dtype="float64"), lattice.init("serial"), resume=tmp_path / "a")
    assert middle.step == 3
    second = [middle.train_step()["train_loss"] for _ in range(3)]
    middle.save(tmp_path / "b")
    start, third = run_distributed(2, _resume_pipelined, str(tmp_path / "b"), 3)[0]
    assert start == 6
    got = torch.tensor(first + second + third, dtype=torch.float64)
    assert rel_diff(got, torch.tensor(expect, dtype=torch.float64)) < 1e-10, (got, expect)


# ----------------------------------------------------------------------------- point-to-point traffic
def _metered_step(layout: dict):
    cfg = _cfg(tie_embeddings=False)
    ctx = cached_init(**layout)
    model = lattice.build_model(cfg, ctx, dtype=torch.float64)
    x, y = _batch(cfg)
    with CommMeter() as meter:
        model.forward_backward(x, y)
    sent = {phase: sum(r.elements for r in meter.records if r.op == "send" and r.phase == phase)
            for phase in ("forward", "backward")}
    return ctx.stage, sent


@pytest.mark.parametrize("layout", [dict(mode="1d", tp=2, pp=2, microbatches=4),
                                    dict(mode="1d", tp=2, pp=2, microbatches=4, pp_scatter_gather=False),
                                    dict(mode="serial", pp=2, microbatches=4, pp_schedule="interleaved"),
                                    dict(mode="1d", tp=2, pp=2, microbatches=2, sequence_parallel=True)],
                         ids=["1d-sg", "1d-no-sg", "interleaved", "1d-sp"])
def test_point_to_point_elements_equal_the_formula(layout):
    """Catches traffic the formula does not predict (a stage sending the whole replicated
    activation despite scatter/gather, gradients sent twice, an interleaved chunk sending to
    itself) and a formula that drifted from the schedule: the elements every rank's schedule
    hands to send operations in one step equal `pipeline.p2p_elements`."""
    cfg = _cfg(tie_embeddings=False)
    world = layout.get("tp", 1) * layout["pp"]
    for stage, sent in run_distributed(world, _metered_step, layout):
        expect = p2p_elements(cfg, lattice.Layout.of(**layout), batch=BATCH, stage=stage)
        assert sent == expect, (stage, sent, expect)


def test_scatter_gather_divides_the_traffic_by_t():
    """Catches a scatter/gather that sends the whole activation anyway: with t = 2 the measured
    point-to-point elements halve, exactly."""
    on = dict(run_distributed(4, _metered_step, dict(mode="1d", tp=2, pp=2, microbatches=4)))
    off = dict(run_distributed(4, _metered_step, dict(mode="1d", tp=2, pp=2, microbatches=4,
                                                         pp_scatter_gather=False)))
    assert on[0]["forward"] * 2 == off[0]["forward"] > 0
    assert on[1]["backward"] * 2 == off[1]["backward"] > 0
    residual = (BATCH // 4) * T * 32  # one micro-batch's (B/m, T, h)
    assert off[0]["forward"] == 4 * residual


# ----------------------------------------------------------------------------- bad requests
def _refusal(layout: dict, cfg_overrides: dict, batch: int):
    try:
        ctx = cached_init(**layout)
        model = lattice.build_model(_cfg(**cfg_overrides), ctx)
        x = torch.zeros(batch, T, dtype=torch.int64)
        model.forward_backward(x, x)
    except LatticeConfigError as e:
        return str(e)
    return None


@pytest.mark.parametrize("layout,overrides,batch,expect", [
    (dict(mode="serial", pp=2), dict(n_layers=3), 8, "n_layers = 3 blocks do not split evenly into 2 stages"),
    (dict(mode="serial", pp=2, pp_layers="1,1"), {}, 8, "add up to 2 blocks, but the model has n_layers = 4"),
    (dict(mode="serial", pp=2, microbatches=3), {}, 8, "does not split into 3 micro-batches"),
    (dict(mode="serial", pp=2, microbatches=3, pp_schedule="interleaved"), {}, 6, "multiple of pp = 2 micro-batches"),
    (dict(mode="serial", pp=2, pp_schedule="interleaved"), dict(n_layers=2), 8, "cannot fill 4 virtual stages"),
    (dict(mode="serial", pp=2, pp_schedule="interleaved"), dict(n_layers=6), 8, "do not split evenly into 4 virtual"),
    (dict(mode="serial", pp=2, microbatches=1, pp_schedule="1f1b"), {}, 8, "1F1B needs at least pp = 2 micro-batches"),
    (dict(mode="2d", tp=4, pp=2, microbatches=4), {}, 4,
     "its micro-batches of 1: batch size = 1 is not divisible by the 2D mesh side q = 2; replica batches that "
     "work with everything else as given: 8"),
    (dict(mode="1d", tp=2, pp=2, microbatches=4), {}, 8, None),  # fits: no refusal
], ids=["layers", "explicit-split", "microbatches", "interleaved-m", "interleaved-layers", "interleaved-split", "1f1b-m",
        "2d-microbatch",
        "fits"])
def test_bad_pipeline_requests_are_refused_in_one_line_on_every_rank(layout, overrides, batch, expect):
    """Catches a bad split or micro-batch count that surfaces as a hang in the schedule or a
    shape error on one stage: every rank raises the same one-line message before any
    collective."""
    world = layout.get("tp", 1) * layout["pp"]
    try:
        lattice.context(**layout)
    except LatticeConfigError as e:  # refused by the layout itself, before any process
        assert expect is not None and expect in str(e) and "\n" not in str(e), str(e)
        return
    errors = run_distributed(world, _refusal, layout, overrides, batch)
    assert len(set(errors)) == 1
    if expect is None:
        assert errors[0] is None
    else:
        assert errors[0] is not None and expect in errors[0] and "\n" not in errors[0], errors[0]


def test_a_world_that_does_not_match_tp_pp_dp_is_refused(capsys):
    """Catches a launch whose process count is not tp x pp x dp (the stages would wait on ranks
    that do not exist)."""
    assert cli.main(["train", "--nproc", "2", "--pp", "2", "--tp", "2", "--mode", "1d", "--model", "tiny"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "pp=2" in err and "use --nproc 4" in err
    with pytest.raises(LatticeConfigError, match="configure pipeline parallelism, which needs pp > 1"):
        lattice.context("serial", pp_schedule="gpipe")
    assert lattice.context("serial", microbatches=4).pipeline is None  # without a pipeline: gradient accumulation


def test_pipeline_options_from_the_command_line(tmp_path, capsys):
    """Catches --pp flags that do not reach the layout: `lattice info` prints the stages."""
    assert cli.main(["info", "--mode", "1d", "--tp", "2", "--pp", "2", "--pp-schedule", "interleaved",
                     "--microbatches", "4", "--model", "tiny", "--n-layers", "4"]) == 0
    out = capsys.readouterr().out
    assert "pipeline: 2 stages, schedule interleaved, 4 micro-batches, 2 virtual stages per rank" in out
    assert "stage 0 (chunk 0): embed, drop, blocks 0-0; ranks [0, 1]" in out  # the model's parts, by module name
    assert "stage 1 (chunk 3): blocks 3-3, ln_f, head, loss; ranks [2, 3]" in out
    assert f"bubble (p-1)/(v m) = {1 / 8:.3f}" in out


def test_train_command_with_pp_prints_serial_losses(tmp_path, capfd):
    """Catches a pipelined `lattice train` whose printed losses differ from serial's (the
    acceptance run, on the tiny model to keep the suite fast)."""
    args = ["--model", "tiny", "--steps", "10", "--eval-interval", "5", "--no-progress", "--batch-size", "8"]

    def run(extra, out):  # in this process; capfd also sees the launched workers' output
        assert cli.main(["train", *args, *extra, "--out-dir", str(out)]) == 0, capfd.readouterr().err[-3000:]
        return [line for line in capfd.readouterr().out.splitlines() if line.startswith(("step ", "final val loss"))]

    serial = run([], tmp_path / "serial")
    piped = run(["--mode", "1d", "--tp", "2", "--pp", "2", "--nproc", "4"], tmp_path / "pp")
    assert piped == serial and len(serial) == 3
    assert checkpoint.read(tmp_path / "pp")["layout"]["pp"] == 2


def test_bubble_formula():
    """The schedule's idle fraction as docs/references.md#megatron-lm states it: (p-1)/m, interleaved (p-1)/(v m)."""
    from lattice.parallel.pipeline_config import PipelineConfig

    assert PipelineConfig(stages=4, microbatches=8).bubble() == 3 / 8
    assert PipelineConfig(stages=4, microbatches=8, schedule="interleaved").bubble() == 3 / 16
    assert math.isclose(PipelineConfig(stages=4, microbatches=16, schedule="gpipe").bubble(), 3 / 16)


def _hf_export_and_generate(layout: dict):
    cfg = _cfg()
    serial = lattice.GPT(cfg, lattice.context("serial"), dtype=torch.float64)
    model = lattice.build_model(cfg, cached_init(**layout), dtype=torch.float64)
    model.load_full_state_dict(serial.full_state_dict())
    exported, expect = model.to_hf_state_dict(), serial.to_hf_state_dict()
    same = sorted(exported) == sorted(expect) and all(torch.equal(exported[k], expect[k]) for k in expect)
    try:
        model.generate(torch.zeros(1, 2, dtype=torch.int64), 2)
        refusal = None
    except LatticeConfigError as e:
        refusal = str(e)
    return same, refusal


def test_hf_export_under_pp_and_generation_refused_in_one_line():
    """Catches an export that takes the tied table from the mirror or misses the stages a rank
    does not hold, and generation that would hang waiting for other stages."""
    for same, refusal in run_distributed(4, _hf_export_and_generate, dict(mode="1d", tp=2, pp=2)):
        assert same
        assert refusal and "pp = 1" in refusal and "\n" not in refusal


def _dropout_step(layout: dict, checkpointing: bool):
    cfg = _cfg(dropout=0.2)
    model = lattice.build_model(cfg, cached_init(**layout), dtype=torch.float64, activation_checkpointing=checkpointing)
    x, y = _batch(cfg)
    losses = [model.forward_backward(x, y) for _ in range(2)]  # two steps: the counts move on
    return losses, model.full_grad_dict()


def test_recomputed_blocks_draw_the_dropout_masks_of_their_first_pass():
    """Catches activation checkpointing under a schedule recomputing a block with another
    micro-batch's dropout masks (1F1B runs other micro-batches between a forward and its
    backward): with dropout on, the losses and gradients with and without checkpointing agree."""
    layout = dict(mode="1d", tp=2, pp=2, microbatches=4)
    plain = run_distributed(4, _dropout_step, layout, False)
    recomputed = run_distributed(4, _dropout_step, layout, True)
    for (l1, g1), (l2, g2) in zip(plain, recomputed):
        assert l1 == pytest.approx(l2, rel=1e-12)
        assert all(rel_diff(g1[k], g2[k]) < 1e-10 for k in g1)
    assert plain[0][0][0] != plain[0][0][1]  # the masks differ between steps


def _two_batch_sizes(layout: dict):
    cfg = _cfg()
    serial = lattice.GPT(cfg, lattice.context("serial"), dtype=torch.float64)
    model = lattice.build_model(cfg, cached_init(**layout), dtype=torch.float64)
    model.load_full_state_dict(serial.full_state_dict())
    x, y = _batch(cfg)
    out = []
    for rows in (8, 4, 8):
        out.append((model.forward_backward(x[:rows], y[:rows]), float(serial(x[:rows], y[:rows]).detach())))
    return out


def test_a_new_batch_size_rebuilds_the_stages():
    """Catches stages whose declared shapes stay those of the first batch (the next batch of
    another size would fail in the schedule or hang)."""
    for pairs in run_distributed(4, _two_batch_sizes, dict(mode="1d", tp=2, pp=2, microbatches=2)):
        for got, expect in pairs:
            assert abs(got - expect) <= 1e-10 * expect
