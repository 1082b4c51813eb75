"""The conformance suite: every registered mode, in every small layout it declares
(`Mode.test_layouts`), against the serial model and against its own analytic cost model.

Per layout, on its processes (each world size starts once per session):
- float64, weights loaded from a serial model, the same global batch split over data-parallel
  replicas: the loss, every full gradient and (after one AdamW step) every full parameter and
  both AdamW moments equal serial's within 1e-10 relative, with and without activation
  checkpointing, for a tied model with biases and a padded vocabulary and an untied one without;
- CommMeter's (phase, collective, group size) calls and elements of one step of a replica equal
  `lattice.cost.estimate`'s, with and without checkpointing, and the bytes autograd saves for
  backward are within 2% of its activation figure;
- sizes the layout cannot divide are refused on every rank before any collective;
- checkpoints and HuggingFace weights round-trip through the layout unchanged.
A mode that registers without declaring layouts fails `test_every_mode_declares_test_layouts`.
"""

import math

import pytest
import torch
import torch.distributed as dist

import lattice
from lattice import LatticeConfigError, MeshAxis, checkpoint
from lattice.bench import saved_activation_bytes
from lattice.modes import REFERENCE_MODE, get_mode
from numerics import random_batch, rel_diff as _rel
from multiproc import cached_init, run_distributed

# d_model and heads divide by every tensor-parallel degree the layouts use (up to 4 heads' worth);
# V = 61 is padded wherever a mode splits the vocabulary; T = 8 < seq_len exercises wpe slicing
# and divides by every sequence-parallel degree
SIZES = dict(seq_len=12, d_model=24, n_heads=4, n_layers=2)
VARIANTS = (dict(vocab_size=61, bias=True, tie_embeddings=True), dict(vocab_size=64, bias=False, tie_embeddings=False))
T, REPLICA_BATCH = 8, 4


def _cases():
    return [pytest.param(mode, layout, id=f"{mode}-" + "-".join(f"{k}={v}" for k, v in layout.items()))
            for mode in lattice.available_modes() for layout in get_mode(mode).test_layouts]


def _batch(n: int, vocab: int, seed: int):
    return random_batch(n, T, vocab, seed)


def test_every_mode_declares_test_layouts():
    """Catches a mode registered without layouts: it would silently escape this whole suite."""
    for mode in lattice.available_modes():
        assert get_mode(mode).test_layouts, f"mode {mode!r} declares no test_layouts"
        for layout in get_mode(mode).test_layouts:
            assert lattice.plan(mode, **layout).world_size <= 8, (mode, layout)


def _serial_step(cfg, tokens, targets):
    """Serial's loss, gradients, and parameters and AdamW moments after one step (float64)."""
    serial = lattice.GPT(cfg, lattice.plan(REFERENCE_MODE), dtype=torch.float64)
    weights = {k: v.clone() for k, v in serial.full_state_dict().items()}
    loss = serial.forward_backward(tokens, targets)
    grads = {n: p.grad.clone() for n, p in serial.named_parameters()}
    opt = torch.optim.AdamW(serial.parameters(), lr=1e-2, weight_decay=0.1)
    opt.step()
    moments = {k: {n: opt.state[p][k] for n, p in serial.named_parameters()} for k in ("exp_avg", "exp_avg_sq")}
    return weights, loss, grads, serial.full_state_dict(), moments


def _check_layout(mode: str, layout: dict) -> dict:
    ctx = cached_init(mode=mode, **layout)
    dp, d = ctx.dp, ctx.coord(MeshAxis.DP)
    mine = slice(d * REPLICA_BATCH, (d + 1) * REPLICA_BATCH)
    topo = ctx.topology
    replica_rank = topo.rank_at({**ctx.coords, MeshAxis.DP: 0})  # this rank's place in replica 0's layout
    out = {"exact": [], "comm": [], "activations": []}
    for variant in VARIANTS:
        cfg = lattice.GPTConfig(**SIZES, **variant)
        tokens, targets = _batch(REPLICA_BATCH * dp, cfg.vocab_size, seed=7)
        weights, ref_loss, ref_grads, ref_after, ref_moments = _serial_step(cfg, tokens, targets)
        replica_ref = lattice.GPT(cfg, lattice.plan(REFERENCE_MODE), dtype=torch.float64)
        replica_ref.load_full_state_dict(weights)
        replica_loss = float(replica_ref(tokens[mine], targets[mine]).detach())
        for ckpt in (False, True):
            model = lattice.GPT(cfg, ctx, dtype=torch.float64, activation_checkpointing=ckpt)
            model.load_full_state_dict(weights)
            round_trip = model.full_state_dict()
            with lattice.CommMeter() as meter:
                loss = model.forward_backward(tokens[mine], targets[mine])
            if dp > 1:  # data-parallel averaging by hand (the Trainer's DDP does this)
                for p in model.parameters():
                    dist.all_reduce(p.grad, group=ctx.group(MeshAxis.DP))
                    p.grad /= dp
            grads = model.full_grad_dict()
            # a param group rather than a list: a rank may hold no parameters (D&SP-cSub's idle ranks)
            opt = torch.optim.AdamW([{"params": list(model.parameters())}], lr=1e-2, weight_decay=0.1)
            opt.step()
            after = model.full_state_dict()
            moments = checkpoint.gather_optimizer(model, opt)
            out["exact"].append(dict(
                variant=variant, ckpt=ckpt, loss=abs(loss - replica_loss) / abs(replica_loss),
                grads=max(_rel(grads[n], ref_grads[n]) for n in ref_grads),
                step=max(_rel(after[n], ref_after[n]) for n in ref_after),
                moments=max(_rel(moments[k][n], ref_moments[k][n]) for k in ref_moments for n in ref_grads),
                round_trip=all(torch.equal(round_trip[n], weights[n]) for n in weights),
                keys=sorted(grads) == sorted(ref_grads)))
            analytic = lattice.cost.estimate(cfg, mode, batch=REPLICA_BATCH, seq=T, dtype=torch.float64,
                                             activation_checkpointing=ckpt, rank=replica_rank,
                                             **{**layout, "dp": 1})
            measured = {k: (v["calls"], v["elements"]) for k, v in meter.summary().items()}
            modelled = {k: (v["calls"], v["elements"]) for k, v in analytic.summary().items() if v["calls"]}
            out["comm"].append((variant, ckpt, measured, modelled))
            if not ckpt:
                saved = saved_activation_bytes(model, lambda: model(tokens[mine], targets[mine]))
                out["activations"].append((variant, saved, analytic.memory["activations"]))
    return out


def _check_refusals(mode: str, layout: dict) -> dict:
    """A head count no tensor-parallel layout divides (1 head), and the HF round trip."""
    from lattice import hf

    ctx = cached_init(mode=mode, **layout)
    refused = None
    with lattice.CommMeter() as meter:
        try:
            lattice.GPT(lattice.GPTConfig(vocab_size=61, seq_len=8, d_model=24, n_heads=1, n_layers=1), ctx)
        except LatticeConfigError as e:
            refused = str(e)
    dist.barrier()  # every rank reaches this: none was left inside a collective
    cfg = lattice.GPTConfig(**SIZES, **VARIANTS[0])
    serial = lattice.GPT(cfg, lattice.plan(REFERENCE_MODE), dtype=torch.float64)
    expected_hf = hf.to_hf_state_dict(cfg, serial.full_state_dict())
    model = lattice.GPT.from_hf(expected_hf, ctx, config=hf.config_to_hf(cfg))
    exported = model.to_hf_state_dict()
    hf_equal = sorted(exported) == sorted(expected_hf) and all(torch.equal(exported[k], expected_hf[k]) for k in exported)
    return {"refused": refused, "sent": meter.count(), "hf_equal": hf_equal}


@pytest.mark.parametrize("mode,layout", _cases())
def test_layout_equals_serial_and_its_cost_model(mode, layout):
    """Catches a layout whose loss, gradients, optimizer step or moments differ from serial's (a
    wrong shard, a missing or doubled gradient sum, a broken resharding of AdamW state), any
    collective its cost model does not describe (or the reverse), an activation model that
    misses a saved tensor, and a load/gather round trip that is not the identity."""
    world = lattice.plan(mode, **layout).world_size
    results = run_distributed(world, _check_layout, mode, layout)
    for rank, result in enumerate(results):
        for r in result["exact"]:
            assert r["keys"] and r["round_trip"], (rank, r)
            worst = max(r["loss"], r["grads"], r["step"], r["moments"])
            assert worst < 1e-10, (rank, r)
        for variant, ckpt, measured, modelled in result["comm"]:
            assert set(measured) == set(modelled), (rank, variant, ckpt, set(measured) ^ set(modelled))
            for key, (calls, elements) in measured.items():
                assert calls == modelled[key][0] and math.isclose(elements, modelled[key][1], rel_tol=1e-9), \
                    (rank, variant, ckpt, key, (calls, elements), modelled[key])
        for variant, saved, modelled in result["activations"]:
            assert saved == pytest.approx(modelled, rel=0.02), (rank, variant, saved, modelled)
    worst = max(max(r["loss"], r["grads"], r["step"], r["moments"]) for res in results for r in res["exact"])
    sent = sum(sum(b for _, b in m.values()) for _, _, m, _ in results[0]["comm"])
    print(f"{mode} {layout}: {world} ranks, worst relative difference to serial {worst:.1e}; "
          f"rank 0 metered {sent:,.0f} elements over {len(results[0]['comm'])} steps = cost model")


@pytest.mark.parametrize("mode,layout", _cases())
def test_layout_refuses_bad_sizes_and_round_trips_hf_weights(mode, layout):
    """Catches a size error raised on some ranks only (a hang) or after a collective, and an HF
    import/export that loses or reshapes a tensor under this layout."""
    world = lattice.plan(mode, **layout).world_size
    replica = lattice.plan(mode, **layout).topology.tp_size
    for result in run_distributed(world, _check_refusals, mode, layout):
        assert result["sent"] == 0 and result["hf_equal"], result
        if replica > 1:
            assert result["refused"] and "\n" not in result["refused"] and "n_heads = 1" in result["refused"], result
        else:
            assert result["refused"] is None, result
