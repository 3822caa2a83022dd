"""Building and checking a run config: the only config module that consults the registries (methods,
datasets and partitioners, privacy mechanisms and accountants, evaluation protocols, the model's fast paths).

`build_config(values)` is the front door: the user's mapping (its old keys moved into their sections once,
here), every key checked, every value range-checked, the method built once to check its privacy. A message
names the key as it is written (`train.rounds`) and what to do.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any, Mapping

from raysim.config.load import (
    RENAMED,
    _build_dataclass,
    _coerce,
    deep_merge,
    expand_dotted_keys,
    load_config_file,
    move_flat_keys,
    parse_user_overrides,
)
from raysim.config.schema import (
    AUGMENT_CHOICES,
    BACKEND_NAMES,
    KEEP_CLIENT_STATES,
    ON_CLIENT_ERROR,
    PLACEMENTS,
    SECTIONS,
    DataConfig,
    DPConfig,
    EvalConfig,
    ExecutionConfig,
    RunConfig,
    TrainConfig,
)
from raysim.errors import ConfigError, shown

if TYPE_CHECKING:
    from raysim.methods.base import Method


def method_options(cfg: RunConfig, name: str | None = None) -> Any:
    """The resolved Options dataclass of method `name` (default: the run's method) in `cfg`."""
    from raysim.methods import get_method

    name = (name or cfg.method).lower()
    cls = get_method(name)
    section = cfg.methods.get(name)
    if isinstance(section, cls.Options):
        return section
    return _build_dataclass(cls.Options, section or {}, prefix=f"{name}.")


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
    plain = _stored_clients(plain)
    cfg = _build_dataclass(RunConfig, plain)
    cfg.methods = {
        name: _build_dataclass(get_method(name).Options, sec, prefix=f"{name}.") for name, sec in sections.items()
    }
    validate(cfg)
    # the run's own method section is always materialised so config.yaml lists every knob
    cfg.methods.setdefault(cfg.method.lower(), method_options(cfg))
    return cfg


def _stored_clients(plain: dict[str, Any]) -> dict[str, Any]:
    """data.dataset=pfllib runs on the clients its folder stores: data.partition=stored and train.num_clients
    are taken from the folder's config.json (a conflicting value the user set is refused), data.shots is 0
    (every stored sample), and the config.json is recorded as data.folder_config."""
    if not isinstance(plain.get("data") or {}, Mapping) or not isinstance(plain.get("train") or {}, Mapping):
        return plain  # not sections: _build_dataclass says so
    data = dict(plain.get("data") or {})
    if str(data.get("dataset", "")).lower() != "pfllib":
        _check(not data.get("folder_config"), "data.folder_config is recorded from a data.dataset=pfllib folder; do not set it")
        return plain
    from raysim.data.pfllib_folder import read_config

    root = str(data.get("data_root", DataConfig.data_root))
    folder = read_config(root)
    train = dict(plain.get("train") or {})
    K = int(folder["num_clients"])
    if "num_clients" in train and _coerce(train["num_clients"], int, "train.num_clients") != K:
        raise ConfigError(f"train.num_clients={train['num_clients']} conflicts with the {K} clients of the PFLlib folder "
                          f"{root} (its config.json): data.dataset=pfllib runs on the stored clients; drop train.num_clients "
                          f"or set it to {K}")
    if data.get("partition", "stored") != "stored":
        raise ConfigError(f"data.partition={data['partition']} would re-split the clients of the PFLlib folder {root}; "
                          "data.dataset=pfllib runs on its stored clients (data.partition=stored): drop data.partition")
    if _coerce(data.get("shots", 0) or 0, int, "data.shots") != 0:
        raise ConfigError(f"data.shots={data['shots']} would drop samples of the stored clients of {root}; data.dataset=pfllib "
                          "keeps every stored sample: set data.shots=0 or drop it")
    if data.get("folder_config") not in (None, {}, folder):
        raise ConfigError(f"data.folder_config differs from {root}/config.json: the folder changed since this config was "
                          "written (its clients may differ); start a new run")
    train["num_clients"] = K
    data.update(partition="stored", shots=0, folder_config=folder)
    return {**plain, "data": data, "train": train}


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
           f"is on, else last), got {shown(cfg.output.keep_client_states)}")
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
           f"train.ctx_init={_short(cfg.train.ctx_init)!r} sets the phrase a learnt CoOp context starts from, but {cfg.method} "
           f"does not start its prompts from it (it would be ignored); leave train.ctx_init at its default, or use a method "
           f"that does (promptfl, pfedmoap, fedsept with fedsept.r_init=phrase)")
    if cfg.train.optimizer_state == "shared":
        _validate_shared_optimizer(cfg, method)
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


def _validate_data(d: DataConfig) -> None:
    from raysim.data import PARTITIONERS, dataset_names

    if d.dataset.lower() not in dataset_names():
        raise ConfigError(f"unknown dataset {shown(d.dataset)}. Valid choices: {', '.join(dataset_names())}.")
    d.dataset = d.dataset.lower()
    _check(d.partition in PARTITIONERS, f"data.partition must be one of {', '.join(PARTITIONERS.names())}, got {shown(d.partition)}")
    _check(d.beta > 0 and math.isfinite(d.beta), f"data.beta must be a positive number, got {d.beta}")
    _check(d.shots >= 0, f"data.shots must be >= 0 (0 = use all training images), got {d.shots}")
    _check(not d.domain_reseed or d.partition == "domain",
           f"data.domain_reseed=true is the FedSEPT code's domain split; it needs data.partition=domain (got {shown(d.partition)})")
    _check(d.cifar_transform in ("clip", "official"),
           f"data.cifar_transform must be clip (CLIP's normalisation) or official (the FedSEPT code's CIFAR mean/std, then "
           f"resize), got {shown(d.cifar_transform)}")
    _check(d.min_samples >= 0, f"data.min_samples must be >= 0 (0 = the partition's default), got {d.min_samples}")
    _check((d.partition == "stored") == (d.dataset == "pfllib"),
           "data.partition=stored (the clients a folder stores) goes with data.dataset=pfllib, and only with it")
    _check(d.augment in AUGMENT_CHOICES,
           f"data.augment must be one of {', '.join(AUGMENT_CHOICES)} (auto = the official code's augmentation for the CoOp "
           f"and domain datasets, off elsewhere), got {shown(d.augment)}")
    _check(1 <= d.augment_views <= MAX_AUGMENT_VIEWS,
           f"data.augment_views must be between 1 and {MAX_AUGMENT_VIEWS} (augmented views per training image, each encoded "
           f"once and cached), got {d.augment_views}")
    if d.augment == "official":  # whether the dataset has images to augment depends on the method: checked in validate
        from raysim.data.partition import is_pooled

        _check(not is_pooled(d.partition),
               f"data.augment=official cannot go with data.partition={d.partition}: it pools train and test, so a client's "
               "training row may be another's test row; set data.augment=off (or auto)")
    _check(isinstance(d.train_fraction, (int, float)) and not isinstance(d.train_fraction, bool)
           and 0.0 < float(d.train_fraction) <= 1.0,
           f"data.train_fraction must be a number in (0, 1]: the fraction of each domain's training images kept (1 = all; "
           f"the VPDR code keeps 0.1 of Digits and 0.3 of PACS and Office-Caltech), got {shown(d.train_fraction)}")
    d.train_fraction = float(d.train_fraction)
    if d.train_fraction < 1.0:
        from raysim.data.partition import is_pooled

        _check(not is_pooled(d.partition) and d.partition != "stored",
               f"data.train_fraction keeps part of each domain's training split before the partition; data.partition="
               f"{d.partition} {'pools train and test' if d.partition != 'stored' else 'uses the clients a folder stores'}, "
               "so there is no training split to keep part of: set data.train_fraction=1")
    _check(d.partition != "pfllib" or d.shots == 0,
           f"data.partition=pfllib is PFLlib's protocol, which keeps every sample of each client; set data.shots=0 (got {d.shots})")


# documented maxima (docs/security.md): a count past these is a typo or an attack, and would hang or exhaust the machine
MAX_ROUNDS = 1_000_000
MAX_CLIENTS = 100_000
MAX_LOCAL_EPOCHS = 10_000
MAX_BATCH_SIZE = 1_000_000
MAX_N_CTX = 1_000
MAX_CTX_INIT_CHARS = 1_000
MAX_AUGMENT_VIEWS = 256  # features of every view are held in memory: N x views x D floats


def _at_most(value: int, limit: int, key: str) -> None:
    _check(value <= limit, f"{key} is at most {limit:,} (raysim's documented maximum, docs/security.md), got {_short(value)}")


def _short(value: Any) -> str:
    text = shown(value, 40)
    return text[1:-1] if isinstance(value, str) and text.endswith("'") else text


def _validate_train(t: TrainConfig) -> None:
    _at_most(t.num_clients, MAX_CLIENTS, "train.num_clients")
    _at_most(t.rounds, MAX_ROUNDS, "train.rounds")
    _at_most(t.local_epochs, MAX_LOCAL_EPOCHS, "train.local_epochs")
    _at_most(t.batch_size, MAX_BATCH_SIZE, "train.batch_size")
    _at_most(t.n_ctx, MAX_N_CTX, "train.n_ctx")
    _check(len(t.ctx_init) <= MAX_CTX_INIT_CHARS,
           f"train.ctx_init is a short phrase (at most {MAX_CTX_INIT_CHARS} characters), got {len(t.ctx_init):,} characters")
    _check(t.num_clients >= 1, f"train.num_clients must be >= 1, got {t.num_clients}")
    _check(0 < t.participation <= 1, f"train.participation must be in (0, 1], got {t.participation}")
    _check(t.rounds >= 1, f"train.rounds must be >= 1, got {t.rounds}")
    _check(t.local_epochs >= 1, f"train.local_epochs must be >= 1, got {t.local_epochs}")
    _check(t.batch_size >= 1, f"train.batch_size must be >= 1, got {t.batch_size}")
    _check(t.lr > 0, f"train.lr must be > 0, got {t.lr}")
    _check(t.momentum >= 0 and t.weight_decay >= 0, "train.momentum and train.weight_decay must be >= 0")
    _check(t.n_ctx >= 1, f"train.n_ctx must be >= 1, got {t.n_ctx}")
    _check(t.optimizer_state in OPTIMIZER_STATES,
           f"train.optimizer_state must be fresh (a new SGD state per client per round) or shared (the FedSEPT code's one "
           f"optimiser for all clients), got {shown(t.optimizer_state)}")
    _check(0 <= t.seed < 2**63, f"train.seed must be in [0, 2^63), got {_short(t.seed)}")


OPTIMIZER_STATES = ("fresh", "shared")


def _validate_shared_optimizer(cfg: RunConfig, method: Any) -> None:
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


def _validate_eval(e: EvalConfig, t: TrainConfig) -> None:
    from raysim.protocols import PROTOCOLS

    _check(0 <= e.clients <= t.num_clients,
           f"eval.clients is how many clients are evaluated per evaluated round: 0 (all) up to train.num_clients="
           f"{t.num_clients}; got {e.clients}")
    _check(e.protocol in PROTOCOLS, f"eval.protocol must be one of {', '.join(PROTOCOLS.names())}, got {shown(e.protocol)}")
    _check(e.batch_size >= 1, f"eval.batch_size must be >= 1, got {e.batch_size}")
    _check(e.every >= 1 and e.last >= 0, "eval.every must be >= 1 and eval.last >= 0")
    _at_most(e.every, MAX_ROUNDS, "eval.every")
    _at_most(e.last, MAX_ROUNDS, "eval.last")
    _at_most(e.batch_size, MAX_BATCH_SIZE, "eval.batch_size")


def _validate_execution(x: ExecutionConfig, t: TrainConfig) -> None:
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


def _validate_dp(dp: DPConfig) -> None:
    from raysim.privacy.accountant import ACCOUNTANTS, CONVERSIONS
    from raysim.privacy.mechanisms import MECHANISMS

    _check(dp.epsilon > 0, f"dp.epsilon must be > 0 (inf turns DP off), got {dp.epsilon}")
    _check(0 < dp.delta < 1, f"dp.delta must be in (0, 1), got {dp.delta}")
    _check(dp.clip > 0, f"dp.clip must be > 0, got {dp.clip}")
    _check(dp.accountant in ACCOUNTANTS, f"dp.accountant must be one of {', '.join(ACCOUNTANTS)}, got {shown(dp.accountant)}")
    _check(dp.conversion in CONVERSIONS, f"dp.conversion must be one of {', '.join(CONVERSIONS)}, got {shown(dp.conversion)}")
    _check(dp.conversion == "tight" or dp.accountant == "rdp",
           "dp.conversion=classic converts an RDP curve to epsilon; it needs dp.accountant=rdp")
    _check(dp.microbatch >= 0, f"dp.microbatch must be >= 1, or 0 = sized from the graph's memory, got {dp.microbatch}")
    _check(dp.calibration in ("participated", "all_rounds"), "dp.calibration must be participated or all_rounds")
    _check(dp.level in ("sample", "client"), f"dp.level must be sample or client, got {shown(dp.level)}")
    _check(dp.sampling in ("poisson", "shuffle"), f"dp.sampling must be poisson or shuffle, got {shown(dp.sampling)}")
    protos = [n for n in MECHANISMS.names() if MECHANISMS.get(n).applied == "release" and n != "embedding"]
    _check(dp.prototypes in protos, f"dp.prototypes must be one of {', '.join(protos)}, got {shown(dp.prototypes)}")
    _check(dp.proto_clip > 0, f"dp.proto_clip must be > 0, got {dp.proto_clip}")
    _check(0 < dp.vpp.rho <= 0.5, f"dp.vpp.rho must be in (0, 0.5], got {dp.vpp.rho}")
    _check(dp.vpp.H > 0, f"dp.vpp.H must be > 0, got {dp.vpp.H}")
    _check(0 < dp.vpp.split < 1, f"dp.vpp.split must be in (0, 1), got {dp.vpp.split}")


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
