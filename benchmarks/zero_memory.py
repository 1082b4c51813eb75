"""Memory per rank of weights, gradients and AdamW moments with the distributed optimizer
(lattice.parallel.zero), measured after one step, beside the formula and lattice.cost's figure.

    python benchmarks/zero_memory.py                      # the gpt2 preset at dp = 1, 2, 4, 8
    python benchmarks/zero_memory.py --model tiny --dp 1 2

For each dp and ZeRO stage (0: plain data parallelism, 1: moments split, 2: gradients too, 3:
weights too) it starts dp gloo processes (serial tensor layout), builds the model in fp32, takes
one step on one sequence per replica, and counts the bytes of the distinct storages the rank then
holds: parameters, gradients (p.grad, or the reduced slices AdamW reads) and the optimizer's
state; at stage 3 also the most weight bytes gathered at once during the step (the gathers in
flight, the next block's, counted). The formula per
parameter (lattice.parallel.zero.memory_per_rank): fp32 16 bytes without ZeRO, 8 + 8/d with stage
1, 4 + 12/d with stage 2, 16/d with stage 3; bf16 weights with fp32 master rows 18, 4 + 16/d,
2 + 16/d, 16/d (Megatron-LM's table, which keeps a whole fp32 gradient buffer: 18 and 6 + 12/d).
At dp above 4 only the stages that split something run (stage 0 keeps the same bytes at every
dp, and 8 processes of it would not fit this host's memory). Then the same figures from the cost
model (no processes) for Llama-3-8B.
"""

from __future__ import annotations

import argparse

from lattice.bench.world import spawn

MIB = 2 ** 20


def formula(zero: int, dp: int, precision: str = "fp32") -> float:
    """Bytes per parameter this implementation keeps (see lattice.parallel.zero.memory_per_rank)."""
    if precision == "bf16":
        return {0: 18.0, 1: 4 + 16 / dp, 2: 2 + 16 / dp, 3: 16 / dp}[zero]
    return {0: 16.0, 1: 8 + 8 / dp, 2: 4 + 12 / dp, 3: 16 / dp}[zero]


def megatron(zero: int, dp: int, precision: str) -> str:
    """Megatron-LM's distributed-optimizer table (bf16 weights, fp32 gradients and master; it has
    no stages 2 and 3)."""
    if zero >= 2:
        return "—"
    return f"{_megatron(zero, dp, precision):.3f}"


def _megatron(zero: int, dp: int, precision: str) -> float:
    if precision == "bf16":
        return 18.0 if zero == 0 else 6 + 12 / dp
    return 16.0 if zero == 0 else 8 + 8 / dp


def _held_bytes(model, optimizer, buffers=()) -> dict[str, int]:
    """Bytes of the distinct storages behind the parameters, the gradients and the optimizer state
    (and `buffers`: other tensors the rank holds, counted where no earlier one shares their storage)."""
    seen: set[int] = set()

    def count(tensors) -> int:
        total = 0
        for t in tensors:
            storage = t.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
        return total

    params = list(model.parameters())
    out = {"parameters": count(params)}
    grads = [p.grad for p in params if p.grad is not None]
    pieces = getattr(optimizer, "pieces", {})
    grads += [piece.master.grad for piece in pieces.values() if piece.master is not None and piece.master.grad is not None]
    out["gradients"] = count(grads)
    masters = [piece.master for piece in pieces.values()
               if piece.master is not None and getattr(optimizer, "separate_masters", False)]
    out["optimizer"] = count([t for state in optimizer.state.values() for t in state.values()
                              if hasattr(t, "untyped_storage") and t.dim() > 0] + masters)
    if buffers:
        out["buffers"] = count(buffers)
    return out


def _worker(preset: str, seq: int, zero: int, precision: str) -> dict:
    import torch
    import torch.distributed as dist

    import lattice
    from lattice.bench.measure import most_weight_bytes_whole
    from lattice.models import get_arch
    from lattice.parallel.zero import ZeroOptimizer
    from lattice.training.optim import make_optimizer

    ctx = lattice.init("serial", dp=dist.get_world_size())
    cfg = get_arch("gpt2").config_class.preset(preset, seq_len=seq)
    model = lattice.build_model(cfg, ctx, dtype=torch.bfloat16 if precision == "bf16" else torch.float32)
    with most_weight_bytes_whole(model) as gathered:
        if zero or precision == "bf16":  # (bf16 weights: fp32 master rows, at stage 0 unsplit)
            optimizer = ZeroOptimizer(model, ctx, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, stage=zero,
                                      overlap_param_gather=zero == 3)  # (stage 3: the Trainer's prefetch)
        else:
            optimizer = make_optimizer(model, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)
        g = torch.Generator().manual_seed(ctx.rank)
        tokens = torch.randint(0, cfg.vocab_size, (1, seq + 1), generator=g)
        model.forward_backward(tokens[:, :-1], tokens[:, 1:])
        if zero or precision == "bf16":
            optimizer.reduce_grads()
        else:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= ctx.dp
        optimizer.step()
    return {**_held_bytes(model, optimizer), "numel": sum(p.numel() for p in model.parameters()),
            "gathered": gathered[0]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gpt2", help="gpt2 preset (default gpt2: 124M parameters)")
    p.add_argument("--dp", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--seq", type=int, default=32, help="tokens of the one sequence per replica")
    args = p.parse_args(argv)

    import torch

    import lattice.cost
    from lattice.models import get_arch

    print(f"gpt2 preset {args.model}, serial tensor layout; bytes each rank holds after one step (the largest "
          f"rank), per parameter of the model (optimizer: moments, and fp32 master rows of bf16 weights):")
    print("| precision | dp | zero | parameters MiB | gradients MiB | optimizer MiB | total MiB | B/param measured | "
          "formula | cost model | Megatron's table | stage 3: gathered MiB at most (cost model) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    cfg = get_arch("gpt2").config_class.preset(args.model, seq_len=args.seq)
    for precision in ("fp32", "bf16"):
        for dp in args.dp:
            for zero in (0, 1, 2, 3):
                if (dp == 1 and zero) or (dp > 4 and not zero):
                    continue  # the same as without: one replica owns every row; stage 0's bytes are dp = 1's
                rows = spawn(dp, _worker, args.model, args.seq, zero, precision)
                worst = max(rows, key=lambda r: r["parameters"] + r["gradients"] + r["optimizer"])
                total = worst["parameters"] + worst["gradients"] + worst["optimizer"]
                modelled = lattice.cost.estimate(cfg, "serial", batch=1, seq=args.seq, dp=dp, zero=zero,
                                                 precision=precision).memory
                model_total = modelled["parameters"] + modelled["gradients"] + modelled["optimizer"]
                gathered = (f"{max(r['gathered'] for r in rows) / MIB:.1f} ({modelled['gathered'] / MIB:.1f})"
                            if zero == 3 else "—")
                print(f"| {precision} | {dp} | {zero} | {worst['parameters'] / MIB:.1f} | {worst['gradients'] / MIB:.1f} | "
                      f"{worst['optimizer'] / MIB:.1f} | {total / MIB:.1f} | {total / worst['numel']:.3f} | "
                      f"{formula(zero, dp, precision):.3f} | {model_total / worst['numel']:.3f} | "
                      f"{megatron(zero, dp, precision)} | {gathered} |", flush=True)

    llama = get_arch("llama").config_class.preset("llama3-8b")
    with torch.device("meta"):
        n = lattice.build_model(llama, lattice.context("serial")).num_parameters()
    print(f"\nLlama-3-8B ({n / 1e9:.2f} B parameters) from the cost model (no processes), one replica of tp = 1; "
          f"GiB per rank (bytes per parameter; formula):")
    print("| precision | dp | zero 0 | zero 1 | zero 2 | zero 3 |")
    print("|---|---|---|---|---|---|")
    for precision in ("fp32", "bf16"):
        for dp in args.dp:
            cells = []
            for zero in (0, 1, 2, 3):
                m = lattice.cost.estimate(llama, "serial", batch=1, seq=128, dp=dp, zero=zero, precision=precision).memory
                tot = m["parameters"] + m["gradients"] + m["optimizer"]
                cells.append(f"{tot / 2 ** 30:.1f} ({tot / n:.3f}; {formula(zero, dp, precision):.3f})")
            print(f"| {precision} | {dp} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
