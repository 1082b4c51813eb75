"""Pricing a whole setup (lattice.planner.pricing through `search.price`): without a pipeline the
cost model's own step, plus the terms measured on ranks sharing cores (skew, wakes, group
curves), pipelines paced by their slowest stage, hops and overlap as training runs them."""

import dataclasses
import itertools

import pytest
from planner_cases import MACHINE, small

from lattice.cost.machines import MACHINES
from lattice.cost.model import estimate, spans_nodes
from lattice.cost.pipeline import p2p_piece
from lattice.cost import model_config
from lattice.planner.search import Choice, price
from lattice.modes.layout import Layout
from lattice.parallel.context import LatticeConfigError, MeshAxis


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
    slow_wire = dataclasses.replace(skewed, alpha_intra=10 * MACHINE.alpha_intra, beta_intra=10 * MACHINE.beta_intra,
                                    collectives=tuple((op, 10 * a, 10 * b) for op, a, b in MACHINE.collectives))
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


def _ring_send_latency_check(batch: int, beta: float) -> tuple[float, int]:
    import lattice.calibration.comm as calibrate
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
        return calibrate.measure_send_latency(cfg, batch, beta, reps=1), len(ran)
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


def test_topology_of_a_pipeline_stage_sends_across_nodes():
    """Catches the pipeline hop priced inside a node when the stages sit on different nodes."""
    lay = Layout("1d", tp=4, pp=2, microbatches=2, ranks_per_node=4)
    assert spans_nodes(lay.topology, (MeshAxis.PP,))
    assert not spans_nodes(lay.replace(ranks_per_node=8).topology, (MeshAxis.PP,))


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
    from lattice.planner.pricing import trainer_scalar_seconds

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
        assert priced.terms["update"] - trainer_scalar_seconds(lay, Choice(lay), machine) == pytest.approx(sum(update) / 2)


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
    from lattice.planner.pricing import comm_group, trainer_scalar_seconds

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
        data = sum(s for term, s in c.term_times(at) if comm_group(term.site) == "data")
        return t["forward_compute"] + t["backward_compute"], t["update"] + t["update_overlapped"], data

    few = Layout("subgraph", tp=8, options={"subgrids": 4, "common": "subgrid", "projections": "common"},
                 ranks_per_node=8)
    own, world = machine.at(2), machine.at(8)
    busy, idle = rank_figures(few, 0, own), rank_figures(few, 2, own)
    priced = price(cfg, Choice(few), batch=8, machine=machine).terms
    assert idle[1] == idle[2] == 0  # rank 2 (sub-grid 1) holds no parameters
    assert priced["compute"] == pytest.approx(rank_figures(few, 2, world)[0] + busy[0] - idle[0], rel=1e-9)
    assert priced["data"] == pytest.approx(busy[2], rel=1e-9) and busy[2] > 0
    scalars = trainer_scalar_seconds(few, Choice(few), own)  # the gradient norm's all-reduce, the others waiting
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
    assert loss and all(t.elements == 1 and comm_group(t.site) == "tensor" for t in loss)

    def tensor(at, terms=None):
        return sum(s for term, s in c.term_times(at, terms) if comm_group(term.site) == "tensor")

    assert tensor(world, loss) > 1.5 * tensor(own, loss)
    assert priced["tensor"] == pytest.approx(tensor(world) - tensor(world, loss) + tensor(own, loss), rel=1e-9)

    many = Layout("subgraph", tp=4, dp=2, options={"common": "subgrid"}, ranks_per_node=8)
    ranks = [rank_figures(many, r, world) for r in range(4)]
    priced = price(cfg, Choice(many), batch=8, machine=machine).terms
    assert ranks[0][0] > 1.3 * ranks[2][0]  # sub-grid 0 (ranks 0, 1) runs the common layers
    assert priced["compute"] == pytest.approx(sum(r[0] for r in ranks) / 4, rel=1e-9)
    c = estimate(cfg, many, batch=4, rank=0)
    c.topology = many.topology
    assert priced["tensor"] == pytest.approx(sum(s for term, s in c.term_times(world) if comm_group(term.site) == "tensor"),
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


def test_reductions_started_in_backward_are_hidden_by_its_compute_where_the_trainer_starts_them():
    """Catches the gradients' reductions DDP and the distributed optimizer's hooks start as backward
    completes each bucket priced after backward (torchtitan's FSDP rows were priced 30% slow so),
    hiding more of them than the backward's compute, or hiding a pipeline's flat all-reduce and the
    reductions of --no-overlap-grad-reduce, which the Trainer runs after the schedule."""
    cfg = model_config("gpt2", "small")
    gpu = MACHINES["h100-node"]
    blind = dataclasses.replace(gpu, overlap=0.0)  # a machine whose compute hides no collective
    lay = Layout("serial", dp=8, ranks_per_node=8)
    for zero, precision in ((0, "fp32"), (1, "bf16"), (2, "bf16")):
        c = estimate(cfg, lay, batch=8, zero=zero, precision=precision)
        reductions = c.comm_time(gpu.at(8), "backward", "grads")
        backward = c.time(gpu)["backward_compute"]
        assert reductions > 0 and backward > 0
        hidden, blinded = (price(cfg, Choice(lay, zero=zero, precision=precision), batch=64, machine=m).terms["data"]
                           for m in (gpu, blind))
        assert blinded - hidden == pytest.approx(min(reductions, backward), rel=1e-9)
        if zero or precision == "bf16":  # the hooks switched off: after backward, as on the blind machine
            after = price(cfg, Choice(lay, zero=zero, precision=precision, overlap_grad_reduce=False), batch=64,
                          machine=gpu)
            assert after.terms["data"] == pytest.approx(blinded, rel=1e-9)
            assert "--no-overlap-grad-reduce" in after.choice.train_flags()
        else:  # DDP's buckets always start in backward, and train has no flag for them
            assert "overlap" not in Choice(lay, overlap_grad_reduce=False).train_flags()
    piped = Layout("serial", dp=4, pp=2, microbatches=4, ranks_per_node=8)  # fp32: the flat all-reduce after it
    flat = price(cfg, Choice(piped), batch=32, machine=blind).terms["data"]
    assert flat > 0 and price(cfg, Choice(piped), batch=32, machine=gpu).terms["data"] == pytest.approx(flat, rel=1e-9)
    # the distributed optimizer under a pipeline starts them in the last micro-batch's backward
    assert (price(cfg, Choice(piped, zero=1), batch=32, machine=gpu).terms["data"]
            < price(cfg, Choice(piped, zero=1), batch=32, machine=blind).terms["data"])
