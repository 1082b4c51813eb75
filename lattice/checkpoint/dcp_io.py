"""The plumbing under lattice's sharded checkpoints that talks to torch.distributed.checkpoint
(DCP): planners that hand DCP each rank's chunks (`lattice.checkpoint.sharded.Chunk`: a shard
and its place in the full tensor) as they are, DCP's index read without running pickled code, and
the names and CRC-32s of the chunks as DCP laid them out."""

from __future__ import annotations

import pickle
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

from lattice.checkpoint.files import crc_range

INDEX_FILE = ".metadata"  # DCP's index


def item_name(index: MetadataIndex) -> str:
    """A stored chunk's name in the marker: its key and offsets."""
    return f"{index.fqn}@{','.join(map(str, index.offset))}"


def checksums(path: Path, storage: dict, items) -> dict[str, int]:
    """CRC-32 of each stored chunk's bytes (as DCP laid them out: file, offset, length)."""
    by_file: dict[str, list] = {}
    for index in items:
        by_file.setdefault(storage[index].relative_path, []).append(index)
    out = {}
    for name, indices in by_file.items():
        with open(path / name, "rb") as f:
            for index in indices:
                out[item_name(index)] = crc_range(f, storage[index].offset, storage[index].length)
    return out


class SavePlanner(DefaultSavePlanner):
    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def lookup_object(self, index: MetadataIndex) -> torch.Tensor:
        return self.state_dict[index.fqn].data


class LoadPlanner(DefaultLoadPlanner):
    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False) -> None:
        # The default set-up passes the state through _init_state_dict, which returns None for
        # any value that is not a tensor (it would erase every Chunk); there is nothing on the
        # meta device here to initialise.
        self.original_state_dict = self.state_dict = state_dict
        self.metadata, self.is_coordinator = metadata, is_coordinator

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return self.state_dict[index.fqn].data


# ----------------------------------------------------------------------------- DCP's index, read safely
_INDEX_CLASSES = {
    ("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "MetadataIndex", "ChunkStorageMetadata", "TensorProperties", "TensorStorageMetadata",
        "BytesStorageMetadata", "StorageMeta", "_MEM_FORMAT_ENCODING")
} | {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
     ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
     ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath"), ("collections", "OrderedDict")}


class _IndexUnpickler(pickle.Unpickler):
    """DCP pickles its index (`.metadata`) and reads it back with a plain `pickle.load`, which
    would run any code a forged file names. This unpickler resolves only DCP's own metadata
    classes and torch dtypes, so reading a checkpoint stays as safe as `weights_only=True`."""

    def find_class(self, module: str, name: str):
        if (module, name) in _INDEX_CLASSES or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a checkpoint index")


def read_index(path: Path) -> Metadata:
    with open(path / INDEX_FILE, "rb") as f:
        index = _IndexUnpickler(f).load()
    if not isinstance(index, Metadata):
        raise pickle.UnpicklingError(f"the index holds a {type(index).__name__}, not DCP Metadata")
    return index


class Reader(dcp.FileSystemReader):
    def read_metadata(self, *args, **kwargs) -> Metadata:
        index = read_index(Path(self.path))
        index.storage_meta = index.storage_meta or dcp.metadata.StorageMeta()
        index.storage_meta.load_id = self.load_id
        return index


def overlaps(a_offsets, a_sizes, b_offsets, b_sizes) -> bool:
    """Whether two chunks of one tensor (offsets and sizes per dim) share an element."""
    return all(ao < bo + bs and bo < ao + as_ for ao, as_, bo, bs in zip(a_offsets, a_sizes, b_offsets, b_sizes))
