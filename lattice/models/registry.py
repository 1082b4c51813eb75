"""The registry of model families (as lattice/modes/ is of layouts) and `build_model`."""

from __future__ import annotations

import dataclasses
import functools
import importlib
import pkgutil
from pathlib import Path

import torch
import torch.nn as nn

from lattice.parallel.context import LatticeConfigError, ParallelContext

DEFAULT_ARCH = "gpt2"


_FAMILIES: dict[str, type[nn.Module]] = {}


def register(cls: type[nn.Module]) -> type[nn.Module]:
    """Add a family (a lattice.models.Model subclass) under its `name`; its config must declare
    every field the shared code reads (`ModelConfig.SHARED_FIELDS`)."""
    declared = {f.name for f in dataclasses.fields(cls.config_class)}
    missing = [name for name in cls.config_class.SHARED_FIELDS if name not in declared]
    if missing:
        raise TypeError(f"family {cls.name!r}: {cls.config_class.__name__} does not declare {', '.join(missing)}, "
                        f"which the modes, trainer and CLI read; add them as fields")
    _FAMILIES[cls.name] = cls
    return cls


def unregister(name: str) -> None:
    """Remove the family registered under `name` (a plugin unloaded); nothing where there is none."""
    _FAMILIES.pop(name, None)


@functools.cache  # the package's files are listed once per process, not at every lookup
def _load_builtin() -> None:
    # every module of this package but the shared ones defines and registers one family
    for info in pkgutil.iter_modules([str(Path(__file__).parent)]):
        if info.name not in ("base", "components", "encoder_decoder", "generation", "hf", "registry", "weights"):
            importlib.import_module(f"lattice.models.{info.name}")


def available_archs() -> list[str]:
    """Registered family names, sorted."""
    _load_builtin()
    return sorted(_FAMILIES)


def get_arch(name: str) -> type[nn.Module]:
    _load_builtin()
    if name not in _FAMILIES:
        raise LatticeConfigError(f"unknown architecture {name!r}; available: {', '.join(available_archs())}")
    return _FAMILIES[name]


#: config fields a run sets from elsewhere than a size flag: the tokenizer's vocabulary, the
#: data's classes, the task's special-token ids
NOT_SIZES = ("vocab_size", "num_labels", "pad_token_id", "eos_token_id", "decoder_start_token_id")


def int_list(value) -> list[int]:
    """A list of ints from the command line's "1,3" ("": none) or a config file's [1, 3]."""
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value]
    try:
        return [int(v) for v in str(value).split(",") if v.strip()]
    except ValueError:
        raise LatticeConfigError(f"expected comma-separated integers such as 1,3, got {value!r}") from None


def family_sizes() -> dict[str, tuple[type, tuple[str, ...]]]:
    """Every scalar field (int, float, bool, str) and list of ints of the registered families'
    configs but NOT_SIZES, with its type (int_list for a list) and the families that declare it:
    what the command line offers as size flags (`--n-kv-heads`, `--sliding-window`, `--mlp-only
    1,3`, ...), derived here once."""
    _load_builtin()
    kinds = {"int": int, "float": float, "bool": bool, "str": str, "list[int]": int_list}
    found: dict[str, tuple[type, tuple[str, ...]]] = {}
    for name in sorted(_FAMILIES):
        for f in dataclasses.fields(_FAMILIES[name].config_class):
            kind = kinds.get(str(f.type).split(" |")[0])
            if kind is None or f.name in NOT_SIZES:
                continue
            kind, families = found.get(f.name, (kind, ()))
            found[f.name] = (kind, families + (name,))
    return found


def arch_of_config(cfg) -> type[nn.Module]:
    """The family whose config class `cfg` is."""
    _load_builtin()
    for family in _FAMILIES.values():
        if type(cfg) is family.config_class:
            return family
    raise LatticeConfigError(f"{type(cfg).__name__} is not the config of a registered family "
                             f"({', '.join(available_archs())})")


def build_model(cfg, ctx: ParallelContext, *, dtype: torch.dtype = torch.float32,
                activation_checkpointing: bool = False, selective_checkpointing: bool = False) -> nn.Module:
    """The model `cfg` describes, holding this rank's shards under ctx's layout: the family's
    model, or with pipeline stages in ctx (pp > 1) this rank's stages of it
    (`lattice.parallel.pipeline.PipelineModel`). Every method a training loop or a user calls --
    `model(tokens, targets)`, `forward_backward`, `full_grad_dict`, `load_full_state_dict`,
    `full_state_dict`, `to_hf_state_dict` -- means the same on both."""
    family = arch_of_config(cfg)
    if ctx.pipeline is None:
        return family(cfg, ctx, dtype=dtype, activation_checkpointing=activation_checkpointing,
                      selective_checkpointing=selective_checkpointing)
    from lattice.parallel.pipeline import PipelineModel

    return PipelineModel(family, cfg, ctx, dtype=dtype, activation_checkpointing=activation_checkpointing,
                         selective_checkpointing=selective_checkpointing)
