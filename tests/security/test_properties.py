"""Property tests: random keys, values, YAML documents and damaged run folders never give a traceback (an
exception that is not a RaysimError, which the front doors turn into one line and exit 2) nor a write."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import yaml
from conftest import tiny_config
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from raysim.build import build_config, config_from_cli
from raysim.config import flatten
from raysim.config.load import parse_user_overrides
from raysim.engine.loop import run
from raysim.errors import RaysimError
from raysim.storage.runfolder import RunFolder
from raysim.storage.store import StateStore

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                            HealthCheck.too_slow])
KNOWN = sorted(flatten(build_config({}).to_dict()))  # every key of a default config, e.g. train.rounds
KEYS = st.one_of(st.sampled_from(KNOWN), st.sampled_from(["train", "dp", "data", "method", "promptfl", "data.dataset"]),
                 st.text(alphabet="abcdefghijklmnopqrstuvwxyz._", min_size=1, max_size=20))
LEAVES = st.one_of(st.none(), st.booleans(), st.integers(), st.integers(min_value=10**30, max_value=10**60),
                   st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=30),
                   st.sampled_from(["9" * 5000, "inf", "-1", "0", "a photo of a", "[1, 2]", "{a: 1}", "!!python/object:os.system x"]))
VALUES = st.recursive(LEAVES, lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=8), kids, max_size=3),
                      max_leaves=6)


def only_raysim_errors(fn, *args):
    try:
        fn(*args)
    except RaysimError:
        pass  # one clear message, exit 2


def snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    return {str(p): (p.lstat().st_size, p.lstat().st_mtime_ns) for p in folder.rglob("*")}


@SETTINGS
@given(st.dictionaries(KEYS, VALUES, max_size=4))
def test_random_keys_and_values_give_a_config_or_a_raysim_error(tmp_path, monkeypatch, values):
    monkeypatch.chdir(tmp_path)
    only_raysim_errors(lambda: build_config({k: v for k, v in values.items()}))
    assert list(tmp_path.iterdir()) == []


@SETTINGS
@given(st.lists(st.tuples(KEYS, st.text(max_size=40) | st.sampled_from(["9" * 5000, "[[[[", "{", ": x", "!!binary AAAA"])),
                max_size=4))
def test_random_command_line_overrides_give_a_config_or_a_raysim_error(tmp_path, monkeypatch, items):
    monkeypatch.chdir(tmp_path)
    only_raysim_errors(lambda: build_config(parse_user_overrides([f"{k}={v}" for k, v in items])))
    assert list(tmp_path.iterdir()) == []


@SETTINGS
@given(st.one_of(st.binary(max_size=200),
                 VALUES.map(lambda v: yaml.safe_dump(v).encode()),
                 st.dictionaries(KEYS, VALUES, max_size=4).map(lambda d: yaml.safe_dump(d, allow_unicode=True).encode())))
def test_random_yaml_documents_give_a_config_or_a_raysim_error(tmp_path, monkeypatch, doc):
    f = tmp_path / "cfg.yaml"
    f.write_bytes(doc)
    monkeypatch.chdir(tmp_path)
    only_raysim_errors(config_from_cli, str(f), [])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cfg.yaml"]


@pytest.fixture(scope="module")
def finished(tmp_path_factory, cache_dir):
    tmp = tmp_path_factory.mktemp("finished")
    return run(tiny_config(tmp, cache_dir, train={"rounds": 2}, output={"record_uploads": True})).out_dir


DAMAGE = st.sampled_from(["truncate", "flip", "delete", "dev_zero", "outside", "fifo", "junk", "grow"])


def damage(folder: Path, files: list[Path], picks: list[tuple[int, str, int]], outside: Path) -> None:
    for i, how, n in picks:
        f = files[i % len(files)]
        if not f.exists() and not f.is_symlink():
            continue
        # in place, never reading the whole file: an earlier "grow" may have made it a sparse 8 GiB
        if how == "truncate" and f.is_file():
            os.truncate(f, n % (f.stat().st_size + 1))
        elif how == "flip" and f.is_file() and f.stat().st_size:
            with f.open("r+b") as h:
                h.seek(n % f.stat().st_size)
                b = h.read(1)
                h.seek(-1, os.SEEK_CUR)
                h.write(bytes([b[0] ^ 0xFF]))
        elif how == "delete":
            f.unlink()
        elif how in ("dev_zero", "outside", "fifo"):
            f.unlink()
            if how == "fifo":
                os.mkfifo(f)
            else:
                f.symlink_to("/dev/zero" if how == "dev_zero" else outside)
        elif how == "junk":
            f.write_bytes(bytes([n % 256]) * (n % 300))
        elif how == "grow" and f.is_file():
            os.truncate(f, f.stat().st_size + (n % 5 + 1) * (1 << 33))  # sparse: 8 GiB or more


@SETTINGS
@given(st.lists(st.tuples(st.integers(0, 10**6), DAMAGE, st.integers(0, 10**6)), min_size=1, max_size=3))
def test_a_damaged_run_folder_is_read_or_refused_with_a_raysim_error_and_never_written(finished, tmp_path, picks):
    folder = tmp_path / "run"
    if folder.exists():
        shutil.rmtree(folder)
    shutil.copytree(finished, folder)
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"\0" * 64)
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    damage(folder, files, picks, outside)
    before = snapshot(folder)
    run_folder = RunFolder(folder)
    store = StateStore(folder)
    only_raysim_errors(lambda: run_folder.cfg)
    only_raysim_errors(run_folder.utility)
    only_raysim_errors(store.completed_round)
    only_raysim_errors(lambda: [run_folder.uploads(r) for r in store.upload_rounds()])
    only_raysim_errors(lambda: store.damaged(max(store.completed_round(), 0)))
    only_raysim_errors(lambda: [store.load_client(c, 1) for c in range(4)] + [store.load_server(1)])
    assert snapshot(folder) == before  # reading wrote nothing
    for p in tmp_path.rglob(".*tmp*"):
        pytest.fail(f"stray temporary file {p}")
