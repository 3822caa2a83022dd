"""Typed run configuration: YAML files plus `key=value` overrides, validated at the edge.

A run is described by one `RunConfig`. Nested sections are dataclasses too: `dp` (local differential
privacy) and one section per method, named after the method (`fedsept.rank=8`), whose fields are the
method's own `Options` dataclass. Every key is checked; unknown keys and out-of-range values raise
`ConfigError` with a message that says what to do.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import yaml

from raysim.errors import ConfigError
from raysim.methods.base import TrainConfig

_TRAIN = TrainConfig()  # the one source of the training defaults (methods receive a TrainConfig)
PLACEMENTS = ("pooled", "actor_per_client")
ON_CLIENT_ERROR = ("fail", "drop")


@dataclass
class DPConfig:
    """Local DP on what a client releases. `epsilon: inf` turns DP off."""

    epsilon: float = math.inf
    delta: float = 1e-5
    clip: float = 1.0  # per-example L2 clipping norm R_c of DP-SGD
    accountant: str = "rdp"  # rdp | prv (Opacus accountants)
    microbatch: int = 8  # per-example gradients are computed this many at a time (memory bound)
    # Steps used to calibrate sigma: "participated" = the rounds a client really takes part in
    # (fedsept.txt appendix B.2); "all_rounds" = every round, as the official code does (conservative).
    calibration: str = "participated"
    # "sample": DP-SGD on the uploaded parameters (example-level, the papers' setting);
    # "client": clip the whole uploaded update to `clip` and add Gaussian noise (user-level LDP).
    level: str = "sample"
    # DP-SGD batches: "poisson" (each example joins each batch with probability q = B/n, what the
    # accountants assume) or "shuffle" (fixed-size shuffled batches, the papers' code, accounted as if Poisson)
    sampling: str = "poisson"
    prototypes: str = "igpp"  # the mechanism of prototype releases: igpp | vpp (vpdr.txt)
    proto_clip: float = 5.0  # R, the per-example L2 clip of prototype releases (vpdr.txt clip_proto_norm)
    vpp_rho: float = 0.3  # VPP: share of dimensions in the top-k group I_A, in (0, 0.5]
    vpp_H: float = 0.1  # VPP: cap of the discriminativeness scores
    vpp_split: float = 0.1  # VPP: r, the share of epsilon spent on the Laplace top-k partition

    @property
    def enabled(self) -> bool:
        return math.isfinite(self.epsilon)


@dataclass
class RunConfig:
    """Everything that defines one federated run. Field comments are the config reference."""

    # what to run
    method: str = "promptfl"
    dataset: str = "synthetic"
    data_root: str = "./data"  # folder holding real datasets in the layouts of README "Datasets"
    download: bool = False  # let torchvision download datasets that support it (needs internet)
    partition: str = "pathological"  # pathological | dirichlet | domain | iid
    beta: float = 0.5  # Dirichlet concentration (dirichlet and domain partitions)
    shots: int = 16  # training images per class per client (0 = all)
    min_samples: int = 10  # dirichlet: redraw until every client has this many train and test samples
    num_clients: int = _TRAIN.num_clients
    participation: float = 1.0  # fraction of clients sampled per round, in (0, 1]
    rounds: int = _TRAIN.rounds
    local_epochs: int = _TRAIN.local_epochs
    batch_size: int = _TRAIN.batch_size
    test_batch_size: int = 512
    lr: float = _TRAIN.lr
    momentum: float = _TRAIN.momentum
    weight_decay: float = _TRAIN.weight_decay
    seed: int = _TRAIN.seed
    # model
    model: str = "raysim-clip"  # any open_clip model name (ViT-B-16, ...), raysim-clip (bundled) or raysim-tiny
    pretrained: str = "bundled"  # open_clip tag (openai, ...), a checkpoint path, "bundled" (raysim-clip), "" = random init
    n_ctx: int = _TRAIN.n_ctx  # learned context tokens of the CoOp prompt learner (the papers use 16 with ViT-B/16)
    ctx_init: str = _TRAIN.ctx_init  # PromptFL starts its context from this phrase (n_ctx tokens); "" = random
    # evaluation (SPEC 1.10: every eval_every rounds plus each of the last eval_last rounds)
    evaluation: str = "in_cross"  # the evaluation protocol (raysim/evaluation.py): in_cross = In / Cross-Client
    eval_every: int = 5
    eval_last: int = 5
    # execution
    backend: str = "ray"  # ray | inline (same code, one process, no Ray)
    placement: str = "pooled"  # pooled (clients pinned to num_actors actors) | actor_per_client
    num_actors: int = 0  # pooled: number of client actors (0 = as many as the cluster has CPUs for)
    client_cpus: float = 1.0  # CPUs reserved per client actor
    client_gpus: float = 0.0  # fraction of a GPU per client actor (e.g. 0.25 = four actors per GPU)
    server_cpus: float = 0.0
    server_gpus: float = 0.0
    num_threads: int = 1  # torch threads per actor (results are bitwise reproducible for a fixed value)
    device: str = "auto"  # auto | cpu | cuda
    address: str = ""  # join an existing Ray cluster ("auto" on a `ray up` head node); "" = start one here
    max_actor_restarts: int = 3  # actors (client or server) replaced after a crash, per run (Ray backend)
    # client failures: a client whose local training raises, uploads a non-finite tensor or takes longer
    # than client_timeout seconds (0 = no limit) stops the run (fail) or is left out of its round (drop);
    # under drop the run stops when fewer than min_clients of a round's participants remain
    on_client_error: str = "fail"  # fail | drop
    client_timeout: float = 0.0
    min_clients: int = 1
    # output
    out_dir: str = ""  # "" = runs/<method>-<dataset>-<timestamp>
    resume: str = ""  # a run folder to continue from its last completed round
    cache_dir: str = "~/.cache/raysim"  # frozen image features and generated data
    tensorboard: bool = True
    progress: bool = True
    record_uploads: bool = False  # write what the server saw (uploads and the broadcast state) to out_dir/uploads/, for attacks
    # privacy
    dp: DPConfig = field(default_factory=DPConfig)
    # per-method sections (validated against each method's Options dataclass)
    methods: dict[str, Any] = field(default_factory=dict)

    # ----------------------------------------------------------------------------------------
    def method_options(self, name: str | None = None) -> Any:
        """The resolved Options dataclass of `name` (default: the run's method)."""
        from raysim.methods import get_method

        name = (name or self.method).lower()
        cls = get_method(name)
        section = self.methods.get(name)
        if isinstance(section, cls.Options):
            return section
        return _build_dataclass(cls.Options, section or {}, prefix=f"{name}.")

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.pop("methods")
        d["dp"] = dataclasses.asdict(self.dp)
        for name, section in sorted(self.methods.items()):
            d[name] = dataclasses.asdict(section) if dataclasses.is_dataclass(section) and not isinstance(section, type) else dict(section)
        return d

    def to_yaml(self) -> str:
        return yaml.safe_dump(_yaml_safe(self.to_dict()), sort_keys=False)


# --------------------------------------------------------------------------------------------
# parsing

def _yaml_safe(obj: Any) -> Any:
    if isinstance(obj, float) and math.isinf(obj):
        return "inf" if obj > 0 else "-inf"
    if isinstance(obj, dict):
        return {k: _yaml_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_yaml_safe(v) for v in obj]
    return obj


def _coerce(value: Any, tp: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        return _coerce(value, args[0], key)
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "yes", "1", "on", "false", "no", "0", "off"):
            return value.lower() in ("true", "yes", "1", "on")
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        raise ConfigError(f"{key} must be true or false, got {value!r}")
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise ConfigError(f"{key} must be an integer, got {value!r}")
        try:
            f = float(value)
        except ValueError:
            raise ConfigError(f"{key} must be an integer, got {value!r}") from None
        if not f.is_integer():
            raise ConfigError(f"{key} must be an integer, got {value!r}")
        return int(f)
    if tp is float:
        if isinstance(value, bool):
            raise ConfigError(f"{key} must be a number, got {value!r}")
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{key} must be a number (use inf for infinity), got {value!r}") from None
    if tp is str:
        if isinstance(value, (dict, list)):
            raise ConfigError(f"{key} must be a string, got {value!r}")
        return "" if value is None else str(value)
    if origin in (list, tuple):
        if isinstance(value, str):
            value = yaml.safe_load(value)
        if not isinstance(value, (list, tuple)):
            value = [value]
        (inner, *_) = typing.get_args(tp) or (Any,)
        items = [_coerce(v, inner, key) if inner is not Any else v for v in value]
        return tuple(items) if origin is tuple else items
    return value


def _build_dataclass(cls: type, values: Mapping[str, Any], prefix: str = "") -> Any:
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in values.items():
        if key not in names:
            import difflib

            hint = difflib.get_close_matches(key, names, n=1)
            extra = f" Did you mean {prefix}{hint[0]}?" if hint else ""
            raise ConfigError(
                f"unknown config key {prefix}{key!r}.{extra} Valid keys: {', '.join(prefix + n for n in sorted(names))}."
            )
        if dataclasses.is_dataclass(hints[key]):
            if not isinstance(value, Mapping):
                raise ConfigError(f"{prefix}{key} is a section; set its keys as {prefix}{key}.NAME=VALUE")
            kwargs[key] = _build_dataclass(hints[key], value, prefix=f"{prefix}{key}.")
        else:
            kwargs[key] = _coerce(value, hints[key], prefix + key)
    return cls(**kwargs)


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """`["a=1", "dp.epsilon=inf"]` -> nested dict with YAML-typed values."""
    out: dict[str, Any] = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"expected key=value, got {item!r} (for example rounds=5 or dp.epsilon=1.0)")
        key, raw = item.split("=", 1)
        key = key.strip()
        if not key:
            raise ConfigError(f"empty key in {item!r}")
        try:
            value = yaml.safe_load(raw) if raw.strip() != "" else ""
        except yaml.YAMLError:
            value = raw
        node = out
        parts = key.split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"{key}: {p} is not a section")
        node[parts[-1]] = value
    return out


def deep_merge(base: Mapping[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in extra.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), Mapping):
            out[k] = deep_merge(dict(out[k]), v)
        else:
            out[k] = v
    return out


def load_yaml(path: str | Path) -> dict[str, Any]:
    p = Path(path).expanduser()
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} does not exist")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {str(p)!r} is not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(p)!r} must hold a mapping of keys to values")
    return data


def build_config(values: Mapping[str, Any] | None = None, **overrides: Any) -> RunConfig:
    """Build and validate a RunConfig from a (nested) mapping plus keyword overrides."""
    from raysim.methods import get_method, method_names

    values = deep_merge(dict(values or {}), overrides)
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

            choices = sorted(run_fields | set(method_names()))
            hint = difflib.get_close_matches(key, choices, n=1)
            extra = f" Did you mean {hint[0]!r}?" if hint else ""
            raise ConfigError(
                f"unknown config key {key!r}.{extra} Valid keys: {', '.join(sorted(run_fields))}; "
                f"method sections: {', '.join(method_names())}."
            )
    cfg = _build_dataclass(RunConfig, plain)
    cfg.methods = {
        name: _build_dataclass(get_method(name).Options, sec, prefix=f"{name}.") for name, sec in sections.items()
    }
    validate(cfg)
    # the run's own method section is always materialised so config.yaml lists every knob
    cfg.methods.setdefault(cfg.method.lower(), cfg.method_options())
    return cfg


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def validate(cfg: RunConfig) -> None:
    from raysim.data import dataset_names
    from raysim.methods import get_method
    from raysim.sampling import participants

    get_method(cfg.method)  # raises with the valid choices
    cfg.method = cfg.method.lower()
    if cfg.dataset.lower() not in dataset_names():
        raise ConfigError(f"unknown dataset {cfg.dataset!r}. Valid choices: {', '.join(dataset_names())}.")
    cfg.dataset = cfg.dataset.lower()
    from raysim.backends import BACKENDS
    from raysim.data import PARTITIONERS

    _check(cfg.partition in PARTITIONERS, f"partition must be one of {', '.join(PARTITIONERS.names())}, got {cfg.partition!r}")
    _check(cfg.backend in BACKENDS, f"backend must be one of {', '.join(sorted(BACKENDS))}, got {cfg.backend!r}")
    from raysim.evaluation import PROTOCOLS

    _check(cfg.evaluation in PROTOCOLS, f"evaluation must be one of {', '.join(PROTOCOLS.names())}, got {cfg.evaluation!r}")
    _check(cfg.placement in PLACEMENTS, f"placement must be one of {', '.join(PLACEMENTS)}, got {cfg.placement!r}")
    _check(cfg.beta > 0 and math.isfinite(cfg.beta), f"beta must be a positive number, got {cfg.beta}")
    _check(cfg.shots >= 0, f"shots must be >= 0 (0 = use all training images), got {cfg.shots}")
    _check(cfg.num_clients >= 1, f"num_clients must be >= 1, got {cfg.num_clients}")
    _check(0 < cfg.participation <= 1, f"participation must be in (0, 1], got {cfg.participation}")
    _check(cfg.rounds >= 1, f"rounds must be >= 1, got {cfg.rounds}")
    _check(cfg.local_epochs >= 1, f"local_epochs must be >= 1, got {cfg.local_epochs}")
    _check(cfg.batch_size >= 1, f"batch_size must be >= 1, got {cfg.batch_size}")
    _check(cfg.test_batch_size >= 1, f"test_batch_size must be >= 1, got {cfg.test_batch_size}")
    _check(cfg.lr > 0, f"lr must be > 0, got {cfg.lr}")
    _check(cfg.momentum >= 0 and cfg.weight_decay >= 0, "momentum and weight_decay must be >= 0")
    _check(cfg.n_ctx >= 1, f"n_ctx must be >= 1, got {cfg.n_ctx}")
    _check(cfg.eval_every >= 1 and cfg.eval_last >= 0, "eval_every must be >= 1 and eval_last >= 0")
    _check(cfg.num_actors >= 0, f"num_actors must be >= 0 (0 = automatic), got {cfg.num_actors}")
    _check(cfg.client_cpus >= 0 and cfg.server_cpus >= 0, "client_cpus and server_cpus must be >= 0")
    _check(0 <= cfg.client_gpus <= 1, f"client_gpus is a fraction of one GPU per actor, in [0, 1]; got {cfg.client_gpus}")
    _check(cfg.server_gpus >= 0, f"server_gpus must be >= 0, got {cfg.server_gpus}")
    _check(cfg.num_threads >= 1, f"num_threads must be >= 1, got {cfg.num_threads}")
    _check(cfg.max_actor_restarts >= 0, f"max_actor_restarts must be >= 0, got {cfg.max_actor_restarts}")
    _check(cfg.on_client_error in ON_CLIENT_ERROR,
           f"on_client_error must be one of {', '.join(ON_CLIENT_ERROR)}, got {cfg.on_client_error!r}")
    _check(cfg.client_timeout >= 0 and not math.isnan(cfg.client_timeout),
           f"client_timeout is in seconds and must be >= 0 (0 = no limit), got {cfg.client_timeout}")
    per_round = len(participants(cfg.seed, 0, cfg.num_clients, cfg.participation))
    _check(1 <= cfg.min_clients <= per_round,
           f"min_clients must be between 1 and the {per_round} clients sampled per round "
           f"(num_clients={cfg.num_clients} x participation={cfg.participation}), got {cfg.min_clients}")
    _check(cfg.device in ("auto", "cpu", "cuda"), f"device must be auto, cpu or cuda, got {cfg.device!r}")
    _check(cfg.seed >= 0, f"seed must be >= 0, got {cfg.seed}")
    dp = cfg.dp
    _check(dp.epsilon > 0, f"dp.epsilon must be > 0 (inf turns DP off), got {dp.epsilon}")
    _check(0 < dp.delta < 1, f"dp.delta must be in (0, 1), got {dp.delta}")
    _check(dp.clip > 0, f"dp.clip must be > 0, got {dp.clip}")
    from raysim.privacy.accountant import ACCOUNTANTS
    from raysim.privacy.mechanisms import MECHANISMS

    _check(dp.accountant in ACCOUNTANTS, f"dp.accountant must be one of {', '.join(ACCOUNTANTS)}, got {dp.accountant!r}")
    _check(dp.microbatch >= 1, f"dp.microbatch must be >= 1, got {dp.microbatch}")
    _check(dp.calibration in ("participated", "all_rounds"), "dp.calibration must be participated or all_rounds")
    _check(dp.level in ("sample", "client"), f"dp.level must be sample or client, got {dp.level!r}")
    _check(dp.sampling in ("poisson", "shuffle"), f"dp.sampling must be poisson or shuffle, got {dp.sampling!r}")
    protos = [n for n in MECHANISMS.names() if MECHANISMS.get(n).applied == "release" and n != "embedding"]
    _check(dp.prototypes in protos, f"dp.prototypes must be one of {', '.join(protos)}, got {dp.prototypes!r}")
    _check(dp.proto_clip > 0, f"dp.proto_clip must be > 0, got {dp.proto_clip}")
    _check(0 < dp.vpp_rho <= 0.5, f"dp.vpp_rho must be in (0, 0.5], got {dp.vpp_rho}")
    _check(dp.vpp_H > 0, f"dp.vpp_H must be > 0, got {dp.vpp_H}")
    _check(0 < dp.vpp_split < 1, f"dp.vpp_split must be in (0, 1), got {dp.vpp_split}")
    opts = cfg.method_options()
    check = getattr(opts, "validate", None)
    if callable(check):
        check()
    from raysim.actors import make_method
    from raysim.privacy.mechanisms import check_method

    check_method(make_method(cfg), dp)  # a method/dp combination that cannot be made private stops here


def config_from_cli(config_file: str | None, overrides: list[str]) -> RunConfig:
    base = load_yaml(config_file) if config_file else {}
    return build_config(deep_merge(base, parse_overrides(overrides)))


def config_from_yaml_text(text: str) -> RunConfig:
    data = yaml.safe_load(text) or {}
    return build_config(data)
