"""The analytic cost model (lattice.cost) against the papers' own expressions, against counting on
the layouts, and against what the modes actually communicate, hold and save (CommMeter, the
parameters a rank builds, the tensors autograd keeps)."""

import argparse
import dataclasses
import math
import re

import pytest
import torch
from multiproc import cached_init, run_distributed

import lattice
from lattice import cost
from lattice.cli import main as cli
from lattice.cli import plan as cost_plan
from lattice.cost import model_config
from lattice.parallel.context import MeshAxis

# ----------------------------------------------------------------------------- the papers


@pytest.mark.parametrize("b,s,h,p", [(12, 512, 3072, 4), (24, 512, 3072, 16), (30, 512, 8192, 64), (3, 7, 18, 9)])
def test_optimus_table1_reproduced(b, s, h, p):
    """Catches a SUMMA product whose broadcasts / reduces are miscounted (e.g. a backward that
    forgets Alg. 3's reduces, or a weight block of the wrong size) or Megatron f/g pairs counted
    wrong: one layer's linear-layer traffic must equal Optimus Table 1 as printed."""
    paper, model = cost.optimus_table1(b, s, h, p), cost.layer_table(b, s, h, p)
    for mode in ("1d", "2d"):
        for key in ("forward", "backward", "forward_mults", "backward_mults"):
            assert model[mode][key] == pytest.approx(paper[mode][key], rel=1e-12), (mode, key)


def test_3d_and_subgraph_layer_volumes_match_their_closed_forms():
    """Catches a 3D linear that gathers or scatters the wrong block, or a sub-graph branch whose
    split/join volume is not B·T·h/n_g per rank. Closed forms worked by hand from docs/references.md#3d
    (per linear: all-gather X [M/q², N/q] along j, W [N/q², K/q] along i, reduce-scatter Y along l,
    each (q-1)/q per element; summed over qkv, proj, fc, proj: ΣMN = 7bsh, ΣNK = 12h², ΣMK = 9bsh)
    and SUPER §IV-B (segmented all-gather in, reduce-scatter out, over g ranks)."""
    b, s, h, p = 24, 512, 3072, 64
    q = 4
    table = cost.layer_table(b, s, h, p, subgrids=4)
    f = (q - 1) / q ** 3
    forward = f * (16 * b * s * h + 12 * h * h)
    backward = f * (7 * b * s * h + 12 * h * h + 9 * b * s * h + 7 * b * s * h + 12 * h * h)
    assert table["3d"]["forward"] == pytest.approx(forward)
    assert table["3d"]["backward"] == pytest.approx(forward + backward)
    g, n_g = 4, 16
    assert table["subgraph"]["forward"] == pytest.approx(2 * (g - 1) / g * b * s * h / n_g)
    # the 3D paper's claim: less traffic than 2D and 1D on 64 ranks
    assert table["3d"]["forward"] < table["2d"]["forward"] < table["1d"]["forward"]


# Eq. 4-7 assume the groups tile the nodes evenly: g and n_g each divide, or are multiples of, n_node
@pytest.mark.parametrize("n,g,n_node", [(8, 2, 4), (8, 4, 4), (16, 8, 4), (16, 2, 4), (32, 4, 8), (64, 16, 4), (36, 2, 4)])
def test_super_message_counts_equal_counting_on_the_layouts(n, g, n_node):
    """Catches a wrong round-robin placement (segmented collectives leaving the node) or a
    miscounted Eq. 4-7: each rank sends one message to every member of its cross-sub-grid group,
    counted here rank by rank on the natural and the topology-aware layouts."""
    for aware in (False, True):
        topo = lattice.context("subgraph", tp=n, subgrids=g, ranks_per_node=n_node,
                            placement="topology" if aware else "natural").topology
        assert cost.count_messages(topo, (MeshAxis.SUBGRID,)) == cost.super_messages(n, g, n_node, aware)


# ----------------------------------------------------------------------------- the time model


def test_alpha_beta_picks_inter_node_constants_when_a_group_spans_nodes():
    """Catches the α-β model using intra-node constants for a group that crosses nodes (or the
    reverse): one all-reduce of a 1D layer group, priced by hand with the ring formula."""
    cfg = lattice.GPTConfig(vocab_size=64, seq_len=8, d_model=16, n_heads=8, n_layers=1)
    m = cost.Machine("m", flop_rate=1e12, alpha_intra=1e-6, beta_intra=1e-10, alpha_inter=1e-5,
                     beta_inter=1e-9, ranks_per_node=4)
    for rpn, (alpha, beta) in ((8, (1e-6, 1e-10)), (4, (1e-5, 1e-9))):
        c = cost.estimate(cfg, "1d", batch=2, tp=8, ranks_per_node=rpn)
        by_hand = sum(t.calls * 2 * 7 * alpha + t.bytes * 2 * 7 / 8 * beta
                      for t in c.terms if t.phase == "forward")
        assert c.comm_time(m, "forward") == pytest.approx(by_hand)



def test_each_collective_is_priced_at_its_own_rates_where_the_machine_has_them():
    """Catches `Machine.collectives` ignored (gloo's all-reduce priced at a broadcast's latency), a
    collective priced at another's rates, or a group across nodes priced at a node's collective rates:
    a 2D layer's broadcasts and all-reduces priced by hand, the all-reduce at its own (α, β) and the
    broadcast at the machine's, inside a node; both at the inter-node constants across nodes."""
    cfg = lattice.GPTConfig(vocab_size=64, seq_len=8, d_model=16, n_heads=8, n_layers=1)
    plain = cost.Machine("m", flop_rate=1e12, alpha_intra=1e-6, beta_intra=1e-10, alpha_inter=1e-5,
                         beta_inter=1e-9, ranks_per_node=4)
    m = dataclasses.replace(plain, collectives=(("all_reduce", 3e-4, 2e-9),))
    by_steps = {"broadcast": lambda n: (math.ceil(math.log2(n)), math.log2(n)),
                "reduce": lambda n: (math.ceil(math.log2(n)), math.log2(n)),
                "all_reduce": lambda n: (2 * (n - 1), 2 * (n - 1) / n),
                "all_gather": lambda n: (n - 1, (n - 1) / n), "reduce_scatter": lambda n: (n - 1, (n - 1) / n)}
    for rpn in (4, 2):
        c = cost.estimate(cfg, "2d", batch=2, tp=4, ranks_per_node=rpn)
        ops = {t.op for t in c.terms if t.phase == "forward"}
        assert {"broadcast", "all_reduce"} <= ops, ops
        by_hand = 0.0
        for t in c.terms:
            if t.phase != "forward":
                continue
            n = c.term_ranks(t)
            if c.spans_nodes(t.axes):
                alpha, beta = 1e-5, 1e-9
            else:
                alpha, beta = (3e-4, 2e-9) if t.op == "all_reduce" else (1e-6, 1e-10)
            steps, words = by_steps[t.op](n)
            by_hand += t.calls * steps * alpha + t.bytes * words * beta
        assert c.comm_time(m, "forward") == pytest.approx(by_hand)
        assert c.comm_time(m, "forward") > c.comm_time(plain, "forward")
        assert any(c.spans_nodes(t.axes) for t in c.terms) == (rpn == 2)


def test_a_collectives_wire_bytes_are_priced_on_its_measured_curve_inside_a_node():
    """Catches Machine.collective_curves ignored (gloo's large all-reduces priced at a β fitted for
    small ones too), read on a term's bytes in all rather than per call, or used between nodes: a
    data-parallel step's gradient all-reduces inside a node priced by hand from the curve's points
    (linear between them, along the last two beyond), and at α and β across nodes."""
    cfg = lattice.GPTConfig(vocab_size=64, seq_len=8, d_model=512, n_heads=4, n_layers=8)  # 4 buckets of 25 MiB
    plain = cost.Machine("m", flop_rate=1e12, alpha_intra=1e-6, beta_intra=1e-10, alpha_inter=1e-5,
                         beta_inter=1e-9, ranks_per_node=4, collectives=(("all_reduce", 2e-6, 3e-10),))
    c = cost.estimate(cfg, "serial", batch=4, dp=4, ranks_per_node=4)
    grads = [t for t in c.terms if t.site == "grads"]
    assert grads and all(t.op == "all_reduce" for t in grads) and sum(t.calls for t in grads) == 4, grads
    wires = [t.bytes * 2 * 3 / 4 / t.calls for t in grads]  # a ring all-reduce of 4 ranks: 2·3/4 of its buffer
    across = cost.estimate(cfg, "serial", batch=4, dp=4, ranks_per_node=2)
    crossing = [t for t in across.terms if t.site == "grads"]
    for points, along in (
            # the calls between the points: 1 ns per byte up to half the largest call, 3 ns beyond
            (((0.0, 0.0), (max(wires) / 2, max(wires) / 2 * 1e-9), (2 * max(wires), max(wires) * 5e-9)),
             lambda x: x * 1e-9 if x <= max(wires) / 2 else max(wires) / 2 * 1e-9 + (x - max(wires) / 2) * 3e-9),
            # every call beyond the last point: along the last two (2 ns per byte)
            (((0.0, 0.0), (1.0, 1e-9), (2.0, 3e-9)), lambda x: 3e-9 + (x - 2.0) * 2e-9)):
        m = dataclasses.replace(plain, collective_curves=(("all_reduce", points),))
        by_hand = sum(t.calls * (2 * 3 * 2e-6 + along(w)) for t, w in zip(grads, wires))
        assert sum(s for _, s in c.term_times(m, grads)) == pytest.approx(by_hand)
        assert sum(s for _, s in c.term_times(plain, grads)) != pytest.approx(by_hand)
        assert sum(s for _, s in across.term_times(m, crossing)) == pytest.approx(
            sum(t.calls * 2 * 3 * 1e-5 + t.bytes * 2 * 3 / 4 * 1e-9 for t in crossing))


def test_a_collectives_curve_is_its_time_beyond_its_latency_steps_at_each_size():
    """Catches the calibration's collective curve holding the whole time of a call (its latency
    steps then counted twice), another op's α subtracted, or its sizes out of order: samples whose
    curve is worked out by hand."""
    from lattice.calibration.calibrate import fit_collective_curves

    samples = {"all_reduce": [(6, 4000.0, 0.009), (6, 40.0, 0.0061)], "broadcast": [(2, 40.0, 0.0009)]}
    curves = dict(fit_collective_curves(samples, {"all_reduce": 0.001, "broadcast": 0.0005}))
    assert [w for w, _ in curves["all_reduce"]] == [40.0, 4000.0]
    assert [t for _, t in curves["all_reduce"]] == pytest.approx([0.0001, 0.003])
    assert curves["broadcast"] == ((40.0, 0.0),)  # 0.0009 - 2 x 0.0005 < 0


def test_plan_command_refuses_a_layout_that_cannot_exist(capsys):
    """Catches `lattice plan` crashing with a traceback (or printing a plan) for an impossible
    layout instead of one line that names the fix."""
    assert cli.main(["plan", "--mode", "2d", "--tp", "6"]) == 2
    err = capsys.readouterr().err.strip()
    assert "tp=6" in err and "\n" not in err
    parser = argparse.ArgumentParser()
    cost_plan.add_plan_arguments(parser)
    assert cost_plan.run_plan(parser.parse_args(["--mode", "2d", "--tp", "4"])) == 0
    assert "total" in capsys.readouterr().out


# ----------------------------------------------------------------------------- against the modes

LAYOUTS = {  # (processes, options) per mode: the sizes the multi-process checks run
    "1d": [(2, {}), (2, {"sequence_parallel": True}), (4, {})],
    "2d": [(4, {}), (4, {"keep_gathered": False})],
    "3d": [(8, {}), (8, {"keep_gathered": False})],
    "subgraph": [(4, {"subgrids": 2}), (4, {"subgrids": 2, "common": "subgrid"})],
}
CFG = dict(vocab_size=97, seq_len=16, d_model=48, n_heads=12, n_layers=2)


def _layouts():
    return [(m, n, o) for m in lattice.available_modes() if m in LAYOUTS for n, o in LAYOUTS[m]]


def test_every_mode_has_a_cost_model():
    """Catches a mode that lands without its analytic model (the Mode.cost_* methods)."""
    cfg = lattice.GPTConfig(**CFG)
    from lattice.modes import get_mode

    for mode in lattice.available_modes():
        layout = dict(get_mode(mode).test_layouts[0])
        assert cost.estimate(cfg, mode, batch=8, **layout).memory["activations"] > 0, mode


@pytest.mark.parametrize("mode", lattice.available_modes())
def test_parameter_bytes_equal_the_storage_every_rank_allocates(mode):
    """Catches a parameter model that forgets the padded vocabulary, the row-0 hosting of 2D
    vectors or a replicated tensor: per rank of every declared layout, the model's bytes (from a
    meta-device model's shapes) equal the bytes of the distinct storages behind the parameters
    of the model that rank really builds on the CPU."""
    from lattice.modes import get_mode

    cfg = lattice.GPTConfig(**CFG)
    for layout in get_mode(mode).test_layouts:
        for rank in range(lattice.context(mode, **layout).world_size):
            ctx = lattice.context(mode, rank=rank, **layout)
            storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes()
                        for p in lattice.GPT(cfg, ctx).parameters()}
            modelled = cost.estimate(cfg, mode, batch=8, rank=rank, **layout).memory["parameters"]
            assert modelled == sum(storages.values()), (layout, rank)


def test_the_update_prices_the_trainers_norm_and_clip_per_tensor_of_the_real_model():
    """Catches the step's gradient norm and clipping going unpriced (a few ms a step for a model of
    many small tensors, several times that where ranks share cores) or priced per tensor of some
    other count: raising Machine.norm_per_tensor adds it once per parameter tensor the rank really
    builds, and the bytes three passes over its gradients (a read for the norm, a read and a write
    for clipping) at mem_bandwidth."""
    import dataclasses

    cfg = lattice.GPTConfig(**CFG)
    base = cost.Machine("m", flop_rate=1e12, alpha_intra=1e-6, beta_intra=1e-10, alpha_inter=1e-5,
                        beta_inter=1e-9, ranks_per_node=4, mem_bandwidth=1e12)
    for mode, layout in (("serial", {}), ("1d", {"tp": 2})):
        ctx = lattice.context(mode, rank=0, **layout)
        params = list(lattice.GPT(cfg, ctx).parameters())
        c = cost.estimate(cfg, mode, batch=8, rank=0, **layout)
        slow = dataclasses.replace(base, norm_per_tensor=1e-3)
        narrow = dataclasses.replace(base, mem_bandwidth=base.mem_bandwidth / 2)
        per_tensor = c.time(slow)["update"] - c.time(base)["update"]
        assert per_tensor == pytest.approx(len(params) * 1e-3), mode
        passes = c.time(narrow)["update"] - c.time(base)["update"]  # (7 of AdamW, 3 of the norm and clip)
        assert passes == pytest.approx((7 + 3) * sum(p.numel() * 4 for p in params) / base.mem_bandwidth), mode


def _measure(mode, n, options, ckpt):
    cfg = lattice.GPTConfig(**CFG)
    ctx = cached_init(mode=mode, tp=n, **options)
    model = lattice.GPT(cfg, ctx, activation_checkpointing=ckpt)
    gen = torch.Generator().manual_seed(3)
    tokens, targets = (torch.randint(0, cfg.vocab_size, (4, cfg.seq_len), generator=gen) for _ in range(2))
    with lattice.CommMeter() as meter:
        model.forward_backward(tokens, targets)
    from lattice.bench.measure import saved_activation_bytes

    saved = saved_activation_bytes(model, lambda: model(tokens, targets))
    c = cost.estimate(cfg, mode, batch=4, tp=n, rank=ctx.rank, activation_checkpointing=ckpt, **options)
    return meter.summary(), c.summary(), saved, c.memory["activations"]


def test_saved_activations_equal_the_model_and_2d_3d_are_a_pth_of_serial():
    """Catches an activation model that misses a saved tensor, and a 2D/3D layout that keeps a
    replicated copy of something serial saves (gathered blocks, whole LayerNorm inputs): measured
    bytes within 2% of the model (with keep_gathered, the default, too), and 2D/3D without
    keep_gathered at most 1.15 x serial / p."""
    cfg = lattice.GPTConfig(**CFG)
    model = lattice.GPT(cfg, lattice.context("serial"))
    gen = torch.Generator().manual_seed(3)
    tokens, targets = (torch.randint(0, cfg.vocab_size, (4, cfg.seq_len), generator=gen) for _ in range(2))
    from lattice.bench.measure import saved_activation_bytes

    serial = saved_activation_bytes(model, lambda: model(tokens, targets))
    assert serial == pytest.approx(cost.estimate(cfg, "serial", batch=4).memory["activations"], rel=0.02)
    for mode, n, options in _layouts():
        for _, _, saved, modelled in run_distributed(n, _measure, mode, n, options, False):
            assert saved == pytest.approx(modelled, rel=0.02), (mode, options)
            if mode in ("2d", "3d") and options.get("keep_gathered") is False:
                assert saved <= 1.15 * serial / n, (mode, saved, serial / n)


def test_plan_splits_refuses_empty_micro_batches_and_keeps_its_columns_apart(capsys):
    """Catches `lattice plan --splits` pricing tp=1 x pp=16 on 16 micro-batches of 8 // 16 = 0
    sequences (and naming it fastest at 4.970 ms), and step times of six digits running into the
    bubble column (`0.938121564.702`)."""
    from lattice.cli import main as cli

    assert cli.main(["plan", "--arch", "llama", "--model", "llama3-8b", "--splits", "16"]) == 0
    out = capsys.readouterr().out
    assert "1  16  does not fit: the replica batch of 8 sequences does not split into 16 micro-batches" in out
    assert "fastest: tp=1 x pp=16" not in out
    assert cli.main(["plan", "--arch", "llama", "--model", "llama3-8b", "--splits", "16", "--batch", "32"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("     1  16")]
    assert len(rows) == 1 and rows[0][:4] == ["1", "16", "16", "0.938"] and float(rows[0][4].replace(",", "")) > 1e4


def test_plan_splits_places_its_stages_on_the_nodes_asked_for(capsys):
    """Catches `lattice plan --splits` ignoring --ranks-per-node (every split priced as if on one
    node: 1d tp=16 at 575 ms against 1530 ms for the same model planned alone): its tp=16 x pp=1
    row equals the training step `lattice plan --tp 16` prints with the same placement (as
    `plan --auto` prices it), and differs from one node's."""
    import re

    model = ["--arch", "gpt2", "--model", "medium", "--n-heads", "16", "--mode", "1d", "--batch", "8"]
    steps = {}
    for per_node in ("4", "16"):
        assert cli.main(["plan", *model, "--tp", "16", "--ranks-per-node", per_node]) == 0
        alone = float(re.findall(r"as `plan --auto` prices it .*: ([\d.]+) ms", capsys.readouterr().out)[-1])
        assert cli.main(["plan", *model, "--splits", "16", "--ranks-per-node", per_node]) == 0
        row = next(line.split() for line in capsys.readouterr().out.splitlines() if line.split()[:2] == ["16", "1"])
        steps[per_node] = (alone, float(row[4].replace(",", "")))
    assert all(abs(split - alone) < 1e-3 for alone, split in steps.values()), steps
    assert steps["4"][0] > steps["16"][0], steps  # four nodes cost more than one


def _forward_gflop(out: str) -> float:
    return float(re.search(r"compute: forward ([\d.]+) GFLOP", out).group(1))


def test_plan_prices_the_task_an_encoder_trains_on(capsys):
    """Catches `lattice plan` pricing BERT's masked-LM head for a classification run (it had no
    --task): the forward work of mlm minus classify is the LM head over this rank's 1/tp of the
    (padded) vocabulary, 2·M·h·V/tp, plus the dense transform before it, 2·M·h² (M = B·T tokens);
    and a task the family does not train on is refused in one line."""
    flops = {}
    for task in ("mlm", "classify"):
        assert cli.main(["plan", "--arch", "bert", "--model", "bert-base", "--mode", "1d", "--tp", "4",
                         "--task", task]) == 0
        out = capsys.readouterr().out
        assert ("num_labels=2" in out) == (task == "classify")
        flops[task] = _forward_gflop(out)
    tokens, h, vocab = 8 * 512, 768, 30524  # --batch 8 of bert-base's 512 positions; 30522 padded to a multiple of 4
    expected = (2 * tokens * h * vocab / 4 + 2 * tokens * h * h) / 1e9
    assert flops["mlm"] - flops["classify"] == pytest.approx(expected, rel=2e-3), (flops, expected)
    assert cli.main(["plan", "--arch", "gpt2", "--task", "classify"]) == 2
    assert "--arch gpt2 trains on lm, not --task classify" in capsys.readouterr().err


def test_published_presets_carry_their_vocabulary_and_context(capsys):
    """Catches a preset of a published model that `lattice plan` prices with the built-in
    corpus's 2048-token vocabulary (GPT-2 medium planned at 2048 rows and 256 positions): the
    GPT-2 sizes hold 50257 rows and 1024 positions, with transformers' parameter counts
    (GPT2LMHeadModel, tied head: 124,439,808 / 354,823,168 / 1,557,611,200), and T5's 32128 rows."""
    published = {"gpt2": 124_439_808, "gpt2-medium": 354_823_168, "gpt2-xl": 1_557_611_200}
    for preset, count in published.items():
        assert cli.main(["plan", "--arch", "gpt2", "--model", preset, "--mode", "serial", "--tp", "1"]) == 0
        assert "vocab_size=50257, seq_len=1024" in capsys.readouterr().out
        with torch.device("meta"):
            model = lattice.build_model(model_config("gpt2", preset), lattice.context("serial"))
        assert model.num_parameters() == count, preset
    assert model_config("t5", "t5-small").vocab_size == 32128


def test_data_parallel_reduction_prices_one_copy_of_the_gradients_into_its_buffer():
    """Catches the copy of every gradient into the data-parallel all-reduce's flat buffer going
    unpriced (DDP's buckets, a pipeline's flat reduction: at 8 ranks on 2 cores a 10 MB copy was a
    tenth of the reduction's time), or priced without data parallelism: halving mem_bandwidth adds
    the same ten passes over the parameters at dp = 1 and, at dp = 2, two more over the gradients
    this rank really holds (a read and a write each)."""
    cfg = lattice.GPTConfig(**CFG)
    base = cost.Machine("m", flop_rate=1e12, alpha_intra=1e-6, beta_intra=1e-10, alpha_inter=1e-5,
                        beta_inter=1e-9, ranks_per_node=4, mem_bandwidth=1e12)
    narrow = dataclasses.replace(base, mem_bandwidth=base.mem_bandwidth / 2)
    for layout in ({}, {"pp": 2, "microbatches": 2}):
        for dp in (1, 2):
            ctx = lattice.context("serial", rank=0, dp=dp, **layout)
            held = sum(p.numel() * 4 for p in lattice.build_model(cfg, ctx).parameters())  # rank 0's stage
            c = cost.estimate(cfg, "serial", batch=8, rank=0, dp=dp, **layout)
            passes = c.time(narrow)["update"] - c.time(base)["update"]
            assert passes == pytest.approx((7 + 3 + (2 if dp > 1 else 0)) * held / base.mem_bandwidth), (layout, dp)


# operators whose outputs are views, allocations, products or attention (priced apart), or the
# embedding's gather and positions (which the builder leaves out)
_NOT_ELEMENTWISE = {"mm", "addmm", "bmm", "view", "_unsafe_view", "t", "transpose", "as_strided", "expand", "detach",
                    "reshape", "permute", "split_with_sizes", "split", "slice", "select", "unsqueeze", "squeeze",
                    "alias", "empty", "empty_like", "unbind", "_to_copy", "lift_fresh", "zeros", "arange", "embedding",
                    "cos", "sin", "_scaled_dot_product_flash_attention_for_cpu"}


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_elementwise_work_equals_the_elements_the_models_operators_write(arch):
    """The builder's forward elementwise work against the elements every non-product operator of
    the serial model writes in a forward, counted by a dispatch mode: catches a family's operators
    the cost model leaves out (rotary embeddings on q and k, uncounted before) or counts once where
    the model runs several (RMSNorm's three products of elements, counted as one before). The
    cross-entropy counts two per logit in the model (its calibration's convention, one operator
    here) and is left out by a vocabulary of 16."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from lattice.models import build_model
    from lattice.modes.layout import Layout

    class Written(TorchDispatchMode):
        elements = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func.overloadpacket.__name__ not in _NOT_ELEMENTWISE:
                first = out[0] if isinstance(out, (tuple, list)) else out
                if isinstance(first, torch.Tensor):
                    self.elements += first.numel()
            return out

    cfg = model_config(arch, "tiny", vocab_size=16, seq_len=128)
    batch = 8  # 1024 rows: the weights' own elementwise work (a fused weight's concatenation) is ~2%
    model = build_model(cfg, Layout("serial").context())
    tokens = torch.randint(0, 16, (batch, cfg.seq_len))
    with torch.no_grad(), Written() as written:
        model(tokens, tokens)
    priced = cost.estimate(cfg, "serial", batch=batch).elementwise["forward"]
    assert priced == pytest.approx(written.elements, rel=0.05)


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_selective_checkpointing_runs_again_the_elementwise_work_and_no_product(arch):
    """What a step under selective checkpointing runs beyond one without, counted by a dispatch
    mode (the products' FLOPs, the elements non-product operators write) against the cost
    model's difference of the backward's work: catches a recomputation that runs a product again
    (a policy keeping too little) or a model that prices the products' time again, or none of the
    element-wise work."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from lattice.models import build_model
    from lattice.modes.layout import Layout

    class Work(TorchDispatchMode):
        flops = elements = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            name = func.overloadpacket.__name__
            if name in ("mm", "addmm"):
                a, b = args[-2:]
                self.flops += 2 * a.shape[0] * a.shape[1] * b.shape[1]
            elif name not in _NOT_ELEMENTWISE:
                first = out[0] if isinstance(out, (tuple, list)) else out
                if isinstance(first, torch.Tensor):
                    self.elements += first.numel()
            return out

    cfg = model_config(arch, "tiny", vocab_size=16, seq_len=128)
    tokens = torch.randint(0, 16, (8, cfg.seq_len))
    counted, priced = [], []
    for selective in (False, True):
        model = build_model(cfg, Layout("serial").context(), selective_checkpointing=selective)
        with Work() as work:
            model.forward_backward(tokens, tokens)
        counted.append(work)
        priced.append(cost.estimate(cfg, "serial", batch=8, selective_checkpointing=selective))
    assert counted[1].flops == counted[0].flops
    assert priced[1].flops == priced[0].flops
    again = priced[1].elementwise["backward"] - priced[0].elementwise["backward"]
    assert 0 < again < priced[0].stem["elementwise"]["forward"]  # a layer's forward, but its last residual add
    assert counted[1].elements - counted[0].elements == pytest.approx(again, rel=0.05)


def test_operation_overhead_is_calibrated_on_the_family_priced():
    """`calibrate`'s time per operation comes from a tiny model of the configured family, not
    always GPT-2: with a clock that counts the framework calls a forward and backward dispatch,
    a Llama block's operations (RMSNorm as three products, rotary q and k, SwiGLU) make more
    calls each than GPT-2's, and a config's own options (Qwen2's q/k/v biases) are kept."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from lattice.calibration.calibrate import measure_op_overhead

    class Calls(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.count += 1
            return func(*args, **(kwargs or {}))

    def calls(fn) -> int:
        with Calls() as counted:
            fn()
        return counted.count

    def calls_beyond(fn, baseline):
        return float(calls(fn) - calls(baseline))

    per_op = {arch: measure_op_overhead(model_config(arch, "small", vocab_size=2048), calls_beyond)
              for arch in ("gpt2", "llama", "qwen2")}
    assert per_op["llama"] > 1.3 * per_op["gpt2"]
    assert per_op["qwen2"] > per_op["llama"]  # three bias adds more per block


def test_each_elementwise_operator_is_priced_at_its_own_rate():
    """A machine with a rate for tanh GELU alone prices GPT-2's GELU elements at it and the rest at
    elem_rate: forward compute grows by exactly the GELU's elements, B·T·4h per block, at the
    difference of the two rates. Catches the per-operator rates being ignored, or applied to
    elements of other operators."""

    cfg = model_config("gpt2", "tiny", vocab_size=64)
    batch = 2
    c = cost.estimate(cfg, "serial", batch=batch)
    base = cost.Machine("m", flop_rate=1e10, alpha_intra=1e-5, beta_intra=1e-9, alpha_inter=1e-5, beta_inter=1e-9,
                        ranks_per_node=1, elem_rate=1e9)
    slow_gelu = dataclasses.replace(base, elementwise_rates=(("gelu_tanh", 0.25e9),))
    gelu_elements = cfg.n_layers * batch * cfg.seq_len * 4 * cfg.d_model
    extra = slow_gelu.elementwise_rate("gelu_tanh"), base.elementwise_rate("gelu_tanh")
    assert c.time(slow_gelu)["forward_compute"] - c.time(base)["forward_compute"] == pytest.approx(
        gelu_elements / extra[0] - gelu_elements / extra[1], rel=1e-9)
    assert c.time(slow_gelu)["backward_compute"] - c.time(base)["backward_compute"] == pytest.approx(
        2 * (gelu_elements / extra[0] - gelu_elements / extra[1]), rel=1e-9)


def test_t5s_position_bias_is_priced_once_a_pass_per_stack_and_head():
    """A T5's relative position bias is looked up once a pass for each stack, every head for every
    pair of positions (encoder S x S, decoder T x T), and its backward sums those into the table:
    a machine slower at "position_bias" alone adds exactly n_heads (S² + T²) elements forward and
    twice that backward at the difference of the rates, halved with the heads at tp = 2, and m
    times that under m micro-batches of the same batch. Catches the bias left unpriced (a T5's
    accumulation and pipelines were priced 3-4 ms a micro-batch short at 128 tokens here), priced
    per layer, or per sequence of the batch."""
    cfg = model_config("t5", "tiny", vocab_size=64)
    S, T, batch = 12, 10, 4
    base = cost.Machine("m", flop_rate=1e10, alpha_intra=1e-5, beta_intra=1e-9, alpha_inter=1e-5, beta_inter=1e-9,
                        ranks_per_node=2, elem_rate=1e9)
    slow = dataclasses.replace(base, elementwise_rates=(("position_bias", 0.1e9),))
    per_element = 1 / 0.1e9 - 1 / 1e9

    def added(layout, **kw):
        c = cost.estimate(cfg, layout, batch=batch, seq=S, target_seq=T, **kw)
        return [c.time(slow)[f"{phase}_compute"] - c.time(base)[f"{phase}_compute"] for phase in ("forward", "backward")]

    elements = cfg.n_heads * (S * S + T * T)
    assert added("serial") == pytest.approx([elements * per_element, 2 * elements * per_element], rel=1e-9)
    assert added("1d", tp=2) == pytest.approx([elements / 2 * per_element, elements * per_element], rel=1e-9)
    from lattice.planner.pricing import Choice, price

    sized = dataclasses.replace(cfg, seq_len=S, target_len=T)
    for m in (1, 2):  # the planner's price of accumulation: each micro-batch's pass looks its bias up again
        choice = Choice(lattice.Layout("serial", microbatches=m))
        compute = [price(sized, choice, batch=batch, machine=machine).terms["compute"] for machine in (slow, base)]
        assert compute[0] - compute[1] == pytest.approx(3 * m * elements * per_element, rel=1e-9)


def test_attention_with_a_learned_bias_is_priced_at_the_biased_kernels_rate():
    """T5's self-attention adds a position bias that requires a gradient, which takes SDPA's math
    kernel (1.4 times the fused kernel's time on this CPU at 128 tokens): a machine whose
    "biased_attention" rate is a quarter of its attn_rate adds exactly B·n_heads·(S²·encoder layers
    + T²·decoder layers) score elements forward, twice backward, at the difference of the two
    rates; the decoder's cross-attention (no bias) and a GPT-2 stay at attn_rate, and a machine
    without that rate prices the bias at attn_rate. Catches a T5's attention priced at the fused
    kernel's rate, or the cross-attention or an unbiased family moved with it."""
    cfg = model_config("t5", "tiny", vocab_size=64)
    S, T, batch = 12, 10, 4
    base = cost.Machine("m", flop_rate=1e10, alpha_intra=1e-5, beta_intra=1e-9, alpha_inter=1e-5, beta_inter=1e-9,
                        ranks_per_node=1, elem_rate=1e9, attn_rate=2e9)
    slow = dataclasses.replace(base, elementwise_rates=(("biased_attention", 0.5e9),))
    assert base.biased_attention_rate() == base.attn_rate
    per_score = 1 / 0.5e9 - 1 / 2e9
    c = cost.estimate(cfg, "serial", batch=batch, seq=S, target_seq=T)
    scores = batch * cfg.n_heads * (S * S * cfg.n_layers + T * T * cfg.n_decoder_layers)
    assert [c.time(slow)[f"{ph}_compute"] - c.time(base)[f"{ph}_compute"] for ph in ("forward", "backward")] == \
        pytest.approx([scores * per_score, 2 * scores * per_score], rel=1e-9)
    gpt2 = cost.estimate(model_config("gpt2", "tiny", vocab_size=64), "serial", batch=batch)
    assert gpt2.time(slow) == gpt2.time(base)


def test_elementwise_rates_are_the_slope_of_time_over_elements(monkeypatch):
    """`calibrate`'s rate of each elementwise operator is elements over the time they add, not over
    a call's whole time: with calls that take 100 µs plus 1 ns per element of their input or of
    their output, whichever is larger (T5's position bias reads a table of 32 rows and writes a
    bias per pair of positions), every operator comes out at 3 (forward and backward) x its count
    per element (ELEMENTWISE_OPERATORS) per ns. Catches the fixed time per call, which
    Machine.op_overhead prices already, counted again in the rates (half a LayerNorm's time at a
    rank's share), and counts other than the builder's; and each operator of the activations
    timed on one input hot in the cache (GELU in half the time a step's take) rather than cycling
    over inputs of COLD_POOL_BYTES."""
    import lattice.calibration.calibrate as calibrate
    from lattice.cost.builder import ELEMENTWISE_OPERATORS

    inputs_of = {}  # (operator's function, input size) -> the distinct inputs it runs on

    def fwd_bwd(fn, *inputs):
        inputs_of.setdefault((fn, inputs[0].numel()), set()).add(id(inputs[0]))
        return lambda: max(inputs[0].numel(), fn(*inputs).numel())

    monkeypatch.setattr(calibrate, "timed_in_turn", lambda runs, reps: [100e-6 + run() * 1e-9 for run in runs])
    rates = dict(calibrate.measure_elementwise_rates(torch.randn(256, 24), torch.randn(256, 40), head_size=8, T=32,
                                              fwd_bwd=fwd_bwd, reps=1))
    assert set(rates) == set(ELEMENTWISE_OPERATORS)
    for op, rate in rates.items():
        assert rate == pytest.approx(3 * ELEMENTWISE_OPERATORS[op] * 1e9, rel=1e-9), op
    assert len(inputs_of) == 2 * len(ELEMENTWISE_OPERATORS)  # each operator at half and at all the rows
    tables = 32 * 24 // 8  # the position bias's (buckets, heads): its output's gradients fill the cache
    assert all(4 * numel * len(ids) >= calibrate.COLD_POOL_BYTES for (_, numel), ids in inputs_of.items()
               if numel != tables)


def _check_rates_timed_on_the_cores(cores: int):
    import torch.distributed as dist

    import lattice.calibration.calibrate as calibrate
    from lattice.cost.builder import ELEMENTWISE_OPERATORS

    timed_by, widths = [], set()  # the ranks of each timing's group, the widths of the inputs timed

    def timed_in_turn(runs, reps, group=None):
        timed_by.append(dist.get_world_size(group))
        dist.barrier(group=group)  # (a rank outside `group` would fail here)
        return [100e-6 + run() * 1e-9 for run in runs]

    real = calibrate.timed_in_turn
    calibrate.timed_in_turn = timed_in_turn
    try:
        rates = dict(calibrate.measure_elementwise_rates(torch.randn(256, 24), torch.randn(256, 40), head_size=8, T=32,
                                                  fwd_bwd=lambda fn, *inputs: (widths.add(inputs[0].shape[-1]) or (
                                                      lambda: max(inputs[0].numel(), fn(*inputs).numel()))),
                                                  reps=1, cores=cores))
    finally:
        calibrate.timed_in_turn = real
    expected = {op: 3 * n * 1e9 * min(1.0, cores / dist.get_world_size()) for op, n in ELEMENTWISE_OPERATORS.items()}
    return timed_by, rates, expected, widths


def test_where_ranks_outnumber_the_cores_the_elementwise_operators_are_timed_on_as_many_ranks_as_cores():
    """At 4 ranks on 2 cores the first 2 ranks time the operators while the other 2 wait, and each
    rate is 2/4 of what they time, on the shares of a world of 2 (twice the 4-rank share's width);
    the waiting ranks report inf (the caller takes the minimum over the ranks). Catches the rates
    timed by every rank at once (their slope was the scheduler's: 4-rank rates 0.01-0.76 of the
    2-rank ones in the validation), the share left out, a waiting rank's own figure let into
    the minimum, and the operators timed at the world's own shares (at 8 ranks gpt2-deep's 512 x 12
    elements, whose slope was noise: rates 0.03-0.73 of the 2-rank ones shared). With a core per
    rank nothing changes."""
    results = run_distributed(4, _check_rates_timed_on_the_cores, 2)
    for rank, (timed_by, rates, expected, widths) in enumerate(results):
        if rank < 2:
            assert timed_by == [2]
            assert rates == pytest.approx(expected, rel=1e-9)
        else:
            assert timed_by == [] and set(rates.values()) == {math.inf} and set(rates) == set(expected)
        # x's 24 and the logits' 40 columns twice as wide; rotary's heads; the position bias's
        # table of the heads of x's share (48 / 8)
        assert widths == {48, 80, 8, 6}
    for timed_by, rates, expected, widths in run_distributed(4, _check_rates_timed_on_the_cores, 4):
        assert timed_by == [4] and rates == pytest.approx(expected, rel=1e-9)
        assert widths == {24, 40, 8, 3}


@pytest.mark.parametrize("arch,schedule", [("gpt2", "1f1b"), ("llama", "interleaved"), ("bert", "1f1b")])
def test_a_pipeline_stages_flops_are_its_blocks_and_the_end_parts_it_holds(arch, schedule):
    """Catches the step FLOPs a pipeline rank logs (its MFU) counted as one micro-batch's, or with
    the embedding and the LM head on every stage: over the two stages of pp = 2 they must sum to the
    model's step without a pipeline, and the last stage's exceed the first's by the head alone
    (its blocks equal): forward 2·M·h·V and backward twice that on the batch's M tokens, with
    BERT's dense h -> h transform before its head, 6·M·h² more."""
    from lattice.modes.layout import Layout
    from lattice.training.metrics import step_flops

    cfg = model_config(arch, "small", vocab_size=512, n_layers=4)
    virtual = {"pp_virtual": 2} if schedule == "interleaved" else {}
    pipelined = Layout("serial", pp=2, microbatches=2, pp_schedule=schedule, **virtual)
    stages = [step_flops(cfg, pipelined.context(rank), batch_size=4, activation_checkpointing=False) for rank in (0, 1)]
    whole = step_flops(cfg, Layout("serial").context(0), batch_size=4, activation_checkpointing=False)
    tokens, h, vocab = 4 * cfg.seq_len, cfg.d_model, 512
    head = 6 * tokens * h * vocab + (6 * tokens * h * h if arch == "bert" else 0)
    assert sum(stages) == pytest.approx(whole, rel=1e-12)
    assert stages[1] - stages[0] == pytest.approx(head, rel=1e-12)


def test_products_are_timed_as_the_three_plain_kernels_a_linear_runs(monkeypatch):
    """Catches the calibration's products timed through autograd and a `.sum()`: the engine's
    time per product (about 50 µs here, which Machine.op_overhead prices per operation already)
    fitted as 55-75 more rows of kernel_rows at h = 96, where the kernels alone fit 7-19, and a
    stride-0 output gradient slowing the backward's products (F 100 against 150 GFLOP/s). A
    linear of X (m, k) by W (k, n) is timed as Y = X W, dX = dY Wᵀ and dW = Xᵀ dY, none of them
    recording autograd."""
    import lattice.calibration.timing as timing

    calls = []
    real_mm = torch.mm

    def mm(a, b):
        calls.append((tuple(a.shape), tuple(b.shape), a.requires_grad or b.requires_grad))
        return real_mm(a, b)

    monkeypatch.setattr(torch, "mm", mm)
    timing.linear_products(6, 4, 10)()
    assert calls == [((6, 4), (4, 10), False), ((6, 10), (10, 4), False), ((4, 6), (6, 10), False)]


def test_fwd_bwd_starts_the_backward_from_a_gradient_of_the_outputs_own_layout():
    """Catches the micro-benchmarks' backward started from `.sum()`: its gradient is a stride-0
    expansion, on which the backward's kernels ran a product 10-20% slower than on a step's
    contiguous gradient, and which no step's backward sees."""
    from lattice.calibration.timing import fwd_bwd_once

    seen = []
    x = torch.randn(5, 3)
    step = fwd_bwd_once(lambda t: _Hooked.apply(t, seen), x)
    step()
    step()
    assert len(seen) == 2 and all(g.shape == (5, 3) and g.is_contiguous() and g.stride() == (3, 1) for g in seen)
    assert torch.equal(seen[0], seen[1])  # one gradient, drawn once


class _Hooked(torch.autograd.Function):
    """y = 2 t, its backward recording the gradient it is given."""

    @staticmethod
    def forward(ctx, t, seen):
        ctx.seen = seen
        return t * 2

    @staticmethod
    def backward(ctx, g):
        ctx.seen.append(g)
        return 2 * g, None


def test_term_times_follow_a_reassigned_topology():
    """A Cost keeps its terms' seconds and group sizes once priced, and the planner then
    reassigns its topology (the same groups placed on nodes). A memo that ignored the change
    would price the tensor groups that now span nodes at the intra-node rates they had before."""
    from lattice.cost.machines import MACHINES
    from lattice.cost.model import estimate
    from lattice.modes.layout import Layout

    cfg = lattice.GPTConfig(vocab_size=512, seq_len=64, d_model=96, n_heads=4, n_layers=2)
    machine = MACHINES["h100-node"]
    one_node, across = Layout("1d", tp=4, ranks_per_node=8), Layout("1d", tp=4, ranks_per_node=2)
    c = estimate(cfg, one_node, batch=4)
    before = c.time(machine)
    c.topology = across.topology
    after = c.time(machine)
    fresh = estimate(cfg, one_node, batch=4)
    fresh.topology = across.topology
    assert after == fresh.time(machine)
    assert after["forward_comm"] > before["forward_comm"]  # inter-node links are slower
    assert [s for _, s in c.term_times(machine)] == [s for _, s in fresh.term_times(machine)]
