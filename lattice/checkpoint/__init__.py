"""Checkpoints that do not depend on the layout they were written under. Training writes and
resumes one form, sharded (every rank writes its own shards; lattice.checkpoint.sharded). The
single file of full tensors below is `lattice convert`'s export and import form (and what runs
before the sharded form wrote as OUT/ckpt.pt): `lattice train --resume` converts one into a
sharded checkpoint first, `generate` and `eval` load its weights directly. `read`, `resolve`
and `load_into` take either.

A single-file checkpoint holds FULL tensors keyed by the serial parameter names: the weights
and AdamW's moments.

    {"format": "lattice-checkpoint", "version": 1, "step": int,
     "model_config": {...}, "train_config": {...},
     "model": {name: full tensor}, "optimizer": {"exp_avg": {...}, "exp_avg_sq": {...}, "step": int},
     "rng": {"torch": uint8 tensor}, "forward_count": int,
     "checksums": {"model/<name>" | "optimizer/<moment>/<name>": CRC-32 of the tensor's bytes}}

It is written to a temporary file, then `os.replace`d, so a crash never leaves half a file under
the real name. Every rank reads and validates the file itself with `torch.load(weights_only=True)`
before any collective, so a missing, truncated or foreign file fails with the same one-line
`LatticeConfigError` everywhere instead of leaving some ranks waiting in a collective.
"""

from __future__ import annotations

import os
import pickle
import zipfile
import zlib
from pathlib import Path

import torch

from lattice.checkpoint.files import START_FRESH, atomic_write, check_version_and_keys
from lattice.parallel.context import LatticeConfigError
from lattice.parallel.sharding import gather_full_many
from lattice.parallel.zero import ZeroOptimizer

FORMAT = "lattice-checkpoint"
VERSION = 1
FILENAME = "ckpt.pt"
_ZIP_MAGIC = b"PK\x03\x04"  # torch.save writes a zip archive


def single_file(path: str | os.PathLike) -> Path:
    """Where a single-file checkpoint goes: the path itself, or ckpt.pt inside a directory."""
    path = Path(path)
    return path / FILENAME if path.is_dir() else path


def resolve(path: str | os.PathLike) -> Path:
    """The checkpoint a path names: a single file, a sharded checkpoint's directory, or, for a
    run directory, its newest complete checkpoint (sharded ones in checkpoints/, or ckpt.pt;
    the more recently written when it has both)."""
    # imported where used: it brings torch.distributed.checkpoint (and DTensor under it), a second of
    # start-up that --help, plan, info and data do not need
    from lattice.checkpoint import sharded
    path = Path(path)
    if not path.is_dir() or sharded.is_checkpoint_dir(path):
        return path
    candidates = [p for p in (sharded.complete(path)[-1:] + [path / FILENAME]) if p.exists()]
    if not candidates:
        return path / FILENAME  # read() names what is missing
    return max(candidates, key=lambda p: (p / sharded.MARKER if p.is_dir() else p).stat().st_mtime)


def run_of(path: str | os.PathLike) -> Path:
    """The run directory a checkpoint path belongs to (where tokenizer.json and metrics.csv are)."""
    from lattice.checkpoint import sharded
    path = resolve(path)
    if path.is_dir():
        return path.parent.parent if path.parent.name == sharded.SUBDIR else path.parent
    return path.parent


def is_sharded(ckpt: dict) -> bool:
    from lattice.checkpoint import sharded
    return ckpt.get("format") == sharded.FORMAT


def full_model(ckpt: dict) -> dict[str, torch.Tensor]:
    """The weights of a checkpoint that `read` validated, as full tensors keyed by serial names,
    in this process (the whole model in memory; no process group needed)."""
    from lattice.checkpoint import sharded
    if is_sharded(ckpt):
        keys = [k for k in ckpt["tensors"] if k.startswith("model/")]
        return {k[len("model/"):]: t for k, t in sharded.load_full(ckpt, keys).items()}
    return ckpt["model"]


def load_into(ckpt: dict, model) -> None:
    """Give the model this rank's shards of the weights of a checkpoint that `read` validated:
    sliced from full tensors without communication, or read by DCP (sharded: a collective, every
    rank calls it). (A training run's optimizer state is restored from sharded checkpoints only,
    by lattice.checkpoint.run_checkpoints.)"""
    from lattice.checkpoint import sharded
    if is_sharded(ckpt):
        sharded.load(ckpt, model)
        return
    model.load_full_state_dict(ckpt["model"])


def _tensors(payload: dict):
    """(name, tensor) for every tensor a checkpoint holds, named by where it sits."""
    yield from ((f"model/{k}", t) for k, t in payload.get("model", {}).items())
    for key in ("exp_avg", "exp_avg_sq"):
        yield from ((f"optimizer/{key}/{k}", t) for k, t in payload.get("optimizer", {}).get(key, {}).items())


def checksum(t: torch.Tensor) -> int:
    """CRC-32 of a tensor's bytes."""
    return zlib.crc32(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())


def non_finite(payload: dict) -> list[str]:
    """Names of the checkpoint tensors holding NaN or infinity."""
    return [name for name, t in _tensors(payload) if t.is_floating_point() and not torch.isfinite(t).all()]


def save(payload: dict, path: str | os.PathLike) -> Path:
    """Write atomically (a crash never leaves half a checkpoint under the real name), with a
    checksum of every tensor; a payload holding NaN or infinity is refused."""
    path = single_file(path)
    bad = non_finite(payload)
    if bad:
        raise LatticeConfigError(f"refusing to save a checkpoint with non-finite values in {bad[:3]}; "
                                 f"the previous checkpoint at {path} is kept")
    sums = {name: checksum(t) for name, t in _tensors(payload)}
    atomic_write(path, lambda tmp: torch.save({"format": FORMAT, "version": VERSION, **payload, "checksums": sums}, tmp))
    return path


def read(path: str | os.PathLike) -> dict:
    """Load and validate a checkpoint on this rank alone (no collective): a single file is read
    whole; of a sharded checkpoint, only its marker and index are read (and its files
    checksummed), the tensors being read later by `load_into`.

    Raises a one-line LatticeConfigError naming the problem and the fix for a missing, truncated,
    corrupt or foreign file, or a format version this code does not read."""
    from lattice.checkpoint import sharded
    given, path = Path(path), resolve(path)
    if path.is_dir():
        return sharded.read(path)
    if not path.exists():
        what = (f"{given} holds no checkpoint (neither {sharded.SUBDIR}/step-N/ nor {FILENAME})" if given.is_dir()
                else f"checkpoint {path} does not exist")
        raise LatticeConfigError(f"{what}; pass the run directory written by `lattice train --out-dir DIR` (or a "
                                 f"checkpoint in it), {START_FRESH}")
    with open(path, "rb") as f:
        head = f.read(4)
    if head != _ZIP_MAGIC:
        what = "an empty file" if not head else "not a torch.save archive"
        raise LatticeConfigError(f"checkpoint {path} is {what}, not a lattice checkpoint; pass the {FILENAME} "
                                 f"written by `lattice train`, {START_FRESH}")
    if not zipfile.is_zipfile(path):
        raise LatticeConfigError(f"checkpoint {path} is truncated (its archive has no end); it was cut off while "
                                 f"being copied or written: use an intact copy, {START_FRESH}")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        reason = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        raise LatticeConfigError(f"checkpoint {path} holds objects other than tensors and plain data, so it is "
                                 f"not a lattice checkpoint ({reason[:120]}); pass the {FILENAME} written by "
                                 f"`lattice train`, {START_FRESH}") from None
    except (RuntimeError, EOFError, OSError, KeyError, ValueError) as e:
        raise LatticeConfigError(f"checkpoint {path} is corrupt and cannot be read ({type(e).__name__}); use an "
                                 f"intact copy, {START_FRESH}") from None
    if not isinstance(ckpt, dict) or ckpt.get("format") != FORMAT:
        keys = f" with keys {sorted(map(str, ckpt))[:4]}" if isinstance(ckpt, dict) else ""
        what = f"a {type(ckpt).__name__}{keys}"
        raise LatticeConfigError(f"{path} is a torch file holding {what}, not a lattice checkpoint; pass the "
                                 f"{FILENAME} written by `lattice train`, {START_FRESH}")
    check_version_and_keys(ckpt, path, VERSION, ("step", "model_config", "model", "optimizer"))
    sums = ckpt.get("checksums", {})
    for name, t in _tensors(ckpt):
        if name in sums and checksum(t) != sums[name]:
            raise LatticeConfigError(f"checkpoint {path}: tensor {name} does not match its checksum, so the file is "
                                     f"corrupt; use an intact copy, {START_FRESH}")
    bad = non_finite(ckpt)
    if bad:
        raise LatticeConfigError(f"checkpoint {path} holds NaN or infinite values in {bad[:3]}; resume from an "
                                 f"earlier checkpoint, {START_FRESH}")
    return ckpt


def arch_of(ckpt: dict) -> str:
    """The model family a checkpoint holds (checkpoints written before families are GPT-2's)."""
    return ckpt.get("arch", "gpt2")


def check_model_config(ckpt: dict, arch: str, model_config: dict, path: str | os.PathLike = "checkpoint") -> None:
    """Refuse a checkpoint whose model differs from this run's (one line, every differing field).
    Dropout is not compared: it changes training, not what the weights mean. A field the saved
    config lacks (written before the family had it) is taken at its default, as loading it does."""
    from lattice.models import get_arch

    if arch_of(ckpt) != arch:
        raise LatticeConfigError(f"{path} holds a {arch_of(ckpt)} model, not {arch}; pass --arch {arch_of(ckpt)} (or "
                                 f"leave --arch out to use the run's), or start without --resume")
    saved = dict(ckpt["model_config"])
    defaults = get_arch(arch).config_class.from_dict(saved).to_dict()
    saved.update({k: v for k, v in defaults.items() if k not in saved})
    keys = sorted((set(saved) | set(model_config)) - {"dropout"})
    differ = [k for k in keys if saved.get(k) != model_config.get(k)]
    if differ:
        diff = [f"{k} {saved.get(k)!r} vs {model_config.get(k)!r}" for k in differ]
        flags = [f"--{k.replace('_', '-')}" for k in differ]
        raise LatticeConfigError(f"{path} was saved for a different model (saved vs this run: {'; '.join(diff)}); "
                                 f"drop the flags that change it ({', '.join(flags)}, or --model) to continue the "
                                 f"saved model, or start without --resume")


def gather_optimizer(model, optimizer: torch.optim.Optimizer) -> dict:
    """AdamW's moments as full tensors keyed by serial parameter names (a collective).

    Moments have their parameter's shape and dtype, so they gather with the parameter's shard
    spec; before the first step they are zeros."""
    params = dict(model.named_parameters())
    out = {"exp_avg": {}, "exp_avg_sq": {}, "step": 0}
    local = optimizer.full_local_moments() if isinstance(optimizer, ZeroOptimizer) else None  # over dp first
    mine = {"exp_avg": [], "exp_avg_sq": []}
    for name, spec in model.specs.items():
        state = optimizer.state.get(params[name], {}) if name in params and local is None else {}
        for key in mine:
            mine[key].append((local[key].get(name) if local is not None else state.get(key), spec))
        if "step" in state:
            out["step"] = int(state["step"])
    for key, shards in mine.items():
        fulls = gather_full_many(shards, model.ctx, dtype=model.dtype if local is None else optimizer.master_dtype)
        out[key] = dict(zip(model.specs, fulls))
    if local is not None:
        out["step"] = max((int(s["step"]) for s in optimizer.state.values() if "step" in s), default=0)
    return out
