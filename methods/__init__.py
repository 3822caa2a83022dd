"""Federated methods, one module each; every module registers its class on import."""

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

from raysim.methods import promptfl  # noqa: F401,E402
from raysim.methods import zeroshot  # noqa: F401,E402
from raysim.methods import fedsept  # noqa: F401,E402
from raysim.methods import fedtsp  # noqa: F401,E402
from raysim.methods import fedproto  # noqa: F401,E402
from raysim.methods import fedtgp  # noqa: F401,E402
from raysim.methods import local  # noqa: F401,E402
from raysim.methods import fedavg  # noqa: F401,E402
from raysim.methods import fedtsp_homo  # noqa: F401,E402


def get_method(name: str) -> type[Method]:
    return METHODS.get(name)


def method_names() -> list[str]:
    return METHODS.names()


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
    "get_method",
    "method_names",
]
