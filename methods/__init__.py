"""Federated methods, grouped by paper (fedsept/, fedtsp/, vpdr/) over shared bases (families/).

Every module under this package that defines a method registers its class on import (`@register_method`);
`discover()` imports them all, so a new method is one new file: nothing here lists them by hand.
"""

from typing import Any

from raysim.methods.base import (
    METHODS,
    ClientData,
    EnvSpec,
    LocalResult,
    Method,
    NoOptions,
    TrainConfig,
    Upload,
    register_method,
)
from raysim.registry import import_all


def discover() -> None:
    """Import every module of the method packages once, so each registers its methods."""
    import_all(__path__, __name__, recursive=True)


def get_method(name: str) -> type[Method]:
    discover()
    return METHODS.get(name)


def method_names() -> list[str]:
    discover()
    return METHODS.names()


def method_options(cfg: Any, name: str | None = None) -> Any:
    """The resolved Options dataclass of method `name` (default: the run's method) in the RunConfig `cfg`: its
    section built and checked against the method's own Options (a message names the key, `fedsept.rank`)."""
    from raysim.config.load import _build_dataclass

    name = (name or cfg.method).lower()
    cls = get_method(name)
    section = cfg.methods.get(name)
    if isinstance(section, cls.Options):
        return section
    return _build_dataclass(cls.Options, section or {}, prefix=f"{name}.")


__all__ = [
    "METHODS",
    "ClientData",
    "EnvSpec",
    "LocalResult",
    "Method",
    "NoOptions",
    "TrainConfig",
    "Upload",
    "register_method",
    "discover",
    "get_method",
    "method_names",
    "method_options",
]
