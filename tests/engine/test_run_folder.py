"""Run folders are safe and single-writer: the out_dir lock, damaged and malicious checkpoints, Ctrl-C."""

from __future__ import annotations

import csv
import hashlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import tiny_config

from raysim.engine.loop import resume_config, run
from raysim.errors import CheckpointError, RunFolderLocked
from raysim.storage.store import LOCK_NAME, RunLock, StateStore

ROOT = Path(__file__).resolve().parents[2]
ENV = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")


def rows(path: Path, drop=("seconds",)) -> list[dict[str, str]]:
    """A results file without its timing column (the only one that differs between identical runs)."""
    with open(path, newline="") as f:
        return [{k: v for k, v in r.items() if k not in drop} for r in csv.DictReader(f)]


def cli(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "raysim" / "run.py"), *args], env=ENV, capture_output=True, text=True, timeout=timeout
    )


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def write_with_digest(path: Path, obj) -> None:
    """Write a checkpoint the way a tamperer would: with a SHA-256 that matches, so only its content can give it away."""
    torch.save(obj, path)
    path.with_name(path.name + ".sha256").write_text(hashlib.sha256(path.read_bytes()).hexdigest() + "\n")


# -- one writer per folder -------------------------------------------------------------------


def test_a_second_run_or_resume_of_a_live_folder_exits_2_naming_the_holder(tmp_path, cache_dir):
    out = run(tiny_config(tmp_path, cache_dir, train={"rounds": 1})).out_dir
    assert not (out / LOCK_NAME).exists()  # released at the end of the run
    holder = subprocess.Popen(
        [sys.executable, "-c", f"import sys, time; from raysim.storage.store import RunLock; RunLock({str(out)!r}).acquire(); "
         "print('locked', flush=True); time.sleep(120)"],
        env=ENV, stdout=subprocess.PIPE, text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        info = json.loads((out / LOCK_NAME).read_text())
        assert info["pid"] == holder.pid and info["host"]
        assert RunLock(out).holder()["pid"] == holder.pid
        # a resume, from the command line and from Python
        p = cli(f"output.resume={out}", "train.rounds=2")
        assert p.returncode == 2, p.stderr
        assert f"pid {holder.pid}" in p.stderr and "Traceback" not in p.stderr
        with pytest.raises(RunFolderLocked, match=f"pid {holder.pid}"):
            run(resume_config(out, {"train": {"rounds": 2}}))
        # a new run pointed at the same folder
        cfg_file = tmp_path / "again.yaml"
        cfg_file.write_text(tiny_config(tmp_path, cache_dir, train={"rounds": 2}).to_yaml())
        p = cli("--config", str(cfg_file), f"output.out_dir={out}")
        assert p.returncode == 2 and f"pid {holder.pid}" in p.stderr and "Traceback" not in p.stderr, p.stderr
        assert [r["round"] for r in rows(out / "results.csv")] == ["0"]  # neither wrote anything
    finally:
        holder.kill()
        holder.wait()
    # the holder is gone (killed, its lock file left behind): the lock is free and the resume takes it over
    assert (out / LOCK_NAME).exists() and RunLock(out).holder() is None
    resumed = run(resume_config(out, {"train": {"rounds": 2}}))
    assert [r["round"] for r in rows(resumed.out_dir / "results.csv")] == ["0", "1"]
    assert not (out / LOCK_NAME).exists()


def test_a_stale_lock_of_a_dead_process_is_taken_over(tmp_path, cache_dir, caplog):
    out = tmp_path / "run"
    out.mkdir()
    pid = dead_pid()
    (out / LOCK_NAME).write_text(json.dumps({"pid": pid, "host": "elsewhere", "started": time.time() - 60}))
    with caplog.at_level(logging.WARNING, logger="raysim.storage.store"):
        res = run(tiny_config(tmp_path, cache_dir, train={"rounds": 1}))  # a folder holding only a lock file is not a run
    assert f"pid {pid}" in caplog.text and "taking over" in caplog.text
    assert len(rows(res.out_dir / "results.csv")) == 1 and not (out / LOCK_NAME).exists()


def test_a_failed_start_leaves_no_folder_and_no_lock(tmp_path, cache_dir):
    out = tmp_path / "deep" / "run"
    with pytest.raises(Exception, match="cifar-10"):
        run(tiny_config(tmp_path, cache_dir, data={"dataset": "cifar10", "data_root": str(tmp_path / "none")},
                        output={"out_dir": str(out)}))
    assert not (tmp_path / "deep").exists()


# -- damaged and malicious checkpoints -------------------------------------------------------


# under DP every participant's ledger changes each round, so each round has its own client checkpoints (without DP a
# PromptFL client's state never changes and is written once: test_an_unchanged_client_state_is_written_once)
DAMAGED = {"train": {"rounds": 3}, "dp": {"epsilon": 8.0}}


@pytest.fixture(scope="module")
def reference(tmp_path_factory, cache_dir):
    """An uninterrupted 3-round run: what every resume below must reproduce."""
    tmp = tmp_path_factory.mktemp("reference")
    out = run(tiny_config(tmp, cache_dir, **DAMAGED)).out_dir
    return rows(out / "results.csv"), rows(out / "client_results.csv")


def test_a_truncated_checkpoint_is_named_and_the_resume_falls_back_to_the_last_good_round(tmp_path, cache_dir, reference, caplog):
    out = run(tiny_config(tmp_path, cache_dir, **DAMAGED)).out_dir
    store = StateStore(out)
    assert store.completed_round() == 2 and store.damaged(2) == []
    cut = out / "state" / "clients" / "1" / "00002.pt"
    cut.write_bytes(cut.read_bytes()[:100])  # cut to 100 bytes
    with caplog.at_level(logging.WARNING, logger="raysim.storage.store"):
        res = run(resume_config(out))
    assert str(cut) in caplog.text and "truncated or corrupted" in caplog.text and "last good round is 1" in caplog.text
    assert (rows(res.out_dir / "results.csv"), rows(res.out_dir / "client_results.csv")) == reference  # round 2 replayed
    assert store.completed_round() == 2 and store.damaged(2) == []  # the replay rewrote the damaged file


def test_a_flipped_byte_is_caught_by_the_digest(tmp_path, cache_dir, reference, caplog):
    out = run(tiny_config(tmp_path, cache_dir, **DAMAGED)).out_dir
    f = out / "state" / "server" / "00002.pt"
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF  # inside the tensor data: the zip archive still opens, the numbers are wrong
    f.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="SHA-256"):
        StateStore(out).load_server(2)
    with caplog.at_level(logging.WARNING, logger="raysim.storage.store"):
        res = run(resume_config(out))
    assert str(f) in caplog.text and "last good round is 1" in caplog.text
    assert rows(res.out_dir / "results.csv") == reference[0]


def test_an_unchanged_client_state_is_written_once(tmp_path, cache_dir):
    """A client checkpoint identical to the client's last written version is not written again (a resume loads the
    latest version up to its round, the same state); a changed one is, each round, and every round's with
    keep_client_states=all. The results are the same either way."""
    def versions(out: Path, cid: int) -> list[str]:
        return sorted(p.name for p in (out / "state" / "clients" / str(cid)).glob("*.pt"))

    plain = run(tiny_config(tmp_path / "plain", cache_dir, train={"rounds": 3})).out_dir  # PromptFL, no DP: nothing changes
    kept = run(tiny_config(tmp_path / "kept", cache_dir, train={"rounds": 3}, output={"keep_client_states": "all"})).out_dir
    noisy = run(tiny_config(tmp_path / "noisy", cache_dir, **DAMAGED)).out_dir  # the ledger grows each round
    for cid in range(4):  # participation 1: every client takes part in rounds 0, 1, 2
        assert versions(plain, cid) == ["00000.pt"]
        assert versions(kept, cid) == ["00000.pt", "00001.pt", "00002.pt"]
        assert versions(noisy, cid) == ["00001.pt", "00002.pt"]  # round 0's pruned: a resume needs rounds 1 and 2 only
        assert StateStore(plain).load_client(cid, 2) == StateStore(kept).load_client(cid, 2)
    assert rows(plain / "results.csv") == rows(kept / "results.csv")
    assert rows(plain / "client_results.csv") == rows(kept / "client_results.csv")
    res = run(resume_config(plain, {"train": {"rounds": 4}}))  # a resume starts from the one version and writes it again once
    assert versions(res.out_dir, 0) == ["00000.pt", "00003.pt"]


def test_without_an_intact_round_the_resume_exits_2_naming_the_file(tmp_path, cache_dir):
    out = run(tiny_config(tmp_path, cache_dir, train={"rounds": 3})).out_dir
    for r in (1, 2):  # the store keeps the last two rounds of the server's state
        f = out / "state" / "server" / f"{r:05d}.pt"
        f.write_bytes(f.read_bytes()[:100])
    before = rows(out / "results.csv")
    p = cli(f"output.resume={out}", "train.rounds=4")
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert str(out / "state" / "server" / "00002.pt") in p.stderr and "truncated or corrupted" in p.stderr
    assert "No intact round" in p.stderr
    assert rows(out / "results.csv") == before and not (out / LOCK_NAME).exists()


class RunsCode:
    """Unpickling this runs a shell command: what a malicious run folder would carry."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_checkpoint_carrying_a_pickled_object_that_would_run_code_is_refused(tmp_path, cache_dir):
    out = run(tiny_config(tmp_path, cache_dir, train={"rounds": 2}, output={"record_uploads": True})).out_dir
    marker = tmp_path / "pwned"
    state = StateStore(out).load_client(0, 1)
    write_with_digest(out / "state" / "clients" / "0" / "00001.pt", {**state, "extra": RunsCode(marker)})
    p = cli(f"output.resume={out}", "train.rounds=3")
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert "could run code" in p.stderr and str(out / "state" / "clients" / "0" / "00001.pt") in p.stderr
    assert not marker.exists()
    with pytest.raises(CheckpointError, match="could run code"):
        run(resume_config(out, {"train": {"rounds": 3}}))
    # the attacks read uploads/ and state/ through the same loader
    write_with_digest(out / "uploads" / "00001.pt", {"pre": {}, "uploads": {0: RunsCode(marker)}, "num_samples": {}})
    with pytest.raises(CheckpointError, match="could run code"):
        StateStore(out).load_uploads(1)
    from raysim.attacks.update_mia import audit_run

    with pytest.raises(CheckpointError, match="could run code"):
        audit_run(out)
    assert not marker.exists()


# -- Ctrl-C ----------------------------------------------------------------------------------


def test_ctrl_c_ends_the_run_cleanly_and_resume_continues_it_identically(tmp_path, cache_dir):
    rounds = 100  # ~40 ms each: after round 1 there are seconds left for the interrupt to land mid-run
    cfg = tiny_config(tmp_path / "ref", cache_dir, train={"rounds": rounds})
    ref = run(cfg).out_dir
    out = tmp_path / "cut"
    cfg_file = tmp_path / "cut.yaml"
    cfg_file.write_text(tiny_config(tmp_path, cache_dir, train={"rounds": rounds}, output={"out_dir": str(out)}).to_yaml())
    def child() -> None:
        # Ctrl-C as a terminal sends it: a test suite started in the background by a non-interactive shell
        # inherits SIGINT ignored, and so would the run (Python then installs no KeyboardInterrupt handler);
        # and the run at a lower priority than this test, so on a loaded machine this loop sees round 1 and
        # sends the interrupt while the run still has rounds left
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.nice(10)

    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "raysim" / "run.py"), "--config", str(cfg_file)],
        env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=child,
    )
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and proc.poll() is None:
        if StateStore(out).completed_round() >= 1:  # round 1 is complete (results.csv has its row)
            break
        time.sleep(0.01)
    assert proc.poll() is None, proc.communicate()
    assert len(rows(out / "results.csv")) >= 2
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, (stdout, stderr)
    assert "Traceback" not in stderr and "interrupted" in stderr and f"resume={out}" in stderr
    done = StateStore(out).completed_round()
    assert 1 <= done < rounds - 1, "the run ended before the interrupt; nothing was tested"
    assert not (out / LOCK_NAME).exists()
    # every completed round is on record (a row past it, from a round cut short, is dropped on resume)
    assert [int(r["round"]) for r in rows(out / "results.csv")][: done + 1] == list(range(done + 1))
    p = cli(f"output.resume={out}")
    assert p.returncode == 0, p.stderr
    assert rows(out / "results.csv") == rows(ref / "results.csv")
    assert rows(out / "client_results.csv") == rows(ref / "client_results.csv")
