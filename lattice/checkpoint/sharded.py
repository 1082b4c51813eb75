"""Sharded checkpoints on torch.distributed.checkpoint (DCP): every rank writes only its shards,
and a checkpoint loads into any layout (DCP's planner reshards).

A run directory keeps its checkpoints side by side, the newest K of them (`--keep K`):

    runs/a/checkpoints/step-00000100/
        __0_0.distcp, __1_0.distcp ...   DCP's data files, one per writing rank
        .metadata                        DCP's index: each key's chunks (offsets, sizes), and where they lie
        lattice.json                     written last, after every shard: step, configs, RNG, and the
                                         size and CRC-32 of every file above

Keys are the serial parameter names: "model/<name>", "optimizer/exp_avg/<name>" and
"optimizer/exp_avg_sq/<name>". A rank offers each shard it holds as a chunk of the full tensor,
placed by its ShardSpec (vocabulary padding cut off), so DCP writes each distinct chunk once
(replicas are deduplicated across ranks) and, on load, reads into each rank exactly the region
of the full tensor its own spec asks for, whatever layout wrote it. No rank ever holds a full
tensor when both sides are parallel: DCP reads one stored chunk at a time.

A save goes into `.step-N.partial/` and becomes `step-N/` (a rename) only after lattice.json is
written, so a crash at any moment leaves the previous checkpoints intact and the partial one
invisible. Loading reads DCP's index with an unpickler that accepts only DCP's metadata classes,
and DCP reads tensors with `torch.load(weights_only=True)`.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex, TensorProperties,
                                                   TensorStorageMetadata)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from lattice.checkpoint.dcp_io import INDEX_FILE, LoadPlanner, Reader, SavePlanner, checksums, overlaps, read_index
from lattice.checkpoint.files import (START_FRESH, WriteFailed, atomic_write, check_version_and_keys, crc_file,
                                      fsync_dir, megabytes, space_shortfall, write_failure_reason)
from lattice.parallel.context import LatticeConfigError
from lattice.parallel.zero import ZeroOptimizer

FORMAT = "lattice-sharded-checkpoint"
VERSION = 1
MARKER = "lattice.json"
SUBDIR = "checkpoints"


def step_name(step: int) -> str:
    return f"step-{step:08d}"


# ----------------------------------------------------------------------------- chunks
class Chunk:
    """A rank's piece of one full tensor, as DCP sees it: the full shape, the offsets where the
    piece starts, and the local tensor (a view into the parameter or moment). DCP's planner
    asks it for write items on save, for the region it wants on load, and for the tensor itself
    (`__get_tensor_shard__`); the planners below hand DCP `data` directly."""

    def __init__(self, data: torch.Tensor, offsets: tuple[int, ...], full_shape: tuple[int, ...]):
        self.data, self.offsets, self.full_shape = data, torch.Size(offsets), torch.Size(full_shape)

    def size(self) -> torch.Size:
        return self.full_shape

    def full_nbytes(self) -> int:
        """The bytes of the whole tensor this is a piece of."""
        return self.full_shape.numel() * self.data.element_size()

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=self.offsets, sizes=self.data.shape)]

    def __create_write_items__(self, fqn: str, obj) -> list[WriteItem]:
        return [WriteItem(index=MetadataIndex(fqn, self.offsets), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=self.__create_chunk_list__()[0],
                                                      properties=TensorProperties.create_from_tensor(self.data),
                                                      size=self.full_shape))]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        return self.data


def chunk_of(local: torch.Tensor, spec, ctx, first_row: int = 0) -> Chunk | None:
    """This rank's shard as a chunk of the full (unpadded) tensor; None when it holds only
    padding. `first_row`: `local` is the shard's rows from there on (a distributed optimizer's
    piece of a moment), not the whole shard."""
    offsets, region = [], []
    for dim, (sl, n) in enumerate(zip(spec.slices(ctx.coords, ctx.topology), spec.full_shape)):
        start, stop = (sl.start + first_row, sl.start + first_row + local.shape[0]) if dim == 0 else (sl.start, sl.stop)
        lo, hi = min(start, n), min(stop, n)
        if hi <= lo:
            return None
        offsets.append(lo)
        region.append(slice(0, hi - lo))
    return Chunk(local[tuple(region)], tuple(offsets), spec.full_shape)


def training_state(model, optimizer, *, with_moments: bool, staged: bool = False) -> dict[str, Chunk]:
    """The chunks this rank contributes: weights, and AdamW's moments (shaped and sharded like
    their parameters) when `with_moments`. `staged` copies them to CPU first, so that training
    may go on changing the live tensors while a background thread writes the copies."""
    params = dict(model.named_parameters())
    # key: (name, the tensor, its first row in the local shard); the model's own state (an MoE's
    # expert bias, no optimizer's) whole on every rank that holds it
    tensors = {f"model/{name}": (name, p.detach(), 0) for name, p in params.items() if not model.specs[name].trainable}
    if isinstance(optimizer, ZeroOptimizer):  # this dp rank's rows (lattice.parallel.zero)
        tensors.update({key: (name, t, row) for key, name, t, row in optimizer.checkpoint_tensors(with_moments)})
    else:
        tensors.update({f"model/{name}": (name, p.detach(), 0) for name, p in params.items()})
        if with_moments:
            tensors.update({f"optimizer/{key}/{name}": (name, optimizer.state[p][key], 0) for name, p in params.items()
                            if model.specs[name].trainable for key in ("exp_avg", "exp_avg_sq")})
    out = {}
    for key, (name, t, row) in tensors.items():
        chunk = chunk_of(t.detach().to("cpu", copy=True) if staged else t.detach(), model.specs[name], model.ctx, row)
        if chunk is not None:
            out[key] = chunk
    return out


# ----------------------------------------------------------------------------- where checkpoints are
def is_checkpoint_dir(path: Path) -> bool:
    """A sharded checkpoint's own directory (complete or not), rather than a run directory."""
    return (path / MARKER).is_file() or (path / INDEX_FILE).is_file() or path.name.startswith(("step-", ".step-"))


def complete(root: Path) -> list[Path]:
    """The complete checkpoints under a run directory (or its checkpoints/), oldest first."""
    root = Path(root)
    base = root / SUBDIR if (root / SUBDIR).is_dir() else root
    found = [p for p in base.glob("step-*") if p.is_dir() and (p / MARKER).is_file()]
    return sorted(found, key=lambda p: p.name)


def prune(root: Path, keep: int, *, written: Path | None = None) -> list[Path]:
    """Remove all but `keep` complete checkpoints (keep 0: remove none): `written`, the one just
    saved, whatever its step, and the newest others."""
    if keep <= 0:
        return []
    done = [p for p in complete(root) if written is None or p.name != written.name]
    others = keep - (written is not None)
    stale = done[:max(len(done) - others, 0)]
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)
    return stale


def remove_partial(root: Path) -> list[Path]:
    """Checkpoints a killed save left half written (never a complete one)."""
    base = Path(root) / SUBDIR
    stale = sorted(base.glob(".step-*.partial")) + sorted(base.glob(".step-*.old")) if base.is_dir() else []
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)
    return stale


# ----------------------------------------------------------------------------- save
@contextlib.contextmanager
def _single_process_ok():
    """DCP warns on every call without a process group; one process (serial, convert) is meant."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def _rank_and_size(group) -> tuple[int, int]:
    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _last_intact(base: Path) -> str:
    newest = complete(base)[-1:]
    return str(newest[0]) if newest else "none"


def _check_space(base: Path, step: int, state: dict[str, Chunk], keep: int, size: int, group) -> None:
    """Refuse, on every rank alike, a save that does not fit (checkpoint_files.space_shortfall)."""
    short = space_shortfall(base, {key: chunk.full_nbytes() for key, chunk in state.items()}, size=size, group=group)
    if short:
        total, r, free = short
        raise WriteFailed(f"step {step}: the checkpoint needs about {megabytes(total)} and {base} has "
                          f"{megabytes(free)} free (rank {r}); nothing was written and the last intact checkpoint "
                          f"is {_last_intact(base)}; free space there, lower --keep (now {keep}), or choose another "
                          f"--out-dir")


def write(root: Path, meta: dict, state: dict[str, Chunk], *, keep: int = 0, group=None) -> Path:
    """Write one checkpoint (a collective over `group`, default: every rank): first the space
    check, then each rank its chunks, then the marker on rank 0 after every rank's files are on
    disk, then the rename that makes it visible, then pruning to `keep`. A write that fails
    anywhere raises WriteFailed on every rank and leaves no partial directory. Returns the
    checkpoint's directory."""
    rank, size = _rank_and_size(group)
    base = Path(root) / SUBDIR
    final = base / step_name(meta["step"])
    partial = base / f".{final.name}.partial"
    _check_space(base, meta["step"], state, keep, size, group)
    if rank == 0:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    if size > 1:
        dist.barrier(group)  # nobody writes into the directory before it is fresh
    report = None  # this rank's checksums, or why its part failed
    try:
        with _single_process_ok():
            index = dcp.save(state, storage_writer=dcp.FileSystemWriter(partial, sync_files=True,
                                                                         single_file_per_rank=True, thread_count=1),
                             planner=SavePlanner(), process_group=group, no_dist=not dist.is_initialized())
        # torch 2.11 returns the metadata without where each chunk went; the file it wrote holds it
        storage = index.storage_data if index.storage_data is not None else \
            dcp.FileSystemReader(partial).read_metadata().storage_data
        # each rank checksums the chunks it wrote (FileSystemWriter names its files __<rank>_<n>.distcp)
        mine = [i for i, info in storage.items() if info.relative_path.startswith(f"__{rank}_")]
        report = checksums(partial, storage, mine)
    except (OSError, dcp.api.CheckpointException) as e:  # (DCP raises its exception on every rank alike)
        report = write_failure_reason(e, base)
    if size > 1:
        gathered = [None] * size if rank == 0 else None
        dist.gather_object(report, gathered, dst=0, group=group)  # global rank 0: every group here spans the world
    else:
        gathered = [report]
    outcome = [None]  # rank 0's verdict, the same on every rank
    if rank == 0:
        outcome = [next((r for r in gathered if isinstance(r, str)), None)]
        if outcome[0] is None:
            try:
                _publish(partial, final, meta, {k: v for part in gathered for k, v in part.items()}, keep, root)
            except OSError as e:
                outcome = [write_failure_reason(e, base)]
    if size > 1:
        dist.broadcast_object_list(outcome, src=0, group=group)  # also: the checkpoint is visible to every rank
    failure = outcome[0]
    if failure is not None:
        if rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
        raise WriteFailed(f"step {meta['step']}: writing the checkpoint into {base} failed ({failure}); nothing of it "
                          f"was kept and the last intact checkpoint is {_last_intact(base)}")
    return final


def _publish(partial: Path, final: Path, meta: dict, sums: dict, keep: int, root: Path) -> None:
    """Rank 0, once every rank's files are written: the marker, the rename that makes the
    checkpoint visible, pruning."""
    base = final.parent
    files = {p.name: [p.stat().st_size] for p in sorted(partial.glob("*.distcp"))}
    files[INDEX_FILE] = [(partial / INDEX_FILE).stat().st_size, crc_file(partial / INDEX_FILE)]
    record = {"format": FORMAT, "version": VERSION, **meta, "files": files, "checksums": sums}
    atomic_write(partial / MARKER, lambda tmp: Path(tmp).write_text(json.dumps(record, indent=1)))
    old = base / f".{final.name}.old"
    if final.exists():  # the same step saved again (a resumed run): swap, then drop the old
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(partial, final)
    fsync_dir(base)
    shutil.rmtree(old, ignore_errors=True)
    prune(root, keep, written=final)


# ----------------------------------------------------------------------------- read (no collective)
def read(path: Path) -> dict:
    """Validate a sharded checkpoint on this rank alone, before any collective: the marker
    (the save finished), its format and version, every file present with its recorded size,
    and DCP's index (its checksum, and unpickled safely). Returns the marker's record with
    "path" and "tensors" ({key: full shape}) added. A bad checkpoint raises one
    LatticeConfigError line. The stored chunks' checksums are verified when they are read
    (`load`, `load_full`): each rank checks the chunks it will read, not the whole checkpoint."""
    path = Path(path)
    if not (path / MARKER).is_file():
        others = ", ".join(p.name for p in complete(path.parent)) or "none"
        raise LatticeConfigError(f"checkpoint {path} is incomplete (no {MARKER}: its save was interrupted); resume from "
                                 f"a complete one (in {path.parent}: {others}), {START_FRESH}")
    try:
        record = json.loads((path / MARKER).read_text())
    except (ValueError, UnicodeDecodeError):
        raise LatticeConfigError(f"checkpoint {path}: {MARKER} is not valid JSON, so the checkpoint is corrupt; use "
                                 f"an intact copy, {START_FRESH}") from None
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        raise LatticeConfigError(f"{path / MARKER} is not the marker of a lattice sharded checkpoint; pass a "
                                 f"checkpoint written by `lattice train`, {START_FRESH}")
    check_version_and_keys(record, path, VERSION, ("step", "model_config", "files", "checksums"))
    for name, (size, *crc) in record["files"].items():
        f = path / name
        if not f.is_file():
            raise LatticeConfigError(f"checkpoint {path} lacks its file {name}; it was copied incompletely: use an intact "
                                     f"copy, {START_FRESH}")
        if f.stat().st_size != size:
            raise LatticeConfigError(f"checkpoint {path}: {name} has {f.stat().st_size} bytes where {size} were written, "
                                     f"so it is truncated or damaged; use an intact copy, {START_FRESH}")
        if crc and crc_file(f) != crc[0]:
            raise LatticeConfigError(f"checkpoint {path}: {name} does not match its checksum, so the checkpoint is "
                                     f"corrupt; use an intact copy, {START_FRESH}")
    try:
        index = read_index(path)
    except (pickle.UnpicklingError, EOFError, AttributeError, ImportError, ValueError, TypeError) as e:
        raise LatticeConfigError(f"checkpoint {path}: its index {INDEX_FILE} cannot be read safely ({str(e)[:100]}); "
                                 f"it is corrupt or not written by lattice, {START_FRESH}") from None
    tensors = {k: tuple(md.size) for k, md in index.state_dict_metadata.items()
               if isinstance(md, TensorStorageMetadata)}
    return {**record, "path": str(path), "tensors": tensors}


# ----------------------------------------------------------------------------- load (a collective)
def check_tensors(saved: dict, model, *, with_moments: bool, where) -> None:
    """Every key this model needs, with its full shape, is in the checkpoint (before any
    collective, on every rank)."""
    for name, spec in model.specs.items():
        moments = with_moments and spec.trainable
        keys = [f"model/{name}"] + ([f"optimizer/{k}/{name}" for k in ("exp_avg", "exp_avg_sq")] if moments else [])
        for key in keys:
            shape = saved["tensors"].get(key)
            if shape is None:
                raise LatticeConfigError(f"checkpoint {where} lacks {key}; it was written for another model, "
                                         f"{START_FRESH}")
            if shape != spec.full_shape:
                raise LatticeConfigError(f"checkpoint {where}: {key} has shape {list(shape)}, this model's is "
                                         f"{list(spec.full_shape)}; use the model config it was saved with")


@torch.no_grad()
def load(saved: dict, model, optimizer=None) -> None:
    """Read this rank's region of every weight (and, given an optimizer and a checkpoint past
    step 0, of AdamW's moments) from a checkpoint validated by `read` (a collective: every
    rank calls it)."""
    with_moments = optimizer is not None and int(saved.get("optimizer_step", 0)) > 0
    check_tensors(saved, model, with_moments=with_moments, where=saved["path"])
    if with_moments and isinstance(optimizer, ZeroOptimizer):
        optimizer.prepare_moments(int(saved["optimizer_step"]))
    elif with_moments:
        for p in (p for name, p in model.named_parameters() if model.specs[name].trainable):
            state = optimizer.state.get(p, {})
            moments = [state.get(k) for k in ("exp_avg", "exp_avg_sq")]
            if all(m is not None and m.shape == p.shape and m.dtype == p.dtype for m in moments):
                for m in moments:  # reuse the memory: only the padding rows keep these zeros
                    m.zero_()
            else:
                moments = [torch.zeros_like(p), torch.zeros_like(p)]
            optimizer.state[p] = {"step": torch.tensor(float(saved["optimizer_step"])), "exp_avg": moments[0],
                                  "exp_avg_sq": moments[1]}
    elif optimizer is not None:
        optimizer.state.clear()
    state = training_state(model, optimizer, with_moments=with_moments)
    problem = _verify_chunks(saved, state, read_index(Path(saved["path"])))
    if dist.is_initialized() and dist.get_world_size() > 1:
        # a damaged chunk is seen only by the ranks that read it: agree before DCP's collectives,
        # so that every rank refuses with the same line instead of the others waiting in them
        problems = [None] * dist.get_world_size()
        dist.all_gather_object(problems, problem)
        problem = next((p for p in problems if p), None)
    if problem:
        raise LatticeConfigError(problem)
    with _single_process_ok():
        dcp.load(state, storage_reader=Reader(saved["path"]), planner=LoadPlanner(),
                 no_dist=not dist.is_initialized())
    if isinstance(optimizer, ZeroOptimizer) and optimizer.separate_masters:
        optimizer.params_from_masters()  # the master rows were read: round them into the weights, gather


def _verify_chunks(saved: dict, state: dict[str, Chunk], index: Metadata) -> str | None:
    """Check the CRC-32 of every stored chunk this rank's regions overlap (exactly what DCP
    will read for it); a one-line problem, or None."""
    needed = []
    for key, chunk in state.items():
        for stored in index.state_dict_metadata[key].chunks:
            if overlaps(chunk.offsets, chunk.data.shape, stored.offsets, stored.sizes):
                needed.append(MetadataIndex(key, stored.offsets))
    return _stored_chunks_problem(saved, index, needed)


def _stored_chunks_problem(saved: dict, index: Metadata, items) -> str | None:
    """The first of the stored chunks `items` whose bytes do not match the CRC-32 the save
    recorded, as a one-line problem, or None."""
    path, recorded = Path(saved["path"]), saved["checksums"]
    for name, crc in checksums(path, index.storage_data, items).items():
        if recorded.get(name) != crc:
            what = "has no recorded checksum" if name not in recorded else "does not match its checksum"
            return (f"checkpoint {path}: the stored chunk {name} {what}, so the checkpoint is corrupt; use an intact "
                    f"copy, {START_FRESH}")
    return None


def verify(path: Path) -> str | None:
    """Why the checkpoint in `path` cannot be resumed, in one line, or None when it is whole: its
    marker, files and index (`read`) and the checksum of every stored chunk, all of them (a
    restart chooses a checkpoint before it knows which chunks each rank will read)."""
    try:
        saved = read(path)
        index = read_index(Path(path))
        problem = _stored_chunks_problem(saved, index, list(index.storage_data))
    except LatticeConfigError as e:
        problem = str(e)
    # the problem, without the ways out that a person resuming it would read
    return problem.split("; ")[0] if problem else None


def load_full(saved: dict, keys, *, index: Metadata | None = None) -> dict[str, torch.Tensor]:
    """Full tensors of the given keys, in their saved dtype, in one process (for `lattice
    convert`, which asks for one key at a time and passes the DCP index it read once)."""
    if index is None:
        index = read_index(Path(saved["path"]))
    stored = index.state_dict_metadata
    out = {k: torch.empty(stored[k].size, dtype=stored[k].properties.dtype) for k in keys}
    state = {k: Chunk(t, (0,) * t.dim(), t.shape) for k, t in out.items()}
    problem = _verify_chunks(saved, state, index)
    if problem:
        raise LatticeConfigError(problem)
    with _single_process_ok():
        dcp.load(state, storage_reader=Reader(saved["path"]), planner=LoadPlanner(), no_dist=True)
    return out


class LazyChunk(Chunk):
    """A whole tensor that is read only when DCP writes it (`load()`, not kept), so that
    converting holds one full tensor at a time; its shape and dtype are known before."""

    def __init__(self, load, full_shape: tuple[int, ...], dtype: torch.dtype):
        self.load, self.dtype = load, dtype
        self.full_shape, self.offsets = torch.Size(full_shape), torch.Size((0,) * len(full_shape))

    @property
    def data(self) -> torch.Tensor:
        return self.load()

    def full_nbytes(self) -> int:  # without reading the tensor
        return self.full_shape.numel() * self.dtype.itemsize

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=self.offsets, sizes=self.full_shape)]

    def __create_write_items__(self, fqn: str, obj) -> list[WriteItem]:
        return [WriteItem(index=MetadataIndex(fqn, self.offsets), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=self.__create_chunk_list__()[0],
                                                      properties=TensorProperties(dtype=self.dtype),
                                                      size=self.full_shape))]


def write_full(root: Path, meta: dict, tensors: dict, *, group=None) -> Path:
    """A sharded checkpoint from full tensors, written by one process (for `lattice convert`;
    in a process group, `group` holds this process alone); a value with a `load()`
    (lattice.models.hf.LazyTensor) is read only while it is written."""
    state = {k: LazyChunk(t.load, t.shape, t.dtype) if hasattr(t, "load") else Chunk(t, (0,) * t.dim(), t.shape)
             for k, t in tensors.items()}
    return write(root, meta, state, group=group)
