"""The previous layout's front door, kept for its callers: building and checking a run config now lives in
`raysim.build` (where a run is assembled: each part checks its own section there), the documented maxima in
`raysim.config.limits`, the checks that ask no registry in `raysim.config.rules`. This module only re-exports
them; nothing inside raysim imports it (import-linter: it is the one module of raysim.config allowed to import
raysim.build, and it sits in the top layer)."""

from __future__ import annotations

from raysim.build import build_config, config_from_cli, config_from_yaml_text, env_spec, make_method, method_options, validate
from raysim.config.limits import (
    MAX_AUGMENT_VIEWS,
    MAX_BATCH_SIZE,
    MAX_CLIENTS,
    MAX_CTX_INIT_CHARS,
    MAX_LOCAL_EPOCHS,
    MAX_N_CTX,
    MAX_ROUNDS,
)
from raysim.config.rules import OPTIMIZER_STATES

__all__ = [
    "MAX_AUGMENT_VIEWS", "MAX_BATCH_SIZE", "MAX_CLIENTS", "MAX_CTX_INIT_CHARS", "MAX_LOCAL_EPOCHS", "MAX_N_CTX", "MAX_ROUNDS",
    "OPTIMIZER_STATES", "build_config", "config_from_cli", "config_from_yaml_text", "env_spec", "make_method", "method_options",
    "validate",
]
