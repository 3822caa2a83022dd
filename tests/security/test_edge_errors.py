"""Every OS and decoding error at the edge exits 2 with one line naming the path and what to do; a full
disk mid-run stops cleanly with every completed round intact and no stray temporary file."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
from conftest import tiny_config

import raysim.safeio as safeio
from raysim.engine.loop import resume_config, run
from raysim.storage.store import StateStore
from raysim.tools.run import main as run_main


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    lines = [ln for ln in err if ln.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in "\n".join(err), err
    return lines[0]


def cli(capsys, *args: str) -> tuple[int, str]:
    rc = run_main(["execution.backend=inline", "output.progress=false", "output.tensorboard=false", *args])
    return rc, one_error_line(capsys) if rc else ""


@pytest.mark.parametrize("case", ["existing file", "under a file", "read-only", "name too long"])
def test_an_unusable_out_dir_exits_2_naming_it(tmp_path, capsys, case):
    f = tmp_path / "afile"
    f.write_text("x")
    out, want = {
        "existing file": (f, "is an existing file"),
        "under a file": (f / "run", f"lies under {f}, which is a file"),
        "read-only": (Path("/proc/sys/raysim-run"), "cannot be written (read-only or permission denied)"),
        "name too long": (tmp_path / ("n" * 5000), "choose a shorter output.out_dir"),
    }[case]
    rc, line = cli(capsys, f"output.out_dir={out}")
    assert rc == 2 and want in line and "output.out_dir" in line
    assert f.read_text() == "x" and sorted(p.name for p in tmp_path.iterdir()) == ["afile"]  # nothing written


def test_a_config_file_that_is_not_utf8_exits_2(tmp_path, capsys):
    f = tmp_path / "cfg.yaml"
    f.write_bytes(b"train:\n  ctx_init: caf\xe9\n")  # Latin-1, not UTF-8
    rc = run_main(["--config", str(f)])
    line = one_error_line(capsys)
    assert rc == 2 and str(f) in line and "not UTF-8" in line and "save it as UTF-8" in line


def test_a_5000_digit_integer_exits_2_on_the_command_line_and_in_a_file(tmp_path, capsys):
    huge = "9" * 5000
    rc, line = cli(capsys, f"train.seed={huge}")
    assert rc == 2 and "train.seed" in line and len(line) < 400  # the value is not echoed back
    f = tmp_path / "cfg.yaml"
    f.write_text(f"train:\n  seed: {huge}\n")
    rc = run_main(["--config", str(f)])
    line = one_error_line(capsys)
    assert rc == 2 and str(f) in line and len(line) < 600


def test_a_full_disk_mid_run_stops_cleanly_and_the_completed_rounds_resume(tmp_path, cache_dir, monkeypatch, capsys):
    out = tmp_path / "run"
    real = Path.write_bytes

    def disk_full_in_round_2(self: Path, data) -> int:
        if self.name.startswith(".00002.pt.tmp"):  # a round-2 checkpoint: half of it lands, then the disk is full
            real(self, bytes(data)[: len(data) // 2])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self))
        return real(self, data)

    monkeypatch.setattr(Path, "write_bytes", disk_full_in_round_2)
    cfg = tiny_config(tmp_path, cache_dir, train={"rounds": 4}, output={"out_dir": str(out)})
    with pytest.raises(OSError):
        run(cfg)
    stray = [str(p) for p in out.rglob("*") if ".tmp" in p.name]
    assert stray == []
    store = StateStore(out)
    assert store.completed_round() == 1 and store.damaged(1) == []
    # through the command line the same failure is one line naming the file and what to do, exit 2
    rc, line = cli(capsys, f"output.resume={out}")
    assert rc == 2 and "No space left on device" in line and "free some space" in line and f"output.resume={out}" in line
    assert [p for p in out.rglob("*") if ".tmp" in p.name] == [] and store.completed_round() == 1
    monkeypatch.setattr(Path, "write_bytes", real)
    res = run(resume_config(out))
    assert store.completed_round() == 3 and len(res.rounds) == 2


def test_atomic_save_leaves_no_temporary_file_when_the_write_fails(tmp_path, monkeypatch):
    def fail(self, data):
        Path.write_text(self, "partial")
        raise OSError(errno.ENOSPC, "No space left on device", str(self))

    monkeypatch.setattr(Path, "write_bytes", fail)
    with pytest.raises(OSError):
        safeio.atomic_save({"x": 1}, tmp_path / "a.pt")
    assert list(tmp_path.iterdir()) == []
