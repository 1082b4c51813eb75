"""A training run's checkpoints: what one step's checkpoint records (step, time, family, model
and train config, layout, dropout count, RNG, weights and AdamW moments), written sharded (every
rank its own shards into OUT/checkpoints/step-N, the newest `keep` kept; on a background thread
with async_checkpoint) and restored into a model and its optimizer in any layout. Training
writes and resumes this one form; a single file of full tensors is `lattice convert`'s export
and import (`lattice train --resume` converts one first). NaN or infinity anywhere is refused on every rank before anything is
written, so that a diverged run never overwrites its last good checkpoint."""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist

from lattice.checkpoint import files as checkpoint_files
from lattice.checkpoint import sharded
from lattice.parallel.context import Diverged


class AsyncWriter:
    """Writes checkpoints on a background thread over a process group of its own (gloo), so
    that its collectives never interleave with training's. One save in flight at a time:
    `submit` first waits for the previous one. The state must be staged (copied) by the caller."""

    def __init__(self):
        self.group = dist.new_group(backend="gloo") if dist.is_initialized() else None
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lattice-checkpoint")
        self.pending: Future | None = None

    def submit(self, root: Path, meta: dict, state: dict[str, sharded.Chunk], *, keep: int) -> Future:
        self.wait()
        self.pending = self.pool.submit(sharded.write, root, meta, state, keep=keep, group=self.group)
        return self.pending

    def wait(self) -> Path | None:
        """Block until the save in flight (if any) is complete; re-raises its error."""
        pending, self.pending = self.pending, None
        return pending.result() if pending is not None else None

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self.pool.shutdown()


class RunCheckpoints:
    """The checkpoints of one Trainer's run (`cfg`: its TrainConfig)."""

    def __init__(self, cfg, ctx, model, optimizer, model_config):
        self.cfg, self.ctx, self.model, self.optimizer, self.model_config = cfg, ctx, model, optimizer, model_config
        self.async_writer = None

    def start_async(self) -> None:
        """The background writer of async_checkpoint (a collective: its own process group)."""
        self.async_writer = AsyncWriter()

    def wait(self) -> None:
        """Until the last checkpoint submitted to the background writer is complete."""
        if self.async_writer:
            self.async_writer.wait()

    def save(self, path: str | os.PathLike, *, step: int, elapsed: float) -> Path:
        """Write the checkpoint of `step` into PATH/checkpoints/step-N (a collective: every rank
        must call it). Returns where it is (being) written."""
        steps = [int(state["step"]) for state in self.optimizer.state.values() if "step" in state]
        # (copied now under async_checkpoint: the thread writes the copy while training goes on)
        state = sharded.training_state(self.model, self.optimizer, with_moments=bool(steps),
                                       staged=self.async_writer is not None)
        # the weights as saved (ZeRO-3's master rows: its parameters are gathered only where used)
        bad = torch.tensor([float(any(not torch.isfinite(chunk.data).all() for chunk in state.values()))],
                           device=self.ctx.device)
        if self.ctx.world_size > 1:
            dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        if bad.item():
            raise Diverged(f"step {step}: the weights or optimizer moments hold NaN or infinity; "
                                         f"refusing to save over the last checkpoint in {path}")
        meta = {
            "step": step,
            "elapsed_s": elapsed,
            "arch": self.cfg.arch,
            "model_config": self.model_config.to_dict(),
            "train_config": asdict(self.cfg),
            "layout": self.ctx.layout.record(),
            "forward_count": self.model.seeds.forward_count,
        }
        meta.update(optimizer_step=max(steps, default=0), rng={"torch": checkpoint_files.encode_rng(torch.get_rng_state())})
        if self.async_writer is not None:
            self.async_writer.submit(Path(path), meta, state, keep=self.cfg.keep)
            return Path(path) / sharded.SUBDIR / sharded.step_name(step)
        return sharded.write(Path(path), meta, state, keep=self.cfg.keep)

    def restore(self, ckpt: dict) -> tuple[int, float]:
        """This rank's shard of every saved tensor, read by DCP (a collective), the dropout count
        and the RNG. Returns the checkpoint's (step, elapsed seconds)."""
        sharded.load(ckpt, self.model, self.optimizer)
        step = int(ckpt["step"])
        self.model.seeds.forward_count = int(ckpt.get("forward_count", step))
        rng = ckpt.get("rng", {}).get("torch")
        if rng is not None:
            torch.set_rng_state(checkpoint_files.decode_rng(rng))
        return step, float(ckpt.get("elapsed_s", 0.0))
