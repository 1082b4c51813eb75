"""Registry of layouts. A mode module defines a `Mode` subclass and registers it here."""

from __future__ import annotations

import functools

from lattice.modes.base import Block, Mode, Position
from lattice.parallel.context import LatticeConfigError

_REGISTRY: dict[str, type[Mode]] = {}

#: the one-rank layout every other layout is checked against and loads its weights from
REFERENCE_MODE = "serial"


def register(cls: type[Mode]) -> type[Mode]:
    _REGISTRY[cls.name] = cls
    return cls


def unregister(name: str) -> None:
    """Remove the mode registered under `name` (a plugin unloaded); nothing where there is none."""
    _REGISTRY.pop(name, None)


def get_mode(name: str) -> type[Mode]:
    _load_builtin()
    if name not in _REGISTRY:
        raise LatticeConfigError(f"unknown mode {name!r}; available: {', '.join(available_modes())}")
    return _REGISTRY[name]


def available_modes() -> list[str]:
    """Registered mode names, sorted."""
    _load_builtin()
    return sorted(_REGISTRY)


@functools.cache  # the package's files are listed once per process, not at every lookup
def _load_builtin():
    import importlib
    import pkgutil

    # every module of this package but the contract, the layout request and its flags defines a
    # mode; the kernels are a subpackage
    for info in pkgutil.iter_modules(__path__):
        if not info.ispkg and info.name not in ("base", "layout", "options"):
            importlib.import_module(f"{__name__}.{info.name}")


def parallel_modes() -> list[str]:
    """Every registered layout but the reference."""
    return [m for m in available_modes() if m != REFERENCE_MODE]


def peer_mode(peer: str) -> str | None:
    """The registered mode that an outside implementation (e.g. "dtensor") computes the same
    way, as its `Mode.peer` declares; None when no mode does."""
    return next((m for m in available_modes() if get_mode(m).peer == peer), None)


__all__ = ["Block", "Mode", "Position", "REFERENCE_MODE", "register", "get_mode", "available_modes",
           "parallel_modes", "peer_mode"]
