"""HuggingFace GPT-2 import and export.

    model = lattice.GPT.from_hf(GPT2LMHeadModel(...), ctx)      # or a state dict with config=
    sd = model.to_hf_state_dict()                                # GPT2LMHeadModel key names

This module knows names, shapes and configs only; `lattice.model` builds the models.

GPT-2 and lattice store the same tensors: both keep linear weights as W[in, out] (HF's Conv1D
orientation), so only names change, except the fused qkv projection, which lattice keeps as
(h, 3, h) with bias (3, h) where HF has c_attn (h, 3h) with bias (3h,); both put q, k, v in that
order with heads contiguous, so a reshape is exact.

Rules for GPT-2 variants lattice does not implement (refused with LatticeConfigError):
- activation other than the tanh gelu ("gelu_new", "gelu_pytorch_tanh"); n_inner other than
  4 * n_embd; scale_attn_weights=False; scale_attn_by_inverse_layer_idx; reorder_and_upcast_attn;
  add_cross_attention.
- Dropout: lattice has one rate for embeddings, attention and residuals. Equal resid/embd/attn
  pdrop map to it; different ones are refused unless `dropout=` is given to `config_from_hf`
  (or a GPTConfig to `from_hf`), which then replaces all three.
- tie_word_embeddings maps to tie_embeddings; a tied config whose lm_head.weight differs from
  wte.weight is refused (the weights are untied: set tie_word_embeddings=False).
- Export of a bias-free lattice model writes zero biases (GPT-2 always has them; zeros compute
  the same function), so it re-imports as a bias=True model.

`transformers` is an optional extra (`pip install lattice[hf]`), imported only where a
GPT2Config or GPT2LMHeadModel is built. Nothing is ever downloaded.
"""

from __future__ import annotations

import dataclasses

import torch

from lattice.config import GPTConfig
from lattice.context import LatticeConfigError
from lattice.sharding import check_state_dict_keys

_TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh")
_BUFFERS = (".attn.bias", ".attn.masked_bias")  # causal-mask buffers of older GPT-2 checkpoints
_RENAMES = ((".attn.c_attn.", ".attn.qkv."), (".attn.c_proj.", ".attn.proj."),
            (".mlp.c_fc.", ".mlp.fc."), (".mlp.c_proj.", ".mlp.proj."))


def _transformers():
    try:
        import transformers
    except ImportError as e:
        raise ImportError("HuggingFace export needs the optional package transformers: "
                          "pip install 'lattice[hf]' (or pip install transformers)") from e
    return transformers


# ---------------------------------------------------------------------- configs
def config_from_hf(hf_config, *, dropout: float | None = None) -> GPTConfig:
    """The GPTConfig of a GPT2Config; refuses the GPT-2 variants lattice does not implement."""
    c = hf_config
    if getattr(c, "model_type", None) != "gpt2":
        raise LatticeConfigError(f"expected a GPT-2 config (model_type 'gpt2'), got model_type "
                                 f"{getattr(c, 'model_type', None)!r}; only GPT-2 can be imported")
    if c.activation_function not in _TANH_GELUS:
        raise LatticeConfigError(f"activation_function={c.activation_function!r} is not implemented; "
                                 f"lattice uses the tanh gelu ({' or '.join(_TANH_GELUS)})")
    if c.n_inner not in (None, 4 * c.n_embd):
        raise LatticeConfigError(f"n_inner={c.n_inner} is not implemented; lattice's MLP width is "
                                 f"4 * n_embd = {4 * c.n_embd} (set n_inner=None)")
    for flag, want in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                       ("reorder_and_upcast_attn", False), ("add_cross_attention", False)):
        if bool(getattr(c, flag, want)) != want:
            raise LatticeConfigError(f"{flag}={getattr(c, flag)} is not implemented; lattice needs {flag}={want}")
    rates = {"resid_pdrop": c.resid_pdrop, "embd_pdrop": c.embd_pdrop, "attn_pdrop": c.attn_pdrop}
    if dropout is None:
        if len(set(rates.values())) != 1:
            raise LatticeConfigError(f"lattice has one dropout rate but the GPT-2 config has {rates}; "
                                     f"pass dropout=p to config_from_hf (or a GPTConfig to from_hf)")
        dropout = c.resid_pdrop
    return GPTConfig(vocab_size=c.vocab_size, seq_len=c.n_positions, d_model=c.n_embd, n_heads=c.n_head,
                     n_layers=c.n_layer, dropout=float(dropout), bias=True,
                     tie_embeddings=bool(c.tie_word_embeddings), layer_norm_eps=c.layer_norm_epsilon)


def config_to_hf(cfg: GPTConfig):
    """The transformers.GPT2Config computing the same function as `cfg`."""
    special = 50256 if cfg.vocab_size > 50256 else None  # GPT-2's <|endoftext|> only if it exists
    return _transformers().GPT2Config(
        vocab_size=cfg.vocab_size, n_positions=cfg.seq_len, n_embd=cfg.d_model, n_head=cfg.n_heads,
        n_layer=cfg.n_layers, n_inner=None, activation_function="gelu_new",
        resid_pdrop=cfg.dropout, embd_pdrop=cfg.dropout, attn_pdrop=cfg.dropout,
        layer_norm_epsilon=cfg.layer_norm_eps, tie_word_embeddings=cfg.tie_embeddings,
        bos_token_id=special, eos_token_id=special)


def _check_same_architecture(given: GPTConfig, source: GPTConfig):
    """A GPTConfig passed beside a model may change only the dropout rate."""
    diff = {f.name: (getattr(given, f.name), getattr(source, f.name)) for f in dataclasses.fields(GPTConfig)
            if f.name != "dropout" and getattr(given, f.name) != getattr(source, f.name)}
    if diff:
        raise LatticeConfigError(f"config disagrees with the HF model's config on {diff} (given, model); "
                                 f"only dropout may differ: leave config=None or fix those fields")


# ---------------------------------------------------------------------- names and shapes
def _hf_shapes(cfg: GPTConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter of a GPT2LMHeadModel for `cfg` (without the `transformer.` prefix)."""
    h, v = cfg.d_model, cfg.vocab_size
    out = {"wte.weight": (v, h), "wpe.weight": (cfg.seq_len, h)}
    per_layer = {"ln_1.weight": (h,), "ln_1.bias": (h,), "attn.c_attn.weight": (h, 3 * h),
                 "attn.c_attn.bias": (3 * h,), "attn.c_proj.weight": (h, h), "attn.c_proj.bias": (h,),
                 "ln_2.weight": (h,), "ln_2.bias": (h,), "mlp.c_fc.weight": (h, 4 * h),
                 "mlp.c_fc.bias": (4 * h,), "mlp.c_proj.weight": (4 * h, h), "mlp.c_proj.bias": (h,)}
    for i in range(cfg.n_layers):
        out.update({f"h.{i}.{k}": s for k, s in per_layer.items()})
    out.update({"ln_f.weight": (h,), "ln_f.bias": (h,), "lm_head.weight": (v, h)})
    return out


def _lattice_name(hf_name: str) -> str:
    if hf_name in ("wte.weight", "wpe.weight"):
        return "embed." + hf_name.split(".")[0]
    if hf_name == "lm_head.weight":
        return "head.weight"
    if hf_name.startswith("h."):
        name = "blocks." + hf_name[2:]
        for old, new in _RENAMES:
            name = name.replace(old, new)
        return name
    return hf_name


def _strip(state_dict: dict) -> dict[str, torch.Tensor]:
    """Keys as GPT2Model names them (no `transformer.` prefix), without the mask buffers."""
    out = {}
    for k, t in state_dict.items():
        k = k.removeprefix("transformer.")
        if not k.endswith(_BUFFERS):
            out[k] = t
    return out


# ---------------------------------------------------------------------- import / export
def _lattice_shape(name: str, hf_shape: tuple[int, ...]) -> tuple[int, ...]:
    """lattice keeps the fused qkv as (h, 3, h) / (3, h) where HF has (h, 3h) / (3h,)."""
    if ".attn.qkv." not in name:
        return hf_shape
    return hf_shape[:-1] + (3, hf_shape[-1] // 3)


def read_hf(model_or_state_dict, *, config=None) -> tuple[GPTConfig, dict[str, torch.Tensor]]:
    """The GPTConfig and full state dict (lattice names and shapes) of a GPT-2.

    Accepts a GPT2LMHeadModel or GPT2Model, or a state dict (keys with or without the
    `transformer.` prefix; lm_head.weight may be absent when tied) together with `config` (a
    GPT2Config or GPTConfig). `lattice.GPT.from_hf` builds a model from it.
    """
    if isinstance(model_or_state_dict, torch.nn.Module):
        if not hasattr(model_or_state_dict, "config"):
            raise LatticeConfigError(f"{type(model_or_state_dict).__name__} is not a HuggingFace model; "
                                     f"pass a GPT2LMHeadModel, a GPT2Model or a state dict with config=")
        source = config_from_hf(model_or_state_dict.config,
                                dropout=config.dropout if isinstance(config, GPTConfig) else None)
        if isinstance(config, GPTConfig):
            _check_same_architecture(config, source)
        elif config is not None:
            raise LatticeConfigError("with a HF model, config may only be a GPTConfig (to change dropout); "
                                     "leave it None to use the model's own config")
        cfg, state_dict = config or source, model_or_state_dict.state_dict()
    elif isinstance(model_or_state_dict, dict):
        if config is None:
            raise LatticeConfigError("a GPT-2 state dict needs config= (a GPT2Config or GPTConfig): the number "
                                     "of heads cannot be inferred from the tensor shapes")
        cfg, state_dict = (config if isinstance(config, GPTConfig) else config_from_hf(config)), model_or_state_dict
    else:
        raise LatticeConfigError(f"cannot import a {type(model_or_state_dict).__name__}; pass a GPT2LMHeadModel, "
                                 f"a GPT2Model or a state dict with config=")
    if not cfg.bias:
        raise LatticeConfigError("GPT-2 weights always have biases; import them into a GPTConfig with bias=True")

    sd = _strip(state_dict)
    shapes = _hf_shapes(cfg)
    if cfg.tie_embeddings:
        shapes.pop("lm_head.weight")
        head = sd.pop("lm_head.weight", None)
        if head is not None and "wte.weight" in sd and not torch.equal(head, sd["wte.weight"]):
            raise LatticeConfigError("the config ties lm_head to wte but lm_head.weight differs from wte.weight; "
                                     "set tie_word_embeddings=False (tie_embeddings=False) to import an untied head")
    check_state_dict_keys(shapes, sd, what="GPT-2 state dict")
    for k, shape in shapes.items():
        if tuple(sd[k].shape) != shape:
            raise LatticeConfigError(f"GPT-2 {k}: expected shape {list(shape)} for this config, got "
                                     f"{list(sd[k].shape)}; the config does not match the weights")
    full = {}
    for k, shape in shapes.items():
        name = _lattice_name(k)
        full[name] = sd[k].detach().reshape(_lattice_shape(name, shape))
    return cfg, full


def to_hf_state_dict(cfg: GPTConfig, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Full tensors under GPT2LMHeadModel's key names (lm_head.weight is wte when tied), from a
    lattice full state dict (`model.full_state_dict()`, or `model.to_hf_state_dict()` directly)."""
    out = {}
    wte = full["embed.wte"]
    for k, shape in _hf_shapes(cfg).items():
        name = _lattice_name(k)
        if name == "head.weight" and cfg.tie_embeddings:
            t = wte
        elif name in full:
            t = full[name].reshape(shape)
        else:  # a bias of a bias-free model
            t = torch.zeros(shape, dtype=wte.dtype, device=wte.device)
        out[k if k == "lm_head.weight" else "transformer." + k] = t
    return out


def to_hf_model(model):
    """A transformers GPT2LMHeadModel (eval mode, the model's dtype) with a lattice.GPT's
    weights. A collective under a parallel layout, as model.to_hf_state_dict."""
    return hf_model(model.cfg, model.full_state_dict())


def hf_model(cfg: GPTConfig, full: dict[str, torch.Tensor]):
    """A transformers GPT2LMHeadModel (eval mode, the weights' dtype) from a lattice full state
    dict."""
    sd = to_hf_state_dict(cfg, full)
    hf = _transformers().GPT2LMHeadModel(config_to_hf(cfg)).to(full["embed.wte"].dtype)
    hf.load_state_dict({k: t.cpu() for k, t in sd.items()}, strict=True)
    return hf.eval()
