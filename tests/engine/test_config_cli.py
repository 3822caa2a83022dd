"""Bad input never ends in a traceback: one clear message and exit code 2."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from raysim.build import build_config, config_from_cli
from raysim.config import parse_overrides
from raysim.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    return subprocess.run(
        [sys.executable, str(ROOT / "raysim" / "run.py"), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


def test_overrides_are_typed_and_nested():
    o = parse_overrides(["train.rounds=5", "dp.epsilon=inf", "train.lr=1e-3", "method=promptfl", "output.progress=false"])
    cfg = build_config(o)
    assert cfg.train.rounds == 5 and math.isinf(cfg.dp.epsilon) and cfg.train.lr == 1e-3 and cfg.output.progress is False
    assert not cfg.dp.enabled
    assert build_config({"dp": {"epsilon": "1"}}).dp.enabled


def test_yaml_file_plus_overrides(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("train:\n  rounds: 7\ndata:\n  beta: 0.1\ndp:\n  epsilon: 2\n")
    cfg = config_from_cli(str(f), ["data.beta=0.3"])
    assert (cfg.train.rounds, cfg.data.beta, cfg.dp.epsilon) == (7, 0.3, 2.0)
    # the resolved config round-trips through its YAML
    from raysim.build import config_from_yaml_text
    assert config_from_yaml_text(cfg.to_yaml()).to_dict() == cfg.to_dict()


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"method": "nope"}, "promptfl"),
        ({"data": {"dataset": "imagenet"}}, "digits"),
        ({"train": {"rounds": -1}}, "train.rounds must be >= 1"),
        ({"train": {"participation": 1.5}}, "train.participation must be in (0, 1]"),
        ({"train": {"participation": 0}}, "train.participation must be in (0, 1]"),
        ({"data": {"beta": 0}}, "data.beta must be a positive"),
        ({"roundz": 3}, "Did you mean 'train.rounds'"),
        ({"train": {"roundz": 3}}, "Did you mean train.rounds"),
        ({"dp": {"epsilon": -1}}, "dp.epsilon"),
        ({"dp": {"epsilonn": 1}}, "dp.epsilon"),
        ({"data": {"partition": "weird"}}, "pathological"),
        ({"train": {"rounds": "many"}}, "train.rounds must be an integer"),
        ({"execution": {"client_gpus": 2}}, "fraction"),
    ],
)
def test_bad_values_name_the_fix(overrides, message):
    with pytest.raises(ConfigError) as e:
        build_config(overrides)
    assert message in str(e.value)


@pytest.mark.parametrize("method", ["fedpgp", "fedotp", "dpfpl", "fedpha", "fedsept", "fedproto"])
def test_a_phrase_a_method_would_ignore_is_refused(method):
    # these start their prompts at random (or learn none): a phrase set for them would change nothing
    with pytest.raises(ConfigError, match=f"but {method} does not start its prompts from it"):
        build_config(method=method, train={"ctx_init": "a picture of a"})
    for phrase in ("", "a photo of a"):  # the random start, and the default (what the shipped tables set)
        assert build_config(method=method, train={"ctx_init": phrase}).train.ctx_init == phrase
    # the methods that start one learnt context from it take any phrase
    assert build_config(method="promptfl", train={"ctx_init": "a picture of a"}).train.ctx_init == "a picture of a"
    assert build_config(method="fedsept", fedsept={"r_init": "phrase"}, train={"ctx_init": "a picture of a"})


def test_a_flat_key_of_the_previous_release_is_moved_then_checked(flat_keys_allowed):
    with pytest.raises(ConfigError) as e:
        build_config({"rounds": -1})
    assert "train.rounds must be >= 1" in str(e.value)


@pytest.mark.parametrize("values, old, new", [
    ({"rounds": 3}, "rounds", "train.rounds"),
    ({"model": "raysim-tiny"}, "model", "model.name"),
    ({"dp": {"vpp_rho": 0.2}}, "dp.vpp_rho", "dp.vpp.rho"),
])
def test_under_raysim_flat_keys_error_an_old_key_is_refused_naming_the_new_one(monkeypatch, values, old, new):
    monkeypatch.setenv("RAYSIM_FLAT_KEYS", "error")
    with pytest.raises(ConfigError) as e:
        build_config(values)
    assert f"{old!r} is now {new!r}" in str(e.value)
    with pytest.raises(ConfigError, match="is now 'train.rounds'"):
        config_from_cli(None, ["rounds=2"])  # command-line overrides too
    monkeypatch.setenv("RAYSIM_FLAT_KEYS", "sometimes")
    with pytest.raises(ConfigError, match="RAYSIM_FLAT_KEYS='sometimes' is not one of warn, error"):
        build_config({"train": {"rounds": 2}, **values})


def test_cli_bad_input_exit_2_without_traceback(tmp_path):
    for args, needle in [
        (["method=nope"], "unknown method"),
        (["train.rounds=-3"], "rounds must be >= 1"),
        (["data.dataset=cifar10", f"data.data_root={tmp_path / 'nothing'}", "execution.backend=inline"], "cifar-10-batches-py"),
        (["notakeyvalue"], "key=value"),
    ]:
        p = cli(*args, cwd=tmp_path)
        assert p.returncode == 2, (args, p.stderr)
        assert needle in p.stderr, (args, p.stderr)
        assert "Traceback" not in p.stderr
    assert not (tmp_path / "runs").exists()  # nothing was written by failed starts


def test_cli_refuses_to_overwrite_and_keeps_files(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    p = cli(f"output.out_dir={out}", "execution.backend=inline", cwd=tmp_path)
    assert p.returncode == 2 and "resume=" in p.stderr
    assert (out / "keep.txt").read_text() == "x" and len(list(out.iterdir())) == 1


def test_config_reference_documents_every_config_key():
    """The hand-written notes of docs/reference/config.md name every key (the generated tables above
    them list every key by construction: tests/test_docs.py)."""
    import dataclasses

    from raysim.config import SECTIONS

    def leaves(prefix: str, cls: type) -> list[str]:  # a subsection (dp.vpp) is documented by its keys (dp.vpp.rho, ...)
        return [k for f in dataclasses.fields(cls) for k in (
            leaves(f"{prefix}.{f.name}", f.default_factory) if dataclasses.is_dataclass(f.default_factory) else [f"{prefix}.{f.name}"])]

    notes = (ROOT / "docs" / "reference" / "config.md").read_text()
    keys = ["method"] + [k for name, cls in SECTIONS.items() for k in leaves(name, cls)]
    assert {"dp.vpp.rho", "dp.vpp.H", "dp.vpp.split", "train.rounds"} <= set(keys)
    missing = [k for k in keys if f"`{k}`" not in notes]
    assert not missing, f"docs/reference/config.md lacks {missing}"


def test_python_dash_m_raysim_is_the_console_script(tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1")

    def m(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "raysim", *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)

    usage = m("--help")
    assert usage.returncode == 0 and "usage: raysim COMMAND" in usage.stdout
    assert m().returncode == 2  # no command: usage, as `raysim` does
    bad = m("run", "method=nope", f"out_dir={tmp_path / 'r'}")
    assert bad.returncode == 2 and "error:" in bad.stderr and "Traceback" not in bad.stderr
    assert not (tmp_path / "r").exists()
    args = ("privacy", "epsilon", "--sigma", "20", "--delta", "1e-5", "--sample-rate", "0.5", "--steps", "100")
    via_m = m(*args)
    assert via_m.returncode == 0 and via_m.stdout.strip(), via_m.stderr
    script = Path(sys.executable).with_name("raysim")
    if script.is_file():  # the installed console script prints the same
        direct = subprocess.run([str(script), *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        assert direct.returncode == 0 and direct.stdout == via_m.stdout


def test_defaults_have_one_source_and_the_config_notes_state_them():
    """A method receives the run's train section itself, and the hand-written config table of
    docs/reference/config.md states each default the code has."""
    import dataclasses
    import re

    from raysim.build import make_method
    from raysim.config import SECTIONS
    cfg = build_config({})
    assert make_method(cfg).train is cfg.train
    notes = (ROOT / "docs" / "reference" / "config.md").read_text()
    table = notes[notes.index("## More on some keys"):]
    rows = {}
    for line in table.splitlines():
        m = re.match(r"\| (`[^|]+`) \| ([^|]*) \|", line)
        if m:
            keys = re.findall(r"`([^`]+)`", m.group(1))
            vals = [v.strip() for v in m.group(2).split(",")] if len(keys) > 1 else [m.group(2).strip()]
            rows.update(zip(keys, vals))

    def shown(v):
        if isinstance(v, bool):
            return str(v).lower()
        if isinstance(v, float) and math.isinf(v):
            return "inf"
        return v if isinstance(v, str) else str(v)

    checked = 0
    for name, cls in SECTIONS.items():
        obj = getattr(cfg, name)
        for f in dataclasses.fields(cls):
            key, value = f"{name}.{f.name}", getattr(obj, f.name)
            if key not in rows or key in ("output.out_dir", "output.cache_dir"):
                continue
            cell = rows[key].strip('"')
            if isinstance(value, float) and not math.isinf(value):
                assert float(cell) == pytest.approx(value), key
            else:
                assert cell == shown(value), (key, cell, shown(value))
            checked += 1
    assert checked > 30


def test_flat_keys_of_the_previous_release_still_work_with_one_message(caplog, flat_keys_allowed):
    import logging

    from raysim.config import load as config_load

    config_load._WARNED.clear()
    with caplog.at_level(logging.WARNING, logger="raysim.config"):
        cfg = build_config({"rounds": 3, "model": "raysim-tiny", "backend": "inline", "eval_every": 2})
        build_config({"rounds": 4})
    assert (cfg.train.rounds, cfg.model.name, cfg.execution.backend, cfg.eval.every) == (3, "raysim-tiny", "inline", 2)
    said = [r.getMessage() for r in caplog.records]
    assert sum("'rounds' is now 'train.rounds'" in m for m in said) == 1  # once per key, not per config
    assert any("'model' is now 'model.name'" in m for m in said)
    # an explicit section value wins over the flat one
    assert build_config({"rounds": 3, "train": {"rounds": 5}}).train.rounds == 5


def test_resumable_keys_are_field_metadata():
    cfg = build_config({})
    keys = cfg.resumable_keys()
    assert {"execution.backend", "output.out_dir", "train.rounds", "data.data_root"} <= keys
    assert not {"train.lr", "train.seed", "data.partition", "execution.num_threads", "dp.epsilon"} & keys


def _shipped_yaml() -> list[Path]:
    """Every YAML file of the repository (not the venv, build outputs or run folders)."""
    skip = {".venv", "build", ".git", "site", "runs", "node_modules"}
    return sorted(p for ext in ("*.yaml", "*.yml") for p in ROOT.rglob(ext) if not skip & set(p.relative_to(ROOT).parts))


def test_shipped_sweep_and_table_files_use_sectioned_keys(caplog, tmp_path, monkeypatch):
    """Every shipped YAML file that raysim reads (sweeps, comparison specs, run configs, in any folder)
    builds its configs without one deprecation message, and with old keys refused
    (RAYSIM_FLAT_KEYS=error): they are written with the sectioned keys. The rest (Ray cluster launcher
    files, the docs site's config) are named and not raysim configs."""
    import logging

    import yaml

    from raysim.build import build_config
    from raysim.config import load as config_load
    from raysim.tools.compare import plan, spec_from_args
    from raysim.tools.sweep import load_sweep, validate_sweep

    monkeypatch.setenv("RAYSIM_FLAT_KEYS", "error")
    config_load._WARNED.clear()
    kinds: dict[str, list[str]] = {"sweep": [], "compare": [], "config": [], "cluster": [], "site": []}
    with caplog.at_level(logging.WARNING, logger="raysim.config"):
        for path in _shipped_yaml():
            rel = path.relative_to(ROOT).as_posix()
            raw = yaml.safe_load(path.read_text()) or {}
            if path.name == "mkdocs.yml":
                kinds["site"].append(rel)
            elif "cluster_name" in raw:
                kinds["cluster"].append(rel)
            elif "space" in raw or "base" in raw:
                validate_sweep(load_sweep(path))
                kinds["sweep"].append(rel)
            elif "methods" in raw:
                spec, _ = spec_from_args([str(path)])
                plan(spec, tmp_path / path.stem)
                kinds["compare"].append(rel)
            else:
                build_config(config_load.load_config_file(path))
                kinds["config"].append(rel)
    sweeps = [p for p in kinds["sweep"] if p.startswith("sweeps/")]
    tables = [p for p in kinds["compare"] if p.startswith("benchmarks/tables/")]
    assert len(sweeps) >= 5 and len(tables) >= 5
    assert sorted(kinds["cluster"]) == ["clusters/aws.yaml", "clusters/local.yaml"] and kinds["site"] == ["mkdocs.yml"]
    said = [r.getMessage() for r in caplog.records if "is now" in r.getMessage()]
    assert not said, said


def test_a_shipped_file_with_an_old_key_would_be_caught(tmp_path, monkeypatch):
    """The check above can fail: the same loaders refuse a sweep and a spec with one flat key."""
    from raysim.tools.compare import spec_from_args
    from raysim.tools.sweep import load_sweep, validate_sweep

    monkeypatch.setenv("RAYSIM_FLAT_KEYS", "error")
    sweep = tmp_path / "s.yaml"
    sweep.write_text("base: {method: promptfl, rounds: 2}\nspace: {dp.epsilon: {grid: [1.0]}}\n")
    with pytest.raises(ConfigError, match="'rounds' is now 'train.rounds'"):
        validate_sweep(load_sweep(sweep))
    spec = tmp_path / "t.yaml"
    spec.write_text("methods: [promptfl]\nsetting: {dataset: digits}\n")
    with pytest.raises(ConfigError, match="'dataset' is now 'data.dataset'"):
        spec_from_args([str(spec)])


def test_schema_backend_names_are_the_engine_backends():
    from raysim.config.schema import BACKEND_NAMES
    from raysim.engine.backends import BACKENDS

    assert sorted(BACKEND_NAMES) == sorted(BACKENDS)


def test_old_vpp_keys_move_into_the_dp_vpp_section_with_one_message(caplog, flat_keys_allowed):
    import logging

    from raysim.config import load as config_load

    config_load._WARNED.clear()
    with caplog.at_level(logging.WARNING, logger="raysim.config"):
        cfg = build_config({"dp": {"vpp_rho": 0.2, "vpp_split": 0.3}})
        again = config_from_cli(None, ["dp.vpp_rho=0.25", "dp.vpp.H=0.5"])
    assert (cfg.dp.vpp.rho, cfg.dp.vpp.H, cfg.dp.vpp.split) == (0.2, 0.1, 0.3)
    assert (again.dp.vpp.rho, again.dp.vpp.H) == (0.25, 0.5)
    said = [r.getMessage() for r in caplog.records]
    assert sum("'dp.vpp_rho' is now 'dp.vpp.rho'" in m for m in said) == 1
    assert sum("'dp.vpp_split' is now 'dp.vpp.split'" in m for m in said) == 1
