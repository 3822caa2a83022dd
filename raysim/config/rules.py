"""The config checks that need no other part of raysim: the train section, the output section and the rules
between sections, with the helpers every part's section check uses (`check`, `at_most`, `short`). The checks
that ask a registry (a method's options, a mechanism's domain, a dataset folder's config, a protocol) live
with the part that owns the registry and are called from `raysim.build`, where a run is assembled."""

from __future__ import annotations

from typing import Any

from raysim.config.limits import MAX_BATCH_SIZE, MAX_CLIENTS, MAX_CTX_INIT_CHARS, MAX_LOCAL_EPOCHS, MAX_N_CTX, MAX_ROUNDS
from raysim.config.schema import KEEP_CLIENT_STATES, RunConfig, TrainConfig
from raysim.errors import ConfigError, shown

OPTIMIZER_STATES = ("fresh", "shared")


def check(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def at_most(value: int, limit: int, key: str) -> None:
    check(value <= limit, f"{key} is at most {limit:,} (raysim's documented maximum, docs/security.md), got {short(value)}")


def short(value: Any) -> str:
    text = shown(value, 40)
    return text[1:-1] if isinstance(value, str) and text.endswith("'") else text


def check_train(t: TrainConfig) -> None:
    at_most(t.num_clients, MAX_CLIENTS, "train.num_clients")
    at_most(t.rounds, MAX_ROUNDS, "train.rounds")
    at_most(t.local_epochs, MAX_LOCAL_EPOCHS, "train.local_epochs")
    at_most(t.batch_size, MAX_BATCH_SIZE, "train.batch_size")
    at_most(t.n_ctx, MAX_N_CTX, "train.n_ctx")
    check(len(t.ctx_init) <= MAX_CTX_INIT_CHARS,
          f"train.ctx_init is a short phrase (at most {MAX_CTX_INIT_CHARS} characters), got {len(t.ctx_init):,} characters")
    check(t.num_clients >= 1, f"train.num_clients must be >= 1, got {t.num_clients}")
    check(0 < t.participation <= 1, f"train.participation must be in (0, 1], got {t.participation}")
    check(t.rounds >= 1, f"train.rounds must be >= 1, got {t.rounds}")
    check(t.local_epochs >= 1, f"train.local_epochs must be >= 1, got {t.local_epochs}")
    check(t.batch_size >= 1, f"train.batch_size must be >= 1, got {t.batch_size}")
    check(t.lr > 0, f"train.lr must be > 0, got {t.lr}")
    check(t.momentum >= 0 and t.weight_decay >= 0, "train.momentum and train.weight_decay must be >= 0")
    check(t.n_ctx >= 1, f"train.n_ctx must be >= 1, got {t.n_ctx}")
    check(t.optimizer_state in OPTIMIZER_STATES,
          f"train.optimizer_state must be fresh (a new SGD state per client per round) or shared (the FedSEPT code's one "
          f"optimiser for all clients), got {shown(t.optimizer_state)}")
    check(0 <= t.seed < 2**63, f"train.seed must be in [0, 2^63), got {short(t.seed)}")


def check_between_sections(cfg: RunConfig) -> None:
    """The rules between sections that ask no registry (execution.compile with DP-SGD) and the output section."""
    check(not (cfg.execution.compile and cfg.dp.enabled and cfg.dp.level == "sample"),
          "execution.compile=true cannot run with DP-SGD (dp.epsilon finite, dp.level=sample): a compiled text tower's "
          "backward does not batch over DP-SGD's per-example cotangents, so every example would need its own backward "
          "(slower than not compiling); set execution.compile=false under DP, or dp.level=client")
    check(cfg.output.keep_client_states in KEEP_CLIENT_STATES,
          f"output.keep_client_states must be one of {', '.join(KEEP_CLIENT_STATES)} (auto = all when output.record_uploads "
          f"is on, else last), got {shown(cfg.output.keep_client_states)}")
