"""Where a run is assembled: the user's mapping built into a checked RunConfig, and the run's Method object.

`build_config(values)` is the front door: the user's mapping (its old keys moved into their sections once,
here), every key checked, every value range-checked, the method built once to check its privacy. Each part
validates its own section, called from `validate` in a fixed order: the method registry (raysim.methods),
`data` (raysim.data.checks, and a PFLlib folder's config.json: raysim.data.pfllib_folder.stored_clients),
`train` and `output` (raysim.config.rules: they ask no registry), `eval` (raysim.protocols.check_eval),
`execution` (here: it asks the client sampler and the model's fast paths), `dp` (raysim.privacy.checks), then
where the parts meet: the method's options and its uploads' mechanisms under the run's dp
(raysim.privacy.mechanisms.check_method), train.ctx_init, train.optimizer_state and data.augment against the
method. A message names the key as it is written (`train.rounds`) and what to do.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any, Mapping

from raysim.config.load import (
    RENAMED,
    _build_dataclass,
    deep_merge,
    expand_dotted_keys,
    load_config_file,
    move_flat_keys,
    parse_user_overrides,
)
from raysim.config.rules import check as _check
from raysim.config.rules import check_between_sections, check_train, short
from raysim.config.schema import BACKEND_NAMES, ON_CLIENT_ERROR, PLACEMENTS, SECTIONS, ExecutionConfig, RunConfig, TrainConfig
from raysim.errors import ConfigError, shown

if TYPE_CHECKING:
    from raysim.methods.base import Method


def method_options(cfg: RunConfig, name: str | None = None) -> Any:
    """The resolved Options dataclass of method `name` (default: the run's method) in `cfg` (raysim.methods owns it)."""
    from raysim.methods import method_options as options

    return options(cfg, name)


def make_method(cfg: RunConfig) -> Method:
    """The run's Method object: its class with the run's train section itself, its options and the dp section."""
    from raysim.methods import get_method

    return get_method(cfg.method)(cfg.train, method_options(cfg), cfg.dp)


def env_spec(cfg: RunConfig, classnames: list[str]) -> Any:
    """What a host knows when it builds the method's frozen parts (EnvSpec), from the run's config."""
    from raysim.methods import EnvSpec
    from raysim.models.clip import FastPaths, ModelSpec, resolve_device

    return EnvSpec(
        model=ModelSpec(cfg.model.name, cfg.model.pretrained, cache_dir=cfg.output.cache_dir,
                        fast=FastPaths(cfg.execution.autocast, cfg.execution.compile)),
        classnames=list(classnames),
        device=str(resolve_device(cfg.execution.device)),
        dataset=cfg.data.dataset,
    )


def build_config(values: Mapping[str, Any] | None = None, **overrides: Any) -> RunConfig:
    """Build and validate a RunConfig from a (nested) mapping plus keyword overrides."""
    from raysim.data.pfllib_folder import stored_clients
    from raysim.methods import get_method, method_names

    # user input: dotted keys of a mapping expanded, old keys moved once
    values = deep_merge(move_flat_keys(expand_dotted_keys(dict(values or {}))), move_flat_keys(overrides))
    plain: dict[str, Any] = {}
    sections: dict[str, Any] = {}
    run_fields = {f.name for f in dataclasses.fields(RunConfig)} - {"methods"}
    for key, value in values.items():
        if key in run_fields:
            plain[key] = value
        elif key.lower() in method_names():
            if not isinstance(value, Mapping):
                raise ConfigError(f"{key} is a method section; set its keys as {key}.NAME=VALUE")
            sections[key.lower()] = value
        else:
            import difflib

            flat = {k for k in RENAMED if "." not in k}
            choices = sorted(run_fields | set(method_names()) | flat)
            hint = difflib.get_close_matches(str(key)[:100], choices, n=1)
            extra = f" Did you mean {RENAMED.get(hint[0], hint[0])!r}?" if hint else ""
            raise ConfigError(
                f"unknown config key {shown(key)}.{extra} Valid keys: method and the sections {', '.join(SECTIONS)} "
                f"(e.g. train.rounds=5); method sections: {', '.join(method_names())}."
            )
    plain = stored_clients(plain)
    cfg = _build_dataclass(RunConfig, plain)
    cfg.methods = {
        name: _build_dataclass(get_method(name).Options, sec, prefix=f"{name}.") for name, sec in sections.items()
    }
    validate(cfg)
    # the run's own method section is always materialised so config.yaml lists every knob
    cfg.methods.setdefault(cfg.method.lower(), method_options(cfg))
    return cfg


def validate(cfg: RunConfig) -> None:
    """Check every section; a message names the key as it is written (`train.rounds`) and what to do."""
    from raysim.data.checks import check_data
    from raysim.methods import get_method
    from raysim.privacy.checks import check_dp
    from raysim.protocols import check_eval

    get_method(cfg.method)  # raises with the valid choices
    cfg.method = cfg.method.lower()
    check_data(cfg.data)
    check_train(cfg.train)
    check_eval(cfg.eval, cfg.train)
    _check_execution(cfg.execution, cfg.train)
    check_dp(cfg.dp)
    check_between_sections(cfg)
    opts = method_options(cfg)
    check = getattr(opts, "validate", None)
    if callable(check):
        check()
    from raysim.privacy.mechanisms import check_method

    method = make_method(cfg)
    # train.ctx_init is the phrase a method that learns one CoOp context starts it from; a method that starts its
    # prompts otherwise (FedOTP, FedPGP, DP-FPL, FedPHA: random, as in their code) or learns none would ignore a
    # phrase set for it, so only "" (the random start) and the default are taken for those
    _check(getattr(method, "supports_ctx_init", False) or cfg.train.ctx_init in ("", TrainConfig.ctx_init),
           f"train.ctx_init={short(cfg.train.ctx_init)!r} sets the phrase a learnt CoOp context starts from, but {cfg.method} "
           f"does not start its prompts from it (it would be ignored); leave train.ctx_init at its default, or use a method "
           f"that does (promptfl, pfedmoap, fedsept with fedsept.r_init=phrase)")
    if cfg.train.optimizer_state == "shared":
        _check_shared_optimizer(cfg, method)
    from raysim.data.augment import augment_mode

    # data.augment=official where it cannot apply (a method training its own image model without an augmentation of
    # its code's, a pooled partition, a dataset with no images) stops here; auto never refuses (it resolves to off
    # there), so only official asks the method. A method declaring an image augmentation trains on images; the
    # others' needs() is asked (a VPDR method's needs() reads its backbone's config, absent in a dry run)
    if cfg.data.augment == "official":
        image_augment = type(method).image_augment
        kind = "images" if image_augment else method.needs().input
        augment_mode(cfg.data.augment, cfg.data.dataset, partition=cfg.data.partition, input_kind=kind, image_augment=image_augment)
    check_method(method, method.dp)  # a method/dp combination that cannot be made private stops here (method.dp: the run's,
    # or the run's as the method's own privacy knob refines it, e.g. vpdr_fedproto.privacy=vpdr sets dp.prototypes=vpp)


def _check_shared_optimizer(cfg: RunConfig, method: Any) -> None:
    """train.optimizer_state=shared (methods/base.py OptimizerCarry): one SGD state handed from client to client in id
    order. It is honoured only where that order is one chain on one host, and where the method steps one SGD."""
    x = cfg.execution
    _check(method.shares_optimizer_state(),
           f"train.optimizer_state=shared hands one SGD state from client to client, but {cfg.method}'s local round does not "
           "step one SGD over tensors of one shape for every client; set train.optimizer_state=fresh for it")
    one_host = x.placement == "pooled" and (x.num_actors == 1 or (x.backend == "inline" and x.num_actors == 0))
    _check(one_host or cfg.train.num_clients == 1,
           "train.optimizer_state=shared carries one SGD state through every client in id order, which needs every client on "
           "one host: set execution.num_actors=1 (or execution.backend=inline with execution.num_actors=0); with several "
           "client hosts (several Ray actors or nodes) the chain would have to cross hosts between clients")
    _check(x.on_client_error == "fail",
           "train.optimizer_state=shared cannot drop a failed client (execution.on_client_error=drop): the next client would "
           "continue an SGD state the dropped one had already changed; set execution.on_client_error=fail")


def _check_execution(x: ExecutionConfig, t: TrainConfig) -> None:
    """The execution section: where the engine's settings meet the client sampler (execution.min_clients) and the
    model's fast paths (execution.autocast, execution.compile)."""
    from raysim.sampling import participants

    _check(x.backend in BACKEND_NAMES, f"execution.backend must be one of {', '.join(sorted(BACKEND_NAMES))}, got {shown(x.backend)}")
    _check(x.placement in PLACEMENTS, f"execution.placement must be one of {', '.join(PLACEMENTS)}, got {shown(x.placement)}")
    _check(x.num_actors >= 0, f"execution.num_actors must be >= 0 (0 = automatic), got {x.num_actors}")
    _check(x.client_cpus >= 0 and x.server_cpus >= 0, "execution.client_cpus and execution.server_cpus must be >= 0")
    _check(0 <= x.client_gpus <= 1, f"execution.client_gpus is a fraction of one GPU per actor, in [0, 1]; got {x.client_gpus}")
    _check(x.server_gpus >= 0, f"execution.server_gpus must be >= 0, got {x.server_gpus}")
    _check(x.num_threads >= 1, f"execution.num_threads must be >= 1, got {x.num_threads}")
    _check(x.client_threads >= 0, f"execution.client_threads is how many clients a host trains at once and must be >= 0 "
           f"(0 = as many as the host has CPUs, 1 = client by client), got {x.client_threads}")
    _check(x.max_actor_restarts >= 0, f"execution.max_actor_restarts must be >= 0, got {x.max_actor_restarts}")
    _check(x.on_client_error in ON_CLIENT_ERROR,
           f"execution.on_client_error must be one of {', '.join(ON_CLIENT_ERROR)}, got {shown(x.on_client_error)}")
    _check(x.client_timeout >= 0 and not math.isnan(x.client_timeout),
           f"execution.client_timeout is in seconds and must be >= 0 (0 = no limit), got {x.client_timeout}")
    per_round = len(participants(t.seed, 0, t.num_clients, t.participation))
    _check(1 <= x.min_clients <= per_round,
           f"execution.min_clients must be between 1 and the {per_round} clients sampled per round "
           f"(num_clients={t.num_clients} x participation={t.participation}), got {x.min_clients}")
    _check(x.stack_size >= 1, f"execution.stack_size is the most clients trained in one stack and must be >= 1, got {x.stack_size} "
           "(execution.batch_clients=false trains client by client)")
    _check(x.device in ("auto", "cpu", "cuda"), f"execution.device must be auto, cpu or cuda, got {shown(x.device)}")
    from raysim.models.clip import FastPaths

    fast = FastPaths(x.autocast, x.compile)
    fast.check("cuda")  # the choices; the device itself is checked where the tower is built (an actor may have a GPU)
    if x.device == "cpu":
        fast.check("cpu")


def config_from_cli(config_file: str | None, overrides: list[str]) -> RunConfig:
    """A config file (optional) with `key=value` overrides over it: user input, old keys moved once each."""
    base = load_config_file(config_file) if config_file else {}
    return build_config(deep_merge(base, parse_user_overrides(overrides)))


def config_from_yaml_text(text: str) -> RunConfig:
    from raysim.config.load import parse_yaml

    data = parse_yaml(text, what="config text") or {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"config text must hold a mapping of keys to values, got {shown(data)}")
    return build_config(data)


__all__ = ["build_config", "config_from_cli", "config_from_yaml_text", "env_spec", "make_method", "method_options", "validate"]
