"""Typed run configuration: YAML files plus `key=value` overrides, validated at the edge.

A run is described by one `RunConfig`. Nested sections are dataclasses too: `dp` (local differential
privacy) and one section per method, named after the method (`fedsept.rank=8`), whose fields are the
method's own `Options` dataclass. Every key is checked; unknown keys and out-of-range values raise
`ConfigError` with a message that says what to do.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import yaml

from raysim.errors import ConfigError
from raysim.methods.base import TrainConfig

log = logging.getLogger(__name__)

PLACEMENTS = ("pooled", "actor_per_client")
ON_CLIENT_ERROR = ("fail", "drop")


@dataclass
class VPPConfig:
    """VPP's constants (dp.prototypes=vpp; vpdr.txt Eq. 7-14)."""

    rho: float = 0.3  # share of dimensions in the top-k group I_A, in (0, 0.5]
    H: float = 0.1  # cap of the discriminativeness scores
    split: float = 0.1  # r, the share of epsilon spent on the Laplace top-k partition


@dataclass
class DPConfig:
    """Local DP on what a client releases. `epsilon: inf` turns DP off."""

    epsilon: float = math.inf
    delta: float = 1e-5
    clip: float = 1.0  # per-example L2 clipping norm R_c of DP-SGD
    accountant: str = "rdp"  # rdp | prv (Opacus accountants)
    microbatch: int = 8  # per-example gradients are computed this many at a time (memory bound); 0 = sized from memory
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
    vpp: VPPConfig = field(default_factory=VPPConfig)  # VPP's constants: dp.vpp.rho, dp.vpp.H, dp.vpp.split

    @property
    def enabled(self) -> bool:
        return math.isfinite(self.epsilon)


RESUMABLE = {"resume": True}  # field metadata: the key may change when a run is resumed (it does not change results)


@dataclass
class DataConfig:
    """What data, and how it is split over the clients."""

    dataset: str = "synthetic"
    data_root: str = field(default="./data", metadata=RESUMABLE)  # folder holding real datasets (README "Datasets")
    download: bool = field(default=False, metadata=RESUMABLE)  # let torchvision download datasets that support it
    partition: str = "pathological"  # a registered partitioner: pathological | dirichlet | domain | iid | pfllib
    beta: float = 0.5  # Dirichlet concentration (dirichlet, domain and pfllib partitions)
    shots: int = 16  # training images per class per client (0 = all)
    # redraw the Dirichlet split until every client has this many samples; 0 = the partition's default:
    # dirichlet 10 train and 10 test samples, pfllib 40 samples in all (PFLlib's least_samples)
    min_samples: int = 0


@dataclass
class ModelConfig:
    """The foundation model: any open_clip name (ViT-B-16, ...), raysim-clip (bundled) or raysim-tiny."""

    name: str = "raysim-clip"
    pretrained: str = "bundled"  # open_clip tag (openai, ...), a checkpoint path, "bundled" (raysim-clip), "" = random init


@dataclass
class EvalConfig:
    """Evaluation (SPEC 1.10: every `every` rounds plus each of the last `last` rounds)."""

    protocol: str = "in_cross"  # the evaluation protocol (raysim/engine/evaluation.py registry)
    every: int = 5
    last: int = 5
    batch_size: int = 512
    # clients evaluated per evaluated round: 0 = all; N = a sample of N clients drawn once from train.seed (the
    # same every round); a sampled client's Cross-Client accuracy is on the other sampled clients' test splits
    clients: int = 0


@dataclass
class ExecutionConfig:
    """Where and how the run executes; none of it changes results (except num_threads, bitwise, and the
    text-tower fast paths autocast and compile, within float tolerance: README "GPUs")."""

    backend: str = field(default="ray", metadata=RESUMABLE)  # ray | inline (same code, one process, no Ray)
    placement: str = field(default="pooled", metadata=RESUMABLE)  # pooled | actor_per_client
    num_actors: int = field(default=0, metadata=RESUMABLE)  # pooled: client actors (0 = as many as the CPUs allow)
    client_cpus: float = field(default=1.0, metadata=RESUMABLE)  # CPUs reserved per client actor
    client_gpus: float = field(default=0.0, metadata=RESUMABLE)  # fraction of a GPU per client actor
    server_cpus: float = field(default=0.0, metadata=RESUMABLE)
    server_gpus: float = field(default=0.0, metadata=RESUMABLE)
    num_threads: int = 1  # torch threads per actor (results are bitwise reproducible for a fixed value)
    device: str = field(default="auto", metadata=RESUMABLE)  # auto | cpu | cuda
    autocast: str = "off"  # off | bf16 | fp16: the frozen text tower under torch.autocast (fp16 needs CUDA)
    compile: bool = False  # torch.compile the text tower's forward (refused with DP-SGD: see README "GPUs")
    # "" = join the cluster `ray start --head` runs on this machine when one is up, else start one here;
    # "local" = always start a new one here; "auto" (on a node of a running cluster) or HOST:PORT = join that one
    address: str = field(default="", metadata=RESUMABLE)
    max_actor_restarts: int = field(default=3, metadata=RESUMABLE)  # actors replaced after a crash, per run
    # client failures: a client whose local training raises, uploads a non-finite tensor or takes longer
    # than client_timeout seconds (0 = no limit) stops the run (fail) or is left out of its round (drop);
    # under drop the run stops when fewer than min_clients of a round's participants remain
    on_client_error: str = field(default="fail", metadata=RESUMABLE)  # fail | drop
    client_timeout: float = field(default=0.0, metadata=RESUMABLE)
    min_clients: int = field(default=1, metadata=RESUMABLE)
    # client-batched local training (raysim/engine/batched.py): a host trains its clients of a round in stacks of up
    # to stack_size, one text-tower forward per step for the stack, for methods that support it (PromptFL);
    # equal to client by client up to float reassociation (1e-5)
    batch_clients: bool = False  # opt-in: its results depend on which clients share a host in their last bits
    stack_size: int = 64


@dataclass
class OutputConfig:
    """Where the run writes, and what."""

    out_dir: str = field(default="", metadata=RESUMABLE)  # "" = runs/<method>-<dataset>-<timestamp>
    resume: str = field(default="", metadata=RESUMABLE)  # a run folder to continue from its last completed round
    cache_dir: str = field(default="~/.cache/raysim", metadata=RESUMABLE)  # frozen image features, generated data
    tensorboard: bool = field(default=True, metadata=RESUMABLE)
    progress: bool = field(default=True, metadata=RESUMABLE)
    record_uploads: bool = field(default=False, metadata=RESUMABLE)  # what the server saw, for the attacks
    # clients' checkpoints kept under state/clients/: "last" (the two a resume can need), "all" (every round's:
    # an audit attacks each recorded round with the model that made its release), "auto" = all with record_uploads
    keep_client_states: str = field(default="auto", metadata=RESUMABLE)


KEEP_CLIENT_STATES = ("auto", "last", "all")


def keeps_all_client_states(output: OutputConfig) -> bool:
    """Whether every round's client checkpoint stays on disk (output.keep_client_states, auto: with record_uploads)."""
    return output.keep_client_states == "all" or (output.keep_client_states == "auto" and bool(output.record_uploads))


SECTIONS: dict[str, type] = {
    "data": DataConfig, "model": ModelConfig, "train": TrainConfig, "eval": EvalConfig,
    "execution": ExecutionConfig, "output": OutputConfig, "dp": DPConfig,
}

# the flat keys of the previous release -> their place now (accepted with a deprecation message)
RENAMED = {"model": "model.name", "pretrained": "model.pretrained", "evaluation": "eval.protocol",
           "eval_every": "eval.every", "eval_last": "eval.last", "eval_clients": "eval.clients", "test_batch_size": "eval.batch_size"}
for _section, _cls in SECTIONS.items():
    if _section in ("model", "eval", "dp"):
        continue
    for _f in dataclasses.fields(_cls):
        RENAMED.setdefault(_f.name, f"{_section}.{_f.name}")


@dataclass
class RunConfig:
    """Everything that defines one federated run, in sections. Field comments are the config reference."""

    method: str = "promptfl"
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)  # what every method's local training sees (this object)
    eval: EvalConfig = field(default_factory=EvalConfig)
    execution: ExecutionConfig = field(default_factory=ExecutionConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
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

    def resumable_keys(self) -> set[str]:
        """Dotted keys that may differ between a run and its resume (field metadata)."""
        return {f"{name}.{f.name}" for name, cls in SECTIONS.items() for f in dataclasses.fields(cls)
                if f.metadata.get("resume")}

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.pop("methods")
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


def set_dotted(d: dict[str, Any], key: str, value: Any) -> None:
    """`set_dotted(d, "dp.vpp.rho", 0.3)`: d["dp"]["vpp"]["rho"] = 0.3, making the sections on the way."""
    parts = key.split(".")
    node = d
    for p in parts[:-1]:
        nxt = node.setdefault(p, {})
        if not isinstance(nxt, dict):
            raise ConfigError(f"{key}: {p} is not a section")
        node = nxt
    node[parts[-1]] = value


def get_dotted(d: Mapping[str, Any], key: str, default: Any = None) -> Any:
    """The value at a dotted key of a nested mapping, or `default` when any part is missing."""
    node: Any = d
    for p in key.split("."):
        if not isinstance(node, Mapping) or p not in node:
            return default
        node = node[p]
    return node


def unflatten(flat: Mapping[str, Any]) -> dict[str, Any]:
    """{"train.rounds": 5} -> {"train": {"rounds": 5}}."""
    out: dict[str, Any] = {}
    for k, v in flat.items():
        set_dotted(out, k, v)
    return out


def flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"train": {"rounds": 5}} -> {"train.rounds": 5} (every leaf under its dotted key)."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, Mapping) and v:
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """`["a=1", "dp.epsilon=inf"]` -> nested dict with YAML-typed values."""
    out: dict[str, Any] = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"expected key=value, got {item!r} (for example train.rounds=5 or dp.epsilon=1.0)")
        key, raw = item.split("=", 1)
        key = key.strip()
        if not key:
            raise ConfigError(f"empty key in {item!r}")
        try:
            value = yaml.safe_load(raw) if raw.strip() != "" else ""
        except yaml.YAMLError:
            value = raw
        set_dotted(out, key, value)
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


def move_flat_keys(values: Mapping[str, Any]) -> dict[str, Any]:
    """The previous release's flat keys (`rounds=5`, `model=ViT-B-16`) moved into their sections, with one
    deprecation message per key. Entries apply in order, so of a flat key and its section key in one
    mapping the later one wins (a flat key set on a loaded config overrides it)."""
    out: dict[str, Any] = {}
    for key, value in values.items():
        new = RENAMED.get(key)
        if new is None or (key == "model" and isinstance(value, Mapping)):
            out = deep_merge(out, {key: value})
            continue
        if key not in _WARNED:
            _WARNED.add(key)
            log.warning("config key %r is now %r; the old name works in this release and will be refused in the next", key, new)
        section, name = new.split(".")
        out = deep_merge(out, {section: {name: value}})
    return out


_WARNED: set[str] = set()


def merge_config(base: Mapping[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    """`extra` over `base`, each with its flat keys moved into their sections first, so a flat override
    (`rounds=5` on the command line) wins over a nested base (`train: {rounds: 10}` in a file) and back."""
    return deep_merge(move_flat_keys(base), move_flat_keys(extra))


def build_config(values: Mapping[str, Any] | None = None, **overrides: Any) -> RunConfig:
    """Build and validate a RunConfig from a (nested) mapping plus keyword overrides."""
    from raysim.methods import get_method, method_names

    values = merge_config(dict(values or {}), overrides)
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

            choices = sorted(run_fields | set(method_names()) | set(RENAMED))
            hint = difflib.get_close_matches(key, choices, n=1)
            extra = f" Did you mean {RENAMED.get(hint[0], hint[0])!r}?" if hint else ""
            raise ConfigError(
                f"unknown config key {key!r}.{extra} Valid keys: method and the sections {', '.join(SECTIONS)} "
                f"(e.g. train.rounds=5); method sections: {', '.join(method_names())}."
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
    """Check every section; a message names the key as it is written (`train.rounds`) and what to do."""
    from raysim.methods import get_method

    get_method(cfg.method)  # raises with the valid choices
    cfg.method = cfg.method.lower()
    _validate_data(cfg.data)
    _validate_train(cfg.train)
    _validate_eval(cfg.eval, cfg.train)
    _validate_execution(cfg.execution, cfg.train)
    _validate_dp(cfg.dp)
    _check(not (cfg.execution.compile and cfg.dp.enabled and cfg.dp.level == "sample"),
           "execution.compile=true cannot run with DP-SGD (dp.epsilon finite, dp.level=sample): a compiled text tower's "
           "backward does not batch over DP-SGD's per-example cotangents, so every example would need its own backward "
           "(slower than not compiling); set execution.compile=false under DP, or dp.level=client")
    _check(cfg.output.keep_client_states in KEEP_CLIENT_STATES,
           f"output.keep_client_states must be one of {', '.join(KEEP_CLIENT_STATES)} (auto = all when output.record_uploads "
           f"is on, else last), got {cfg.output.keep_client_states!r}")
    opts = cfg.method_options()
    check = getattr(opts, "validate", None)
    if callable(check):
        check()
    from raysim.engine.hosts import make_method
    from raysim.privacy.mechanisms import check_method

    method = make_method(cfg)
    check_method(method, method.dp)  # a method/dp combination that cannot be made private stops here (method.dp: the run's,
    # or the run's as the method's own privacy knob refines it, e.g. vpdr_fedproto.privacy=vpdr sets dp.prototypes=vpp)


def _validate_data(d: DataConfig) -> None:
    from raysim.data import PARTITIONERS, dataset_names

    if d.dataset.lower() not in dataset_names():
        raise ConfigError(f"unknown dataset {d.dataset!r}. Valid choices: {', '.join(dataset_names())}.")
    d.dataset = d.dataset.lower()
    _check(d.partition in PARTITIONERS, f"data.partition must be one of {', '.join(PARTITIONERS.names())}, got {d.partition!r}")
    _check(d.beta > 0 and math.isfinite(d.beta), f"data.beta must be a positive number, got {d.beta}")
    _check(d.shots >= 0, f"data.shots must be >= 0 (0 = use all training images), got {d.shots}")
    _check(d.min_samples >= 0, f"data.min_samples must be >= 0 (0 = the partition's default), got {d.min_samples}")
    _check(d.partition != "pfllib" or d.shots == 0,
           f"data.partition=pfllib is PFLlib's protocol, which keeps every sample of each client; set data.shots=0 (got {d.shots})")


def _validate_train(t: TrainConfig) -> None:
    _check(t.num_clients >= 1, f"train.num_clients must be >= 1, got {t.num_clients}")
    _check(0 < t.participation <= 1, f"train.participation must be in (0, 1], got {t.participation}")
    _check(t.rounds >= 1, f"train.rounds must be >= 1, got {t.rounds}")
    _check(t.local_epochs >= 1, f"train.local_epochs must be >= 1, got {t.local_epochs}")
    _check(t.batch_size >= 1, f"train.batch_size must be >= 1, got {t.batch_size}")
    _check(t.lr > 0, f"train.lr must be > 0, got {t.lr}")
    _check(t.momentum >= 0 and t.weight_decay >= 0, "train.momentum and train.weight_decay must be >= 0")
    _check(t.n_ctx >= 1, f"train.n_ctx must be >= 1, got {t.n_ctx}")
    _check(t.seed >= 0, f"train.seed must be >= 0, got {t.seed}")


def _validate_eval(e: EvalConfig, t: TrainConfig) -> None:
    from raysim.engine.evaluation import PROTOCOLS

    _check(0 <= e.clients <= t.num_clients,
           f"eval.clients is how many clients are evaluated per evaluated round: 0 (all) up to train.num_clients="
           f"{t.num_clients}; got {e.clients}")
    _check(e.protocol in PROTOCOLS, f"eval.protocol must be one of {', '.join(PROTOCOLS.names())}, got {e.protocol!r}")
    _check(e.batch_size >= 1, f"eval.batch_size must be >= 1, got {e.batch_size}")
    _check(e.every >= 1 and e.last >= 0, "eval.every must be >= 1 and eval.last >= 0")


def _validate_execution(x: ExecutionConfig, t: TrainConfig) -> None:
    from raysim.engine.backends import BACKENDS
    from raysim.sampling import participants

    _check(x.backend in BACKENDS, f"execution.backend must be one of {', '.join(sorted(BACKENDS))}, got {x.backend!r}")
    _check(x.placement in PLACEMENTS, f"execution.placement must be one of {', '.join(PLACEMENTS)}, got {x.placement!r}")
    _check(x.num_actors >= 0, f"execution.num_actors must be >= 0 (0 = automatic), got {x.num_actors}")
    _check(x.client_cpus >= 0 and x.server_cpus >= 0, "execution.client_cpus and execution.server_cpus must be >= 0")
    _check(0 <= x.client_gpus <= 1, f"execution.client_gpus is a fraction of one GPU per actor, in [0, 1]; got {x.client_gpus}")
    _check(x.server_gpus >= 0, f"execution.server_gpus must be >= 0, got {x.server_gpus}")
    _check(x.num_threads >= 1, f"execution.num_threads must be >= 1, got {x.num_threads}")
    _check(x.max_actor_restarts >= 0, f"execution.max_actor_restarts must be >= 0, got {x.max_actor_restarts}")
    _check(x.on_client_error in ON_CLIENT_ERROR,
           f"execution.on_client_error must be one of {', '.join(ON_CLIENT_ERROR)}, got {x.on_client_error!r}")
    _check(x.client_timeout >= 0 and not math.isnan(x.client_timeout),
           f"execution.client_timeout is in seconds and must be >= 0 (0 = no limit), got {x.client_timeout}")
    per_round = len(participants(t.seed, 0, t.num_clients, t.participation))
    _check(1 <= x.min_clients <= per_round,
           f"execution.min_clients must be between 1 and the {per_round} clients sampled per round "
           f"(num_clients={t.num_clients} x participation={t.participation}), got {x.min_clients}")
    _check(x.stack_size >= 1, f"execution.stack_size is the most clients trained in one stack and must be >= 1, got {x.stack_size} "
           "(execution.batch_clients=false trains client by client)")
    _check(x.device in ("auto", "cpu", "cuda"), f"execution.device must be auto, cpu or cuda, got {x.device!r}")
    from raysim.models.clip import FastPaths

    fast = FastPaths(x.autocast, x.compile)
    fast.check("cuda")  # the choices; the device itself is checked where the tower is built (an actor may have a GPU)
    if x.device == "cpu":
        fast.check("cpu")


def _validate_dp(dp: DPConfig) -> None:
    from raysim.privacy.accountant import ACCOUNTANTS
    from raysim.privacy.mechanisms import MECHANISMS

    _check(dp.epsilon > 0, f"dp.epsilon must be > 0 (inf turns DP off), got {dp.epsilon}")
    _check(0 < dp.delta < 1, f"dp.delta must be in (0, 1), got {dp.delta}")
    _check(dp.clip > 0, f"dp.clip must be > 0, got {dp.clip}")
    _check(dp.accountant in ACCOUNTANTS, f"dp.accountant must be one of {', '.join(ACCOUNTANTS)}, got {dp.accountant!r}")
    _check(dp.microbatch >= 0, f"dp.microbatch must be >= 1, or 0 = sized from the graph's memory, got {dp.microbatch}")
    _check(dp.calibration in ("participated", "all_rounds"), "dp.calibration must be participated or all_rounds")
    _check(dp.level in ("sample", "client"), f"dp.level must be sample or client, got {dp.level!r}")
    _check(dp.sampling in ("poisson", "shuffle"), f"dp.sampling must be poisson or shuffle, got {dp.sampling!r}")
    protos = [n for n in MECHANISMS.names() if MECHANISMS.get(n).applied == "release" and n != "embedding"]
    _check(dp.prototypes in protos, f"dp.prototypes must be one of {', '.join(protos)}, got {dp.prototypes!r}")
    _check(dp.proto_clip > 0, f"dp.proto_clip must be > 0, got {dp.proto_clip}")
    _check(0 < dp.vpp.rho <= 0.5, f"dp.vpp.rho must be in (0, 0.5], got {dp.vpp.rho}")
    _check(dp.vpp.H > 0, f"dp.vpp.H must be > 0, got {dp.vpp.H}")
    _check(0 < dp.vpp.split < 1, f"dp.vpp.split must be in (0, 1), got {dp.vpp.split}")


def config_from_cli(config_file: str | None, overrides: list[str]) -> RunConfig:
    base = load_yaml(config_file) if config_file else {}
    return build_config(merge_config(base, parse_overrides(overrides)))


def config_from_yaml_text(text: str) -> RunConfig:
    data = yaml.safe_load(text) or {}
    return build_config(data)
