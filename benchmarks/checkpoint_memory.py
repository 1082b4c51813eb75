"""Peak memory per rank while saving and loading a checkpoint: sharded (DCP) beside single-file.

    python benchmarks/checkpoint_memory.py --model gpt2 --mode 1d --tp 4

Starts tp gloo processes, builds GPT-2 in the layout with AdamW state (random moments, as after
a step), and measures each phase in isolation: the kernel's resident-set high-water mark
(VmHWM) is reset before the phase (/proc/self/clear_refs) and read after it, and the growth over
the resident size at the start is reported beside the rank's own shards (weights + two moments)
and the largest local shard. Phases:

- sharded save: every rank writes its own chunks (lattice.checkpoint.sharded.write);
- sharded load: every rank reads its own regions back (DCP), into the same layout;
- single save: one file of full tensors (weights and moments gathered, rank 0 writes it), the
  form `lattice convert` exports;
- single load: `checkpoint.read` of that file (each rank reads it whole) and slicing its weights'
  shards, as `generate` and `eval` load it.

Linux only (VmHWM and clear_refs). The workers run with MALLOC_MMAP_THRESHOLD_=1 MiB so that
buffers larger than that are returned to the kernel when freed and the high-water mark counts
live memory, not glibc's retained heap.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from lattice.bench.provenance import provenance
from lattice.bench.world import spawn

MIB = 2 ** 20


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def _measure(fn) -> int:
    """Peak resident growth (bytes) while fn runs."""
    import gc

    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
    start = _status("VmRSS")
    fn()
    return _status("VmHWM") - start


def _worker(args, out_dir: str) -> dict:
    import torch
    import torch.distributed as dist

    import lattice
    from lattice import GPTConfig, checkpoint
    from lattice.checkpoint import sharded

    rank = dist.get_rank()
    ctx = lattice.init(args.mode, tp=args.tp)
    cfg = GPTConfig.preset(args.model, vocab_size=args.vocab_size)
    model = lattice.build_model(cfg, ctx)
    opt = torch.optim.AdamW(model.parameters())
    for p in model.parameters():  # the state AdamW holds after its first step
        opt.state[p] = {"step": torch.tensor(1.0), "exp_avg": torch.randn_like(p), "exp_avg_sq": torch.rand_like(p)}
    local = [t for p in model.parameters() for t in (p, opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"])]
    row = {"rank": rank, "shards": sum(t.numel() * t.element_size() for t in local),
           "largest_local": max(t.numel() * t.element_size() for t in local)}
    meta = {"step": 1, "model_config": cfg.to_dict(), "optimizer_step": 1}
    root = Path(out_dir)
    holder = {}
    row["sharded_save"] = _measure(lambda: sharded.write(
        root, meta, sharded.training_state(model, opt, with_moments=True)))
    saved = sharded.read(sharded.complete(root)[-1])
    row["sharded_load"] = _measure(lambda: sharded.load(saved, model, opt))

    def single_save():
        payload = {**meta, "model": model.full_state_dict(), "optimizer": checkpoint.gather_optimizer(model, opt)}
        if rank == 0:
            checkpoint.save(payload, root / "ckpt.pt")
        dist.barrier()

    row["single_save"] = _measure(single_save)

    def single_load():
        holder["ckpt"] = checkpoint.read(root / "ckpt.pt")
        checkpoint.load_into(holder["ckpt"], model)  # weights only: training resumes sharded checkpoints
        holder.clear()

    row["single_load"] = _measure(single_load)
    dist.barrier()
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt2")
    ap.add_argument("--vocab-size", type=int, default=50257)
    ap.add_argument("--mode", default="1d")
    ap.add_argument("--tp", type=int, default=4)
    ap.add_argument("--json", default=None, help="also write the rows to this file")
    args = ap.parse_args(argv)
    # a fixed mmap threshold: freed buffers go back to the kernel at once, so that the resident
    # high-water mark measures live memory rather than what glibc's heap kept after a free
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 << 20))
    with tempfile.TemporaryDirectory() as out_dir:
        rows = spawn(args.tp, _worker, args, out_dir)
    print(f"{args.model} (vocabulary {args.vocab_size}, float32) in {args.mode} tp={args.tp}: peak resident growth "
          f"per rank during each phase, MiB")
    cols = ("shards", "largest_local", "sharded_save", "sharded_load", "single_save", "single_load")
    print("rank " + " ".join(f"{c:>14}" for c in cols))
    for r in rows:
        print(f"{r['rank']:>4} " + " ".join(f"{r[c] / MIB:>14.1f}" for c in cols))
    if args.json:
        Path(args.json).write_text(json.dumps({"provenance": provenance(), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
