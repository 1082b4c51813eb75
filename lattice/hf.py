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

from dataclasses import dataclass

import torch

from lattice.context import LatticeConfigError
from lattice.sharding import check_state_dict_keys


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

    def export_name(self, name: str) -> str:
        """The key a `tensors` name has in the exported transformers model's state dict."""
        return name

    def check_import(self, cfg) -> None:
        """Refuse a lattice config the HF weights cannot fill."""


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
    m.check_import(cfg)
    sd = m.normalize(state_dict)
    for copy, source in m.tied(cfg):
        held = sd.pop(copy, None)
        if held is not None and source in sd and not torch.equal(held, sd[source]):
            raise LatticeConfigError(f"the config ties {copy} to {source} but {copy} differs from {source}; set "
                                     f"tie_word_embeddings=False (tie_embeddings=False) to import an untied head")
    expected = m.tensors(cfg)
    check_state_dict_keys([t.hf for t in expected], sd, what=f"{m.label} state dict")
    for t in expected:
        if tuple(sd[t.hf].shape) != t.shape:
            raise LatticeConfigError(f"{m.label} {t.hf}: expected shape {list(t.shape)} for this config, got "
                                     f"{list(sd[t.hf].shape)}; the config does not match the weights")
    full = {}
    for t in expected:
        tensor = sd[t.hf].detach()
        full[t.lattice] = tensor.t() if t.transpose else tensor
    return cfg, _lattice_shapes(family, cfg, full)


def _lattice_shapes(family, cfg, full: dict) -> dict:
    """`full` reshaped to the serial lattice model's parameter shapes (fused tensors)."""
    from lattice.layout import plan

    with torch.device("meta"):
        specs = family(cfg, plan("serial")).specs
    return {name: t.reshape(specs[name].full_shape) for name, t in full.items()}


def to_hf_state_dict(family, cfg, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Full tensors under the transformers model's key names, from a lattice full state dict
    (`model.full_state_dict()`, or `model.to_hf_state_dict()` directly). A tensor lattice does
    not have (a bias of a bias-free model) is exported as zeros, which computes the same."""
    m = _mapping(family)
    like = next(iter(full.values()))
    out = {}
    for t in m.tensors(cfg):
        if t.lattice in full:
            tensor = full[t.lattice]
            tensor = tensor.reshape(tuple(reversed(t.shape))).t() if t.transpose else tensor.reshape(t.shape)
        else:
            tensor = torch.zeros(t.shape, dtype=like.dtype, device=like.device)
        out[m.export_name(t.hf)] = tensor
    for copy, source in m.tied(cfg):
        out[m.export_name(copy)] = out[m.export_name(source)]
    return out


def hf_model(family, cfg, full: dict[str, torch.Tensor]):
    """A transformers model (eval mode, the weights' dtype) from a lattice full state dict."""
    m = _mapping(family)
    sd = to_hf_state_dict(family, cfg, full)
    model = getattr(transformers_module(), m.model_class)(m.config_to_hf(cfg)).to(next(iter(full.values())).dtype)
    model.load_state_dict({k: t.cpu() for k, t in sd.items()}, strict=True)
    return model.eval()


def to_hf_model(model):
    """A transformers model with a lattice model's weights (a collective under a parallel layout,
    as model.to_hf_state_dict)."""
    return hf_model(model.family, model.cfg, model.full_state_dict())
