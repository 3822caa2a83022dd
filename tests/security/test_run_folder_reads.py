"""Reading a run folder cannot hurt the machine: only regular files inside the folder, never more bytes
than the writer recorded (or the documented maximum), and a checkpoint without its digest is damaged."""

from __future__ import annotations

import logging
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import tiny_config

from raysim.engine.loop import resume_config, run
from raysim.errors import CheckpointError, ConfigError, DataError
from raysim.safeio import DIGEST_SUFFIX, MAX_FILE_BYTES, atomic_save, load_checked, read_regular
from raysim.storage.runfolder import RunFolder
from raysim.storage.store import StateStore

ROOT = Path(__file__).resolve().parents[2]
ENV = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
MEMORY_CAP = 6 << 30  # address-space limit of the resume below: torch's import maps ~2 GB; /dev/zero would need unbounded


def _cap_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_CAP, MEMORY_CAP))


@pytest.fixture(scope="module")
def finished(tmp_path_factory, cache_dir):
    """A finished 2-round run, copied afresh for each test that damages it (keeping every round's client states:
    a PromptFL client's unchanged state is otherwise written once, and the tests damage round 1's)."""
    tmp = tmp_path_factory.mktemp("finished")
    return run(tiny_config(tmp, cache_dir, train={"rounds": 2}, output={"keep_client_states": "all"})).out_dir


@pytest.fixture
def folder(finished, tmp_path):
    import shutil

    out = tmp_path / "run"
    shutil.copytree(finished, out)
    return out


def test_a_checkpoint_linked_to_dev_zero_without_its_digest_is_damaged_and_the_resume_uses_the_round_before(folder):
    ckpt = folder / "state" / "clients" / "0" / "00001.pt"
    ckpt.unlink()
    ckpt.with_name(ckpt.name + DIGEST_SUFFIX).unlink()
    ckpt.symlink_to("/dev/zero")
    # the resume runs under an address-space cap: reading /dev/zero into memory would be killed, not finish
    p = subprocess.run([sys.executable, str(ROOT / "raysim" / "run.py"), f"output.resume={folder}", "train.rounds=3"],
                       env=ENV, capture_output=True, text=True, timeout=600, preexec_fn=_cap_memory)
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr[-3000:]
    assert str(ckpt) in p.stderr and "last good round is 0" in p.stderr
    assert StateStore(folder).completed_round() == 2 and StateStore(folder).damaged(2) == []


def test_a_link_out_of_the_folder_is_refused_even_with_a_matching_digest(folder, tmp_path):
    ckpt = folder / "state" / "server" / "00001.pt"
    outside = tmp_path / "elsewhere.pt"
    outside.write_bytes(ckpt.read_bytes())
    ckpt.unlink()
    ckpt.symlink_to(outside)  # its digest still matches: only where it points gives it away
    with pytest.raises(CheckpointError, match="outside"):
        StateStore(folder).load_server(1)




def test_a_missing_digest_is_named_as_damage(folder, caplog):
    ckpt = folder / "state" / "server" / "00001.pt"
    ckpt.with_name(ckpt.name + DIGEST_SUFFIX).unlink()
    with pytest.raises(CheckpointError, match=r"has no 00001\.pt\.sha256"):
        StateStore(folder).load_server(1)
    with caplog.at_level(logging.WARNING, logger="raysim.storage.store"):
        assert StateStore(folder).resumable_round(1) == 0
    assert str(ckpt) in caplog.text and "treated as damaged" in caplog.text


def test_a_fifo_in_the_folder_is_refused_without_blocking(folder):
    ckpt = folder / "state" / "clients" / "1" / "00001.pt"
    ckpt.unlink()
    os.mkfifo(ckpt)  # opening a FIFO for reading would wait for a writer forever
    with pytest.raises(CheckpointError, match="not a regular file"):
        StateStore(folder).load_client(1, 1)


def test_a_file_larger_than_its_recorded_size_is_refused_before_it_is_read(folder):
    ckpt = folder / "state" / "server" / "00001.pt"
    size = ckpt.stat().st_size
    digest = ckpt.with_name(ckpt.name + DIGEST_SUFFIX).read_text().split()
    assert int(digest[1]) == size  # the writer records the size beside the SHA-256
    os.truncate(ckpt, size + (64 << 30))  # sparse: 64 GiB more without using the disk
    with pytest.raises(CheckpointError, match="more than the"):
        StateStore(folder).load_server(1)


def test_without_a_recorded_size_the_documented_maximum_applies(tmp_path):
    big = tmp_path / "big.bin"
    big.touch()
    os.truncate(big, MAX_FILE_BYTES + 1)  # sparse
    with pytest.raises(DataError, match=f"more than the {MAX_FILE_BYTES} bytes"):
        read_regular(big)
    small = tmp_path / "small.pt"
    atomic_save({"x": 1}, small)
    assert load_checked(small, root=tmp_path) == {"x": 1}


def test_a_config_yaml_linked_to_dev_zero_is_refused_with_exit_2(folder):
    cfg = folder / "config.yaml"
    cfg.unlink()
    cfg.symlink_to("/dev/zero")
    with pytest.raises(ConfigError, match="outside"):
        _ = RunFolder(folder).cfg
    with pytest.raises(ConfigError, match="outside"):
        resume_config(folder)
    p = subprocess.run([sys.executable, str(ROOT / "raysim" / "run.py"), f"output.resume={folder}"],
                       env=ENV, capture_output=True, text=True, timeout=300, preexec_fn=_cap_memory)
    assert p.returncode == 2 and "Traceback" not in p.stderr and "config.yaml" in p.stderr, p.stderr[-2000:]


def test_a_results_csv_linked_to_a_device_is_refused(folder):
    res = folder / "results.csv"
    res.unlink()
    res.symlink_to("/dev/zero")
    with pytest.raises(DataError, match="outside|not a regular file"):
        RunFolder(folder).utility()
