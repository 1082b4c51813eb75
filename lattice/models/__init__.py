"""Registry of model families, as lattice/modes/ is of layouts: one module per architecture,
written once against the mode interface (see lattice.models.base for what a family declares).

    lattice.available_archs()                 # ["gpt2", ...]
    model = lattice.build_model(cfg, ctx)     # the family of cfg's config class; stages with pp > 1
    model = lattice.from_hf(hf_model, ctx)    # the family of hf_model.config.model_type
"""

from __future__ import annotations

from pathlib import Path

from lattice.models.base import DecoderLM, Model, ModelConfig, Parts
from lattice.models.registry import (DEFAULT_ARCH, arch_of_config, available_archs, build_model, family_sizes, get_arch,
                                     register)
from lattice.parallel.context import LatticeConfigError


def arch_of_hf(model_type: str) -> type[Model]:
    """The family importing transformers models of `model_type`."""
    for name in available_archs():
        family = get_arch(name)
        if family.hf is not None and family.hf.model_type == model_type:
            return family
    known = sorted(get_arch(n).hf.model_type for n in available_archs() if get_arch(n).hf is not None)
    raise LatticeConfigError(f"no lattice family imports HuggingFace model_type {model_type!r}; lattice imports "
                             f"{', '.join(known)}")


def from_hf(model_or_dir, ctx, *, dtype=None):
    """The lattice model (this rank's shards under ctx's layout; its pipeline stages with pp > 1)
    of a transformers model, or of a local directory that `save_pretrained` wrote, in the family
    its config's model_type names. No communication: every rank passes the same weights."""
    import torch

    if isinstance(model_or_dir, (str, Path)):
        model_or_dir = load_hf_dir(Path(model_or_dir))
    if not isinstance(model_or_dir, torch.nn.Module) or not hasattr(getattr(model_or_dir, "config", None), "model_type"):
        raise LatticeConfigError(f"{type(model_or_dir).__name__} is not a HuggingFace model; pass a transformers model "
                                 f"or the directory save_pretrained wrote")
    return arch_of_hf(model_or_dir.config.model_type).from_hf(model_or_dir, ctx, dtype=dtype)


def load_hf_dir(src: Path):
    """The transformers model saved in a local directory (its config.json names the family)."""
    import json

    from lattice.models import hf

    config = src / "config.json"
    if not config.is_file():
        raise LatticeConfigError(f"{src} is not a HuggingFace model directory (no config.json); pass the directory "
                                 f"that save_pretrained wrote")
    try:
        fields = json.loads(config.read_text())
        model_type = fields.get("model_type")
    except (OSError, ValueError) as e:
        raise LatticeConfigError(f"{config} cannot be read as JSON ({type(e).__name__}); pass an intact HuggingFace "
                                 f"model directory") from None
    family = arch_of_hf(model_type)
    try:
        # the class that saved it (a family may export several: BERT's masked LM and classifier)
        saved = [a for a in fields.get("architectures") or () if a in family.hf.exported_classes()]
        cls = getattr(hf.transformers_module(), saved[0] if saved else family.hf.model_class)
        return cls.from_pretrained(src, local_files_only=True)
    except (OSError, ValueError) as e:
        raise LatticeConfigError(f"{src} cannot be loaded as {family.hf.label} ({str(e).splitlines()[0][:160]})") from None


__all__ = ["DEFAULT_ARCH", "DecoderLM", "Model", "ModelConfig", "Parts", "arch_of_config", "arch_of_hf", "available_archs",
           "build_model", "family_sizes", "from_hf", "get_arch", "load_hf_dir", "register"]
