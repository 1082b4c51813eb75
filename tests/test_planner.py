"""The planner (`lattice plan --auto`, lattice.cost.search) and the machine presets: prices equal the
cost model's own estimate, the search covers the space a hand enumeration gives, honours the memory
limit, never prices a layout training refuses, and the command answers in text and JSON."""

import dataclasses
import itertools
import json
import re
import shlex

import pytest

from lattice.cli import main as cli
from lattice.cost.machine import Machine
from lattice.cost.machines import MACHINES, machine_named
from lattice.cost.model import estimate, spans_nodes
from lattice.cost.pipeline import p2p_piece
from lattice.cost.plan import mode_verdicts, model_config
from lattice.cost.search import Choice, price, search
from lattice.modes.layout import Layout
from lattice.parallel.context import LatticeConfigError, MeshAxis

MACHINE = dataclasses.replace(MACHINES["h100-node"], ranks_per_node=4)


def small(n_layers=4, **sizes):
    return model_config("gpt2", "small", vocab_size=512, n_layers=n_layers, **sizes)


def test_spans_nodes_agrees_with_walking_every_group():
    """Catches the tensor form of the node test (permute and reshape of the rank grid) taking the
    wrong dimensions as a group: it is compared with a walk over every rank's group."""
    def walk(topo, axes):
        for rank in range(topo.world_size):
            coords = topo.coords(rank)
            nodes = {topo.node_of(topo.rank_at({**coords, **dict(zip(axes, ks))}))
                     for ks in itertools.product(*(range(topo.size(a)) for a in axes))}
            if len(nodes) > 1:
                return True
        return False

    checked = 0
    for mode, tp in (("1d", 2), ("2d", 4), ("3d", 8), ("subgraph", 4)):
        for dp, cp, pp, rpn, placement in itertools.product((1, 2), (1, 2), (1, 2), (1, 2, 4, 8), ("natural", "topology")):
            try:
                topo = Layout(mode, tp=tp, dp=dp, cp=cp, pp=pp, ranks_per_node=rpn, placement=placement).topology
            except LatticeConfigError:
                continue
            for k in range(1, len(topo.axis_names) + 1):
                for axes in itertools.combinations(topo.axis_names, k):
                    assert spans_nodes(topo, axes) == walk(topo, axes), (mode, dp, cp, pp, rpn, placement, axes)
                    checked += 1
    assert checked > 500


A_IN, A_OUT = MACHINE.alpha_intra, MACHINE.alpha_inter


# the Trainer's one-number all-reduces (ring latency 2(n-1) α each), by hand: the gradient norm over
# the replica, the loss over dp, the norm's sum over dp x cp of ZeRO's (or bf16 masters') rows
@pytest.mark.parametrize("layout,zero,ckpt,scalars", [
    (Layout("1d", tp=2, dp=2, ranks_per_node=2), 1, False, 2 * A_IN + 2 * A_OUT + 2 * A_OUT),
    (Layout("2d", tp=4, dp=2, ranks_per_node=4), 0, True, 6 * A_IN + 2 * A_OUT),
    (Layout("3d", tp=8), 0, False, 14 * A_IN),
    (Layout("subgraph", tp=4, cp=2, ranks_per_node=4), 2, True, 14 * A_OUT + 2 * A_OUT)])
def test_price_without_a_pipeline_is_the_cost_models_step(layout, zero, ckpt, scalars):
    """Catches the planner's depth extrapolation (one and two blocks, then linear) drifting from
    the cost model of the whole model: for a model of 6 blocks, the step time is
    `estimate(...).time(machine)` of the real depth plus the Trainer's one-number all-reduces, and
    every memory figure is the estimate's."""
    cfg = small(n_layers=6)
    priced = price(cfg, Choice(layout, zero=zero, precision="bf16", checkpointing=ckpt), batch=8 * layout.dp,
                   machine=MACHINE)
    whole = estimate(cfg, layout, batch=8, zero=zero, precision="bf16", activation_checkpointing=ckpt)
    assert priced.step_s == pytest.approx(whole.time(MACHINE)["step"] + scalars, rel=1e-9)
    for k, v in whole.memory.items():
        assert priced.memory[k] == pytest.approx(v, rel=1e-9), k


@pytest.mark.parametrize("layout", [Layout("1d", tp=4), Layout("serial", dp=2, pp=2, microbatches=4)])
def test_skew_waits_for_compute_not_for_collectives(layout):
    """Catches Machine.skew (the slowest rank's compute beyond the mean's) charged on communication
    too, which the collectives' calibration already prices with its waits (1d tp = 8 with sequence
    parallelism was predicted at twice its measured step so): a machine ten times slower to
    communicate adds no skew, and the skew is the fraction of the compute alone."""
    cfg = small(n_layers=4)
    skewed = dataclasses.replace(MACHINE, skew=0.25)
    slow_wire = dataclasses.replace(skewed, alpha_intra=10 * MACHINE.alpha_intra, beta_intra=10 * MACHINE.beta_intra)
    fast, slow = (price(cfg, Choice(layout), batch=8, machine=m) for m in (skewed, slow_wire))
    assert slow.step_s > fast.step_s
    assert slow.terms["skew"] == pytest.approx(fast.terms["skew"], rel=1e-12)
    assert fast.terms["skew"] == pytest.approx(0.25 * fast.terms["compute"], rel=1e-12)
    if layout.pp == 1:
        t = estimate(cfg, layout, batch=8).time(skewed)
        assert t["skew"] == pytest.approx(0.25 * (t["forward_compute"] + t["backward_compute"]), rel=1e-12)


def test_kernel_term_adds_each_linear_products_overhead():
    """Catches the per-kernel term counting the wrong products: GPT-2 runs 4 linear layers per
    block (qkv, attention out, MLP in, MLP out), so forward pays 4 L kernel_flops / F more and
    backward (two products per linear) 8 L."""
    cfg = small(n_layers=3)
    c = estimate(cfg, "serial", batch=2)
    plain = dataclasses.replace(MACHINE, kernel_flops=0.0)
    slow = dataclasses.replace(MACHINE, kernel_flops=1e9)
    a, b = c.time(plain), c.time(slow)
    assert b["forward_compute"] - a["forward_compute"] == pytest.approx(4 * 3 * 1e9 / MACHINE.flop_rate)
    assert b["backward_compute"] - a["backward_compute"] == pytest.approx(8 * 3 * 1e9 / MACHINE.flop_rate)


@pytest.mark.parametrize("mode,tp,options,weights", [
    ("serial", 1, {}, lambda h, L, V: 12 * h * h * L + h * V),
    ("1d", 2, {}, lambda h, L, V: (12 * h * h * L + h * V) / 2),
    ("2d", 4, {}, lambda h, L, V: (12 * h * h * L + h * V) / 2),
    ("subgraph", 2, {"subgrids": 2}, lambda h, L, V: (4 * h * h / 2 + 8 * h * h) * L + h * V),
])
def test_kernel_rows_add_each_products_weight_piece_per_row(mode, tp, options, weights):
    """Catches the row term counting the wrong weights or rows: a product of a K x N weight piece
    on M rows is priced as one on M + r rows, so the forward pays 2 r (K N summed over its
    products) FLOPs more. A block's weights are 12 h² (qkv 3h², out h², MLP 4h² and 4h²), the
    tied head's h·V: 1d reads 1/tp of each once; 2D's SUMMA a 1/q² block in each of q products of
    (B/q · T) rows; sub-graph's common layers (MLP, head) run whole weights on their rows, and
    each sub-grid its 1/g of the attention projections on its own. Backward pays twice that."""
    cfg = small(n_layers=3)
    c = estimate(cfg, Layout(mode, tp=tp, options=options), batch=4)
    plain = dataclasses.replace(MACHINE, kernel_flops=0.0, kernel_rows=0.0)
    a, b = c.time(plain), c.time(dataclasses.replace(plain, kernel_rows=16.0))
    read = weights(cfg.d_model, cfg.n_layers, cfg.vocab_size)  # V = 512 divides every split here
    assert b["forward_compute"] - a["forward_compute"] == pytest.approx(2 * 16 * read / MACHINE.flop_rate)
    assert b["backward_compute"] - a["backward_compute"] == pytest.approx(4 * 16 * read / MACHINE.flop_rate)


def test_kernel_rows_fitted_over_the_row_counts():
    """Catches a wrong fit of the calibration's row term: products timed at 64 to 512 rows that take
    (rows + 20) units give 20 back, and with any one timing 15% off the fit stays within 10 rows
    (the two-count solve it replaces gave 35 for the shortest); a larger product slower per row than a smaller one
    (out of cache), a smaller no slower per row, or a single row count give 0, never a negative or
    infinite term."""
    from lattice.cost.calibrate import _kernel_rows

    rows = (64, 128, 256, 512)
    assert _kernel_rows([(m, (m + 20) * 3e-6) for m in rows]) == pytest.approx(20.0)
    for off in rows:
        for factor in (0.85, 1.15):
            noisy = [(m, (m + 20) * 3e-6 * (factor if m == off else 1.0)) for m in rows]
            assert abs(_kernel_rows(noisy) - 20) < 10, (off, factor)
    assert _kernel_rows([(m, m * (1 + m / 2048) * 3e-6) for m in rows]) == 0.0
    assert _kernel_rows([(m, m * 3e-6) for m in rows]) == 0.0
    assert _kernel_rows([(512, 1.0)]) == 0.0


def _ring_send_latency_check(batch: int, beta: float) -> tuple[float, int]:
    import lattice.cost.calibrate_comm as calibrate
    from lattice.models.llama import LlamaConfig

    ran = []

    def timed_in_turn(fns, reps, warm_rounds=0):  # each timed function run once: the ring must turn
        ran.extend(fn() is None for fn in fns)
        return [7.0e-3, 0.4e-3]  # ring attention forward and backward, one causal block

    real = calibrate.timed_in_turn
    calibrate.timed_in_turn = timed_in_turn
    try:
        cfg = LlamaConfig(vocab_size=64, seq_len=32, d_model=32, n_heads=4, n_kv_heads=2, n_layers=1,
                          intermediate_size=64)
        return calibrate._ring_send_latency(cfg, batch, beta, reps=1), len(ran)
    finally:
        calibrate.timed_in_turn = real


@pytest.mark.parametrize("world", [2, 4])
def test_a_ring_send_is_priced_from_ring_attention_beyond_its_blocks(world):
    """Catches Machine.alpha_send calibrated from anything but the ring it prices: ring attention
    of a cp pair taking 7.0 ms forward and backward where one causal block takes 0.4 ms is 1.5
    blocks of attention (its own causal block, half of the other's) and four sends (one forward,
    three backward): (7.0 - 0.6) / 4 = 1.6 ms a send, less its keys and values at β (GQA: 2 of 4
    heads; a cp = 2 rank's share: 2·8/world sequences of 16 positions of 8 dimensions, 4 bytes
    each). At 4 ranks the pairs (0, 1) and (2, 3) turn their rings at once."""
    from multiproc import run_distributed

    beta = 1e-8
    sequences = 2 * 8 // world
    kv_bytes = 2 * sequences * 2 * 16 * 8 * 4
    results = run_distributed(world, _ring_send_latency_check, 8, beta)
    for latency, ran in results:
        assert ran == 2
        assert latency == pytest.approx(1.6e-3 - kv_bytes * beta, rel=1e-9)


@pytest.mark.parametrize("layout", [Layout("1d", tp=2), Layout("serial", cp=2)])
def test_overlap_hides_its_fraction_of_a_collective_beside_compute(layout):
    """Catches the machine's overlap fraction left out of a hidden collective's price: a 1d
    backward's input-gradient all-reduces beside the weight gradients' products and a cp ring's
    exchanges beside attention hide all of the shorter of the two where copies and sums have
    engines of their own (overlap 1) and only that fraction of it on a CPU whose ranks have no
    spare core (the rest stays communication), so the step grows by exactly the part not hidden."""
    cfg = small(n_layers=2)
    c = estimate(cfg, layout, batch=4)
    whole = c.time(MACHINE)
    part = c.time(dataclasses.replace(MACHINE, overlap=0.25))
    for phase in ("forward", "backward"):
        hidden = whole.get(f"{phase}_overlapped", 0.0)
        assert part.get(f"{phase}_overlapped", 0.0) == pytest.approx(0.25 * hidden)
        assert part[f"{phase}_comm"] == pytest.approx(whole[f"{phase}_comm"] + 0.75 * hidden)
    assert whole["backward_overlapped"] > 0
    assert part["step"] == pytest.approx(whole["step"] + 0.75 * (whole["backward_overlapped"]
                                                                 + whole.get("forward_overlapped", 0.0)))


def _row_term_of_products_slow_at_first(*, warm_and_in_turn: bool = True) -> float:
    """The calibration's row term of four products that take (rows + 20) x 10 µs, twice as long at
    first and back to that over 0.6 s (a process's first work), timed as `calibrate` times them
    (else each row count's samples one after the other, cold, the shortest first). The products
    advance a clock of their own in place of `time.perf_counter`, so that a loaded machine's
    descheduling cannot stretch them (busy-waited, the fit came out 9 under a full test run)."""
    import types

    import lattice.cost.calibrate as calibrate
    import lattice.cost.timing as timing

    now = [0.0]

    def product(rows):
        def run():
            now[0] += (rows + 20) * 1e-5 * (1 + max(0.0, 1 - now[0] / 0.6))
        return run

    rows = (64, 128, 256, 512)
    real_time, timing.time = timing.time, types.SimpleNamespace(perf_counter=lambda: now[0])
    try:
        if warm_and_in_turn:
            seconds = timing.timed_in_turn([product(m) for m in rows], 5, warm_rounds=1)
        else:
            seconds = [timing.timed_in_turn([product(m)], 5)[0] for m in rows]
    finally:
        timing.time = real_time
    return calibrate._kernel_rows(list(zip(rows, seconds)))


def _differences_under_drift() -> list[tuple[float, float]]:
    """timed_differences of a collective's loop against the loop alone, on a clock of their own: the
    loop's time drifts from round to round (0.1 s plus 0 to 0.9 s, the machine's speed), the
    collective adds 10 ms plus 0 to 12 ms of its own noise."""
    import types

    import lattice.cost.timing as timing

    now, calls = [0.0], {"with": 0, "without": 0}
    drift = [0.0, 0.8, 0.1, 0.9, 0.2]  # seconds, per round
    own = [0.0, 0.003, 0.006, 0.009, 0.012]

    def timed(name, extra):
        def run():
            r = max(calls[name] - 1, 0)  # the first call sets the repeats (one: each is over SAMPLE_S)
            calls[name] += 1
            now[0] += 0.1 + drift[r] + (0.010 + own[r] if extra else 0.0)
        return run

    real_time, timing.time = timing.time, types.SimpleNamespace(perf_counter=lambda: now[0])
    try:
        return timing.timed_differences([(timed("with", True), timed("without", False))], 5)
    finally:
        timing.time = real_time


def test_a_difference_of_timings_is_taken_within_each_round():
    """Catches a calibration's extra time (a collective's wake after a stretch of compute, a
    pipeline's growth per micro-batch) taken as the difference of two medians timed apart: where
    the machine's speed drifts between rounds by more than the extra itself, each median is that
    of the drift's middle round and their difference that round's extra alone (here 22 ms, the
    round with 12 ms of the collective's own noise), not the median over rounds of the extra
    (16 ms: 10 ms plus 0-12 of its own noise). The baseline is the loop alone's median: 0.1 s
    plus the median drift of 0.2 s."""
    from multiproc import run_distributed

    for (baseline, extra), in run_distributed(1, _differences_under_drift):
        assert baseline == pytest.approx(0.3)
        assert extra == pytest.approx(0.016)


def test_products_timed_in_turn_after_a_warm_round_keep_the_row_term():
    """Catches the calibration timing its row counts one after the other, cold: the shortest
    product, timed first while the process is new, came out slower per row and the row term fitted
    26-84 rows at 2 ranks where warm products timed in turn give 6-31 (pipelines of one-sequence
    micro-batches then priced 8-50% above their steps). Products of (rows + 20) units, slow at
    first, must still give 20 back; timed one after the other, cold, the same products give 118
    (111-124 when they were busy-waited)."""
    from multiproc import run_distributed

    for rank_rows in run_distributed(2, _row_term_of_products_slow_at_first):
        assert abs(rank_rows - 20) < 5, rank_rows
    for rank_rows in run_distributed(2, _row_term_of_products_slow_at_first, warm_and_in_turn=False):
        assert rank_rows > 100, rank_rows


def test_skew_seconds_interpolates_the_wait_per_synchronisation():
    """Catches Machine.skew_seconds reading its curve wrongly: the wait of a synchronisation after a
    stretch of compute is linear between the measured stretches, through zero below the first and
    along the last two beyond (never falling there), at the group size nearest by ratio; without a
    curve it is skew x compute. Figures by hand from the two points (10 ms, 2 ms), (40 ms, 4 ms)."""
    m = dataclasses.replace(MACHINE, skew=0.5, skew_curve=((2, 0.01, 0.002), (2, 0.04, 0.004),
                                                           (8, 0.01, 0.005), (8, 0.04, 0.003)))
    assert m.skew_seconds(0.08, {2: 4}, collectives=4) == pytest.approx(4 * (0.002 + 0.002 / 3))  # 20 ms stretches
    assert m.skew_seconds(0.1, {2: 1}, collectives=1) == pytest.approx(0.004 + 0.06 * 0.002 / 0.03)  # beyond: along the last two
    assert m.skew_seconds(0.005, {2: 1}, collectives=1) == pytest.approx(0.001)  # below: through zero
    assert m.skew_seconds(0.1, {8: 1}, collectives=1) == pytest.approx(0.003)  # beyond a falling pair: no less than measured
    # 4 ranks as near 8 as 2 (the larger then), 16 nearest 8: 20 ms stretches on (10, 5), (40, 3)
    assert m.skew_seconds(0.08, {4: 2, 16: 2}, collectives=4) == pytest.approx(4 * (0.005 - 0.002 / 3))
    assert m.skew_seconds(0.08, {}, collectives=0) == pytest.approx(0.0)
    assert dataclasses.replace(m, skew_curve=()).skew_seconds(0.08, {2: 4}, collectives=4) == pytest.approx(0.04)


def test_only_collectives_pay_the_time_a_collective_takes_longer_after_longer_compute():
    """Catches Machine.wake_curve charged to the wrong synchronisations or read wrongly: a
    collective after a stretch of compute longer than the curve's first point (where α and β were
    fitted) pays the curve's rise there, linear between points and flat beyond the last; a
    pipeline's point-to-point hops (syncs that are not `collectives`) pay none. Figures by hand from
    the points (1 ms, 0.5 ms), (4 ms, 0.8 ms), (16 ms, 0.9 ms), with no skew (a flat zero curve)."""
    m = dataclasses.replace(MACHINE, skew_curve=((2, 0.01, 0.0), (2, 0.04, 0.0)),
                            wake_curve=((0.004, 0.0008), (0.001, 0.0005), (0.016, 0.0009)))
    # 20 ms over 10 syncs: 2 ms stretches, 0.5 + (2 - 1) / 3 x 0.3 = 0.6 ms, 0.1 ms beyond α's
    assert m.skew_seconds(0.02, {2: 10}, collectives=4) == pytest.approx(4 * 0.0001)
    assert m.skew_seconds(0.02, {2: 10}, collectives=0) == pytest.approx(0.0)
    assert m.skew_seconds(0.0005, {2: 1}, collectives=1) == pytest.approx(0.0)  # below the first point
    assert m.skew_seconds(0.1, {2: 1}, collectives=1) == pytest.approx(0.0004)  # beyond the last: flat
    assert dataclasses.replace(m, wake_curve=()).skew_seconds(0.02, {2: 10}, collectives=4) == 0.0


def test_collectives_apart_pay_the_wake_of_their_own_stretch():
    """Catches the collectives that follow a short stretch of their own (a cp ring's exchanges
    between its blocks of attention) charged the wake of the step's mean stretch: on gpt2-small at
    2 ranks, where the wake rises 1.1 ms from 1 to 4 ms of compute, that priced cp = 2 above its
    measured step in 7 of 9 measurements of gpt2-small, gpt2-wide and llama-gqa in validation runs
    28, 30 and 31 (up to +13%). Figures by hand from the points (1 ms,
    0.5 ms), (4 ms, 0.8 ms), (16 ms, 0.9 ms): 22 ms over 10 syncs of which 4 collectives, 2 of them
    after 1 ms each; the other 8 syncs share 20 ms, 2.5 ms stretches, 0.5 + 1.5 / 3 x 0.3 = 0.65 ms,
    0.15 ms beyond α's; the 2 at the first point pay none."""
    m = dataclasses.replace(MACHINE, skew_curve=((2, 0.01, 0.0), (2, 0.04, 0.0)),
                            wake_curve=((0.001, 0.0005), (0.004, 0.0008), (0.016, 0.0009)))
    assert m.skew_seconds(0.022, {2: 10}, collectives=4, apart=(0.002, 2)) == pytest.approx(2 * 0.00015)
    # the mean stretch, 2.2 ms, for all four: 0.5 + 1.2 / 3 x 0.3 = 0.62 ms, 0.12 beyond
    assert m.skew_seconds(0.022, {2: 10}, collectives=4) == pytest.approx(4 * 0.00012)


@pytest.mark.parametrize("cp, apart_per_layer", [(2, 2), (4, 8)])
def test_a_rings_waits_after_its_blocks_alone_are_counted_apart(cp, apart_per_layer):
    """Catches Cost.ring_waits counting the wrong waits of RingAttention as following a block of
    attention alone. Forward waits for each of cp - 1 sends, the first after the layer's other
    work; backward for cp - 1 sends of keys and cp of their gradients, the first after the other
    work and the rest after the cp - 1 later blocks or right after another wait: at cp = 2 the
    last 2 of backward's 3, at cp = 4 forward's last 2 and backward's last 6. Their compute: the
    blocks after the first, (cp - 2) / cp of forward's attention and (cp - 1) / cp of backward's."""
    layers = 2
    c = estimate(small(n_layers=layers), Layout("serial", cp=cp, ranks_per_node=cp), batch=8)
    attention, calls = c.ring_waits(MACHINE)
    assert calls == pytest.approx(apart_per_layer * layers)
    rate = MACHINE.at(cp).attn_rate
    assert attention == pytest.approx((c.scores["forward"] * (cp - 2) / cp + c.scores["backward"] * (cp - 1) / cp)
                                      / rate)
    assert estimate(small(n_layers=layers), Layout("1d", tp=2), batch=8).ring_waits(MACHINE) == (0.0, 0.0)


FLAT_WAIT = dataclasses.replace(MACHINE, skew_curve=((2, 1e-9, 0.01), (2, 10.0, 0.01)))  # 10 ms at every sync


@pytest.mark.parametrize("arch,layout,syncs", [
    # the gradients' all-reduce over dp, once
    ("gpt2", Layout("serial", dp=4, ranks_per_node=4), 1),
    # per micro-batch an activation out of stage 0 and its gradient back (2 m); after the schedule
    # the loss's broadcast from the last stage, the gradients over dp, and GPT-2's tied token table
    # summed between the first stage and the last (lattice.parallel.pipeline: sync_grads)
    ("gpt2", Layout("serial", dp=2, pp=2, microbatches=4, ranks_per_node=4), 2 * 4 + 3),
    ("llama", Layout("serial", dp=2, pp=2, microbatches=4, ranks_per_node=4), 2 * 4 + 2)])
def test_skew_per_synchronisation_counts_a_steps_waits(arch, layout, syncs):
    """Catches the planner counting a step's synchronisations wrongly (the gradients' reduction per
    micro-batch, a pipeline's hops or its sums after the schedule left out): at a wait of 10 ms
    whatever the stretch, the skew is 10 ms times the synchronisations counted by hand."""
    cfg = model_config(arch, "small", vocab_size=512, n_layers=4)
    priced = price(cfg, Choice(layout), batch=8, machine=FLAT_WAIT)
    assert priced.terms["skew"] == pytest.approx(0.01 * syncs)


@pytest.mark.parametrize("arch,layout,collectives", [
    ("gpt2", Layout("serial", dp=4, ranks_per_node=4), 1),
    # of the pipeline's syncs above, not its 2 m hops: the loss's broadcast, the gradients over dp
    # and GPT-2's tied table (Llama has none)
    ("gpt2", Layout("serial", dp=2, pp=2, microbatches=4, ranks_per_node=4), 3),
    ("llama", Layout("serial", dp=2, pp=2, microbatches=4, ranks_per_node=4), 2)])
def test_a_pipelines_hops_pay_no_collectives_wake(arch, layout, collectives):
    """Catches the planner charging Machine.wake_curve to a pipeline's point-to-point hops (it made
    the 2-rank pipelines, already priced high, 15-20% dearer) or leaving out a collective: with
    no skew and a collective 10 ms longer after any stretch, the skew term is 10 ms times the
    collectives counted by hand."""
    cfg = model_config(arch, "small", vocab_size=512, n_layers=4)
    machine = dataclasses.replace(MACHINE, skew_curve=((2, 1e-9, 0.0), (2, 10.0, 0.0)),
                                  wake_curve=((1e-12, 0.0), (1e-11, 0.01)))
    priced = price(cfg, Choice(layout), batch=8, machine=machine)
    assert priced.terms["skew"] == pytest.approx(0.01 * collectives)


def test_skew_per_synchronisation_extrapolates_with_depth():
    """Catches the sync count drifting in the planner's depth extrapolation (one and two blocks, then
    linear): 1d's per-layer collectives at 6 blocks give the skew the cost model of the whole model
    counts."""
    cfg, layout = small(n_layers=6), Layout("1d", tp=2, dp=2, ranks_per_node=4)
    priced = price(cfg, Choice(layout), batch=16, machine=FLAT_WAIT)
    whole = estimate(cfg, layout, batch=8).time(FLAT_WAIT)
    assert whole["skew"] > 0.01 * 6 * 4  # at least forward's two and backward's two all-reduces per block
    assert priced.terms["skew"] == pytest.approx(whole["skew"], rel=1e-12)


def _waits_of_one_slow_rank() -> tuple:
    import time

    import torch
    import torch.distributed as dist

    from lattice.cost.calibrate import _skew_curve

    pause = 0.002 if dist.get_rank() == 3 else 0.001
    spent = [0.0, 0]

    def work():
        t = time.perf_counter()
        time.sleep(pause)
        spent[0] += time.perf_counter() - t
        spent[1] += 1

    curve = _skew_curve(work, stretches=(0.02, 0.06), samples=5)
    # a loaded host oversleeps every pause by a fraction of a millisecond, the same on every rank:
    # the expected waits are derived from each rank's measured pause, not from the nominal 1 and 2 ms
    mine = torch.tensor([spent[0] / spent[1]], dtype=torch.float64)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return curve, [float(t) for t in every]


def test_skew_curve_waits_for_the_slowest_rank_of_each_group():
    """Catches the calibration's wait per synchronisation taken over the wrong ranks (the whole
    world for every group, or a group's mean): of 4 ranks whose pause takes d_i (r for three, 2r
    for the last, plus whatever the host oversleeps), groups of 2 wait the mean of their slowest
    rank's pause less the mean pause, (max(d0, d1) + max(d2, d3))/2 - mean(d), about 0.2 of the
    mean pause, and the group of 4 waits max(d) - mean(d), about 0.6 of it."""
    from multiproc import run_distributed

    for curve, pauses in run_distributed(4, _waits_of_one_slow_rank):
        mean = sum(pauses) / 4
        expected = {
            2: ((max(pauses[:2]) + max(pauses[2:])) / 2 - mean) / mean,
            4: (max(pauses) - mean) / mean,
        }
        assert 0.12 < expected[2] < 0.25 and 0.35 < expected[4] < 0.65, pauses  # one rank pauses twice as long
        by_group = {}
        for ranks, stretch, wait in curve:
            by_group.setdefault(ranks, []).append(wait / stretch)
        assert sorted(by_group) == [2, 4]
        assert all(abs(r - expected[2]) < 0.06 for r in by_group[2]), (by_group, expected)
        assert all(abs(r - expected[4]) < 0.1 for r in by_group[4]), (by_group, expected)


def test_search_covers_the_hand_enumerated_space_and_ranks_by_price():
    """Catches a search that skips feasible setups (a pp it never tries, a dp it drops): on 4 ranks
    of one node, every 1d and serial layout a hand enumeration lists (tp, pp with 1F1B at the largest
    micro-batch counts, dp) is among those the planner priced, and its first is the fastest of them."""
    cfg = small(n_layers=4)
    plan = search(cfg, gpus=4, machine=MACHINE, batch=8, ranks_per_node=4, precisions=("bf16",), modes=["1d", "serial"])
    found = {p.choice.describe() for p in plan.ranked}
    hand = []
    for tp in (1, 2, 4):
        for pp in (1, 2, 4):
            if 4 % (tp * pp):
                continue
            dp = 4 // (tp * pp)
            ms = [m for m in range(pp, 8 // dp + 1) if (8 // dp) % m == 0][-2:] if pp > 1 else [None]
            for m in ms:
                pipe = {"microbatches": m, "pp_schedule": "1f1b"} if pp > 1 else {}
                lay = Layout("serial" if tp == 1 else "1d", tp=tp, pp=pp, dp=dp, ranks_per_node=4, **pipe)
                hand.append(price(cfg, Choice(lay, precision="bf16"), batch=8, machine=MACHINE))
    missing = [p.choice.describe() for p in hand if p.choice.describe() not in found]
    assert not missing
    assert plan.ranked == sorted(plan.ranked, key=lambda p: p.step_s)
    assert plan.ranked[0].step_s <= min(p.step_s for p in hand) * (1 + 1e-12)


def test_a_tensor_group_that_only_some_option_settings_allow_is_searched():
    """Catches the search dropping a tp because the mode's default options refuse it: on 3 ranks,
    subgraph's default of 2 sub-grids does not divide tp = 3, yet 3 sub-grids do, and the model's
    12 heads split over them; and 2d and 3d, which no divisor of 3 ranks suits, named with the
    grids they need (4 and 9, 8 and 27), not a hint of tp = 4 or 8 that 3 ranks cannot give."""
    cfg = small(n_layers=4)  # 12 heads, d_model 192
    plan = search(cfg, gpus=3, machine=MACHINE, batch=6, ranks_per_node=3, precisions=("bf16",))
    assert any(p.choice.layout.mode == "subgraph" and p.choice.layout.tp == 3 for p in plan.ranked)
    assert plan.smallest_groups == {"2d": [4, 9], "3d": [8, 27]}
    verdicts = mode_verdicts(plan, ["2d", "3d"])
    assert verdicts["3d"] == "refused: no tp of 3 ranks makes a layout of it (tp = 3); its smallest are tp = 8 and 27"
    assert verdicts["2d"].endswith("its smallest are tp = 4 and 9")
    one = search(cfg, gpus=1, machine=MACHINE, batch=6, precisions=("bf16",), modes=["serial", "1d"])
    assert mode_verdicts(one, ["1d"])["1d"] == "refused: one rank has no tensor group to split over; its smallest are tp = 2 and 3"


def test_gradient_accumulation_is_priced_as_its_passes_and_one_update():
    """Catches the planner pricing --microbatches without --pp as one pass over the whole batch:
    two passes of 4 sequences each compute and run the tensor collectives of a 4-sequence step
    (twice the latency of one 8-sequence step's calls), hold one 4-sequence pass's activations,
    and reduce the gradients and update once."""
    cfg = small(n_layers=4)
    lay = Layout("1d", tp=2, dp=2, ranks_per_node=4)
    whole = price(cfg, Choice(lay), batch=16, machine=MACHINE)
    half = price(cfg, Choice(lay), batch=8, machine=MACHINE)
    passes = price(cfg, Choice(lay.replace(microbatches=2)), batch=16, machine=MACHINE)
    assert passes.terms["compute"] == pytest.approx(2 * half.terms["compute"])
    assert passes.terms["tensor"] == pytest.approx(2 * half.terms["tensor"])
    assert passes.terms["tensor"] > whole.terms["tensor"]  # the same bytes in twice the calls
    assert passes.terms["data"] == pytest.approx(half.terms["data"]) == pytest.approx(whole.terms["data"])
    assert passes.memory["activations"] == pytest.approx(half.memory["activations"])
    assert passes.memory["activations"] < whole.memory["activations"]


def test_gradient_accumulation_rescues_a_batch_whose_activations_are_over_the_limit():
    """Catches the search dropping a layout whose batch fits only in smaller passes: one rank, 64
    sequences, a limit below the checkpointed whole batch but above the checkpointed batch in 8
    passes. The planner must rank a setup with accumulation, within the limit, whose command
    trains it with --microbatches."""
    cfg = small(n_layers=4)
    precision = MACHINE.precision
    whole = price(cfg, Choice(Layout("serial"), precision=precision, checkpointing=True), batch=64, machine=MACHINE)
    passes = price(cfg, Choice(Layout("serial", microbatches=8), precision=precision, checkpointing=True), batch=64,
                   machine=MACHINE)
    limit = (whole.memory["total"] + passes.memory["total"]) / 2
    plan = search(cfg, gpus=1, machine=MACHINE, batch=64, precisions=(precision,), memory_gib=limit / 2 ** 30)
    assert plan.ranked and all(p.memory["total"] <= limit for p in plan.ranked)
    first = plan.ranked[0].choice
    assert first.layout.microbatches > 1 and first.layout.pipeline is None
    assert f"--microbatches {first.layout.microbatches}" in first.train_flags()
    assert f"accumulated m={first.layout.microbatches}" in first.describe()


def test_memory_limit_drops_and_counts_and_zero_or_checkpointing_rescue():
    """Catches a setup over the memory limit in the ranking, the drops going uncounted, or ZeRO and
    activation checkpointing never tried: with a limit between the smallest and the largest
    memory of the unlimited search, every ranked setup fits, some were dropped, and some ranked
    setup needed ZeRO or checkpointing to fit."""
    cfg = small(n_layers=4)
    free = search(cfg, gpus=8, machine=MACHINE, batch=16, ranks_per_node=8, precisions=("bf16",))
    totals = sorted(p.memory["total"] for p in free.ranked)
    limit = totals[len(totals) // 4]
    plan = search(cfg, gpus=8, machine=MACHINE, batch=16, ranks_per_node=8, precisions=("bf16",),
                  memory_gib=limit / 2 ** 30)
    assert plan.ranked and plan.over_memory > 0
    assert all(p.memory["total"] <= limit for p in plan.ranked)
    assert any(p.choice.zero or p.choice.checkpointing for p in plan.ranked)
    assert all(p.memory["total"] > limit for p in plan.closest_over.values())


def test_no_micro_batch_of_zero_sequences_is_priced():
    """Catches the old `plan --splits` pricing "16 micro-batches of 0": a pipeline with more
    micro-batches than a replica's sequences is refused by `price`, and the search lists none."""
    cfg = small(n_layers=4)
    lay = Layout("1d", tp=2, pp=2, microbatches=4)
    with pytest.raises(LatticeConfigError, match="micro-batches"):  # (as training words it)
        price(cfg, Choice(lay), batch=2, machine=MACHINE)
    plan = search(cfg, gpus=8, machine=MACHINE, batch=4, ranks_per_node=8, precisions=("bf16",))
    for p in plan.ranked:
        lay = p.choice.layout
        assert lay.pp == 1 or 4 // lay.dp >= lay.pipeline.m


@pytest.mark.parametrize("n_layers", [4, 6])
def test_train_flags_of_a_choice_give_back_its_layout(n_layers):
    """Catches a suggested command line that would train another layout than the one priced: the
    flags parse (as `lattice train` parses them) back into the same Layout (with 6 blocks, pp = 4
    with its uneven split)."""
    import argparse

    from lattice.cli.arguments import add_layout_flags, layout_from_args

    cfg = small(n_layers=n_layers)
    plan = search(cfg, gpus=8, machine=MACHINE, batch=16, ranks_per_node=4, precisions=("bf16",))
    for p in plan.ranked[:40] + [p for p in plan.ranked[40:] if p.choice.layout.pp_layers]:
        parser = argparse.ArgumentParser()
        add_layout_flags(parser)
        for flag in ("--zero", "--precision"):
            parser.add_argument(flag)
        parser.add_argument("--activation-checkpointing", action="store_true")
        args = parser.parse_args(p.choice.train_flags().split())
        assert layout_from_args(args, ranks_per_node=4) == p.choice.layout, p.choice.train_flags()


def test_machine_presets_and_files():
    """Catches a preset with a missing rate and a `--machine` file whose per-world calibrations stay
    lists (unhashable, never matched): each preset prices a step; a file's by_world rows are read,
    and `at` picks the calibration of the nearest world size."""
    cfg = small(n_layers=2)
    for name, machine in MACHINES.items():
        assert estimate(cfg, "serial", batch=2).time(machine)["step"] > 0, name
    m = machine_named(json.dumps({"flop_rate": 1e12, "alpha_intra": 1e-6, "beta_intra": 1e-10, "alpha_inter": 1e-5,
                                  "beta_inter": 1e-9, "ranks_per_node": 8,
                                  "by_world": [[1, 1e12, 1e9, 1e9, 1e-6, 1e-10],
                                               [8, 2e11, 1e9, 1e9, 1e-3, 1e-10, 1e-5, 1e10, 0, 0, 0, 0,
                                                [["all_reduce", 2e-3, 3e-10]]]]}))
    assert m.at(1).flop_rate == 1e12 and m.at(6).flop_rate == 2e11 and m.at(2).flop_rate == 1e12
    hash(m)  # a Machine file's nested lists became tuples
    assert m.at(8).link(False, "all_reduce") == (2e-3, 3e-10) and m.at(8).link(False, "broadcast") == (1e-3, 1e-10)
    assert m.at(8).link(True, "all_reduce") == (1e-3, 1e-9) and m.at(1).link(False, "all_reduce") == (1e-6, 1e-10)
    with pytest.raises(LatticeConfigError, match="no preset"):
        machine_named("no-such-machine")
    assert isinstance(MACHINES["cpu-2core"], Machine)


def test_the_cpu_presets_rows_are_read_column_by_column_from_its_file():
    """Catches the cpu-2core preset losing its calibrated curves or reading them into the wrong
    columns: each of its rows at 2, 4 and 8 ranks is the file's, named field by field as
    BY_WORLD_FIELDS orders them, and the machine at 2 ranks reads the file's wake curve and
    pipeline schedules' times."""
    import json
    import os

    from lattice.cost import machines
    from lattice.cost.machine import BY_WORLD_FIELDS
    from lattice.cost.machines import frozen

    with open(os.path.join(os.path.dirname(machines.__file__), "cpu_2core.json")) as f:
        rows = json.load(f)["rows"]
    assert [list(row) for row in rows] == [list(BY_WORLD_FIELDS)] * 3 and [row["ranks"] for row in rows] == [2, 4, 8]
    two = MACHINES["cpu-2core"].at(2)
    assert two.flop_rate == rows[0]["flop_rate"] and two.skew == rows[0]["skew"]
    assert two.wake_curve == frozen(rows[0]["wake_curve"]) and len(two.wake_curve) == 4
    assert two.pipeline_actions == frozen(rows[0]["pipeline_actions"])
    assert MACHINES["cpu-2core"].at(8).collective_curves == frozen(rows[2]["collective_curves"])


def test_plan_auto_answers_in_text_and_json(capsys):
    """Catches `plan --auto` crashing on a real preset, printing columns that run together, or JSON
    that is not one document: GPT-2-medium on 16 GPUs of 4 per node."""
    argv = ["plan", "--auto", "--arch", "gpt2", "--model", "gpt2-medium", "--gpus", "16", "--ranks-per-node", "4",
            "--batch", "32", "--machine", "h100-node"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if re.match(r"\s+\d+\s+[\d,]+\.\d", line)]
    assert len(rows) == 5
    assert "the first as a run: torchrun --nnodes 4 --nproc-per-node 4 " in out and "the other modes:" in out
    for mode in ("1d", "2d", "3d", "subgraph"):
        assert f"  {mode}: " in out
    assert cli.main(argv + ["--json"]) == 0
    answer = json.loads(capsys.readouterr().out)
    assert len(answer["top"]) == 5 and answer["priced"] >= answer["fit"] > 0
    steps = [t["step_s"] for t in answer["top"]]
    assert steps == sorted(steps)


def test_plan_auto_prints_a_train_command_that_runs_its_first_choice(capsys):
    """Catches the printed run dropping the launcher (a --dp 4 layout then refused in one process),
    the model's size flags or the batch, or naming another layout than the one ranked first."""
    from lattice.cli.arguments import layout_from_args

    argv = ["plan", "--auto", "--model", "small", "--n-layers", "2", "--no-bias", "--gpus", "4", "--batch", "8",
            "--machine", "cpu-2core"]
    assert cli.main(argv) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("the first as a run: "))
    words = shlex.split(line[len("the first as a run: "):])
    assert words[:2] == ["lattice", "train"]
    args = cli.build_parser("train").parse_args(words[1:])
    assert (args.nproc, args.n_layers, args.bias, args.batch_size) == (4, 2, False, 8)
    assert cli.main(argv + ["--json"]) == 0
    answer = json.loads(capsys.readouterr().out)
    first = answer["top"][0]
    assert answer["command"] == " ".join(words)  # the same line for scripts
    layout = layout_from_args(args)
    assert (layout.mode, layout.tp, layout.cp, layout.pp, layout.dp, dict(layout.options)) == (
        first["mode"], first["tp"], first["cp"], first["pp"], first["dp"], first["options"])
    assert (args.zero or 0, bool(args.activation_checkpointing)) == (first["zero"], first["activation_checkpointing"])
    assert cli.main(argv[:-4] + ["--gpus", "16", "--ranks-per-node", "4", "--batch", "16"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("the first as a run: "))
    assert "torchrun --nnodes 4 --nproc-per-node 4 " in line and " -m lattice train " in line


def test_plan_auto_refuses_bad_input_in_one_line(capsys):
    """Catches --auto without --gpus, an unknown mode or a precision the machine has no rate for
    ending in a traceback."""
    for extra, words in ((["--auto"], "--gpus"), (["--auto", "--gpus", "4", "--modes", "4d"], "no mode 4d"),
                         (["--auto", "--gpus", "4", "--machine", "cpu-2core", "--precision", "bf16"], "fp32 only"),
                         (["--auto", "--gpus", "4", "--batch", "0"], "give the global batch")):
        assert cli.main(["plan", *extra]) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and words in err, err


def test_topology_of_a_pipeline_stage_sends_across_nodes():
    """Catches the pipeline hop priced inside a node when the stages sit on different nodes."""
    lay = Layout("1d", tp=4, pp=2, microbatches=2, ranks_per_node=4)
    assert spans_nodes(lay.topology, (MeshAxis.PP,))
    assert not spans_nodes(lay.replace(ranks_per_node=8).topology, (MeshAxis.PP,))


def test_a_classifier_is_planned_without_pipeline_or_context_parallelism():
    """Catches the planner proposing for --task classify a pipeline or cp, which training refuses
    (one target per sequence)."""
    cfg = model_config("bert", "bert-base", num_labels=3, n_layers=4)
    plan = search(cfg, gpus=8, machine=MACHINE, batch=16, ranks_per_node=8, precisions=("bf16",))
    assert plan.ranked
    assert all(p.choice.layout.pp == 1 and p.choice.layout.cp == 1 for p in plan.ranked)


def test_a_pipeline_hop_under_context_parallelism_sends_its_share_of_the_sequence():
    """Each cp rank of a stage holds T/cp of every sequence and sends only that to the next stage;
    pricing the hop with the whole sequence (cp ignored) made `plan --pp --cp` overprice it cp-fold."""
    from lattice.cost.pipeline import p2p_piece

    cfg = model_config("gpt2", "small", vocab_size=2048)  # T 128, h 192
    for cp in (1, 2, 4):
        lay = Layout("1d", tp=2, pp=2, cp=cp, microbatches=2, pp_scatter_gather=False)
        # a replica's 8 sequences in 2 micro-batches: 4 x T/cp tokens x h, whole on each 1d rank
        assert p2p_piece(cfg, lay, batch=8) == 4 * (128 // cp) * 192


def test_a_pipeline_on_shared_cores_computes_at_the_rates_of_the_whole_world():
    """With 8 ranks on 2 cores, dp=8 and pp=2 x dp=4 with 2 micro-batches give every rank the
    same work (the whole model on one sequence, or half of it on two), so their compute terms
    agree; pricing the pipeline at the rates of a rank with a core of its own (the world of 2)
    made it ~35% cheaper than it measures."""
    cfg = model_config("gpt2", "small", vocab_size=2048)
    machine = MACHINES["cpu-2core"]
    flat = price(cfg, Choice(Layout("serial", dp=8, ranks_per_node=8)), batch=8, machine=machine)
    piped = price(cfg, Choice(Layout("serial", dp=4, pp=2, microbatches=2, ranks_per_node=8)), batch=8,
                  machine=machine)
    assert piped.terms["compute"] == pytest.approx(flat.terms["compute"], rel=1e-9)


def test_ranks_sharing_cores_compute_at_the_mean_of_their_tensor_groups_work():
    """Catches pricing sub-graph with common="subgrid" by its busiest rank where ranks outnumber
    the cores: the sub-grid without the common layers leaves its core to the one with them, and
    pricing rank 0's work put gpt2-wide's tp=2 pp=2 dp=2 layout at +44% of its measured step on 8
    ranks of 2 cores. Its compute and update are the mean of each rank's as the cost model prices
    that rank alone at the world's rates; 1d, whose ranks work alike, keeps rank 0's."""
    from lattice.cost.pricing import _trainer_scalars

    cfg = model_config("gpt2", "small", vocab_size=2048, n_layers=2)
    machine = MACHINES["cpu-2core"]
    for options, uneven in (({"common": "subgrid"}, True), ({}, False)):
        lay = Layout("subgraph" if uneven else "1d", tp=2, dp=4, options=options, ranks_per_node=8)
        ranks = [estimate(cfg, lay, batch=2, rank=r).time(machine.at(8)) for r in (0, 1)]
        compute = [t["forward_compute"] + t["backward_compute"] for t in ranks]
        update = [t["update"] + t["update_overlapped"] for t in ranks]
        priced = price(cfg, Choice(lay), batch=8, machine=machine)
        assert (compute[0] > 1.3 * compute[1]) == uneven  # sub-grid 0 runs the MLPs and the head
        assert priced.terms["compute"] == pytest.approx(sum(compute) / 2, rel=1e-9)
        assert priced.terms["update"] - _trainer_scalars(lay, Choice(lay), machine) == pytest.approx(sum(update) / 2)


def test_work_only_as_many_ranks_as_cores_do_runs_at_the_rates_of_a_rank_with_a_core_of_its_own():
    """Catches pricing sub-graph's common layers, their gradients' sum and their update at the
    world's rates for the mean rank when only sub-grid 0's 2 ranks do them at 8 ranks on 2 cores:
    the 6 others wait and leave their cores, and a rank among 8 on 2 cores runs 5.3 times slower
    than one with a core of its own, not 4. gpt2-wide's tp=8 (4 sub-grids, common on the first)
    measured 174 ms a step where it was priced at 296, and the planner passed over the fastest
    layout. Nor do the busy ranks wait for the others' scheduling at the collectives they share
    with them: the waiting ranks are there first, and only their wake is paid, at the rates of a
    core each (left out, sub-graph at tp = 4 on 4 ranks was priced 7-15% below its measured steps
    and chosen first). With 2 sub-grids over 2 replicas 4 ranks run the
    common layers, more than the cores, and the mean rank at the world's rates stays."""
    from lattice.cost.pricing import _group, _trainer_scalars

    from lattice.cost.machine import BY_WORLD_FIELDS

    cfg = model_config("gpt2", "small", vocab_size=2048, n_layers=2)
    machine = MACHINES["cpu-2core"]
    # the preset's rates, α and β (its rows' first 14 columns, without their curves) and waits that
    # depend on the group and the stretch: 2 ms at 2 ranks, 6 at 4, after any stretch beyond 1 ms
    curve = ((2, 0.001, 0.002), (2, 1.0, 0.002), (4, 0.001, 0.006), (4, 1.0, 0.006))
    assert BY_WORLD_FIELDS.index("skew_curve") == 15
    machine = dataclasses.replace(machine, by_world=tuple(row[:14] + (0.0, curve) for row in machine.by_world))

    def rank_figures(lay, rank, at):
        c = estimate(cfg, lay, batch=8 // lay.dp, rank=rank)
        c.topology = lay.topology
        t = c.time(at)
        data = sum(s for term, s in c.term_times(at) if _group(term.site) == "data")
        return t["forward_compute"] + t["backward_compute"], t["update"] + t["update_overlapped"], data

    few = Layout("subgraph", tp=8, options={"subgrids": 4, "common": "subgrid", "projections": "common"},
                 ranks_per_node=8)
    own, world = machine.at(2), machine.at(8)
    busy, idle = rank_figures(few, 0, own), rank_figures(few, 2, own)
    priced = price(cfg, Choice(few), batch=8, machine=machine).terms
    assert idle[1] == idle[2] == 0  # rank 2 (sub-grid 1) holds no parameters
    assert priced["compute"] == pytest.approx(rank_figures(few, 2, world)[0] + busy[0] - idle[0], rel=1e-9)
    assert priced["data"] == pytest.approx(busy[2], rel=1e-9) and busy[2] > 0
    scalars = _trainer_scalars(few, Choice(few), own)  # the gradient norm's all-reduce, the others waiting
    assert priced["update"] - scalars == pytest.approx(busy[1], rel=1e-9)
    assert busy[1] < rank_figures(few, 0, world)[1]
    # the busy ranks meet at every collective on a core each: each pays its waiting partners' wake
    # (a wake curve at the rates of 2 ranks, none at 8) and the skew of the world of 2's curve
    c = estimate(cfg, few, batch=8, rank=0)
    c.topology = few.topology
    syncs = c.syncs()
    assert sum(c.grad_syncs().values()) > 0 and sum(c.syncs(grads=False).values()) > 0
    wake = BY_WORLD_FIELDS.index("wake_curve")  # beyond the 16 columns above: the 2-rank row grows to it
    woken = dataclasses.replace(machine, by_world=tuple(
        row + ((),) * (wake - len(row)) + (((0.001, 0.0), (0.004, 0.001)),) if row[0] == 2 else row
        for row in machine.by_world))
    assert woken.at(2).wake_curve == ((0.001, 0.0), (0.004, 0.001)) and woken.at(8).wake_curve == ()
    skew = woken.at(2).skew_seconds(priced["compute"], syncs, collectives=sum(syncs.values()))
    assert skew > woken.at(2).skew_seconds(priced["compute"], c.grad_syncs(), collectives=sum(c.grad_syncs().values()))
    assert price(cfg, Choice(few), batch=8, machine=woken).terms["skew"] == pytest.approx(skew, rel=1e-9)
    # the loss's one-number sum over the 8 ranks, which the busy ranks reach last, at a core's rates;
    # the branches' scatters and gathers, which every rank runs busy, at the world's
    loss = [t for t in c.terms if t.site == "loss"]
    assert loss and all(t.elements == 1 and _group(t.site) == "tensor" for t in loss)

    def tensor(at, terms=None):
        return sum(s for term, s in c.term_times(at, terms) if _group(term.site) == "tensor")

    assert tensor(world, loss) > 1.5 * tensor(own, loss)
    assert priced["tensor"] == pytest.approx(tensor(world) - tensor(world, loss) + tensor(own, loss), rel=1e-9)

    many = Layout("subgraph", tp=4, dp=2, options={"common": "subgrid"}, ranks_per_node=8)
    ranks = [rank_figures(many, r, world) for r in range(4)]
    priced = price(cfg, Choice(many), batch=8, machine=machine).terms
    assert ranks[0][0] > 1.3 * ranks[2][0]  # sub-grid 0 (ranks 0, 1) runs the common layers
    assert priced["compute"] == pytest.approx(sum(r[0] for r in ranks) / 4, rel=1e-9)
    c = estimate(cfg, many, batch=4, rank=0)
    c.topology = many.topology
    assert priced["tensor"] == pytest.approx(sum(s for term, s in c.term_times(world) if _group(term.site) == "tensor"),
                                             rel=1e-9)


@pytest.mark.parametrize("schedule,v", [("1f1b", 1), ("interleaved", 2)])
def test_a_pipeline_schedule_pays_its_own_time_per_chunk_of_a_micro_batch(schedule, v):
    """Catches Machine.pipeline_actions left out of a pipeline's price or charged per micro-batch
    rather than per chunk: torch.distributed.pipelining's own time per chunk of one micro-batch
    (on a tiny model at 4 ranks on 2 cores the pipelines measured 38-68 ms where their operations
    and hops priced 26-41) is paid m v times on the pipeline term and once more on each of the
    pp - 1 slots of the bubble, and only by the schedule it was measured for."""
    cfg = model_config("gpt2", "small", vocab_size=2048, n_layers=4)
    lay = Layout("serial", pp=2, dp=2, microbatches=4, pp_schedule=schedule, ranks_per_node=4)
    own = {"1f1b": 0.003, "interleaved": 0.005}
    base = price(cfg, Choice(lay), batch=8, machine=MACHINE)
    paid = price(cfg, Choice(lay), batch=8, machine=dataclasses.replace(MACHINE, pipeline_actions=tuple(own.items())))
    assert paid.terms["pipeline"] - base.terms["pipeline"] == pytest.approx(4 * v * own[schedule])
    assert paid.terms["bubble"] - base.terms["bubble"] == pytest.approx(1 * own[schedule])
    other = dataclasses.replace(MACHINE, pipeline_actions=(("gpipe", 0.003),))
    assert price(cfg, Choice(lay), batch=8, machine=other).step_s == pytest.approx(base.step_s)


def _pipeline_actions_on_set_timings() -> tuple:
    """`_pipeline_actions` on steps timed as if each schedule took 10 ms + 4 ms per micro-batch
    (gpipe), 3 ms (1f1b) or 5 ms (interleaved), against a price of 20 ms + 1 ms per micro-batch;
    with what the price was asked: (sizes of the model, micro-batches, batch, the machine's actions)."""
    import lattice.cost.calibrate as calibrate
    import lattice.cost.pricing as pricing
    from lattice.cost.plan import model_config

    per_microbatch = {"gpipe": 0.004, "1f1b": 0.003, "interleaved": 0.005}
    # the timed pairs in calibrate's order: each schedule at 3 micro-batches per stage beyond 1 (p = 2)
    fake = [(0.01 + 2 * per_microbatch[s], 4 * per_microbatch[s]) for s in ("gpipe", "1f1b", "interleaved")]
    asked = []

    def fake_price(cfg, choice, *, batch, machine):
        asked.append(((cfg.vocab_size, cfg.n_layers, cfg.d_model, cfg.seq_len), choice.layout.pipeline.m, batch,
                      machine.pipeline_actions))
        return pricing.Priced(choice, 0.02 + 0.001 * choice.layout.pipeline.m, {}, {})

    real, calibrate.timed_differences = calibrate.timed_differences, lambda pairs, n: fake[:len(pairs)]
    real_price, pricing.price = pricing.price, fake_price
    try:
        machine = dataclasses.replace(MACHINE, pipeline_actions=(("1f1b", 1.0),))
        cfg = model_config("gpt2", "small", vocab_size=2048, d_model=48, seq_len=16)
        return calibrate._pipeline_actions(cfg, machine, 1), asked
    finally:
        calibrate.timed_differences, pricing.price = real, real_price


def test_a_schedules_own_time_per_chunk_is_its_slope_beyond_its_price():
    """Catches the calibration's pipeline_actions taken per micro-batch rather than per chunk
    (interleaved runs two chunks of one block per micro-batch on each rank, the others one of two),
    with the price's own growth per micro-batch left in, priced with the actions it is measuring,
    or timed on a model other than the family's at its own width and sequence (the tiny preset's
    ranks idle between chunks, which a step's do not: gpt2-wide's pipeline at 4 ranks grew 27.4 ms
    per micro-batch where the tiny model's grew 5.6). By hand, against a price growing 1 ms per
    micro-batch: gpipe 4 - 1 = 3 ms, 1f1b 3 - 1 = 2 ms, interleaved (5 - 1) / 2 = 2 ms."""
    from multiproc import run_distributed

    for actions, asked in run_distributed(2, _pipeline_actions_on_set_timings):
        assert dict(actions) == pytest.approx({"gpipe": 0.003, "1f1b": 0.002, "interleaved": 0.002}, abs=1e-9)
        assert [(m, batch) for _, m, batch, _ in asked] == [(2, 2), (6, 6)] * 3
        assert all(sizes == (16, 4, 48, 16) and not actions for sizes, _, _, actions in asked)


def test_an_all_reduce_over_groups_smaller_than_the_world_is_priced_on_their_own_curve():
    """Catches a dp = 2 or tp = 2 group's all-reduce at 4 ranks priced on the whole world's α and
    curve at its wire bytes (two pairs' all-reduces of 4.2 MB each at 4 ranks on 2 cores took 7.1 ms
    where that said 3.6): with Machine.group_curves each call of a group of 2 costs the curve at its
    wire bytes (a pair's all-reduce puts its whole buffer on each rank's wire), figures by hand from
    the points (0 B, 1 ms), (1 MB, 3 ms); the groups of the whole world, and every term without a
    curve for its group size, keep their price."""
    cfg = model_config("gpt2", "small", vocab_size=2048)
    lay = Layout("1d", tp=2, dp=2, ranks_per_node=4)
    cost = estimate(cfg, lay, batch=4)
    curves = dataclasses.replace(MACHINE, group_curves=(("all_reduce", 2, ((0.0, 0.001), (1e6, 0.003))),))
    before, after = cost.term_times(MACHINE), cost.term_times(curves)
    pairs = 0
    for (term, old), (same, new) in zip(before, after):
        assert term is same
        if term.op == "all_reduce" and cost.term_ranks(term) == 2:
            pairs += 1
            assert new == pytest.approx(term.calls * (0.001 + 0.002 * term.bytes / term.calls / 1e6)), term
        else:
            assert new == old, term
    assert pairs >= 2  # the blocks' activations over tp, the gradients over dp
    whole = estimate(cfg, Layout("serial", dp=4, ranks_per_node=4), batch=4)
    every = dataclasses.replace(MACHINE, group_curves=(("all_reduce", 4, ((0.0, 1.0), (1e6, 1.0))),))
    assert whole.term_times(every) == whole.term_times(MACHINE)


def _group_curves_on_set_timings() -> tuple:
    """`_group_curves` at 4 ranks with the loop's gain set to 8 x k ms for the k-th size."""
    import lattice.cost.calibrate_comm as calibrate

    gains = iter(range(1, 100))

    def fake(pairs, n):
        return [(0.01, 8e-3 * next(gains))]

    real, calibrate.timed_differences = calibrate.timed_differences, fake
    try:
        return calibrate._group_curves(lambda coll: None, 1)
    finally:
        calibrate.timed_differences = real


def test_the_group_curves_are_each_sizes_gain_per_call_at_a_ranks_wire_bytes():
    """Catches the calibration's group curves at the wrong group sizes (at 4 ranks: pairs only; the
    world's is the collective curve), at the buffer's bytes rather than a rank's wire bytes
    (2 (n - 1)/n of them: the buffer itself for a pair) or per loop rather than per call (8 calls)."""
    from multiproc import run_distributed

    from lattice.cost.calibrate import COLLECTIVE_SIZES

    expected = (("all_reduce", 2, tuple((numel * 4.0, k * 1e-3) for k, numel in enumerate(COLLECTIVE_SIZES, 1))),)
    for curves in run_distributed(4, _group_curves_on_set_timings):
        assert curves[0][:2] == expected[0][:2]
        assert [w for w, _ in curves[0][2]] == [w for w, _ in expected[0][2]]
        assert [t for _, t in curves[0][2]] == pytest.approx([t for _, t in expected[0][2]])
        assert len(curves) == 1


def test_a_gradient_all_reduce_is_priced_at_its_measured_ratio_to_the_collective():
    """Catches Machine.grad_sum_ratios ignored (a dp = 2 step's gradient sum of gpt2-deep priced
    4.3 ms where the Trainer's took 8.5 at 2 ranks on 2 cores), applied to a layer's all-reduces
    too, or read on the term's bytes in all rather than a call's wire bytes: with ratios through
    (1 MB, 1) and (4 MB, 3) every gradient all-reduce costs its old price times the ratio at its
    wire bytes, linear between the points and flat beyond them, worked out by hand; every other
    term keeps its price."""
    cfg = model_config("gpt2", "small", vocab_size=2048)
    cost = estimate(cfg, Layout("1d", tp=2, dp=2, ranks_per_node=4), batch=4)
    ratios = dataclasses.replace(MACHINE, grad_sum_ratios=((4e6, 3.0), (1e6, 1.0)))

    def by_hand(wire):
        return 1.0 if wire <= 1e6 else 3.0 if wire >= 4e6 else 1.0 + 2.0 * (wire - 1e6) / 3e6

    assert [ratios.grad_sum_ratio(w) for w in (1e3, 1e6, 2.5e6, 4e6, 1e9)] == pytest.approx([1.0, 1.0, 2.0, 3.0, 3.0])
    grads = 0
    for (term, old), (same, new) in zip(cost.term_times(MACHINE), cost.term_times(ratios)):
        assert term is same
        if term.site == "grads" and term.op == "all_reduce":
            grads += 1
            wire = term.bytes * 2 * (2 - 1) / 2 / term.calls  # a pair's ring: its whole buffer once
            assert new == pytest.approx(old * by_hand(wire)), term
        else:
            assert new == old, term
    assert grads >= 1
    assert cost.term_times(dataclasses.replace(MACHINE, grad_sum_ratios=((1e6, 2.0),))) == cost.term_times(MACHINE)


def _grad_sums_on_a_set_clock() -> tuple:
    """`_grad_sum_ratios` at 2 ranks with a clock that the all-reduce alone moves (1 ns per
    element), what it runs recorded: ("stretch" | "barrier" | elements and buffer of an all-reduce)."""
    import types

    import torch

    import lattice.cost.calibrate_comm as calibrate

    now, calls, buffers = [0.0], [], []
    real_reduce, real_barrier, real_time = calibrate.dist.all_reduce, calibrate.dist.barrier, calibrate.time

    def all_reduce(x, op=None, **kw):
        if x.dtype == torch.float64:  # the slowest rank's seconds: the real one
            return real_reduce(x, op=op)
        calls.append(x.numel())
        buffers.append(x)
        now[0] += x.numel() * 1e-9

    calibrate.dist.all_reduce, calibrate.dist.barrier = all_reduce, lambda: calls.append("barrier")
    calibrate.time = types.SimpleNamespace(perf_counter=lambda: now[0])
    try:
        looped = {n: n * 0.5e-9 for n in calibrate.GRAD_SUM_SIZES}
        ratios = calibrate._grad_sum_ratios(lambda: calls.append("stretch"), looped, 3)
    finally:
        calibrate.dist.all_reduce, calibrate.dist.barrier, calibrate.time = real_reduce, real_barrier, real_time
    return ratios, calls, len({id(b) for b in buffers}), len(buffers), [b.numel() for b in buffers]


def test_the_gradient_sum_is_timed_after_compute_and_a_barrier_on_a_fresh_buffer():
    """Catches the gradient sum timed back to back on one buffer (the loop the collectives' curves
    come from, which priced gpt2-deep's 4.4 MB sum at half the Trainer's time), without the stretch
    of compute and the barrier before each call, or its ratio taken at the buffer's bytes rather
    than a rank's wire bytes (2 (n - 1)/n of them: the buffer itself for a pair): a clock only the
    all-reduce moves (1 ns per element) against a loop of 0.5 ns per element gives 2 at every size."""
    from multiproc import run_distributed

    from lattice.cost.calibrate_comm import GRAD_SUM_SIZES

    for ratios, calls, distinct, total, sizes in run_distributed(2, _grad_sums_on_a_set_clock):
        assert [w for w, _ in ratios] == [n * 4.0 for n in GRAD_SUM_SIZES]
        assert [r for _, r in ratios] == pytest.approx([2.0] * len(GRAD_SUM_SIZES))
        assert calls == [c for n in GRAD_SUM_SIZES for _ in range(7) for c in ("stretch", "barrier", n)]
        assert sizes == [n for n in GRAD_SUM_SIZES for _ in range(7)]
        assert distinct == total  # each call on a buffer of its own, as a step's concatenated gradients


@pytest.mark.parametrize("n_layers, pp_layers", [(4, None), (5, (3, 2)), (5, (2, 3))])
def test_a_pipeline_is_paced_by_its_slowest_stage_and_filled_by_the_others(n_layers, pp_layers):
    """Catches a pipeline priced with the embedding and the LM head on every stage (gpt2-small's
    pp = 2 at 2 ranks was priced 22-42% above its measured step), or with ceil(L / pp) blocks on
    every stage of an uneven split: the slowest stage sets the pace of the m micro-batches, and
    the other fills and drains the pipeline with one micro-batch of its blocks and its end part.
    Each stage's compute is the cost model's estimate of that rank of the pipeline itself (one
    micro-batch through its blocks)."""
    cfg = model_config("gpt2", "small", vocab_size=2048, n_layers=n_layers)
    lay = Layout("serial", pp=2, microbatches=4, pp_layers=pp_layers, ranks_per_node=4)
    priced = price(cfg, Choice(lay), batch=8, machine=MACHINE)
    stage = []
    for rank in (0, 1):
        t = estimate(cfg, lay, batch=8, rank=rank).time(MACHINE.with_precision("fp32"))  # Choice's default
        stage.append(t["forward_compute"] + t["backward_compute"])
    if pp_layers is None:
        assert stage[1] > stage[0]  # the head's products over a vocabulary of 2048
    hop = 2 * (MACHINE.alpha_intra + p2p_piece(cfg, lay, batch=8) * 4 * MACHINE.beta_intra)
    assert priced.terms["compute"] == pytest.approx(4 * max(stage), rel=1e-9)
    assert priced.terms["bubble"] == pytest.approx(min(stage) + hop, rel=1e-9)


@pytest.mark.parametrize("cores", [0, 2, 1])
def test_the_slowest_stage_of_a_pipeline_on_cores_of_its_own_waits_for_no_hops_latency(cores):
    """Catches the hops' latency charged on every micro-batch of a pipeline whose other stages run
    ahead of its slowest (the head's stage): at 2 ranks on 2 cores gpt2-small's pp = 2 1F1B
    measured 3.6 ms more with 8 micro-batches than with 4 and llama-gqa's 5.9 ms, where the full
    hop (2 alpha and the schedule's time per chunk) had priced 7-18 ms more. With a core per rank
    (`cores` 0: not known, or 2), the steady state's hop is 2 alpha + its own time less the
    stages' difference, at least its own time (wire and schedule); the bubble's hops (filling
    and draining) stay whole. Where the ranks outnumber the cores (1), the hop stays whole."""
    from lattice.cost.pipeline import p2p_piece

    cfg = model_config("gpt2", "small", vocab_size=2048, n_layers=4)
    lay = Layout("serial", pp=2, microbatches=4, ranks_per_node=2)
    alpha, beta, action = 3e-3, 1e-9, 2e-3  # a latency larger than the stages' difference
    machine = dataclasses.replace(MACHINE, alpha_intra=alpha, beta_intra=beta, cores=cores,
                                  pipeline_actions=(("1f1b", action),), ranks_per_node=2)
    priced = price(cfg, Choice(lay), batch=8, machine=machine).terms
    stage = []
    for rank in (0, 1):
        t = estimate(cfg, lay, batch=8, rank=rank).time(machine.with_precision("fp32"))
        stage.append(t["forward_compute"] + t["backward_compute"])
    own = 2 * p2p_piece(cfg, lay, batch=8) * 4 * beta + action
    hop = 2 * alpha + own
    assert 0 < max(stage) - min(stage) < 2 * alpha
    steady = hop - (max(stage) - min(stage)) if cores != 1 else hop
    assert priced["pipeline"] == pytest.approx(4 * steady, rel=1e-9)
    if cores != 1:
        assert priced["bubble"] == pytest.approx(min(stage) + hop, rel=1e-9)
        wide = dataclasses.replace(machine, alpha_intra=1.0)  # a difference that hides none of its own time
        assert price(cfg, Choice(lay), batch=8, machine=wide).terms["pipeline"] == pytest.approx(
            4 * (2 * 1.0 + own - (max(stage) - min(stage))), rel=1e-9)
        fast = dataclasses.replace(machine, alpha_intra=1e-6)  # the stages' difference hides all latency
        assert price(cfg, Choice(lay), batch=8, machine=fast).terms["pipeline"] == pytest.approx(4 * own, rel=1e-9)


def test_every_pipeline_the_search_ranks_splits_as_training_splits_it():
    """Catches `plan --auto` ranking pp = 4 for a model of 6 blocks with the flags `--pp 4` alone,
    which training refuses ("6 blocks do not split evenly into 4 stages"): an uneven split is
    priced and suggested with its --pp-layers, the extra blocks off the stages with the end parts."""
    cfg = small(n_layers=6)
    plan = search(cfg, gpus=8, machine=MACHINE, batch=16, ranks_per_node=4, precisions=("bf16",))
    pipelined = [p.choice.layout for p in plan.ranked if p.choice.layout.pp > 1]
    assert {lay.pp for lay in pipelined} >= {2, 4}
    for lay in pipelined:
        counts = [len(c) for c in lay.pipeline.chunks(cfg.n_layers)]  # raises where training would
        if lay.pp == 4:
            assert lay.pipeline.v > 1 or counts == [1, 2, 2, 1]


def test_kernel_rows_and_rate_from_the_median_of_the_product_bursts():
    """Catches the row term fitted from one burst of the products: the first, timed as the
    calibration's world starts, fitted 70-75 rows for gpt2-deep at 2 ranks where two later bursts
    of the same calibration gave 43-56. Of three bursts taking (rows + 50) x 1 µs, (rows + 150) x
    1 µs and (rows + 50) x 1.3 µs, the row term is 50 and the rate the median of what each burst
    gives the batch's products with it: weights x (512 + 50) over 562, 662 and 730.6 µs, the
    second's."""
    from lattice.cost.calibrate import _product_rates

    rows = [64, 128, 256, 512]
    bursts = [[(m + 50) * 1e-6 for m in rows], [(m + 150) * 1e-6 for m in rows], [(m + 50) * 1.3e-6 for m in rows]]
    kernel_rows, rate = _product_rates(rows, bursts, weights=1e6)
    assert kernel_rows == pytest.approx(50.0)
    assert rate == pytest.approx(1e6 * 562 / 662e-6)


def test_the_stage_figures_the_search_keeps_follow_every_argument_they_depend_on():
    """Catches the planner's kept stage figures (pricing._priced_blocks) answering a later price
    with the figures of another: a key that leaves out the machine, the placement of the groups on
    nodes, the ZeRO stage, the precision or the batch would price the second setup as the first.
    Each must equal the figures computed afresh (pricing._blocks_figures), and each pair differ."""
    from lattice.cost import pricing

    cfg = small(n_layers=4)
    lay = Layout("1d", tp=4, dp=2, ranks_per_node=8)
    spread = Layout("1d", tp=4, dp=2, ranks_per_node=2)  # the tensor groups now span nodes
    slower = dataclasses.replace(MACHINE, flop_rate=MACHINE.flop_rate / 2)
    base = dict(blocks=4, batch=4, machine=MACHINE, topology=lay.topology, zero=0, precision="fp32")
    variants = [{}, {"machine": slower}, {"topology": spread.topology}, {"zero": 1}, {"precision": "bf16"},
                {"batch": 2}]
    kept = []
    for change in variants:
        args = {**base, **change}
        kept.append(pricing._priced_blocks(cfg, lay, **args))
        assert kept[-1] == pricing._blocks_figures(cfg, lay, **args), change
        assert pricing._priced_blocks(cfg, lay, **args) is kept[-1]  # the second ask is kept
    for (a, fa), (b, fb) in itertools.combinations(zip(variants, kept), 2):
        assert fa != fb, (a, b)
