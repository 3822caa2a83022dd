"""Federated methods, one module each; every module registers its class on import."""

from raysim.methods import (
    alignfed,  # noqa: F401,E402
    dpfpl,  # noqa: F401,E402
    fedavg,  # noqa: F401,E402
    fedbabu,  # noqa: F401,E402
    feddistill,  # noqa: F401,E402
    fedetf,  # noqa: F401,E402
    fedfa,  # noqa: F401,E402
    fedgen,  # noqa: F401,E402
    fedgh,  # noqa: F401,E402
    fedkd,  # noqa: F401,E402
    fedmrl,  # noqa: F401,E402
    fedotp,  # noqa: F401,E402
    fedpac,  # noqa: F401,E402
    fedpcl,  # noqa: F401,E402
    fedpgp,  # noqa: F401,E402
    fedpha,  # noqa: F401,E402
    fedproto,  # noqa: F401,E402
    fedsept,  # noqa: F401,E402
    fedtgp,  # noqa: F401,E402
    fedtsp,  # noqa: F401,E402
    fedtsp_homo,  # noqa: F401,E402
    fml,  # noqa: F401,E402
    lgfedavg,  # noqa: F401,E402
    local,  # noqa: F401,E402
    pfedmoap,  # noqa: F401,E402
    promptfl,  # noqa: F401,E402
    vpdr_fedpcl,  # noqa: F401,E402
    vpdr_fedplvm,  # noqa: F401,E402
    vpdr_fedproto,  # noqa: F401,E402
    vpdr_fedtgp,  # noqa: F401,E402
    vpdr_fpl,  # noqa: F401,E402
    vpdr_mpft,  # noqa: F401,E402
    zeroshot,  # noqa: F401,E402
)
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
