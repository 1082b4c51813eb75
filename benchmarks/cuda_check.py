"""CUDA checks for a machine with one GPU: every family's serial model on the GPU against the same
model on the CPU (float64: loss, every gradient, inference logits) and against `transformers` on the
GPU where the family maps to it; then serial bf16 training throughput (tokens/s and model FLOP
utilisation against the card's dense bf16 peak).

    python benchmarks/cuda_check.py --peak-tflops 989 --out results.json

The CPU model is the reference of the test suite (tests/test_conformance.py compares every layout
with it); this script shows the same model computes the same numbers on CUDA.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import lattice
from lattice.bench.provenance import provenance
from lattice.cost import estimate
from lattice.models import get_arch
from lattice.models import hf as lhf

TOLERANCE = 1e-10
# transformers' RMSNorm casts its input to float32 (to protect half precision), which in a float64
# model alone puts its logits ~1e-7 from an exact float64 computation (tests/test_llama.py)
NEGLIGIBLE = 1e-4  # as tests/test_conformance.py
HF_TOLERANCE = {"llama": 1e-6, "mistral": 1e-6, "qwen2": 1e-6}


def _rel(a: torch.Tensor, ref: torch.Tensor, floor: float = 1e-300) -> float:
    a, ref = a.detach().double().cpu(), ref.detach().double().cpu()
    return ((a - ref).abs().max() / ref.abs().max().clamp_min(floor)).item()


def exactness(ctx) -> list[dict]:
    rows = []
    for family in lattice.available_archs():
        for k, shape in enumerate(get_arch(family).test_shapes):
            cfg = get_arch(family).config_class(**shape)
            gen = torch.Generator().manual_seed(k)
            tokens = torch.randint(0, cfg.vocab_size, (4, 8), generator=gen)
            targets = get_arch(family).random_targets(cfg, tokens, gen)
            cpu = lattice.build_model(cfg, lattice.context("serial"), dtype=torch.float64)
            gpu = lattice.build_model(cfg, ctx, dtype=torch.float64)
            gpu.load_full_state_dict(cpu.full_state_dict())
            loss_cpu = cpu.forward_backward(tokens, targets)
            loss_gpu = gpu.forward_backward(tokens.to(ctx.device), targets.to(ctx.device))
            grads_cpu, grads_gpu = cpu.full_grad_dict(), gpu.full_grad_dict()
            # relative to each gradient's largest entry, or to NEGLIGIBLE of the largest of any where that
            # is larger: BERT's key bias has an analytically zero gradient, rounding noise on any device
            floor = NEGLIGIBLE * max(float(g.abs().max()) for g in grads_cpu.values())
            grad_diff = max(_rel(grads_gpu[n], grads_cpu[n], floor) for n in grads_cpu)
            row = {"family": family, "shape": shape, "loss_cpu": loss_cpu, "loss_cuda": loss_gpu,
                   "loss_rel": abs(loss_gpu - loss_cpu) / abs(loss_cpu), "grad_rel": grad_diff}
            if not getattr(cfg, "num_labels", 0) and not hasattr(cfg, "target_len"):
                cpu.eval(), gpu.eval()
                with torch.no_grad():
                    logits_gpu = gpu(tokens.to(ctx.device))
                    row["logits_rel"] = _rel(logits_gpu, cpu(tokens))
                    try:
                        hf = lhf.to_hf_model(cpu).double().to(ctx.device).eval()
                        ref = hf(input_ids=tokens.to(ctx.device)).logits
                        row["hf_logits_rel"] = _rel(logits_gpu, ref)
                    except Exception as e:  # noqa: BLE001  (a family without a mapping: say so in the row)
                        row["hf"] = f"{type(e).__name__}: {str(e)[:120]}"
            row["ok"] = (all(row.get(k, 0) <= TOLERANCE for k in ("loss_rel", "grad_rel", "logits_rel"))
                         and row.get("hf_logits_rel", 0) <= HF_TOLERANCE.get(family, TOLERANCE))
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def throughput(ctx, arch: str, preset: str, batch: int, seq_len: int | None, steps: int, peak_tflops: float) -> dict:
    """Serial bf16 training as `lattice train --precision bf16` runs it: bf16 weights and
    activations, fp32 master weights and AdamW moments. Median step time after warm-up."""
    from lattice.cost import model_config
    from lattice.parallel.zero import ZeroOptimizer

    cfg = model_config(arch, preset, seq_len=seq_len)
    model = lattice.build_model(cfg, ctx, dtype=torch.bfloat16)
    opt = ZeroOptimizer(model, ctx, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, stage=0)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len + 1), generator=gen).to(ctx.device)
    sync = torch.cuda.synchronize if ctx.device.type == "cuda" else (lambda: None)
    if ctx.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()  # (not the checks run before)
    times = []
    for _ in range(steps):
        sync()
        t = time.perf_counter()
        model.forward_backward(tokens[:, :-1], tokens[:, 1:])
        opt.reduce_grads()  # the master rows' gradients: without them AdamW would skip every row
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        times.append(time.perf_counter() - t)
    step_s = statistics.median(times[max(3, steps // 4):])
    flops = estimate(cfg, "serial", batch=batch)
    flops_per_step = flops.flops["forward"] + flops.flops["backward"]
    row = {"arch": arch, "preset": preset, "batch": batch, "seq_len": cfg.seq_len, "step_ms": step_s * 1e3,
           "tokens_per_s": batch * cfg.seq_len / step_s, "tflops": flops_per_step / step_s / 1e12,
           "mfu": flops_per_step / step_s / (peak_tflops * 1e12),
           "peak_memory_gib": torch.cuda.max_memory_allocated() / 2 ** 30 if ctx.device.type == "cuda" else None}
    print(json.dumps(row), flush=True)
    if ctx.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    return row


def gemm_curve(ctx) -> list[dict]:
    """bf16 matrix-product rate against the product's size (M x K @ K x N), the curve a GPU
    machine preset of the cost model reads its kernel efficiency from (lattice.cost.machine)."""
    rows = []
    sizes = [(m, k, n) for m in (256, 1024, 4096, 16384) for k, n in ((256, 256), (1024, 1024), (1024, 4096),
                                                                       (4096, 1024), (4096, 4096), (8192, 8192))]
    for m, k, n in sizes:
        a = torch.randn(m, k, device=ctx.device, dtype=torch.bfloat16)
        b = torch.randn(k, n, device=ctx.device, dtype=torch.bfloat16)
        for _ in range(3):
            a @ b
        reps = max(3, min(200, int(2e11 / (2 * m * k * n))))
        if ctx.device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(reps):
            a @ b
        if ctx.device.type == "cuda":
            torch.cuda.synchronize()
        rate = 2 * m * k * n * reps / (time.perf_counter() - t)
        rows.append({"m": m, "k": k, "n": n, "flops": 2 * m * k * n, "tflops": rate / 1e12})
    print(json.dumps(rows), flush=True)
    return rows


def kernel_rates(ctx) -> list[dict]:
    """bf16 causal attention (score elements B·n·T² per second, forward + backward counted as the
    cost model does: 3 forwards) and elementwise operators (LayerNorm + GELU + bias add, elements
    per second, forward + backward) against their size: the GPU presets' attn_rate and elem_rate."""
    import torch.nn.functional as F

    def timed(fn, reps=20):
        fn()
        if ctx.device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        if ctx.device.type == "cuda":
            torch.cuda.synchronize()
        return (time.perf_counter() - t) / reps

    rows = []
    for heads, T in ((16, 512), (16, 2048), (64, 2048), (32, 8192)):
        q, k, v = (torch.randn(1, heads, T, 128, device=ctx.device, dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        s = timed(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward())
        rows.append({"kernel": "attention", "heads": heads, "T": T, "rate": 3 * heads * T * T / s})
    for m, h in ((2048, 1024), (16384, 4096), (65536, 8192)):
        x = torch.randn(m, h, device=ctx.device, dtype=torch.bfloat16, requires_grad=True)
        b = torch.randn(h, device=ctx.device, dtype=torch.bfloat16, requires_grad=True)
        s = timed(lambda: (F.layer_norm(x, (h,)).sum() + F.gelu(x, approximate="tanh").sum() + (x + b).sum()).backward())
        rows.append({"kernel": "elementwise", "m": m, "h": h, "rate": 3 * 3 * m * h / s})
    print(json.dumps(rows), flush=True)
    return rows


def overheads(ctx) -> dict:
    """The framework's time per operation a family describes (Machine.op_overhead) and the
    optimizer's per parameter tensor, on this device: a serial GPT-2 of one and two blocks at sizes
    whose work is negligible, forward + backward and the bf16 step with fp32 masters (as
    `lattice.calibration.calibrate` measures them on a CPU)."""
    from lattice.models.gpt2 import GPTConfig
    from lattice.parallel.zero import ZeroOptimizer

    sync = torch.cuda.synchronize if ctx.device.type == "cuda" else (lambda: None)

    def timed(fn, reps=30):
        for _ in range(3):
            fn()
        sync()
        out = []
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            sync()
            out.append(time.perf_counter() - t)
        return statistics.median(out)

    fb, step, ops, tensors = [], [], [], []
    for blocks in (1, 2):
        cfg = GPTConfig(vocab_size=16, seq_len=4, d_model=8, n_heads=2, n_layers=blocks)
        model = lattice.build_model(cfg, ctx, dtype=torch.bfloat16)
        tokens = torch.randint(0, 16, (1, 4)).to(ctx.device)
        fb.append(timed(lambda: model.forward_backward(tokens, tokens)))  # (gradients accumulate: no optimizer yet)
        opt = ZeroOptimizer(model, ctx, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, stage=0)
        model.forward_backward(tokens, tokens)
        opt.reduce_grads()  # the master rows' gradients, which every timed step then applies
        step.append(timed(opt.step))
        c = estimate(cfg, "serial", batch=1)
        ops.append(c.ops["forward"] + c.ops["backward"])
        tensors.append(len(list(model.parameters())))
    row = {"op_overhead": (fb[1] - fb[0]) / (ops[1] - ops[0]),
           "update_per_tensor": (step[1] - step[0]) / (tensors[1] - tensors[0]), "fb_s": fb, "step_s": step}
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak of the card (H100/H200 SXM: 989)")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--parts", default="exactness,gemm,kernels,overheads,throughput", help="which checks, comma-separated")
    p.add_argument("--out", default=None)
    p.add_argument("--cpu-dry-run", action="store_true", help="run the script's paths on the CPU (tiny sizes), to try it")
    args = p.parse_args()
    ctx = lattice.init("serial")
    if ctx.device.type != "cuda" and not args.cpu_dry_run:
        raise SystemExit(f"no GPU: lattice.init chose {ctx.device}; --cpu-dry-run tries the script on the CPU")
    name = torch.cuda.get_device_name(0) if ctx.device.type == "cuda" else "cpu"
    print(f"device {name}, torch {torch.__version__}", flush=True)
    parts = args.parts.split(",")
    out = {"provenance": provenance(), "device": name, "torch": torch.__version__, "exactness": exactness(ctx) if "exactness" in parts else []}
    torch.backends.cuda.matmul.allow_tf32 = True
    out["gemm"] = gemm_curve(ctx) if "gemm" in parts and not args.cpu_dry_run else []
    out["kernels"] = kernel_rates(ctx) if "kernels" in parts and not args.cpu_dry_run else []
    out["overheads"] = overheads(ctx) if "overheads" in parts else {}
    runs = ((("gpt2", "small", 16, None), ("gpt2", "small", 256, None), ("gpt2", "gpt2", 16, None),
             ("gpt2", "gpt2-medium", 16, None), ("llama", "llama3.2-1b", 8, 2048))
            if not args.cpu_dry_run else (("gpt2", "tiny", 2, None),))
    out["throughput"] = [throughput(ctx, arch, preset, batch, seq, args.steps, args.peak_tflops)
                         for arch, preset, batch, seq in runs if "throughput" in parts]
    bad = [r for r in out["exactness"] if not r["ok"]]
    print(f"exactness: {len(out['exactness']) - len(bad)} of {len(out['exactness'])} family shapes within tolerance", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
