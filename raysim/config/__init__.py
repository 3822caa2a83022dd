"""Typed run configuration: YAML files plus `key=value` overrides, validated at the edge.

A run is described by one `RunConfig`. Nested sections are dataclasses too: `dp` (local differential
privacy, with its `dp.vpp` subsection) and one section per method, named after the method (`fedsept.rank=8`),
whose fields are the method's own `Options` dataclass. Every key is checked; unknown keys and out-of-range
values raise `ConfigError` with a message that says what to do.

A leaf: it imports nothing of raysim but the errors (and safeio, to read a config file). Low to high: `schema`
(the section dataclasses) and `limits` (the documented maxima), `load` (YAML, `key=value`, dotted keys, the
flat-key shim) and `rules` (the checks that ask no registry). The checks that ask a registry live with the part
that owns it, called from `raysim.build` (`build_config`, `validate`, `method_options`, `make_method`), where a
run is assembled; `checks` re-exports those for the callers of the previous layout. This package re-exports
`schema` and `load` only.
"""

from raysim.config.load import (
    RENAMED,
    deep_merge,
    flatten,
    get_dotted,
    load_config_file,
    load_yaml,
    merge_config,
    move_flat_key,
    move_flat_keys,
    parse_overrides,
    parse_user_overrides,
    parse_yaml,
    set_dotted,
    unflatten,
)
from raysim.config.schema import (
    BACKEND_NAMES,
    KEEP_CLIENT_STATES,
    ON_CLIENT_ERROR,
    PLACEMENTS,
    RESUMABLE,
    SECTIONS,
    DataConfig,
    DPConfig,
    EvalConfig,
    ExecutionConfig,
    ModelConfig,
    OutputConfig,
    RunConfig,
    TrainConfig,
    VPPConfig,
    keeps_all_client_states,
)

__all__ = [
    "BACKEND_NAMES", "KEEP_CLIENT_STATES", "ON_CLIENT_ERROR", "PLACEMENTS", "RENAMED", "RESUMABLE", "SECTIONS",
    "DPConfig", "DataConfig", "EvalConfig", "ExecutionConfig", "ModelConfig", "OutputConfig", "RunConfig", "TrainConfig",
    "VPPConfig", "deep_merge", "flatten", "get_dotted", "keeps_all_client_states", "load_config_file", "load_yaml",
    "merge_config", "move_flat_key", "move_flat_keys", "parse_overrides", "parse_user_overrides", "parse_yaml", "set_dotted", "unflatten",
]
