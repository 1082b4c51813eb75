"""`lattice convert`: move a checkpoint between its forms, in one process.

    lattice convert runs/a runs/a.pt                 # sharded (the run's newest) -> one file of full tensors
    lattice convert runs/a.pt runs/b                 # one file -> sharded, in runs/b/checkpoints/step-N
    lattice convert runs/a --to hf runs/a-hf         # config.json + model.safetensors for the family's
                                                     #   transformers class (GPT2LMHeadModel.from_pretrained)
    lattice convert --from hf runs/a-hf runs/c       # a local HF directory (its config.json's model_type
                                                     #   names the family) -> a lattice checkpoint (step 0,
                                                     #   no optimizer state) to train --resume from
    lattice convert runs/a --to hf runs/a-hf --overwrite   # replace an earlier export's files there

A destination that holds anything (an HF directory, a file, a run) is refused; `--overwrite`
lets an export replace what an export writes (HF_EXPORT_FILES, or the one .pt file) and keeps the
rest. An HF export is written into a hidden directory beside the destination and moved into place
once whole, so an export that fails leaves the destination as it was.

Between a sharded checkpoint and an HF directory (either way) one full tensor is in memory at a
time, plus, on export, the safetensors shard being written (at most 2 GiB); writing the single
file holds the whole model (and AdamW's moments), as that form does. Sharded-to-sharded
resharding needs no conversion (every layout loads every sharded checkpoint).
"""

from __future__ import annotations

import argparse
import os
import shutil
from pathlib import Path

import torch

from lattice import checkpoint
from lattice.checkpoint import files as checkpoint_files
from lattice.checkpoint import run_dir, sharded
from lattice.checkpoint.files import check_out_dir
from lattice.models import arch_of_hf, available_archs, get_arch, hf
from lattice.parallel.context import LatticeConfigError

_MOMENTS = ("exp_avg", "exp_avg_sq")
# the files an HF export consists of (its config, generation config, weights, and tokenizer in either
# of transformers' forms): with --overwrite these are removed from a used destination, nothing else
HF_EXPORT_FILES = ("config.json", "generation_config.json", "model.safetensors", "model.safetensors.index.json",
                   "model-*-of-*.safetensors", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "added_tokens.json", "vocab.json", "merges.txt", "vocab.txt", "tokenizer.model", "chat_template.jinja")
_NOT_CARRIED = {"format", "version", "files", "path", "tensors", "checksums", "model", "optimizer", "rng",
                "optimizer_step"}


def add_convert_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("src", help="a run directory or checkpoint written by lattice (with --from hf: a HuggingFace "
                               "model directory)")
    p.add_argument("dst", help="where to write: a run directory for sharded, a .pt file for single, a directory for hf")
    p.add_argument("--to", choices=("sharded", "single", "hf"), default=None,
                   help="the form to write (default: single from sharded, sharded from anything else)")
    p.add_argument("--from", dest="source", choices=("lattice", "hf"), default="lattice",
                   help="what SRC is (default lattice)")
    p.add_argument("--arch", default=None, choices=available_archs(),
                   help="the model family SRC must hold (default: whatever it holds)")
    p.add_argument("--overwrite", action="store_true",
                   help="export into a DST that already holds a file or an HF directory: replace the files an export "
                        "writes (the .pt file; config, weights, tokenizer) and keep the rest")


def convert(args) -> dict:
    """Write args.src's checkpoint in the form asked for at args.dst; returns its metadata."""
    if args.source == "hf" or args.to == "hf":
        hf.require_hf_packages("lattice convert --from hf" if args.source == "hf" else "lattice convert --to hf")
    if args.source == "hf":
        meta, tensors = _from_hf(Path(args.src))
        to = args.to or "sharded"
        if to == "hf":
            raise LatticeConfigError("--from hf --to hf copies nothing; pass --to sharded or --to single")
    else:
        ckpt = checkpoint.read(args.src)
        to = args.to or ("single" if checkpoint.is_sharded(ckpt) else "sharded")
        meta, tensors = _full_tensors(ckpt)
    if args.arch is not None and meta["arch"] != args.arch:
        raise LatticeConfigError(f"{args.src} holds a {meta['arch']} model, not {args.arch}; drop --arch or pass "
                                 f"another source")
    dst = Path(args.dst)
    _check_destination(dst, to, args.overwrite)
    if to == "hf":  # written whole beside the destination, then moved in (`publish_hf`)
        staging = hf_staging(dst)
        try:
            _write_hf(staging, meta, tensors)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        meta, where = {**meta, "staging": staging}, dst
    else:
        replaced = to == "single" and checkpoint.single_file(dst).exists()
        where = {"sharded": _write_sharded, "single": _write_single}[to](dst, meta, tensors)
        if replaced:
            print(f"--overwrite: replaced the file that was at {where}")
    print(f"wrote {to} checkpoint {where} (step {meta['step']}, "
          f"{sum(t.numel() for k, t in tensors.items() if k.startswith('model/')):,} parameters"
          f"{', with AdamW moments' if meta['optimizer_step'] and to != 'hf' else ''})")
    return {**meta, "to": to}


def _check_destination(dst: Path, to: str, overwrite: bool) -> None:
    """Refuse, before reading any tensor, a destination that cannot take the form (a file where a
    directory goes, a place that cannot be created or written, a run directory holding a run) or
    that holds what this conversion did not write, unless `overwrite` (exports only)."""
    if to == "single":
        target = checkpoint.single_file(dst)
        if target.exists() and not overwrite:
            raise LatticeConfigError(f"destination {target} already exists ({_size(target)}); convert to a new path, "
                                     f"or pass --overwrite to replace it")
        check_out_dir(target.parent, flag="destination directory")
        return
    if to == "sharded" and dst.suffix != ".pt" and dst.is_dir() and (found := run_dir.describe(dst)):
        raise LatticeConfigError(f"destination {dst} holds {found}; convert into a new directory (lattice never "
                                 f"mixes two runs in one)")
    if to == "hf" and dst.is_dir() and (held := sorted(p.name for p in dst.iterdir())) and not overwrite:
        what = "a HuggingFace model directory" if "config.json" in held else "a directory in use"
        raise LatticeConfigError(f"destination {dst} is {what} holding {len(held)} entries ({_listing(held)}); export "
                                 f"into a new directory, or pass --overwrite to replace the files an export writes "
                                 f"(config, weights, tokenizer) and keep the rest")
    if dst.suffix != ".pt":
        if to == "hf" and not dst.exists():  # created by the move into place: only its parent now
            check_out_dir(dst.parent, flag="destination's directory")
            return
        check_out_dir(dst, flag="destination")


def _size(path: Path) -> str:
    return f"{path.stat().st_size:,} bytes" if path.is_file() else "a directory"


def _listing(names: list[str], shown: int = 5) -> str:
    return ", ".join(names[:shown]) + (f", ... {len(names) - shown} more" if len(names) > shown else "")


def hf_staging(dst: Path) -> Path:
    """The hidden directory beside `dst` an HF export is written into before `publish_hf`."""
    staging = dst.parent / f".{dst.name}.export-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)  # (a killed export of this same pid number)
    staging.mkdir(parents=True)
    return staging


def publish_hf(staging: Path, dst: Path) -> tuple[list[str], list[str]]:
    """The whole export in `staging` moved to `dst`: renamed into place where `dst` is new or
    empty; else (--overwrite) the HF_EXPORT_FILES there removed and the new files moved in. Returns
    (the names removed, the names kept) of what `dst` held."""
    if not dst.exists() or (dst.is_dir() and not any(dst.iterdir())):
        if dst.exists():
            dst.rmdir()
        os.replace(staging, dst)
        return [], []
    held = sorted(p.name for p in dst.iterdir())
    removed = sorted({p.name for pattern in HF_EXPORT_FILES for p in dst.glob(pattern) if p.is_file()})
    for name in removed:
        (dst / name).unlink()
    for path in sorted(staging.iterdir()):
        os.replace(path, dst / path.name)
    staging.rmdir()
    return removed, [name for name in held if name not in removed]


def _full_tensors(ckpt: dict) -> tuple[dict, dict[str, torch.Tensor]]:
    """(metadata, {"model/<name>" | "optimizer/<moment>/<name>": full tensor}) of either form."""
    meta = {k: v for k, v in ckpt.items() if k not in _NOT_CARRIED}
    meta["arch"] = checkpoint.arch_of(ckpt)
    rng = ckpt.get("rng", {}).get("torch")
    if rng is not None:
        meta["rng"] = {"torch": rng if isinstance(rng, str) else checkpoint_files.encode_rng(rng)}
    if checkpoint.is_sharded(ckpt):
        meta["optimizer_step"] = int(ckpt.get("optimizer_step", 0))
        keys = [k for k in ckpt["tensors"] if k.startswith("model/") or (meta["optimizer_step"] and
                                                                          k.startswith("optimizer/"))]
        index = sharded.read_index(Path(ckpt["path"]))
        stored = index.state_dict_metadata
        return meta, {k: hf.LazyTensor(lambda k=k: sharded.load_full(ckpt, [k], index=index)[k], stored[k].size,
                                       stored[k].properties.dtype) for k in keys}
    meta["optimizer_step"] = int(ckpt["optimizer"].get("step", 0))
    tensors = {f"model/{k}": t for k, t in ckpt["model"].items()}
    if meta["optimizer_step"]:
        tensors.update({f"optimizer/{m}/{k}": t for m in _MOMENTS for k, t in ckpt["optimizer"][m].items()})
    return meta, tensors


def _model_part(tensors: dict) -> dict:
    return {k[len("model/"):]: t for k, t in tensors.items() if k.startswith("model/")}


def _loaded(tensors: dict) -> dict[str, torch.Tensor]:
    """Every tensor in memory (the single-file form holds them all)."""
    return {k: t.load() if isinstance(t, hf.LazyTensor) else t for k, t in tensors.items()}


def import_single(ckpt: dict, dst: Path, *, group=None) -> Path:
    """A single-file checkpoint that `checkpoint.read` validated, written as a sharded checkpoint
    in the run directory `dst` (weights, moments, RNG and counters exactly) by this process
    (inside a process group: `group` holds this process alone)."""
    return _write_sharded(dst, *_full_tensors(ckpt), group=group)


def export_single(ckpt: dict, dst: Path) -> Path:
    """A sharded checkpoint that `checkpoint.read` validated, written as one file of full tensors."""
    return _write_single(dst, *_full_tensors(ckpt))


def _write_sharded(dst: Path, meta: dict, tensors: dict, group=None) -> Path:
    if dst.suffix == ".pt":
        raise LatticeConfigError(f"{dst} names a file, but a sharded checkpoint is a directory; pass a run directory "
                                 f"or --to single")
    return sharded.write_full(dst, meta, tensors, group=group)


def _write_single(dst: Path, meta: dict, tensors: dict) -> Path:
    tensors = _loaded(tensors)
    model = _model_part(tensors)
    step = meta["optimizer_step"]
    # (a tensor the model updates itself, an MoE's expert bias, has no moments in a sharded checkpoint)
    optimizer = {m: {name: tensors[f"optimizer/{m}/{name}"] if step else torch.zeros_like(t)
                     for name, t in model.items() if not step or f"optimizer/{m}/{name}" in tensors} for m in _MOMENTS}
    payload = {k: v for k, v in meta.items() if k not in ("rng", "optimizer_step")}
    payload.update(model=model, optimizer={**optimizer, "step": step})
    if "rng" in meta:
        payload["rng"] = {"torch": checkpoint_files.decode_rng(meta["rng"]["torch"])}
    return checkpoint.save(payload, checkpoint.single_file(dst))


def _write_hf(dst: Path, meta: dict, tensors: dict) -> Path:
    family = get_arch(meta["arch"])
    cfg = family.config_class.from_dict(meta["model_config"])
    hf.write_hf_dir(family, cfg, _model_part(tensors), dst)
    return dst


def _from_hf(src: Path) -> tuple[dict, dict]:
    """The directory's weights as lazy tensors: each is read from its safetensors file only
    while it is written (sharded or hf), so the import holds one full tensor at a time."""
    hf_config = hf.read_hf_config(src)
    family = arch_of_hf(hf_config.model_type)
    cfg, full = hf.read_hf_dir(family, src, hf_config)
    meta = {"step": 0, "arch": family.name, "model_config": cfg.to_dict(), "train_config": {}, "optimizer_step": 0,
            "imported_from": str(src)}
    return meta, {f"model/{k}": t for k, t in full.items()}
