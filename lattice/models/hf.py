"""HuggingFace import and export, written once for every family.

    model = lattice.from_hf(hf_model, ctx)              # the family from hf_model.config.model_type
    model = lattice.GPT.from_hf(state_dict, ctx, config=GPT2Config(...))
    sd = model.to_hf_state_dict()                        # the transformers model's key names

A family declares how its tensors meet a transformers model's (`HFMapping`, as `Model.hf`):
its model type and class, the config in both directions (refusing variants lattice does not
implement), and every tensor as an `HFTensor` -- the HF name, the lattice name, the HF shape
and whether the HF tensor is the transpose (nn.Linear keeps W[out, in], lattice W[in, out]);
shapes that differ beyond that (GPT-2's fused c_attn (h, 3h) against lattice's (h, 3, h)) are
reshapes. This module knows names, shapes and configs only; the families build the models.

`transformers` is an optional extra (`pip install lattice[hf]`), imported only where a config or
model of it is built. Nothing is ever downloaded.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from copy import copy as shallow_copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lattice.parallel.context import LatticeConfigError
from lattice.parallel.sharding import check_state_dict_keys


def require_hf_packages(what: str) -> None:
    """Refuse, in one line naming the extra to install, HF import or export (`what`) without
    transformers and safetensors: before anything is read or written."""
    import importlib.util

    missing = [name for name in ("transformers", "safetensors") if importlib.util.find_spec(name) is None]
    if missing:
        raise LatticeConfigError(f"{what} needs {' and '.join(missing)}, which are not installed; pip install "
                                 f"'lattice[hf]' (or pip install {' '.join(missing)})")


def transformers_module():
    try:
        import transformers
    except ImportError as e:
        raise ImportError("HuggingFace import and export need the optional package transformers: "
                          "pip install 'lattice[hf]' (or pip install transformers)") from e
    return transformers


@dataclass(frozen=True)
class HFTensor:
    hf: str  # name in the transformers model's state dict (after `HFMapping.normalize`)
    lattice: str  # the serial lattice parameter
    shape: tuple[int, ...]  # its shape in the transformers model
    transpose: bool = False  # the HF tensor is the (2-d) transpose of lattice's


class HFMapping:
    """How a family's weights and config meet a transformers model's; each family subclasses it."""

    #: transformers' config.model_type of the models this family imports
    model_type: str = ""
    #: the transformers class exported to (and loaded from a directory)
    model_class: str = ""
    #: the family's description in messages ("a GPT-2")
    label: str = ""

    def config_from_hf(self, hf_config, given=None):
        """The lattice config of a transformers config; `given` (a lattice config or None) may
        override what does not change the weights' meaning (dropout). Refuses variants lattice
        computes differently, in one line."""
        raise NotImplementedError

    @staticmethod
    def with_given(cfg, given):
        """`cfg` (read from a transformers config) with the dropout rate of `given`, a lattice
        config passed beside the model (None: `cfg` as it is). Every other field must agree: only
        the dropout rate leaves the weights' meaning alone."""
        if given is None:
            return cfg
        cfg = dataclasses.replace(cfg, dropout=given.dropout)
        diff = {f.name: (getattr(given, f.name), getattr(cfg, f.name)) for f in dataclasses.fields(cfg)
                if getattr(given, f.name) != getattr(cfg, f.name)}
        if diff:
            raise LatticeConfigError(f"config disagrees with the HF model's config on {diff} (given, model); "
                                     f"only dropout may differ: leave config=None or fix those fields")
        return cfg

    def config_to_hf(self, cfg):
        """The transformers config computing the same function as `cfg`."""
        raise NotImplementedError

    def tensors(self, cfg) -> list[HFTensor]:
        """Every tensor of the transformers model for `cfg`, tied copies excluded."""
        raise NotImplementedError

    def tied(self, cfg) -> list[tuple[str, str]]:
        """(HF name, HF name it must equal) of tensors the transformers model holds as a tied
        copy (an LM head tied to the token table); export writes the copy."""
        return []

    def normalize(self, state_dict: dict) -> dict:
        """A transformers state dict with the keys `tensors` uses (prefixes, buffers)."""
        return dict(state_dict)

    def assembled(self, cfg, keys) -> dict:
        """Tensors of `tensors` that a source among `keys` holds in another layout (transformers 4's
        per-expert MoE weights): {HF name: (its source keys, their shapes, a function of those
        tensors giving it)}; none by default."""
        return {}

    def export_name(self, name: str) -> str:
        """The key a `tensors` name has in the exported transformers model's state dict."""
        return name

    def check_import(self, cfg) -> None:
        """Refuse a lattice config the HF weights cannot fill."""

    def class_name(self, cfg) -> str:
        """The transformers class of `cfg`'s model (a family whose heads differ by config says)."""
        return self.model_class

    def exported_classes(self) -> tuple[str, ...]:
        """Every transformers class `class_name` may name."""
        return (self.model_class,)


def _mapping(family):
    if family.hf is None:
        raise LatticeConfigError(f"family {family.name!r} has no HuggingFace mapping")
    return family.hf


def read_hf(family, model_or_state_dict, *, config=None):
    """(lattice config, full state dict under lattice names and shapes) of a transformers model
    of `family`, or of a state dict together with `config` (a transformers config or the
    family's lattice config)."""
    m = _mapping(family)
    if isinstance(model_or_state_dict, torch.nn.Module):
        hf_config = getattr(model_or_state_dict, "config", None)
        if hf_config is None or not hasattr(hf_config, "model_type"):
            raise LatticeConfigError(f"{type(model_or_state_dict).__name__} is not a HuggingFace model; pass a "
                                     f"{m.model_class}, or a state dict with config=")
        if config is not None and not isinstance(config, family.config_class):
            raise LatticeConfigError(f"with a HF model, config may only be a {family.config_class.__name__} (to change "
                                     f"dropout); leave it None to use the model's own config")
        if not getattr(hf_config, "architectures", None):  # a model built from a config: its class says
            hf_config = shallow_copy(hf_config)
            hf_config.architectures = [type(model_or_state_dict).__name__]
        cfg, state_dict = m.config_from_hf(hf_config, given=config), model_or_state_dict.state_dict()
    elif isinstance(model_or_state_dict, dict):
        if config is None:
            raise LatticeConfigError(f"{m.label} state dict needs config= (a transformers config or "
                                     f"{family.config_class.__name__}): the number of heads cannot be inferred from "
                                     f"the tensor shapes")
        cfg = config if isinstance(config, family.config_class) else m.config_from_hf(config)
        state_dict = model_or_state_dict
    else:
        raise LatticeConfigError(f"cannot import a {type(model_or_state_dict).__name__}; pass a {m.model_class} or a "
                                 f"state dict with config=")
    plan = import_plan(family, cfg, {k: tuple(t.shape) for k, t in state_dict.items()},
                       lambda a, b: torch.equal(state_dict[a], state_dict[b]))
    return cfg, {item.lattice: item.read(lambda k: state_dict[k].detach()) for item in plan}


@dataclass(frozen=True)
class ImportItem:
    """One lattice parameter of an import: which source tensor fills it and how."""

    lattice: str  # the serial lattice parameter
    key: str  # the source's key (state dict or safetensors file)
    transpose: bool
    shape: tuple[int, ...]  # the lattice parameter's shape
    parts: tuple[str, ...] = ()  # the source's keys of a tensor assembled from several (`HFMapping.assembled`)
    assemble: Any = None  # and how

    def convert(self, tensor: torch.Tensor) -> torch.Tensor:
        return (tensor.t() if self.transpose else tensor).reshape(self.shape)

    def read(self, get) -> torch.Tensor:
        """The lattice parameter from the source (`get(key)`: one of its tensors)."""
        if self.parts:
            return self.assemble([get(k) for k in self.parts]).reshape(self.shape)
        return self.convert(get(self.key))


def import_plan(family, cfg, shapes: dict[str, tuple[int, ...]], equal) -> list[ImportItem]:
    """Check a transformers checkpoint against `cfg` from its keys and shapes alone (`shapes`:
    key -> shape; `equal(key_a, key_b)` compares two of its tensors, for tied copies) and say
    which tensor fills each lattice parameter. Nothing is loaded here: a directory import reads
    the tensors one at a time afterwards."""
    m = _mapping(family)
    m.check_import(cfg)
    keys = m.normalize({k: k for k in shapes})  # the mapping's names -> the source's keys
    for copy, source in m.tied(cfg):
        held = keys.pop(copy, None)
        if held is not None and source in keys and not equal(held, keys[source]):
            raise LatticeConfigError(f"the config ties {copy} to {source} but {copy} differs from {source}; set "
                                     f"tie_word_embeddings=False (tie_embeddings=False) to import an untied head")
    expected = m.tensors(cfg)
    assembled = m.assembled(cfg, keys)
    sources = [(name, shape) for t in expected
               for name, shape in (zip(*assembled[t.hf][:2]) if t.hf in assembled else ((t.hf, t.shape),))]
    check_state_dict_keys([name for name, _ in sources], keys, what=f"{m.label} state dict")
    for name, shape in sources:
        if tuple(shapes[keys[name]]) != tuple(shape):
            raise LatticeConfigError(f"{m.label} {name}: expected shape {list(shape)} for this config, got "
                                     f"{list(shapes[keys[name]])}; the config does not match the weights")
    lattice_shapes = _lattice_shapes(family, cfg)
    items = []
    for t in expected:
        if t.hf in assembled:
            parts, _, combine = assembled[t.hf]
            items.append(ImportItem(t.lattice, keys[parts[0]], False, lattice_shapes[t.lattice],
                                    tuple(keys[k] for k in parts), combine))
        else:
            items.append(ImportItem(t.lattice, keys[t.hf], t.transpose, lattice_shapes[t.lattice]))
    return items


def _lattice_shapes(family, cfg) -> dict[str, tuple[int, ...]]:
    """The serial lattice model's parameter shapes (fused tensors), from a meta build."""
    from lattice.modes.layout import context

    serial = context("serial")
    with torch.device("meta"):
        specs = family(cfg, serial).specs
    return {name: spec.full_shape for name, spec in specs.items()}


def to_hf_state_dict(family, cfg, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Full tensors under the transformers model's key names, from a lattice full state dict
    (`model.full_state_dict()`, or `model.to_hf_state_dict()` directly). A tensor lattice does
    not have (a bias of a bias-free model) is exported as zeros, which computes the same."""
    m = _mapping(family)
    like = next(iter(full.values()))
    out = {m.export_name(t.hf): _exported(t, full, like) for t in m.tensors(cfg)}
    for copy, source in m.tied(cfg):
        out[m.export_name(copy)] = out[m.export_name(source)]
    return out


def _exported(t: HFTensor, full: dict, like) -> torch.Tensor:
    """The HF tensor `t` from lattice full tensors (a LazyTensor is loaded now); zeros where
    lattice has none (a bias of a bias-free model), which compute the same."""
    source = full.get(t.lattice)
    if source is None:
        return torch.zeros(t.shape, dtype=like.dtype, device=getattr(like, "device", "cpu"))
    tensor = source.load() if isinstance(source, LazyTensor) else source
    return tensor.reshape(tuple(reversed(t.shape))).t() if t.transpose else tensor.reshape(t.shape)


def hf_model(family, cfg, full: dict[str, torch.Tensor]):
    """A transformers model (eval mode, the weights' dtype) from a lattice full state dict."""
    m = _mapping(family)
    sd = to_hf_state_dict(family, cfg, full)
    model = getattr(transformers_module(), m.class_name(cfg))(m.config_to_hf(cfg)).to(next(iter(full.values())).dtype)
    model.load_state_dict({k: t.cpu() for k, t in sd.items()}, strict=True)
    return model.eval()


def to_hf_model(model):
    """A transformers model with a lattice model's weights (a collective under a parallel layout,
    as model.to_hf_state_dict)."""
    return hf_model(model.family, model.cfg, model.full_state_dict())


# ----------------------------------------------------------------------------- directories, a tensor at a time
_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
WEIGHTS, INDEX = "model.safetensors", "model.safetensors.index.json"


class LazyTensor:
    """A full tensor read only when `load()` is called (and not kept), with its shape and dtype
    known before: converting a directory holds one full tensor at a time."""

    def __init__(self, load, shape: tuple[int, ...], dtype: torch.dtype):
        self.load, self.shape, self.dtype = load, torch.Size(shape), dtype

    def numel(self) -> int:
        return math.prod(self.shape)


def read_hf_config(src: Path):
    """The transformers config in a local directory's config.json (nothing downloaded)."""
    if not (src / "config.json").is_file():
        raise LatticeConfigError(f"{src} is not a HuggingFace model directory (no config.json); pass the directory "
                                 f"that save_pretrained wrote")
    try:
        return transformers_module().AutoConfig.from_pretrained(src, local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        raise LatticeConfigError(f"{src}/config.json cannot be read as a transformers config "
                                 f"({str(e).splitlines()[0][:160]}); pass an intact HuggingFace model directory") from None


def _safetensors_files(src: Path) -> dict[str, Path]:
    """Every tensor's key -> the safetensors file holding it (a sharded directory's index, or
    the one model.safetensors)."""
    from safetensors import SafetensorError, safe_open

    if (src / INDEX).is_file():
        try:
            weight_map = json.loads((src / INDEX).read_text())["weight_map"]
        except (OSError, ValueError, KeyError) as e:
            raise LatticeConfigError(f"{src / INDEX} is not a safetensors index ({type(e).__name__}); pass an intact "
                                     f"HuggingFace model directory") from None
        files = {k: src / name for k, name in weight_map.items()}
        absent = sorted({str(p.name) for p in files.values() if not p.is_file()})
        if absent:
            raise LatticeConfigError(f"{src} lacks {len(absent)} weight file(s) its index names (first: {absent[0]}); "
                                     f"copy the whole directory")
        return files
    if (src / WEIGHTS).is_file():
        try:
            with safe_open(src / WEIGHTS, "pt") as f:
                return {k: src / WEIGHTS for k in f.keys()}
        except (SafetensorError, OSError) as e:
            raise LatticeConfigError(f"{src / WEIGHTS} cannot be read as safetensors ({str(e)[:160]}); it is truncated "
                                     f"or damaged: copy the model directory again") from None
    raise LatticeConfigError(f"{src} holds no {WEIGHTS} or {INDEX}; lattice reads safetensors only (re-save the model "
                             f"with save_pretrained(..., safe_serialization=True))")


def _read_one(path: Path, key: str) -> torch.Tensor:
    from safetensors import safe_open

    with safe_open(path, "pt") as f:
        return f.get_tensor(key)


def read_hf_dir(family, src: Path, hf_config) -> tuple[Any, dict[str, LazyTensor]]:
    """(lattice config, {lattice name: LazyTensor}) of a local HF directory's safetensors,
    checked against its config from the files' headers alone; each tensor is read when loaded."""
    from safetensors import SafetensorError, safe_open

    cfg = _mapping(family).config_from_hf(hf_config)
    files = _safetensors_files(src)
    shapes, dtypes = {}, {}
    try:
        for path in sorted(set(files.values())):
            with safe_open(path, "pt") as f:
                for k in f.keys():
                    piece = f.get_slice(k)
                    shapes[k], dtypes[k] = tuple(piece.get_shape()), _SAFETENSORS_DTYPES.get(piece.get_dtype())
    except (SafetensorError, OSError) as e:
        raise LatticeConfigError(f"{src}: a weight file cannot be read ({str(e)[:160]}); it is truncated or damaged: "
                                 f"copy the model directory again") from None
    plan = import_plan(family, cfg, shapes, lambda a, b: torch.equal(_read_one(files[a], a), _read_one(files[b], b)))
    out = {}
    for item in plan:
        if dtypes[item.key] is None:
            raise LatticeConfigError(f"{src}: {item.key} is stored as a dtype lattice does not train in; convert it to "
                                     f"float32 or bfloat16")
        out[item.lattice] = LazyTensor(lambda item=item: item.read(lambda k: _read_one(files[k], k)),
                                       item.shape, dtypes[item.key])
    return cfg, out


def write_hf_dir(family, cfg, tensors: dict, dst: Path, *, max_shard_bytes: int = 2 << 30) -> list[Path]:
    """A directory `from_pretrained` loads (`dst`: new or empty; the caller moves it into place):
    config.json and safetensors files of at most
    `max_shard_bytes` each (with model.safetensors.index.json when there are several), written
    from lattice full tensors (tensors or LazyTensors: each is loaded, converted and written
    before the next shard fills, so the peak is one shard plus one full tensor)."""
    from safetensors.torch import save_file

    m = _mapping(family)
    dst.mkdir(parents=True, exist_ok=True)
    m.config_to_hf(cfg).save_pretrained(dst)
    like = next(iter(tensors.values()))
    written, shard, shard_bytes, weight_map, total = [], {}, 0, {}, 0

    def flush():
        nonlocal shard, shard_bytes
        path = dst / f".shard-{len(written):05d}.safetensors"
        save_file(shard, path, metadata={"format": "pt"})
        written.append((path, list(shard)))
        shard, shard_bytes = {}, 0

    for t in m.tensors(cfg):
        tensor = _exported(t, tensors, like).detach().cpu().contiguous()
        size = tensor.numel() * tensor.element_size()
        if shard and shard_bytes + size > max_shard_bytes:
            flush()
        shard[m.export_name(t.hf)] = tensor
        shard_bytes, total = shard_bytes + size, total + size
    flush()
    paths = []
    for i, (path, keys) in enumerate(written):
        name = WEIGHTS if len(written) == 1 else f"model-{i + 1:05d}-of-{len(written):05d}.safetensors"
        os.replace(path, dst / name)
        weight_map.update({k: name for k in keys})
        paths.append(dst / name)
    if len(written) > 1:
        (dst / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return paths
