"""Reading configuration: YAML files, `key=value` overrides, dotted keys, and the flat-key shim.

Everything here works on plain nested mappings (`{"train": {"rounds": 5}}`) and on the section dataclasses
of `raysim.config.schema`; nothing consults a registry (that is `raysim.build`). The previous
release's flat keys (`rounds=5`, `dp.vpp_rho=0.3`) are moved into their sections by `move_flat_keys`,
once, where user input enters: config files (`load_config_file`), command-line overrides
(`parse_user_overrides`), sweep and compare spec files, and the `build_config(values)` front door.
Internal code writes sectioned keys and merges with `merge_config` (a deep merge, no shim).

`RAYSIM_FLAT_KEYS=error` in the environment turns the shim into a check: an old key raises `ConfigError`
naming its new place instead of being moved (the test suite runs so, to prove the repository's own files
and tests use sectioned keys). Unset, or `warn`, the old keys are moved with one message each.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import types
import typing
from pathlib import Path
from typing import Any, Mapping

import yaml

from raysim.config.schema import SECTIONS
from raysim.errors import ConfigError, one_line, shown

log = logging.getLogger(__name__)

# the keys of the previous release -> their place now (accepted with a deprecation message): top-level flat
# keys (`rounds` -> `train.rounds`) and renamed keys inside a section (`dp.vpp_rho` -> `dp.vpp.rho`)
RENAMED = {"model": "model.name", "pretrained": "model.pretrained", "evaluation": "eval.protocol",
           "eval_every": "eval.every", "eval_last": "eval.last", "eval_clients": "eval.clients", "test_batch_size": "eval.batch_size",
           "dp.vpp_rho": "dp.vpp.rho", "dp.vpp_H": "dp.vpp.H", "dp.vpp_split": "dp.vpp.split"}
for _section, _cls in SECTIONS.items():
    if _section in ("model", "eval", "dp"):
        continue
    for _f in dataclasses.fields(_cls):
        RENAMED.setdefault(_f.name, f"{_section}.{_f.name}")


class AliasRefused(yaml.YAMLError):
    """A YAML alias (`*name`) in user input: refused, so a few hundred bytes cannot expand to gigabytes."""

    def __init__(self, mark: Any) -> None:
        super().__init__(f"line {mark.line + 1}, column {mark.column + 1}")
        self.mark = mark


class NoAliasLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses aliases (`*name`, and so `<<: *name` merges): an anchor is harmless
    alone, but nine aliases of nine aliases of ... of a list expand to billions of items (a "billion laughs"
    bomb) that every later step (the config check, its error message) would walk. Every YAML reader of
    raysim goes through `parse_yaml` (tests/security/test_hostile_cli.py checks that none calls yaml.load)."""

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            raise AliasRefused(self.peek_event().start_mark)
        return super().compose_node(parent, index)


def _yaml_value(text: str) -> Any:
    loader = NoAliasLoader(text)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def parse_yaml(text: str, *, what: str) -> Any:
    """The value YAML `text` holds (safe types only, no aliases); anything unreadable is one ConfigError
    naming `what` (a file, a key) and saying what to do, with nothing of the text repeated but its place."""
    try:
        return _yaml_value(text)
    except AliasRefused as e:
        raise ConfigError(f"{what}: YAML aliases (*name) are not accepted ({e}); write the value out in full") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{what} is not valid YAML: {one_line(str(e))}") from None
    except (ValueError, RecursionError) as e:  # an integer of thousands of digits, a deeply nested document
        raise ConfigError(f"{what} holds a value raysim cannot read ({one_line(str(e), 120)}); give a value of sensible size") from None


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
        raise ConfigError(f"{key} must be true or false, got {shown(value)}")
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise ConfigError(f"{key} must be an integer, got {shown(value)}")
        if isinstance(value, int):
            return value
        try:
            f = float(value)
        except (ValueError, OverflowError):
            raise ConfigError(f"{key} must be an integer, got {shown(value)}") from None
        if not f.is_integer():
            raise ConfigError(f"{key} must be an integer, got {shown(value)}")
        return int(f)
    if tp is float:
        if isinstance(value, bool):
            raise ConfigError(f"{key} must be a number, got {shown(value)}")
        try:
            return float(value)
        except (TypeError, ValueError, OverflowError):
            raise ConfigError(f"{key} must be a number (use inf for infinity), got {shown(value)}") from None
    if tp is str:
        if isinstance(value, (dict, list)):
            raise ConfigError(f"{key} must be a string, got {shown(value)}")
        return "" if value is None else str(value)
    if origin in (list, tuple):
        if isinstance(value, str):
            value = parse_yaml(value, what=key)
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

            if not names:
                raise ConfigError(f"unknown config key {shown(prefix + str(key))}: {prefix.rstrip('.') or 'this section'} takes no keys; "
                                  "remove it")
            hint = difflib.get_close_matches(str(key)[:100], names, n=1)
            extra = f" Did you mean {prefix}{hint[0]}?" if hint else ""
            raise ConfigError(
                f"unknown config key {shown(prefix + str(key))}.{extra} Valid keys: {', '.join(prefix + n for n in sorted(names))}."
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
            raise ConfigError(f"{shown(key)}: {shown(p)} is not a section")
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
            raise ConfigError(f"expected key=value, got {shown(item)} (for example train.rounds=5 or dp.epsilon=1.0)")
        key, raw = item.split("=", 1)
        key = key.strip()
        if not key:
            raise ConfigError(f"empty key in {shown(item)}")
        try:
            value = _yaml_value(raw) if raw.strip() != "" else ""
        except yaml.YAMLError:  # not YAML (or holding an alias, refused): the text itself, unexpanded
            value = raw
        except (ValueError, RecursionError) as e:  # an integer of thousands of digits, a deeply nested value
            raise ConfigError(f"{shown(key)}: the value ({len(raw):,} characters) cannot be read ({one_line(str(e), 120)}); "
                              "give a value of sensible size") from None
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


MAX_CONFIG_BYTES = 16 << 20  # a config file (or a run's config.yaml) is at most 16 MiB


def load_yaml(path: str | Path, *, root: str | Path | None = None) -> dict[str, Any]:
    """A YAML mapping from a file: a regular UTF-8 file of at most MAX_CONFIG_BYTES (inside `root`, a run
    folder, when given). Anything else is a ConfigError naming the file."""
    from raysim.safeio import read_regular

    p = Path(path).expanduser()
    if not os.path.lexists(p):
        raise ConfigError(f"config file {str(p)!r} does not exist")
    raw = read_regular(p, root=root, max_bytes=MAX_CONFIG_BYTES, error=ConfigError, what=f"config file {str(p)!r}")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {str(p)!r} is not UTF-8 text (byte {e.start} is {raw[e.start]:#04x}); save it as UTF-8") from None
    data = parse_yaml(text, what=f"config file {str(p)!r}") or {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(p)!r} must hold a mapping of keys to values")
    return data


FLAT_KEYS_ENV = "RAYSIM_FLAT_KEYS"
FLAT_KEY_MODES = ("warn", "error")


def flat_key_mode() -> str:
    """What the shim does with an old key: "warn" (move it, one message per key; the default) or "error"
    (refuse it), from the environment variable RAYSIM_FLAT_KEYS."""
    mode = os.environ.get(FLAT_KEYS_ENV, "").strip().lower() or "warn"
    if mode not in FLAT_KEY_MODES:
        raise ConfigError(f"{FLAT_KEYS_ENV}={mode!r} is not one of {', '.join(FLAT_KEY_MODES)}")
    return mode


def move_flat_keys(values: Mapping[str, Any], _prefix: str = "") -> dict[str, Any]:
    """The previous release's keys (`rounds=5`, `model=ViT-B-16`, `dp.vpp_rho=0.3`) moved to their place now,
    with one deprecation message per key. Entries apply in order, so of an old key and its new key in one
    mapping the later one wins (a flat key set on a loaded config overrides it). Run it once, on user input.
    Under RAYSIM_FLAT_KEYS=error an old key raises ConfigError instead."""
    refuse = flat_key_mode() == "error"
    out: dict[str, Any] = {}
    for key, value in values.items():
        full = _prefix + str(key)
        new = RENAMED.get(full)
        if new is None or (full == "model" and isinstance(value, Mapping)):
            if isinstance(value, Mapping) and any(old.startswith(full + ".") for old in RENAMED):
                value = move_flat_keys(value, full + ".")
            out = deep_merge(out, {key: value})
            continue
        if refuse:
            raise ConfigError(f"config key {full!r} is now {new!r}; write {new}=... "
                              f"(old keys are refused because {FLAT_KEYS_ENV}=error)")
        if full not in _WARNED:
            _WARNED.add(full)
            log.warning("config key %r is now %r; the old name works in this release and will be refused in the next", full, new)
        out = deep_merge(out, unflatten({new[len(_prefix):]: value}))
    return out


def move_flat_key(key: str) -> str:
    """One dotted key of user input (a swept key) at its place now, with the deprecation message once."""
    flat = flatten(move_flat_keys(unflatten({key: None})))
    return next(iter(flat))


_WARNED: set[str] = set()


def merge_config(base: Mapping[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    """`extra` over `base` (sectioned keys: user input has been through `move_flat_keys` at the edge)."""
    return deep_merge(base, extra)


def expand_dotted_keys(values: Mapping[str, Any]) -> dict[str, Any]:
    """`{"data.dataset": "digits"}` (a dotted key written in a YAML mapping) as `{"data": {"dataset": "digits"}}`."""
    out: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(key, str) and "." in key:
            out = deep_merge(out, unflatten({key: value}))
        else:
            out = deep_merge(out, {key: value})
    return out


def check_sections(values: Mapping[str, Any], where: str) -> None:
    """A section given as a scalar (`train: 5`) is refused: merged with other input it would be dropped silently."""
    for key, value in values.items():
        if key in SECTIONS and key != "model" and value is not None and not isinstance(value, Mapping):
            raise ConfigError(f"{where}: {key} is a section, not a value (got {shown(value)}); write its keys under it, "
                              f"e.g. {key}:\n  NAME: VALUE, or {key}.NAME=VALUE on the command line")


def load_config_file(path: str | Path) -> dict[str, Any]:
    """A run config file (YAML), its old keys moved into their sections."""
    values = load_yaml(path)
    check_sections(values, f"config file {str(path)!r}")
    return move_flat_keys(expand_dotted_keys(values))


def parse_user_overrides(items: list[str]) -> dict[str, Any]:
    """Command-line `key=value` overrides as a nested mapping, their old keys moved into their sections."""
    return move_flat_keys(parse_overrides(items))
