"""The conformance suite: every registered model family in every registered mode, in the small
layouts the mode declares (`Mode.test_layouts`; GPT-2, the reference family, in all of them,
every other family in each mode's first) and in pipeline layouts, against the family's serial
model and against its own analytic cost model.

Per (family, layout), on its processes (each world size starts once per session):
- float64, weights loaded from the family's serial model, the same global batch split over
  data-parallel replicas: the loss (the same float on every rank of a replica), every full
  gradient, the full logits of inference and (after one AdamW step) every full parameter and
  both AdamW moments equal serial's within 1e-10 relative, for every config the family declares
  (`Model.test_shapes`); with the first of them, the loss and gradients also under full and
  selective activation checkpointing;
- CommMeter's (phase, collective, group size) calls and elements of one step of a replica equal
  `lattice.cost.estimate`'s, with and without checkpointing, and the bytes autograd saves for
  backward are within 2% of its activation figure; what selective checkpointing holds beyond
  full checkpointing after a forward (`held_forward_bytes`: the products' and fused attention's
  kept outputs) equals the estimate's difference;
- sizes the layout cannot divide are refused on every rank before any collective;
- checkpoints and HuggingFace weights (for families with an HF mapping) round-trip through the
  layout unchanged.
A family or mode that registers without declaring its test shapes or layouts fails
`test_every_family_and_mode_declares_what_the_suite_runs`.

tests/probe_family.py is a family made for this suite: it exercises the parts of the mode
interface no built-in family uses yet (RMSNorm, grouped-query attention through a segmented
linear, no position table, a per-head bias, a gated MLP, the pooled classification head).
"""

import contextlib
import importlib.util
import sys
from pathlib import Path

import probe_family  # noqa: F401  (registers the family "probe")
import pytest
import torch
import torch.distributed as dist
from multiproc import cached_init, run_distributed
from numerics import assert_comm_equal

import lattice
from lattice import LatticeConfigError, MeshAxis, checkpoint
from lattice.bench.measure import held_forward_bytes, saved_activation_bytes
from lattice.models import get_arch
from lattice.modes import REFERENCE_MODE, get_mode
from lattice.modes.kernels.loss import IGNORE_INDEX, labelled_count

T, REPLICA_BATCH = 8, 4  # T < every test shape's seq_len: exercises position slicing
REFERENCE_FAMILY = "gpt2"
#: pipeline layouts every family runs (its serial model split in two stages; with 1d tensors)
PIPELINE_LAYOUTS = ({"mode": "serial", "pp": 2, "microbatches": 2}, {"mode": "1d", "tp": 2, "pp": 2, "microbatches": 2})


def _layouts(family: str) -> list[dict]:
    out = []
    for mode in lattice.available_modes():
        declared = get_mode(mode).test_layouts
        out += [{"mode": mode, **layout} for layout in (declared if family == REFERENCE_FAMILY else declared[:1])]
    return out


def _label(family, layout):
    return f"{family}-" + "-".join(f"{k}={v}" for k, v in layout.items())


def _pipelined(family: str) -> bool:
    """Whether the family declares parts for pipeline stages."""
    cls = get_arch(family)
    with torch.device("meta"):
        return cls(cls.config_class(**cls.test_shapes[0]), lattice.context(REFERENCE_MODE)).parts() is not None


def _cases(with_pipeline: bool):
    cases = [(family, layout) for family in lattice.available_archs() for layout in _layouts(family)]
    if with_pipeline:
        cases += [(family, dict(layout)) for family in lattice.available_archs() if _pipelined(family)
                  for layout in PIPELINE_LAYOUTS]
    fast = _fast_subset(cases) if with_pipeline else set()
    return [pytest.param(family, layout, id=_label(family, layout),
                         marks=[pytest.mark.fast] if _label(family, layout) in fast else [])
            for family, layout in cases]


def _fast_subset(cases: list[tuple[str, dict]]) -> set[str]:
    """The cases of `pytest -m fast`: every layout once, each with the family used least so far,
    then every family not yet chosen in its first layout (so each layout and each family runs)."""
    families_of: dict[str, list[str]] = {}
    for family, layout in cases:
        families_of.setdefault(_label("", layout), []).append(family)
    used = {family: 0 for family, _ in cases}
    chosen = set()
    for layout, families in families_of.items():
        family = min(families, key=lambda f: (used[f], families.index(f)))
        used[family] += 1
        chosen.add(family + layout)
    for family, layout in cases:
        if not used[family]:
            used[family] += 1
            chosen.add(_label(family, layout))
    return chosen


def _world(layout: dict) -> int:
    return lattice.context(**layout).world_size


def _batch(cfg, n: int, seed: int):
    """(tokens, targets): n sequences of T tokens and the family's random targets for them (token
    ids (n, T), T5's labels (n, T/2), class ids (n,) of a classifying config), token targets with
    every third position ignored (-100, as BERT's unmasked positions are). Every sequence has the
    same number of labelled targets, so that the mean over the replicas' (and micro-batches')
    means is the global batch's mean."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab_size, (n, T), generator=gen)
    targets = lattice.models.arch_of_config(cfg).random_targets(cfg, tokens, gen)
    if targets.dim() == 2:
        targets[:, 1::3] = IGNORE_INDEX
    return tokens, targets


def _rel(a: torch.Tensor, ref: torch.Tensor, floor: float = 1e-300) -> float:
    return ((a - ref).abs().max() / ref.abs().max().clamp_min(floor)).item()


#: a tensor's difference is relative to its own largest entry, or to this fraction of the largest
#: entry of any tensor of the same kind (gradients, weights, a moment) when that is larger:
#: BERT's key bias has an analytically zero gradient (softmax ignores a constant per query), so
#: what serial and a layout compute for it is rounding noise (~1e-22), equal in no layout, and
#: AdamW's first step moves it by lr·g/(|g| + eps), noise of ~1e-16
NEGLIGIBLE = 1e-4


def _worst(tensors: dict, refs: dict) -> float:
    """The largest difference of `tensors` to `refs` (same keys), each relative as NEGLIGIBLE says."""
    floor = NEGLIGIBLE * max(float(t.abs().max()) for t in refs.values())
    return max(_rel(tensors[n], refs[n], floor) for n in refs)


def test_every_family_and_mode_declares_what_the_suite_runs():
    """Catches a family registered without test shapes or a mode without test layouts: it would
    silently escape this whole suite."""
    for mode in lattice.available_modes():
        assert get_mode(mode).test_layouts, f"mode {mode!r} declares no test_layouts"
        for layout in get_mode(mode).test_layouts:
            assert lattice.context(mode, **layout).world_size <= 8, (mode, layout)
    for family in lattice.available_archs():
        assert get_arch(family).test_shapes, f"family {family!r} declares no test_shapes"


@contextlib.contextmanager
def plugins_registered(paths=()):
    """Modes or families written as module files outside lattice's packages (a copy of the
    repository with a new file, tests/test_extending.py) imported into lattice's registries while
    the block runs, then removed, so that no other check sees them."""
    from lattice import modes as mode_registry
    from lattice.models import registry as family_registry

    added = []
    for path in map(Path, paths):
        package = "lattice.modes" if path.parent.name == "modes" else "lattice.models"
        name = f"{package}.{path.stem}"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)  # registers it
        added.append((name, path.stem))
    try:
        yield
    finally:
        for name, stem in added:
            sys.modules.pop(name, None)
            if name.startswith("lattice.modes"):
                listed, get, registry = mode_registry.available_modes(), mode_registry.get_mode, mode_registry
            else:
                listed, get, registry = family_registry.available_archs(), family_registry.get_arch, family_registry
            for key in [k for k in listed if get(k).__module__ == name]:
                registry.unregister(key)


def _microbatched(model, tokens, targets, m: int) -> torch.Tensor:
    """The loss of a step of m micro-batches: each micro-batch's mean weighted by its share of the
    labelled targets. The whole batch's mean for a family whose loss is a mean over tokens; for a
    mixture of experts, whose balancing term a micro-batch takes over its own tokens, the sum of
    the micro-batches' (as a pipeline computes it)."""
    from lattice.parallel.pipeline import microbatch_rows

    rows = microbatch_rows(len(tokens), m)
    counts = [labelled_count(targets[r]).double() for r in rows]
    return sum(model(tokens[r], targets[r]) * (c / sum(counts)) for r, c in zip(rows, counts))


def _serial_step(cfg, tokens, targets, m: int = 1):
    """Serial's loss, gradients, and parameters and AdamW moments after one step of m micro-batches
    (float64)."""
    serial = lattice.build_model(cfg, lattice.context(REFERENCE_MODE), dtype=torch.float64)
    weights = {k: v.clone() for k, v in serial.full_state_dict().items()}
    total = _microbatched(serial, tokens, targets, m)
    total.backward()
    loss = float(total.detach())
    grads = {n: p.grad.clone() for n, p in serial.named_parameters()}
    opt = torch.optim.AdamW(serial.parameters(), lr=1e-2, weight_decay=0.1)
    opt.step()
    moments = {k: {n: opt.state[p][k] for n, p in serial.named_parameters()} for k in ("exp_avg", "exp_avg_sq")}
    return weights, loss, grads, serial.full_state_dict(), moments


def _check_layout(family: str, layout: dict, plugins=()) -> dict:
    with plugins_registered(plugins):
        return _check_layout_registered(family, layout)


def _check_layout_registered(family: str, layout: dict) -> dict:
    layout = dict(layout)
    ctx = cached_init(**layout)
    mode = layout.pop("mode")
    dp, d = ctx.dp, ctx.coord(MeshAxis.DP)
    mine = slice(d * REPLICA_BATCH, (d + 1) * REPLICA_BATCH)
    topo = ctx.topology
    replica_rank = topo.rank_at({**ctx.coords, MeshAxis.DP: 0})  # this rank's place in replica 0's layout
    pipelined = ctx.pp > 1
    out = {"exact": [], "comm": [], "activations": [], "kept": []}
    for k, shape in enumerate(get_arch(family).test_shapes):
        cfg = get_arch(family).config_class(**shape)
        tokens, targets = _batch(cfg, REPLICA_BATCH * dp, seed=7)
        m = ctx.pipeline.m if pipelined else 1
        weights, ref_loss, ref_grads, ref_after, ref_moments = _serial_step(cfg, tokens, targets, m)
        replica_ref = lattice.build_model(cfg, lattice.context(REFERENCE_MODE), dtype=torch.float64)
        replica_ref.load_full_state_dict(weights)
        replica_loss = float(_microbatched(replica_ref, tokens[mine], targets[mine], m).detach())
        held = {}  # recomputation's: bytes a forward leaves held, measured and modelled
        for ckpt in (None, "full", "selective") if k == 0 else (None,):  # checkpointing with the first shape
            recompute = dict(activation_checkpointing=ckpt == "full", selective_checkpointing=ckpt == "selective")
            model = lattice.build_model(cfg, ctx, dtype=torch.float64, **recompute)
            model.load_full_state_dict(weights)
            round_trip = model.full_state_dict() if not ckpt else weights
            logits = 0.0
            if not pipelined and not getattr(cfg, "num_labels", 0) and not ckpt:  # inference: full logits
                model.eval()
                with torch.no_grad():
                    try:
                        logits = _rel(model(tokens[mine]), replica_ref(tokens[mine]))
                    except LatticeConfigError:  # refused on every rank: T5 decodes its start token alone, which
                        pass  # sequence parallelism cannot split (test_t5 checks the refusal)
                model.train()
            with lattice.CommMeter() as meter:
                loss = model.forward_backward(tokens[mine], targets[mine])
            if dp > 1:  # data-parallel averaging by hand (the Trainer's DDP does this)
                for p in model.parameters():
                    dist.all_reduce(p.grad, group=ctx.group(MeshAxis.DP))
                    p.grad /= dp
            grads = model.full_grad_dict()
            step = moments = 0.0  # (recomputation changes how the gradients are computed, not the update)
            if not ckpt:
                # a param group rather than a list: a rank may hold no parameters (D&SP-cSub's idle ranks)
                opt = torch.optim.AdamW([{"params": list(model.parameters())}], lr=1e-2, weight_decay=0.1)
                opt.step()
                step = _worst(model.full_state_dict(), ref_after)
                gathered = checkpoint.gather_optimizer(model, opt)
                moments = max(_worst(gathered[k], ref_moments[k]) for k in ref_moments)
            losses = [None] * ctx.world_size  # the same float on every rank of a replica, bit for bit
            dist.all_gather_object(losses, (d, loss))
            out["exact"].append(dict(
                shape=shape, ckpt=ckpt, loss=abs(loss - replica_loss) / abs(replica_loss), logits=logits,
                replica_losses_equal=len({x for r, x in losses if r == d}) == 1,
                grads=_worst(grads, ref_grads), step=step, moments=moments,
                round_trip=all(torch.equal(round_trip[n], weights[n]) for n in weights),
                keys=sorted(grads) == sorted(ref_grads)))
            analytic = lattice.cost.estimate(cfg, mode, batch=REPLICA_BATCH, seq=T, target_seq=targets.shape[-1],
                                             dtype=torch.float64, **recompute, rank=replica_rank,
                                             **{**layout, "dp": 1})
            measured = {k: (v["calls"], v["elements"]) for k, v in meter.summary().items()}
            modelled = {k: (v["calls"], v["elements"]) for k, v in analytic.summary().items() if v["calls"]}
            out["comm"].append((shape, ckpt, measured, modelled))
            if not ckpt and not pipelined:  # (with stages the model's figure is one micro-batch's)
                saved = saved_activation_bytes(model, lambda: model(tokens[mine], targets[mine]))
                out["activations"].append((shape, saved, analytic.memory["activations"]))
            elif not pipelined:
                held[ckpt] = (held_forward_bytes(model, lambda: model(tokens[mine], targets[mine])),
                              analytic.memory["activations"])
        if held:
            out["kept"].append(tuple(held["selective"][i] - held["full"][i] for i in (0, 1)))
    return out


def _check_refusals(family: str, layout: dict, root: str, plugins=()) -> dict:
    """Every head count 1 (no tensor-parallel layout divides it); a sharded checkpoint (weights and
    AdamW moments) written and read back under the layout; the HF round trip."""
    with plugins_registered(plugins):
        return _check_refusals_registered(family, layout, root)


def _check_refusals_registered(family: str, layout: dict, root: str) -> dict:
    from lattice.checkpoint import sharded
    from lattice.models import hf

    ctx = cached_init(**layout)
    cls = get_arch(family)
    shape = dict(cls.test_shapes[0])
    cfg = cls.config_class(**shape)
    refused = None
    with lattice.CommMeter() as meter:
        try:
            lattice.build_model(cls.config_class(**{**shape, **{k: 1 for k in cfg.head_counts()}}), ctx)
        except LatticeConfigError as e:
            refused = str(e)
    dist.barrier()  # every rank reaches this: none was left inside a collective
    model = lattice.build_model(cfg, ctx, dtype=torch.float64)
    opt = torch.optim.AdamW([{"params": list(model.parameters())}], lr=1e-2)
    tokens, targets = _batch(cfg, REPLICA_BATCH, seed=3)
    model.forward_backward(tokens, targets)
    opt.step()
    written = sharded.write(Path(root), {"step": 1, "arch": family, "model_config": cfg.to_dict(), "optimizer_step": 1},
                            sharded.training_state(model, opt, with_moments=True))
    back = lattice.build_model(cfg, ctx, dtype=torch.float64)
    back_opt = torch.optim.AdamW([{"params": list(back.parameters())}], lr=1e-2)
    sharded.load(sharded.read(written), back, back_opt)
    before, after = model.full_state_dict(), back.full_state_dict()
    moments = checkpoint.gather_optimizer(model, opt), checkpoint.gather_optimizer(back, back_opt)
    checkpoint_equal = (all(torch.equal(before[k], after[k]) for k in before)
                        and all(torch.equal(moments[0][m][k], moments[1][m][k]) for m in ("exp_avg", "exp_avg_sq")
                                for k in before))
    hf_equal = None
    if cls.hf is not None:
        serial = lattice.build_model(cfg, lattice.context(REFERENCE_MODE), dtype=torch.float64)
        expected = hf.to_hf_state_dict(cls, cfg, serial.full_state_dict())
        model = cls.from_hf(expected, ctx, config=cls.hf.config_to_hf(cfg))
        exported = model.to_hf_state_dict()
        hf_equal = sorted(exported) == sorted(expected) and all(torch.equal(exported[k], expected[k]) for k in exported)
    return {"refused": refused, "sent": meter.count(), "hf_equal": hf_equal, "checkpoint_equal": checkpoint_equal}


@pytest.mark.parametrize("family,layout", _cases(with_pipeline=True))
def test_layout_equals_serial_and_its_cost_model(family, layout):
    """Catches a layout whose loss, gradients, optimizer step or moments differ from serial's (a
    wrong shard, a missing or doubled gradient sum, a broken resharding of AdamW state, a stage
    that runs the wrong blocks), any collective its cost model does not describe (or the
    reverse), an activation model that misses a saved tensor, and a load/gather round trip that
    is not the identity -- for every family, including the mode-interface pieces only a newer
    family uses."""
    assert_layout_equals_serial(family, layout)


def assert_layout_equals_serial(family: str, layout: dict, plugins=()) -> None:
    world = _world(layout)
    results = run_distributed(world, _check_layout, family, layout, plugins)
    for rank, result in enumerate(results):
        for r in result["exact"]:
            assert r["keys"] and r["round_trip"] and r["replica_losses_equal"], (rank, r)
            worst = max(r["loss"], r["grads"], r["step"], r["moments"], r["logits"])
            assert worst < 1e-10, (rank, r)
        for shape, ckpt, measured, modelled in result["comm"]:
            assert_comm_equal(measured, modelled, (rank, shape, ckpt))
        for shape, saved, modelled in result["activations"]:
            assert saved == pytest.approx(modelled, rel=0.02), (rank, shape, saved, modelled)
        for measured, modelled in result["kept"]:
            assert measured == pytest.approx(modelled, rel=0.02), (rank, "kept under selective checkpointing")
    worst = max(max(r["loss"], r["grads"], r["step"], r["moments"]) for res in results for r in res["exact"])
    sent = sum(sum(b for _, b in m.values()) for _, _, m, _ in results[0]["comm"])
    print(f"{family} {layout}: {world} ranks, worst relative difference to serial {worst:.1e}; "
          f"rank 0 metered {sent:,.0f} elements over {len(results[0]['comm'])} steps = cost model")


@pytest.mark.parametrize("family,layout", _cases(with_pipeline=False))
def test_layout_refuses_bad_sizes_and_round_trips_checkpoints_and_hf_weights(family, layout, tmp_path):
    """Catches a size error raised on some ranks only (a hang) or after a collective, a sharded
    checkpoint that loses or misplaces a shard of a weight or a moment, and an HF import/export
    that loses or reshapes a tensor under this layout."""
    assert_refusals_and_round_trips(family, layout, tmp_path)


def assert_refusals_and_round_trips(family: str, layout: dict, tmp_path, plugins=()) -> None:
    world = _world(layout)
    replica = lattice.context(**layout).topology.tp_size
    for result in run_distributed(world, _check_refusals, family, layout, str(tmp_path), tuple(plugins)):
        assert result["sent"] == 0 and result["checkpoint_equal"], result
        if get_arch(family).hf is not None:
            assert result["hf_equal"], result
        if replica > 1:
            assert result["refused"] and "\n" not in result["refused"] and "n_heads = 1" in result["refused"], result
        else:
            assert result["refused"] is None, result


# ----------------------------------------------------------------------------- 30 AdamW steps
#: One layout per mode and one pipelined, the families alternating, each at the options most
#: likely to drift: sequence parallelism with data parallelism (partial gradients of replicated
#: vectors), a q = 2 square and cube, D&SP-cSub (idle ranks), 1d stages with a tied table.
TRAJECTORIES = [("gpt2", {"mode": "1d", "tp": 2, "dp": 2, "sequence_parallel": True}),
                ("llama", {"mode": "2d", "tp": 4}),
                ("llama", {"mode": "3d", "tp": 8}),
                ("gpt2", {"mode": "subgraph", "tp": 4, "subgrids": 2, "common": "subgrid"}),
                ("gpt2", {"mode": "1d", "tp": 2, "pp": 2, "microbatches": 4})]
ADAMW_RUN = dict(model="tiny", seq_len=32, vocab_size=512, batch_size=8, steps=30, lr=3e-3, warmup=3, grad_clip=0.5,
                 eval_interval=100, eval_batches=1, progress=False)


def _adamw_trajectory(family: str, layout: dict | None):
    """30 float32 training steps (AdamW, warmup + cosine, clipping at the global norm) through the
    Trainer: every step's loss, the final validation loss, and a digest of every parameter shard
    this rank holds, keyed by the name and the slice of the full tensor it is."""
    import hashlib

    from lattice.training.trainer import TrainConfig, Trainer

    ctx = cached_init(**layout) if layout else lattice.init(REFERENCE_MODE)
    trainer = Trainer(TrainConfig(arch=family, **ADAMW_RUN), ctx)
    losses = [trainer.train_step()["train_loss"] for _ in range(ADAMW_RUN["steps"])]
    shards = {(name, repr(trainer.model.specs[name].slices(ctx.coords, ctx.topology))):
              hashlib.sha256(p.detach().contiguous().numpy().tobytes()).hexdigest()
              for name, p in trainer.model.named_parameters()}
    return losses, trainer.evaluate(), shards


@pytest.mark.parametrize("family,layout", TRAJECTORIES, ids=[_label(f, lay) for f, lay in TRAJECTORIES])
def test_thirty_adamw_steps_follow_serial_and_copies_stay_identical(family, layout):
    """Catches drift that one exact step hides: a gradient summed over too few or too many ranks
    for a parameter that only some ranks hold (a 3D vector, a 2D row-0 bias, D&SP-cSub's common
    weights), a gradient norm counting a replicated or tied shard twice (clipping is active), and
    replicated copies of a parameter falling out of step across tensor, data-parallel or pipeline
    ranks (compared bit for bit). The written-once form of every mode's trajectory test."""
    serial, serial_val, _ = _adamw_trajectory(family, None)
    results = run_distributed(_world(layout), _adamw_trajectory, family, layout)
    diff = max(abs(a - b) / abs(b) for losses, _, _ in results for a, b in zip(losses, serial))
    print(f"{family} {layout}: serial loss {serial[0]:.4f} -> {serial[-1]:.4f}, max relative difference over "
          f"{len(serial)} steps and {len(results)} ranks {diff:.1e}")
    assert serial[-1] < serial[0] - 0.5, "the reference did not train: the comparison would be vacuous"
    assert diff < 1e-5
    assert all(abs(val - serial_val) / serial_val < 1e-5 for _, val, _ in results)
    copies: dict = {}
    for _, _, shards in results:
        for key, digest in shards.items():
            copies.setdefault(key, set()).add(digest)
    assert copies and not [key for key, digests in copies.items() if len(digests) > 1]
