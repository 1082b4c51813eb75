"""Registry of layouts. A mode module defines a `Mode` subclass and registers it here."""

from __future__ import annotations

from lattice.context import LatticeConfigError
from lattice.modes.base import Block, Mode, Position

_REGISTRY: dict[str, type[Mode]] = {}


def register(cls: type[Mode]) -> type[Mode]:
    _REGISTRY[cls.name] = cls
    return cls


def get_mode(name: str) -> type[Mode]:
    _load_builtin()
    if name not in _REGISTRY:
        raise LatticeConfigError(f"unknown mode {name!r}; available: {', '.join(available_modes())}")
    return _REGISTRY[name]


def available_modes() -> list[str]:
    _load_builtin()
    return list(_REGISTRY)


def _load_builtin():
    import importlib
    import pkgutil

    for info in pkgutil.iter_modules(__path__):
        if info.name not in ("base",):
            importlib.import_module(f"{__name__}.{info.name}")


__all__ = ["Block", "Mode", "Position", "register", "get_mode", "available_modes"]
